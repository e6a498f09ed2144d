"""usage (from the repository root): python evals/results/greedy-match/tree_mask_timing.py

Chain forward (causal, as the cost table times it) against the same tokens as a tree forward
(a chain-shaped tree through extend_tree's 4D mask), packed target, several contexts and widths."""
import sys, time, statistics, torch
torch.set_num_threads(2)
sys.path.insert(0, "evals")
from common import load_pair
from hf_specdec.pair import DRAFT, TARGET
from hf_specdec.cache import new_cache, extend_tree, rollback, make_rollbackable
from hf_specdec.cache import extend
target, draft, tok = load_pair(TARGET.name, DRAFT.name, "cpu", pack=True)
torch.manual_seed(0)
res = {}
for ctx in (256, 1024):
    ids = torch.randint(100, 20000, (1, ctx + 40))
    cache = make_rollbackable(new_cache(target))
    with torch.no_grad():
        extend(target, cache, ids[:, :ctx], None, num_logits=1)
        for rep in range(5):
            for w in (5, 9, 17):
                for kind in ("chain", "tree"):
                    t0 = time.perf_counter()
                    if kind == "chain":
                        extend(target, cache, ids[:, : ctx + w], None, num_logits=w)
                    else:
                        n = w - 1
                        seen = torch.ones(n, n, dtype=torch.bool).tril()
                        extend_tree(target, cache, ids[:, : ctx + 1], ids[:, ctx + 1 : ctx + 1 + n], seen, list(range(n)))
                    dt = time.perf_counter() - t0
                    rollback([cache], ctx)
                    res.setdefault((ctx, w, kind), []).append(dt)
for (ctx, w, kind), v in sorted(res.items()):
    print(ctx, w, kind, "median %.3f min %.3f" % (statistics.median(v), min(v)))
