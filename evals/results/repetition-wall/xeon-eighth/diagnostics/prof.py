"""Issue 39: a plain round of hf_specdec at 8 rows against transformers' plain step (wall; run alone)."""
import sys, time, json, statistics, cProfile, pstats, io
sys.path.insert(0, "/work/main/evals"); sys.path.insert(0, "/work/main")
import torch
import hf_specdec
from common import load_pair, apply_threads
from repetition import WORKLOADS, workload_prompts
N = int(sys.argv[1]) if len(sys.argv) > 1 else 64
MODE = sys.argv[2] if len(sys.argv) > 2 else "time"
torch.set_num_threads(2)
target, draft, tok = load_pair("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "cpu")
w = WORKLOADS["pass_at_k"]
prompt = workload_prompts(tok, ["pass_at_k"], 1)["pass_at_k"][0]
ids = torch.tensor([prompt["input_ids"]] * 8)
kw = dict(max_new_tokens=N, do_sample=True, temperature=w.temperature, top_p=w.top_p, attention_mask=torch.ones_like(ids))
def plain(seed):
    torch.manual_seed(seed); t = time.perf_counter(); target.generate(ids, **kw); return time.perf_counter() - t
def spec(seed, costs=None, records=None):
    torch.manual_seed(seed); t = time.perf_counter()
    extra = {} if costs is None else {"costs": costs}
    if records is not None: extra["acceptance_sink"] = records.append
    target.generate(ids, custom_generate=hf_specdec.speculative_generate, assistant=draft, **extra, **kw)
    return time.perf_counter() - t
plain(0); spec(0)  # warm
if MODE == "time":
    out = {"plain": [], "spec": [], "spec_plainonly": []}
    for rep in range(2):
        out["plain"].append(plain(rep))
        recs = []; out["spec"].append(spec(rep, records=recs))
        recs2 = []; out["spec_plainonly"].append(spec(rep, costs=hf_specdec.Costs(draft_step=1.0, verify=1.0), records=recs2))
        for name, rr in (("spec", recs), ("plainonly", recs2)):
            rounds = {}
            for r in rr:
                d = r if isinstance(r, dict) else r.to_dict()
                rounds.setdefault(d["round"], []).append(d)
            kinds = {}
            for k, rows in rounds.items():
                kind = "plain" if all(x["source"] == "none" for x in rows) else "other"
                kinds.setdefault(kind, []).append(rows[0]["target_seconds"])
            print(name, rep, {k: (len(v), round(statistics.mean(v), 4)) for k, v in kinds.items()}, flush=True)
        print({k: [round(x, 2) for x in v] for k, v in out.items()}, "per plain step", round(out["plain"][-1] / N, 4), flush=True)
else:
    pr = cProfile.Profile(); pr.enable(); spec(0, costs=hf_specdec.Costs(draft_step=1.0, verify=1.0)); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue())
    pr = cProfile.Profile(); pr.enable(); plain(0); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(20); print(s.getvalue())
