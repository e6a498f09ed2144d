"""Old code against new, paired per prompt and seed over several seeds of deterministic replays
(`evals/replay.py` folders named <regime>-s<seed>): per regime, the geometric mean over (prompt,
seed) of the new rate over the old (rate = new tokens / modelled seconds), overall and per category.
Sampled paths differ between the two codes, so a pair still carries path noise; pooling seeds
shrinks it. Reads replay.jsonl files only (no torch).

    python evals/paired_replays.py OLD_ROOT NEW_ROOT --regimes bf16 packed accel --seeds 0 1 2 3
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path


def load(folder: Path) -> dict[str, dict] | None:
    path = folder / "replay.jsonl"
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())} if path.exists() else None


def paired(old_root: Path, new_root: Path, regime: str, seeds: list[int]) -> tuple[list[int], dict[str, list[float]]]:
    """(the seeds both roots have, per category the new/old rate ratios)."""
    used, ratios = [], defaultdict(list)
    for seed in seeds:
        old, new = load(old_root / f"{regime}-s{seed}"), load(new_root / f"{regime}-s{seed}")
        if not old or not new:
            continue
        used.append(seed)
        for key in sorted(old.keys() & new.keys()):
            rate = lambda r: r["new_tokens"] / r["modelled_seconds"]  # noqa: E731
            ratios[new[key]["category"]].append(rate(new[key]) / rate(old[key]))
    return used, ratios


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--regimes", nargs="+", default=["bf16", "packed", "accel"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    args = parser.parse_args(argv)
    print("| regime | seeds | pairs | new / old overall | per category |\n|---|---|---|---|---|")
    for regime in args.regimes:
        used, ratios = paired(args.old, args.new, regime, args.seeds)
        if not ratios:
            continue
        every = [r for values in ratios.values() for r in values]
        cells = ", ".join(f"{c} {geomean(v):.3f}" for c, v in sorted(ratios.items()))
        print(f"| {regime} | {','.join(map(str, used))} | {len(every)} | {geomean(every):.3f} | {cells} |")


if __name__ == "__main__":
    main()
