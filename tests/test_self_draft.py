"""Self-speculation (`hf_specdec.early_exit_draft`): the draft is the target's first layers.

What it computes (the target's hidden state after L layers through its own norm and head), that it
copies nothing and leaves the target intact, greedy identity on three architectures, and the
generate-level chi-square with a broken variant that reads q from the full target.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import hf_specdec
from conftest import chi_square_against, tiny_model
from test_exactness import ALPHA, SAMPLES, exact_joint, processors, sample_sequences, spec_kwargs
from hf_specdec.proposals import DraftModelDrafter
from hf_specdec.self_draft import decoder_layers

LAYERS = 4


def final_norm(model):
    """The norm applied after the last decoder layer (Llama/Qwen2 `norm`, GPT-2 `ln_f`)."""
    base = model.base_model
    return getattr(base, "norm", None) or base.ln_f


@torch.no_grad()
def test_early_exit_logits_are_the_head_over_layer_l(arch):
    target = tiny_model(arch, layers=LAYERS, seed=3)
    ids = torch.randint(2, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    out = target(ids, output_hidden_states=True)
    for layers in (1, 2, LAYERS):
        draft = hf_specdec.early_exit_draft(target, layers)
        logits = draft(ids).logits
        if layers == LAYERS:
            expected = out.logits
        else:  # hidden_states[L] is layer L's output before the final norm
            expected = target.get_output_embeddings()(final_norm(target)(out.hidden_states[layers]))
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    # the target is intact and still runs all of its layers
    assert len(decoder_layers(target)[2]) == LAYERS == target.config.num_hidden_layers
    torch.testing.assert_close(target(ids).logits, out.logits)


def test_early_exit_shares_every_weight_and_refuses_in_place_quantization():
    target = tiny_model("qwen2", layers=LAYERS)
    draft = hf_specdec.early_exit_draft(target, 2)
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert {p.data_ptr() for p in draft.parameters()} <= target_ptrs
    assert sum(p.numel() for p in draft.parameters()) < sum(p.numel() for p in target.parameters())
    with pytest.raises(ValueError, match="shares its weights"):
        hf_specdec.quantize_weights(draft, 8)
    with pytest.raises(ValueError, match="num_layers must be an integer from 1 to 4"):
        hf_specdec.early_exit_draft(target, 5)
    for bad in (True, 2.0, "2"):  # a bool is not a layer count (Python says True == 1)
        with pytest.raises(ValueError, match="num_layers must be an integer"):
            hf_specdec.early_exit_draft(target, bad)
    assert hf_specdec.early_exit_draft(target, np.int64(2)).config.num_hidden_layers == 2
    cast = hf_specdec.early_exit_draft(target, 2).half()  # casts the layers it shares: the target is half float16
    with pytest.raises(ValueError, match="now has weights in torch.float16 and torch.float32.*Cast the target, then"):
        target.generate(torch.tensor([[1, 2, 3]]), custom_generate=hf_specdec.speculative_generate, assistant=cast,
                        max_new_tokens=3)  # a raw 'expected m1 and m2 to have the same dtype'


def test_greedy_identity_with_a_self_draft(arch):
    target = tiny_model(arch, layers=LAYERS, seed=5)
    prompt = torch.tensor([[1, 7, 3, 9, 4]])
    plain = target.generate(prompt, max_new_tokens=40, do_sample=False)
    records = []
    out = target.generate(
        prompt, max_new_tokens=40, do_sample=False, custom_generate=hf_specdec.speculative_generate,
        assistant=hf_specdec.early_exit_draft(target, 2), ngram=False, costs=hf_specdec.Costs(draft_step=0.1, verify=0.03),
        acceptance_sink=records.append,
    )
    assert torch.equal(out, plain)
    drafted = sum(len(r.draft_tokens) for r in records)
    accepted = sum(r.num_accepted for r in records)
    assert drafted > 0 and 0 < accepted < drafted  # the early exit drafted, and it is not the target


def test_opt_whose_layers_sit_one_level_down_keeps_greedy_identity():
    """Before: refused ("cannot find the decoder layers"): OPT keeps them at model.decoder.layers, and
    only the base model's children were searched. The decoder between is the draft's own copy."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(5)
    target = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, ffn_dim=64, init_std=0.3,
                                      num_hidden_layers=LAYERS, word_embed_proj_dim=32, max_position_embeddings=256,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=None)).eval()
    target.generation_config.eos_token_id = None
    base, path, layers = decoder_layers(target)
    assert path == "decoder.layers" and layers is target.model.decoder.layers
    draft = hf_specdec.early_exit_draft(target, 2)
    assert len(draft.model.decoder.layers) == draft.model.decoder.config.num_hidden_layers == 2
    assert len(target.model.decoder.layers) == target.model.decoder.config.num_hidden_layers == LAYERS  # intact
    assert {p.data_ptr() for p in draft.parameters()} <= {p.data_ptr() for p in target.parameters()}
    prompt = torch.tensor([[1, 7, 3, 9, 4]])
    plain = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False)
    records = []
    out = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False,
                          custom_generate=hf_specdec.speculative_generate, assistant=draft, ngram=False,
                          costs=hf_specdec.Costs(draft_step=0.1, verify=0.03), acceptance_sink=records.append)
    assert torch.equal(out, plain)
    drafted = sum(len(r.draft_tokens) for r in records)
    assert drafted > 0 and 0 < sum(r.num_accepted for r in records) < drafted


