"""End-to-end through `model.generate(custom_generate=...)` on tiny models built from configs."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StaticCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.streamers import BaseStreamer

import hf_specdec
from conftest import perturbed, tiny_model

PROMPT = torch.tensor([[1, 5, 9, 2, 7, 3]])


def spec(model, draft, **kwargs):
    """hf_specdec with a fixed draft length and model drafts only (the levers of `test_levers.py` off),
    so that these tests see exactly k drafts per round."""
    kwargs = {"adaptive": False, "ngram": False, **kwargs}
    return model.generate(PROMPT, custom_generate=hf_specdec.speculative_generate, assistant=draft, **kwargs)


# ---------------------------------------------------------------- greedy identity


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_greedy_matches_plain_greedy(arch, k):
    target = tiny_model(arch, seed=1)
    draft = perturbed(target, noise=0.5)
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=40)
    out = spec(target, draft, num_draft_tokens=k, do_sample=False, max_new_tokens=40, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    # The draft must disagree sometimes, or rollback is never exercised.
    assert 0 < out.acceptance.accepted < out.acceptance.drafted


def test_greedy_with_an_unrelated_draft_and_with_the_target_as_draft(arch):
    target = tiny_model(arch, seed=2)
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=25)
    for draft in (tiny_model(arch, seed=3, layers=1), target):
        assert torch.equal(spec(target, draft, do_sample=False, max_new_tokens=25), plain)


def test_eos_inside_an_accepted_block_ends_the_sequence_there(arch):
    target = tiny_model(arch, seed=4)
    draft = perturbed(target, noise=0.3)
    free = target.generate(PROMPT, do_sample=False, max_new_tokens=40)[0, PROMPT.shape[1] :].tolist()
    # An EOS that plain greedy reaches after a few tokens, not at the first one.
    eos = next(tok for i, tok in enumerate(free) if i >= 3 and tok not in free[:i] and tok != 0)
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=40, eos_token_id=eos)
    out = spec(target, draft, num_draft_tokens=6, do_sample=False, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(out, plain)
    assert out[0, -1].item() == eos and out.shape[1] < PROMPT.shape[1] + 40


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_max_new_tokens_is_exact_when_it_cuts_a_round(max_new_tokens):
    target = tiny_model("llama", seed=5)
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=max_new_tokens)
    out = spec(target, target, num_draft_tokens=5, do_sample=False, max_new_tokens=max_new_tokens)
    assert torch.equal(out, plain)
    out = spec(target, target, num_draft_tokens=5, do_sample=False, max_length=PROMPT.shape[1] + max_new_tokens)
    assert torch.equal(out, plain)


def test_greedy_with_processors_matches_plain_greedy():
    target = tiny_model("qwen2", seed=6)
    draft = perturbed(target, noise=0.4)
    kwargs = dict(do_sample=False, max_new_tokens=30, repetition_penalty=1.5, no_repeat_ngram_size=2, bad_words_ids=[[4]])
    assert torch.equal(spec(target, draft, **kwargs), target.generate(PROMPT, **kwargs))


def test_user_stopping_criterion_stops_mid_round():
    class StopAfterToken(StoppingCriteria):
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == self.token

    target = tiny_model("llama", seed=7)
    free = target.generate(PROMPT, do_sample=False, max_new_tokens=30)[0, PROMPT.shape[1] :].tolist()
    token = next(tok for i, tok in enumerate(free) if i >= 4 and tok not in free[:i])
    criteria = StoppingCriteriaList([StopAfterToken(token)])
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=30, stopping_criteria=criteria)
    out = spec(target, target, do_sample=False, max_new_tokens=30, stopping_criteria=criteria)
    assert torch.equal(out, plain) and out[0, -1].item() == token


def test_directory_form_with_standard_argument_names():
    target = tiny_model("llama", seed=8)
    draft = perturbed(target, noise=0.5)
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=20)
    out = target.generate(
        PROMPT, custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True, assistant_model=draft,
        do_sample=False, max_new_tokens=20, return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain) and out.acceptance.rounds > 0


def test_token_healing_in_the_directory_form_heals_as_plain_generate():
    """Before: transformers dropped `tokenizer` on its way to the callable, and healing failed asking for the
    tokenizer it had been given. The directory form heals the prompt first (`model.heal_tokens`)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))
    from tiny import tiny_pair

    target, draft, tokenizer = tiny_pair()
    prompt = tokenizer("hello there", return_tensors="pt").input_ids
    kwargs = dict(do_sample=False, max_new_tokens=12, token_healing=True, tokenizer=tokenizer)
    out = target.generate(prompt, custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True,
                          assistant_model=draft, **kwargs)
    assert torch.equal(out, target.generate(prompt, **kwargs))
    # a prompt starting with BOS, which healing turns into the pad id: plain generate() took the mask before
    # healing and attends it; before, the directory form let transformers infer one that hid it (greedy differed)
    from tokenizers import processors

    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    bos = tokenizer("hello there", return_tensors="pt").input_ids
    assert target.heal_tokens(bos, tokenizer)[0, 0] == tokenizer.pad_token_id != tokenizer.eos_token_id
    for mask in ({}, dict(attention_mask=torch.ones_like(bos))):
        out = target.generate(bos, custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True,
                              assistant_model=draft, **mask, **kwargs)
        assert torch.equal(out, target.generate(bos, **mask, **kwargs))
    # a left-padded batch without a mask, the settings in a GenerationConfig whose pad id is the model's
    tokenizer.padding_side = "left"
    batch = tokenizer(["hello there", "hi"], return_tensors="pt", padding=True).input_ids
    config = dict(generation_config=GenerationConfig(do_sample=False, max_new_tokens=12), token_healing=True,
                  tokenizer=tokenizer)
    out = target.generate(batch, custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True,
                          assistant_model=draft, **config)
    assert torch.equal(out, target.generate(batch, **config))


def test_the_directory_form_refuses_what_it_would_drop():
    """Before: assistant= beside assistant_model= was used instead of it, spec_streamer= beside streamer=
    left the streamer without a token or an end, and cache_implementation='paged' ran transformers' own
    continuous batching without the draft (and returned a bare tensor under return_dict_in_generate)."""
    target = tiny_model("llama", seed=8)
    draft, other = perturbed(target, noise=0.5), perturbed(target, noise=0.9)
    form = dict(custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True, max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match="both assistant_model= and assistant= were given"):
        target.generate(PROMPT, assistant_model=draft, assistant=other, **form)
    ends = []

    class Ends(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            ends.append(self)

    mine, theirs = Ends(), Ends()
    with pytest.raises(ValueError, match="both streamer= and spec_streamer= were given"):
        target.generate(PROMPT, assistant_model=draft, streamer=mine, spec_streamer=theirs, **form)
    assert ends == [theirs, mine]  # spec_streamer's consumer waited forever
    with pytest.raises(ValueError, match="both streamer= and spec_streamer= were given"):  # one that cannot end
        target.generate(PROMPT, assistant_model=draft, streamer=BaseStreamer(), spec_streamer=BaseStreamer(), **form)
    with pytest.raises(ValueError, match="cache_implementation='paged'.*generate_continuous"):
        target.generate(PROMPT, assistant_model=draft, cache_implementation="paged", **form)
    out = target.generate(PROMPT, assistant_model=draft, assistant=draft, **form)  # one draft under both names
    assert torch.equal(out, target.generate(PROMPT, max_new_tokens=4, do_sample=False))


def test_synced_gpus_and_one_streamer_under_both_names_in_the_callable_form():
    """Before: generate() keeps synced_gpus from a callable (passing False), so synced_gpus=True decoded
    without syncing; the same streamer as streamer= and spec_streamer= got the prompt twice."""
    target = tiny_model("llama", seed=8)
    draft = perturbed(target, noise=0.5)
    with pytest.raises(ValueError, match="does not support synced_gpus"):
        spec(target, draft, max_new_tokens=4, do_sample=False, synced_gpus=True)

    class Puts(BaseStreamer):
        def __init__(self):
            self.puts, self.ends = [], 0

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ends += 1

    streamer = Puts()
    out = spec(target, draft, max_new_tokens=6, do_sample=False, streamer=streamer, spec_streamer=streamer)
    assert streamer.puts[0] == PROMPT[0].tolist() and streamer.ends == 1
    assert sum(streamer.puts[1:], []) == out[0, PROMPT.shape[1] :].tolist()


def test_what_plain_generate_stops_on_is_what_hf_specdec_stops_on():
    """Before: a user's MaxLengthCriteria (which replaces the config's in plain generate()) was cut to the
    config's max_length; a criterion answering by a row's place in the batch never stopped a row; a
    constrained beam search (force_words_ids) decoded greedily without the words."""
    from transformers import MaxLengthCriteria

    target = tiny_model("llama", seed=1)
    draft = perturbed(target, noise=0.5)
    kwargs = dict(max_new_tokens=10, do_sample=False, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(30)]))
    plain = target.generate(PROMPT, **kwargs)
    assert plain.shape[1] == 30 and torch.equal(spec(target, draft, **kwargs), plain)

    class ByPlace(StoppingCriteria):  # row b stops on token stop[b]: it needs the whole batch
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == torch.tensor([1, 2, 3])

    batch = PROMPT.repeat(3, 1)
    with pytest.raises(ValueError, match="answered 3 values for one row"):
        target.generate(batch, custom_generate=hf_specdec.speculative_generate, assistant=draft, max_new_tokens=5,
                        do_sample=False, stopping_criteria=StoppingCriteriaList([ByPlace()]))
    with pytest.raises(ValueError, match="constrained beam search"):
        spec(target, draft, max_new_tokens=5, do_sample=False, force_words_ids=[[5]])


