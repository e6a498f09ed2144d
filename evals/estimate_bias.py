"""How far the cost model's expectations are from what verification accepts, per kind of round.

Each tree round's `RoundRecord.estimated_acceptance` holds the cost model's estimate, per proposed
node, of the probability that verification reaches and accepts it: the round was chosen on their
sum. This script runs hf_specdec on tuning-split prompts (costs pinned, so the decisions do not
depend on the clock) and compares, per kind of round, the mean of that sum with the mean number of
tokens accepted:

    tree-ngram    a branching retrieval tree (no draft model)
    chain-ngram   retrieved nodes that form one chain (one continuation kept)
    tree-draft    the draft model's chain merged with retrieved branches (or its runners-up)
    chain-draft   the draft model's chain alone
    chain-none    a plain step

A ratio accepted / estimated far from 1 says which estimate misleads the choice between sources.
Only tree rounds carry estimates, and trees are built in greedy single-row calls only (sampling
always verifies chains): `--mode sampling` counts rounds and accepted tokens but estimates none.

    python evals/estimate_bias.py --categories summarization --prompts 2 --mode greedy
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import add_options, apply_threads, drafts_by_precision, load_pair, load_prompts  # noqa: E402

import hf_specdec  # noqa: E402
from hf_specdec.pair import DRAFT, TARGET  # noqa: E402

MODES = {"greedy": dict(do_sample=False), "sampling": dict(do_sample=True, temperature=0.7, top_p=0.95)}


def round_kind(record: hf_specdec.RoundRecord) -> str:
    return ("tree-" if record.parents is not None else "chain-") + record.source


def tally(records: list[hf_specdec.RoundRecord]) -> dict[str, dict[str, float]]:
    """Per kind of round: rounds, nodes per round, accepted and estimated tokens per round (the
    estimate only over rounds that carry one)."""
    sums = collections.defaultdict(lambda: collections.Counter())
    for r in records:
        s = sums[round_kind(r)]
        s["rounds"] += 1
        s["nodes"] += len(r.draft_tokens)
        s["accepted"] += r.num_accepted
        if r.estimated_acceptance is not None:
            s["estimated_rounds"] += 1
            s["estimated"] += sum(r.estimated_acceptance)
            s["accepted_where_estimated"] += r.num_accepted
    out = {}
    for kind, s in sorted(sums.items()):
        row = dict(rounds=s["rounds"], nodes_per_round=s["nodes"] / s["rounds"], accepted_per_round=s["accepted"] / s["rounds"])
        if s["estimated_rounds"]:
            row["estimated_per_round"] = s["estimated"] / s["estimated_rounds"]
            row["accepted_over_estimated"] = s["accepted_where_estimated"] / s["estimated"] if s["estimated"] else None
        out[kind] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--categories", nargs="+", default=["summarization"])
    parser.add_argument("--prompts", type=int, default=2, help="prompts per category (tuning split)")
    parser.add_argument("--mode", choices=list(MODES), default="greedy",
                        help="greedy (tree rounds, which carry estimates) or sampling (chains: none)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-cost", type=float, default=0.24, help="pinned c (the int8 draft's on the real pair)")
    parser.add_argument("--verify-cost", type=float, default=0.03, help="pinned d (a forward over w tokens costs 1 + d (w - 1) target steps)")
    add_options(parser, threads=2)
    parser.add_argument("--out", type=Path, help="write the table here (JSON)")
    args = parser.parse_args()
    apply_threads(args.threads)
    target, draft, tokenizer = load_pair(TARGET.name, DRAFT.name, "cpu")
    draft = drafts_by_precision(draft, 8)["hf"]
    records: list[hf_specdec.RoundRecord] = []
    for prompt in load_prompts(tokenizer, args.categories, args.prompts, "tuning"):
        ids = torch.tensor([prompt["input_ids"]])
        for seed in args.seeds:
            torch.manual_seed(seed)
            target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, **MODES[args.mode],
                            custom_generate=hf_specdec.speculative_generate, assistant=draft,
                            costs=hf_specdec.Costs(draft_step=args.draft_cost, verify=args.verify_cost),
                            acceptance_sink=records.append)
            if args.mode == "greedy":
                break  # seeds do not matter
    table = tally(records)
    for kind, row in table.items():
        print(kind, " ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, table=table), indent=2))


if __name__ == "__main__":
    main()
