"""Models as PEFT and user code wrap them, and processors that subclass transformers' own. Each case gave
output that differed from plain generate() without a word, or a false refusal. PEFT itself is not a
dependency: its wrappers are imitated by what hf_specdec reads of them (an instance-level
`prepare_inputs_for_generation`, forward pre-hooks by PEFT's function names, a wrapper from a `peft.` module
with `get_base_model`), and peft 0.21 itself was checked by hand (the closing note of this change)."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper

import hf_specdec
from conftest import perturbed, tiny_model

PROMPT = torch.tensor([[1, 5, 9, 12, 17, 33]])


def spec(target, prompt=PROMPT, **kwargs):
    return target.generate(prompt, custom_generate=hf_specdec.speculative_generate, max_new_tokens=12,
                           do_sample=False, **kwargs)


class NoRepeat(TemperatureLogitsWarper):
    """Temperature, and the last token banned: a subclass of a warper that reads input_ids."""

    def __call__(self, input_ids, scores):
        scores = super().__call__(input_ids, scores).clone()
        return scores.scatter_(1, input_ids[:, -1:], -float("inf"))


def test_a_subclass_of_a_warper_sees_the_real_prefix():
    """Before: processors were sorted by isinstance, so this subclass passed as one that never reads input_ids
    and was called with a column of zeros: it banned token 0, not the last one (greedy repeated a token it
    bans), and in a batch it was trusted row by row without a word."""
    target = tiny_model("llama", vocab=64, seed=3, init=1.0)
    draft = perturbed(target, 0.02)
    kwargs = dict(logits_processor=LogitsProcessorList([NoRepeat(1.0)]), max_new_tokens=12, do_sample=False)
    plain = target.generate(PROMPT, **kwargs)
    out = spec(target, assistant=draft, **{k: v for k, v in kwargs.items() if k not in ("max_new_tokens", "do_sample")})
    assert torch.equal(out, plain)
    assert all(a != b for a, b in zip(out[0, 5:-1].tolist(), out[0, 6:].tolist()))
    with pytest.raises(ValueError, match="NoRepeat is not known to allow that"):
        spec(target, PROMPT.repeat(2, 1), assistant=draft, logits_processor=kwargs["logits_processor"])


def test_inputs_prepared_on_the_instance_are_refused():
    """PEFT prompt tuning sets the model's prepare_inputs_for_generation for the call, where it adds its virtual
    tokens. Before: hf_specdec fed token ids to the forward and gave the base model's output."""
    target = tiny_model("llama", vocab=64, seed=3)
    draft = perturbed(target, 0.02)
    original = target.prepare_inputs_for_generation
    target.prepare_inputs_for_generation = lambda *args, **kwargs: original(*args, **kwargs)
    with pytest.raises(ValueError, match="prepare_inputs_for_generation is replaced on the model"):
        spec(target, assistant=draft)
    target.prepare_inputs_for_generation = original  # PEFT's restore: the model's own method, on the instance
    assert torch.equal(spec(target, assistant=draft), target.generate(PROMPT, max_new_tokens=12, do_sample=False))


def _adapter_names_pre_forward_hook(module, args, kwargs):  # PEFT's name; PEFT adds adapter_names=[...] here
    return args, kwargs


def _alora_offsets_pre_forward_hook(module, args, kwargs):
    return args, kwargs


def _seed_shadow_pre_hook(module, args, kwargs):  # ShadowPEFT's, registered for good: it threads a ShadowCache
    return args, kwargs


def test_per_row_adapters_and_alora_are_refused_where_they_would_differ():
    """PEFT's adapter_names= binds one adapter per row when the call starts. Before: a batch lost a row as it
    finished and PEFT's next forward failed inside the decode loop (leaving its hooks on the model, so that
    every later call failed too); aLoRA, which adapts each forward's last positions, would leave a verify
    forward's earlier ones unadapted; ShadowPEFT's own cache failed in a raw size mismatch."""
    target = tiny_model("llama", vocab=64, seed=3)
    draft = perturbed(target, 0.02)
    layer = target.model.layers[0].self_attn.q_proj
    for call in (lambda: spec(target, PROMPT.repeat(2, 1), assistant=draft),
                 lambda: hf_specdec.generate_continuous(target, [[1, 5, 9]], assistant=draft, max_new_tokens=4)):
        layer.register_forward_pre_hook(_adapter_names_pre_forward_hook, with_kwargs=True)
        with pytest.raises(ValueError, match="PEFT adapters per row"):
            call()
        assert not layer._forward_pre_hooks  # PEFT removes them when its call returns; a refused call's, hf_specdec
    handle = layer.register_forward_pre_hook(_adapter_names_pre_forward_hook, with_kwargs=True)
    assert torch.equal(spec(target, assistant=draft), target.generate(PROMPT, max_new_tokens=12, do_sample=False))
    handle.remove()
    layer.register_forward_pre_hook(_alora_offsets_pre_forward_hook, with_kwargs=True)
    with pytest.raises(ValueError, match="aLoRA"):
        spec(target, assistant=draft)
    layer.register_forward_pre_hook(_seed_shadow_pre_hook, with_kwargs=True)
    with pytest.raises(ValueError, match="ShadowPEFT"):
        spec(target, assistant=draft)
    assert list(layer._forward_pre_hooks.values()) == [_seed_shadow_pre_hook]  # ShadowPEFT's own stay


class PeftModelForCausalLM(torch.nn.Module):
    """PEFT's wrapper as hf_specdec sees it: forward(*args, **kwargs), the model's attributes passed through, the
    model at get_base_model()."""

    __module__ = "peft.peft_model"

    def __init__(self, model):
        super().__init__()
        self.base_model = model

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.base_model, name)

    def get_base_model(self):
        return self.base_model

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)


def test_a_peft_draft_drafts_with_its_base_model():
    """Before: a PEFT-wrapped draft was refused as one that 'takes no key-value cache' (its forward takes
    *args, **kwargs), and early_exit_draft said to load it with AutoModelForCausalLM."""
    target = tiny_model("llama", vocab=64, seed=3)
    draft = PeftModelForCausalLM(perturbed(target, 0.02))
    plain = target.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert torch.equal(spec(target, assistant=draft), plain)
    assert torch.equal(spec(target, assistant=hf_specdec.early_exit_draft(PeftModelForCausalLM(target), 1)), plain)
