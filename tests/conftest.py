"""Tiny models built from configs (no downloads), shared by the tests."""

from __future__ import annotations

import copy
import os

import pytest
from scipy import stats
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ARCHITECTURES = ("llama", "qwen2", "gpt2")

# Under pytest-xdist (setup.cfg runs one worker per core) each worker gets its share of the cores:
# the tiny models are bound by Python overhead, so workers, not threads, are what use a second core.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def tiny_model(arch: str = "llama", vocab: int = 64, layers: int = 2, seed: int = 0, init: float = 0.3, eos=None):
    """A randomly initialised causal LM small enough to run thousands of times on a CPU.

    `init` is the weight std: 0.3 gives peaked, varied next-token distributions (transformers'
    0.02 default gives near-uniform ones, which make greedy identity a test of rounding noise).
    """
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, initializer_range=init, bos_token_id=1, eos_token_id=eos, pad_token_id=0)
    if arch == "llama":
        config = LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, **common,
        )
        model = LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = Qwen2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, **common,
        )
        model = Qwen2ForCausalLM(config)
    elif arch == "gpt2":
        config = GPT2Config(n_embd=32, n_layer=layers, n_head=4, n_positions=1024, **common)
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(arch)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = eos
    return model.eval()


def perturbed(model, noise: float, seed: int = 123):
    """A draft that agrees with `model` often but not always: its weights plus Gaussian noise."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * noise * param.std().clamp_min(1e-3))
    return draft


@pytest.fixture(params=ARCHITECTURES)
def arch(request):
    return request.param


def chi_square_against(law, samples) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value); cells with expected count < 5 are pooled."""
    counts = {}
    for s in samples:
        assert s in law, f"sampled a sequence the target gives probability 0: {s}"
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    observed, expected, pool_obs, pool_exp = [], [], 0, 0.0
    for cell, prob in law.items():
        if prob * n >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(prob * n)
        else:
            pool_obs += counts.get(cell, 0)
            pool_exp += prob * n
    if pool_exp > 0:
        observed.append(pool_obs)
        expected.append(pool_exp)
    expected = [e * n / sum(expected) for e in expected]
    result = stats.chisquare(observed, expected)
    return float(result.statistic), len(observed) - 1, float(result.pvalue)
