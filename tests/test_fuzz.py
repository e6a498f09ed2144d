"""Random configurations against plain greedy decoding, with a random clock.

The planner's choices (draft or lookup, how many tokens, which rows) follow the rounds' wall times
unless costs are pinned, so a test run on a quiet machine walks few of the paths a loaded one walks.
Here the loop's clock (`generate.Clock.now`) returns random durations, zero among them, and each case
draws an architecture, prompts, left padding, an EOS or none, a stopping criterion, processors and
speculative settings. Greedy output must equal plain greedy token for token, and nothing may raise.
Fuzzing like this found a ZeroDivisionError on a round timed at 0 s, and batch rows without EOS that
stopped but were padded rather than decoded on as plain generate() does.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_specdec
from conftest import perturbed, tiny_model
from hf_specdec import generate as generate_module

CASES = 60


class StopAfter(StoppingCriteria):
    def __init__(self, tokens: list[int]):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.tokens)


@pytest.fixture
def random_clock(monkeypatch):
    rng, now = random.Random(7), [0.0]

    def tick(self):
        now[0] += 0.0 if rng.random() < 0.3 else 10 ** rng.uniform(-7, 1.5)
        return now[0]

    monkeypatch.setattr(generate_module.Clock, "now", tick)


def draw(rng: random.Random) -> tuple[dict, dict, dict]:
    """(models and inputs, generate() kwargs, hf_specdec settings) for one case."""
    eos = rng.choice([None, 5, [5, 6]])
    case = dict(arch=rng.choice(["llama", "qwen2", "gpt2"]), eos=eos, noise=rng.choice([0.1, 0.5, 2.0]))
    motif = [rng.randint(2, 63) for _ in range(6)]  # repeated often enough that lookups fire
    prompts = [[rng.choice(motif) if rng.random() < 0.7 else rng.randint(2, 63) for _ in range(rng.randint(1, 24))]
               for _ in range(rng.choice([1, 1, 2, 3]))]
    width = max(map(len, prompts))
    case["ids"] = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    case["mask"] = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(max_new_tokens=rng.randint(1, 32), do_sample=False, pad_token_id=0)
    if rng.random() < 0.4:
        kwargs["stopping_criteria"] = StoppingCriteriaList([StopAfter(rng.sample(range(2, 64), rng.randint(1, 6)))])
    if rng.random() < 0.2:
        kwargs["repetition_penalty"] = 1.3
    if rng.random() < 0.2:
        kwargs["min_new_tokens"] = rng.randint(0, kwargs["max_new_tokens"])
    settings = dict(num_draft_tokens=rng.randint(1, 10), tree=rng.random() < 0.7, ngram=rng.random() < 0.8,
                    tree_max_nodes=rng.randint(1, 30), draft_window=rng.choice(["auto", None, 4, 16]))
    if rng.random() < 0.2:
        settings["adaptive"] = False
    if rng.random() < 0.3:
        settings["costs"] = hf_specdec.Costs(draft_step=rng.uniform(0.01, 1.0), verify=rng.uniform(0, 0.5))
    return case, kwargs, settings


def test_random_configurations_equal_plain_greedy(random_clock):
    rng, models = random.Random(2026), {}
    for n in range(CASES):
        case, kwargs, settings = draw(rng)
        key = (case["arch"], str(case["eos"]), case["noise"])
        if key not in models:
            target = tiny_model(case["arch"], seed=7, eos=case["eos"])
            models[key] = (target, perturbed(target, noise=case["noise"]))
        target, draft = models[key]
        plain = target.generate(case["ids"], attention_mask=case["mask"], **kwargs)
        out = target.generate(case["ids"], attention_mask=case["mask"], custom_generate=hf_specdec.speculative_generate,
                              assistant=draft, **kwargs, **settings)
        assert torch.equal(out, plain), f"case {n}: {case['arch']} eos={case['eos']} rows={len(case['ids'])} {kwargs} {settings}"
