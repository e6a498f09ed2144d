"""Batched throughput: plain batched decoding against hf_specdec at several batch sizes, greedy and sampling.

    python evals/batch_study.py --out runs/batch     # real pair, batch 1-16, both modes, 16 prompts a size: ~40 min on 2 CPU cores
    python evals/batch_study.py --target tiny --draft tiny --batch-sizes 1 2 4 --max-new-tokens 10 --out runs/tiny-batch

Short prompts (Spec-Bench's shorter tasks and HumanEval), round-robin over the categories so that
every batch mixes them. At each batch size the prompts (`--prompts-per-size`, or the batch size if
larger) are cut into batches, left-padded, and each batch runs plain decoding then hf_specdec
(interleaved batch by batch; sampling: T = 0.7, top-p 0.95, both seeded alike). Throughput counts
each row's generated tokens up to and including its EOS; the padding after a finished row is not
work. Greedy: checks that every batched hf_specdec output equals plain batched greedy. Also records
the per-row proposal lengths (each row's tokens proposed per round, 0 = a plain step for that row)
and their sources. Writes <out>/batch_throughput.json, .md and .png (throughput against batch size)
after every cell, so a run stopped early keeps the cells it finished (`complete` in the json says
whether it ran to the end). Each cell also gives the spread of its per-batch ratios.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # evals/ is a folder of scripts, not a package

import hf_specdec  # noqa: E402
from common import add_options, apply_threads, draft_length, hf_draft, load_pair, load_prompts, speedup_over_plain  # noqa: E402

BATCH_CATEGORIES = ("mt_bench", "translation", "qa", "math_reasoning", "humaneval")  # short prompts


def batch_prompts(tokenizer, categories, count: int) -> list[dict]:
    """`count` prompts, round-robin over `categories` so that every batch mixes them."""
    prompts = load_prompts(tokenizer, categories, math.ceil(count / len(categories)))
    by_category = [[p for p in prompts if p["category"] == c] for c in categories]
    return [p for group in itertools.zip_longest(*by_category) for p in group if p is not None][:count]


def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (len(rows), longest row): each row right-aligned, as
    decoder-only generation needs (the next token is read at the last position of every row)."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def _trim(row: torch.Tensor, eos_id, pad_id) -> list[int]:
    """A row's generated tokens through its EOS (or without its trailing padding)."""
    return row.tolist()[: _generated_length(row, eos_id, pad_id)]


def _generated_length(row: torch.Tensor, eos_id, pad_id) -> int:
    """row: (new,) one row's generated tokens. Up to and including its EOS, else up to its padding."""
    tokens = row.tolist()
    if eos_id is not None and eos_id in tokens:
        return tokens.index(eos_id) + 1
    while tokens and tokens[-1] == pad_id:
        tokens.pop()
    return len(tokens)


MODES = {"greedy": dict(do_sample=False), "sampling": dict(do_sample=True, temperature=0.7, top_p=0.95)}


def _timed_generate(target, ids, mask, pad_id, max_new_tokens, mode: dict, spec: dict | None, seed: int):
    """(sequences (batch, width + new), seconds, AcceptanceStats or None): plain decoding when `spec`
    is None, else hf_specdec with the keyword arguments in `spec`. ids, mask: (batch, width)."""
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=pad_id, **mode)
    if spec is not None:
        kwargs.update(spec, custom_generate=hf_specdec.speculative_generate, return_dict_in_generate=True)
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = target.generate(ids, attention_mask=mask, **kwargs)
    seconds = time.perf_counter() - start
    return (out, seconds, None) if spec is None else (out.sequences, seconds, out.acceptance)


def divergences(target, prompts: list[list[int]], reference: list[list[int]], outputs: list[list[int]]) -> list[dict]:
    """Where each of `outputs` first leaves `reference` (plain greedy's generated tokens), with the
    top-two logit margin of an unbatched target forward there (0 or one bf16 step: a rounding tie)."""
    from hf_specdec.diagnostics import bf16_step, first_divergence, top_two_margin

    found = []
    for i, (prompt, ref, out) in enumerate(zip(prompts, reference, outputs)):
        j = first_divergence(torch.tensor(ref, dtype=torch.long), torch.tensor(out, dtype=torch.long))
        if j is None:
            continue
        with torch.no_grad():
            logits = target(torch.tensor([prompt + ref[:j]], device=target.device)).logits[0, -1]
        margin, top = top_two_margin(logits), float(logits.float().max())
        found.append(dict(prompt=i, position=j, margin=margin, bf16_steps=margin / bf16_step(top)))
    return found


