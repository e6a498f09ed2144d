"""What a wider verify forward costs as the batch grows: the reason batches verify chains, not trees.

A tree of n nodes costs its row n more positions in the target's verifying forward. At batch 1 on a
CPU that forward is memory bound (each extra position costs a few % of a step), which is why trees
pay there. With b rows the forward processes b x (n + 1) positions and turns compute bound; this
script times the target's forward over a cache of `--context` tokens for batch sizes x widths and
prints each time in units of the batch's one-token step.

    python evals/batch_widths.py --out runs/batch-widths
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
from hf_specdec.pair import TARGET, load_model  # noqa: E402


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
    parser.add_argument("--target", default=TARGET.name)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 5, 9, 17, 25])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", default="runs/batch-widths")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_model(args.target)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    table = {}
    for batch in args.batch_sizes:
        row = {w: forward_seconds(model, batch, w, args.context, args.reps, gen) for w in args.widths}
        table[batch] = {w: row[w] / row[1] for w in args.widths}
        print(f"batch {batch}: step {row[1] * 1000:.0f} ms; width -> cost in steps: "
              + ", ".join(f"{w}: {table[batch][w]:.2f}" for w in args.widths), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch_widths.json").write_text(json.dumps(dict(args=vars(args), steps=table), indent=1))
    return table


if __name__ == "__main__":
    main()
