"""Distilling the draft toward the target (`hf_specdec.distill`) on tiny models: the divergence falls,
the saved draft reloads with identical logits, an interrupted run resumes exactly, and a distilled
draft keeps generation exact (greedy identity; the sampled law by chi-square)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_specdec
from conftest import chi_square_against, perturbed, tiny_model
from hf_specdec.distill import DistillConfig, Distiller, divergence
from test_exactness import ALPHA, SAMPLES, exact_joint, sample_sequences, spec_kwargs

PROMPTS = [[1, 5, 9, 13, 2, 7], [1, 3, 3, 8, 21, 4, 6], [1, 40, 2, 11]]


def make_pair(vocab=64, layers=3):
    target = tiny_model("llama", vocab=vocab, layers=layers, seed=7)
    return target, perturbed(target, noise=0.6, seed=8)


@torch.no_grad()
def held_out_divergence(target, draft, kind="fkl") -> float:
    """The divergence on fixed texts (no sampling): the quantity training should lower."""
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 30, 31, 8, 9, 10, 2, 5, 60, 4]])
    return divergence(target(ids).logits, draft(ids).logits, kind).item()


@pytest.mark.parametrize("kind", ["fkl", "tv"])
def test_distillation_lowers_the_divergence(tmp_path, kind):
    target, draft = make_pair()
    before = held_out_divergence(target, draft, kind)
    config = DistillConfig(divergence=kind, steps=30, lr=3e-3, new_tokens=12, train_layers=(0, 1, 2), checkpoint_every=100)
    distiller = Distiller(target, draft, config, tmp_path)
    losses = distiller.train(PROMPTS, progress=False)
    after = held_out_divergence(target, distiller.draft, kind)
    print(f"\n{kind}: held-out {before:.4f} -> {after:.4f}; training loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    # Deterministic (seeded samples, fixed texts). Measured: tv (a weaker gradient than fkl) falls by
    # 11% in these 30 steps; an untrained draft (lr = 0) stays where it was and fails this.
    assert after < 0.95 * before
    # only the chosen layers moved: the embeddings and the head are the draft's own
    assert torch.equal(distiller.draft.get_output_embeddings().weight, draft.get_output_embeddings().weight)


@pytest.mark.parametrize("draft_vocab", [198, 202])
def test_a_draft_with_padding_rows_is_distilled_on_the_rows_both_score(tmp_path, draft_vocab):
    """Before: refused ("vocabularies differ"), though generate() takes such a pair. The divergence is
    taken over the shared rows, and a wider draft never samples an id the target lacks."""
    target = tiny_model("llama", vocab=200, layers=3, seed=7)
    draft = perturbed(target, noise=0.6, seed=8)
    draft.resize_token_embeddings(draft_vocab, mean_resizing=False)
    with torch.no_grad():  # a wider draft's extra rows made likely: sampling them would crash the target's forward
        draft.lm_head.weight[198:] = 3 * draft.lm_head.weight[198:].abs().mean() * torch.sign(draft.lm_head.weight[0])
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 30, 31, 8, 9, 10, 2, 5, 60, 4]])
    shared = lambda model: model(ids).logits[..., :198]  # noqa: E731
    with torch.no_grad():
        before = divergence(shared(target), shared(draft), "fkl").item()
    config = DistillConfig(steps=20, lr=3e-3, new_tokens=12, train_layers=(0, 1, 2), checkpoint_every=100)
    distiller = Distiller(target, draft, config, tmp_path)
    losses = distiller.train(PROMPTS, progress=False)
    with torch.no_grad():
        after = divergence(shared(target), shared(distiller.draft), "fkl").item()
    assert all(loss == loss for loss in losses) and after < 0.95 * before
    bad = [1, min(200, draft_vocab)]
    with pytest.raises(ValueError, match=f"prompt id {bad[1]} is past the {bad[1]} vocabulary rows both models score"):
        distiller.step(bad)
    config = DistillConfig(steps=25, lr=3e-3, new_tokens=12, train_layers=(0, 1, 2), checkpoint_every=100)
    with pytest.raises(ValueError, match="past the"):  # named before any step of the run
        Distiller(target, draft, config, tmp_path / "again").train(PROMPTS + [bad], progress=False)
    assert not (tmp_path / "again" / "checkpoint.pt").exists()


def test_untrained_layers_stay_and_the_divergence_is_zero_for_the_target_itself(tmp_path):
    target, draft = make_pair()
    original = copy.deepcopy(draft)
    distiller = Distiller(target, draft, DistillConfig(steps=2, lr=1e-2, new_tokens=4, train_layers=(2,)), tmp_path)
    distiller.step(PROMPTS[0])
    trained = dict(distiller.draft.named_parameters())
    for name, param in original.named_parameters():
        moved = not torch.equal(param, trained[name])
        assert moved == name.startswith("model.layers.2."), name
    logits = target(torch.tensor([PROMPTS[0]])).logits
    assert divergence(logits, logits, "fkl").abs().item() < 1e-6
    assert divergence(logits, logits, "tv").item() < 1e-6


def test_saved_draft_reloads_with_identical_logits(tmp_path):
    target, draft = make_pair()
    distiller = Distiller(target, draft, DistillConfig(steps=3, lr=1e-2, new_tokens=6), tmp_path / "run")
    distiller.train(PROMPTS, progress=False)
    folder = distiller.save_draft(tmp_path / "draft")
    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, distiller.draft(ids).logits, rtol=0, atol=0)
    assert not torch.equal(reloaded(ids).logits, draft_before_training_logits(ids))


def draft_before_training_logits(ids):
    with torch.no_grad():
        return make_pair()[1](ids).logits


def test_an_interrupted_run_resumes_where_it_stopped(tmp_path):
    target, _ = make_pair()
    config = DistillConfig(steps=4, lr=1e-2, new_tokens=6, checkpoint_every=2)
    straight = Distiller(target, make_pair()[1], config, tmp_path / "straight")
    straight.train(PROMPTS, progress=False)
    # the same run stopped after 2 steps, then a new process (a new Distiller on a fresh draft) resumes
    Distiller(target, make_pair()[1], DistillConfig(**{**config.__dict__, "steps": 2}), tmp_path / "cut").train(PROMPTS, progress=False)
    resumed = Distiller(target, make_pair()[1], config, tmp_path / "cut")
    assert resumed.step_count == 2
    resumed.train(PROMPTS, progress=False)
    assert resumed.losses == straight.losses
    for (name, a), (_, b) in zip(straight.draft.named_parameters(), resumed.draft.named_parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="other settings"):
        Distiller(target, make_pair()[1], DistillConfig(**{**config.__dict__, "lr": 1.0}), tmp_path / "cut")


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="divergence"):
        DistillConfig(divergence="rkl")
    target, draft = make_pair()
    with pytest.raises(ValueError, match="train_layers"):
        Distiller(target, draft, DistillConfig(train_layers=(7,)), "unused")
    with pytest.raises(ValueError, match="vocabularies differ"):
        Distiller(target, tiny_model("llama", vocab=32), DistillConfig(), "unused")


@pytest.fixture(scope="module")
def distilled_pair(tmp_path_factory):
    target = tiny_model("llama", vocab=8, seed=21, init=0.25)
    draft = perturbed(target, noise=0.4)
    distiller = Distiller(target, draft, DistillConfig(steps=10, lr=3e-3, new_tokens=4, train_layers=(0, 1)),
                          tmp_path_factory.mktemp("distil"))
    distiller.train([[1, 5, 2], [1, 2, 3, 4]], progress=False)
    return target, distiller.draft, exact_joint(target)


def test_distilled_draft_keeps_greedy_identity(distilled_pair):
    target, draft, _ = distilled_pair
    prompt = torch.tensor([[1, 5, 2, 7, 3]])
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False)
    out = target.generate(prompt, max_new_tokens=30, do_sample=False, custom_generate=hf_specdec.speculative_generate,
                          assistant=draft, ngram=False)
    assert torch.equal(out, plain)


def test_distilled_draft_sampling_is_exact(distilled_pair):
    target, draft, law = distilled_pair
    statistic, dof, pvalue = chi_square_against(law, sample_sequences(target, 40, samples=SAMPLES // 2, **spec_kwargs(draft)))
    print(f"\ndistilled draft: chi2={statistic:.1f} dof={dof} p={pvalue:.3f}")
    assert pvalue > ALPHA


class Recording(Distiller):
    """Records which prompt each step takes (no forward)."""

    def step(self, prompt):
        self.taken = getattr(self, "taken", []) + [tuple(prompt)]
        self.step_count += 1
        self.losses.append(0.0)
        return 0.0


def test_prompts_are_taken_in_a_seeded_shuffled_order_each_once_per_pass(tmp_path):
    target, draft = make_pair()
    prompts = [[1, i] for i in range(2, 12)]
    runs = []
    for seed in (0, 0, 1):
        distiller = Recording(target, copy.deepcopy(draft), DistillConfig(steps=20, seed=seed, checkpoint_every=100), tmp_path / f"s{len(runs)}")
        distiller.train(prompts, progress=False)
        runs.append(distiller.taken)
    first, again, other = runs
    assert first == again  # the order is the seed's
    assert sorted(first[:10]) == sorted(map(tuple, prompts)) and first[10:] == first[:10]  # each once a pass
    assert first[:10] != [tuple(p) for p in prompts]  # not the order given (categories one after another)
    assert other != first


# ---------------------------------------------------------------- refused up front, named


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_early_exit_draft_is_refused_before_the_target_changes(tmp_path, dtype):
    """Before: its layers are the target's, so training moved the target's weights (float32), or
    draft.float() left the target half float32 and its first forward failed (bfloat16)."""
    target = tiny_model("llama", layers=3, seed=7).to(dtype)
    before = {name: t.clone() for name, t in target.state_dict().items()}
    for draft in (hf_specdec.early_exit_draft(target, 2), target):
        with pytest.raises(ValueError, match=r"shares its weights with the target.*copy\.deepcopy"):
            Distiller(target, draft, DistillConfig(steps=2, lr=1e-2, new_tokens=4), tmp_path)
    assert all(torch.equal(t, before[name]) for name, t in target.state_dict().items())
    assert {p.dtype for p in target.parameters()} == {dtype}
    # the copy the message suggests trains, and the target stays as it was
    draft = copy.deepcopy(hf_specdec.early_exit_draft(target, 2))
    Distiller(target, draft, DistillConfig(steps=2, lr=1e-2, new_tokens=4), tmp_path).train(PROMPTS, progress=False)
    assert all(torch.equal(t, before[name]) for name, t in target.state_dict().items())
    assert {p.dtype for p in target.parameters()} == {dtype}


@pytest.mark.parametrize("field, value, message", [
    ("context", 4.5, "context must be a positive integer"),  # a TypeError at the first slice
    ("lr", "1e-3", "lr must be a finite number >= 0"),  # a TypeError inside AdamW
    ("lr", float("nan"), "lr must be a finite number >= 0"),
    ("temperature", float("inf"), "temperature must be a finite number > 0"),  # trained nothing, loss 0, no error
    ("temperature", 0, "temperature must be a finite number > 0"),
    ("train_layers", (1.0,), "train_layers must be None or a non-empty tuple"),  # a TypeError
    ("train_layers", 1, "train_layers must be None or a non-empty tuple"),
    ("train_layers", (-1,), "train_layers must be None or a non-empty tuple"),
    ("steps", True, "steps must be a positive integer"),
    ("seed", "0", "seed must be an integer >= 0"),
])
def test_bad_config_values_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        DistillConfig(**{field: value})


def test_numpy_values_are_kept_as_plain_numbers(tmp_path):
    """The checkpoint's JSON writes them (a numpy integer is not JSON)."""
    np = pytest.importorskip("numpy")
    config = DistillConfig(steps=np.int64(1), lr=np.float32(1e-3), new_tokens=np.int64(4), train_layers=[np.int64(2)])
    assert (config.steps, config.train_layers, type(config.lr)) == (1, (2,), float)
    target, draft = make_pair()
    Distiller(target, draft, config, tmp_path).train(PROMPTS, progress=False)
    assert (tmp_path / "checkpoint.json").exists()


