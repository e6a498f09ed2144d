"""Continuous batching with speculation: a stream of prompts, at most N rows at a time.

    python examples/continuous_batching.py    # tiny random models built from configs, offline, seconds

Prompts arrive from a generator (some with a budget of their own); each result is printed as its
row finishes, and every greedy output is checked against plain greedy on that prompt alone.
"""

from __future__ import annotations

import copy

import torch

import hf_specdec
from tiny_models import tiny_pair


def close_draft(target, noise: float = 0.01):
    """A draft that agrees with the random target often: its weights plus a little noise (random
    tiny models share nothing a smaller draft could learn)."""
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * noise * param.std())
    return draft


def main() -> None:
    target, _ = tiny_pair()
    draft = close_draft(target)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (int(n),), generator=gen).tolist() for n in torch.randint(3, 40, (12,), generator=gen)]

    def arrivals():  # a serving queue: plain token lists, or dicts with their own max_new_tokens
        for i, prompt in enumerate(prompts):
            yield {"input_ids": prompt, "max_new_tokens": 8} if i % 3 == 0 else prompt

    def show(result: hf_specdec.StreamResult) -> None:
        stats = result.acceptance
        print(f"prompt {result.index:2d} finished: {len(result.tokens)} tokens, "
              f"{stats.mean_tokens_per_round:.2f} tokens per round")

    # The planner measures costs online and, for tiny models at batch 4 on a CPU, may find plain
    # steps cheaper; pinned costs (a draft step 0.1 of a target step) make the mechanics visible.
    results = hf_specdec.generate_continuous(target, arrivals(), assistant=draft, max_batch_size=4,
                                             max_new_tokens=24, do_sample=False, on_result=show,
                                             costs=hf_specdec.Costs(draft_step=0.1, verify=0.03))
    same = all(
        torch.equal(r.tokens, target.generate(torch.tensor([p]), do_sample=False,
                                              max_new_tokens=8 if i % 3 == 0 else 24)[0, len(p):])
        for i, (r, p) in enumerate(zip(results, prompts))
    )
    print(f"{len(results)} results in the order given; every one identical to plain greedy: {same}")


if __name__ == "__main__":
    main()
