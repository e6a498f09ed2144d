"""Tier 1-3 for the acceptance rule: hand-built cases, a slow reference, Monte Carlo laws."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy import stats

from hf_specdec.verify import PAD_TOKEN, greedy_verification, lazy_speculative_sampling, speculative_sampling


def one_hot(indices, vocab):
    return torch.nn.functional.one_hot(torch.tensor(indices), vocab).float()


# ---------------------------------------------------------------- exact, hand-built cases


def test_p_equal_q_accepts_everything_and_takes_a_bonus_from_p():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]] * 4).unsqueeze(0)  # [1, 4, 4]
    draft_tokens = torch.tensor([[0, 1, 2]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        n, emitted = speculative_sampling(draft_tokens, probs[:, :3], probs, gen)
        assert n.item() == 3
        assert emitted[0, :3].tolist() == [0, 1, 2]
        assert emitted[0, 3].item() in (0, 1, 2)  # bonus drawn from p, never the zero-probability token


def test_disjoint_supports_reject_at_once_and_recover_from_p():
    draft_probs = one_hot([[2, 2]], 4) * 0.5 + one_hot([[3, 3]], 4) * 0.5  # q on {2, 3}
    target_probs = torch.tensor([[[0.6, 0.4, 0.0, 0.0]] * 3])  # p on {0, 1}
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        n, emitted = speculative_sampling(torch.tensor([[2, 3]]), draft_probs, target_probs, gen)
        assert n.item() == 0
        assert emitted[0, 0].item() in (0, 1)
        assert emitted[0, 1:].tolist() == [PAD_TOKEN, PAD_TOKEN]


def test_minus_inf_logits_from_top_k_are_never_emitted_and_never_nan():
    # Target and draft both top-k filtered to 2 tokens (logits -inf elsewhere), same support.
    logits = torch.tensor([[[2.0, 1.0, -float("inf"), -float("inf")]] * 3])
    probs = torch.softmax(logits, -1)
    draft_logits = torch.tensor([[[1.0, 2.0, -float("inf"), -float("inf")]] * 2])
    draft_probs = torch.softmax(draft_logits, -1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        draft_tokens = torch.multinomial(draft_probs[0], 1, generator=gen).T  # [1, 2]
        n, emitted = speculative_sampling(draft_tokens, draft_probs, probs, gen)
        valid = emitted[0, : n.item() + 1]
        assert set(valid.tolist()) <= {0, 1}


def test_residual_guard_samples_from_p_when_p_equals_q_up_to_rounding():
    # Force a rejection of a token that p and q both give probability ~0: the residual max(0, p - q)
    # is all zeros, and the guard must fall back to p instead of producing NaN.
    p = torch.tensor([[[0.7, 0.3, 0.0]] * 2])
    q = torch.tensor([[[0.7, 0.3, 0.0]]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):  # the lazy rule (the loop's): the eager one refuses a token its q could not have drawn
        n, emitted, _ = lazy_speculative_sampling(torch.tensor([[2]]), q, lambda a, b: p[:, a:b], gen,  # p(x) = 0
                                                  check=False)  # unchecked, as the loop calls it
        assert n.item() == 0
        assert emitted[0, 0].item() in (0, 1)


def test_zero_draft_tokens_emit_one_token_from_p():
    p = torch.tensor([[[0.0, 1.0, 0.0]]])
    n, emitted = speculative_sampling(torch.empty(1, 0, dtype=torch.long), torch.empty(1, 0, 3), p)
    assert n.tolist() == [0] and emitted.tolist() == [[1]]


def test_point_mass_draft_accepts_with_probability_p_of_x():
    # q = one-hot(x): acceptance is min(1, p(x)); on rejection the residual is p without x.
    p = torch.tensor([[[0.25, 0.75, 0.0]] * 2]).expand(20000, 2, 3)
    q = one_hot([[1]], 3).expand(20000, 1, 3)
    n, emitted = speculative_sampling(torch.ones(20000, 1, dtype=torch.long), q, p, torch.Generator().manual_seed(1))
    assert abs(n.float().mean().item() - 0.75) < 0.015  # 5 sigma is 0.015 at n = 20000
    assert (emitted[n == 0, 0] == 0).all()  # the residual has all its mass on token 0


def test_greedy_accepts_while_argmaxes_agree():
    target_scores = torch.log(one_hot([[3, 1, 2, 0], [3, 1, 2, 0]], 4) + 1e-3)  # argmaxes 3, 1, 2, 0
    draft_tokens = torch.tensor([[3, 1, 0], [3, 1, 2]])
    n, emitted = greedy_verification(draft_tokens, target_scores)
    assert n.tolist() == [2, 3]
    assert emitted.tolist() == [[3, 1, 2, PAD_TOKEN], [3, 1, 2, 0]]


def test_bad_shapes_are_named():
    # Before: lengths past k made the bonus token come from a padding position (always one token), and a
    # list or another batch's lengths met raw TypeError / IndexError; greedy broadcast a wrong batch.
    p = torch.zeros(1, 3, 4)
    p[0, :2, 1], p[0, 2, 0], p[0, 2, 3] = 1, 0.5, 0.5
    with pytest.raises(ValueError, match=r"lengths must be in 0..k=2 \(the drafts each row proposed\), got \[5\]"):
        speculative_sampling(torch.tensor([[1, 1]]), None, p, lengths=torch.tensor([5]))
    for bad in ([1], torch.tensor([1, 1]), torch.tensor([1.0])):
        with pytest.raises(ValueError, match=r"lengths must be an integer tensor of shape \[batch=1\]"):
            speculative_sampling(torch.tensor([[1, 1]]), None, p, lengths=bad)
    with pytest.raises(ValueError, match=r"lengths must be an integer tensor of shape \[batch=1\]"):
        greedy_verification(torch.tensor([[1, 1]]), p, lengths=torch.tensor([1, 1, 1]))
    q = torch.tensor([[[0.0, 1.0, 0.0, 0.0]] * 2])  # bool ids, a token q gives 0, a generator of another kind
    for args, kwargs, message in (((torch.tensor([[True, True]]), None, p), {}, "integer ids"),
                                  ((torch.tensor([[1, 2]]), q, p), {}, "a token its draft_probs give probability 0"),
                                  ((torch.tensor([[1, 1]]), q, p), dict(generator=3), "generator must be a torch.Generator")):
        with pytest.raises(ValueError, match=message):
            speculative_sampling(*args, **kwargs)
    with pytest.raises(ValueError, match=r"target distribution must be \[batch=1, k\+1=3"):
        speculative_sampling(torch.tensor([[0, 1]]), torch.rand(1, 2, 4), torch.rand(1, 2, 4))
    with pytest.raises(ValueError, match="draft distribution"):
        speculative_sampling(torch.tensor([[0, 1]]), torch.rand(1, 2, 5), torch.rand(1, 3, 4))


# ---------------------------------------------------------------- seeded determinism


@pytest.mark.parametrize("case, message", [
    ("logits", "target_probs must be probabilities"), ("unnormalized", "draft_probs must be probabilities"),
    ("out of vocabulary", r"outside the vocabulary \[0, 8\)"), ("float ids", "integer ids"),
])
def test_bad_values_are_named(case, message):
    """Before: logits or unnormalized weights were verified silently, and an id past the vocabulary was a gather
    error. Padding past a row's length may hold any id."""
    g = torch.Generator().manual_seed(0)
    tokens, q, p = torch.tensor([[1, 2, 3]]), torch.rand(1, 3, 8, generator=g), torch.randn(1, 4, 8, generator=g)
    q, p = q / q.sum(-1, keepdim=True), p.softmax(-1)
    bad = {"logits": (tokens, q, p.log()), "unnormalized": (tokens, 3 * q, p), "out of vocabulary": (tokens + 6, q, p),
           "float ids": (tokens.float(), q, p)}[case]
    with pytest.raises(ValueError, match=message):
        speculative_sampling(*bad)
    # padding past a row's length may hold anything: PAD_TOKEN ids, zero rows of q, zero rows of p past the bonus
    speculative_sampling(torch.tensor([[1, 2, PAD_TOKEN]]), q, p, lengths=torch.tensor([2]))
    q_padded, p_padded = q.clone(), p.clone()
    q_padded[0, 1:], p_padded[0, 2:] = 0, 0
    speculative_sampling(torch.tensor([[1, PAD_TOKEN, PAD_TOKEN]]), q_padded, p_padded, lengths=torch.tensor([1]))