def test_a_processor_built_from_the_first_prompt_is_refused_before_a_stream_starts():
    """Before: the first prompt ran, then the stream stopped with "run such a generation one row at a time"."""
    target = tiny_model("llama", seed=1)
    seen = []
    with pytest.raises(ValueError, match="EncoderRepetitionPenaltyLogitsProcessor .* first prompt"):
        hf_specdec.generate_continuous(target, iter([[1, 5, 9], [1, 2, 3]]), assistant=perturbed(target, noise=0.5),
                                       max_batch_size=1, max_new_tokens=5, do_sample=False,
                                       encoder_repetition_penalty=1.5, on_result=seen.append)
    assert not seen


def test_stop_strings_in_the_directory_form():
    """transformers drops `tokenizer` on its way to a callable custom_generate; the directory form
    builds the stop-string criterion itself and stops where plain generate() stops (the eval's
    offline character tokenizer, `evals/tiny.py`)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))
    from tiny import tiny_pair

    target, draft, tokenizer = tiny_pair()
    prompt = tokenizer("hello there", return_tensors="pt").input_ids
    free = target.generate(prompt, do_sample=False, max_new_tokens=20, eos_token_id=None)
    stop = tokenizer.decode(free[0, prompt.shape[1] + 6])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=20, eos_token_id=None, stop_strings=[stop],
                            tokenizer=tokenizer)
    assert plain.shape[1] < free.shape[1]  # the stop string does stop it
    out = target.generate(prompt, custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True,
                          assistant_model=draft, do_sample=False, max_new_tokens=20, eos_token_id=None,
                          stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(out, plain)
    # the same strings set in a GenerationConfig, the one passed or the model's (the model's is left as it was)
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=None, stop_strings=[stop])
    out = target.generate(prompt, custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True,
                          assistant_model=draft, generation_config=config, tokenizer=tokenizer)
    assert torch.equal(out, plain) and config.stop_strings == [stop]
    target.generation_config.stop_strings = [stop]
    try:
        out = target.generate(prompt, custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True,
                              assistant_model=draft, do_sample=False, max_new_tokens=20, eos_token_id=None,
                              tokenizer=tokenizer)
        assert torch.equal(out, plain) and target.generation_config.stop_strings == [stop]
        out = target.generate(prompt, custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True,
                              assistant_model=draft, do_sample=False, max_new_tokens=20, eos_token_id=None,
                              stop_strings=None)  # turns the model's default off, as in plain generate()
        assert torch.equal(out, free)
    finally:
        target.generation_config.stop_strings = None


def test_stop_strings_in_generate_continuous():
    """generate_continuous passes the callable form, to which transformers does not forward `tokenizer`:
    it failed asking for the tokenizer it was given. Each prompt now stops where plain generate() stops."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))
    from tiny import tiny_pair

    target, draft, tokenizer = tiny_pair()
    prompts = [tokenizer(text, return_tensors="pt").input_ids for text in ("hello there", "the cat sat")]
    free = target.generate(prompts[0], do_sample=False, max_new_tokens=20, eos_token_id=None)
    stop = tokenizer.decode(free[0, prompts[0].shape[1] + 6])
    plain = [target.generate(p, do_sample=False, max_new_tokens=20, eos_token_id=None, stop_strings=[stop],
                             tokenizer=tokenizer)[0, p.shape[1]:].tolist() for p in prompts]
    assert len(plain[0]) < 20  # the stop string does stop it
    results = hf_specdec.generate_continuous(target, [p[0].tolist() for p in prompts], assistant=draft, do_sample=False,
                                             max_new_tokens=20, eos_token_id=None, stop_strings=[stop], tokenizer=tokenizer)
    assert [r.tokens.tolist() for r in results] == plain
    with pytest.raises(ValueError, match=r"stop_strings needs the tokenizer: pass tokenizer=\.\.\. to generate_continuous"):
        hf_specdec.generate_continuous(target, [prompts[0][0].tolist()], assistant=draft, max_new_tokens=5,
                                       stop_strings=[stop])


def test_an_explicit_draft_window_of_none_encodes_the_whole_prompt():
    """draft_window=None given to generate() means the whole prompt (None had meant "not given": the default)."""
    target = tiny_model("llama", seed=8)
    draft = perturbed(target, noise=0.5)
    prompt = torch.randint(1, 64, (1, 300), generator=torch.Generator().manual_seed(0))
    # the default ("auto"): 64 tokens in greedy calls, 256 when sampling
    for window, sample, encoded in (("default", False, 64), ("default", True, 256), (None, False, 300),
                                    (256, False, 256), (128, True, 128)):
        widths = []
        hook = draft.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                               with_kwargs=True)
        kwargs = {} if window == "default" else dict(draft_window=window)
        target.generate(prompt, custom_generate=hf_specdec.speculative_generate, assistant=draft, do_sample=sample,
                        max_new_tokens=4, adaptive=False, ngram=False, **kwargs)
        hook.remove()
        assert widths[0] == encoded, (window, sample, widths)
    for bad in ("big", 0, True):
        with pytest.raises(ValueError, match="draft_window"):
            hf_specdec.SpeculativeConfig(draft_window=bad)


@pytest.mark.parametrize("draft_vocab", [396, 404])
def test_greedy_identity_with_a_draft_vocabulary_padded_differently(draft_vocab):
    """A draft whose embedding has a few rows fewer or more than the target's (padding, as Qwen2.5-0.5B
    has for 7B): plain greedy's output on one row, a left-padded batch, a stream and a drafter passed as
    candidate_generator; the target emits ids past the narrower draft's rows (fed to it as its last row)."""
    target = tiny_model("llama", vocab=400, seed=5)
    with torch.no_grad():
        target.lm_head.weight[396:] *= 3
    draft = perturbed(target, 0.3)
    draft.resize_token_embeddings(draft_vocab, mean_resizing=False)
    prompt = torch.tensor([[1, 5, 9, 397, 12, 398]])
    plain = target.generate(prompt, max_new_tokens=40, do_sample=False)
    assert sum(t >= 396 for t in plain[0, 6:].tolist()) >= 5
    wrapped = hf_specdec.CandidateGeneratorDrafter(hf_specdec.DraftCandidateGenerator(draft, None, 4, False))
    for kwargs in ({"assistant": draft}, {"candidate_generator": hf_specdec.DraftModelDrafter(draft, None, False)},
                   {"candidate_generator": wrapped}):  # the last: an IndexError before
        out = target.generate(prompt, max_new_tokens=40, do_sample=False, custom_generate=hf_specdec.speculative_generate,
                              return_dict_in_generate=True, costs=hf_specdec.Costs(draft_step=0.05, verify=0.02), **kwargs)
        # pinned costs: measured ones on a loaded machine can decide drafting does not pay (accepted 0)
        assert out.sequences.tolist() == plain.tolist() and out.acceptance.accepted > 0
    batch = torch.tensor([[0, 0, 1, 5, 9, 397], [1, 5, 9, 397, 12, 398]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    fixed = target.generate(prompt, max_new_tokens=30, do_sample=False, custom_generate=hf_specdec.speculative_generate,
                            assistant=draft, adaptive=False, ngram=False)  # draft chains only
    assert fixed.tolist() == plain[:, :36].tolist()
    assert target.generate(batch, attention_mask=mask, max_new_tokens=30, do_sample=False,
                           custom_generate=hf_specdec.speculative_generate, assistant=draft).tolist() == \
        target.generate(batch, attention_mask=mask, max_new_tokens=30, do_sample=False).tolist()
    prompts = [[1, 5, 9, 397], [1, 398, 3], [1, 2, 3, 4, 5]]
    results = hf_specdec.generate_continuous(target, prompts, assistant=draft, max_batch_size=2, max_new_tokens=20,
                                             do_sample=False)
    for result, p in zip(results, prompts, strict=True):
        assert result.tokens.tolist() == target.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p):].tolist()


