"""The planner's standard-preset wall run (sampling, ../planner-wall/sampling) repriced with the positions
its lazy rule scored (derived from each record's round_log: lazy_scored(drafted, accepted) per round),
beside the old charge of every position and the wall. From the repository root:
python evals/results/lazy-positions/wallmodel.py"""
import json, math, statistics, sys
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from costs import CostTable
from hf_specdec.config import lazy_scored
D = sys.argv[1] if len(sys.argv) > 1 else str(HERE.parent / 'planner-wall' / 'sampling')
table = CostTable.load(f'{D}/cost_table.json')
recs = [json.loads(l) for l in open(f'{D}/records.jsonl')]
plain = {r['id']: r for r in recs if r['method'] == 'plain'}
rows = []
for r in recs:
    if r['method'] != 'hf_specdec' or not r.get('new_tokens'):
        continue
    log, work = r['round_log'], r['work']
    if len(log) != len(work['target']):
        print('mismatch', r['id'], len(log), len(work['target'])); continue
    scored = [lazy_scored(d, a) for d, a, _ in log]
    b = plain[r['id']]
    ps = table.modelled_seconds(b['work'], 'sampling', 'transformers')
    old = table.modelled_seconds(work, 'sampling', 'hf_specdec')
    new = table.modelled_seconds(dict(work, scored=scored), 'sampling', 'hf_specdec')
    sp = lambda s: (r['new_tokens'] / s) / (b['new_tokens'] / ps)
    wall = (r['new_tokens'] / r['seconds']) / (b['new_tokens'] / b['seconds'])
    rows.append((r['category'], r['id'], wall, sp(old), sp(new), sum(w for w, c in work['target'] if c) , sum(scored)))
g = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))
print('prompts', len(rows))
print('geomean over prompts: wall %.3f  modelled all positions %.3f  modelled scored %.3f' % (g([x[2] for x in rows]), g([x[3] for x in rows]), g([x[4] for x in rows])))
print('wall / modelled, geomean: all positions %.3f  scored %.3f' % (g([x[2] / x[3] for x in rows]), g([x[2] / x[4] for x in rows])))
cats = sorted({x[0] for x in rows})
print('| category | wall | modelled, every position | modelled, positions scored | positions charged / scored |')
print('|---|---|---|---|---|')
for c in cats:
    xs = [x for x in rows if x[0] == c]
    print(f'| {c} | {statistics.median(x[2] for x in xs):.2f} | {statistics.median(x[3] for x in xs):.2f} | {statistics.median(x[4] for x in xs):.2f} | {sum(x[5] for x in xs)} / {sum(x[6] for x in xs)} |')
med = lambda i: g([statistics.median(x[i] for x in rows if x[0] == c) for c in cats])
print(f'| **geometric mean of medians** | {med(2):.2f} | {med(3):.2f} | {med(4):.2f} | |')
