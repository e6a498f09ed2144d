"""Two methods of one eval run compared prompt by prompt: the geometric mean of per-prompt speed
ratios (A's tokens per second over B's), wall-clock and modelled, with a bootstrap 90% interval
(prompts resampled within categories, 2000 draws, seed 0), and per category.

    python evals/paired.py runs/x/records.jsonl hf_specdec hf_chain
    python evals/paired.py runs/x/records.jsonl hf_specdec prompt_lookup --mode greedy

Both methods ran on the same prompts in the same run, interleaved per prompt, so a slow spell of a
shared machine hits both: a paired ratio is far less noisy than two category medians set side by
side (their 90% intervals are often 20-40% wide on 5 prompts). Reads the records only (no torch).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import defaultdict
from pathlib import Path


def paired_ratios(records: list[dict], a: str, b: str, mode: str | None = None) -> dict[str, list[tuple[float, float | None]]]:
    """Per category, per prompt (and mode) where both ran without error: (wall ratio, modelled ratio
    or None), each A's speed over B's."""
    by_prompt: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in records:
        if "error" not in r and (mode is None or r["mode"] == mode):
            by_prompt[(r["id"], r["mode"])][r["method"]] = r
    out: dict[str, list[tuple[float, float | None]]] = defaultdict(list)
    for methods in by_prompt.values():
        if a in methods and b in methods:
            ra, rb = methods[a], methods[b]
            wall = (ra["new_tokens"] / ra["seconds"]) / (rb["new_tokens"] / rb["seconds"])
            modelled = None
            if ra.get("modelled_seconds") and rb.get("modelled_seconds"):
                modelled = (ra["new_tokens"] / ra["modelled_seconds"]) / (rb["new_tokens"] / rb["modelled_seconds"])
            out[ra["category"]].append((wall, modelled))
    return dict(out)


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def interval(groups: list[list[float]], draws: int = 2000, level: float = 0.9, seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of the geometric mean of all values, resampling within each group."""
    rng, stats = random.Random(seed), []
    for _ in range(draws):
        stats.append(geomean([rng.choice(g) for g in groups for _ in g]))
    stats.sort()
    tail = (1 - level) / 2
    return stats[int(tail * draws)], stats[min(draws - 1, int((1 - tail) * draws))]


def compare(records: list[dict], a: str, b: str, mode: str | None = None) -> dict:
    """{"prompts", "wall": (geomean, low, high), "modelled": (...) or None, "categories": {c: (wall, modelled)}}."""
    ratios = paired_ratios(records, a, b, mode)
    if not ratios:
        raise SystemExit(f"no prompt on which both {a} and {b} ran" + (f" in {mode} mode" if mode else ""))
    result = dict(prompts=sum(len(v) for v in ratios.values()), categories={})
    for kind, index in (("wall", 0), ("modelled", 1)):
        groups = [[pair[index] for pair in pairs] for pairs in ratios.values()]
        if any(v is None for g in groups for v in g):
            result[kind] = None
            continue
        result[kind] = (geomean([v for g in groups for v in g]), *interval(groups))
    for category, pairs in ratios.items():
        modelled = [m for _, m in pairs]
        result["categories"][category] = (geomean([w for w, _ in pairs]), None if None in modelled else geomean(modelled))
    return result


def render(result: dict, a: str, b: str) -> str:
    def cell(value):
        return "-" if value is None else f"{value[0]:.3f} [{value[1]:.3f}, {value[2]:.3f}]"

    lines = [f"{a} / {b}, paired over {result['prompts']} prompts: wall {cell(result['wall'])}, "
             f"modelled {cell(result['modelled'])}"]
    lines += [f"  {c}: wall {w:.3f}, modelled " + ("-" if m is None else f"{m:.3f}") for c, (w, m) in result["categories"].items()]
    return "\n".join(lines)


def main(path, a: str, b: str, mode: str | None = None) -> str:
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    text = render(compare(records, a, b, mode), a, b)
    print(text)
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", help="records.jsonl written by evals/run_eval.py")
    parser.add_argument("a", help="the method whose speed is the numerator")
    parser.add_argument("b", help="the method it is compared with")
    parser.add_argument("--mode", default=None, help="greedy or sampling (default: both, each prompt and mode a pair)")
    args = parser.parse_args()
    main(args.records, args.a, args.b, args.mode)
