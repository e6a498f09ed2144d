"""The comparison table of the issue-6 bars from an eval summary: per category, each method's speedup,
hf_specdec over the best transformers method, measured over cost-model prediction, and where hf_specdec's
time went (model forwards / processing and sampling around them / everything else).

    python evals/bars.py runs/quick/summary.json
"""
import json, math, sys
s = json.load(open(sys.argv[1]))["summary"]
cats = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "humaneval"]
gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))
for mode in ("greedy", "sampling"):
    m = s[mode]
    sp = lambda meth, c: m[meth]["categories"][c]["median_speedup"]
    print(f"## {mode}")
    methods = [x for x in ("assisted", "assisted_quantized", "prompt_lookup", "hf_specdec", "hf_k5_model_only", "hf_bf16_draft", "hf_no_adaptive", "hf_no_ngram") if x in m]
    print("| category | " + " | ".join(methods) + " | hf / best transformers | hf predicted | measured/predicted | hf time split fwd/proc/other |")
    ratios = []
    for c in cats:
        best = max(sp("assisted", c), sp("prompt_lookup", c))
        hf = m["hf_specdec"]["categories"][c]
        ratios.append(hf["median_speedup"] / best)
        ts = hf.get("time_split", {})
        print(f"| {c} | " + " | ".join(f"{sp(x, c):.2f}x" for x in methods) + f" | {hf['median_speedup']/best:.2f} | {hf['predicted_speedup']:.2f}x | {hf['median_speedup']/hf['predicted_speedup']:.2f} | " + "/".join(f"{ts.get(k,0):.2f}" for k in ("forwards","processing","other")) + " |")
    print("| geomean | " + " | ".join(f"{m[x]['geomean_speedup']:.2f}x" for x in methods) + f" | {gm(ratios):.2f} | | | |")
    hf = m["hf_specdec"]["categories"]
    print("acceptance / tokens per fwd / ngram rounds / plain rounds / rounds:", {c: (round(hf[c].get("acceptance_rate", 0), 2), round(hf[c]["tokens_per_target_forward"], 2), hf[c].get("ngram_rounds"), hf[c].get("plain_rounds"), hf[c].get("rounds")) for c in cats})
    if mode == "greedy":
        print("greedy match:", {x: all(m[x]["categories"][c].get("all_match_plain") for c in cats) for x in methods})