def length_distribution(records) -> dict:
    """Per-row proposal lengths over every row-round: mean, share at 0, quantiles, share by source."""
    lengths = sorted(len(r.draft_tokens) for r in records)
    if not lengths:
        return {}
    sources = {}
    for r in records:
        sources[r.source] = sources.get(r.source, 0) + 1
    pick = lambda q: lengths[min(len(lengths) - 1, int(q * len(lengths)))]  # noqa: E731
    return dict(row_rounds=len(lengths), mean=sum(lengths) / len(lengths), zero_share=lengths.count(0) / len(lengths),
                p50=pick(0.5), p90=pick(0.9), max=lengths[-1],
                source_share={k: v / len(lengths) for k, v in sorted(sources.items())})


def batch_throughput(target, draft, tokenizer, prompts, batch_sizes, max_new_tokens, num_draft_tokens,
                     modes=("greedy",), prompts_per_size: int | None = None, on_row=None,
                     variant: dict | None = None) -> list[dict]:
    """Throughput (generated tokens / second) of plain batched decoding and hf_specdec at each batch
    size and mode, over the same prompts, the two interleaved batch by batch. Each cell also keeps
    the ratio of every batch on its own (`batch_ratios`): their spread is the noise a one-run cell
    carries. `on_row(rows)`, if given, is called with the rows so far after each cell. `variant`:
    hf_specdec's keyword arguments changed for a third method run right after it on every batch (an
    A/B of one lever in the same run: row["variant"])."""
    from tqdm.auto import tqdm

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    spec = dict(assistant=draft)
    if num_draft_tokens is not None:
        spec["num_draft_tokens"] = num_draft_tokens
    rows = []
    for mode_name in modes:
        mode = MODES[mode_name]
        for size in batch_sizes:
            count = len(prompts) if not prompts_per_size else max(size, min(prompts_per_size, len(prompts)))
            methods = [("plain", None), ("hf_specdec", dict(spec))]
            if variant:
                methods.append(("variant", _with_settings(spec, variant)))
            tokens, seconds = {m: 0 for m, _ in methods}, {m: 0.0 for m, _ in methods}
            match, acceptance, records, diverged, batch_ratios = True, [], [], [], []
            variant_acceptance, variant_records, variant_match, variant_ratios = [], [], True, []
            chunks = [prompts[i : i + size] for i in range(0, count - size + 1, size)]
            for n, chunk in enumerate(tqdm(chunks, desc=f"{mode_name} batch {size}")):
                ids, mask = left_pad([p["input_ids"] for p in chunk], pad_id, target.device)
                outputs, this_batch = {}, {}
                for method, kwargs in methods:
                    if kwargs is not None:
                        kwargs = dict(kwargs, acceptance_sink=(records if method == "hf_specdec" else variant_records).append)
                    seqs, took, stats = _timed_generate(target, ids, mask, pad_id, max_new_tokens, mode, kwargs, seed=n)
                    new = seqs[:, ids.shape[1] :]  # (batch, new)
                    made = sum(_generated_length(row, tokenizer.eos_token_id, pad_id) for row in new)
                    tokens[method] += made
                    seconds[method] += took
                    this_batch[method] = (made, took)
                    outputs[method] = seqs
                    if stats is not None:
                        (acceptance if method == "hf_specdec" else variant_acceptance).append(stats)
                batch_ratios.append(speedup_over_plain(*this_batch["hf_specdec"], *this_batch["plain"]))
                if variant:
                    variant_ratios.append(speedup_over_plain(*this_batch["variant"], *this_batch["hf_specdec"]))
                    if mode_name == "greedy" and not torch.equal(outputs["plain"], outputs["variant"]):
                        variant_match = False
                if mode_name == "greedy" and not torch.equal(outputs["plain"], outputs["hf_specdec"]):
                    match = False
                    rows_new = [[_trim(row, tokenizer.eos_token_id, pad_id) for row in outputs[m][:, ids.shape[1]:]]
                                for m in ("plain", "hf_specdec")]
                    for d in divergences(target, [p["input_ids"] for p in chunk], *rows_new):
                        diverged.append(dict(d, prompt=chunk[d["prompt"]]["id"]))
            merged = functools.reduce(hf_specdec.AcceptanceStats.merge, acceptance)
            rows.append(dict(
                mode=mode_name, batch_size=size, prompts=len(chunks) * size,
                plain_tokens_per_s=tokens["plain"] / seconds["plain"],
                hf_specdec_tokens_per_s=tokens["hf_specdec"] / seconds["hf_specdec"],
                ratio=speedup_over_plain(tokens["hf_specdec"], seconds["hf_specdec"], tokens["plain"], seconds["plain"]),
                acceptance_rate=merged.acceptance_rate, all_match_plain=bool(match) if mode_name == "greedy" else None,
                mismatches=diverged if mode_name == "greedy" else None,
                lengths=length_distribution(records), batch_ratios=batch_ratios,
            ))
            if variant:
                rows[-1]["variant"] = dict(
                    settings=variant, tokens_per_s=tokens["variant"] / seconds["variant"],
                    ratio=speedup_over_plain(tokens["variant"], seconds["variant"], tokens["plain"], seconds["plain"]),
                    over_hf_specdec=speedup_over_plain(tokens["variant"], seconds["variant"], tokens["hf_specdec"], seconds["hf_specdec"]),
                    batch_ratios_over_hf_specdec=variant_ratios,
                    acceptance_rate=functools.reduce(hf_specdec.AcceptanceStats.merge, variant_acceptance).acceptance_rate,
                    all_match_plain=bool(variant_match) if mode_name == "greedy" else None,
                    lengths=length_distribution(variant_records))
            if on_row is not None:
                on_row(rows)
    return rows