@pytest.mark.parametrize("prompts, message", [
    ([], "train takes a non-empty list of prompts"),  # ZeroDivisionError
    ([[]], "a prompt must be a non-empty list of token ids"),  # a float tensor in the embedding
    ([[1, -3, 4]], r"prompt ids must be integers >= 0, got -3"),  # an IndexError in the embedding
    ([[1, 2.5]], r"prompt ids must be integers >= 0, got 2\.5"),
    ([1, 2, 3], "a prompt must be a non-empty list of token ids, got 1"),  # one prompt, not a list of them
])
def test_bad_prompts_are_named_before_any_step(tmp_path, prompts, message):
    target, draft = make_pair()
    with pytest.raises(ValueError, match=message):
        Distiller(target, draft, DistillConfig(steps=2, new_tokens=4, checkpoint_every=1), tmp_path).train(prompts, progress=False)
    assert not (tmp_path / "checkpoint.pt").exists()


def test_drafts_it_cannot_train_are_named(tmp_path):
    target, _ = make_pair()
    # one layer: the message named train_layers (-1, 0), which the caller never passed
    with pytest.raises(ValueError, match=r"the draft has 1 decoder layer.*train_layers=\(0,\)"):
        Distiller(target, tiny_model("llama", layers=1, seed=8), DistillConfig(), tmp_path)
    Distiller(target, tiny_model("llama", layers=1, seed=8), DistillConfig(train_layers=(0,)), tmp_path)
    # quantized or packed: the first backward failed (no derivative of the int8 matmul)
    from hf_specdec.cpu import pack_linears

    for draft in (hf_specdec.quantize_weights(perturbed(target, 0.5), 8), pack_linears(perturbed(target, 0.5))):
        with pytest.raises(ValueError, match="(WeightOnlyLinear|PackedLinear) layers .*distil the draft as loaded"):
            Distiller(target, draft, DistillConfig(), tmp_path)


