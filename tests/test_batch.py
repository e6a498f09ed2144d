"""Batched speculative decoding: ragged acceptance, holes, compaction, finished rows."""

from __future__ import annotations

import pytest
import torch

import hf_specdec
from conftest import perturbed, tiny_model
from hf_specdec.batch import RaggedBatch

PAD = 0
PROMPTS = [[1, 5, 9, 2, 7, 3], [1, 8, 4], [1, 6, 6, 2, 9], [1, 3]]


def left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def spec(model, draft, ids, mask, **kwargs):
    kwargs = {"adaptive": False, "ngram": False, **kwargs}  # fixed k: the planner is tested in test_planner.py
    return model.generate(ids, attention_mask=mask, custom_generate=hf_specdec.speculative_generate,
                          assistant=draft, **kwargs)


def generated(row_ids, prompt_width):
    """Generated tokens of one row (no EOS is set, so every row runs to max_new_tokens)."""
    return row_ids[prompt_width:].tolist()


@pytest.mark.parametrize("k", [2, 5])
def test_batched_greedy_matches_plain_batched_greedy_and_each_row_alone(arch, k):
    target = tiny_model(arch, seed=31)
    draft = perturbed(target, noise=0.5)
    ids, mask = left_padded(PROMPTS)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    out = spec(target, draft, ids, mask, do_sample=False, max_new_tokens=30, num_draft_tokens=k,
               return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    for row, prompt in enumerate(PROMPTS):
        alone = spec(target, draft, torch.tensor([prompt]), None, do_sample=False, max_new_tokens=30, num_draft_tokens=k)
        assert generated(out.sequences[row], ids.shape[1]) == alone[0, len(prompt):].tolist()
    per_row = [s.accepted for s in out.acceptance_per_row]
    assert len(set(per_row)) > 1, "rows should accept differently, or holes are never exercised"
    assert out.acceptance.accepted == sum(per_row)
    for stats in out.acceptance_per_row:  # the rounds a row took part in, counted in full (they were left at 0)
        assert stats.target_forwards == stats.rounds <= out.acceptance.rounds
        assert stats.draft_forwards >= stats.rounds - stats.plain_rounds - stats.ngram_rounds > 0
        assert stats.target_seconds > 0


@pytest.mark.parametrize("levers", [{}, {"adaptive": True, "ngram": True, "costs": hf_specdec.Costs(draft_step=0.05)}],
                         ids=["fixed-k", "per-row-sources"])
def test_rows_finishing_at_eos_in_different_rounds_are_padded_like_transformers(arch, levers):
    target = tiny_model(arch, seed=32)
    draft = perturbed(target, noise=0.4)
    ids, mask = left_padded(PROMPTS)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)[:, ids.shape[1]:]
    # An EOS that the rows reach at different steps (or not at all).
    firsts = {}
    for tok in set(free.flatten().tolist()) - {PAD}:
        steps = [row.tolist().index(tok) if tok in row.tolist() else 99 for row in free]
        if len(set(steps)) >= 3 and min(steps) >= 2:
            firsts[tok] = steps
    eos = next(iter(sorted(firsts)))
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40, eos_token_id=eos, pad_token_id=PAD)
    out = spec(target, draft, ids, mask, do_sample=False, max_new_tokens=40, eos_token_id=eos, pad_token_id=PAD, **levers)
    assert torch.equal(out, plain)


MIXED = [[1, 5, 9, 2, 1, 5, 9], [1, 8, 4], [7, 3, 7, 3, 7], [1, 3]]  # rows 0 and 2 repeat themselves