@pytest.mark.parametrize("setting, message", [
    (dict(assistant_ensemble_weight=0.5, do_sample=True), "relaxes the target's law"),
    (dict(prompt_lookup_num_tokens=3), "ngram=True"),
    (dict(assistant_early_exit=1), "early_exit_draft"),
    (dict(use_mtp=True), "multi-token prediction"),
    (dict(speculation_type="dflash"), "picks one of transformers' methods"),
    (dict(assistant_early_exit=0), "early_exit_draft"),  # set, as transformers reads it (0 is not None)
])
def test_transformers_own_speculation_settings_are_refused(setting, message):
    """Before: each was dropped silently (a relaxed law asked for, exact verification given)."""
    target = tiny_model("llama", seed=14)
    with pytest.raises(ValueError, match=f"{next(iter(setting))}=.* asks for transformers' own assisted decoding.*{message}"):
        spec(target, perturbed(target, 0.3), max_new_tokens=3, **setting)


def test_transformers_assisted_knobs_are_named_as_unread(caplog):
    """Settings of transformers' assisted loop that hf_specdec does not read are warned about by name
    (transformers fills its own defaults in every call, so those are not)."""
    target = tiny_model("llama", seed=14)
    draft = perturbed(target, 0.3)
    hf_specdec.arguments._WARNED.clear()
    with caplog.at_level("WARNING", logger="hf_specdec"):
        spec(target, draft, max_new_tokens=3)
        assert "assisted decoding" not in caplog.text
        spec(target, draft, max_new_tokens=3, num_assistant_tokens=5, max_matching_ngram_size=3)
        assert "num_assistant_tokens=5 is a setting of transformers' assisted decoding" in caplog.text
        assert "max_matching_ngram_size=3" in caplog.text
        caplog.clear()
        spec(target, draft, max_new_tokens=3, num_assistant_tokens=5)  # once a process
        assert "assisted decoding" not in caplog.text
        target.generation_config.num_assistant_tokens = 7  # a saved config's value: named as the model's
        spec(target, draft, max_new_tokens=3)
    assert "num_assistant_tokens=7 comes from the model's generation_config: pass num_assistant_tokens=None" in caplog.text
    target.generation_config.num_assistant_tokens, target.generation_config.prompt_lookup_num_tokens = None, 10
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens=10 comes from the model's generation_config"):
        spec(target, draft, max_new_tokens=3)
    spec(target, draft, max_new_tokens=3, prompt_lookup_num_tokens=None)  # dropped as the message says


def test_a_draft_window_that_cannot_apply_is_warned_about(caplog):
    """Before: draft_window=8 was dropped silently for a batch and a stream (the window is for one row)."""
    target = tiny_model("llama", seed=14)
    draft = perturbed(target, 0.3)
    batch, mask = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with caplog.at_level("WARNING", logger="hf_specdec"):
        spec(target, draft, max_new_tokens=3, draft_window=8)
        assert "draft_window" not in caplog.text
        target.generate(batch, attention_mask=mask, max_new_tokens=3, custom_generate=hf_specdec.speculative_generate,
                        assistant=draft, draft_window=8)
        assert "draft_window=8 is for one row with a full-attention draft; this call has 2 rows" in caplog.text
        hf_specdec.generate_continuous(target, [[1, 2, 3]], assistant=draft, max_new_tokens=3, draft_window=8)
        assert "continuous batching encodes whole prompts" in caplog.text
        spec(target, None, max_new_tokens=3, draft_window=8, candidate_generator=hf_specdec.DraftModelDrafter(draft, None, False))
    assert "a candidate_generator drafts as it was made (DraftModelDrafter(draft, ..., window=8)" in caplog.text


def test_vocabularies_beyond_padding_are_refused():
    """Sizes within 1% of the larger are one vocabulary's padding; beyond, a draft loaded by mistake."""
    from hf_specdec.arguments import padding_rows

    assert padding_rows(152064, 151936) and padding_rows(50688, 50304) and not padding_rows(32768, 32000)
    target = tiny_model("llama", vocab=400, seed=5)
    with pytest.raises(ValueError, match="vocabulary mismatch: the target scores 400 tokens but the draft scores 392.*1%"):
        spec(target, tiny_model("llama", vocab=392), max_new_tokens=3)
    wrapped = hf_specdec.CandidateGeneratorDrafter(hf_specdec.DraftCandidateGenerator(tiny_model("llama", vocab=300), None, 4, False))
    with pytest.raises(ValueError, match="the target scores 400 tokens but the draft scores 300"):  # an IndexError before
        spec(target, None, max_new_tokens=3, candidate_generator=wrapped)


@pytest.mark.parametrize("form", ["callable", "directory"])
def test_num_return_sequences_gives_the_repeated_rows_draws(form):
    """n samples a prompt, as plain generate() takes them: transformers repeats each row n times
    (repeat_interleave) before the decode loop, so with pinned costs and one seed the output is the
    explicit repeat's, draw for draw (rows of one prompt retrieve from each other's text). Greedy with
    n > 1 gets transformers' own error, as plain; a stream (one result a prompt) is refused by name."""
    target = tiny_model("llama", seed=3)
    draft = perturbed(target, 0.3)
    prompts, mask = torch.tensor([[1, 5, 9, 2], [0, 1, 4, 6]]), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    method = (dict(custom_generate=hf_specdec.speculative_generate, assistant=draft) if form == "callable" else
              dict(custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True, assistant_model=draft))
    kwargs = dict(do_sample=True, max_new_tokens=12, return_dict_in_generate=True, output_scores=True,
                  costs=hf_specdec.Costs(draft_step=0.1, verify=0.05), **method)
    torch.manual_seed(0)
    out = target.generate(prompts, attention_mask=mask, num_return_sequences=3, **kwargs)
    torch.manual_seed(0)
    repeated = target.generate(prompts.repeat_interleave(3, 0), attention_mask=mask.repeat_interleave(3, 0), **kwargs)
    assert out.sequences.shape == (6, 16) and out.sequences.tolist() == repeated.sequences.tolist()
    assert len(out.scores) == 12 and out.scores[0].shape == (6, 64)
    with pytest.raises(ValueError, match="Greedy methods .* do not support `num_return_sequences`"):
        target.generate(prompts, attention_mask=mask, num_return_sequences=3, max_new_tokens=3, **method)
    with pytest.raises(ValueError, match="one StreamResult a prompt: for n samples of a prompt, give it n times"):
        hf_specdec.generate_continuous(target, [[1, 2, 3]], assistant=draft, do_sample=True, num_return_sequences=2)
    one = torch.tensor([[1, 5, 9, 2]])  # one prompt, n rows: the refusals of several rows say why there are n
    with pytest.raises(ValueError, match=r"got a batch of 3 rows \(num_return_sequences=3 repeats each prompt\)"):
        target.generate(one, do_sample=True, num_return_sequences=3, max_new_tokens=3, spec_streamer=BaseStreamer(),
                        custom_generate=hf_specdec.speculative_generate, assistant=draft)
    with pytest.raises(ValueError, match=r"NgramDrafter\) proposes for 1 row at a time; got a batch of 2 rows \(num_return"):
        target.generate(one, do_sample=True, num_return_sequences=2, max_new_tokens=3,
                        custom_generate=hf_specdec.speculative_generate, candidate_generator=hf_specdec.NgramDrafter())
    with pytest.raises(ValueError, match="a direct call of speculative_generate takes input_ids as they are"):
        hf_specdec.speculative_generate(target, one, None, None, GenerationConfig(do_sample=True, num_return_sequences=3,
                                                                                  max_length=8), assistant=draft)


class _Ban(LogitsProcessor):
    """A user's processor hf_specdec does not know to be row-wise."""

    def __call__(self, input_ids, scores):
        return scores.index_fill(-1, torch.tensor([7]), float("-inf"))


def test_an_unknown_processor_is_refused_for_several_rows_naming_num_return_sequences():
    """One prompt with num_return_sequences=2 is two rows: the refusal says so (it spoke of batches only)."""
    target = tiny_model("llama", seed=3)
    kwargs = dict(do_sample=True, max_new_tokens=4, logits_processor=LogitsProcessorList([_Ban()]),
                  custom_generate=hf_specdec.speculative_generate, assistant=perturbed(target, 0.3))
    assert target.generate(PROMPT, **kwargs).shape == (1, PROMPT.shape[1] + 4)
    with pytest.raises(ValueError, match=r"num_return_sequences > 1.*_Ban is not known to allow that.*one call per sample"):
        target.generate(PROMPT, num_return_sequences=2, **kwargs)


# ---------------------------------------------------------------- outputs, streamers, stats


