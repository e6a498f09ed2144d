"""Batched greedy throughput: plain batched decoding against hf_specdec at several batch sizes.

    python evals/batch_study.py --batch-sizes 1 4 8 --out runs/batch     # real pair, ~6 min on 2 CPU cores
    python evals/batch_study.py --target tiny --draft tiny --batch-sizes 1 2 4 --max-new-tokens 10 --out runs/tiny-batch

Short prompts (Spec-Bench's shorter tasks and HumanEval), round-robin over the categories so that
every batch mixes them, as many as the largest batch. At each batch size the prompts are cut into
batches, left-padded, and each batch runs plain decoding then hf_specdec (interleaved batch by batch).
Throughput counts each row's generated tokens up to and including its EOS; the padding after a
finished row is not work. Also checks that every batched hf_specdec output equals plain batched
greedy. Writes <out>/batch_throughput.json and <out>/batch_throughput.md.
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
from common import drafts_by_precision, load_pair, load_prompts, speedup_over_plain  # noqa: E402
from hf_specdec.pair import DRAFT, TARGET  # noqa: E402

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


def _generated_length(row: torch.Tensor, eos_id, pad_id) -> int:
    """row: (new,) one row's generated tokens. Up to and including its EOS, else up to its padding."""
    tokens = row.tolist()
    if eos_id is not None and eos_id in tokens:
        return tokens.index(eos_id) + 1
    while tokens and tokens[-1] == pad_id:
        tokens.pop()
    return len(tokens)


def _timed_generate(target, ids, mask, pad_id, max_new_tokens, spec: dict | None):
    """(sequences (batch, width + new), seconds, AcceptanceStats or None): plain greedy when `spec`
    is None, else hf_specdec with the keyword arguments in `spec`. ids, mask: (batch, width)."""
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
    if spec is not None:
        kwargs.update(spec, custom_generate=hf_specdec.speculative_generate, return_dict_in_generate=True)
    start = time.perf_counter()
    out = target.generate(ids, attention_mask=mask, **kwargs)
    seconds = time.perf_counter() - start
    return (out, seconds, None) if spec is None else (out.sequences, seconds, out.acceptance)


def batch_throughput(target, draft, tokenizer, prompts, batch_sizes, max_new_tokens, num_draft_tokens) -> list[dict]:
    """Greedy throughput (generated tokens / second) of plain batched decoding and hf_specdec at each
    batch size, over the same prompts, the two interleaved batch by batch."""
    from tqdm.auto import tqdm

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    spec = dict(assistant=draft)
    if num_draft_tokens is not None:
        spec["num_draft_tokens"] = num_draft_tokens
    rows = []
    for size in batch_sizes:
        tokens, seconds = {"plain": 0, "hf_specdec": 0}, {"plain": 0.0, "hf_specdec": 0.0}
        match, acceptance = True, []
        chunks = [prompts[i : i + size] for i in range(0, len(prompts) - size + 1, size)]
        for chunk in tqdm(chunks, desc=f"batch {size}"):
            ids, mask = left_pad([p["input_ids"] for p in chunk], pad_id, target.device)
            outputs = {}
            for method, kwargs in (("plain", None), ("hf_specdec", spec)):
                seqs, took, stats = _timed_generate(target, ids, mask, pad_id, max_new_tokens, kwargs)
                new = seqs[:, ids.shape[1] :]  # (batch, new)
                tokens[method] += sum(_generated_length(row, tokenizer.eos_token_id, pad_id) for row in new)
                seconds[method] += took
                outputs[method] = seqs
                if stats is not None:
                    acceptance.append(stats)
            match &= torch.equal(outputs["plain"], outputs["hf_specdec"])
        merged = functools.reduce(hf_specdec.AcceptanceStats.merge, acceptance)
        rows.append(dict(
            batch_size=size, prompts=len(chunks) * size, plain_tokens_per_s=tokens["plain"] / seconds["plain"],
            hf_specdec_tokens_per_s=tokens["hf_specdec"] / seconds["hf_specdec"],
            ratio=speedup_over_plain(tokens["hf_specdec"], seconds["hf_specdec"], tokens["plain"], seconds["plain"]),
            acceptance_rate=merged.acceptance_rate, all_match_plain=bool(match),
        ))
    return rows


def batch_table(rows) -> str:
    lines = ["| batch size | prompts | plain tok/s | hf_specdec tok/s | hf_specdec / plain | acceptance | greedy match |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['batch_size']} | {r['prompts']} | {r['plain_tokens_per_s']:.2f} | {r['hf_specdec_tokens_per_s']:.2f} | "
                     f"{r['ratio']:.2f}x | {r['acceptance_rate']:.2f} | {'yes' if r['all_match_plain'] else 'NO'} |")
    return "\n".join(lines)


def run_batch_study(args: argparse.Namespace) -> list[dict]:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, draft, tokenizer = load_pair(args.target, args.draft, device)
    draft = drafts_by_precision(draft, args.draft_bits)["hf"]
    prompts = batch_prompts(tokenizer, args.categories, max(args.batch_sizes))
    target.generate(torch.tensor([prompts[0]["input_ids"]], device=target.device), max_new_tokens=4)  # warm-up
    rows = batch_throughput(target, draft, tokenizer, prompts, args.batch_sizes, args.max_new_tokens, args.num_draft_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(target=args.target, draft=args.draft, batch_sizes=list(args.batch_sizes), max_new_tokens=args.max_new_tokens,
                  num_draft_tokens=args.num_draft_tokens, draft_bits=args.draft_bits, categories=list(args.categories),
                  torch_threads=torch.get_num_threads())
    (out / "batch_throughput.json").write_text(json.dumps(dict(config=config, rows=rows), indent=2))
    table = batch_table(rows)
    title = f"Batched greedy throughput ({len(prompts)} prompts, {args.max_new_tokens} new tokens)"
    (out / "batch_throughput.md").write_text(f"# {title}\n\n{table}\n")
    print(table)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=TARGET.name, help="registry name, local folder, hub id, or 'tiny'")
    parser.add_argument("--draft", default=DRAFT.name, help="registry name, local folder, hub id, or 'tiny'")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8], metavar="N")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="override hf_specdec's default (max) draft length")
    parser.add_argument("--draft-bits", type=int, choices=(4, 8, 16), default=8,
                        help="weight-only quantization of hf_specdec's draft (16: none)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default="runs/batch")
    parser.add_argument("--categories", nargs="+", default=list(BATCH_CATEGORIES), choices=BATCH_CATEGORIES, metavar="CATEGORY")
    return parser.parse_args(argv)


if __name__ == "__main__":
    run_batch_study(parse_args())