@pytest.mark.parametrize("draft_cost", [0.05, 5.0])  # lookup rows beside draft rows; beside rows at length 0
def test_rows_mixing_lookup_draft_and_plain_steps_match_plain_greedy(arch, draft_cost):
    target = tiny_model(arch, seed=35)
    draft = perturbed(target, noise=0.3)
    ids, mask = left_padded(MIXED)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    records = []
    out = spec(target, draft, ids, mask, do_sample=False, max_new_tokens=40, adaptive=True, ngram=True,
               costs=hf_specdec.Costs(draft_step=draft_cost, verify=0.03), acceptance_sink=records.append)
    assert torch.equal(out, plain)
    rounds = {}
    for r in records:
        rounds.setdefault(r.round, {})[r.row] = r
    other = "draft" if draft_cost < 1 else "none"
    mixed = [rows for rows in rounds.values() if {"ngram", other} <= {r.source for r in rows.values()}]
    assert mixed, "some round should verify a lookup row beside a row of the other kind"
    for rows in mixed:  # each row proposes its own length; lookups are the rows' own continuations
        for r in rows.values():
            assert (len(r.draft_tokens) == 0) == (r.source == "none")
    if draft_cost > 1:
        assert all(r.source != "draft" for r in records)  # a draft this dear never runs


def test_long_batched_generation_keeps_cache_bounded_and_exact():
    target = tiny_model("llama", seed=33)
    draft = perturbed(target, noise=0.04)  # acceptance ~0.3, different per row: holes pile up
    ids, mask = left_padded(PROMPTS)
    lengths = []  # columns the target attends over, at every forward
    target.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["cache"].get_seq_length() + kwargs["input_ids"].shape[1]),
        with_kwargs=True,
    )
    records = []
    out = spec(target, draft, ids, mask, do_sample=False, max_new_tokens=300, num_draft_tokens=6,
               return_dict_in_generate=True, acceptance_sink=records.append)
    real = ids.shape[1] + 300
    bound = real * 4 / 3 + 6 + 2
    # Compaction keeps holes under a quarter of the work sequence (plus one round's columns).
    assert max(lengths) <= bound
    # The bound has teeth: without compaction, each round would add the most any row accepted plus
    # one column, and the work sequence would have grown past it.
    most_accepted = {}
    for r in records:
        most_accepted[r.round] = max(most_accepted.get(r.round, 0), r.num_accepted)
    assert ids.shape[1] + sum(m + 1 for m in most_accepted.values()) > bound
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=300)
    assert torch.equal(out.sequences, plain)


def test_batched_greedy_with_processors_and_compaction_matches_plain():
    target = tiny_model("qwen2", seed=34)
    draft = perturbed(target, noise=0.04)
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(do_sample=False, max_new_tokens=150, repetition_penalty=1.3, no_repeat_ngram_size=3)
    plain = target.generate(ids, attention_mask=mask, **kwargs)
    compactions = []
    original = RaggedBatch.compact
    RaggedBatch.compact = lambda self, *args: compactions.append(1) or original(self, *args)
    try:
        out = spec(target, draft, ids, mask, num_draft_tokens=6, **kwargs)
    finally:
        RaggedBatch.compact = original
    assert torch.equal(out, plain)
    assert compactions, "the run should compact at least once"


@pytest.mark.parametrize("scheme, width", [("lefthash", 1), ("selfhash", 1), ("lefthash", 4), ("selfhash", 4)])
def test_batched_greedy_with_a_watermark_matches_plain(scheme, width):
    """A watermark (seeded from each row's last tokens) in a left-padded batch: it was refused. A
    context of 4 tokens reads into the left padding of a short row, as plain's padded rows show it."""
    from transformers import WatermarkingConfig

    target = tiny_model("llama", seed=35)
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(do_sample=False, max_new_tokens=30, watermarking_config=WatermarkingConfig(bias=2.5, seeding_scheme=scheme,
                                                                                         context_width=width))
    assert torch.equal(spec(target, perturbed(target, noise=0.3), ids, mask, **kwargs),
                       target.generate(ids, attention_mask=mask, **kwargs))


