"""What a wider verify forward costs as the batch grows: the reason batches verify chains, not trees.

A tree of n nodes costs its row n more positions in the target's verifying forward. At batch 1 on a
CPU that forward is memory bound (each extra position costs a few % of a step), which is why trees
pay there. With b rows the forward processes b x (n + 1) positions and turns compute bound; this
script times the target's forward over a cache of `--context` tokens for batch sizes x widths and
prints each time in units of the batch's one-token step. With `--draft`, it also times the draft's
step (one column) at each batch size, as c: the draft step over the target's, both at that batch,
and prints what a drafted column costs the batch (c + d, d the slope of cost against width) and the
best speedup a draft chain can reach at a per-token acceptance a: max over k of
(1 + a + ... + a^k) / (1 + k (c + d)).

    python evals/batch_widths.py --out runs/batch-widths
    python evals/batch_widths.py --batch-sizes 1 2 4 8 --widths 1 2 3 5 --draft qwen2.5-coder-0.5b-instruct --out runs/bw
    python evals/batch_widths.py --pack --threads 2 --batch-sizes 1 2 4 8 --widths 1 2 3 4 5 --draft qwen2.5-coder-0.5b-instruct --out runs/bw-packed
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_specdec.cache import new_cache, rollback  # noqa: E402
from hf_specdec.cpu import pack_linears  # noqa: E402
from hf_specdec.pair import load_model  # noqa: E402
from hf_specdec.stats import geometric_tokens_per_round  # noqa: E402
from common import add_options, apply_threads, hf_draft, pack_draft  # noqa: E402


@torch.no_grad()
def forward_seconds(model, batch: int, width: int, context: int, reps: int, gen: torch.Generator) -> float:
    vocab = model.config.vocab_size
    cache = new_cache(model)
    model(input_ids=torch.randint(4, vocab, (batch, context), generator=gen), cache=cache, use_cache=True, logits_to_keep=1)
    ids = torch.randint(4, vocab, (batch, width), generator=gen)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=width)
        times.append(time.perf_counter() - start)
        rollback([cache], context)
    return statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(parser, "target")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 5, 9, 17, 25])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--draft", default=None, help="also time this draft's one-column step at each batch size")
    parser.add_argument("--draft-bits", type=int, choices=(4, 8, 16), default=8,
                        help="weight-only quantization of the draft (with --pack: 8 gives the packed draft int8 copies for its steps)")
    parser.add_argument("--acceptance", type=float, default=0.75, help="per-token acceptance for the best-speedup line")
    add_options(parser, "threads", "pack")
    add_options(parser, out="runs/batch-widths")
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    model, _ = load_model(args.target)
    model.eval()
    if args.pack:
        model = pack_linears(model)
    gen = torch.Generator().manual_seed(0)
    draft = None
    if args.draft:
        draft, _ = load_model(args.draft)
        if args.pack:  # as the other eval scripts pack hf_specdec's draft (int8 copies under --draft-bits 8)
            draft = pack_draft(draft.eval(), args.draft_bits)
        else:
            draft = hf_draft(draft.eval(), args.draft_bits)
    table, step_ms, draft_cost = {}, {}, {}
    for batch in args.batch_sizes:
        row = {w: forward_seconds(model, batch, w, args.context, args.reps, gen) for w in args.widths}
        table[batch] = {w: row[w] / row[1] for w in args.widths}
        step_ms[batch] = row[1] * 1000
        line = f"batch {batch}: step {row[1] * 1000:.0f} ms; width -> cost in steps: " + ", ".join(
            f"{w}: {table[batch][w]:.2f}" for w in args.widths)
        if draft is not None:
            draft_cost[batch] = forward_seconds(draft, batch, 1, args.context, args.reps, gen) / row[1]
            line += f"; draft step c = {draft_cost[batch]:.2f}"
            d = column_cost(table[batch])
            if d is not None:
                per_column = draft_cost[batch] + d
                line += (f"; d = {d:.3f}, a drafted column costs c + d = {per_column:.2f}; best chain speedup at "
                         f"a = {args.acceptance}: {best_chain_speedup(args.acceptance, per_column):.2f}x")
        print(line, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch_widths.json").write_text(json.dumps(dict(args=vars(args), steps=table, step_ms=step_ms,
                                                           draft_cost=draft_cost), indent=1))
    return table


def column_cost(costs: dict[int, float]) -> float | None:
    """d: the least-squares slope of cost (in one-token steps) against width - 1, through (0, 1)."""
    xs = [(w - 1, c - 1) for w, c in costs.items() if w > 1]
    if not xs:
        return None
    return sum(x * y for x, y in xs) / sum(x * x for x, _ in xs)


def best_chain_speedup(acceptance: float, column_cost: float, max_k: int = 16) -> float:
    """max over k of expected tokens (1 + a + ... + a^k) over cost (1 + k x column cost), at least 1
    (k = 0: a plain step)."""
    return max(geometric_tokens_per_round(acceptance, k) / (1 + k * column_cost) for k in range(max_k + 1))


if __name__ == "__main__":
    main()
