"""The retrieval cache (issue 39): what it proposes, its bounds and persistence, and generate() with it.
Exactness with it (chi-square and broken variants) is in test_exactness.py."""

from __future__ import annotations

import json
import threading
from collections import Counter

import numpy as np
import pytest
import torch

import hf_specdec
from conftest import perturbed, tiny_model
from hf_specdec import RetrievalCache
from hf_specdec.proposals.base import DraftRequest

PINNED = dict(costs=hf_specdec.Costs(draft_step=0.1, verify=0.02))


def test_the_most_frequent_continuation_of_the_longest_match_comes_first():
    cache = RetrievalCache(context=2)
    for output in ([5, 6, 7, 8, 9], [5, 6, 7, 1, 1], [5, 6, 7, 8, 4]):
        cache.add(output, context=[0, 2, 3])  # three answers to one prompt ending in 2, 3
    # a new answer to that prompt: its context (the prompt's tail) matches; 5 6 7 8 followed twice
    continuations, size = cache.lookup([4, 2, 3], max_tokens=8, max_branches=3)
    assert continuations == [[5, 6, 7, 8, 4], [5, 6, 7, 8, 9], [5, 6, 7, 1, 1]] and size == 2
    assert cache.lookup([2, 3], max_tokens=2)[0] == [[5, 6]]  # max_tokens bounds each continuation
    # each token's share of the occurrences that reached its parent: 5 6 7 all three, 8 two of three, 4 one of two
    continuations, size, shares = cache.lookup_shares([4, 2, 3], max_tokens=8, max_branches=2)
    assert continuations[0] == [5, 6, 7, 8, 4] and shares == [[1, 1, 1, 2 / 3, 1 / 2], [1, 1, 1, 2 / 3, 1 / 2]]
    assert cache.lookup_shares([42], max_tokens=5) == ([], 0, [])
    # an occurrence that stops (an open row's tokens so far) does not count against the way on
    rows = RetrievalCache(context=0)
    rows.open("a"), rows.open("b")
    rows.extend("a", [2, 3, 5]), rows.extend("b", [2, 3, 5, 6, 7, 8])
    assert rows.lookup_shares([9, 2, 3], max_tokens=8) == ([[5, 6, 7, 8]], 2, [[1, 1, 1, 1]])
    # a longer match outranks a shorter one: 9 2 3 occurs nowhere, but 7 8 (size 2) does; 6 7 8 (3) does too
    assert cache.lookup([1, 6, 7, 8], max_tokens=3, max_branches=3) == ([[4], [9]], 3)
    # continuations stop at the end of their sequence; no match across sequences
    assert cache.lookup([8, 9], max_tokens=5) == ([], 0)
    assert cache.lookup([9, 5], max_tokens=5)[1] <= 1  # "9 5" spans two sequences: only the 1-gram "5" matches
    assert cache.lookup([42], max_tokens=5) == ([], 0)
    assert cache.lookup([7], max_tokens=5, min_match=2) == ([], 0)  # a 1-gram is not enough when asked for 2


def test_open_sequences_are_searched_by_others_and_join_when_closed():
    cache = RetrievalCache(context=1)
    cache.open("a", context=[3])
    cache.open("b", context=[3])
    cache.extend("a", [10, 11, 12])
    assert cache.lookup([3, 10], max_tokens=4, exclude="b") == ([[11, 12]], 2)  # b sees a's tokens
    assert cache.lookup([3, 10], max_tokens=4, exclude="a") == ([], 0)  # a's own text is in-row lookup's
    cache.extend("b", [10, 13])
    assert cache.lookup([3, 10], max_tokens=4, max_branches=2)[0] == [[13], [11, 12]]  # equal counts: most recent first
    with pytest.raises(ValueError, match="already open"):
        cache.open("a")
    cache.close("a")
    cache.close("b")
    assert len(cache) == 4 + 1 + 3 + 1  # two sequences with their one-token context, a separator each
    assert cache.lookup([3, 10], max_tokens=4, max_branches=2)[0] == [[13], [11, 12]]


