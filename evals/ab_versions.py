"""Old code against new code on the real pair, interleaved per prompt in one process.

    python evals/ab_versions.py --baseline HEAD --preset quick --out runs/ab      # ~10 min on 2 cores

A refactor must not slow decoding down. This script exports the library as it was at a git revision
(`--baseline`) into a temporary folder as the package `hf_specdec_baseline`, and runs, for every
prompt of the preset and both modes (greedy; T = 0.7, top-p 0.95): plain decoding, the baseline
and the working tree's hf_specdec, interleaved (plain, baseline, current; the order of the last two
alternates between prompts), with the library defaults and the int8 draft both use. Speedup is
tokens/s over plain tokens/s on the same prompt and mode; the report gives the per-category
speedups of both versions, their ratio current / baseline, and the geometric means.

Timings on a shared 2-core machine move 10-30% between runs; read the geometric mean of the ratio,
not a single cell.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_specdec  # noqa: E402
from common import (  # noqa: E402
    CATEGORIES, MODES, add_options, drafts_by_precision, geometric_mean, import_baseline, load_pair, load_prompts,
)

PRESETS = {"quick": (1, 64), "standard": (3, 64)}  # prompts per category, new tokens


def timed(target, ids, **kwargs) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return (out.sequences if hasattr(out, "sequences") else out), time.perf_counter() - start


def run(config: argparse.Namespace) -> dict:
    from tqdm.auto import tqdm

    torch.set_num_threads(config.threads) if config.threads else None
    per_category, new_tokens = PRESETS[config.preset]
    with tempfile.TemporaryDirectory() as folder:
        versions = {"baseline": import_baseline(config.baseline, Path(folder)), "current": hf_specdec}
        target, draft, tokenizer = load_pair(config.target, config.draft, "cpu")
        draft = drafts_by_precision(draft, config.draft_bits)["hf"]
        prompts = load_prompts(tokenizer, CATEGORIES, per_category)
        records = []
        for index, prompt in enumerate(tqdm(prompts, desc="prompts")):
            ids = torch.tensor([prompt["input_ids"]])
            if index == 0:  # warm-up of every path
                for lib in versions.values():
                    timed(target, ids, max_new_tokens=4, custom_generate=lib.speculative_generate, assistant=draft)
            for mode, mode_kwargs in MODES.items():
                common = dict(max_new_tokens=new_tokens, **mode_kwargs)
                torch.manual_seed(index)
                plain, plain_s = timed(target, ids, **common)
                order = list(versions) if index % 2 == 0 else list(reversed(versions))
                for name in order:
                    torch.manual_seed(index)
                    seqs, seconds = timed(target, ids, **common, custom_generate=versions[name].speculative_generate,
                                          assistant=draft)
                    n, n_plain = seqs.shape[1] - ids.shape[1], plain.shape[1] - ids.shape[1]
                    records.append(dict(id=prompt["id"], category=prompt["category"], mode=mode, version=name,
                                        new_tokens=n, seconds=seconds, plain_new_tokens=n_plain, plain_seconds=plain_s,
                                        speedup=(n / seconds) / (n_plain / plain_s),
                                        matches_plain=bool(torch.equal(seqs, plain)) if mode == "greedy" else None))
    return summarise(records, config)


def summarise(records: list[dict], config: argparse.Namespace) -> dict:
    table, summary = [], {}
    for mode in MODES:
        rows = {}
        for category in CATEGORIES:
            cell = {v: [r["speedup"] for r in records if (r["mode"], r["category"], r["version"]) == (mode, category, v)]
                    for v in ("baseline", "current")}
            if cell["baseline"]:
                rows[category] = {v: statistics.median(xs) for v, xs in cell.items()}
        gm = {v: geometric_mean([r[v] for r in rows.values()]) for v in ("baseline", "current")}
        summary[mode] = dict(categories=rows, geomean=gm, ratio=gm["current"] / gm["baseline"])
        table += [f"## {mode}", "", "| category | baseline | current | current / baseline |", "| --- | --- | --- | --- |"]
        table += [f"| {c} | {r['baseline']:.2f}x | {r['current']:.2f}x | {r['current'] / r['baseline']:.2f} |"
                  for c, r in rows.items()]
        table += [f"| geomean | {gm['baseline']:.2f}x | {gm['current']:.2f}x | {gm['current'] / gm['baseline']:.2f} |", ""]
    greedy = [r for r in records if r["mode"] == "greedy"]
    table.append("greedy outputs identical to plain: " + ", ".join(
        f"{v} {sum(r['matches_plain'] for r in greedy if r['version'] == v)}/{sum(r['version'] == v for r in greedy)}"
        for v in ("baseline", "current")))
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "summary.json").write_text(json.dumps(dict(config=vars(config), summary=summary), indent=2))
    (out / "summary.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="HEAD", help="git revision of the old code")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    add_options(parser, "target", "draft", "draft_bits", threads=2, out="runs/ab")
    run(parser.parse_args())
