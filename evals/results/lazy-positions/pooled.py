"""Per prompt, hf_specdec's modelled rate with lazy pricing over the old pins, seeds pooled (tokens over
modelled seconds summed over the seeds). From the repository root: python evals/results/lazy-positions/pooled.py [0,1,2,3]"""
import json, sys, math, collections
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from costs import CostTable
t = CostTable.load(HERE.parent / 'standard' / 'cost_table.json')
def pool(v, seeds):
    tot = collections.defaultdict(lambda: [0, 0.0]); cat = {}
    for s in seeds:
        for r in map(json.loads, open(HERE / 'replays' / f'{v}-s{s}' / 'replay.jsonl')):
            tot[r['id']][0] += r['new_tokens']; tot[r['id']][1] += t.modelled_seconds(r['work'], 'sampling', 'hf_specdec'); cat[r['id']] = r['category']
    return {i: a / b for i, (a, b) in tot.items()}, cat
seeds = [int(x) for x in sys.argv[1].split(',')] if len(sys.argv) > 1 else [0, 1, 2, 3]
e, cat = pool('eager', seeds); l, _ = pool('lazy', seeds)
g = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))
bycat = collections.defaultdict(list)
for i in e: bycat[cat[i]].append(l[i] / e[i])
for c, xs in sorted(bycat.items()):
    print(f'| {c} | {g(xs):.3f} | {" ".join(f"{x:.2f}" for x in xs)} |')
allx = [l[i] / e[i] for i in e]
print(f'| all 35 | {g(allx):.3f} | lazy faster on {sum(x > 1 for x in allx)} of 35 |')