class Recorder(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("form", ["callable", "directory"])
def test_streamer_receives_prompt_then_tokens_in_order(form):
    target = tiny_model("llama", seed=9)
    draft = perturbed(target, noise=0.5)
    recorder = Recorder()
    if form == "callable":
        out = spec(target, draft, do_sample=False, max_new_tokens=20, spec_streamer=recorder)
    else:
        out = target.generate(
            PROMPT, custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True, assistant_model=draft,
            do_sample=False, max_new_tokens=20, streamer=recorder,
        )
    assert recorder.chunks[0] == PROMPT[0].tolist()
    assert sum(recorder.chunks[1:], []) == out[0, PROMPT.shape[1] :].tolist()
    assert recorder.ended


def test_return_types_scores_and_logits_like_transformers():
    target = tiny_model("gpt2", seed=10)
    draft = perturbed(target, noise=0.5)
    assert isinstance(spec(target, draft, do_sample=False, max_new_tokens=5), torch.Tensor)
    kwargs = dict(do_sample=False, max_new_tokens=12, return_dict_in_generate=True, output_scores=True, output_logits=True)
    out = spec(target, draft, **kwargs, repetition_penalty=1.3)
    plain = target.generate(PROMPT, **kwargs, repetition_penalty=1.3)
    assert isinstance(out, hf_specdec.SpeculativeDecoderOnlyOutput)
    assert len(out.scores) == len(out.logits) == 12
    for ours, theirs in zip(out.scores, plain.scores):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    for ours, theirs in zip(out.logits, plain.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_acceptance_stats_add_up_and_sink_gets_one_record_per_round(tmp_path):
    target = tiny_model("llama", seed=11)
    draft = perturbed(target, noise=0.5)
    records = []
    out = spec(
        target, draft, do_sample=True, max_new_tokens=30, return_dict_in_generate=True,
        acceptance_sink=records.append, generator=torch.Generator().manual_seed(0),
    )
    stats = out.acceptance
    assert stats.rounds == len(records) == stats.target_forwards
    assert stats.emitted == 30 == sum(len(r.emitted_tokens) for r in records)
    assert stats.drafted == sum(len(r.draft_tokens) for r in records) == sum(stats.drafted_per_position)
    assert stats.accepted == sum(r.num_accepted for r in records) == sum(stats.accepted_per_position)
    assert stats.acceptance_rate == pytest.approx(stats.accepted / stats.drafted)
    reached = sum(min(r.num_accepted + 1, len(r.draft_tokens)) for r in records)
    assert sum(stats.reached_per_position) == reached
    assert stats.token_acceptance == pytest.approx(stats.accepted / reached)
    for i, rate in enumerate(stats.per_position_rate):  # conditional on reaching position i + 1
        reached_i = sum(min(r.num_accepted + 1, len(r.draft_tokens)) > i for r in records)
        accepted_i = sum(r.num_accepted > i for r in records)
        assert rate == pytest.approx(accepted_i / reached_i if reached_i else 0.0)
    assert stats.mean_tokens_per_round == pytest.approx(30 / stats.rounds)
    back = hf_specdec.AcceptanceStats.from_dict(json.loads(json.dumps(stats.to_dict())))  # saved as JSON, read back
    assert back == stats and back.merge(stats).rounds == 2 * stats.rounds
    with pytest.raises(ValueError, match="unknown fields"):
        hf_specdec.AcceptanceStats.from_dict({**stats.to_dict(), "roundz": 1})
    emitted = sum((r.emitted_tokens for r in records), [])
    assert emitted == out.sequences[0, PROMPT.shape[1] :].tolist()
    # p is computed up to each row's first rejection (and perhaps a little further): every reached position
    assert all(min(r.num_accepted + 1, len(r.draft_tokens)) <= len(r.expected_acceptance) <= len(r.draft_tokens) for r in records)
    assert all(0 <= a <= 1 + 1e-6 for r in records for a in r.expected_acceptance)

    path = tmp_path / "rounds.jsonl"
    spec(target, draft, do_sample=False, max_new_tokens=10, acceptance_sink=path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines and {"round", "draft_tokens", "num_accepted", "emitted_tokens"} <= set(lines[0])


def test_seeded_sampling_repeats_and_different_seeds_differ():
    target = tiny_model("qwen2", seed=12)
    draft = perturbed(target, noise=0.5)

    def run(seed):
        return spec(target, draft, do_sample=True, temperature=1.3, max_new_tokens=30, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1))
    torch.manual_seed(5)
    a = spec(target, draft, do_sample=True, max_new_tokens=30)
    torch.manual_seed(5)
    assert torch.equal(a, spec(target, draft, do_sample=True, max_new_tokens=30))


# ---------------------------------------------------------------- forward-call counts


class CountingForward:
    """Wraps a model's forward to record how many tokens each call processes."""

    def __init__(self, model):
        self.calls = []
        original = model.forward

        def forward(*args, **kwargs):
            self.calls.append(kwargs["input_ids"].shape[1])
            return original(*args, **kwargs)

        model.forward = forward


def test_forward_counts_target_once_per_round_and_no_prefix_re_encoded():
    target = tiny_model("llama", seed=13)
    draft = perturbed(target, noise=0.5)
    target_calls, draft_calls = CountingForward(target), CountingForward(draft)
    k, new = 4, 40
    records = []
    out = spec(target, draft, num_draft_tokens=k, do_sample=False, max_new_tokens=new,
               return_dict_in_generate=True, acceptance_sink=records.append)
    stats = out.acceptance
    assert len(target_calls.calls) == stats.rounds
    # First round: prompt + drafts. Later rounds: the last emitted token + the drafts, never more.
    assert target_calls.calls[0] == PROMPT.shape[1] + len(records[0].draft_tokens)
    assert target_calls.calls[1:] == [1 + len(r.draft_tokens) for r in records[1:]]
    # Draft: one forward per drafted token; the first takes the prompt, then 1 token, or 2 after an
    # all-accepted round (the last draft token and the bonus token catch up together).
    assert len(draft_calls.calls) == stats.drafted == stats.draft_forwards
    assert draft_calls.calls[0] == PROMPT.shape[1]
    assert set(draft_calls.calls[1:]) <= {1, 2}
    all_accepted_rounds = sum(
        r.num_accepted == len(r.draft_tokens) > 0 and len(nxt.draft_tokens) > 0 for r, nxt in zip(records, records[1:])
    )
    assert draft_calls.calls.count(2) == all_accepted_rounds
    # Caches end holding what was verified: no unbounded growth.
    assert out.cache.get_seq_length() <= out.sequences.shape[1]


# ---------------------------------------------------------------- errors that name the problem


def test_errors_name_the_problem():
    target = tiny_model("llama", seed=14)
    with pytest.raises(ValueError, match="needs a draft model"):
        target.generate(PROMPT, custom_generate=hf_specdec.speculative_generate, max_new_tokens=3)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        spec(target, tiny_model("llama", vocab=80), max_new_tokens=3)
    with pytest.raises(ValueError, match="streamers take one row"):
        target.generate(PROMPT.repeat(2, 1), custom_generate=hf_specdec.speculative_generate, assistant=target,
                        max_new_tokens=3, spec_streamer=Recorder())
    with pytest.raises(ValueError, match="proposes for 1 row at a time; got a batch of 2 rows"):
        target.generate(PROMPT.repeat(2, 1), custom_generate=hf_specdec.speculative_generate,
                        candidate_generator=CandidateGenerator(),
                        max_new_tokens=3)
    with pytest.raises(ValueError, match="beam search"):
        spec(target, target, num_beams=2, max_new_tokens=3)
    for kwargs, strategy in ((dict(dola_layers="high"), "DoLa"), (dict(penalty_alpha=0.6, top_k=4), "contrastive search")):
        with pytest.raises(ValueError, match=f"does not do {strategy}"):  # it decoded greedily, silently
            spec(target, target, max_new_tokens=3, **kwargs)
    spec(target, target, max_new_tokens=3, penalty_alpha=0.6, top_k=1)  # not contrastive search for transformers either
    with pytest.raises(hf_specdec.UnsupportedCacheError, match="DynamicCache only"):  # a plain ValueError, as the README did not say
        spec(target, target, max_new_tokens=3, cache_implementation="static")
    with pytest.raises(hf_specdec.UnsupportedCacheError, match="DynamicCache only"):
        spec(target, target, max_new_tokens=3, cache=StaticCache(config=target.config, max_cache_len=64))
    target.generation_config.cache_implementation = "static"  # the message said nothing of where it came from
    try:
        with pytest.raises(hf_specdec.UnsupportedCacheError, match="comes from the model's generation_config: pass "
                                                                   "cache_implementation=None"):
            spec(target, target, max_new_tokens=3)
        spec(target, target, max_new_tokens=3, cache_implementation=None)
    finally:
        target.generation_config.cache_implementation = None
    with pytest.raises(ValueError, match="num_draft_tokens"):
        spec(target, target, max_new_tokens=3, num_draft_tokens=-1)
    with pytest.raises(ValueError, match="draft_temperature"):  # a removed setting: transformers names it unused
        spec(target, target, max_new_tokens=3, do_sample=True, draft_temperature=1.5)
    # What plain generate() would use and this loop cannot: refused, never silently dropped.
    with pytest.raises(ValueError, match="UnbatchedClassifierFreeGuidance.*guidance_scale"):
        spec(target, target, max_new_tokens=3, guidance_scale=3.0)
    from transformers import SynthIDTextWatermarkingConfig

    with pytest.raises(ValueError, match="SynthIDTextWatermarkLogitsProcessor keeps state"):
        spec(target, target, max_new_tokens=3, do_sample=True,
             watermarking_config=SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123, 340], ngram_len=3))
    gpt2 = tiny_model("gpt2", seed=14)
    with pytest.raises(ValueError, match="got token_type_ids"):
        spec(gpt2, gpt2, max_new_tokens=3, token_type_ids=torch.zeros_like(PROMPT))
    with pytest.raises(ValueError, match="position_ids other than those the attention mask gives"):  # GPT-2 reads them
        spec(gpt2, gpt2, max_new_tokens=3, position_ids=torch.arange(5, 5 + PROMPT.shape[1])[None])
    spec(gpt2, gpt2, max_new_tokens=3, position_ids=torch.arange(PROMPT.shape[1])[None])  # the default, spelt out
    with pytest.raises(ValueError, match="inputs_embeds is not supported"):
        target.generate(inputs_embeds=target.get_input_embeddings()(PROMPT), custom_generate=hf_specdec.speculative_generate,
                        assistant=target, max_new_tokens=3)
    done = spec(target, target, max_new_tokens=3, return_dict_in_generate=True)
    target.generate(done.sequences, cache=done.cache, max_new_tokens=2)  # plain decoding extends the cache past its input
    with pytest.raises(ValueError, match="must hold a prefix of input_ids"):
        spec(target, target, max_new_tokens=3, cache=done.cache)