def test_memory_is_bounded_oldest_first_and_the_cache_round_trips_through_disk(tmp_path):
    cache = RetrievalCache(max_tokens=60, context=0)
    for i in range(20):
        cache.add([100 + i] * 5 + [i])
    assert len(cache) <= 60
    assert cache.lookup([100], max_tokens=1) == ([], 0)  # the oldest are gone
    assert cache.lookup([119, 119], max_tokens=2) == ([[119, 119]], 2)  # the newest remain
    assert 0 < cache.memory_bytes() < 100_000
    cache.acceptance.observe(4, False)
    cache.save(tmp_path / "cache.json")
    loaded = RetrievalCache.load(tmp_path / "cache.json")
    assert len(loaded) == len(cache) and loaded.max_tokens == 60
    assert loaded.acceptance.at(4) == cache.acceptance.at(4) < 0.8 and loaded.acceptance.seen == {4: 1}
    assert loaded.lookup([119, 119], max_tokens=2) == cache.lookup([119, 119], max_tokens=2)
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a saved hf_specdec.RetrievalCache"):
        RetrievalCache.load(tmp_path / "other.json")
    with pytest.raises(FileNotFoundError):  # as open() raises it, so `except FileNotFoundError` starts anew
        RetrievalCache.load(tmp_path / "missing.json")
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(ValueError, match="cannot read"):
        RetrievalCache.load(tmp_path / "folder.json")
    # the right format tag over the wrong structure: a ValueError naming the file (a KeyError, TypeError or
    # AttributeError before), and learned values that are not probabilities
    import json

    from hf_specdec.retrieval import FORMAT

    good = json.loads((tmp_path / "cache.json").read_text())
    for broken in ({"format": FORMAT}, {**good, "settings": [1]}, {**good, "settings": {"foo": 1}},
                   {**good, "acceptance": {"per_size": [1]}}, {**good, "acceptance": {"pooled": -1.0}},
                   {**good, "acceptance": {"pooled": "0.5"}}, {**good, "acceptance": {"pooled": True}},
                   {**good, "acceptance": {"seen": {"2": -1}}}, {**good, "sequences": [[1, -2]]},
                   {**good, "sequences": "abc"}, {**good, "sequences": [[1, 2.5]]}):
        (tmp_path / "bad.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match="bad.json"):
            RetrievalCache.load(tmp_path / "bad.json")



def test_eviction_indexes_each_sequence_once_and_keeps_most_of_the_cache(monkeypatch):
    """Before: each eviction rebuilt the whole index from the tokens kept, under the lock (2-4 s at
    250,000 tokens, every 25,000 tokens added, while every lookup of every thread waited)."""
    from hf_specdec import retrieval

    indexed = []
    original = retrieval._Finished.add
    monkeypatch.setattr(retrieval._Finished, "add", lambda self, *args: (indexed.append(1), original(self, *args)))
    cache = RetrievalCache(max_tokens=1000, context=0)
    for i in range(300):
        cache.add([i % 200, 7, 8, i % 13, 9])
        assert len(cache) <= 1000
        if i >= 200:
            assert len(cache) >= 850  # what eviction keeps: all but the oldest tenth or so
    assert len(indexed) == 300
    assert cache.lookup([299 % 200, 7, 8], max_tokens=2) == ([[299 % 13, 9]], 3)  # the newest remain
    assert cache.lookup([100, 7], max_tokens=1, min_match=2) == ([], 0)  # the oldest are gone (about 165 fit)

def test_bounds_hold_in_long_use_and_a_used_cache_round_trips(tmp_path):
    """Before: a closed row's index entries stayed until a lookup met them (memory grew without bound
    while len() stayed under max_tokens); a prompt shorter than `context` but over half of it kept
    1-7 of its tokens; one sequence longer than the cache evicted itself; an acceptance learned with
    shares under 1 (above 1 per unit of share, capped where read) made a file `load` refused."""
    import copy
    import random

    rng = random.Random(0)
    cache = RetrievalCache(max_tokens=1000, context=0)
    sizes = []
    for i in range(3001):
        cache.open(i)
        cache.extend(i, [rng.randrange(50_000) for _ in range(20)])
        cache.close(i)
        if i % 1000 == 0:
            sizes.append(cache.memory_bytes())
    assert len(cache) <= 1000 and max(sizes[1:]) < 1.5 * sizes[1], sizes  # it had grown 30 KB -> 17 MB -> 46 MB
    for n in (8, 9, 12, 15, 16, 20):
        short = RetrievalCache(context=16)
        short.add([100, 101], context=list(range(n)))
        assert len(short) == min(n, 16) + 2 + 1
    tail = RetrievalCache(max_tokens=20, context=0)
    tail.add(list(range(50)))
    assert 0 < len(tail) <= 20 and tail.lookup([47], max_tokens=2) == ([[48, 49]], 1)  # its newest tokens kept
    tail.add([7, 8])  # the long one is evicted: its ids no longer count against a smaller vocabulary
    assert tail.max_token_id == 8 and len(tail) == 3
    cache.acceptance.observe(2, True, 0.5)  # as generate() does with shares under 1
    cache.save(tmp_path / "used.json")
    assert RetrievalCache.load(tmp_path / "used.json").acceptance.per_size == cache.acceptance.per_size
    assert copy.deepcopy(cache).lookup([1], max_tokens=3) == cache.lookup([1], max_tokens=3)  # no lock in a copy
    with pytest.raises(ValueError, match="no sequence is open under 'nobody'"):
        cache.extend("nobody", [1])
    with pytest.raises(ValueError, match="token ids must be integers"):
        cache.lookup([1.7, 2.2], max_tokens=2)  # floats are not rounded into ids
    with pytest.raises(ValueError, match="max_tokens must be an integer"):
        cache.lookup([1], max_tokens=True)
    shallow = copy.copy(cache)  # its own store: adding to it leaves the original as it was
    shallow.add([7, 7, 7])
    assert len(shallow) != len(cache)
    assert cache.lookup([1], max_tokens=0) == ([], 0)


@pytest.mark.parametrize("kwargs, name", [(dict(max_tokens=0), "max_tokens"), (dict(context=-1), "context"),
                                          (dict(index_ngram=True), "index_ngram"), (dict(max_match=1.5), "max_match")])
def test_bad_settings_and_tokens_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RetrievalCache(**kwargs)
    with pytest.raises(ValueError, match="token ids must be integers >= 0"):
        RetrievalCache().add([1, -5])
    # a refused add or open keeps nothing: before, the context's ids counted against every later target's
    # vocabulary, and the key stayed half-open
    cache = RetrievalCache()
    with pytest.raises(ValueError, match="got -1"):
        cache.add([-1], context=[1000])
    assert cache.max_token_id == -1 and len(cache) == 0
    with pytest.raises(ValueError, match="got -2"):
        cache.open("k", [5, -2])
    cache.open("k", [5])
    with pytest.raises(ValueError, match="got -3"):
        cache.extend("k", [900, -3])
    assert cache.max_token_id == 5
    assert RetrievalCache(max_tokens=np.int64(100)).max_tokens == 100  # numpy ints, as SpeculativeConfig takes them
    short = RetrievalCache(max_tokens=10)
    short.add([200] + [1] * 20)  # longer than the cache: only its tail is kept, and only that counts
    assert short.max_token_id == 1
    with pytest.raises(ValueError, match="tokens must be one sequence of token ids, got int"):  # a raw TypeError
        cache.add(5)
    for context_size in (4, 0):  # a bad context was named as bad tokens, and ignored where no context is kept
        with pytest.raises(ValueError, match="context must be one sequence of token ids, got str"):
            RetrievalCache(context=context_size).add([1, 2, 3], context="the prompt")
        with pytest.raises(ValueError, match="token ids must be integers"):
            RetrievalCache(context=context_size).add([1, 2, 3], context=[1.5])
    for bad in (dict(max_branches=0), dict(max_branches=-1), dict(min_match="a")):  # -1 dropped a branch silently
        with pytest.raises(ValueError, match="RetrievalCache.lookup: (max_branches|min_match)"):
            cache.lookup([5], 2, **bad)


def test_threads_share_one_cache():
    cache = RetrievalCache(context=0)
    errors = []

    def work(t):
        try:
            for i in range(200):
                cache.open((t, i))
                cache.extend((t, i), [t, i % 7, 1000 + t])
                cache.lookup([t, i % 7], max_tokens=2, exclude=(t, i))
                cache.close((t, i))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(cache) == 4 * 200 * 4  # every sequence intact (3 tokens and a separator)
    assert cache.lookup([2, 3], max_tokens=1) == ([[1002]], 2)


# ---------------------------------------------------------------- through generate


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_with_a_cache_equals_plain_greedy_and_a_repeated_prompt_is_retrieved(arch):
    target = tiny_model(arch, seed=1)
    draft = perturbed(target, 0.5)
    cache = RetrievalCache()
    first, second = torch.tensor([[1, 5, 2, 7, 9, 4]]), torch.tensor([[3, 8, 2, 7, 9, 4]])
    for prompt in (first, second, first):
        plain = target.generate(prompt, do_sample=False, max_new_tokens=40)
        records = []
        out = target.generate(prompt, custom_generate=hf_specdec.speculative_generate, assistant=draft, do_sample=False,
                              max_new_tokens=40, retrieval_cache=cache, acceptance_sink=records.append,
                              return_dict_in_generate=True, **PINNED)
        assert torch.equal(out.sequences, plain)
    # the third call answers the first prompt again: its whole output is in the cache
    assert Counter(r.retrieval for r in records)["cache"] >= 1 and out.acceptance.rounds <= 5
    # every call's whole output is kept, its last round's tokens too: per call the prompt (6 tokens,
    # under the 16-token context), 40 generated tokens and a separator
    assert len(cache) == 3 * (6 + 40 + 1)
    assert sum(cache.acceptance.seen.values()) > 0  # what its proposals earned is kept for the next call


def test_rows_of_a_batch_retrieve_from_each_other_and_stay_exact_in_greedy():
    target = tiny_model("llama", seed=1)
    draft = perturbed(target, 0.5)
    prompts = torch.tensor([[1, 5, 2, 7, 9, 4], [1, 5, 2, 7, 9, 4], [0, 3, 8, 2, 7, 9]])
    mask = torch.tensor([[1] * 6, [1] * 6, [0] + [1] * 5])
    plain = target.generate(prompts, attention_mask=mask, do_sample=False, max_new_tokens=30)
    records = []
    out = target.generate(prompts, attention_mask=mask, custom_generate=hf_specdec.speculative_generate,
                          assistant=draft, do_sample=False, max_new_tokens=30, acceptance_sink=records.append,
                          return_dict_in_generate=True, **PINNED)
    assert torch.equal(out.sequences, plain)
    assert any(r.retrieval == "cache" for r in records)  # rows 0 and 1 are the same prompt: one copies the other


def test_retrieval_cache_arguments_are_checked():
    target = tiny_model("llama", seed=1)
    prompt = torch.tensor([[1, 5, 2]])
    kwargs = dict(custom_generate=hf_specdec.speculative_generate, assistant=target, max_new_tokens=3)
    with pytest.raises(ValueError, match="retrieval_cache must be an hf_specdec.RetrievalCache"):
        target.generate(prompt, retrieval_cache={}, **kwargs)
    with pytest.raises(ValueError, match="retrieval_cache .* needs ngram=True"):
        target.generate(prompt, retrieval_cache=RetrievalCache(), ngram=False, **kwargs)
    # a transformers CandidateGenerator proposes alone: the cache had been ignored silently
    with pytest.raises(ValueError, match="CandidateGenerator proposes alone"):
        target.generate(prompt, retrieval_cache=RetrievalCache(), candidate_generator=hf_specdec.NgramCandidateGenerator(),
                        custom_generate=hf_specdec.speculative_generate, max_new_tokens=3)


def test_ids_past_the_target_vocabulary_added_while_a_call_runs_are_never_proposed():
    """A cache shared with a larger model's calls in another thread: its ids were proposed to the smaller
    target (an IndexError in the embedding; a device assert on CUDA). The sink stands in for the thread."""
    target = tiny_model("llama", seed=1)
    draft = perturbed(target, 0.5)
    vocab = target.config.vocab_size
    prompt = torch.tensor([[3, 4, 5]])
    cache = RetrievalCache(context=0)

    def other_thread(record):
        if record.round == 0:
            for t in range(vocab):
                cache.add([t, vocab + 10, vocab + 11, t])

    out = target.generate(prompt, do_sample=False, max_new_tokens=20, custom_generate=hf_specdec.speculative_generate,
                          assistant=draft, retrieval_cache=cache, acceptance_sink=other_thread, **PINNED)
    assert torch.equal(out, target.generate(prompt, do_sample=False, max_new_tokens=20))
    # the ids are filtered by what a lookup returns, not by max_token_id, which another thread's eviction may lower
    cache.max_token_id = 0
    out = target.generate(prompt, do_sample=False, max_new_tokens=20, custom_generate=hf_specdec.speculative_generate,
                          assistant=draft, retrieval_cache=cache, **PINNED)
    assert torch.equal(out, target.generate(prompt, do_sample=False, max_new_tokens=20))


def test_left_padding_is_not_kept_as_a_prompt_tail():
    target = tiny_model("llama", seed=1)
    cache = RetrievalCache(context=16)
    ids, mask = torch.tensor([[0, 0, 0, 5, 6, 7], [1, 2, 3, 5, 6, 7]]), torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4, retrieval_cache=cache,
                    custom_generate=hf_specdec.speculative_generate, assistant=perturbed(target, 0.5), **PINNED)
    assert len(cache) == (3 + 4 + 1) + (6 + 4 + 1)  # the padded row's 3 pad ids are not context