def test_seeded_runs_repeat():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(64, 5, 10), -1)
    q = torch.softmax(torch.randn(64, 4, 10), -1)
    x = torch.multinomial(q.reshape(-1, 10), 1).reshape(64, 4)
    a = speculative_sampling(x, q, p, torch.Generator().manual_seed(7))
    b = speculative_sampling(x, q, p, torch.Generator().manual_seed(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------- slow loop reference


def reference_sampling(draft_tokens, draft_probs, target_probs, uniforms):
    """Algorithm 1 of arXiv:2211.17192 written as a loop over one row, for comparison. Returns the
    accepted tokens and the distribution the extra (recovered or bonus) token is drawn from."""
    k = len(draft_tokens)
    for i in range(k):
        x = draft_tokens[i]
        if not uniforms[i] < target_probs[i][x] / draft_probs[i][x]:
            residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
            residual = residual / residual.sum() if residual.sum() > 1e-6 else target_probs[i]
            return list(draft_tokens[:i]), residual
    return list(draft_tokens), target_probs[k]


def test_vectorised_rule_matches_loop_reference():
    torch.manual_seed(3)
    batch, k, vocab = 300, 4, 6
    target = torch.softmax(torch.randn(batch, k + 1, vocab) * 2, -1)
    draft = torch.softmax(torch.randn(batch, k, vocab) * 2, -1)
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1).reshape(batch, k)
    n, emitted = speculative_sampling(tokens, draft, target, torch.Generator().manual_seed(11))
    # Replay the same random stream: first the [batch, k] uniforms, then one multinomial draw over
    # the rows' extra-token distributions, which the reference builds row by row.
    replay = torch.Generator().manual_seed(11)
    uniforms = torch.rand(batch, k, generator=replay)
    references = [reference_sampling(tokens[r].tolist(), draft[r], target[r], uniforms[r]) for r in range(batch)]
    extra = torch.multinomial(torch.stack([dist for _, dist in references]), 1, generator=replay)[:, 0]
    assert 0 < sum(len(accepted) for accepted, _ in references) < batch * k  # both branches exercised
    assert sum(len(accepted) == k for accepted, _ in references) > 0  # and the bonus token
    for row, (accepted, _) in enumerate(references):
        assert n[row].item() == len(accepted)
        assert emitted[row].tolist() == accepted + [extra[row].item()] + [PAD_TOKEN] * (k - len(accepted))


@pytest.mark.parametrize("point_masses", [False, True])
@pytest.mark.parametrize("first_chunk", [1, 2, 4, 16])
def test_lazy_rule_equals_the_eager_rule_on_the_same_random_stream(first_chunk, point_masses):
    """The lazy rule asks for p chunk by chunk and stops once every row has rejected; on the same
    generator state it must return exactly the eager rule's tokens, and ask only for positions
    that some row still needed."""
    torch.manual_seed(4)
    batch, k, vocab = 400, 7, 5
    target = torch.softmax(torch.randn(batch, k + 1, vocab) * 2, -1)
    draft = torch.softmax(torch.randn(batch, k, vocab) * 2, -1)
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1).reshape(batch, k)
    q = None if point_masses else draft
    eager = speculative_sampling(tokens, q, target, torch.Generator().manual_seed(5))
    asked = []

    def target_probs_at(start, stop):
        asked.append((start, stop))
        return target[:, start:stop]

    n, emitted, computed = lazy_speculative_sampling(tokens, q, target_probs_at, torch.Generator().manual_seed(5), first_chunk)
    assert torch.equal(n, eager[0]) and torch.equal(emitted, eager[1])
    assert [a for a, _ in asked] == [0] + [b for _, b in asked[:-1]]  # contiguous chunks, each position once
    assert torch.equal(computed, target[:, : computed.shape[1]])
    assert computed.shape[1] >= int(n.max()) + 1  # p reached every row's extra-token position
    assert asked[-1][0] <= int(n.max())  # and the last chunk was needed by some row