@pytest.mark.parametrize("tree", [False, True])
def test_a_single_rows_cache_continues_like_plain_generates(tree):
    """out.cache holds every token of out.sequences but the last (as plain generate() returns it), so a
    follow-up call with `cache=out.cache`, plain or speculative, continues plain greedy."""
    target = tiny_model("llama", seed=5)
    draft = perturbed(target, noise=0.2)
    prompt = torch.tensor([[1, 5, 2, 7, 1, 5, 2, 7, 1, 5]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=30)
    levers = dict(custom_generate=hf_specdec.speculative_generate, assistant=draft, do_sample=False, tree=tree, ngram=True,
                  costs=hf_specdec.Costs(draft_step=0.05, verify=0.02))
    for first in (7, 12):
        out = target.generate(prompt, max_new_tokens=first, return_dict_in_generate=True, **levers)
        assert out.cache.get_seq_length() == out.sequences.shape[1] - 1
        more = target.generate(out.sequences, cache=out.cache, max_new_tokens=30 - first, **levers)
        assert torch.equal(more, plain)
    out = target.generate(prompt, max_new_tokens=9, return_dict_in_generate=True, **levers)
    assert torch.equal(target.generate(out.sequences, cache=out.cache, do_sample=False, max_new_tokens=21), plain)


@pytest.mark.parametrize("return_dict", [True, False])
def test_a_cache_is_cut_to_the_output_when_a_stop_falls_inside_a_round(return_dict):
    """A perfect draft (the target itself) has all 5 drafts accepted in the first round and EOS is the
    second of them: the cache has seen 5 drafted tokens, the output ends at EOS. The cache, returned or
    the user's own `cache=`, is cut to the output, so the next call continues from the output."""
    from transformers import DynamicCache

    target = tiny_model("llama", seed=5)
    free = target.generate(PROMPT, do_sample=False, max_new_tokens=8)
    eos = free[0, PROMPT.shape[1] + 1].item()
    assert eos not in free[0, PROMPT.shape[1] : PROMPT.shape[1] + 1].tolist()
    mine = DynamicCache(config=target.config)
    out = target.generate(PROMPT, custom_generate=hf_specdec.speculative_generate, assistant=target, do_sample=False,
                          max_new_tokens=20, eos_token_id=eos, num_draft_tokens=5, adaptive=False, ngram=False,
                          cache=mine, return_dict_in_generate=return_dict)
    sequences = out.sequences if return_dict else out
    assert sequences.shape[1] == PROMPT.shape[1] + 2 and sequences[0, -1].item() == eos  # stopped 3 drafts early
    assert mine.get_seq_length() == sequences.shape[1] - 1
    if return_dict:
        assert out.cache is mine and out.acceptance.accepted == 5
    more = target.generate(sequences, cache=mine, do_sample=False, max_new_tokens=6, eos_token_id=None)
    assert torch.equal(more, target.generate(sequences, do_sample=False, max_new_tokens=6, eos_token_id=None))


def test_a_batchs_cache_is_emptied_not_left_in_the_loops_layout():
    """A batch's cache holds this loop's holes and padding: out.cache is None, and a cache the user
    passed is emptied, so a follow-up call with it encodes its whole input (and matches plain)."""
    from transformers import DynamicCache

    target = tiny_model("llama", seed=5)
    ids, mask = torch.tensor([[0, 1, 5, 2], [1, 5, 2, 9]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    mine = DynamicCache(config=target.config)
    out = target.generate(ids, attention_mask=mask, custom_generate=hf_specdec.speculative_generate,
                          assistant=perturbed(target, noise=0.3), do_sample=False, max_new_tokens=10, pad_token_id=0,
                          cache=mine, return_dict_in_generate=True)
    assert out.cache is None and mine.get_seq_length() == 0
    follow = dict(attention_mask=torch.cat([mask, torch.ones(2, 10, dtype=torch.long)], 1), do_sample=False,
                  max_new_tokens=4, pad_token_id=0)
    assert torch.equal(target.generate(out.sequences, cache=mine, **follow), target.generate(out.sequences, **follow))


def test_finished_rows_have_finite_transition_scores():
    """A row that stops at EOS before the others: its later positions score the pad token as certain,
    so compute_transition_scores has no NaN (all -inf rows gave NaN after normalisation)."""
    target = tiny_model("llama", seed=5, eos=26)
    ids, mask = torch.tensor([[0, 1, 5, 2], [1, 5, 2, 9]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    kwargs = dict(attention_mask=mask, max_new_tokens=15, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  pad_token_id=0)
    out = target.generate(ids, custom_generate=hf_specdec.speculative_generate, assistant=perturbed(target, noise=0.3),
                          **kwargs)
    plain = target.generate(ids, **kwargs)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.sequences[0, 4].item() == 26 and (out.sequences[0, 5:] == 0).all()  # row 0 ends at once
    scores = target.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    assert torch.isfinite(scores).all() and (scores[0, 1:] == 0).all()


def test_draft_candidate_generator_follows_the_contract_and_is_a_drafter():
    """transformers' contract (get_candidates / update_candidate_strategy) driven by hand as
    transformers' assisted loop drives it, and the same object passed twice as candidate_generator=
    (a fresh draft cache per call): both give plain greedy's tokens."""
    target = tiny_model("llama", seed=15)
    draft = perturbed(target, noise=0.3)
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=30)
    generator = hf_specdec.DraftCandidateGenerator(draft, None, num_draft_tokens=4, do_sample=False)
    for _ in range(2):
        out = target.generate(PROMPT, custom_generate=hf_specdec.speculative_generate, candidate_generator=generator,
                              do_sample=False, max_new_tokens=30, adaptive=False, ngram=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain) and out.acceptance.drafted > 0
    seq = PROMPT
    while seq.shape[1] < plain.shape[1]:
        candidates, logits = generator.get_candidates(seq)
        assert logits is None and candidates.shape[1] == seq.shape[1] + 4  # greedy drafts are point masses
        best = target(candidates).logits[0, seq.shape[1] - 1 :].argmax(-1)
        drafts = candidates[0, seq.shape[1] :]
        n = int((drafts == best[:-1]).long().cumprod(0).sum())
        seq = torch.cat([seq, drafts[None, :n], best[None, n : n + 1]], dim=1)
        generator.update_candidate_strategy(seq, None, n)
    assert torch.equal(seq[:, : plain.shape[1]], plain)


def test_drafts_caches_and_layers_the_loop_cannot_use_are_named():
    """Each refused before any forward with an error naming it, where it used to fail deep inside
    (an AttributeError, an embedding's IndexError, a TypeError in a linear-attention forward)."""
    from transformers import LlamaModel, Qwen3NextConfig, Qwen3NextForCausalLM

    target = tiny_model("llama", seed=14)
    with pytest.raises(ValueError, match=r"\(LlamaModel\) has no language-model head"):
        spec(target, LlamaModel(target.config), max_new_tokens=3)
    with pytest.raises(ValueError, match="assistant must be a transformers model.*got Linear"):
        spec(target, torch.nn.Linear(3, 3), max_new_tokens=3)
    with pytest.raises(ValueError, match="candidate_generator must be .*got LlamaForCausalLM .*pass it as assistant="):
        target.generate(PROMPT, custom_generate=hf_specdec.speculative_generate, candidate_generator=target,
                        max_new_tokens=3)
    cache = hf_specdec.RetrievalCache()
    cache.add([2, 7, 3, 100, 200] * 3)  # ids of another tokenizer
    with pytest.raises(ValueError, match="retrieval_cache holds token id 200, outside the target's vocabulary of 64"):
        spec(target, target, max_new_tokens=3, retrieval_cache=cache, ngram=True, adaptive=True)
    for bad, message in (([1.5, 2.0], "token ids must be integers"), ("text", "tokens must be one sequence of token ids, got str")):
        with pytest.raises(ValueError, match=message):
            hf_specdec.RetrievalCache().add(bad)
    torch.manual_seed(0)
    config = Qwen3NextConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                             linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=32,
                             layer_types=["linear_attention", "full_attention"], pad_token_id=0)
    linear = Qwen3NextForCausalLM(config).eval()
    with pytest.raises(hf_specdec.UnsupportedCacheError, match="the target has cache layers of type LinearAttentionLayer"):
        spec(linear, linear, max_new_tokens=3)
    with pytest.raises(hf_specdec.UnsupportedCacheError, match=r"the draft model \(assistant\) has cache layers of type Lin"):
        spec(target, linear, max_new_tokens=3)
    # a draft model inside a Drafter passed as candidate_generator is checked as assistant= is (an IndexError, or
    # a shape error from inside the sampling code, before)
    small = tiny_model("llama", vocab=48, seed=14)
    for drafter in (hf_specdec.DraftModelDrafter(small, None, False),
                    hf_specdec.DraftCandidateGenerator(small, None, 3, False)):
        with pytest.raises(ValueError, match="vocabulary mismatch: the target scores 64 tokens but the draft scores 48"):
            target.generate(PROMPT, custom_generate=hf_specdec.speculative_generate, candidate_generator=drafter,
                            max_new_tokens=3)
    # a source that proposes for one row: refused for a batch, and for a stream that runs several (it failed part-way)
    batch = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for bad, name in ((dict(max_ngram=2.0), "max_ngram"), (dict(max_tokens=True), "max_tokens")):  # a TypeError later
        with pytest.raises(ValueError, match=f"{name} must be an integer"):
            hf_specdec.NgramDrafter(**bad)
    with pytest.raises(ValueError, match=r"NgramDrafter\) proposes for 1 row at a time; got a batch of 2 rows"):
        target.generate(batch, custom_generate=hf_specdec.speculative_generate, candidate_generator=hf_specdec.NgramDrafter(),
                        max_new_tokens=3, attention_mask=torch.ones_like(batch))
    with pytest.raises(ValueError, match="proposes for 1 row at a time; continuous batching with max_batch_size=2"):
        hf_specdec.generate_continuous(target, [[1, 2], [3, 4]], candidate_generator=hf_specdec.NgramDrafter(),
                                       max_batch_size=2, max_new_tokens=3)
    results = hf_specdec.generate_continuous(target, [[1, 2, 1, 2], [3, 4]], candidate_generator=hf_specdec.NgramDrafter(),
                                             max_batch_size=1, max_new_tokens=3, do_sample=False)
    assert all(r.ok for r in results)


def test_an_empty_cache_object_passed_is_the_one_filled():
    """`DynamicCache()` built without a config holds no layer, so it is falsy: the loop took a fresh cache and
    left the caller's empty (a hand-fed next token then read wrong logits)."""
    from transformers import DynamicCache

    target = tiny_model("llama", seed=1)
    draft = perturbed(target, noise=0.02)
    mine, theirs = DynamicCache(), DynamicCache()
    out = target.generate(PROMPT, max_new_tokens=5, do_sample=False, cache=mine,
                          custom_generate=hf_specdec.speculative_generate, assistant=draft)
    assert torch.equal(out, target.generate(PROMPT, max_new_tokens=5, do_sample=False, cache=theirs))
    assert mine.get_seq_length() == theirs.get_seq_length() == out.shape[1] - 1
    # its keys and values came from forwards over several tokens: equal up to float rounding
    assert torch.allclose(target(out[:, -1:], cache=mine).logits, target(out[:, -1:], cache=theirs).logits, atol=1e-5)


def test_a_direct_calls_past_key_values_is_the_cache_filled():
    """From a probe: a direct call given past_key_values= (generate() renames it cache= before a custom_generate
    sees it) encoded the whole prompt again in a cache of its own and left the caller's prefix cache as it was."""
    from transformers import DynamicCache, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

    target = tiny_model("llama", seed=1)
    draft = perturbed(target, noise=0.02)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])
    plain = target.generate(ids, max_new_tokens=10, do_sample=False)
    prefix = DynamicCache(config=target.config)
    target(ids[:, :4], cache=prefix, use_cache=True)
    config = GenerationConfig(max_new_tokens=10, max_length=18, do_sample=False, pad_token_id=0)
    out = hf_specdec.speculative_generate(target, ids, LogitsProcessorList(), StoppingCriteriaList([MaxLengthCriteria(18)]),
                                          config, assistant=draft, past_key_values=prefix)
    assert torch.equal(out, plain) and prefix.get_seq_length() == plain.shape[1] - 1
    with pytest.raises(ValueError, match="both cache= and past_key_values="):
        hf_specdec.speculative_generate(target, ids, LogitsProcessorList(), StoppingCriteriaList([MaxLengthCriteria(18)]),
                                        config, assistant=draft, past_key_values=prefix, cache=DynamicCache())


def test_use_cache_false_returns_no_cache_and_criteria_are_not_asked_past_a_stop():
    """As plain generate(): `use_cache=False` returns no cache (one was returned); on the CPU a stopping
    criterion is asked about each emitted token once and never past the token it stops at (it was asked
    about the rest of the round too)."""
    target = tiny_model("llama", seed=1)
    draft = perturbed(target, noise=0.02)
    out = spec(target, draft, max_new_tokens=5, do_sample=False, use_cache=False, return_dict_in_generate=True)
    assert out.cache is None

    class Spy(StoppingCriteria):
        def __init__(self):
            self.seen = []

        def __call__(self, input_ids, scores, **kwargs):
            self.seen.append(input_ids.shape[1])
            return torch.tensor([input_ids.shape[1] >= PROMPT.shape[1] + 3])

    asked = []
    for run in (lambda c: spec(target, draft, num_draft_tokens=5, do_sample=False, max_new_tokens=10, stopping_criteria=c),
                lambda c: target.generate(PROMPT, do_sample=False, max_new_tokens=10, stopping_criteria=c)):
        spy = Spy()
        asked.append((run(StoppingCriteriaList([spy])).shape[1], spy.seen))
    assert asked[0] == asked[1] == (PROMPT.shape[1] + 3, [PROMPT.shape[1] + 1, PROMPT.shape[1] + 2, PROMPT.shape[1] + 3])


def test_state_one_call_leaves_for_the_next(tmp_path):
    """From a probe of state across calls: a streamer whose first put (the prompt) raised left a path sink
    open (one file handle per failed call, while the exception lived); a streamer whose end() raised was
    ended twice; a DraftModelDrafter built without a generator, passed as candidate_generator, drew from
    the global RNG instead of the call's `generator` (seeded calls did not repeat); quantize_weights'
    first call in a process drew from the global RNG."""
    import gc
    import os

    target = tiny_model("llama", seed=1)
    draft = perturbed(target, noise=0.05)

    class Gone(BaseStreamer):
        def __init__(self, fail_put=True):
            self.fail_put, self.ends = fail_put, 0

        def put(self, value):
            if self.fail_put:
                raise BrokenPipeError("client gone")

        def end(self):
            self.ends += 1
            if not self.fail_put:
                raise BrokenPipeError("client gone")

    kept = []
    open_before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(BrokenPipeError) as caught:
            spec(target, draft, max_new_tokens=6, do_sample=False, spec_streamer=Gone(), acceptance_sink=str(tmp_path / "r.jsonl"))
        kept.append(caught.value)  # a kept exception keeps its frames: the sink must be closed before
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == open_before
    ending = Gone(fail_put=False)
    with pytest.raises(BrokenPipeError):
        spec(target, draft, max_new_tokens=6, do_sample=False, spec_streamer=ending)
    assert ending.ends == 1

    own = hf_specdec.DraftModelDrafter(draft, None, True)  # no generator of its own

    def run():
        return target.generate(PROMPT, do_sample=True, max_new_tokens=12, custom_generate=hf_specdec.speculative_generate,
                               candidate_generator=own, costs=hf_specdec.Costs(draft_step=0.2, verify=0.05),
                               generator=torch.Generator().manual_seed(0)).tolist()

    first = run()
    torch.manual_seed(123)  # the global RNG moved: the call's generator alone decides
    assert run() == first
    from hf_specdec.quantize import _kernel_problem

    _kernel_problem.cache_clear()
    torch.manual_seed(0)
    hf_specdec.quantize_weights(perturbed(target, noise=0.01), 8)
    after = torch.rand(2)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(2))


