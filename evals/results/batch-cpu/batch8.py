import sys, time, torch
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "evals")); sys.path.insert(0, str(ROOT))
import hf_specdec
from common import load_pair
from repetition import WORKLOADS, workload_prompts
target, draft, tok = load_pair("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "cpu")
wname = sys.argv[1]; N = int(sys.argv[2]); idx = int(sys.argv[3]) if len(sys.argv) > 3 else 0
wl = WORKLOADS[wname]
prompt = workload_prompts(tok, [wname], idx + 1)[wname][idx]
ids = torch.tensor([prompt["input_ids"]] * 8)
eos = target.generation_config.eos_token_id
def call(method, n=N):
    kw = dict(max_new_tokens=n, **wl.sampling())
    rounds = []
    if method != "plain":
        kw.update(custom_generate=hf_specdec.speculative_generate, assistant=draft, acceptance_sink=rounds.append)
        if method.startswith("k"):
            kw.update(adaptive=False, num_draft_tokens=int(method[1:]))
    torch.manual_seed(0)
    t = time.perf_counter()
    out = target.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    s = time.perf_counter() - t
    new = out[:, ids.shape[1]:]
    toks = 0
    for row in new.tolist():
        toks += next((i + 1 for i, x in enumerate(row) if x == eos), len(row))
    drafted = sum(1 for r in rounds if getattr(r, "source", "") == "draft") if rounds else 0
    return s, toks, len(rounds), drafted
methods = sys.argv[4].split(",") if len(sys.argv) > 4 else ["plain", "adaptive", "k2", "k4"]
for m in methods: call(m, 4)
res = {}
for m in methods:
    s, toks, r, d = call(m)
    res[m] = toks / s
    print(m, f"{s:.1f}s {toks} tok {toks/s:.2f} tok/s rows-rounds {r} draft-row-rounds {d} vs plain {res[m]/res[methods[0]]:.2f}", flush=True)