def batch_table(rows) -> str:
    lines = ["| mode | batch size | prompts | plain tok/s | hf_specdec tok/s | hf_specdec / plain | per batch (min-max) | "
             "acceptance | row length mean / p50 / p90 | rows at 0 | rows by source | greedy match |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        d = r.get("lengths") or {}
        shares = ", ".join(f"{k} {v:.0%}" for k, v in d.get("source_share", {}).items())
        match = "-" if r.get("all_match_plain") is None else "yes" if r["all_match_plain"] else (
            "NO: " + ", ".join(f"{m['prompt']} @{m['position']} {m['bf16_steps']:.0f} bf16 steps" for m in r.get("mismatches") or []))
        lengths = f"{d['mean']:.1f} / {d['p50']} / {d['p90']}" if d else "-"
        zero = f"{d['zero_share']:.0%}" if d else "-"
        per_batch = r.get("batch_ratios") or []
        spread = (f"{min(per_batch):.2f}-{max(per_batch):.2f}x ({len(per_batch)})" if len(per_batch) > 1
                  else "one batch" if per_batch else "-")
        lines.append(f"| {r.get('mode', 'greedy')} | {r['batch_size']} | {r['prompts']} | {r['plain_tokens_per_s']:.2f} | "
                     f"{r['hf_specdec_tokens_per_s']:.2f} | {r['ratio']:.2f}x | {spread} | {r['acceptance_rate']:.2f} | {lengths} | "
                     f"{zero} | {shares} | {match} |")
    return "\n".join(lines)


def _with_settings(spec: dict, settings: dict) -> dict:
    """hf_specdec's keyword arguments with `settings` changed (each a speculative_generate argument:
    every SpeculativeConfig field is one)."""
    import inspect

    named = {name for name, parameter in inspect.signature(hf_specdec.speculative_generate).parameters.items()
             if parameter.kind is not inspect.Parameter.VAR_KEYWORD}
    unknown = sorted(set(settings) - named)
    if unknown:
        raise ValueError(f"--variant: {', '.join(unknown)} is not a speculative_generate argument")
    return dict(spec, **settings)


def variant_table(rows) -> str:
    """The `--variant` A/B, if run: the variant against plain and against hf_specdec, per cell."""
    mine = [r for r in rows if r.get("variant")]
    if not mine:
        return ""
    settings = ", ".join(f"{k}={v}" for k, v in mine[0]["variant"]["settings"].items())
    lines = [f"Variant ({settings}), run right after hf_specdec on every batch:", "",
             "| mode | batch size | variant tok/s | variant / plain | variant / hf_specdec | per batch (min-max) | "
             "acceptance | row length mean | rows at 0 | greedy match |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in mine:
        v, d = r["variant"], r["variant"].get("lengths") or {}
        per = v["batch_ratios_over_hf_specdec"]
        spread = f"{min(per):.2f}-{max(per):.2f}x ({len(per)})" if len(per) > 1 else "one batch"
        match = "-" if v["all_match_plain"] is None else "yes" if v["all_match_plain"] else "NO"
        lines.append(f"| {r['mode']} | {r['batch_size']} | {v['tokens_per_s']:.2f} | {v['ratio']:.2f}x | {v['over_hf_specdec']:.2f}x | "
                     f"{spread} | {v['acceptance_rate']:.2f} | {d.get('mean', 0):.1f} | {d.get('zero_share', 0):.0%} | {match} |")
    return "\n".join(lines)


def plot_throughput(rows, path: Path) -> None:
    """Tokens per second against batch size, plain and hf_specdec, one panel per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r.get("mode", "greedy") for r in rows))
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        mine = [r for r in rows if r.get("mode", "greedy") == mode]
        sizes = [r["batch_size"] for r in mine]
        ax.plot(sizes, [r["plain_tokens_per_s"] for r in mine], "o-", label="plain batched")
        ax.plot(sizes, [r["hf_specdec_tokens_per_s"] for r in mine], "s-", label="hf_specdec")
        if all(r.get("variant") for r in mine):
            ax.plot(sizes, [r["variant"]["tokens_per_s"] for r in mine], "^--", label="hf_specdec variant")
        for r in mine:
            ax.annotate(f"{r['ratio']:.2f}x", (r["batch_size"], r["hf_specdec_tokens_per_s"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel("generated tokens / s")
        ax.set_title(mode)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_batch_study(args: argparse.Namespace) -> list[dict]:
    apply_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, draft, tokenizer = load_pair(args.target, args.draft, device, pack=args.pack, draft_bits=args.draft_bits)
    draft = hf_draft(draft, args.draft_bits)
    prompts = batch_prompts(tokenizer, args.categories, max(max(args.batch_sizes), args.prompts_per_size))
    target.generate(torch.tensor([prompts[0]["input_ids"]], device=target.device), max_new_tokens=4)  # warm-up
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(target=args.target, draft=args.draft, batch_sizes=list(args.batch_sizes), max_new_tokens=args.max_new_tokens,
                  num_draft_tokens=args.num_draft_tokens, draft_bits=args.draft_bits, categories=list(args.categories),
                  torch_threads=torch.get_num_threads(), modes=list(args.modes), prompts_per_size=args.prompts_per_size,
                  pack=args.pack, variant=args.variant)
    title = f"Batched throughput ({args.max_new_tokens} new tokens, prompts mixed across {', '.join(args.categories)})"
    if args.pack:
        title += "; float32 oneDNN-packed target and draft"

    def write(rows, done: bool = False) -> None:  # after every cell: a run stopped early keeps what it measured
        (out / "batch_throughput.json").write_text(json.dumps(dict(config=config, rows=rows, complete=done), indent=2))
        status = "" if done else "\n\n(partial: the run has not finished every cell)"
        variant = variant_table(rows)
        (out / "batch_throughput.md").write_text(
            f"# {title}\n\n{batch_table(rows)}{status}\n\n{variant + chr(10) * 2 if variant else ''}![throughput](batch_throughput.png)\n")
        plot_throughput(rows, out / "batch_throughput.png")

    rows = batch_throughput(target, draft, tokenizer, prompts, args.batch_sizes, args.max_new_tokens, args.num_draft_tokens,
                            modes=args.modes, prompts_per_size=args.prompts_per_size, on_row=write, variant=args.variant)
    write(rows, done=True)
    print(batch_table(rows))
    if args.variant:
        print(variant_table(rows))
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, "target", "draft")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16], metavar="N")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--prompts-per-size", type=int, default=16,
                        help="prompts run at each batch size (at least one batch; 0: as many as the largest batch); "
                             "16 gives batch 8 two batches, whose spread shows the cell's noise")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=draft_length, default=None, help="override hf_specdec's default (max) draft length")
    add_options(parser, "pack", "draft_bits")
    parser.add_argument("--variant", nargs="+", default=None, metavar="KEY=VALUE", type=_setting,
                        help="also run hf_specdec with these keyword arguments changed, right after it on every batch "
                             "(an A/B of one lever in the same run), e.g. --variant adaptive=False")
    add_options(parser, "threads", out="runs/batch")
    parser.add_argument("--categories", nargs="+", default=list(BATCH_CATEGORIES), choices=BATCH_CATEGORIES, metavar="CATEGORY")
    args = parser.parse_args(argv)
    args.variant = dict(args.variant) if args.variant else None
    return args


def _setting(text: str) -> tuple[str, object]:
    """"key=value" -> (key, value as a Python literal where it parses as one, else the string)."""
    import ast

    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with a keyword argument name, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


if __name__ == "__main__":
    run_batch_study(parse_args())