def test_what_is_reported_matches_what_happened():
    """From a probe of the acceptance logs. (1) A batch without EOS whose rows a criterion stops decodes on
    until the last stops, then cuts the rows that ran past it: records written before the cut still listed
    the cut tokens as emitted. (2) A tree whose accepted branch ends at a leaf counted the next depth as
    reached (no node was there to verify). (3) A source of one's own that proposed nothing counted an
    n-gram round, not a plain step."""
    target = tiny_model("llama", seed=0)
    draft = perturbed(target, noise=0.02)

    class StopOn(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == 10

    ids = torch.tensor([[0, 0, 0, 1, 5, 9, 2, 7], [1, 8, 8, 2, 3, 11, 12, 13]])
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    records = []
    out = target.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False,
                          stopping_criteria=StoppingCriteriaList([StopOn()]), custom_generate=hf_specdec.speculative_generate,
                          assistant=draft, return_dict_in_generate=True, acceptance_sink=records.append,
                          costs=hf_specdec.Costs(draft_step=0.05, verify=0.02))
    assert torch.equal(out.sequences, target.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False,
                                                      stopping_criteria=StoppingCriteriaList([StopOn()])))
    for row in range(2):
        emitted = [t for r in records if r.row == row for t in r.emitted_tokens]
        assert emitted == out.sequences[row, 8:].tolist() and len(emitted) == out.acceptance_per_row[row].emitted
    assert sum(len(r.emitted_tokens) for r in records) == out.acceptance.emitted

    records = []
    out = target.generate(torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6, 7, 5]]), max_new_tokens=30, do_sample=False,
                          custom_generate=hf_specdec.speculative_generate, assistant=perturbed(target, noise=0.1),
                          return_dict_in_generate=True, acceptance_sink=records.append,
                          costs=hf_specdec.Costs(draft_step=0.05, verify=0.02))
    reached = [0] * len(out.acceptance.reached_per_position)
    for r in records:
        last = r.path[-1] if r.path else -1
        looked = r.num_accepted + (last in r.parents) if r.parents is not None else min(r.num_accepted + 1, len(r.draft_tokens))
        for depth in range(looked):
            reached[depth] += 1
    assert any(r.parents is not None for r in records) and out.acceptance.reached_per_position == reached

    records = []
    out = target.generate(torch.tensor([[3, 4, 5, 6, 7, 8, 9, 11]]), max_new_tokens=12, do_sample=False,
                          custom_generate=hf_specdec.speculative_generate, candidate_generator=hf_specdec.NgramDrafter(),
                          return_dict_in_generate=True, acceptance_sink=records.append)
    empty = [r for r in records if not r.draft_tokens]
    assert empty and all(r.source == "none" for r in empty)
    assert out.acceptance.plain_rounds == len(empty) and out.acceptance.ngram_rounds == len(records) - len(empty)


