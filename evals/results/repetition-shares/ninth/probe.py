"""Log, per verified retrieved token (cache or in-row), its share, match size, depth, the target's p(x),
and whether it was accepted; plus the planner's a(size) at the time. Runs repetition.py's workload
with the cache, pinned bf16 costs; wraps hf_specdec.generate.observe (our own module). From the
repository root:

    python evals/results/repetition-shares/ninth/probe.py LOG.jsonl OUT_DIR --workloads pass_at_k --limit 5
"""
import json, sys
sys.argv = [sys.argv[0]] + sys.argv[1:]
sys.path.insert(0, "evals")
import repetition
import hf_specdec.generate as G
from hf_specdec.stats import NGRAM, CACHE

OUT = open(sys.argv[1], "w")
orig = G.observe

def observe(state, proposal, trace, verdict, emission):
    acc = verdict.accepted
    if proposal.tree is None:
        for i in range(len(acc)):
            if proposal.source_of(i) != NGRAM:
                continue
            src = trace.match_sources[i] if trace.match_sources else NGRAM
            size = trace.match_sizes[i]
            toks = proposal.host[i]
            shares = state.lookup.shares.get(i) if (state.lookup and src == CACHE) else None
            a = state.planner.acceptance.lookup_at(size, src)
            p = None
            if verdict.target_probs is not None:
                n = min(len(toks), verdict.target_probs.shape[1])
                p = [float(verdict.target_probs[i, j, toks[j]]) for j in range(n)]
            OUT.write(json.dumps(dict(src=src, size=size, tokens=toks, shares=shares, a=a, p=p,
                                      accepted=acc[i])) + "\n")
    return orig(state, proposal, trace, verdict, emission)

G.observe = observe
repetition.main(["--out", sys.argv[2], "--limit", "2", "--samples", "8", "--max-new-tokens", "128",
                 "--threads", "1", "--no-execute", "--methods", "hf_specdec+cache"] + sys.argv[3:])
