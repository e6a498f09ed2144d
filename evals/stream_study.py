"""A stream of prompts: continuous batching with speculation against static batches.

    python evals/stream_study.py --threads 2 --out runs/stream          # real pair, 32 prompts: ~25 min on 2 CPU cores
    python evals/stream_study.py --target tiny --draft tiny --prompts 8 --max-batch-size 4 --out runs/tiny-stream

A serving trace: `--prompts` short prompts mixed across categories (as in batch_study.py), each with
its own output budget drawn uniformly from [--min-new-tokens, --max-new-tokens] (seeded), greedy.
Methods, one after the other over the whole stream (the machine is shared: read ratios, and expect a
few percent of drift between methods that a per-prompt interleave would cancel):

* `plain_static`: transformers' generate on static batches of `--max-batch-size` in arrival order,
  each run to the largest budget in the batch (one max_new_tokens per call), every row cut to its
  own budget or EOS: the rows that finished early wait for the longest.
* `hf_specdec_static`: the same batches through hf_specdec's speculative_generate.
* `hf_specdec_continuous`: `hf_specdec.generate_continuous`, at most `--max-batch-size` rows: a row
  leaves when it reaches its budget or EOS and the next prompt joins at once.
* `continuous_no_speculation`: the same continuous batching with the draft priced out (pinned
  `costs=hf_specdec.Costs(draft_step=1e3)`) and lookup off (plain steps for every row, but for the
  planner's occasional probes of the draft): what continuous batching alone buys.
* `transformers_continuous`: transformers' own continuous batching (its manager, each request with
  its budget, at most `--max-batch-size` requests a batch), when it runs on this machine (no speculation).

Throughput counts each prompt's useful tokens (to its budget, through EOS) over the method's wall
time for the whole stream. Every greedy output is checked against plain's; a mismatch is reported with
the top-two logit margin where it first differs (bf16 ties). Writes <out>/stream.json, .md, .png.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # evals/ is a folder of scripts, not a package

import hf_specdec  # noqa: E402
from batch_study import BATCH_CATEGORIES, batch_prompts, divergences, left_pad, length_distribution  # noqa: E402
from common import add_options, apply_threads, hf_draft, load_pair  # noqa: E402


def useful(tokens: list[int], budget: int, eos_id) -> list[int]:
    """A row's output cut to its budget, through its first EOS."""
    tokens = tokens[:budget]
    if eos_id is not None and eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id) + 1]
    return tokens


def run_static(target, prompts, budgets, size, pad_id, eos_id, spec: dict | None) -> tuple[list[list[int]], float, list]:
    """(outputs per prompt, seconds, records): static batches of `size` in arrival order."""
    outputs, records, seconds = [], [], 0.0
    for start in range(0, len(prompts), size):
        chunk, own = prompts[start : start + size], budgets[start : start + size]
        ids, mask = left_pad(chunk, pad_id, target.device)
        kwargs = dict(max_new_tokens=max(own), do_sample=False, pad_token_id=pad_id, attention_mask=mask)
        if spec is not None:
            kwargs.update(spec, custom_generate=hf_specdec.speculative_generate, acceptance_sink=records.append)
        began = time.perf_counter()
        out = target.generate(ids, **kwargs)
        seconds += time.perf_counter() - began
        outputs += [useful(row.tolist(), b, eos_id) for row, b in zip(out[:, ids.shape[1] :], own)]
    return outputs, seconds, records


def run_continuous(target, draft, prompts, budgets, size, eos_id, **levers) -> tuple[list[list[int]], float, list, dict]:
    records = []
    items = [{"input_ids": p, "max_new_tokens": b} for p, b in zip(prompts, budgets)]
    began = time.perf_counter()
    results = hf_specdec.generate_continuous(target, items, assistant=draft, max_batch_size=size, do_sample=False,
                                             max_new_tokens=max(budgets), acceptance_sink=records.append, progress=True,
                                             **levers)
    seconds = time.perf_counter() - began
    rounds = {}
    for r in records:
        rounds[r.round] = rounds.get(r.round, 0) + 1
    occupancy = list(rounds.values())
    extra = dict(rounds=len(rounds), mean_rows_per_round=sum(occupancy) / max(1, len(occupancy)),
                 longest_cache=max((r.cache_length for r in records), default=0))
    return [useful(r.tokens.tolist(), b, eos_id) for r, b in zip(results, budgets)], seconds, records, extra