def test_stopping_criteria_get_the_scores_plain_decoding_passes():
    """Before: each criterion got the current token's scores as one [1, vocab] tensor, where plain passes
    None or (output_scores) the tuple of every step's scores; transformers' ConfidenceCriteria raised."""
    from transformers.generation.stopping_criteria import ConfidenceCriteria

    target = tiny_model("llama", seed=4)
    draft = perturbed(target, noise=0.3)
    seen = []

    class Record(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append(None if scores is None else (len(scores), tuple(scores[-1].shape)))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    for kwargs in (dict(), dict(return_dict_in_generate=True, output_scores=True)):
        for run in (lambda **kw: target.generate(PROMPT, **kw), lambda **kw: spec(target, draft, **kw)):
            seen.clear()
            run(max_new_tokens=6, do_sample=False, eos_token_id=None, stopping_criteria=StoppingCriteriaList([Record()]),
                **kwargs)
            assert seen == ([None] * 6 if not kwargs else [(n, (1, target.config.vocab_size)) for n in range(1, 7)])
    kwargs = dict(max_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  stopping_criteria=StoppingCriteriaList([ConfidenceCriteria(0.02)]))
    assert torch.equal(spec(target, draft, **kwargs).sequences, target.generate(PROMPT, **kwargs).sequences)


def test_a_float_attention_mask_and_flex_attention_trees():
    """Before: a float mask (plain takes one) raised a TypeError once a batch compacted its holes; and a
    flex-attention model's tree forward (a 4-D mask) aborted the process on a CPU: it now decodes with chains."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)).eval()
    draft = perturbed(target, noise=0.3)
    rows = [[1, 5, 9, 2, 5, 9, 2, 5, 9, 2, 5, 9, 4], [5, 9, 2, 5, 9, 4], [3, 3, 3], [50, 50]]
    ids = torch.tensor([[0] * (13 - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (13 - len(r)) + [1] * len(r) for r in rows]).float()
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=40, eos_token_id=127, pad_token_id=0)
    out = target.generate(ids, custom_generate=hf_specdec.speculative_generate, assistant=draft,
                          costs=hf_specdec.Costs(draft_step=0.01, verify=0.01), **kwargs)
    assert torch.equal(out, target.generate(ids, **kwargs))
    from hf_specdec.cache import column_bound

    assert column_bound(target)[1] is None
    target.set_attn_implementation("flex_attention")
    assert "flex" in column_bound(target)[1]
    prompt = torch.tensor([[1, 5, 9, 2, 5, 9, 2, 5, 9, 4]])
    kwargs = dict(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    out = target.generate(prompt, custom_generate=hf_specdec.speculative_generate, assistant=draft, tree=True, **kwargs)
    assert torch.equal(out, target.generate(prompt, **kwargs))


def test_a_sliding_window_cache_is_left_as_plain_leaves_it():
    """Before: the returned cache kept every column with past recording on, and a plain follow-up call on it
    kept growing (120 columns where plain keeps 7 for a window of 8)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    target = MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, sliding_window=8)).eval()
    ids = torch.tensor([[1, 5, 9, 2, 5, 9, 2, 5, 9, 2, 5, 9, 4]])
    kwargs = dict(do_sample=False, max_new_tokens=60, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
    plain = target.generate(ids, **kwargs)
    out = target.generate(ids, custom_generate=hf_specdec.speculative_generate, assistant=target, **kwargs)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.cache.layers[0].keys.shape == plain.past_key_values.layers[0].keys.shape
    longer = torch.cat([out.sequences, torch.tensor([[3, 4]])], 1)
    after = target.generate(longer, attention_mask=torch.ones_like(longer), cache=out.cache, **kwargs)
    assert after.past_key_values.layers[0].keys.shape[2] == 7


def test_an_offloaded_target_and_a_compiled_draft_are_taken():
    """Before: an accelerate-offloaded target (its weights on meta until a forward) was refused as "on meta",
    and a torch.compile'd draft as a model without a key-value cache (its wrapper's forward takes **kwargs)."""
    import copy

    from accelerate import cpu_offload

    target = tiny_model("llama", seed=2)
    draft = perturbed(target, noise=0.3)
    plain = target.generate(PROMPT, max_new_tokens=12, do_sample=False)
    offloaded = cpu_offload(copy.deepcopy(target), execution_device=torch.device("cpu"))
    assert offloaded.device.type == "meta"
    assert torch.equal(spec(offloaded, draft, max_new_tokens=12, do_sample=False), plain)
    compiled = torch.compile(draft, backend="eager")
    assert torch.equal(spec(target, compiled, max_new_tokens=12, do_sample=False), plain)


def test_a_custom_generate_of_ones_own_calling_hf_specdec_is_still_a_generate_call():
    """A function of one's own as custom_generate (fixing the draft, timing the call) sits between generate()
    and hf_specdec: num_return_sequences stays generate()'s to expand, and a streamer= it kept is refused
    and ended, as with hf_specdec's own callable."""
    target = tiny_model("llama", seed=8)
    draft = perturbed(target, noise=0.5)

    def mine(model, *args, **kwargs):
        return hf_specdec.speculative_generate(model, *args, assistant=draft, **kwargs)

    out = target.generate(PROMPT, custom_generate=mine, max_new_tokens=4, do_sample=True, num_return_sequences=2)
    assert out.shape == (2, PROMPT.shape[1] + 4)
    ends = []
    streamer = BaseStreamer()
    streamer.put, streamer.end = (lambda value: None), (lambda: ends.append(1))
    with pytest.raises(hf_specdec.StreamerNotForwardedError):
        target.generate(PROMPT, custom_generate=mine, max_new_tokens=4, do_sample=False, streamer=streamer)
    assert ends == [1]


def test_direct_calls_and_draft_sources_are_checked_as_generate_would():
    """From an API fuzz. Before: a direct call with max_length at or below the prompt emitted a token past it;
    3-D or float input_ids failed inside the model after forwards ran; assistant= beside candidate_generator=
    dropped the assistant silently; a mask of 2s was blamed on position_ids the caller never passed."""
    target = tiny_model("llama", seed=8)
    draft = perturbed(target, noise=0.5)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    for length in (3, 6):
        with pytest.raises(ValueError, match=f"6 tokens but max_length is {length}"):
            hf_specdec.speculative_generate(target, ids, None, None, GenerationConfig(max_length=length), assistant=draft)
    for bad, said in ((ids[None], "3-D torch.int64"), (ids.float(), "2-D torch.float32")):
        with pytest.raises(ValueError, match=f"input_ids must be a 2-D tensor of token ids.*{said}"):
            hf_specdec.speculative_generate(target, bad, None, None, GenerationConfig(max_length=10), assistant=draft)
    for dtype in (torch.uint8, torch.int16):  # ran in some rounds and failed in the draft's embedding in others
        for kwargs in ({}, dict(adaptive=False, num_draft_tokens=4)):
            with pytest.raises(ValueError, match=f"int64 .torch.long. or int32 token ids, got {dtype}"):
                target.generate(ids.to(dtype), max_new_tokens=4, custom_generate=hf_specdec.speculative_generate,
                                assistant=draft, **kwargs)
    out = target.generate(ids.int(), max_new_tokens=4, custom_generate=hf_specdec.speculative_generate, assistant=draft)
    assert torch.equal(out, target.generate(ids, max_new_tokens=4, do_sample=False))
    with pytest.raises(ValueError, match="both assistant= and candidate_generator="):
        spec(target, draft, max_new_tokens=4, candidate_generator=hf_specdec.NgramDrafter())
    for mask in (torch.full((1, 6), 2), torch.full((1, 6), 0.5)):
        with pytest.raises(ValueError, match="attention_mask must hold 0 .padding. and 1 .a token. only"):
            target.generate(ids, attention_mask=mask, max_new_tokens=4, custom_generate=hf_specdec.speculative_generate,
                            assistant=draft)
    result, = hf_specdec.generate_continuous(target, [{"input_ids": [5, 6, 7], "attention_mask": [0.5, 1, 1]}],
                                             assistant=draft, max_new_tokens=3)  # that request's error, as the docs say
    assert not result.ok and "attention_mask must hold 0" in str(result.error)
    for name in ("input_ids", "inputs"):  # transformers' error named the first prompt as passed alongside input_ids
        with pytest.raises(ValueError, match=f"generate_continuous takes no {name} argument"):
            hf_specdec.generate_continuous(target, [[5, 6, 7]], assistant=draft, max_new_tokens=3, **{name: ids})


def test_a_direct_call_without_processors_refuses_a_config_that_asks_for_some():
    """From an API probe. A direct call applies the processors and criteria it is passed, as transformers' decoding
    methods do. Before: one passing none sampled at temperature 1 with temperature=0.01, top_k=1 in its config,
    and decoded past its eos_token_id, without a word."""
    target = tiny_model("llama", seed=8)
    draft = perturbed(target, noise=0.5)
    ids = torch.tensor([[1, 5, 9, 2]])
    for config, named in ((GenerationConfig(max_length=10, do_sample=True, temperature=0.01, top_k=1), "temperature, top_k"),
                          (GenerationConfig(max_length=10, eos_token_id=5), "eos_token_id"),
                          (GenerationConfig(max_length=10, repetition_penalty=1.3), "repetition_penalty")):
        with pytest.raises(ValueError, match=f"so {named} of the GenerationConfig would be ignored"):
            hf_specdec.speculative_generate(target, ids, None, None, config, assistant=draft)
    with pytest.raises(ValueError, match="so remove_invalid_values of"):
        hf_specdec.speculative_generate(target, ids, None, None, GenerationConfig(max_length=10, remove_invalid_values=True),
                                        assistant=draft)
    neutral = GenerationConfig(max_length=10, do_sample=False, temperature=0.01, top_k=1, repetition_penalty=1.0,
                               min_new_tokens=3, sequence_bias={})  # no eos: transformers builds no min-length processor
    out = hf_specdec.speculative_generate(target, ids, None, None, neutral, assistant=draft)  # greedy reads no warper
    assert torch.equal(out, target.generate(ids, max_length=10, do_sample=False))
    out = hf_specdec.speculative_generate(target, ids, LogitsProcessorList(), StoppingCriteriaList(),
                                          GenerationConfig(max_length=10, eos_token_id=5), assistant=draft)
    assert out.shape[1] == 10  # lists passed: the caller's, as transformers' decoding methods take them
    with torch.enable_grad():  # generate() runs under no_grad; a direct call recorded graphs (memory grew with length)
        out = hf_specdec.speculative_generate(target, ids, None, None, GenerationConfig(max_length=10, output_logits=True,
                                              return_dict_in_generate=True), assistant=draft)
    assert not any(logits.requires_grad for logits in out.logits)
    with pytest.raises(ValueError, match=r"num_draft_token \(did you mean num_draft_tokens\?\)"):  # a typo, not an input
        hf_specdec.speculative_generate(target, ids, None, None, GenerationConfig(max_length=10), assistant=draft,
                                        num_draft_token=3)


def test_a_direct_calls_own_arguments_and_the_sink_and_draft_are_named():
    """From an API fuzz. Before: AttributeErrors from inside the loop (generation_config=None, a str as the
    model, streamer or processors), a sink taking no argument failed after the first round's forwards, and a
    draft moved to meta passed validation and failed when it first drafted."""
    target = tiny_model("llama", seed=8)
    draft = perturbed(target, noise=0.5)
    ids, config = torch.tensor([[1, 5, 9, 2]]), GenerationConfig(max_length=8)
    for args, kwargs, said in (((target, ids, None, None, None), {}, "GenerationConfig generate.. prepares"),
                               (("target", ids, None, None, config), {}, "got str and GenerationConfig"),
                               ((target, ids, "x", None, config), {}, "logits_processor must be a list of callables"),
                               ((target, ids, None, "x", config), {}, "stopping_criteria must be a list of callables"),
                               ((target, ids, None, None, config), {"streamer": "x"}, "streamer must be a streamer")):
        with pytest.raises(ValueError, match=said):
            hf_specdec.speculative_generate(*args, assistant=draft, **kwargs)
    with pytest.raises(ValueError, match="acceptance_sink must be a callable taking one argument"):
        spec(target, draft, max_new_tokens=4, acceptance_sink=lambda: None)
    with pytest.raises(ValueError, match="the draft's weights are on meta and nothing will load them"):
        spec(target, perturbed(target, noise=0.5).to("meta"), max_new_tokens=4)
    from hf_specdec.proposals import DraftModelDrafter

    for kwargs, said in ((dict(model="draft"), "takes a transformers causal LM"), (dict(window=2.5), "window must be"),
                         (dict(generator=5), "generator must be"),
                         (dict(logits_processor="procs"), "logits_processor must be"),
                         (dict(do_sample="no"), "do_sample must be True or False")):  # each failed inside the loop (or sampled)
        with pytest.raises(ValueError, match=said):
            DraftModelDrafter(**{"model": draft, "logits_processor": None, "do_sample": False, **kwargs})


def test_what_the_argument_checks_must_still_take():
    """From a review of the checks above: a compiled target, do_sample=None (a GenerationConfig's default) in a
    DraftCandidateGenerator, and a MaxLengthCriteria shorter than the prompt (plain emits one token) were
    refused; generate_continuous left a streamer un-ended when an earlier check failed."""
    from transformers import MaxLengthCriteria
    from hf_specdec.proposals import DraftCandidateGenerator

    target = tiny_model("llama", seed=8)
    draft = perturbed(target, noise=0.5)
    compiled = torch.compile(target, backend="eager")
    result, = hf_specdec.generate_continuous(compiled, [[5, 6, 7]], assistant=draft, max_new_tokens=5)
    assert result.ok and result.tokens.tolist() == target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5,
                                                                   do_sample=False)[0, 3:].tolist()
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    out = hf_specdec.speculative_generate(compiled, ids, None, None, GenerationConfig(max_length=9), assistant=draft)
    assert torch.equal(out, target.generate(ids, max_length=9, do_sample=False))
    generator = DraftCandidateGenerator(draft, None, 4, GenerationConfig().do_sample)  # None: greedy
    assert torch.equal(spec(target, None, candidate_generator=generator, max_new_tokens=6),
                       target.generate(PROMPT, max_new_tokens=6, do_sample=False))
    short = StoppingCriteriaList([MaxLengthCriteria(max_length=4)])
    kwargs = dict(max_new_tokens=6, do_sample=False, stopping_criteria=short)
    assert torch.equal(target.generate(ids, custom_generate=hf_specdec.speculative_generate, assistant=draft, **kwargs),
                       target.generate(ids, **kwargs))
    ends = []

    class Ends(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            ends.append(1)

    with pytest.raises(ValueError, match="streamers take one row"):  # refused and ended before the other checks
        hf_specdec.generate_continuous(target, [[5, 6, 7]], assistant=draft, eos_token_id="x", streamer=Ends())
    assert ends == [1]