def test_a_continuous_stream_shares_one_cache_across_its_requests():
    target = tiny_model("llama", seed=1)
    draft = perturbed(target, 0.5)
    prompt = [1, 5, 2, 7, 9, 4]
    plain = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30)[0, 6:].tolist()
    records = []
    results = hf_specdec.generate_continuous(target, [prompt, prompt], assistant=draft, max_batch_size=1,
                                             do_sample=False, max_new_tokens=30, acceptance_sink=records.append, **PINNED)
    assert [r.tokens.tolist() for r in results] == [plain, plain]
    second = [r for r in records if r.row == 1]
    assert second and any(r.retrieval == "cache" for r in second)  # the second request copies the first's answer


def test_the_source_passed_over_is_scored_against_the_emitted_tokens():
    """A row's cache match is proposed (it is expected to be accepted more often); the in-row
    continuation it displaced is kept in `passed_over` and learns from the tokens the round emitted."""
    from hf_specdec.planner import Acceptance
    from hf_specdec.proposals.ngram import NgramDrafter
    from hf_specdec.retrieval import Retrieval
    from hf_specdec.stats import CACHE, NGRAM

    cache = RetrievalCache(context=0)
    cache.add([5, 6, 7, 8, 9, 10])
    acceptance = Acceptance(4)
    for _ in range(30):
        acceptance.observe_lookup(2, True, CACHE)
        acceptance.observe_lookup(2, False, NGRAM)
    retrieval = Retrieval(NgramDrafter(3, 1), cache, acceptance.lookup_at)
    host = [[1, 6, 7, 3, 6, 7]]  # in-row: "6 7" was followed by 3; the cache: by 8, 9, 10
    retrieval.sync([host[0][:2]], [host[0][2:]], [0])
    request = DraftRequest(torch.tensor(host), None, None, max_tokens=3, host=host)
    (tokens, size, source), = retrieval.match_rows(request, [0])
    assert (tokens, size, source) == ([8, 9, 10], 2, CACHE)
    assert retrieval.passed_over == {0: ([3, 6, 7], 2, NGRAM)}
    before = acceptance.matches(NGRAM).seen.get(2, 0)
    acceptance.score_unverified(*retrieval.passed_over[0][:1], [3, 9], *retrieval.passed_over[0][1:])
    assert acceptance.matches(NGRAM).seen[2] == before + 2  # 3 matched, then 6 against 9: stop there
    # a lookup where only in-row lookup matches passes nothing over
    assert retrieval.match_rows(DraftRequest(torch.tensor([[4, 4]]), None, None, 3, host=[[4, 4]]), [0])[0][2] == NGRAM
    assert retrieval.passed_over == {}