def test_a_compaction_reads_nothing_from_the_device_whatever_its_segments(monkeypatch):
    """The target's cache runs ahead of a draft that sat out lookup rounds, so a compaction gathers two
    segments of columns; each segment's width comes from the host copy of the mask (no synchronisation
    on an accelerator), and the output stays plain greedy's."""
    target = tiny_model("llama", seed=33)
    draft = perturbed(target, noise=0.04)
    ids, mask = left_padded([[1, 5, 9, 2, 1, 5, 9, 2], [1, 8, 4, 1, 8, 4], [1, 6, 6, 2, 9], [1, 3]])
    seen, inside = [], []  # per compaction: (segments, reads)
    original = RaggedBatch.compact

    def counted(self, caches):
        inside.append(0)
        segments = len({c.get_seq_length() for c in caches if c is not None and c.get_seq_length() > 0})
        original(self, caches)
        seen.append((segments, inside.pop()))
        assert self.host_mask == self.mask.tolist()  # the host copy follows the device's mask

    def reading(name):
        real = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            if inside:
                inside[-1] += 1
            return real(self, *args, **kwargs)
        return wrapper

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, reading(name))
    monkeypatch.setattr(RaggedBatch, "compact", counted)
    out = spec(target, draft, ids, mask, do_sample=False, max_new_tokens=150, num_draft_tokens=6,
               costs=hf_specdec.Costs(draft_step=0.1, verify=0.02))
    assert torch.equal(out, target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=150))
    assert any(segments > 1 for segments, _ in seen), seen
    assert all(reads == 0 for _, reads in seen), seen


def test_an_unpadded_batch_copies_only_its_prompt_to_the_host(monkeypatch):
    """Without a padding mask the host mask is built on the host: constructing the batch copies the
    prompt (for lookups) and nothing else; with one, the user's mask is copied once too."""
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real(self))
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    batch = RaggedBatch(prompt, None, max_new_tokens=4)
    assert len(reads) == 1 and batch.host_mask == [[1, 1, 1], [1, 1, 1]] and batch.real == [3, 3]
    padded = RaggedBatch(prompt, torch.tensor([[0, 1, 1], [1, 1, 1]]), max_new_tokens=4)
    assert len(reads) == 3 and padded.host_mask == [[0, 1, 1], [1, 1, 1]] and padded.real == [2, 3]


def test_batch_of_one_row_with_padding_matches_plain():
    target = tiny_model("gpt2", seed=35)
    ids, mask = left_padded([[1, 2, 3]] + [[1, 2, 3, 4, 5]])
    plain = target.generate(ids[:1], attention_mask=mask[:1], do_sample=False, max_new_tokens=15)
    out = spec(target, perturbed(target, 0.5), ids[:1], mask[:1], do_sample=False, max_new_tokens=15)
    assert torch.equal(out, plain)


def test_a_batchs_cold_draft_runs_only_where_its_prefill_pays(arch):
    """The draft's prefill of a batch (300 columns a row) is spread over what the draft is expected to
    draft: four tokens a row never pay it, forty do; outputs equal plain greedy either way."""
    target = tiny_model(arch, seed=11)
    draft = perturbed(target, noise=0.1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 64, (n,), generator=gen).tolist() for n in (300, 280)]
    ids, mask = left_padded(prompts)
    # no lookups: on random prompts 1-token matches are everywhere and would compete with the draft
    costs = dict(costs=hf_specdec.Costs(draft_step=0.25, verify=0.03, draft_prefill=0.01), adaptive=True, ngram=False,
                 do_sample=False)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    out = spec(target, draft, ids, mask, max_new_tokens=40, return_dict_in_generate=True, **costs)
    assert torch.equal(out.sequences, plain) and out.acceptance.draft_forwards > 0
    short = spec(target, draft, ids, mask, max_new_tokens=4, return_dict_in_generate=True, **costs)
    assert torch.equal(short.sequences, plain[:, : ids.shape[1] + 4])
    assert short.acceptance.draft_forwards == 0  # four tokens a row never pay a 300-column prefill


def _sliding(window: int):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(1)
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.3, bos_token_id=1,
                           eos_token_id=None, pad_token_id=0, sliding_window=window)
    model = MistralForCausalLM(config).eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return model