@pytest.mark.parametrize("case, message", [
    ("logits", "target_probs must be probabilities"), ("unnormalized", "draft_probs must be probabilities"),
    ("out of vocabulary", r"outside the vocabulary \[0, 8\)"), ("q(x) = 0", "give probability 0"),
    ("lengths past k", r"lengths must be in 0..k=3 .*got \[4\]"), ("1-D ids", r"\[batch, k\] integer ids"),
    ("a generator of another kind", "generator must be a torch.Generator"),
])
def test_the_public_lazy_rule_checks_what_the_eager_rule_checks(case, message):
    """Before: the exported lazy rule checked shapes only: logits or q x 3 were verified silently, lengths past k
    drew the bonus from p without token 0 (a wrong law), and bad ids or generators were raw errors."""
    g = torch.Generator().manual_seed(0)
    tokens, q, p = torch.tensor([[1, 2, 3]]), torch.rand(1, 3, 8, generator=g), torch.randn(1, 4, 8, generator=g)
    q, p = q / q.sum(-1, keepdim=True), p.softmax(-1)
    args, kwargs = {"logits": ((tokens, q, p.log()), {}), "unnormalized": ((tokens, 3 * q, p), {}),
                    "out of vocabulary": ((tokens + 6, q, p), {}),
                    "q(x) = 0": ((tokens, torch.nn.functional.one_hot(tokens + 1, 8).float(), p), {}),
                    "lengths past k": ((tokens, None, p), dict(lengths=torch.tensor([4]))),
                    "1-D ids": ((tokens[0], q, p), {}),
                    "a generator of another kind": ((tokens, q, p), dict(generator=3))}[case]
    draft_tokens, draft, target = args
    with pytest.raises(ValueError, match=message):
        lazy_speculative_sampling(draft_tokens, draft, lambda start, stop: target[:, start:stop], **kwargs)
    n, emitted, _ = lazy_speculative_sampling(tokens, q, lambda start, stop: p[:, start:stop], torch.Generator().manual_seed(1))
    assert torch.equal(emitted, speculative_sampling(tokens, q, p, torch.Generator().manual_seed(1))[1])


