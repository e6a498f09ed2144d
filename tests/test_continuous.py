"""Continuous batching: prompts join a running batch and leave it as they finish, exact per prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

import hf_specdec
import hf_specdec.rounds as rounds_module
from conftest import chi_square_against, perturbed, tiny_model
from hf_specdec.cache import UnsupportedCacheError, add_row
from test_exactness import ALPHA, NEW, SAMPLING, exact_joint, spec_kwargs


def random_prompts(count: int, seed: int, longest: int = 20, vocab: int = 64) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, longest + 1, (count,), generator=gen).tolist()
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


def with_varied_eos(target, prompts, new_tokens):
    """Sets as EOS the token that plain greedy reaches at the most different steps over `prompts`
    (never for some), so rows finish in different rounds."""
    free = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=new_tokens)[0, len(p):].tolist() for p in prompts]
    def spread(tok):
        steps = [row.index(tok) if tok in row else new_tokens for row in free]
        return len(set(steps)) + (new_tokens in steps)
    eos = max(sorted({t for row in free for t in row}), key=spread)
    target.generation_config.eos_token_id = eos
    return target


class JoinSpy:
    """Counts rows that joined a cache already holding columns (a mid-stream join with a prefill)."""

    def __init__(self, monkeypatch):
        self.warm_joins = 0
        monkeypatch.setattr(rounds_module, "add_row", self)

    def __call__(self, model, cache, ids, mask):
        self.warm_joins += cache.get_seq_length() > 0
        add_row(model, cache, ids, mask)


@pytest.mark.parametrize("levers", [
    {"adaptive": False, "ngram": False, "num_draft_tokens": 3},
    {"costs": hf_specdec.Costs(draft_step=0.05, verify=0.03)},  # the defaults (planner, per-row lookup), costs pinned
], ids=["fixed-k", "per-row-sources"])
def test_stream_greedy_equals_plain_greedy_per_prompt(arch, levers, monkeypatch):
    prompts = random_prompts(12, seed=1)
    target = with_varied_eos(tiny_model(arch, seed=31), prompts, 25)
    draft = perturbed(target, noise=0.5)
    spy, records, finished = JoinSpy(monkeypatch), [], []
    results = hf_specdec.generate_continuous(
        target, prompts, assistant=draft, max_batch_size=3, max_new_tokens=25, do_sample=False,
        acceptance_sink=records.append, on_result=lambda r: finished.append(r.index), **levers,
    )
    assert [r.index for r in results] == list(range(len(prompts)))
    for result, prompt in zip(results, prompts):
        plain = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=25)[0, len(prompt):]
        assert torch.equal(result.tokens, plain), f"prompt {result.index}"
        assert torch.equal(result.prompt, torch.tensor(prompt))
        assert result.acceptance.emitted == len(plain)
    lengths = [len(r.tokens) for r in results]
    assert min(lengths) < 25 <= max(lengths), "some rows should stop at EOS, others run to max_new_tokens"
    first_round = {}
    for record in records:
        first_round.setdefault(record.row, record.round)
    assert sorted(first_round) == list(range(len(prompts)))
    assert max(first_round.values()) > 0 and spy.warm_joins >= 3, "rows must join mid-stream, into warm caches"
    assert finished != sorted(finished), "rows finish in another order than they arrive (EOS in different rounds)"
    rows_per_round = {}
    for record in records:
        rows_per_round[record.round] = rows_per_round.get(record.round, 0) + 1
    assert max(rows_per_round.values()) == 3  # the batch is kept full, never above max_batch_size
    if "costs" in levers:
        assert {"draft", "none"} <= {r.source for r in records}, "rows should mix sources"


def test_cache_length_stays_bounded_over_a_long_stream():
    target = tiny_model("llama", seed=33)
    draft = perturbed(target, noise=0.5)
    prompts = random_prompts(60, seed=2)
    records = []
    results = hf_specdec.generate_continuous(
        target, prompts, assistant=draft, max_batch_size=4, max_new_tokens=20, do_sample=False,
        adaptive=False, ngram=False, num_draft_tokens=3, acceptance_sink=records.append,
    )
    total = sum(len(p) + len(r.tokens) for p, r in zip(prompts, results))
    longest_row = max(len(p) for p in prompts) + 20
    longest_cache = max(r.cache_length for r in records)
    print(f"\n{total} tokens through the stream; longest cache {longest_cache} columns (longest row {longest_row})")
    assert total > 10 * longest_cache  # without compaction the columns would pile up to far more
    # Compaction keeps holes and padding under a quarter of the width (or 32 columns), plus a round's columns.
    assert longest_cache <= max(longest_row + 32, longest_row * 4 // 3) + 4


def test_prompts_arriving_while_it_runs():
    prompts = random_prompts(6, seed=3)
    target = with_varied_eos(tiny_model("qwen2", seed=34), prompts, 12)
    draft = perturbed(target, noise=0.5)

    def arrivals():  # a source that sometimes has nothing waiting
        for i, prompt in enumerate(prompts):
            if i % 2:
                yield None
            yield torch.tensor(prompt)

    results = hf_specdec.generate_continuous(target, arrivals(), assistant=draft, max_batch_size=2,
                                             max_new_tokens=12, do_sample=False)
    for result, prompt in zip(results, prompts):
        plain = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[0, len(prompt):]
        assert torch.equal(result.tokens, plain)
    # Requests with budgets of their own (a serving trace); the others take the call's max_new_tokens.
    budgets = [3, None, 9, 1, None, 5]
    items = [{"input_ids": p, "max_new_tokens": b} for p, b in zip(prompts, budgets)]
    results = hf_specdec.generate_continuous(target, items, assistant=draft, max_batch_size=3, max_new_tokens=7,
                                             do_sample=False)
    for result, prompt, budget in zip(results, prompts, budgets):
        plain = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=budget or 7)[0, len(prompt):]
        assert torch.equal(result.tokens, plain)
    assert hf_specdec.generate_continuous(target, [], assistant=draft, max_new_tokens=4) == []


# ---------------------------------------------------------------- sampling: each prompt's law

STREAM_PROMPTS = [[1, 5, 2], [1, 3]]
STREAM_SAMPLES = 2000  # per prompt


def sample_stream(target, draft, seed) -> list[list[tuple[int, ...]]]:
    """The first NEW tokens of every prompt in one stream that alternates STREAM_PROMPTS."""
    torch.manual_seed(seed)
    stream = [STREAM_PROMPTS[i % len(STREAM_PROMPTS)] for i in range(STREAM_SAMPLES * len(STREAM_PROMPTS))]
    kwargs = {k: v for k, v in spec_kwargs(draft).items() if k != "custom_generate"}
    results = hf_specdec.generate_continuous(target, stream, max_batch_size=4, max_new_tokens=NEW, **SAMPLING, **kwargs)
    per_prompt = [[] for _ in STREAM_PROMPTS]
    for result in results:
        per_prompt[result.index % len(STREAM_PROMPTS)].append(tuple(result.tokens.tolist()))
    return per_prompt


@pytest.fixture(scope="module")
def stream_pair():
    target = tiny_model("llama", vocab=8, seed=21, init=0.25)
    draft = perturbed(target, noise=0.4)
    return target, draft, [exact_joint(target, torch.tensor([p])) for p in STREAM_PROMPTS]


def test_stream_sampling_is_exact_per_prompt(stream_pair, monkeypatch):
    target, draft, laws = stream_pair
    spy = JoinSpy(monkeypatch)
    for row, (law, samples) in enumerate(zip(laws, sample_stream(target, draft, seed=7))):
        statistic, dof, pvalue = chi_square_against(law, samples)
        print(f"\nstream prompt {row}: chi2={statistic:.1f} dof={dof} p={pvalue:.3f}")
        assert pvalue > ALPHA
    assert spy.warm_joins > STREAM_SAMPLES  # nearly every prompt joined a running batch


def test_broken_join_is_detected(stream_pair, monkeypatch):
    """Broken on purpose: a row joining a warm cache gets its prompt's columns from another prompt
    (the previous row's), so the target scores it in the wrong context."""
    target, draft, laws = stream_pair

    def wrong_context(model, cache, ids, mask):
        if cache.get_seq_length() > 0:
            held = cache.get_seq_length()
            for layer in cache.layers:
                layer.keys = torch.cat([layer.keys, layer.keys[-1:, :, :held]])
                layer.values = torch.cat([layer.values, layer.values[-1:, :, :held]])
            return
        add_row(model, cache, ids, mask)

    monkeypatch.setattr(rounds_module, "add_row", wrong_context)
    pvalues = []
    for row, (law, samples) in enumerate(zip(laws, sample_stream(target, draft, seed=8))):
        impossible = sum(s not in law for s in samples)  # sequences the target gives probability 0
        statistic, dof, pvalue = (float("inf"), 0, 0.0) if impossible else chi_square_against(law, samples)
        print(f"\nbroken stream prompt {row}: {impossible} impossible samples, chi2={statistic:.1f} dof={dof} p={pvalue:.2e}")
        pvalues.append(pvalue)
    assert max(pvalues) < ALPHA


# ---------------------------------------------------------------- clear errors


def test_continuous_batching_refuses_what_it_cannot_do():
    target = tiny_model("llama", seed=35)
    draft = perturbed(target, noise=0.5)
    with pytest.raises(ValueError, match="max_batch_size"):
        hf_specdec.generate_continuous(target, [[1, 2]], assistant=draft, max_batch_size=0)
    (result,) = hf_specdec.generate_continuous(target, [[[1, 2], [3, 4]]], assistant=draft, max_new_tokens=3)
    assert not result.ok and "1-D" in str(result.error)  # a bad prompt fails alone (tests/test_faults.py)
    with pytest.raises(ValueError, match="min_new_tokens"):
        hf_specdec.generate_continuous(target, [[1, 2]], assistant=draft, max_new_tokens=3, min_new_tokens=2, eos_token_id=3)
    # the other processors built from the first prompt's length: later prompts would be cut or suppressed wrongly
    for setting, value in (("begin_suppress_tokens", [4]), ("forced_eos_token_id", 6),
                           ("exponential_decay_length_penalty", (3, 3.0))):
        with pytest.raises(ValueError, match=setting):
            hf_specdec.generate_continuous(target, [[1, 5, 9], [2, 7, 3, 4]], assistant=draft, max_new_tokens=12,
                                           eos_token_id=6, **{setting: value})
    for name in ("return_dict_in_generate", "output_scores", "output_logits"):  # silently ignored before
        with pytest.raises(ValueError, match=f"{name} has no place"):
            hf_specdec.generate_continuous(target, [[1, 2]], assistant=draft, max_new_tokens=3, **{name: True})
    with pytest.raises(ValueError, match="draft_vocab_size"):
        hf_specdec.generate_continuous(target, [[1, 2]], assistant=draft, max_new_tokens=3, draft_vocab_size=16)
    with pytest.raises(ValueError, match="streamer"):
        hf_specdec.generate_continuous(target, [[1, 2]], assistant=draft, max_new_tokens=3, spec_streamer=object())
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4, pad_token_id=0)
    sliding = MistralForCausalLM(config).eval()
    with pytest.raises(UnsupportedCacheError, match="full-attention cache layers, and the target and the draft have "
                                                    "DynamicSlidingWindowLayer layers"):
        hf_specdec.generate_continuous(sliding, [[1, 2, 3]], assistant=perturbed(sliding, 0.5), max_new_tokens=3)
    with pytest.raises(UnsupportedCacheError, match="the draft has DynamicSlidingWindowLayer layers.*or a draft with full"):
        hf_specdec.generate_continuous(tiny_model("llama", seed=35), [[1, 2, 3]], assistant=sliding, max_new_tokens=3)


