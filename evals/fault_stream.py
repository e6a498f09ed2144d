"""A stream of short prompts with bad requests mixed in, through `generate_continuous` on tiny models:
how many good prompts completed, how many equal plain greedy, and the process's memory as the stream
goes on (issue 38; the same check, smaller assertions, is `tests/test_faults.py`).

    python evals/fault_stream.py            # 1,000 prompts, 5% bad
    python evals/fault_stream.py 5000 0.1   # 5,000 prompts, 10% bad
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import perturbed, tiny_model  # noqa: E402

import hf_specdec  # noqa: E402


def rss_mb() -> float:
    """Peak resident set size of this process so far, in MB (Linux reports KB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(count: int = 1000, bad_share: float = 0.05, new_tokens: int = 4) -> None:
    torch.set_num_threads(1)
    target = tiny_model("llama", seed=1)
    draft = perturbed(target, noise=0.3)
    gen = torch.Generator().manual_seed(5)
    items, bad, every = [], set(), max(1, round(1 / bad_share))
    for i in range(count):
        prompt = torch.randint(2, 64, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen).tolist()
        if i % every == 7 % every:
            prompt = [[1, 200], [], [prompt, prompt]][(i // every) % 3]  # out of vocabulary, empty, 2-D
            bad.add(i)
        items.append(prompt)
    marks, cache_lengths = [], []

    def on_result(result):
        if (result.index + 1) % (count // 10) == 0:
            marks.append((result.index + 1, rss_mb()))

    start = time.perf_counter()
    results = hf_specdec.generate_continuous(
        target, iter(items), assistant=draft, max_batch_size=8, max_new_tokens=new_tokens, do_sample=False,
        costs=hf_specdec.Costs(draft_step=0.05, verify=0.03), on_result=on_result,
        acceptance_sink=lambda record: cache_lengths.append(record.cache_length),
    )
    seconds = time.perf_counter() - start
    good = [r for r in results if r.ok]
    equal = sum(
        torch.equal(r.tokens, target.generate(torch.tensor([items[r.index]]), do_sample=False,
                                              max_new_tokens=new_tokens)[0, len(items[r.index]):])
        for r in good
    )
    print(f"prompts: {count}, bad: {len(bad)}, results: {len(results)}, failed with an error: "
          f"{sum(not r.ok for r in results)} (the bad ones: {({r.index for r in results if not r.ok} == bad)})")
    print(f"good prompts completed: {len(good)}, equal to plain greedy: {equal}")
    print(f"stream: {seconds:.1f} s; target cache length: max {max(cache_lengths)} over {len(cache_lengths)} row-rounds")
    print("peak RSS (MB) after N results: " + ", ".join(f"{n}: {mb:.0f}" for n, mb in marks))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("count", nargs="?", type=int, default=1000, help="prompts in the stream")
    parser.add_argument("bad_share", nargs="?", type=float, default=0.05, help="share of bad requests")
    args = parser.parse_args()
    main(args.count, args.bad_share)