def test_padding_ids_of_any_value_and_tree_tensors():
    """Before: an id past the vocabulary in padding past a row's length was an index error in both sampling
    rules; uint8 ids overflowed against a vocabulary past 255; a tree given as tensors found no child (tensor
    keys hash by identity) and accepted nothing, silently."""
    from hf_specdec import greedy_tree_verification

    p = torch.softmax(torch.randn(2, 4, 300, generator=torch.Generator().manual_seed(0)), -1)
    tokens, lengths = torch.tensor([[4, 999, 999], [7, 8, 999]]), torch.tensor([1, 2])
    eager = speculative_sampling(tokens, None, p, torch.Generator().manual_seed(2), lengths=lengths)
    lazy = lazy_speculative_sampling(tokens, None, lambda a, b: p[:, a:b], torch.Generator().manual_seed(2), lengths=lengths)
    assert torch.equal(eager[1], lazy[1])
    small = torch.tensor([[4, 250, 7]], dtype=torch.uint8)
    assert torch.equal(speculative_sampling(small, None, p[:1], torch.Generator().manual_seed(2))[1],
                       speculative_sampling(small.long(), None, p[:1], torch.Generator().manual_seed(2))[1])
    argmax = {-1: 5, 0: 6, 1: 9}.get
    assert greedy_tree_verification(torch.tensor([5, 6]), torch.tensor([-1, 0]), argmax) == ([0, 1], 9)
    with pytest.raises(ValueError, match="one token per node: 3 tokens for 2 parents"):
        greedy_tree_verification([5, 6, 7], [-1, 0], argmax)


