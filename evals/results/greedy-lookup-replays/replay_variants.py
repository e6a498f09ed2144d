"""Deterministic replay (pinned costs) of hf_specdec variants on a recorded run's prompts; work priced with
that run's cost table; compared with the recorded methods' modelled seconds.
usage (from the repository root): python evals/results/greedy-lookup-replays/replay_variants.py FOLDER CATS VARIANT_JSON ...
a variant is an eval ablation's settings: '{}' (the code as it is), '{"config": {"ngram_max_size": 8}}'.
REPLAY_MODE=sampling replays the sampling mode instead (a record folder of a sampling run; seeded per
prompt as the eval seeds it, so variants that draft alike repeat, and texts differ from the recorded
ones: read plain/x over many prompts, not per prompt); best/x is then over plain."""
import json, os, sys, math, statistics, torch
torch.set_num_threads(2)
sys.path.insert(0, "evals")
from pathlib import Path
from common import load_pair, drafts_by_precision, ForwardTimer, MODES, load_prompts
from costs import CostTable
import run_eval
import hf_specdec
from hf_specdec.pair import DRAFT, TARGET
folder, cats = sys.argv[1], sys.argv[2].split(",")
mode = os.environ.get("REPLAY_MODE", "greedy")
variants = [json.loads(v) for v in sys.argv[3:]]
recs = [json.loads(l) for l in open(f"{folder}/records.jsonl")]
order = [r["id"] for r in recs if r["method"] == "plain" and r["mode"] == mode]  # the run's prompt order
plain = [r for r in recs if r["method"] == "plain" and r["category"] in cats and r["mode"] == mode]
rec = {(r["id"], r["method"]): r for r in recs if r["mode"] == mode}
target, draft, tok = load_pair(TARGET.name, DRAFT.name, "cpu", pack=True)
drafts = drafts_by_precision(draft, 8)
table = CostTable.load(Path(folder) / "cost_table.json")
timers = {"target": ForwardTimer(target), "hf": ForwardTimer(drafts["hf"])}
prompts = {p["id"]: p for p in load_prompts(tok, cats, None, "all")}
names = []
for i, v in enumerate(variants):
    name = f"hf_var{i}"; names.append(name)
    run_eval.ABLATIONS[name] = dict(v)
run_eval.HF_METHODS = ("hf_specdec", *run_eval.ABLATIONS, *run_eval.SECOND_DRAFT)
out = {}
for pr in plain:
    p = prompts[pr["id"]]
    ids = torch.tensor([p["input_ids"]])
    window = hf_specdec.SpeculativeConfig().window_for(mode == "sampling")  # as the eval pins it
    pins = {name: table.pinned_costs(ids.shape[1], name, window) for name in drafts}
    base = {k: table.modelled_seconds(rec[(pr["id"], k)]["work"], mode, run_eval._engine(k))
            for k in ("plain", "assisted", "prompt_lookup", "hf_specdec") if (pr["id"], k) in rec}
    line = [f"{pr['category'][:8]:8} {pr['id']:>14} P{ids.shape[1]:5}"]
    for name, v in zip(names, variants):
        for t in timers.values(): t.take()
        seed = order.index(pr["id"])  # the eval seeds each prompt by its index in the run
        seqs, _, stats, rounds, _ = run_eval.run_method(name, target, drafts, ids, MODES[mode], 64, None, seed, pins)
        work = {k: w for k, (_, w) in ((n, t.take_with_work()) for n, t in timers.items()) if w}
        ms = table.modelled_seconds(work, mode, "hf_specdec")
        same = seqs[0, ids.shape[1]:].tolist() == rec[(pr["id"], "plain")]["tokens"]
        best = min(base.get("assisted", base["plain"]), base.get("prompt_lookup", base["plain"]))
        out.setdefault(name, {}).setdefault(pr["category"], []).append((base["plain"] / ms, best / ms, base["hf_specdec"] / ms))
        line.append(f"| v{names.index(name)} plain/x {base['plain']/ms:.2f} best/x {best/ms:.2f} rec/x {base['hf_specdec']/ms:.3f} r{len(rounds)} df{stats.draft_forwards} {'=' if same else 'DIFF'}")
    print(" ".join(line), flush=True)
gm = lambda v: math.exp(statistics.fmean(map(math.log, v)))
for name, v in zip(names, variants):
    per = {c: tuple(round(gm([x[i] for x in xs]), 3) for i in range(3)) for c, xs in out[name].items()}
    allx = [x for xs in out[name].values() for x in xs]
    print(name, v, "per category (plain/x, best/x, recorded hf/x):", per)
    print(name, "geomean of category medians best/x:", round(gm([statistics.median([x[1] for x in xs]) for xs in out[name].values()]), 3),
          "all prompts rec/x:", round(gm([x[2] for x in allx]), 3))