@pytest.fixture(scope="module")
def self_pair():
    target = tiny_model("llama", vocab=8, layers=LAYERS, seed=21, init=0.25)
    return target, hf_specdec.early_exit_draft(target, 2), exact_joint(target)


def test_sampling_with_a_self_draft_is_exact(self_pair):
    target, draft, law = self_pair
    statistic, dof, pvalue = chi_square_against(law, sample_sequences(target, 30, samples=SAMPLES // 2, **spec_kwargs(draft)))
    print(f"\nself draft: chi2={statistic:.1f} dof={dof} p={pvalue:.3f}")
    assert pvalue > ALPHA


class FullTargetQ(DraftModelDrafter):
    """Broken on purpose: samples from the early exit but reports the full target's processed
    distribution as q (so every draft is accepted as if q were p)."""

    def __init__(self, draft, target):
        super().__init__(draft, processors(), do_sample=True)
        self.target = target

    def propose(self, request):
        proposal = super().propose(request)
        ids = torch.cat([request.ids, proposal.tokens], dim=1)
        start, pipeline = request.ids.shape[1], processors()
        full = [pipeline(ids[:, :i], self.target(ids[:, :i]).logits[:, -1].float()) for i in range(start, ids.shape[1])]
        return dataclasses.replace(proposal, draft_probs=torch.softmax(torch.stack(full, dim=1), -1))


def test_broken_self_draft_with_the_full_targets_q_is_detected(self_pair, monkeypatch):
    target, draft, law = self_pair
    broken = FullTargetQ(draft, target)
    # A source of one's own is checked each round: a token its q gives 0 is named at once ...
    with pytest.raises(ValueError, match="a token its draft_probs give probability 0"):
        sample_sequences(target, 31, samples=SAMPLES // 6, **spec_kwargs(None, candidate_generator=broken))
    # ... and the chi-square, run without the check, rejects the law it would have given
    monkeypatch.setattr(hf_specdec.proposals.checked.CheckedDrafter, "check", lambda self, proposal, request: proposal)
    # At 500 samples: chi2 = 241 on 29 dof (the 0.999 quantile is ~58), p = 3e-35
    samples = sample_sequences(target, 31, samples=SAMPLES // 6, **spec_kwargs(None, candidate_generator=broken))
    statistic, dof, pvalue = chi_square_against(law, samples)
    print(f"\nBROKEN self draft (full target's q): chi2={statistic:.1f} dof={dof} p={pvalue:.2e}")
    assert pvalue < ALPHA


def test_hooks_on_the_target_do_not_fire_on_the_draft():
    """The eval times the target and the draft with forward hooks; they must stay apart."""
    target = tiny_model("llama", layers=LAYERS)
    draft = hf_specdec.early_exit_draft(target, 1)
    calls = []
    target.register_forward_hook(lambda *args: calls.append("target"))
    draft.register_forward_hook(lambda *args: calls.append("draft"))
    ids = torch.tensor([[1, 2, 3]])
    target(ids)
    draft(ids)
    assert calls == ["target", "draft"]


def test_a_forward_bound_to_the_target_is_refused_not_copied():
    """Before: the copy kept the instance forward, bound to the target, so the draft ran every layer
    (with accelerate's offloading hooks: the full target's logits, then an IndexError in the cache)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    ids = torch.tensor([[1, 2, 3]])
    hooked = tiny_model("llama", layers=LAYERS)
    add_hook_to_module(hooked, AlignDevicesHook(io_same_device=True))  # what dispatch_model adds
    compiled = tiny_model("llama", layers=LAYERS)
    compiled.model.forward = compiled.model.forward  # an instance forward, as model.forward = torch.compile(...) sets
    for target, name in ((hooked, "dispatch hooks"), (compiled, "forward set on the instance")):
        with pytest.raises(ValueError, match=name):
            hf_specdec.early_exit_draft(target, 1)
    plain = tiny_model("llama", layers=LAYERS)
    assert not torch.allclose(hf_specdec.early_exit_draft(plain, 1)(ids).logits, plain(ids).logits)


def test_cli_runs_with_a_self_draft(tmp_path, capsys):
    """`hf-specdec generate --draft self:L` on a saved tiny target (a local folder), greedy."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))
    from tiny import tiny_pair

    from hf_specdec.cli import main

    target, _, tokenizer = tiny_pair()
    target.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    main(["generate", "hi", "--target", str(tmp_path), "--draft", "self:1", "--max-new-tokens", "12", "--threads", "1"])
    out = capsys.readouterr().out
    assert "identical to plain greedy: True" in out
    assert "cost model:" in out and "a drafted token pays when accepted more often than c + d" in out
    with pytest.raises(SystemExit) as refused:
        main(["generate", "hi", "--target", str(tmp_path), "--draft", "self:x"])
    assert refused.value.code == 2 and "self:L takes a positive number" in capsys.readouterr().err