def test_a_round_whose_only_lookup_was_cut_to_nothing_is_labelled_plain():
    """Before: the round said "ngram" while its one row said "none", so the call's statistics and the
    per-row ones disagreed."""
    from hf_specdec.proposals.base import Proposal
    from hf_specdec.rounds import _mixed

    chain = Proposal(torch.tensor([[4, 5]]), None, "draft", host=[[4, 5]], forwards=2, confidences=[[0.9, 0.8]])
    mixed = _mixed(chain, [[]], [0])
    assert mixed.source == mixed.source_of(0) == "none"


def test_a_minimum_match_longer_than_the_index_and_tokens_not_one_sequence():
    """A `min_match` above `index_ngram` never matched, however long the match (`ngram_min_size=3` with a
    cache of `index_ngram=2` left the cache unused); a 0-d tensor gave a raw TypeError, a batch's rows a
    message about one row's ids."""
    cache = RetrievalCache(context=0, index_ngram=2)
    cache.add(list(range(1, 12)))
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7], 3, min_match=3) == ([[8, 9, 10]], 4)
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7], 3, min_match=5) == ([[8, 9, 10]], 4)
    assert cache.lookup([40, 5, 6, 7], 3, min_match=4) == ([], 0)  # only 3 tokens match
    for bad in (torch.tensor(3), torch.tensor([[1, 2], [3, 4]]), np.zeros((2, 2), dtype=int)):
        with pytest.raises(ValueError, match="one sequence of token ids"):
            cache.add(bad)


