"""How long a RetrievalCache.add waits when the cache is full (eviction happens under the cache's lock,
so every lookup of every thread waits with it), and the memory it holds.

    python evals/retrieval_eviction.py                       # 250,000 tokens, 1,200 outputs of 400 tokens
    PYTHONPATH=<a checkout of another revision> python evals/retrieval_eviction.py   # the same, older code

Outputs are drawn from a Zipf law over 30,000 ids (seeded), as text is; each `add` is timed. Prints the
median, 99th percentile and worst add, and `memory_bytes()` at the end. No model is loaded.
"""

from __future__ import annotations

import argparse
import random
import time

import hf_specdec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=250_000)
    parser.add_argument("--outputs", type=int, default=1_200)
    parser.add_argument("--length", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    ids = list(range(30_000))
    weights = [1 / (i + 1) for i in ids]
    cache = hf_specdec.RetrievalCache(max_tokens=args.max_tokens)
    times = []
    for _ in range(args.outputs):
        output = rng.choices(ids, weights, k=args.length)
        start = time.perf_counter()
        cache.add(output)
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"{hf_specdec.__file__}: add median {times[len(times) // 2] * 1e3:.2f} ms, p99 "
          f"{times[int(0.99 * len(times))] * 1e3:.1f} ms, worst {times[-1]:.3f} s; {len(cache)} tokens held, "
          f"{cache.memory_bytes() / 2**20:.0f} MB")


if __name__ == "__main__":
    main()