def gpt2_with_16_positions():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=64, bos_token_id=1,
                        eos_token_id=None, initializer_range=0.3)
    return GPT2LMHeadModel(config).eval()


def test_the_default_context_is_capped_at_the_models_positions(tmp_path):
    """Before: context's default 256 with a GPT-2 of 16 positions: an IndexError in the position
    embedding at the first prompt longer than 16 - new_tokens."""
    target = gpt2_with_16_positions()
    distiller = Distiller(target, perturbed(target, 0.5), DistillConfig(steps=2, new_tokens=4), tmp_path)
    assert distiller.context == 12
    losses = distiller.train([list(range(2, 40))], progress=False)
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    with pytest.raises(ValueError, match=r"context=100 and new_tokens=4 need more than the 16 positions.*context to 12"):
        Distiller(target, perturbed(target, 0.5), DistillConfig(context=100, new_tokens=4), tmp_path / "set")
    with pytest.raises(ValueError, match="new_tokens=16 leaves no room for a prompt in the 16 positions"):
        Distiller(target, perturbed(target, 0.5), DistillConfig(new_tokens=16), tmp_path / "long")


def test_resuming_with_another_draft_is_named(tmp_path):
    """Before: a KeyError (another layer count) or a size RuntimeError (another width) from copy_."""
    target, _ = make_pair()
    config = DistillConfig(steps=1, lr=1e-3, new_tokens=4)
    Distiller(target, tiny_model("llama", layers=3, seed=8), config, tmp_path).train(PROMPTS, progress=False)
    again = DistillConfig(steps=2, lr=1e-3, new_tokens=4)
    with pytest.raises(ValueError, match=r"written for another draft \(it holds model\.layers\.2\."):
        Distiller(target, tiny_model("llama", layers=2, seed=8), again, tmp_path)
    wider = tiny_model("llama", layers=3, seed=8)
    wider.model.layers[2].mlp.up_proj = torch.nn.Linear(32, 48, bias=False)  # a trained tensor of another size
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.up_proj\.weight is \[64, 32\] there, \[48, 32\] here"):
        Distiller(target, wider, again, tmp_path)
    assert Distiller(target, tiny_model("llama", layers=3, seed=8), again, tmp_path).step_count == 1  # its own draft


