import sys, time, torch
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "evals")); sys.path.insert(0, str(ROOT))
from common import load_pair
from transformers import DynamicCache
target, draft, tok = load_pair("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "cpu")
print(torch.get_num_threads())
def bench(rows, width, ctx=150, reps=5):
    ids = torch.randint(100, 1000, (rows, ctx))
    with torch.no_grad():
        c = DynamicCache(config=target.config)
        target(ids, cache=c, use_cache=True)
        new = torch.randint(100, 1000, (rows, width))
        ts = []
        for _ in range(reps):
            extra = c.get_seq_length() - ctx
            if extra: c.crop(-extra)
            t = time.perf_counter(); target(new, cache=c, use_cache=True, logits_to_keep=0); ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts)//2]
for rows, width in [(1,1),(1,8),(8,1),(1,16),(8,2),(2,4),(4,1),(4,2),(8,4)]:
    print(rows, width, round(bench(rows, width)*1000, 1), "ms", flush=True)
x = torch.randn(8, 1536, dtype=torch.bfloat16); w = torch.nn.Linear(1536, 8960, bias=False).to(torch.bfloat16)
for m in (1, 2, 4, 8, 9, 16):
    xx = torch.randn(m, 1536, dtype=torch.bfloat16); w(xx)
    t=time.perf_counter(); [w(xx) for _ in range(20)]; print("linear M", m, round((time.perf_counter()-t)/20*1000,2), "ms")
    xx3 = xx[None]; t=time.perf_counter(); [w(xx3) for _ in range(20)]; print("  3d [1,M]", round((time.perf_counter()-t)/20*1000,2))
    xx3 = xx[:, None]; t=time.perf_counter(); [w(xx3) for _ in range(20)]; print("  3d [M,1]", round((time.perf_counter()-t)/20*1000,2))
