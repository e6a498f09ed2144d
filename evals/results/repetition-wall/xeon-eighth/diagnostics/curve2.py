import sys, time
sys.path.insert(0, "/work/main/evals"); sys.path.insert(0, "/work/main")
import torch, hf_specdec
from hf_specdec import planner as P
from common import load_pair
from repetition import WORKLOADS, workload_prompts
torch.set_num_threads(2)
target, draft, tok = load_pair("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "cpu")
w = WORKLOADS["pass_at_k"]
prompt = workload_prompts(tok, ["pass_at_k"], 1)["pass_at_k"][0]
ids = torch.tensor([prompt["input_ids"]] * 8)
log = []
orig = P.CostCurve.observe
def observe(self, width, seconds, draft_steps=0, draft_seconds=0.0, columns=0):
    before = (self.verify_price(width), self.verify_price(2), self.slope0, self.rows)
    orig(self, width, seconds, draft_steps, draft_seconds, columns)
    log.append((self.rounds, self.rows, width, columns, round(seconds, 3), draft_steps, round(draft_seconds, 3), [round(x, 3) if isinstance(x, float) else x for x in before], round(self.step_seconds() or 0, 3)))
P.CostCurve.observe = observe
plans = []
orig_plan = P.Planner.plan
def plan(self, retrieved, *a, **k):
    out = orig_plan(self, retrieved, *a, **k)
    width = 1 + max((len(n) for n in out.nodes), default=0)
    exp = sum(1 + sum(r[j] for j in n) for r, n in zip(retrieved, out.nodes)) if not out.draft else None
    plans.append((out.draft, width, None if exp is None else round(exp, 2), round(out.rate, 2), self.curve.rows))
    return out
P.Planner.plan = plan
recs = []
kw = dict(max_new_tokens=int(sys.argv[1]), do_sample=True, temperature=w.temperature, top_p=w.top_p, attention_mask=torch.ones_like(ids))
torch.manual_seed(0); target.generate(ids, custom_generate=hf_specdec.speculative_generate, assistant=draft, **kw)
log.clear()
plans.clear()
torch.manual_seed(1); t = time.perf_counter()
target.generate(ids, custom_generate=hf_specdec.speculative_generate, assistant=draft, acceptance_sink=recs.append, **kw)
print("seconds", time.perf_counter() - t)
print("round rows width columns seconds draft_steps draft_s [price(w) price(2) slope0 rows] step")
emitted = {}
srcs = {}
for r in recs:
    d = r.to_dict()
    emitted[d["round"]] = emitted.get(d["round"], 0) + len(d["emitted_tokens"])
    srcs.setdefault(d["round"], []).append(d["retrieval"] or d["source"][0])
for i, l in enumerate(log):
    p = plans[i] if i < len(plans) else None
    print(*l, "| plan", p, "emitted", emitted.get(i), "".join(x[0] for x in srcs.get(i, [])))
