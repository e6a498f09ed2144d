"""Calibration of retrieved tokens' acceptance (cache and in-row) from probe.py's log: by share, depth and
match size, acceptance against the mean target p(x) and the planner's price a x share; Brier scores.
Usage: python calibration.py LOG.jsonl"""
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
def events(src):
    for r in rows:
        if r["src"] != src: continue
        reach = 1.0
        for j, t in enumerate(r["tokens"]):
            if j > r["accepted"]: break
            yield dict(j=j, share=(r["shares"][j] if r["shares"] else 1.0), size=r["size"], a=r["a"],
                       p=(r["p"][j] if r["p"] and j < len(r["p"]) else None), acc=float(j < r["accepted"]))
for src in ("cache", "ngram"):
    ev = list(events(src))
    if not ev: continue
    print(f"== {src}: {len(ev)} reached tokens, {sum(e['acc'] for e in ev)/len(ev):.3f} accepted, rounds {sum(r['src']==src for r in rows)}")
    for name, key in (("share", lambda e: min(4, int(e['share']*5))), ("depth", lambda e: min(e['j'], 4)),
                      ("size", lambda e: e['size'])):
        g = collections.defaultdict(list)
        for e in ev: g[key(e)].append(e)
        print(f"  by {name}:")
        for k in sorted(g):
            v = g[k]
            acc = sum(e['acc'] for e in v)/len(v)
            p = [e['p'] for e in v if e['p'] is not None]
            pred = sum(e['a']*e['share'] for e in v)/len(v)
            a = sum(e['a'] for e in v)/len(v)
            sh = sum(e['share'] for e in v)/len(v)
            print(f"    {k}: n={len(v):4d} acc={acc:.3f} mean p={sum(p)/max(1,len(p)):.3f} a*share={pred:.3f} a={a:.3f} share={sh:.3f}")
    # Brier of predictors
    def brier(f): return sum((f(e)-e['acc'])**2 for e in ev)/len(ev)
    print("  brier a*share %.4f  a %.4f  share %.4f" % (brier(lambda e: e['a']*e['share']), brier(lambda e: e['a']), brier(lambda e: e['share'])))
