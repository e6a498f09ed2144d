"""The fast paths of sampling.py and verify.draw: the same tokens as transformers' top-p, the same law
as a full-vocabulary multinomial draw."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats
from transformers import LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hf_specdec.sampling import RowProcessors, SparseTopPLogitsWarper
from hf_specdec.verify import draw

IDS = torch.zeros(1, 1, dtype=torch.long)  # top-p never reads the prefix


def both(scores, top_p, min_keep=1):
    theirs = TopPLogitsWarper(top_p, min_tokens_to_keep=min_keep)(IDS, scores.clone())
    ours = SparseTopPLogitsWarper(top_p, min_tokens_to_keep=min_keep)(IDS, scores.clone())
    return theirs, ours


@pytest.mark.parametrize("vocab", [4096, 151936])
def test_sparse_top_p_keeps_the_same_tokens_as_transformers_on_random_inputs(vocab, monkeypatch):
    fallbacks = []
    real = TopPLogitsWarper.__call__
    monkeypatch.setattr(TopPLogitsWarper, "__call__", lambda self, i, s: fallbacks.append(1) or real(self, i, s))
    gen = torch.Generator().manual_seed(0)
    cases, trials = 0, 40 if vocab < 10000 else 6
    for trial in range(trials):
        logits = torch.randn(6, vocab, generator=gen) * (1 + trial % 4)
        for top_k, top_p, temperature in [(50, 0.95, 0.7), (20, 0.8, 1.0), (200, 0.5, 1.3), (5, 0.99, 0.5)]:
            warped = TopKLogitsWarper(top_k)(IDS, TemperatureLogitsWarper(temperature)(IDS, logits.clone()))
            fallbacks.clear()
            theirs, ours = both(warped, top_p, min_keep=1 + trial % 3)
            assert len(fallbacks) == 1  # theirs only: ours took its fast path
            assert torch.equal(theirs, ours)
            cases += int((theirs > -float("inf")).sum() < (warped > -float("inf")).sum())  # top-p removed tokens
    assert cases >= 2 * trials  # most cases cut something


def test_sparse_top_p_falls_back_where_ties_straddle_the_cut_and_keeps_transformers_tokens(monkeypatch):
    fallbacks = []
    real = TopPLogitsWarper.__call__
    monkeypatch.setattr(TopPLogitsWarper, "__call__", lambda self, i, s: fallbacks.append(1) or real(self, i, s))
    gen = torch.Generator().manual_seed(1)
    vocab, straddled, fast = 4096, 0, 0
    for trial in range(200):
        # Scores on a grid of 0.05: exact ties near the top, some of them at the top-p cut.
        logits = torch.round(torch.randn(1, vocab, generator=gen) * (1 + 2 * (trial % 2)) / 0.05) * 0.05
        warped = TopKLogitsWarper(40 + trial % 30)(IDS, logits)  # top-k keeps every tie at its boundary
        fallbacks.clear()
        theirs, ours = both(warped, top_p=[0.3, 0.5, 0.7, 0.9][trial % 4], min_keep=1 + trial % 2)
        assert torch.equal(theirs, ours)
        straddled += len(fallbacks) == 2
        fast += len(fallbacks) == 1
    assert straddled > 10 and fast > 10  # both branches exercised


class NoTieCheck(SparseTopPLogitsWarper):
    """Broken on purpose: no row is ever taken for a tie straddling the cut."""

    @staticmethod
    def _ties_at_cut(sorted_logits, cut):
        return torch.zeros(sorted_logits.shape[0], dtype=torch.bool)


def test_without_the_tie_check_the_tied_inputs_catch_a_difference():
    """Broken on purpose: both paths with their tie check removed keep other tied tokens than
    transformers on the tied inputs of the two tests (sparse and dense), so those tests have teeth."""
    gen = torch.Generator().manual_seed(1)
    differ = 0
    for trial in range(200):
        logits = torch.round(torch.randn(1, 4096, generator=gen) * (1 + 2 * (trial % 2)) / 0.05) * 0.05
        warped = TopKLogitsWarper(40 + trial % 30)(IDS, logits)
        top_p, min_keep = [0.3, 0.5, 0.7, 0.9][trial % 4], 1 + trial % 2
        theirs = TopPLogitsWarper(top_p, min_tokens_to_keep=min_keep)(IDS, warped.clone())
        differ += not torch.equal(theirs, NoTieCheck(top_p, min_tokens_to_keep=min_keep)(IDS, warped.clone()))
    assert differ > 20  # sparse path (measured: 71 of 200)
    gen = torch.Generator().manual_seed(4)
    differ = 0
    for trial in range(120):
        logits = torch.round(dense_logits(gen, 1, 4096, trial) / 0.25) * 0.25
        top_p, min_keep = [0.3, 0.5, 0.7, 0.9][trial % 4], 1 + trial % 2
        theirs = TopPLogitsWarper(top_p, min_tokens_to_keep=min_keep)(IDS, logits.clone())
        differ += not torch.equal(theirs, NoTieCheck(top_p, min_tokens_to_keep=min_keep)(IDS, logits.clone()))
    assert differ > 2  # dense path (measured: 6 of 120)


def test_sparse_top_p_without_a_sparsifying_processor_is_transformers_own(monkeypatch):
    logits = torch.randn(4, 4096, generator=torch.Generator().manual_seed(2))
    theirs, ours = both(logits, 0.9)
    assert torch.equal(theirs, ours)
    minp = MinPLogitsWarper(0.05)(IDS, logits.clone())  # min-p also leaves few finite entries
    theirs, ours = both(minp, 0.9)
    assert torch.equal(theirs, ours)


def test_row_processors_use_the_sparse_top_p_without_touching_the_users_list():
    pipeline = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.9)])
    processors = RowProcessors(pipeline, 2)
    assert type(pipeline[2]) is TopPLogitsWarper
    assert isinstance(processors.pipeline[2], SparseTopPLogitsWarper) and processors.prefix_free


def test_sparse_draw_follows_the_weights():
    """Chi-square at level 1e-3 of 60000 draws from a 4096-entry distribution with 12 non-zero
    weights (sparse path), against the weights; and a draw that ignores the weights fails it."""
    gen = torch.Generator().manual_seed(3)
    vocab, support, samples = 4096, 12, 60_000
    probs = torch.zeros(vocab)
    where = torch.randperm(vocab, generator=gen)[:support]
    probs[where] = torch.rand(support, generator=gen) + 0.05
    tokens = draw(probs.expand(samples, -1).contiguous(), gen)
    counts = torch.bincount(tokens, minlength=vocab)
    assert counts[probs == 0].sum() == 0
    expected = (probs[where] / probs.sum() * samples).numpy()
    assert stats.chisquare(counts[where].numpy(), expected).pvalue > 1e-3
    uniform = torch.bincount(where[torch.randint(0, support, (samples,), generator=gen)], minlength=vocab)
    assert stats.chisquare(uniform[where].numpy(), expected).pvalue < 1e-3


def dense_logits(gen, rows, vocab, trial):
    """LM-like logits with no top-k before top-p: a head of a few boosted tokens over a Gaussian body,
    the head's size and height varying with `trial` (nuclei of 1 token to past the candidates)."""
    logits = torch.randn(rows, vocab, generator=gen) * 2
    head = torch.randint(0, vocab, (rows, 1 + trial % 7), generator=gen)
    height = math.log(vocab) + 2 * (trial % 4) + 3 * torch.rand(head.shape, generator=gen)  # the body's log-mass is log(vocab) + 2
    return logits.scatter_add(-1, head, height)