def test_an_ngram_drafter_beside_a_retrieval_cache_is_not_scored_as_the_caches_lookup():
    """Found by a fuzz: with NgramDrafter as the draft source, a round that ran it was scored as the cache's
    lookup, its 5 tokens against the cache's 1-token continuation's shares (an IndexError in _observe_chains)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(7)
    target = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, initializer_range=0.3,
                                        pad_token_id=0)).eval()
    cache = hf_specdec.RetrievalCache()
    cache.add([74, 74, 61, 61, 96, 96, 96, 96, 96, 96, 96, 96, 96, 96, 96, 60, 96, 96, 64, 96, 96, 96, 96, 96, 60, 60, 96, 27, 0])
    ids = torch.tensor([[74, 74]])
    out = target.generate(ids, max_new_tokens=39, do_sample=False, pad_token_id=0,
                          custom_generate=hf_specdec.speculative_generate, candidate_generator=hf_specdec.NgramDrafter(),
                          retrieval_cache=cache, tree=False, costs=hf_specdec.Costs(draft_step=0.05, verify=0.0))
    assert torch.equal(out, target.generate(ids, max_new_tokens=39, do_sample=False, pad_token_id=0))


def test_bad_contexts_queries_and_stream_arguments_are_named():
    """From an API fuzz: raw TypeErrors ('NoneType' object is not iterable) and AttributeErrors before."""
    cache = RetrievalCache()
    cache.add([1, 2, 3], context=None)  # no context, as the default
    for call in (lambda: cache.add([1, 2], context=5), lambda: cache.lookup(None, 4), lambda: cache.lookup(5, 4)):
        with pytest.raises(ValueError, match="(tokens|context) must be one sequence of token ids"):
            call()
    target = tiny_model("llama")
    with pytest.raises(ValueError, match="generate_continuous takes a transformers model"):
        hf_specdec.generate_continuous("model", [[1, 2]], assistant=target)
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        hf_specdec.generate_continuous(target, [[1, 2]], assistant=target, eos_token_id="x")


def test_a_saved_cache_with_odd_match_sizes_is_named(tmp_path):
    """Before: `load` took per_size keys such as "-3" or "1e3" (float() of a string) into the planner's table."""
    import json

    cache = hf_specdec.RetrievalCache()
    cache.add([1, 2, 3, 1, 2, 4])
    path = tmp_path / "c.json"
    cache.save(path)
    data = json.loads(path.read_text())
    for key in ("-3", "0", "x", "1.5"):
        data.setdefault("acceptance", {})["per_size"] = {key: 0.5}
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match="a match size must be a positive integer"):
            hf_specdec.RetrievalCache.load(path)
    data["acceptance"]["per_size"] = {"2": 0.5}
    path.write_text(json.dumps(data))
    assert hf_specdec.RetrievalCache.load(path).acceptance.per_size == {2: 0.5}