def test_lazy_rule_stops_asking_once_every_row_rejected():
    p = torch.tensor([[[0.0, 1.0]] * 9])  # p never proposes token 0
    drafts = torch.zeros(1, 8, dtype=torch.long)  # every draft is token 0: rejected at position 1
    asked = []
    n, emitted, _ = lazy_speculative_sampling(drafts, None, lambda a, b: asked.append((a, b)) or p[:, a:b], first_chunk=2)
    assert n.tolist() == [0] and emitted[0, 0].item() == 1
    assert asked == [(0, 2)]


# ---------------------------------------------------------------- Monte Carlo laws

ALPHA = 1e-3  # each chi-square test fails a correct implementation with probability 0.001


def chi_square(observed_counts, expected_probs):
    observed = torch.as_tensor(observed_counts, dtype=torch.float64)
    probs = torch.as_tensor(expected_probs, dtype=torch.float64)
    keep = probs > 0
    assert observed[~keep].sum() == 0, "a zero-probability outcome was observed"
    expected = probs[keep] / probs[keep].sum() * observed.sum()
    return stats.chisquare(observed[keep].numpy(), expected.numpy())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_emitted_token_follows_p_and_acceptance_count_follows_its_law(seed):
    gen = torch.Generator().manual_seed(seed)
    k, vocab, samples = 3, 5, 200_000
    target = torch.softmax(torch.randn(1, k + 1, vocab, generator=gen) * 1.5, -1)
    draft = torch.softmax(torch.randn(1, k, vocab, generator=gen) * 1.5, -1)
    tokens = torch.multinomial(draft[0], samples, replacement=True, generator=gen).T  # [samples, k]
    n, emitted = speculative_sampling(tokens, draft.expand(samples, -1, -1), target.expand(samples, -1, -1), gen)

    # The first emitted token is distributed as p at position 1.
    first = torch.bincount(emitted[:, 0], minlength=vocab)
    assert chi_square(first, target[0, 0]).pvalue > ALPHA

    # With position-independent p and q, P(N >= j) = prod_{i <= j} beta_i, beta_i = sum min(p_i, q_i).
    beta = torch.minimum(target[0, :k], draft[0]).sum(-1).double()
    survive = torch.cat([torch.ones(1, dtype=torch.float64), beta.cumprod(0)])  # P(N >= j), j = 0..k
    law = torch.cat([survive[:-1] - survive[1:], survive[-1:]])  # P(N = j)
    assert chi_square(torch.bincount(n, minlength=k + 1), law).pvalue > ALPHA


def test_monte_carlo_detects_a_broken_rule():
    """The same check fails when acceptance uses a q other than the one sampled from."""
    gen = torch.Generator().manual_seed(0)
    vocab, samples = 5, 200_000
    target = torch.softmax(torch.randn(1, 2, vocab, generator=gen) * 1.5, -1)
    draft = torch.softmax(torch.randn(1, 1, vocab, generator=gen) * 1.5, -1)
    wrong_q = torch.softmax(torch.log(draft) / 0.5, -1)  # q sharpened after sampling
    tokens = torch.multinomial(draft[0], samples, replacement=True, generator=gen).T
    _, emitted = speculative_sampling(tokens, wrong_q.expand(samples, -1, -1), target.expand(samples, -1, -1), gen)
    assert chi_square(torch.bincount(emitted[:, 0], minlength=vocab), target[0, 0]).pvalue < ALPHA


