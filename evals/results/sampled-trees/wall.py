"""Sampled trees on the wall clock, interleaved (issue 39): hf_specdec with a shared RetrievalCache,
`tree=True` (the default: the cache's continuations verified as a tree where that pays) against
`tree=False` (the cache's top continuation as a chain, the code before e35ec06), each arm with a cache
of its own, the arms alternating call by call (the order flips every sample).

    python evals/results/sampled-trees/wall.py --limit 2 --samples 8 --max-new-tokens 128 --threads 2

Costs are measured online (what a user gets), so the arms draw different sample paths; the figure is
pooled tokens per wall second, arm against arm, per workload and per prompt. Run nothing beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

EVALS = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(EVALS.parent))
sys.path.insert(0, str(EVALS))

import hf_specdec  # noqa: E402
from common import add_options, apply_threads, load_pair  # noqa: E402
from repetition import WORKLOADS, workload_prompts  # noqa: E402

ARMS = {"trees": True, "chains": False}


def call(target, draft, ids, workload, cache, tree: bool, max_new_tokens: int, seed: int) -> tuple[int, float, int]:
    """(new tokens, wall seconds, tree rounds) of one sampled call."""
    rounds = []
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=True,
                          temperature=workload.temperature, top_p=workload.top_p,
                          custom_generate=hf_specdec.speculative_generate, assistant=draft, retrieval_cache=cache,
                          tree=tree, acceptance_sink=rounds.append)
    seconds = time.perf_counter() - start
    return out.shape[1] - ids.shape[1], seconds, sum(r.parents is not None for r in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="sample i is seeded with seed + i")
    parser.add_argument("--out", default=None, help="a records.jsonl to write (one line per call)")
    add_options(parser, "target", "draft")
    args = parser.parse_args()
    apply_threads(args.threads)
    target, draft, tokenizer = load_pair(args.target, args.draft, "cpu")
    prompts = workload_prompts(tokenizer, args.workloads, args.limit)
    warm = torch.tensor([prompts[args.workloads[0]][0]["input_ids"]])
    for tree in ARMS.values():  # untimed: first-call costs out of the figures
        call(target, draft, warm, WORKLOADS[args.workloads[0]], hf_specdec.RetrievalCache(), tree, 8, 0)
    sink = open(args.out, "w") if args.out else None
    for name in args.workloads:
        caches = {arm: hf_specdec.RetrievalCache() for arm in ARMS}
        totals = {arm: [0, 0.0] for arm in ARMS}
        for prompt in prompts[name]:
            ids, mine = torch.tensor([prompt["input_ids"]]), {arm: [0, 0.0] for arm in ARMS}
            for sample in range(args.samples):
                order = list(ARMS) if sample % 2 == 0 else list(reversed(ARMS))
                for arm in order:
                    tokens, seconds, trees = call(target, draft, ids, WORKLOADS[name], caches[arm], ARMS[arm],
                                                  args.max_new_tokens, args.seed + sample)
                    for acc in (totals[arm], mine[arm]):
                        acc[0], acc[1] = acc[0] + tokens, acc[1] + seconds
                    line = dict(workload=name, id=prompt["id"], sample=args.seed + sample, arm=arm, tokens=tokens,
                                seconds=round(seconds, 3), tree_rounds=trees)
                    print(json.dumps(line), file=sys.stderr, flush=True)
                    if sink:
                        sink.write(json.dumps(line) + "\n")
                        sink.flush()
            rates = {arm: t / s for arm, (t, s) in mine.items()}
            print(f"{name} {prompt['id']}: trees {rates['trees']:.2f} tok/s, chains {rates['chains']:.2f} tok/s, "
                  f"trees / chains {rates['trees'] / rates['chains']:.3f}", flush=True)
        rates = {arm: t / s for arm, (t, s) in totals.items()}
        print(f"{name} pooled: trees {rates['trees']:.2f} tok/s ({totals['trees'][0]} tokens), chains "
              f"{rates['chains']:.2f} tok/s ({totals['chains'][0]} tokens), trees / chains "
              f"{rates['trees'] / rates['chains']:.3f}", flush=True)


if __name__ == "__main__":
    main()