def run_transformers_continuous(
    target, prompts, budgets, size, eos_id, pad_id, limit: float
) -> tuple[list[list[int]], float]:
    """transformers' continuous batching manager (public API), each request with its own budget, at
    most `size` requests a batch (`ContinuousBatchingConfig.max_requests_per_batch`)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(budgets), eos_token_id=eos_id, pad_token_id=pad_id)
    manager = target.init_continuous_batching(
        generation_config=config, continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=size))
    manager.start()
    try:
        manager.add_request(prompts[0], request_id="warm-up", max_new_tokens=4)  # its set-up is not timed
        while (result := manager.get_result(timeout=600)) is not None and not result.is_finished():
            pass
        began = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=b) for i, (p, b) in enumerate(zip(prompts, budgets))]
        done = {}
        while len(done) < len(ids):
            if time.perf_counter() - began > limit:
                raise TimeoutError(f"{len(done)} of {len(ids)} requests done after {limit:.0f} s (--transformers-limit)")
            result = manager.get_result(timeout=limit)
            if result is None:
                raise RuntimeError("transformers' continuous batching returned no result")
            if result.is_finished():
                done[result.request_id] = list(result.generated_tokens)
    finally:
        manager.stop(block=True)
    seconds = time.perf_counter() - began
    return [useful(done[i], b, eos_id) for i, b in zip(ids, budgets)], seconds


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r["method"] for r in rows]
    values = [r["tokens_per_s"] for r in rows]
    bars = ax.barh(names, values)
    for bar, r in zip(bars, rows):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['ratio']:.2f}x", va="center", fontsize=8)
    ax.set_xlabel("useful generated tokens / s (whole stream)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: argparse.Namespace) -> None:
    apply_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, draft, tokenizer = load_pair(args.target, args.draft, device, pack=args.pack, draft_bits=args.draft_bits)
    draft = hf_draft(draft, args.draft_bits)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_id = tokenizer.eos_token_id
    chosen = batch_prompts(tokenizer, args.categories, args.prompts)
    prompts = [p["input_ids"] for p in chosen]
    rng = random.Random(args.seed)
    budgets = [rng.randint(args.min_new_tokens, args.max_new_tokens) for _ in prompts]
    target.generate(torch.tensor([prompts[0]], device=target.device), max_new_tokens=4)  # warm-up
    size, spec = args.max_batch_size, dict(assistant=draft)

    runs = {}
    plain, seconds, _ = run_static(target, prompts, budgets, size, pad_id, eos_id, None)
    runs["plain_static"] = dict(outputs=plain, seconds=seconds)
    outputs, seconds, records, extra = run_continuous(target, draft, prompts, budgets, size, eos_id)
    runs["hf_specdec_continuous"] = dict(outputs=outputs, seconds=seconds, lengths=length_distribution(records), **extra)
    if not args.skip_no_speculation:
        outputs, seconds, _, extra = run_continuous(target, draft, prompts, budgets, size, eos_id, ngram=False,
                                                   costs=hf_specdec.Costs(draft_step=1e3))
        runs["continuous_no_speculation"] = dict(outputs=outputs, seconds=seconds, **extra)
    if not args.skip_static_spec:
        outputs, seconds, records = run_static(target, prompts, budgets, size, pad_id, eos_id, spec)
        runs["hf_specdec_static"] = dict(outputs=outputs, seconds=seconds, lengths=length_distribution(records))
    if not args.skip_transformers:
        try:
            outputs, seconds = run_transformers_continuous(target, prompts, budgets, size, eos_id, pad_id, args.transformers_limit)
            runs["transformers_continuous"] = dict(outputs=outputs, seconds=seconds)
        except Exception as error:  # recorded, not hidden: the study still reports the others
            runs["transformers_continuous"] = dict(error=f"{type(error).__name__}: {error}")
            print(f"transformers' continuous batching did not run: {error}")

    base = sum(map(len, plain)) / runs["plain_static"]["seconds"]
    rows = []
    for name, run in runs.items():
        if "error" in run:
            rows.append(dict(method=name, error=run["error"]))
            continue
        tokens = sum(map(len, run["outputs"]))
        rows.append(dict(
            method=name, tokens=tokens, seconds=run["seconds"], tokens_per_s=tokens / run["seconds"],
            ratio=tokens / run["seconds"] / base,
            mismatches=[] if name == "plain_static" else divergences(target, prompts, plain, run["outputs"]),
            **{k: v for k, v in run.items() if k not in ("outputs", "seconds")},
        ))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items()} | dict(torch_threads=torch.get_num_threads(), budgets=budgets,
                                                          prompt_ids=[p["id"] for p in chosen])
    (out / "stream.json").write_text(json.dumps(dict(config=config, rows=rows), indent=2))
    lines = [f"# A stream of {len(prompts)} prompts, budgets {args.min_new_tokens}-{args.max_new_tokens} new tokens, "
             f"at most {size} rows (greedy)", "",
             "| method | useful tokens | seconds | tokens / s | over plain static | greedy mismatches: prompt @position (top-two margin in bf16 steps) | notes |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | - | - | - | - | - | did not run: {r['error'][:120]} |")
            continue
        found = "; ".join(f"p{m['prompt']} @{m['position']} ({m['bf16_steps']:.0f})" for m in r["mismatches"]) or "none"
        notes = []
        if "mean_rows_per_round" in r:
            notes.append(f"{r['rounds']} rounds, {r['mean_rows_per_round']:.1f} rows a round, longest cache {r['longest_cache']}")
        if r.get("lengths"):
            d = r["lengths"]
            notes.append(f"row length mean {d['mean']:.1f}, at 0 {d['zero_share']:.0%}, "
                         + ", ".join(f"{k} {v:.0%}" for k, v in d["source_share"].items()))
        lines.append(f"| {r['method']} | {r['tokens']} | {r['seconds']:.1f} | {r['tokens_per_s']:.2f} | {r['ratio']:.2f}x | "
                     f"{found} | {'; '.join(notes)} |")
    lines += ["", "![stream](stream.png)", ""]
    (out / "stream.md").write_text("\n".join(lines))
    plot([r for r in rows if "error" not in r], out / "stream.png")
    print("\n".join(lines))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, "target", "draft")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--min-new-tokens", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="seed of the budgets")
    add_options(parser, "pack", "draft_bits", "threads")
    parser.add_argument("--skip-static-spec", action="store_true", help="leave out hf_specdec on static batches")
    parser.add_argument("--skip-no-speculation", action="store_true", help="leave out continuous batching without speculation")
    parser.add_argument("--skip-transformers", action="store_true", help="leave out transformers' continuous batching")
    parser.add_argument("--transformers-limit", type=float, default=900, help="seconds before transformers' run is given up")
    add_options(parser, out="runs/stream")
    parser.add_argument("--categories", nargs="+", default=list(BATCH_CATEGORIES), choices=BATCH_CATEGORIES, metavar="CATEGORY")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