def test_modes_are_restored_and_dropout_does_not_draw_from_the_global_rng(tmp_path):
    """Before: Distiller left a train-mode target in eval mode, and a train-mode draft (a model built
    from a config is; GPT-2 has dropout) trained with dropout drawn from the caller's RNG, so one
    DistillConfig(seed=0) gave other losses under another torch.manual_seed."""
    target = tiny_model("gpt2", seed=7)
    config = DistillConfig(steps=3, lr=1e-3, new_tokens=6, checkpoint_every=100)
    runs = []
    for global_seed, training in ((1, True), (2, True), (1, False)):
        draft = perturbed(target, 0.6, 8).train(training)
        target.train()
        torch.manual_seed(global_seed)
        rng = torch.random.get_rng_state()
        distiller = Distiller(target, draft, config, tmp_path / f"run{len(runs)}")
        assert target.training
        runs.append(distiller.train(PROMPTS, progress=False))
        assert target.training and draft.training == training
        assert all(m.training == training for m in draft.modules())
        assert torch.equal(torch.random.get_rng_state(), rng)  # nothing drew from the caller's RNG
    assert runs[0] == runs[1] == runs[2]  # as the draft in eval mode trains


def test_divergence_and_settings_name_what_would_be_wrong():
    """Before: logits of different shapes broadcast (a KL of -1.23 from a [3, 1] draft), a temperature of -1
    distilled the negated logits, forward KL was NaN wherever the target has a -inf logit (even of a model
    against itself), and a temperature of 1e-40 or a seed of 2**62 were taken, then failed at the first step."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    for draft in (b[:, :1], b[:1]):
        with pytest.raises(ValueError, match="must have one shape"):
            divergence(a, draft, "fkl")
    for temperature in (-1.0, 0.0, float("inf"), 1e-40):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0.0001"):
            divergence(a, b, "fkl", temperature)
    masked = a.clone()
    masked[:, 3] = -float("inf")
    assert divergence(masked, masked, "fkl").item() == 0.0
    assert divergence(masked, b, "fkl").item() > 0 and divergence(masked, b, "tv").item() > 0
    with pytest.raises(ValueError, match="temperature must be at least"):
        DistillConfig(temperature=1e-40)
    with pytest.raises(ValueError, match="seed must be below 2\\*\\*32"):
        DistillConfig(seed=2 ** 62)


def test_a_refused_distiller_leaves_the_draft_and_a_saved_one_keeps_its_buffers(tmp_path):
    """Before: a Distiller refused for its folder had already cast the draft to float32 and frozen it; a folder
    that cannot be written was found after checkpoint_every steps; a damaged checkpoint gave a raw JSON or
    pickle error (with torch's advice to load it with weights_only=False, which would run the file); train_layers=None against a
    checkpoint of the same layers given as (1, 2) was 'other settings'; save_draft of a bf16 draft rounded its
    RoPE frequencies (not in the state dict) through bf16 for good."""
    target, _ = make_pair()
    config = DistillConfig(steps=1, lr=1e-3, new_tokens=4)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "bad" / "checkpoint.json").write_text("{}")
    draft = make_pair()[1]
    frequencies = draft.model.rotary_emb.inv_freq.clone()  # float32, as from_pretrained(dtype=bfloat16) keeps them
    draft.to(torch.bfloat16).model.rotary_emb.inv_freq = frequencies.clone()
    with pytest.raises(ValueError, match="are not a checkpoint hf_specdec wrote"):
        Distiller(target, draft, config, tmp_path / "bad")
    assert draft.dtype == torch.bfloat16 and all(p.requires_grad for p in draft.parameters())
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot be written"):  # before the first step
        Distiller(target, make_pair()[1], config, tmp_path / "file").train(PROMPTS, progress=False)
    Distiller(target, make_pair()[1], DistillConfig(steps=1, lr=1e-3, new_tokens=4, train_layers=(1, 2)),
              tmp_path / "run").train(PROMPTS, progress=False)
    assert Distiller(target, make_pair()[1], DistillConfig(steps=2, lr=1e-3, new_tokens=4), tmp_path / "run").step_count == 1
    distiller = Distiller(target, draft, config, tmp_path / "bf16")
    distiller.save_draft(tmp_path / "saved")
    assert torch.equal(distiller.draft.model.rotary_emb.inv_freq, frequencies)
