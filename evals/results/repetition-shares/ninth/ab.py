"""Before/after: per prompt and overall, the modelled speedup over plain (samples pooled by geometric
mean), and paired by seed. Usage: python ab.py BEFORE_DIR AFTER_DIR (each holding <workload>.records.jsonl)."""
import json, sys, math, collections
def load(p):
    return [json.loads(l) for l in open(p)]
for w in ("pass_at_k", "self_consistency"):
    old = load(f"{sys.argv[1]}/{w}.records.jsonl"); new = load(f"{sys.argv[2]}/{w}.records.jsonl")
    def speed(rs):
        per = collections.defaultdict(list)
        for r in rs: per[r["id"]].append(r["plain_modelled_seconds"] / r["modelled_seconds"])
        return per
    o, n = speed(old), speed(new)
    print(f"## {w}: samples old {len(old)} new {len(new)}")
    allo, alln = [], []
    for pid in o:
        if pid not in n: continue
        go = math.exp(sum(map(math.log, o[pid]))/len(o[pid])); gn = math.exp(sum(map(math.log, n[pid]))/len(n[pid]))
        allo += o[pid]; alln += n[pid]
        print(f"  {pid}: old {go:.3f} new {gn:.3f} new/old {gn/go:.3f}  (cache rounds old {sum(r['cache_rounds'] for r in old if r['id']==pid)} new {sum(r['cache_rounds'] for r in new if r['id']==pid)})")
    g = lambda v: math.exp(sum(map(math.log, v))/len(v))
    print(f"  overall (geomean over samples): old {g(allo):.3f} new {g(alln):.3f} new/old {g(alln)/g(allo):.3f}")
    # paired by sample index (same seed), geometric mean of old time / new time
    po = {(r['id'], r['sample']): r['modelled_seconds'] for r in old}; pn = {(r['id'], r['sample']): r['modelled_seconds'] for r in new}
    ks = [k for k in po if k in pn]
    ratios = [po[k]/pn[k] for k in ks]
    print(f"  paired by seed: {g(ratios):.3f} over {len(ks)} samples; new faster on {sum(x>1 for x in ratios)}")
