"""Deterministic replay (pinned costs: decisions read no clock) of hf_specdec on recorded prompts with the
code as it is now; work repriced with the recorded run's cost table against the recorded hf_specdec work."""
import json, sys, math, statistics, torch
torch.set_num_threads(2)
sys.path.insert(0, "evals")
from pathlib import Path
from common import load_pair, drafts_by_precision, ForwardTimer, MODES
from costs import CostTable
from run_eval import run_method
from hf_specdec.pair import DRAFT, TARGET
folder, cats = sys.argv[1], sys.argv[2].split(",")
recs = [json.loads(l) for l in open(f"{folder}/records.jsonl")]
rec = {(r["id"], r["method"]): r for r in recs}
prompt_ids = [r for r in recs if r["method"] == "plain" and r["category"] in cats]
target, draft, tok = load_pair(TARGET.name, DRAFT.name, "cpu", pack=True)
drafts = drafts_by_precision(draft, 8)
table = CostTable.load(Path(folder) / "cost_table.json")
timers = {"target": ForwardTimer(target), "hf": ForwardTimer(drafts["hf"])}
from common import load_prompts
prompts = {p["id"]: p for p in load_prompts(tok, cats, None, "all")}
ratios = {}
for pr in prompt_ids:
    p = prompts[pr["id"]]
    ids = torch.tensor([p["input_ids"]])
    assert ids.shape[1] == pr["prompt_tokens"]
    pins = {name: table.pinned_costs(ids.shape[1], name) for name in drafts}
    for t in timers.values(): t.take()
    seqs, seconds, stats, rounds, _ = run_method("hf_specdec", target, drafts, ids, MODES["greedy"], 64, None, 0, pins)
    work = {name: w for name, (_, w) in ((n, t.take_with_work()) for n, t in timers.items()) if w}
    old = rec[(pr["id"], "hf_specdec")]
    a = table.modelled_seconds(old["work"], "greedy", "hf_specdec")
    b = table.modelled_seconds(work, "greedy", "hf_specdec")
    same = seqs[0, ids.shape[1]:].tolist() == old["tokens"]
    ratios.setdefault(pr["category"], []).append(a / b)
    print(f"{pr['category']} {pr['id']} prompt {ids.shape[1]}: speed now/recorded {a / b:.3f} rounds {len(rounds)} vs {old['rounds']} "
          f"draft fwd {stats.draft_forwards} vs {old['draft_forwards']} same tokens {same} same work {work == old['work']}", flush=True)
gm = lambda v: math.exp(statistics.fmean(map(math.log, v)))
print({c: round(gm(v), 3) for c, v in ratios.items()}, "all", round(gm([x for v in ratios.values() for x in v]), 3))
