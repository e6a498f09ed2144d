"""evals/recycling.py's simulation of Token Recycling, on a hand-made sequence and top-k array whose
figures are counted by hand (no model)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_recycling_simulation_counts_hits_and_accepted_tokens_by_hand():
    sys.path.insert(0, str(ROOT / "evals"))
    import recycling

    tree = recycling.tree_template()
    depth = []
    for parent, rank in tree:
        assert parent < len(depth)  # parents first
        depth.append(1 if parent < 0 else depth[parent] + 1)
        assert rank < recycling.BRANCHING[depth[-1] - 1]
    assert len(tree) == 24 and max(depth) <= 6 and tree[:3] == [(-1, 0), (-1, 1), (0, 0)]

    # prompt 10 11 12, output 10 11 13 10 11 12; topk[j]: the "target's" two candidates after seq[j]
    seq = [10, 11, 12, 10, 11, 13, 10, 11, 12]
    topk = [[11, 20], [12, 13], [10, 21], [11, 22], [13, 12], [10, 23], [11, 24], [12, 25], [30, 31]]
    # Position by position (i: 3..8; the table holds inputs j <= i-2), table filled from the prompt too:
    #   i=3 last 12: no entry (topk[2], whose top-1 is the true 10, is not in yet); no lookup match
    #   i=4 last 10 -> [11,20], truth 11 13 ..: hit@1; chain 11 (then 12 != 13): 1; tree 11 -> 13
    #       (table[11]'s rank 1), table[13] empty: 2; 1-gram lookup [11,12,10]: 1; no 2-gram match
    #   i=5 last 11 -> [12,13], truth 13 10 ..: hit@2; chain 0; tree 13: 1; lookup [12,10,11] (2-gram
    #       10 11 too): 0
    #   i=6 last 13: no entry, no lookup match
    #   i=7 last 10 -> [11,22], truth 11 12: hit@1; chain 11 (then 13): 1; tree 11 -> 12: 2; 1-gram
    #       lookup [11,12,10,..]: 2; no 2-gram match
    #   i=8 last 11 -> [13,12] (from j=4), truth 12: hit@2; chain 0; tree 1; lookup [12,..] (2-gram): 1
    prompt_fills = recycling.simulate(seq, topk, prompt_len=3, fill_from=0)
    assert prompt_fills == {
        "positions": 6, "has_entry": 4, "hit@1": 2, "hit@2": 4, "hit@4": 4, "hit@8": 4,
        "lookup matched": 4, "lookup n>=2 matched": 2, "lookup": 4, "lookup n>=2": 1, "chain": 2, "tree": 6,
        "lookup else tree": 4,  # the 1-gram lookup matches wherever the table has an entry
        "lookup n>=2 else tree": 0 + 2 + 0 + 0 + 2 + 1, "merged": 0 + 2 + 1 + 0 + 2 + 1,
        # rounds replayed from i=3, each emitting accepted + 1: lookup 3 | 4 5 | 6 | 7 8 (+1 past the end);
        # tree and merged 3 | 4 5 6 | 7 8; lookup n>=2: one token a round until i=8
        "rounds: lookup": 4, "rounds: lookup n>=2": 6, "rounds: tree": 3, "rounds: lookup n>=2 else tree": 3,
        "rounds: merged": 3,
    }
    # Generated positions only (j >= 3): the table holds nothing before i=5, and 11 only from i=6,
    # 13 from i=7: i=7 and i=8 score as above, nothing else does; the lookups do not change.
    generated_only = recycling.simulate(seq, topk, prompt_len=3, fill_from=3)
    assert generated_only == {
        "positions": 6, "has_entry": 2, "hit@1": 1, "hit@2": 2, "hit@4": 2, "hit@8": 2,
        "lookup matched": 4, "lookup n>=2 matched": 2, "lookup": 4, "lookup n>=2": 1, "chain": 1, "tree": 3,
        "lookup else tree": 4, "lookup n>=2 else tree": 2 + 1, "merged": 1 + 2 + 1,
        "rounds: lookup": 4, "rounds: lookup n>=2": 6, "rounds: tree": 5, "rounds: lookup n>=2 else tree": 5,
        "rounds: merged": 4,
    }
    assert recycling.rates(prompt_fills)["tree"] == 1.0 and recycling.rates(generated_only)["hit@1"] == 1 / 6
    assert recycling.rates(prompt_fills)["merged tokens/round"] == 6 / 3
