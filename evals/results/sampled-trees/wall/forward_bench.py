"""A tree forward (extend_tree, a 4-D mask, two branches) against a chain forward of the same width on the real
target at a 300-token context, interleaved, 12 repetitions each (medians of the last 10): is a tree round dearer
on a CPU than the width it is priced at?  python evals/results/sampled-trees/wall/forward_bench.py"""
import sys, time, statistics, torch
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "evals"))
from common import load_pair, apply_threads
from hf_specdec.cache import extend_tree
from hf_specdec.proposals.tree import ancestors_mask, depths
from transformers import DynamicCache
apply_threads(2)
import common
target, draft, tok = load_pair(common.TARGET.name, common.DRAFT.name, "cpu")
torch.manual_seed(0)
ctx = torch.randint(100, 20000, (1, 300))
cache = DynamicCache(config=target.config)
with torch.no_grad():
    target(ctx[:, :-1], past_key_values=cache, use_cache=True)
base = cache.get_seq_length()
def chain(n):
    ids = torch.cat([ctx[:, -1:], torch.randint(100, 20000, (1, n))], 1)
    with torch.no_grad():
        out = target(ids, past_key_values=cache, use_cache=True, logits_to_keep=n + 1).logits
    cache.crop(base - cache.get_seq_length())
def tree(n, parents):
    toks = torch.randint(100, 20000, (1, n))
    with torch.no_grad():
        extend_tree(target, cache, ctx, toks, ancestors_mask(parents), depths(parents))
    cache.crop(base - cache.get_seq_length())
res = {}
for n in (4, 8, 16):
    # a branching tree of n nodes: two branches of n/2
    h = n // 2
    parents = [-1] + list(range(0, h - 1)) + [-1] + list(range(h, n - 1))
    for rep in range(12):
        for name, f in (("chain", lambda: chain(n)), ("tree", lambda: tree(n, parents))):
            t = time.perf_counter(); f(); res.setdefault((n, name), []).append(time.perf_counter() - t)
one = []
for rep in range(12):
    t = time.perf_counter(); chain(0); one.append(time.perf_counter() - t)
step = statistics.median(one)
print(f"one-token step {step*1000:.1f} ms")
for n in (4, 8, 16):
    c, t = statistics.median(res[(n, 'chain')][2:]), statistics.median(res[(n, 'tree')][2:])
    print(f"{n} nodes: chain {c*1000:.1f} ms ({c/step:.2f} steps), tree {t*1000:.1f} ms ({t/step:.2f} steps), tree/chain {t/c:.3f}")
