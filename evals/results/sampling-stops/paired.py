"""Paired rate ratios, new over old, per category (geometric means): python paired.py OLD1,OLD2 NEW1,NEW2 (replay folders)."""
import json, sys, math, collections
def load(d):
    out={}
    for l in open(d+'/replay.jsonl'):
        r=json.loads(l); out[(r['id'],r['seed'])]=r
    return out
old={}; new={}
for d in sys.argv[1].split(','): old.update(load(d))
for d in sys.argv[2].split(','): new.update(load(d))
cat=collections.defaultdict(list)
for k,n in new.items():
    if k not in old: continue
    o=old[k]
    ratio=(n['new_tokens']/n['modelled_seconds'])/(o['new_tokens']/o['modelled_seconds'])
    cat[n['category']].append(ratio)
allr=[]
for c,v in sorted(cat.items()):
    allr+=v
    print(f"{c:15s} n={len(v):3d} paired geo {math.exp(sum(map(math.log,v))/len(v)):.3f}")
print(f"{'all':15s} n={len(allr):3d} paired geo {math.exp(sum(map(math.log,allr))/len(allr)):.3f}")