def test_a_prompts_attention_mask_drops_its_padding():
    """A mapping with a tokenizer's padded `attention_mask`: the padding it marks is dropped (it was
    read as prompt tokens), so the row equals plain greedy on the unpadded prompt; a mask given as an
    argument is refused by name (it was a TypeError)."""
    target = tiny_model("llama", seed=1, eos=4)
    draft = perturbed(target, 0.5)
    items = [{"input_ids": [0, 0, 1, 5, 9], "attention_mask": [0, 0, 1, 1, 1]},
             {"input_ids": [1, 5, 9, 2, 0], "attention_mask": [1, 1, 1, 1, 0]},
             {"input_ids": [1, 0, 9], "attention_mask": [1, 0, 1]},
             {"input_ids": [[1, 5], [1, 6]], "attention_mask": [[1, 1], [1, 1]]}]  # two sequences, not one
    results = hf_specdec.generate_continuous(target, items, assistant=draft, max_new_tokens=6, do_sample=False)
    for result, real in zip(results[:2], ([1, 5, 9], [1, 5, 9, 2])):
        plain = target.generate(torch.tensor([real]), max_new_tokens=6, do_sample=False)[0, len(real):]
        assert result.ok and result.tokens.tolist() == plain.tolist()
    assert not results[2].ok and "hole between real tokens" in str(results[2].error)
    assert not results[3].ok and "must be one sequence" in str(results[3].error)
    with pytest.raises(ValueError, match="takes no attention_mask argument"):
        hf_specdec.generate_continuous(target, [[1, 2, 3]], assistant=draft, max_new_tokens=3,
                                       attention_mask=torch.ones(1, 3))