def test_bool_ids_deep_files_load_on_a_cache_and_copies_during_a_call(tmp_path):
    """Before: a bool tensor's items passed as ids 1 and 0; a file nested past Python's depth raised a raw
    RecursionError; and a copy taken during a call kept the call's rows open forever (nothing closes them in the copy)."""
    import copy

    cache = hf_specdec.RetrievalCache()
    with pytest.raises(ValueError, match="token ids must be integers"):
        cache.add(torch.tensor([True, False, True]))
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="cannot read a saved hf_specdec.RetrievalCache"):
        RetrievalCache.load(path)
    cache.add([1, 2, 3])
    cache.save(path)
    assert len(RetrievalCache.load(path)) == len(cache)
    cache.open("row", context=[7])
    cache.extend("row", [4, 5])
    for twin in (copy.deepcopy(cache), copy.copy(cache)):
        assert len(twin) == 4 and twin.lookup([4], 2) == ([], 0)  # the finished sequence, not the open row
    cache.close("row")
    assert cache.lookup([4], 2)[0] == [[5]]


def test_saves_are_whole_and_odd_inputs_are_named(tmp_path, monkeypatch):
    """From a probe: a save that failed midway left a cut file where the earlier save had been; a set
    was stored in its arbitrary order; a cap of 1 held 2 tokens; a list as a key, a 0-d tensor as a
    size, and another version's file were refused with bare or vague errors."""
    import json
    import os

    path = tmp_path / "c.json"
    cache = RetrievalCache()
    cache.add([1, 2, 3, 4])
    cache.save(path)
    cache.add(list(range(5, 500)))
    opened = os.fdopen

    class FullDisk:  # the file the save writes: half of it fits
        def __init__(self, fd, *args, **kwargs):
            self.file = opened(fd, *args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, text):
            self.file.write(text[: len(text) // 2])
            raise OSError(27, "File too large")

    monkeypatch.setattr(os, "fdopen", FullDisk)
    with pytest.raises(OSError, match="too large"):
        cache.save(path)
    monkeypatch.undo()
    assert len(RetrievalCache.load(path)) == 5 and list(tmp_path.iterdir()) == [path]  # the earlier save, alone
    for unordered in ({40, 3, 17}, {5: "x", 6: "y"}):
        with pytest.raises(ValueError, match="tokens must be an ordered sequence of token ids, got a (set|dict)"):
            RetrievalCache().add(unordered)
    with pytest.raises(ValueError, match="max_tokens must be at least 2"):
        RetrievalCache(max_tokens=1)
    tiny = RetrievalCache(max_tokens=2)
    tiny.add([7, 8, 9])
    assert len(tiny) <= 2
    with pytest.raises(ValueError, match="key must be hashable"):
        RetrievalCache().open([1, 2])
    sized = RetrievalCache(max_tokens=torch.tensor(1000), context=0)
    assert sized.max_tokens == 1000 and type(sized.max_tokens) is int
    sized.add([1, 2, 3, 4, 1, 2, 3, 4])
    assert sized.lookup([2, 3], max_tokens=torch.tensor(2))[0] == [[4, 1]]
    data = json.loads(path.read_text())
    for found, told in (("hf_specdec.RetrievalCache/2", "'hf_specdec.RetrievalCache/2', written by another version"),
                        (None, "it has no format field")):
        data["format"] = found
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=told):
            RetrievalCache.load(path)


def test_a_match_inside_a_stored_prompt_counts_only_when_it_reaches_the_prompts_start(tmp_path):
    """Before: every chat prompt ends in the same assistant header, so a new prompt matched another
    prompt's stored tail on those tokens alone and was offered the start of that prompt's answer
    (evals/results/cache-value/header_matches.txt), and "header + The" was a 5-token match. A match's
    tokens in a stored prompt now count only if it reaches back to where that prompt starts."""
    header = [90, 91, 92]  # the template's tokens every prompt ends in
    cache = RetrievalCache(context=5)
    cache.add([10, 11, 12], context=[1, 2, 3, 4, *header])  # 5 kept: 3 4 90 91 92
    assert cache.lookup([7, 8, *header], max_tokens=3) == ([], 0)  # another prompt, the same header: nothing
    assert cache.lookup([3, 4, *header], max_tokens=3) == ([[10, 11, 12]], 4)  # the same prompt: its answer
    assert cache.lookup([8, 10, 11], max_tokens=3) == ([[12]], 2)  # a match ending in the output: as before
    # "header + its answer's first token": only the token in the output counts (a 1-token match) ...
    assert cache.lookup([7, 8, *header, 10], max_tokens=2) == ([[11, 12]], 1)
    cache.add([44, 92, 10, 55])  # ... so a corpus's 2-token match of "92 10" is the longer one
    assert cache.lookup([7, 8, *header, 10], max_tokens=2) == ([[55]], 2)
    cache.add([40, 41], context=[*header])  # a prompt shorter than `context`: all of it must match
    assert cache.lookup([*header], max_tokens=2)[0] == [[40, 41]]
    cache.add([90, 91, 92, 50])  # a corpus document (no prompt): matches anywhere
    assert cache.lookup([6, 90, 91, 92], max_tokens=2)[0] == [[50]]
    # rows being generated keep their prompt's extent too
    cache.open("a", context=[1, 2, 3, 4, *header])
    cache.extend("a", [20, 21])
    assert cache.lookup([5, 5, *header], max_tokens=2, exclude="b")[0] == [[50]]  # not row a's answer
    assert cache.lookup([5, 5, *header, 20], max_tokens=2, exclude="b") == ([[21]], 1)
    assert cache.lookup([3, 4, *header], max_tokens=2, exclude="b")[0][0] in ([10, 11], [20, 21])
    # the extents survive a save; a file saved before they were kept loads with none (as matched then)
    cache.close("a")
    cache.save(tmp_path / "c.json")
    loaded = RetrievalCache.load(tmp_path / "c.json")
    assert loaded.lookup([7, 8, *header], max_tokens=2) == cache.lookup([7, 8, *header], max_tokens=2)
    assert loaded.lookup([3, 4, *header], max_tokens=3, max_branches=3)[0] == [[20, 21], [10, 11, 12]]  # equal counts: newest first
    data = json.loads((tmp_path / "c.json").read_text())
    del data["contexts"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert RetrievalCache.load(tmp_path / "old.json").lookup([7, 8, *header], max_tokens=3, max_branches=3)[0]
    data["contexts"] = [0, 6]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="contexts must be a list with one count per sequence"):
        RetrievalCache.load(tmp_path / "bad.json")


def test_a_save_over_a_link_or_a_private_file_keeps_them(tmp_path):
    """Before: saving through a symlink replaced the link with a file (the file it named kept the old
    cache), and a file made private (0600) came back with the default permissions."""
    import os
    import stat

    cache = RetrievalCache()
    cache.add([1, 2, 3])
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    cache.save(real)
    os.chmod(real, 0o600)
    link.symlink_to(real)
    cache.add([4, 5, 6])
    cache.save(link)
    assert link.is_symlink() and len(RetrievalCache.load(real)) == len(cache)
    assert stat.S_IMODE(real.stat().st_mode) == 0o600


@pytest.mark.parametrize("contexts", [[True], [-1], ["3"], [3.0], [[1]], None, 5, [4], [2, 2]])
def test_a_saved_file_with_bad_prompt_extents_is_named(tmp_path, contexts):
    """Each sequence's prompt extent must be a count of at most its length and the saved `context`, one a sequence."""
    cache = RetrievalCache(context=3)
    cache.add([10, 11], context=[1, 2, 3])  # 5 tokens, 3 of them prompt
    cache.save(tmp_path / "c.json")
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["contexts"] == [3]
    data["contexts"] = contexts
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not a valid saved hf_specdec.RetrievalCache"):
        RetrievalCache.load(tmp_path / "bad.json")


def test_a_save_to_a_missing_folder_or_a_folder_names_the_path(tmp_path):
    """From a probe: the error named the hidden file written beside the path, not the path given."""
    cache = RetrievalCache()
    cache.add([1, 2, 3])
    with pytest.raises(FileNotFoundError, match=r"cannot save to .*nowhere/c\.json.*does not exist"):
        cache.save(tmp_path / "nowhere" / "c.json")
    with pytest.raises(IsADirectoryError, match="it is a folder"):
        cache.save(tmp_path)
    assert not list(tmp_path.iterdir())  # nothing left behind