def test_verify_module_does_not_import_transformers():
    # Load the pure modules as files: importing them through the package would run hf_specdec/__init__.
    probe = (
        "import importlib.util, sys, pathlib\n"
        "spec = importlib.util.find_spec('hf_specdec')\n"
        "root = pathlib.Path(spec.origin).parent\n"
        "for name in ('verify', 'stats', 'config'):\n"
        "    s = importlib.util.spec_from_file_location(name, root / f'{name}.py')\n"
        "    m = importlib.util.module_from_spec(s); sys.modules[name] = m; s.loader.exec_module(m)\n"
        "print('transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_stats_count_reached_positions_up_to_the_first_rejection():
    from hf_specdec.stats import AcceptanceStats

    stats = AcceptanceStats()
    stats.record(num_drafted=4, num_accepted=1, num_emitted=2)  # reached positions 1, 2
    stats.record(num_drafted=4, num_accepted=4, num_emitted=5)  # reached all four
    stats.record(num_drafted=2, num_accepted=0, num_emitted=1)  # reached position 1
    assert stats.drafted_per_position == [3, 3, 2, 2]
    assert stats.reached_per_position == [3, 2, 1, 1]
    assert stats.accepted_per_position == [2, 1, 1, 1]
    assert stats.per_position_rate == [2 / 3, 1 / 2, 1.0, 1.0]
    assert stats.token_acceptance == 5 / 7
    assert stats.merge(stats).reached_per_position == [6, 4, 2, 2]


# ---------------------------------------------------------------- per-row proposal lengths


def _rows_of_lengths(seed: int, samples: int, k: int = 3, vocab: int = 5):
    """`samples` rows, lengths cycling 0..k; drafts past a row's length are padding drawn from a
    garbage distribution (which must never matter)."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(1, k + 1, vocab, generator=gen) * 1.5, -1).expand(samples, -1, -1)
    draft = torch.softmax(torch.randn(1, k, vocab, generator=gen) * 1.5, -1)
    garbage = torch.softmax(torch.randn(1, k, vocab, generator=gen) * 3.0, -1)
    lengths = torch.arange(samples) % (k + 1)
    proposed = torch.arange(k)[None, :] < lengths[:, None]  # [samples, k]
    q = torch.where(proposed[..., None], draft, garbage)  # [samples, k, vocab]
    tokens = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(samples, k)
    return target, q, tokens, lengths, gen


def _law_by_length(n, emitted, target, q, lengths):
    """For each length L: (first token ~ p_0), (the token after an all-accepted prefix of a short row
    ~ p_L: the bonus), and the law of the accepted count; returns the smallest p-value."""
    pvalues = []
    for length in range(q.shape[1] + 1):
        rows = lengths == length
        pvalues.append(chi_square(torch.bincount(emitted[rows, 0], minlength=q.shape[-1]), target[0, 0]).pvalue)
        beta = torch.minimum(target[0, :length], q[rows][0, :length]).sum(-1).double()
        survive = torch.cat([torch.ones(1, dtype=torch.float64), beta.cumprod(0)])
        law = torch.cat([survive[:-1] - survive[1:], survive[-1:]])
        assert int(n[rows].max()) <= length
        pvalues.append(chi_square(torch.bincount(n[rows], minlength=length + 1), law).pvalue)
        if length:
            full = rows & (n == length)
            pvalues.append(chi_square(torch.bincount(emitted[full, length], minlength=q.shape[-1]), target[0, length]).pvalue)
    return min(pvalues)


@pytest.mark.parametrize("lazy", [False, True])
def test_per_row_lengths_zero_included_keep_the_law(lazy):
    target, q, tokens, lengths, gen = _rows_of_lengths(seed=3, samples=160_000)
    assert (lengths == 0).any()
    if lazy:
        n, emitted, _ = lazy_speculative_sampling(tokens, q, lambda a, b: target[:, a:b], gen, first_chunk=2, lengths=lengths)
    else:
        n, emitted = speculative_sampling(tokens, q, target, gen, lengths=lengths)
    assert _law_by_length(n, emitted, target, q, lengths) > ALPHA / 20  # Bonferroni over the 10 tests


def test_per_row_lengths_broken_variant_is_detected(monkeypatch):
    """The extra token of a short row drawn as a residual against its padding (lengths ignored there)."""
    from hf_specdec import verify

    original = verify._extra_token
    monkeypatch.setattr(verify, "_extra_token", lambda d, q, p, n, g, lengths=None: original(d, q, p, n, g, None))
    target, q, tokens, lengths, gen = _rows_of_lengths(seed=3, samples=160_000)
    n, emitted = speculative_sampling(tokens, q, target, gen, lengths=lengths)
    assert _law_by_length(n, emitted, target, q, lengths) < 1e-9


def test_greedy_with_lengths_never_accepts_padding():
    scores = one_hot([[1, 2, 3], [1, 2, 3]], 4).log()  # argmax 1, 2, 3 at the three positions
    drafts = torch.tensor([[1, 2], [1, 2]])  # both rows' tokens agree, but row 1 proposed only its first
    n, emitted = greedy_verification(drafts, scores, lengths=torch.tensor([2, 1]))
    assert n.tolist() == [2, 1] and emitted.tolist() == [[1, 2, 3], [1, 2, PAD_TOKEN]]
    n, emitted = greedy_verification(drafts, scores, lengths=torch.tensor([0, 0]))
    assert n.tolist() == [0, 0] and emitted[:, 0].tolist() == [1, 1]


def test_the_public_rules_name_lists_foreign_ids_and_a_bad_first_chunk():
    """Before: a list or an array met `.dim()` (AttributeError), greedy_verification kept an id past the
    vocabulary out of the comparison without a word, and the lazy rule's first_chunk of 0 or 2.5 was a raw
    error deep in its loop."""
    p = torch.softmax(torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(0)), -1)
    for call in (lambda: speculative_sampling([[1, 2]], None, p), lambda: greedy_verification([[1, 2]], p),
                 lambda: speculative_sampling(torch.tensor([[1, 2]]), None, p.numpy()),
                 lambda: lazy_speculative_sampling([[1, 2]], None, lambda a, b: p[:, a:b])):
        with pytest.raises(ValueError, match=r"must be a torch.Tensor, got (list|ndarray)"):
            call()
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 8\)"):
        greedy_verification(torch.tensor([[1, 9]]), p)
    for first in (0, 2.5, True):
        with pytest.raises(ValueError, match="first_chunk must be a positive int"):
            lazy_speculative_sampling(torch.tensor([[1, 2]]), None, lambda a, b: p[:, a:b], first_chunk=first)
    for first in (np.int64(1), torch.tensor(2)):  # integers of other kinds, as before
        lazy_speculative_sampling(torch.tensor([[1, 2]]), None, lambda a, b: p[:, a:b], first_chunk=first)
    greedy_verification(torch.tensor([[250, 7]], dtype=torch.uint8), torch.zeros(1, 3, 300))  # uint8 ids in range
    # padding past a row's length may hold anything, as in the sampling rules
    assert greedy_verification(torch.tensor([[1, 9]]), p, lengths=torch.tensor([1]))[0].tolist() in ([0], [1])


def test_acceptance_counts_refuse_more_accepted_than_drafted():
    """Before: record(2, 5, 6) was an IndexError from the per-position counts."""
    from hf_specdec import AcceptanceStats

    stats = AcceptanceStats()
    with pytest.raises(ValueError, match="0 <= accepted <= reached <= drafted"):
        stats.record(2, 5, 6)
    stats.record(3, 1, 1)  # a stop may cut the emitted tokens below the kept ones
    assert (stats.drafted, stats.accepted, stats.drafted_per_position) == (3, 1, [1, 1, 1])
    # Before: a float count or a reach past the draft failed after the totals moved; a reach below the accepted
    # gave token_acceptance 1.5; from_dict took negative counts and named a list's items as unknown fields
    for args in ((3.0, 1, 2), (2, 0, 1, 5), (3, 3, 3, 0)):
        with pytest.raises(ValueError, match="checked before any is counted"):
            stats.record(*args)
    assert (stats.drafted, stats.accepted, stats.drafted_per_position) == (3, 1, [1, 1, 1])
    with pytest.raises(ValueError, match="drafted must hold integers >= 0"):
        AcceptanceStats.from_dict({**stats.to_dict(), "drafted": -4})
    with pytest.raises(ValueError, match="takes the dict to_dict writes"):
        AcceptanceStats.from_dict([1, 2])
    assert AcceptanceStats.from_dict(json.loads(json.dumps(stats.to_dict()))) == stats
    from hf_specdec.stats import geometric_tokens_per_round

    for a, k in ((-0.5, 3), (0.5, -1), (float("nan"), 3)):
        with pytest.raises(ValueError, match="the geometric law takes"):
            geometric_tokens_per_round(a, k)