def count_transformers_calls(monkeypatch):
    calls = []
    real = TopPLogitsWarper.__call__
    monkeypatch.setattr(TopPLogitsWarper, "__call__", lambda self, i, s: calls.append(s.shape[0]) or real(self, i, s))
    return calls


@pytest.mark.parametrize("vocab", [4096, 151936])
def test_dense_top_p_keeps_the_same_tokens_as_transformers_without_sorting_the_vocabulary(vocab, monkeypatch):
    """No top-k before top-p (the standard preset's sampling): the cut is found among the 1024
    highest entries, and the tokens kept are transformers' on every row; rows it cannot call
    (a nucleus past the candidates, a sum within the margin, a tie) go to transformers' code alone."""
    calls = count_transformers_calls(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    fast = slow = 0
    for trial in range(30 if vocab < 10000 else 10):
        logits = dense_logits(gen, 4, vocab, trial)
        for top_p, temperature in [(0.95, 0.7), (0.8, 1.0), (0.5, 1.3), (0.99, 0.5)]:
            warped = TemperatureLogitsWarper(temperature)(IDS, logits.clone())
            calls.clear()
            theirs, ours = both(warped, top_p, min_keep=1 + trial % 3)
            assert torch.equal(theirs, ours)
            fast += 4 - sum(calls[1:])  # calls[0] is transformers' own run in `both`
            slow += sum(calls[1:])
    assert fast > 100 and slow > 20  # both paths exercised (measured: 455 and 25; 135 and 25 at 152k)


def test_dense_top_p_falls_back_on_ties_at_the_cut_and_keeps_transformers_tokens(monkeypatch):
    calls = count_transformers_calls(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    tied = 0
    for trial in range(120):
        logits = torch.round(dense_logits(gen, 1, 4096, trial) / 0.25) * 0.25  # exact ties among the head
        calls.clear()
        theirs, ours = both(logits, top_p=[0.3, 0.5, 0.7, 0.9][trial % 4], min_keep=1 + trial % 2)
        assert torch.equal(theirs, ours)
        tied += len(calls) == 2
    assert tied > 5


def test_dense_top_p_normalised_over_the_candidates_only_would_be_caught():
    """Broken on purpose: probabilities normalised over the 256 candidates rather than the whole
    vocabulary overstate each one, so the cut moves up; the comparison above catches it."""
    import hf_specdec.sampling as sampling

    class CandidatesOnly(SparseTopPLogitsWarper):
        @staticmethod
        def _normaliser(scores):
            return torch.logsumexp(scores.topk(sampling.NUCLEUS_CANDIDATES, dim=-1).values.float(), dim=-1, keepdim=True)

    gen = torch.Generator().manual_seed(3)
    differ = 0
    for trial in range(40):
        warped = dense_logits(gen, 4, 4096, trial)  # temperature 1: more of the mass in the body
        theirs = TopPLogitsWarper(0.95)(IDS, warped.clone())
        differ += int((theirs != CandidatesOnly(0.95)(IDS, warped.clone())).any(dim=-1).sum())
    assert differ > 15  # rows that keep other tokens (measured: 40 of 160)
