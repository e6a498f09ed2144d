"""Float32 linears packed for oneDNN (hf_specdec.cpu) on tiny models built from configs.

Tolerance: the packed model against the same model cast to float32, logits relative error measured
0 on these shapes (float32 GEMMs that block differently could round differently); bound 1e-5. A
wrongly packed weight fails it: each weight's rows rolled by one (another output's weights) gave 1.39,
checked by hand once.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import perturbed, tiny_model
from torch import nn

import hf_specdec
from hf_specdec import cpu
from hf_specdec.cpu import PackedLinear, pack_linears

IDS = torch.randint(2, 64, (2, 24), generator=torch.Generator().manual_seed(1))

pytestmark = pytest.mark.skipif(cpu.packing_problem() is not None, reason=f"{cpu.packing_problem()}")

# Costs pinned where a test asserts that drafts ran and were accepted: measured costs make that depend on timing.
PINNED = dict(costs=hf_specdec.Costs(draft_step=0.1, verify=0.02))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_linear_is_packed_and_logits_are_the_float32_models(arch):
    base = tiny_model(arch).to(torch.bfloat16)
    reference = copy.deepcopy(base).float()
    model = pack_linears(base)
    assert model is base and model.dtype == torch.float32
    assert not [m for m in model.modules() if type(m) is nn.Linear]
    assert isinstance(model.lm_head, PackedLinear)
    assert model.get_output_embeddings().weight.shape == (64, 32)  # the vocabulary size stays readable
    with torch.no_grad():
        ref, out = reference(IDS).logits, model(IDS).logits
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5


def test_a_tied_head_gets_its_own_packed_copy():
    model = tiny_model("qwen2")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    embedding = model.get_input_embeddings().weight.detach().clone()
    with torch.no_grad():
        ref = model(IDS).logits
    pack_linears(model)
    assert isinstance(model.lm_head, PackedLinear) and not model.config.tie_word_embeddings
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    with torch.no_grad():
        assert rel_err(model(IDS).logits, ref) < 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_speculative_decoding_on_a_packed_target_equals_its_plain_greedy(arch):
    target = tiny_model(arch, seed=3)
    draft = perturbed(target, 0.1)  # accepted 10-18 times per run, pinned; at 0.3 once or twice
    pack_linears(target)
    prompt = torch.tensor([[1, 5, 2, 7, 9, 4]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=40)
    for trees in (True, False):
        out = target.generate(
            prompt, custom_generate=hf_specdec.speculative_generate, assistant=draft, do_sample=False,
            max_new_tokens=40, tree=trees, return_dict_in_generate=True, **PINNED,  # measured costs can find no gain (CI)
        )
        assert torch.equal(out.sequences, plain), trees
        assert out.acceptance.drafted > 0 and out.acceptance.accepted > 0  # the draft ran and was verified


def test_a_packed_model_can_be_copied():
    model = pack_linears(tiny_model("llama"))
    twin = copy.deepcopy(model)
    assert twin.lm_head.packed is model.lm_head.packed  # shared, never written
    with torch.no_grad():
        assert torch.equal(twin(IDS).logits, model(IDS).logits)


def test_a_packed_model_is_not_saved_without_its_weights(tmp_path):
    for model in (pack_linears(tiny_model("llama")), copy.deepcopy(pack_linears(tiny_model("llama")))):
        with pytest.raises(RuntimeError, match="q_proj is packed.*Save or load the model before packing"):
            model.save_pretrained(tmp_path)  # wrote a model without a single linear weight, silently
        assert not list(tmp_path.glob("*.safetensors"))
    packed, checkpoint = pack_linears(tiny_model("llama")), tiny_model("llama", seed=5).state_dict()
    with pytest.raises(RuntimeError, match="is packed by hf_specdec.pack_linears"):
        packed.load_state_dict(checkpoint, strict=False)  # skipped every linear weight, silently
    with pytest.raises(RuntimeError, match="is packed by hf_specdec.pack_linears"):
        torch.save(packed, tmp_path / "model.pt")  # torch's message named an opaque tensor's storage


def test_a_packed_model_cast_afterwards_is_named_and_bad_layers_refused():
    """Before: a target cast after packing reached a tree round's SDPA dtype error (and a biased layer oneDNN's
    own error, in plain decoding too); PackedLinear(None) was an AttributeError."""
    model = pack_linears(tiny_model("qwen2")).half()
    model(IDS)  # plain forwards run as torch runs a mixed model: the cast bias is taken back to float32
    with pytest.raises(ValueError, match="has weights in torch.float16: it was cast after packing"):
        model.generate(IDS[:1, :5], custom_generate=hf_specdec.speculative_generate, assistant=model, max_new_tokens=3)
    packed = pack_linears(tiny_model("llama"))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        packed(IDS)  # autocast feeds bf16 activations to float32 weights: taken, as before
    twin = copy.copy(packed.lm_head)  # not through pickling
    assert twin.packed is packed.lm_head.packed
    for bad in (None, tiny_model("llama"), torch.zeros(3, 3), nn.Linear(4, 4, device="meta")):
        with pytest.raises(ValueError, match="PackedLinear packs a torch.nn.Linear on the CPU"):
            PackedLinear(bad)


def test_int8_decode_copies_take_few_rows_and_the_packed_weight_the_rest():
    """pack_linears(decode_bits=8): inputs of at most DECODE_ROWS rows get exactly the int8 weight-only
    layer of the weight as given (bf16 compute), wider ones exactly the packed float32 weight. A copy of
    the wrong weight (another layer's) would fail the closeness check: int8 is within 2% of float32 here."""
    from hf_specdec.quantize import WeightOnlyLinear

    base = tiny_model("qwen2", seed=5).to(torch.bfloat16)
    linear = base.model.layers[0].mlp.up_proj
    int8 = WeightOnlyLinear.from_weight(linear.weight.detach().clone(), None, 8)
    dense = linear.weight.detach().float().clone()
    model = pack_linears(base, decode_bits=8)
    layer = model.model.layers[0].mlp.up_proj
    assert isinstance(layer.decode, WeightOnlyLinear) and layer.decode.compute_dtype == torch.bfloat16
    assert all(m.decode is not None for m in model.modules() if isinstance(m, PackedLinear))
    packed_only = copy.deepcopy(layer)
    packed_only.decode = None
    gen = torch.Generator().manual_seed(0)
    few, many = torch.randn(1, cpu.DECODE_ROWS, 32, generator=gen), torch.randn(1, cpu.DECODE_ROWS + 1, 32, generator=gen)
    with torch.no_grad():
        out_few, out_many = layer(few), layer(many)
        assert out_few.dtype == out_many.dtype == torch.float32
        assert torch.equal(out_few, int8(few.to(torch.bfloat16)).float())
        assert not torch.equal(out_few, packed_only(few))  # int8 rounds differently from float32
        assert torch.equal(out_many, packed_only(many))
        assert rel_err(out_few, few @ dense.T) < 0.02
        # the whole model: a one-token step through the copies stays close to the packed model's
        ids = IDS[:1, :1]
        assert rel_err(model(ids).logits, cpu.without_decode_copies(model)(ids).logits) < 0.05
    for bad in (4, 8.0, True):  # 8.0 was taken as 8
        with pytest.raises(ValueError, match="decode_bits must be None or 8"):
            pack_linears(tiny_model("llama"), decode_bits=bad)


@pytest.mark.parametrize("trees", [True, False])
def test_a_packed_draft_with_int8_copies_drafts_with_them_and_decoding_stays_exact(trees):
    """The draft's one-token steps go through its int8 copies and its prompt encoding through the packed
    weights; greedy output equals plain greedy (q is whatever the draft computed)."""
    target = tiny_model("qwen2", seed=3)
    # noise 0.1: the draft's tokens are accepted often enough (12 of 27 first tokens in chains) that
    # "something was accepted" does not rest on one token (at 0.3, 1 of 12, and 0 after a lookup change)
    draft = perturbed(target, 0.1).to(torch.bfloat16)
    pack_linears(target)
    pack_linears(draft, decode_bits=8)
    rows, copy_calls = [], []  # input rows of every call to one of the draft's layers; those its int8 copy took
    layer = draft.model.layers[0].mlp.up_proj
    layer.register_forward_pre_hook(lambda m, args: rows.append(args[0].reshape(-1, 32).shape[0]))
    layer.decode.register_forward_pre_hook(lambda m, args: copy_calls.append(args[0].shape[0]))
    prompt = torch.tensor([[1, 5, 2, 7, 9, 4, 11, 3]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=40)
    out = target.generate(prompt, custom_generate=hf_specdec.speculative_generate, assistant=draft, do_sample=False,
                          max_new_tokens=40, tree=trees, return_dict_in_generate=True, **PINNED)
    assert torch.equal(out.sequences, plain)
    assert out.acceptance.drafted > 0 and out.acceptance.accepted > 0
    assert copy_calls and all(n <= cpu.DECODE_ROWS for n in copy_calls)  # the int8 copy drafted
    assert len(copy_calls) == sum(n <= cpu.DECODE_ROWS for n in rows)  # and took every few-row call
    assert max(rows) > cpu.DECODE_ROWS  # the prompt's encoding went through the packed weight


def test_bad_models_are_refused_with_the_reason(monkeypatch):
    with pytest.raises(ValueError, match="for models on the CPU; this one has weights on \\['meta'\\]"):
        pack_linears(tiny_model("llama").to("meta"))
    target = tiny_model("llama")
    with pytest.raises(ValueError, match="shares its weights with another"):
        pack_linears(hf_specdec.early_exit_draft(target, 1))
    with pytest.raises(ValueError, match="pack_linears takes a torch model"):
        pack_linears("target")
    with pytest.raises(ValueError, match="weight-only quantized layers"):
        pack_linears(hf_specdec.quantize_weights(tiny_model("llama"), 8))
    with pytest.raises(ValueError, match="already has PackedLinear"):
        hf_specdec.quantize_weights(pack_linears(tiny_model("llama")), 8)
    pack_linears(pack_linears(tiny_model("llama"), decode_bits=8))  # packing again changes nothing, copies and all
    cpu.packing_problem.cache_clear()
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    try:
        with pytest.raises(ValueError, match="has no oneDNN"):
            pack_linears(tiny_model("llama"))
    finally:
        monkeypatch.undo()
        cpu.packing_problem.cache_clear()
    assert type(target.lm_head) is nn.Linear  # nothing was changed by the refusals


def test_targets_whose_forwards_compute_different_functions_are_refused():
    """A target with int8 copies for one-token steps decodes plainly through them and verifies through the
    packed float32 weight (1-2 of 15 prompts parted from plain); an early-exit draft made before its model
    was packed holds the replaced head (a dtype error) or, quantized, the old weights."""
    prompt = torch.tensor([[1, 5, 9, 2, 7]])
    target = pack_linears(tiny_model("llama", seed=2), decode_bits=8)
    with pytest.raises(ValueError, match="int8 copies for one-token steps"):
        target.generate(prompt, custom_generate=hf_specdec.speculative_generate, assistant=perturbed(target, 0.3),
                        max_new_tokens=4)
    twin = cpu.without_decode_copies(target)  # the way out the message names
    out = twin.generate(prompt, custom_generate=hf_specdec.speculative_generate, assistant=perturbed(twin, 0.3),
                        max_new_tokens=8, do_sample=False)
    assert torch.equal(out, twin.generate(prompt, max_new_tokens=8, do_sample=False))
    for replace in (lambda m: pack_linears(m), lambda m: hf_specdec.quantize_weights(m, 8)):
        model = tiny_model("llama", seed=2, layers=3).to(torch.bfloat16)
        stale = hf_specdec.early_exit_draft(model, 1)
        replace(model)
        with pytest.raises(ValueError, match="made before that model's layers were replaced"):
            model.generate(prompt, custom_generate=hf_specdec.speculative_generate, assistant=stale, max_new_tokens=4)
        fresh = hf_specdec.early_exit_draft(model, 1)
        out = model.generate(prompt, custom_generate=hf_specdec.speculative_generate, assistant=fresh,
                             max_new_tokens=6, do_sample=False)
        assert out.shape == (1, 11)


def test_should_pack_follows_the_measured_cost_of_a_multi_token_forward(monkeypatch):
    model = tiny_model("llama")
    cost = cpu.multi_token_cost(model)  # a ratio of two timed forwards, in one-token steps: no bound on a
    assert math.isfinite(cost) and cost > 0  # shared machine (it failed once at < 0.2 or > 20 under load)
    monkeypatch.setattr(cpu, "multi_token_cost", lambda m: 4.0)  # the AVX2 EPYC's bf16 figure
    pack, why = cpu.should_pack(model)
    assert pack and "costs 4.0 one-token steps" in why and "float32" in why
    monkeypatch.setattr(cpu, "multi_token_cost", lambda m: 1.3)
    pack, why = cpu.should_pack(model)
    assert not pack and "cheap enough" in why
    assert cpu.should_pack(pack_linears(model)) == (False, "the target is packed already")


def test_cli_times_the_packed_target_and_the_target_as_loaded(tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))
    from tiny import tiny_pair

    from hf_specdec.cli import main

    target, draft, tokenizer = tiny_pair()
    for folder, model in (("target", target), ("draft", draft)):
        model.save_pretrained(tmp_path / folder)
        tokenizer.save_pretrained(tmp_path / folder)
    main(["generate", "hi", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
          "--max-new-tokens", "12", "--threads", "1", "--pack", "yes"])
    out = capsys.readouterr().out
    assert "plain decoding (packed):" in out and "plain, target as loaded:" in out and "speedup over it:" in out
    assert "the draft is packed like the target with int8 copies for its one-token steps" in out
    assert "identical to plain greedy: True" in out
