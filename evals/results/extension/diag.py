"""Extension rounds: predicted vs realised (run with PYTHONPATH of the code under test)."""
import json, sys
sys.argv = [sys.argv[0]] + sys.argv[1:]
import hf_specdec.rounds as R
LOG = []
real_extend, real_obs = R._extend, R._observe_chains
def extend(state, request, chain, room, trace):
    out = real_extend(state, request, chain, room, trace)
    if trace.extension:
        planner = state.planner
        k = chain.num_tokens
        conf = chain.confidences[0]
        import itertools, operator
        reach = list(itertools.accumulate(map(planner.acceptance.calibrated, conf), operator.mul))
        d, size, source, shares = trace.extension[0]
        run = out.host[0][k:]
        a = planner.acceptance.lookup_at(size, source)
        trace._diag = dict(k=k, n=len(run), size=size, source=source, a=a, shares=(shares or [1.0]*len(run))[:len(run)], reach_k=reach[-1])
    return out
def observe(state, proposal, trace, accepted):
    d = getattr(trace, "_diag", None)
    LOG.append(dict(source=proposal.source_of(0), length=proposal.length(0), accepted=accepted[0], ext=d))
    return real_obs(state, proposal, trace, accepted)
R._extend, R._observe_chains = extend, observe
sys.path.insert(0, "evals")
import repetition
import atexit
atexit.register(lambda: json.dump(LOG, open("/work/runs/s11/diag/" + sys.argv[-1] + ".json", "w")))
sys.argv = sys.argv[:-1]
repetition.main() if hasattr(repetition, "main") else None
