"""Weight-only int8 / int4 quantization (hf_specdec.quantize) on tiny models built from configs.

Tolerances. Layer level (random input through one layer, relative Frobenius error against the
unquantized float Linear): measured about 0.006 for int8 and 0.09 for int4 (group 32), bounds
0.02 and 0.15. Model level (tiny models have std 0.3 weights, which amplify errors through
the layers): logits relative error measured 0.03-0.045 for int8 and 0.42-0.46 for int4, bounds
0.1 and 0.75. Checked by hand once: with the scales doubled (int8 `scales *= 2`, int4
`scale_and_zero[..., 0] *= 2`) the layer error is about 1.0 and the model logits error 1.5-1.8,
so every bound below fails for that broken variant.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model
from torch import nn

import hf_specdec
from hf_specdec import quantize as quantize_module
from hf_specdec.quantize import WeightOnlyLinear, quantize_weights

GROUP = 32  # tiny models have hidden 32 / intermediate 64; the int4 kernel takes groups of 32..256
LAYER_TOL = {8: 0.02, 4: 0.15}
MODEL_TOL = {8: 0.1, 4: 0.75}
IDS = torch.randint(2, 64, (2, 24), generator=torch.Generator().manual_seed(1))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def linears(model) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if type(m) is nn.Linear}


def tied_model(arch: str = "qwen2"):
    model = tiny_model(arch)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    return model


def test_a_model_without_linear_layers_is_named_as_unchanged(caplog):
    """Before: GPT-2 (transformers' Conv1D layers, a tied head) asked for int8 stayed float, said at info level."""
    with caplog.at_level("WARNING", logger="hf_specdec"):
        quantize_weights(tiny_model("gpt2"), 8)
    assert "found no torch.nn.Linear layer to quantize in GPT2LMHeadModel" in caplog.text


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_linear_is_replaced(arch, bits):
    model = tiny_model(arch)  # untied head: an ordinary Linear, quantized too
    names = set(linears(model))
    assert quantize_weights(model, bits, group_size=GROUP) is model
    assert not linears(model)
    replaced = {name for name, m in model.named_modules() if isinstance(m, WeightOnlyLinear)}
    assert replaced == names and "lm_head" in replaced
    assert all(m.bits == bits for m in model.modules() if isinstance(m, WeightOnlyLinear))
    # Code that reads the vocabulary size from the head (hf_specdec does) keeps working.
    assert model.get_output_embeddings().weight.shape == (64, 32)


@pytest.mark.parametrize("bits", [8, 4])
def test_tied_head_is_kept_by_default(bits):
    model = tied_model()
    embedding = model.get_input_embeddings().weight
    quantize_weights(model, bits, group_size=GROUP)
    assert list(linears(model)) == ["lm_head"]
    assert model.lm_head.weight is embedding is model.get_input_embeddings().weight
    assert model.config.tie_word_embeddings


@pytest.mark.parametrize("bits", [8, 4])
def test_tied_head_quantized_as_untied_copy(bits):
    model = tied_model()
    reference = copy.deepcopy(model)
    before = model.get_input_embeddings().weight.detach().clone()
    quantize_weights(model, bits, group_size=GROUP, include_lm_head=True)
    assert not linears(model)
    assert isinstance(model.lm_head, WeightOnlyLinear)
    assert torch.equal(model.get_input_embeddings().weight, before)  # the embedding keeps its float weight
    assert not model.config.tie_word_embeddings
    model.tie_weights()  # does not try to tie the quantized head back
    assert isinstance(model.lm_head, WeightOnlyLinear)
    with torch.no_grad():
        assert rel_err(model(IDS).logits, reference(IDS).logits) < MODEL_TOL[bits]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_layer_outputs_close(bits, dtype):
    model = tiny_model("qwen2").to(dtype)  # qwen2's q/k/v projections carry a bias
    gen = torch.Generator().manual_seed(0)
    for name, linear in linears(model).items():
        layer = WeightOnlyLinear.from_linear(linear, bits, GROUP, name)
        x = torch.randn(3, 5, linear.in_features, generator=gen).to(dtype)  # [batch, seq, in]
        with torch.no_grad():
            out = layer(x)
            ref = nn.functional.linear(x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
        assert out.shape == (3, 5, linear.out_features) and out.dtype == dtype
        assert rel_err(out, ref) < LAYER_TOL[bits], name
        # The kernel computes with exactly the weight dequantize() reports (up to dtype rounding).
        deq = nn.functional.linear(x.float(), layer.dequantize().float(), None if linear.bias is None else linear.bias.float())
        assert rel_err(out, deq) < 1e-2, name


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_outputs_close(arch, bits):
    base = tiny_model(arch)
    model = quantize_weights(copy.deepcopy(base), bits, group_size=GROUP)
    with torch.no_grad():
        ref, out = base(IDS).logits, model(IDS).logits
    assert rel_err(out, ref) < MODEL_TOL[bits]
    if bits == 8:
        assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_draft_keeps_greedy_speculative_output(bits):
    target = tiny_model("qwen2", seed=0)
    draft = quantize_weights(tiny_model("qwen2", seed=0), bits, group_size=GROUP)
    prompt = torch.tensor([[1, 5, 2, 7]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=12)
    spec = target.generate(
        prompt, custom_generate=hf_specdec.speculative_generate, assistant=draft, do_sample=False, max_new_tokens=12
    )
    assert torch.equal(spec, plain)


@pytest.mark.parametrize("bits", [0, 2, 3, 32, "8", 8.0, True])
def test_bad_bits_raise(bits):
    with pytest.raises(ValueError, match=f"bits={bits!r}"):
        quantize_weights(tiny_model(), bits)


def test_bad_models_and_skips_are_named():
    """A non-model was an AttributeError, a skip given as one string was split into its letters, and a
    model quantized already was left as it was (int8 asked for int4) without a word."""
    for bad in ("draft", None, torch.zeros(3)):
        with pytest.raises(ValueError, match="takes a torch model"):
            quantize_weights(bad, 8)
        with pytest.raises(ValueError, match="takes a transformers causal LM"):
            hf_specdec.early_exit_draft(bad, 1)
    with pytest.raises(ValueError, match="takes a transformers causal LM .* got LlamaModel"):  # an AttributeError
        hf_specdec.early_exit_draft(tiny_model().model, 1)
    with pytest.raises(ValueError, match="include_lm_head must be True or False"):  # "yes" was taken
        quantize_weights(tiny_model(), 8, include_lm_head="yes")
    model = quantize_weights(tiny_model(), 8, skip="model.layers.0.mlp.down_proj")
    assert type(model.get_submodule("model.layers.0.mlp.down_proj")) is torch.nn.Linear
    with pytest.raises(ValueError, match="already has WeightOnlyLinear layers"):
        quantize_weights(model, 4)


def test_bare_linears_meta_weights_and_odd_skips_are_named():
    """Before: a bare Linear stayed float under a child named ''; offloaded (meta) weights were quantized
    into meta buffers that the int kernels read as garbage (1e21); skip=None and skip=5 were TypeErrors."""
    import numpy as np
    from accelerate import init_empty_weights

    with pytest.raises(ValueError, match="wrap a bare nn.Linear"):
        quantize_weights(nn.Linear(32, 32), 8)
    with init_empty_weights():
        empty = tiny_model()
    with pytest.raises(ValueError, match="have theirs on meta"):
        quantize_weights(empty, 8)
    with pytest.raises(ValueError, match="skip must be module names"):
        quantize_weights(tiny_model(), 8, skip=5)
    model = quantize_weights(tiny_model(), np.int64(8), skip=None)  # a sweep's numpy value; no skips
    assert all(type(m) is not nn.Linear for m in model.model.layers.modules())


def test_weights_another_library_quantized_are_named():
    """From a probe with torchao 0.18: its quantized weights are tensor subclasses, and quantize_weights and
    pack_linears met them in torchao's raw NotImplementedError (aten.abs on Int8Tensor)."""

    class Quantized(torch.Tensor):  # what a weight quantized by torchao is: a torch.Tensor subclass
        pass

    model = tiny_model()
    layer = model.model.layers[0].mlp.up_proj
    layer._parameters["weight"] = torch.Tensor._make_subclass(Quantized, layer.weight.detach(), False)
    with pytest.raises(ValueError, match=r"quantize_weights needs float weights; 1 Linear layers hold a tensor subclass.*"
                                         r"model.layers.0.mlp.up_proj', 'Quantized'"):
        quantize_weights(model, 8)
    if hf_specdec.cpu.packing_problem() is None:
        with pytest.raises(ValueError, match="pack_linears needs float weights"):
            hf_specdec.pack_linears(model)
    assert type(layer) is nn.Linear and type(layer.weight) is Quantized  # nothing changed


def test_bits_16_is_a_no_op():
    model = tiny_model()
    modules = dict(model.named_modules())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert quantize_weights(model, 16) is model
    assert dict(model.named_modules()) == modules
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_skip_keeps_named_layers():
    model = tiny_model()
    skip = ("model.layers.0.mlp.down_proj", "lm_head")
    quantize_weights(model, 8, skip=skip)
    assert set(linears(model)) == set(skip)


def test_unknown_skip_name_raises():
    with pytest.raises(ValueError, match="lm-head"):
        quantize_weights(tiny_model(), 8, skip=("lm-head",))


def test_int4_shape_errors_name_the_layer_and_change_nothing():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"in_features=32 is not a multiple of group_size=64"):
        quantize_weights(model, 4, group_size=64)  # attention projections have in_features 32
    assert not any(isinstance(m, WeightOnlyLinear) for m in model.modules())
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_weights(model, 4, group_size=16)


def test_missing_kernel_raises(monkeypatch):
    quantize_module._kernel_problem.cache_clear()
    monkeypatch.delattr(torch, "_weight_int4pack_mm_for_cpu")
    try:
        with pytest.raises(ValueError, match="int4 weight-only needs torch._weight_int4pack_mm_for_cpu, not in this torch build"):
            quantize_weights(tiny_model(), 4, group_size=GROUP)
    finally:
        quantize_module._kernel_problem.cache_clear()