def test_an_explicit_none_overrides_the_models_generation_config():
    """generate() lets a keyword given as None override the model's generation_config. Before: the stream read it
    as not given, so with the model's max_new_tokens set and max_new_tokens=None later prompts got the first
    prompt's max_length, and pad_token_id=None still stripped the config's pad id from a prompt's start."""
    from transformers import GenerationConfig

    target = tiny_model("llama", seed=1)
    draft = perturbed(target, 0.5)
    target.generation_config = GenerationConfig(do_sample=False, max_new_tokens=15, pad_token_id=0)
    prompts = [list(range(1, 11)), [5, 6], list(range(7, 26)), [0, 0, 5, 6, 7]]
    results = hf_specdec.generate_continuous(target, prompts, assistant=draft, max_batch_size=2, max_new_tokens=None,
                                             pad_token_id=None)
    for prompt, result in zip(prompts, results):
        plain = target.generate(torch.tensor([prompt]), max_new_tokens=None, pad_token_id=None)[0, len(prompt):]
        assert result.ok and result.tokens.tolist() == plain.tolist()


def test_a_target_that_accelerate_offloaded_streams():
    """accelerate's cpu_offload leaves the weights on meta (model.device is meta). Before: the stream put the
    prompts there and failed in a raw meta-tensor error; plain generate() and a single call ran."""
    import copy

    from accelerate import cpu_offload

    target = tiny_model("llama", seed=1)
    draft = perturbed(target, 0.5)
    offloaded = cpu_offload(copy.deepcopy(target), execution_device=torch.device("cpu"))
    assert offloaded.device.type == "meta"
    prompts = [[1, 5, 9, 2, 7], [3, 4, 5]]
    results = hf_specdec.generate_continuous(offloaded, prompts, assistant=draft, max_new_tokens=6, do_sample=False)
    for prompt, result in zip(prompts, results):
        plain = target.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):]
        assert result.ok and result.tokens.tolist() == plain.tolist()
    from hf_specdec.continuous import _input_device

    offloaded.get_input_embeddings()._hf_hook.execution_device = 0  # accelerate's name for the first accelerator
    assert _input_device(offloaded) == 0  # the hooks' device, not a falsy 0 read as none (no GPU here to run on)