def test_a_batch_on_a_sliding_window_model_is_exact_or_refused_by_name():
    """Rows that accept fewer tokens than another keep masked holes, which a sliding window counts (it
    spans columns): a batch that could outgrow the window is refused by name (without the check, this
    batch's rows differ from plain batched greedy); one that cannot, and any single row, are exact."""
    ids = torch.tensor([[1, 5, 9, 2, 7, 3] * 2, [3, 7, 2, 9, 5, 1] * 2])
    narrow = _sliding(8)
    with pytest.raises(hf_specdec.UnsupportedCacheError, match="sliding-window attention .*window of 8 tokens"):
        spec(narrow, perturbed(narrow, 0.3), ids, None, do_sample=False, max_new_tokens=30)
    for row in ids:  # one row at a time is exact, the window sliding many times over
        plain = narrow.generate(row[None], do_sample=False, max_new_tokens=40)
        assert torch.equal(spec(narrow, perturbed(narrow, 0.3), row[None], None, do_sample=False, max_new_tokens=40),
                           plain)
    wide = _sliding(200)  # 12 + 2 x 2 x 30 = 132 columns at most: the window never slides
    plain = wide.generate(ids, do_sample=False, max_new_tokens=30)
    assert torch.equal(spec(wide, perturbed(wide, 0.3), ids, None, do_sample=False, max_new_tokens=30), plain)


def test_a_batch_without_eos_decodes_stopped_rows_on_as_plain_generate_does(arch):
    """With no EOS, plain generate() has nothing to pad a stopped row with: it decodes every row until
    the last one stops (or max_length), and so must we, scores included (rows had been padded)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAfter(StoppingCriteria):
        def __init__(self, tokens):
            self.tokens = torch.tensor(tokens)

        def __call__(self, input_ids, scores, **kwargs):
            return torch.isin(input_ids[:, -1], self.tokens)

    target = tiny_model(arch, seed=4)
    draft = perturbed(target, noise=0.2)
    gen = torch.Generator().manual_seed(1)
    ids, mask = left_padded([torch.randint(2, 64, (n,), generator=gen).tolist() for n in (3, 7, 5)])
    stopped_early = 0
    for stops, budget in (([7, 19, 33], 30), (list(range(2, 64, 5)), 24), (list(range(2, 64, 2)), 16), ([5], 12)):
        kwargs = dict(max_new_tokens=budget, do_sample=False, attention_mask=mask, return_dict_in_generate=True,
                      output_scores=True, stopping_criteria=StoppingCriteriaList([StopAfter(stops)]))
        plain = target.generate(ids, **kwargs)
        stopped_early += plain.sequences.shape[1] < ids.shape[1] + budget
        for k in (1, 4):
            out = target.generate(ids, custom_generate=hf_specdec.speculative_generate, assistant=draft,
                                  num_draft_tokens=k, costs=hf_specdec.Costs(draft_step=0.1, verify=0.02), **kwargs)
            assert torch.equal(out.sequences, plain.sequences)
            assert len(out.scores) == len(plain.scores)
            for ours, theirs in zip(out.scores, plain.scores):
                torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert stopped_early  # a case where every row stopped before the budget: rows cut back to the last stop


def test_a_row_that_stopped_and_left_at_its_budget_is_cut_back_too():
    """Found by fuzzing: row 0 stops early, decodes on quickly and leaves at its budget before the last row
    stops; plain generate() ends every row at that last stop, so the row that left is cut back as well."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.isin(input_ids[:, -1], torch.tensor([63, 46, 10]))

    target = tiny_model("llama", seed=5)
    ids, mask = left_padded([[53, 34, 57, 42, 25, 28, 47, 27], [5, 27, 31, 38, 62, 8], [56, 37, 25, 63, 10, 3, 19, 54],
                             [50, 14, 13, 7, 59]])
    kwargs = dict(max_new_tokens=38, do_sample=False, attention_mask=mask, stopping_criteria=StoppingCriteriaList([StopAfter()]))
    plain = target.generate(ids, **kwargs)
    assert plain.shape[1] < ids.shape[1] + 38  # the batch ended at a stop, before the budget
    out = target.generate(ids, custom_generate=hf_specdec.speculative_generate, assistant=perturbed(target, noise=0.2),
                          num_draft_tokens=4, costs=hf_specdec.Costs(draft_step=0.49, verify=0.18),
                          return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, plain)
    new = plain.shape[1] - ids.shape[1]  # the tokens cut back are not counted as emitted either
    assert out.acceptance.emitted == 4 * new and all(row.emitted == new for row in out.acceptance_per_row)
