"""hf_specdec's top-p against transformers' on the real target's logits at the standard preset's
recorded plain-sampling positions (T 0.7, top-p 0.95, no top-k): the same kept tokens? how many rows
left to transformers' code? the median time a position.

    python evals/results/top-k-positions/top_p_bench.py [THREADS]        (default 1)
"""
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "evals"), str(ROOT)]
from transformers import TemperatureLogitsWarper, TopPLogitsWarper  # noqa: E402

import hf_specdec.sampling as sampling  # noqa: E402
from common import load_pair  # noqa: E402
from costs import recorded_logits  # noqa: E402
from hf_specdec.pair import DRAFT, TARGET  # noqa: E402

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
target, _, tokenizer = load_pair(TARGET.name, DRAFT.name, "cpu")
logits = recorded_logits(target, tokenizer)
ids = torch.zeros(1, 1, dtype=torch.long)
theirs, ours, temperature = TopPLogitsWarper(0.95), sampling.SparseTopPLogitsWarper(0.95), TemperatureLogitsWarper(0.7)
fallbacks, real = [], TopPLogitsWarper.__call__
same, sizes, times = 0, [], {"transformers": [], "hf_specdec": []}
for row in logits:
    scores = temperature(ids, row[None].clone())
    start = time.perf_counter()
    expected = theirs(ids, scores.clone())
    times["transformers"].append(time.perf_counter() - start)
    TopPLogitsWarper.__call__ = lambda self, i, s: fallbacks.append(s.shape[0]) or real(self, i, s)
    start = time.perf_counter()
    got = ours(ids, scores.clone())
    times["hf_specdec"].append(time.perf_counter() - start)
    TopPLogitsWarper.__call__ = real
    same += torch.equal(expected, got)
    sizes.append(int(torch.isfinite(expected).sum()))
n = len(sizes)
print(f"positions {n}, kept tokens equal {same}, rows left to transformers {sum(fallbacks)}; nucleus median "
      f"{statistics.median(sizes)}, 90th percentile {sorted(sizes)[int(0.9 * n)]}, largest {max(sizes)}")
print(", ".join(f"{k} median {statistics.median(v) * 1e3:.2f} ms" for k, v in times.items()))