def test_a_stream_refuses_a_deadline_and_a_single_prompt_and_names_a_failed_loop():
    """`max_time` was one deadline for the whole stream: every prompt admitted after it got one token and
    `ok=True`. One prompt given flat (`[1, 2, 3]`) made each id a failed request. A decode loop that failed
    before any result was raised raw, after one as `StreamError`: now always `StreamError`."""
    target = tiny_model("llama", seed=0)
    draft = perturbed(target, noise=0.3)
    with pytest.raises(ValueError, match="max_time is one generate"):
        hf_specdec.generate_continuous(target, [[1, 2]], assistant=draft, max_new_tokens=5, max_time=1.0)
    from transformers import GenerationConfig

    timed = GenerationConfig(max_time=1.0, max_new_tokens=5)
    with pytest.raises(ValueError, match="set in a generation config; max_time=None drops it"):
        hf_specdec.generate_continuous(target, [[1, 2]], assistant=draft, generation_config=timed)
    assert hf_specdec.generate_continuous(target, [[1, 2]], assistant=draft, generation_config=timed, max_time=None)[0].ok
    with pytest.raises(ValueError, match="beam"):  # the call's own error, as it is, though a request failed before
        hf_specdec.generate_continuous(target, ["text", [1, 2]], assistant=draft, max_new_tokens=5, num_beams=2)
    for flat in ([1, 2, 3], torch.tensor([1, 2, 3])):
        with pytest.raises(ValueError, match="one sequence of token ids.*give \\[prompt\\]"):
            hf_specdec.generate_continuous(target, flat, assistant=draft, max_new_tokens=5)
    results = hf_specdec.generate_continuous(target, iter([3, [1, 2]]), assistant=draft, max_new_tokens=5)
    assert "one number (3)" in str(results[0].error) and results[1].ok

    def sink(record):
        raise RuntimeError("sink fails")

    with pytest.raises(hf_specdec.StreamError, match="sink fails") as caught:
        hf_specdec.generate_continuous(target, [[1, 5, 9], [3], [7, 8]], assistant=draft, max_new_tokens=8,
                                       acceptance_sink=sink, max_batch_size=np.int64(2))
    assert caught.value.results == [] or all(r is None or not r.ok for r in caught.value.results)


@pytest.mark.parametrize("arch, pad", [("gpt2", None), ("llama", 500)])
def test_a_pad_id_outside_the_vocabulary_fills_no_column(arch, pad):
    """Before: rows joining the batch were padded with pad_token_id (or EOS: GPT-2's 50256 with a small vocabulary,
    which transformers only warns about) and that id was embedded: IndexError, and the whole stream failed."""
    target = tiny_model(arch, vocab=64, seed=3)
    if arch == "gpt2":
        target.config.eos_token_id = target.generation_config.eos_token_id = 50256
    draft = perturbed(target, 0.02)
    prompts, kwargs = [[5, 6, 7], [8, 9, 10, 11, 12]], dict(max_new_tokens=6, do_sample=False, pad_token_id=pad)
    plain = [target.generate(torch.tensor([p]), **kwargs)[0, len(p):].tolist() for p in prompts]
    results = hf_specdec.generate_continuous(target, prompts, assistant=draft, max_batch_size=2, **kwargs)
    assert [r.tokens.tolist() for r in results] == plain
