"""Generate-level exactness: the joint law of the first emitted tokens equals the target's.

The target's exact distribution over the first `NEW` tokens is enumerated on a tiny vocabulary
with the same processor pipeline generate() builds (repetition penalty, temperature, top-k, top-p).
Samples drawn through `model.generate(custom_generate=...)` are compared with it at level ALPHA
(`batch_pvalue`: chi-square goodness-of-fit tests of the joint law and of the first token's law,
Bonferroni-combined). Each deliberately broken variant must be rejected by the same test, with a
fixed seed, at a sample size no larger than that of the test it is paired with.

Samples are drawn as the rows of ONE batched generate call (`sample_rows`: the prompt repeated, with
an attention mask), not one call each: about 1 ms a sample on one core instead of 20 to 30. For an
exact implementation the rows are independent draws of their prompts' laws: every choice a round
makes (which rows verify what, how many tokens) may depend on earlier rounds and on other rows, but
not on the tokens it is about to verify, and each row is verified with its own uniforms; the costs
are pinned (`costs=`), so no choice reads the clock and a seed fixes every draw. The slow tier
repeats the key checks with one call a sample.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import pytest
import torch
from scipy import stats
from transformers import (
    LogitNormalization,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    WatermarkingConfig,
    WatermarkLogitsProcessor,
)
from transformers.generation.candidate_generator import CandidateGenerator

import hf_specdec
import hf_specdec.rounds
from conftest import chi_square_against, perturbed, tiny_model
from hf_specdec.proposals import DraftModelDrafter
from hf_specdec.sampling import RowProcessors, logits_to_probs
from hf_specdec.stats import DRAFT, NGRAM, NONE

ALPHA = 1e-3  # a correct implementation fails each test with probability 0.001
VOCAB, NEW, SAMPLES = 8, 3, 3000  # SAMPLES: the draws of the tests without a paired broken variant
# Draws per law where a broken variant is paired (the same number for the test and its variant):
# chosen for power > 0.99 against it at ALPHA (each test notes the noncentrality it was sized by).
ROWS = 6000  # one prompt (UnprocessedQ)
BATCH_ROWS = 1000  # per prompt, three prompts (OverconfidentQ)
PROMPT = torch.tensor([[1, 5, 2]])
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=5, top_p=0.95, repetition_penalty=1.3)
# Pinned prices: no decision reads the clock, so a seeded run draws the same numbers every time.
COSTS = hf_specdec.Costs(draft_step=0.05, verify=0.03)


def processors() -> LogitsProcessorList:
    """The pipeline generate() builds from SAMPLING, in transformers' order."""
    return LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(SAMPLING["repetition_penalty"]),
            TemperatureLogitsWarper(SAMPLING["temperature"]),
            TopKLogitsWarper(SAMPLING["top_k"]),
            TopPLogitsWarper(SAMPLING["top_p"]),
        ]
    )


@torch.no_grad()
def exact_joint(model, prompt=PROMPT, pipeline: LogitsProcessorList | None = None) -> dict[tuple[int, ...], float]:
    """P(first NEW tokens = t) under plain sampling from `model`, by enumeration: at each depth every
    prefix with mass is one row of a full forward (no cache, no padding: they have one length), and
    the pipeline (all row-wise; SAMPLING's unless given) gives each row's next-token law."""
    pipeline = pipeline or processors()
    law = {(): 1.0}
    for _ in range(NEW):
        prefixes = list(law)
        tails = torch.tensor(prefixes, dtype=torch.long, device=prompt.device).reshape(len(prefixes), -1)
        ids = torch.cat([prompt.expand(len(prefixes), -1), tails], dim=1)
        probs = torch.softmax(pipeline(ids, model(ids).logits[:, -1].float()), -1).double().tolist()
        law = {prefix + (tok,): law[prefix] * p for prefix, row in zip(prefixes, probs) for tok, p in enumerate(row) if p > 0}
    return law


def batch_pvalue(laws, per_prompt, label: str = "") -> float:
    """One p-value for "each prompt's samples follow its law" (prompts drawn independently): two
    chi-square tests, each summed over the prompts (statistics and degrees of freedom add up), one of
    the joint law and one of the first token's law (where each round's choices act first: a deviation
    there is spread thin over the joint's cells), the smaller p doubled (Bonferroni). A correct sampler
    is rejected with probability at most ALPHA."""
    joint = first = (0.0, 0)
    for law, samples in zip(laws, per_prompt, strict=True):
        marginal = Counter()
        for cell, prob in law.items():
            marginal[cell[:1]] += prob
        stat, dof, _ = chi_square_against(law, samples)
        joint = (joint[0] + stat, joint[1] + dof)
        stat, dof, _ = chi_square_against(dict(marginal), [s[:1] for s in samples])
        first = (first[0] + stat, first[1] + dof)
    joint_p, first_p = stats.chi2.sf(*joint), stats.chi2.sf(*first)
    pvalue = min(1.0, 2 * min(joint_p, first_p))
    sizes = "+".join(str(len(s)) for s in per_prompt)
    print(f"\n{label}: n={sizes} joint chi2={joint[0]:.1f} dof={joint[1]} p={joint_p:.2e}; "
          f"first token chi2={first[0]:.1f} dof={first[1]} p={first_p:.2e}; combined p={pvalue:.2e}")
    return pvalue


def law_pvalue(law, samples, label: str = "") -> float:
    """`batch_pvalue` for one prompt's law and samples."""
    return batch_pvalue([law], [samples], label)


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", vocab=VOCAB, seed=21, init=0.25)
    draft = perturbed(target, noise=0.4)
    return target, draft, exact_joint(target)


def sample_rows(target, seed, prompts, rows=ROWS, **kwargs) -> list[list[tuple[int, ...]]]:
    """Per prompt, the first NEW tokens of `rows` draws, as the rows of one generate call: the prompts
    repeated `rows` times, interleaved (row i holds prompts[i % len(prompts)]), left-padded, with an
    attention mask."""
    prompts = [list(p) for p in prompts]
    every = prompts * rows
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in every])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in every])
    torch.manual_seed(seed)  # plain generate() draws from the global generator; so do we without `generator=`
    out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, **{**SAMPLING, **kwargs})  # kwargs may replace them
    per_prompt = [[] for _ in prompts]
    for i, row in enumerate(out[:, width:].tolist()):
        per_prompt[i % len(prompts)].append(tuple(row))
    return per_prompt


def sample_sequences(target, seed, prompt=PROMPT, samples=SAMPLES, **kwargs) -> list[tuple[int, ...]]:
    """The first NEW tokens of `samples` generate() calls on one prompt, one row a call."""
    torch.manual_seed(seed)
    out = []
    for _ in range(samples):
        seq = target.generate(prompt, max_new_tokens=NEW, **SAMPLING, **kwargs)
        out.append(tuple(seq[0, prompt.shape[1] :].tolist()))
    return out


def spec_kwargs(draft, **extra):
    """Fixed k = 2 model drafts per round unless a test switches the levers on; pinned costs."""
    settings = {"num_draft_tokens": 2, "adaptive": False, "ngram": False, "costs": COSTS, **extra}
    return dict(custom_generate=hf_specdec.speculative_generate, assistant=draft, **settings)


def levers_kwargs(draft, draft_step: float, verify: float = 0.03, **extra):
    """The planner on (adaptive lengths, n-gram lookups), k <= 3, prices pinned at `draft_step`, `verify`."""
    costs = hf_specdec.Costs(draft_step=draft_step, verify=verify)
    return spec_kwargs(draft, adaptive=True, ngram=True, num_draft_tokens=3, costs=costs, **extra)


@pytest.fixture
def proposed(monkeypatch) -> list[list[tuple[str, int]]]:
    """Per round that proposed chains, each active row's (source, length) as verified: a spy on
    `hf_specdec.rounds._propose_chains` (an acceptance sink's records would cost more than the draws)."""
    rounds = []
    real = hf_specdec.rounds._propose_chains

    def spy(state, request, room, trace):
        proposal = real(state, request, room, trace)
        rounds.append([(proposal.source_of(i), proposal.length(i)) for i in range(proposal.tokens.shape[0])])
        return proposal

    monkeypatch.setattr(hf_specdec.rounds, "_propose_chains", spy)
    return rounds


class UnprocessedQ(DraftModelDrafter):
    """Broken on purpose: draws each token from the processed q but reports the unprocessed draft
    distribution (softmax of the raw logits), so acceptance uses a q other than the one the token was
    drawn from. Works on any device and batch (it changes what `_next` returns, nothing else)."""

    def _next(self, prefixes, drafts, logits, report):
        token, q, parts = super()._next(prefixes, drafts, logits, report)
        return token, None if q is None else torch.softmax(logits.float(), -1), parts


class OverconfidentQ(DraftModelDrafter):
    """Broken on purpose: draws each token from q but reports its scores doubled, i.e. a sharper q."""

    def _next(self, prefixes, drafts, logits, report):
        token, q, parts = super()._next(prefixes, drafts, logits, report)
        return token, None if q is None else torch.softmax(2.0 * q.log(), -1), parts


class TopTokenProposer(CandidateGenerator):
    """Proposes the target's most likely next token twice, with no logits: a point-mass q."""

    def __init__(self, model):
        self.model = model

    def get_candidates(self, input_ids):
        ids = input_ids
        for _ in range(2):
            ids = torch.cat([ids, self.model(ids).logits[:, -1:].argmax(-1)], dim=1)
        return ids, None


def test_law_has_enough_cells_to_have_power(pair):
    """Guard against a degenerate reference (e.g. a near-deterministic target) that every sampler passes."""
    _, _, law = pair
    assert sum(p * SAMPLES >= 5 for p in law.values()) >= 20
    assert max(law.values()) < 0.3


def test_the_reference_law_is_what_plain_sampling_draws(pair):
    """Validates the enumeration (and so the processor order) against transformers' own sampler, and
    that the rows of one batched call are independent draws (plain batched sampling is cheap: 20000)."""
    target, _, law = pair
    (samples,) = sample_rows(target, 1, PROMPT.tolist(), rows=20000)
    assert law_pvalue(law, samples, "plain sampling, rows of one call") > ALPHA


def test_sampling_is_exact(pair, proposed):
    target, draft, law = pair
    (samples,) = sample_rows(target, 0, PROMPT.tolist(), **spec_kwargs(draft))
    assert proposed[0] == [(DRAFT, 2)] * ROWS  # every row's first round verifies k = 2 drafts
    assert law_pvalue(law, samples, "speculative, fixed k = 2") > ALPHA


def test_broken_variant_unprocessed_q_is_detected(pair):
    target, draft, law = pair
    # Power: the joint statistic's noncentrality was measured at 0.0176 a sample (chi2 = 433 on 81 dof
    # at 20000 rows, another seed), 106 at ROWS = 6000: on ~77 dof, P(beyond the 1 - ALPHA / 2
    # quantile) = 0.996 (scipy ncx2), before the first-token test adds its share. (At 4000: 0.88.)
    broken = UnprocessedQ(draft, processors(), do_sample=True)
    (samples,) = sample_rows(target, 2, PROMPT.tolist(), **spec_kwargs(None, candidate_generator=broken))
    assert law_pvalue(law, samples, "BROKEN (unprocessed q)") < ALPHA


def test_sampling_is_exact_with_a_hotter_draft(pair):
    """A draft warped otherwise than the target (temperature 1.6 against 0.8), passed as a drafter: q is
    still the distribution each draft token was drawn from, so the output is the target's."""
    target, draft, law = pair
    hot = LogitsProcessorList([p if not isinstance(p, TemperatureLogitsWarper) else TemperatureLogitsWarper(1.6)
                               for p in processors()])
    hotter = DraftModelDrafter(draft, hot, do_sample=True)
    (samples,) = sample_rows(target, 3, PROMPT.tolist(), rows=SAMPLES, **spec_kwargs(None, candidate_generator=hotter))
    assert law_pvalue(law, samples, "a draft at temperature 1.6") > ALPHA


@pytest.mark.parametrize("free", [True, False])  # False: the accelerator's path, no read (a CPU branches on the host)
def test_a_draft_whose_logits_are_nan_drafts_from_a_uniform_q_and_stays_exact(pair, proposed, monkeypatch, free):
    """Before: torch.multinomial's raw 'probability tensor contains either inf, nan' on the first draw
    (a draft that overflows), where plain sampling, which never runs the draft, works."""
    monkeypatch.setattr(hf_specdec.proposals.draft_model, "reads_are_free", lambda device: free)
    target, draft, law = pair
    broken = copy.deepcopy(draft)
    with torch.no_grad():
        broken.lm_head.weight[3] = float("nan")  # every row's logits NaN at token 3: softmax NaN everywhere
    (samples,) = sample_rows(target, 4, PROMPT.tolist(), rows=SAMPLES, **spec_kwargs(broken))
    assert proposed[0] == [(DRAFT, 2)] * SAMPLES  # drafted (from a uniform q) and verified, not skipped
    assert law_pvalue(law, samples, "a draft with NaN logits") > ALPHA


class UniformClaimedQ(DraftModelDrafter):
    """Broken on purpose: reports the uniform q of a NaN row but always proposes token 0 (a q the token was not
    drawn from): the check above must see it."""

    def _next(self, prefixes, drafts, logits, report):
        token, q, parts = super()._next(prefixes, drafts, logits, report)
        return torch.zeros_like(token), q, parts


def test_broken_uniform_q_claimed_for_a_nan_draft_is_detected(pair):
    target, draft, law = pair
    broken = copy.deepcopy(draft)
    with torch.no_grad():
        broken.lm_head.weight[3] = float("nan")
    source = UniformClaimedQ(broken, processors(), do_sample=True)
    (samples,) = sample_rows(target, 4, PROMPT.tolist(), rows=SAMPLES, **spec_kwargs(None, candidate_generator=source))
    assert law_pvalue(law, samples, "BROKEN (token 0 proposed under a uniform q)") < ALPHA


def test_sampling_is_exact_with_a_large_vocabulary():
    """With 2048 tokens, top-k leaves few finite scores, so the CPU fast paths run: the sparse top-p
    (hf_specdec.sampling.SparseTopPLogitsWarper) for both models and the sparse draw
    (hf_specdec.verify.draw). The reference law is enumerated with transformers' own warpers."""
    target = tiny_model("llama", vocab=2048, seed=22, init=0.25)
    draft = perturbed(target, noise=0.4)
    law = exact_joint(target)
    assert sum(p * SAMPLES >= 5 for p in law.values()) >= 20 and max(law.values()) < 0.3
    (samples,) = sample_rows(target, 12, PROMPT.tolist(), rows=SAMPLES, **spec_kwargs(draft))
    assert law_pvalue(law, samples, "large vocabulary (sparse paths)") > ALPHA


def test_sampling_is_exact_with_top_p_alone_over_a_large_vocabulary(monkeypatch, dense_top_p_case):
    """No top-k (the standard preset's sampling): top-p finds its cut among the 256 highest of 2048
    scores (SparseTopPLogitsWarper's dense path) for both models; its rows past the candidates or
    near the cut go to transformers' code. The reference law is enumerated with transformers' own
    warpers, and the dense path must have run for most positions."""
    target, draft, law = dense_top_p_case
    rows_to_transformers = []
    real = TopPLogitsWarper.__call__
    monkeypatch.setattr(TopPLogitsWarper, "__call__",
                        lambda self, i, s: rows_to_transformers.append(s.shape[0]) or real(self, i, s))
    (samples,) = sample_rows(target, 13, PROMPT.tolist(), rows=SAMPLES, **spec_kwargs(draft, **DENSE_TOP_P))
    assert sum(rows_to_transformers) < SAMPLES * NEW / 4  # most positions took the dense path (measured: 246 rows)
    assert law_pvalue(law, samples, "top-p alone, large vocabulary (dense path)") > ALPHA


def test_broken_dense_top_p_is_detected(monkeypatch, dense_top_p_case):
    """Broken on purpose: the dense path's normaliser a quarter short, so every candidate's probability
    is overstated and the cut falls early (measured: joint chi2 1897 on 115 dof). The subtler bug of
    normalising over the candidates alone moves this law too little (noncentrality 0.1 at 3000 draws);
    `tests/test_sampling.py` catches that one by comparing kept tokens with transformers'."""
    import math

    from hf_specdec.sampling import SparseTopPLogitsWarper

    target, draft, law = dense_top_p_case
    short = staticmethod(lambda scores: torch.logsumexp(scores.float(), dim=-1, keepdim=True) + math.log(0.8))
    monkeypatch.setattr(SparseTopPLogitsWarper, "_normaliser", short)
    (samples,) = sample_rows(target, 13, PROMPT.tolist(), rows=SAMPLES, **spec_kwargs(draft, **DENSE_TOP_P))
    assert law_pvalue(law, samples, "BROKEN dense top-p (normaliser short)") < ALPHA


DENSE_TOP_P = dict(temperature=1.0, top_k=0, top_p=0.9, repetition_penalty=1.0)


@pytest.fixture(scope="module")
def dense_top_p_case():
    """(target, draft, law) with a 2048-token vocabulary and DENSE_TOP_P's processors, built once."""
    target = tiny_model("llama", vocab=2048, seed=22, init=0.8)
    law = exact_joint(target, pipeline=LogitsProcessorList([TemperatureLogitsWarper(1.0), TopPLogitsWarper(0.9)]))
    assert sum(p * SAMPLES >= 5 for p in law.values()) >= 20 and max(law.values()) < 0.3
    return target, perturbed(target, noise=0.4), law


# ---------------------------------------------------------------- batches of different prompts


BATCH_PROMPTS = [[1, 5, 2], [1, 3], [1, 6, 4, 7]]


@pytest.fixture(scope="module")
def batch_laws(pair):
    target, _, _ = pair
    return [exact_joint(target, torch.tensor([p])) for p in BATCH_PROMPTS]


def test_batched_sampling_is_exact_per_row(pair, batch_laws):
    """Left-padded rows of different prompts, each row its own law."""
    target, draft, _ = pair
    per_prompt = sample_rows(target, 5, BATCH_PROMPTS, rows=BATCH_ROWS, **spec_kwargs(draft))
    assert batch_pvalue(batch_laws, per_prompt, "batched prompts") > ALPHA


def test_batched_broken_variant_is_detected(pair, batch_laws):
    target, draft, _ = pair
    # Power: noncentralities measured at 6000 rows a prompt (another seed): 0.047, 0.075 and 0.022 a
    # sample (chi2 = 361 on 77, 557 on 106, 180 on 50 dof); summed, 144 at BATCH_ROWS = 1000 on ~120
    # dof: power 0.9996 at ALPHA / 2 (at 700: 0.976). Alone, prompt 2 would need ~3000 rows.
    broken = OverconfidentQ(draft, processors(), do_sample=True)
    per_prompt = sample_rows(target, 6, BATCH_PROMPTS, rows=BATCH_ROWS, **spec_kwargs(None, candidate_generator=broken))
    assert batch_pvalue(batch_laws, per_prompt, "BROKEN batched (overconfident q)") < ALPHA


# ---------------------------------------------------------------- the planner: lookups, adaptive lengths


HYBRID_PROMPT = [1, 5, 2, 6, 1, 5]  # ends with the 2-gram (1, 5) seen before: lookup proposes 2, 6


@pytest.fixture(scope="module")
def hybrid_law(pair):
    target, _, _ = pair
    return exact_joint(target, torch.tensor([HYBRID_PROMPT]))


def test_hybrid_ngram_drafts_are_exact(pair, hybrid_law, proposed):
    """n-gram proposals are verified as point masses: accepted with probability p(x), residual p
    without x (hf_specdec.proposals.ngram). The first round of every row here is an n-gram round."""
    target, draft, _ = pair
    assert sum(p * SAMPLES >= 5 for p in hybrid_law.values()) >= 20 and max(hybrid_law.values()) < 0.3
    (samples,) = sample_rows(target, 7, [HYBRID_PROMPT], rows=SAMPLES, **levers_kwargs(draft, 0.05))
    assert all(source == NGRAM and length for source, length in proposed[0])  # every row starts with a lookup
    sources = Counter(source for round_ in proposed for source, length in round_ if length)
    assert sources[DRAFT] > 0  # and the draft model runs too
    assert law_pvalue(hybrid_law, samples, f"hybrid n-gram + draft {dict(sources)}") > ALPHA


def uniform_q_for_lookups(real):
    """`rounds._propose_chains`, broken: the rows that propose a lookup are verified as if their tokens
    were drawn from a uniform q (accepted with min(1, p(x) / (1/V)) instead of p(x))."""

    def broken(state, request, room, trace):
        proposal = real(state, request, room, trace)
        lookup = [proposal.source_of(i) == NGRAM for i in range(proposal.tokens.shape[0])]
        if not any(lookup) or not proposal.num_tokens:
            return proposal
        q = proposal.draft_probs
        if q is None:
            q = torch.full((*proposal.tokens.shape, VOCAB), 1.0 / VOCAB)
        q = q.clone()
        q[torch.tensor(lookup)] = 1.0 / VOCAB
        return dataclasses.replace(proposal, draft_probs=q)

    return broken


def test_broken_hybrid_ngram_with_a_uniform_q_is_detected(pair, hybrid_law, monkeypatch):
    target, draft, _ = pair
    # Power: at 1000 rows the first-token chi2 was 3401 on 4 dof (a noncentrality of ~3.4 a sample: a
    # lookup is accepted with probability min(1, 8 p(x)), not p(x)); at 250 rows ~850: power ~1.
    monkeypatch.setattr(hf_specdec.rounds, "_propose_chains", uniform_q_for_lookups(hf_specdec.rounds._propose_chains))
    (samples,) = sample_rows(target, 8, [HYBRID_PROMPT], rows=250, **levers_kwargs(draft, 0.05))
    assert law_pvalue(hybrid_law, samples, "BROKEN hybrid (uniform q for lookups)") < ALPHA


def test_adaptive_draft_lengths_are_exact(pair, proposed):
    """The planner's stop rule decides how many drafted tokens are verified, token j + 1 on what
    tokens 1..j said (their calibrated confidences), never on its own value: a stopping time, exact.
    Prices where a wide verification is dear (d = 0.3) make it stop at different lengths in different
    rounds. Paired with `test_broken_selection_by_a_tokens_own_confidence_is_detected` (same rows,
    seed and prices)."""
    target, draft, law = pair
    (samples,) = sample_rows(target, 11, PROMPT.tolist(), rows=10000, **levers_kwargs(draft, 0.05, verify=0.3))
    lengths = {length for round_ in proposed for source, length in round_ if source == DRAFT}
    assert len(lengths) > 1, f"the stop rule never stopped at another length: {lengths}"
    assert law_pvalue(law, samples, f"adaptive lengths {sorted(lengths)}") > ALPHA


def own_confidence_cut(real):
    """`rounds._propose_chains`, broken: each row keeps the leading drafted tokens whose own confidence
    is at least 0.5 (the selection the planner made before it used a stopping rule): a token kept
    because its own q(x) was high is no longer distributed as q."""

    def broken(state, request, room, trace):
        proposal = real(state, request, room, trace)
        if proposal.confidences is None or proposal.sources is not None:
            return proposal
        return proposal.first([next((j for j, c in enumerate(row) if c < 0.5), len(row)) for row in proposal.confidences])

    return broken


def test_broken_selection_by_a_tokens_own_confidence_is_detected(pair, monkeypatch):
    """Power: when the planner cut each row's chain by its own confidences (best prefix by calibrated
    reach, ~5% of rows cut to 0 in the first round), 10000 rows gave first-token chi2 = 42 on 3 dof
    (p = 4e-9); this cut removes more rows' first tokens."""
    target, draft, law = pair
    monkeypatch.setattr(hf_specdec.rounds, "_propose_chains", own_confidence_cut(hf_specdec.rounds._propose_chains))
    (samples,) = sample_rows(target, 11, PROMPT.tolist(), rows=10000, **levers_kwargs(draft, 0.05, verify=0.3))
    assert law_pvalue(law, samples, "BROKEN own-confidence cut") < ALPHA


# ---------------------------------------------------------------- batches mixing sources (issue 13)


MIXED_PROMPTS = [[1, 5, 2, 6, 1, 5], [1, 3], [7, 4, 7, 4, 7]]  # rows 0 and 2 have lookup matches, row 1 none


@pytest.fixture(scope="module")
def mixed_laws(pair):
    target, _, _ = pair
    return [exact_joint(target, torch.tensor([p])) for p in MIXED_PROMPTS]


# draft_step 0.01: a cheap draft runs from the first round, where rows 0 and 2 verify their lookups
# beside row 1's draft chain; 5.0: it never runs, and rows 0 and 2 verify lookups beside row 1's plain step.
@pytest.mark.parametrize("draft_step", [0.01, 5.0])
def test_batches_mixing_lookup_draft_and_empty_rows_are_exact_per_row(pair, mixed_laws, draft_step, proposed):
    target, draft, _ = pair
    per_prompt = sample_rows(target, 11, MIXED_PROMPTS, rows=BATCH_ROWS, **levers_kwargs(draft, draft_step))
    other = DRAFT if draft_step < 1 else NONE
    mixing = sum({NGRAM, other} <= {source for source, _ in round_} for round_ in proposed)
    assert mixing, "no round verified a lookup row beside a row of the other kind"
    assert batch_pvalue(mixed_laws, per_prompt, f"mixed batch (draft_step={draft_step})") > ALPHA


def test_broken_mixed_batch_with_another_rows_q_is_detected(pair, mixed_laws, monkeypatch):
    """Broken on purpose: q handed to the rule one row off (each row verified with the previous row's q)."""
    real = hf_specdec.rounds._propose_chains

    def shifted(state, request, room, trace):
        proposal = real(state, request, room, trace)
        if proposal.draft_probs is None:
            return proposal
        return dataclasses.replace(proposal, draft_probs=proposal.draft_probs.roll(1, dims=0))

    monkeypatch.setattr(hf_specdec.rounds, "_propose_chains", shifted)
    target, draft, _ = pair
    # Power: at 1000 rows a prompt the summed first-token chi2 was 5115 on 10 dof; at 250, ~1280: power ~1.
    per_prompt = sample_rows(target, 12, MIXED_PROMPTS, rows=250, **levers_kwargs(draft, 0.01))
    assert batch_pvalue(mixed_laws, per_prompt, "BROKEN mixed batch (q of another row)") < ALPHA


# ---------------------------------------------------------------- slow: one call a sample


@pytest.mark.slow  # ~45 s; the default tier draws the same law as rows of one call (test_sampling_is_exact)
def test_single_row_calls_are_exact(pair):
    target, draft, law = pair
    assert law_pvalue(law, sample_sequences(target, 20, **spec_kwargs(draft)), "single-row calls, fixed k = 2") > ALPHA


@pytest.mark.slow  # ~30 s; a foreign CandidateGenerator runs one row at a time. Point masses are also tested
# by the hybrid lookup chi-square and test_verify's Monte Carlo
def test_point_mass_proposals_are_exact(pair):
    target, _, law = pair
    samples = sample_sequences(target, 4, **spec_kwargs(None, candidate_generator=TopTokenProposer(target)))
    assert law_pvalue(law, samples, "point-mass q (foreign generator)") > ALPHA


@pytest.mark.slow  # ~45 s; a single row's stop rule sees one row's confidences, a batch's the sum over rows
def test_single_row_adaptive_draft_lengths_are_exact(pair):
    """test_adaptive_draft_lengths_are_exact with one call a sample: the stop rule ends a lone row's
    chain where its confidences so far say the next token no longer pays for the wider forward."""
    target, draft, law = pair
    records = []
    samples = sample_sequences(target, 21, acceptance_sink=records.append, **levers_kwargs(draft, 0.05, verify=0.3))
    assert len(Counter(len(r.draft_tokens) for r in records if r.source == DRAFT)) > 1  # lengths differ
    assert law_pvalue(law, samples, "single-row calls, adaptive lengths") > ALPHA


# ---------------------------------------------------------------- the retrieval cache (issue 39)


class PeekingCache(hf_specdec.RetrievalCache):
    """Broken on purpose: a row's continuation is proposed only when this round's first uniform for the
    row, drawn here and handed to verification (`peek_at_uniforms`), is below 0.3, so a retrieved token
    is proposed just when it is likely to be accepted: P(first token = x) rises from p(x) towards
    0.3 + 0.7 p(x) for the cache's favourite x."""

    def __init__(self):
        super().__init__()
        self.peeked: list[float] = []  # this round's, one per active row (rows are looked up in order)

    def lookup_shares(self, query, max_tokens, max_branches=1, min_match=1, exclude=None):
        u = float(torch.rand(()))
        self.peeked.append(u)
        return super().lookup_shares(query, max_tokens, max_branches, min_match, exclude) if u < 0.3 else ([], 0, [])


def peek_at_uniforms(cache: PeekingCache, monkeypatch) -> None:
    """Verification's uniforms, with each row's first one replaced by the one its cache lookup drew."""
    real = hf_specdec.verify._uniforms

    def uniforms(draft_tokens, generator):
        u = real(draft_tokens, generator)
        if u.shape[1] and cache.peeked:
            u[:, 0] = torch.tensor(cache.peeked)
        cache.peeked.clear()
        return u

    monkeypatch.setattr(hf_specdec.verify, "_uniforms", uniforms)


def _cache_calls(target, draft, cache, seed):
    """An earlier call's 300 answers fill the cache, then ROWS rows in one call that retrieve from
    those and from each other; drafting is priced out (c = 5), so retrieval and plain steps only.
    Returns the samples and how many row-rounds verified a cached continuation."""
    used = Counter()
    kwargs = levers_kwargs(draft, 5.0, retrieval_cache=cache, acceptance_sink=lambda r: used.update([r.retrieval]))
    sample_rows(target, seed, PROMPT.tolist(), rows=300, **kwargs)
    used.clear()
    (samples,) = sample_rows(target, seed + 1, PROMPT.tolist(), **kwargs)
    return samples, used["cache"]


def test_sampling_with_a_retrieval_cache_is_exact(pair):
    """Rows proposing earlier calls' and each other's continuations (point masses decided before the
    round's uniforms): each row still follows the target's law. The broken variant below, at the same
    seed and ROWS, gives first-token chi2 ~ 1000 on 3 dof (p ~ 1e-224)."""
    target, draft, law = pair
    samples, used = _cache_calls(target, draft, hf_specdec.RetrievalCache(), 40)
    assert used > ROWS // 2  # most rows verified a cached continuation at least once
    assert law_pvalue(law, samples, "retrieval cache, earlier calls and other rows") > ALPHA


def test_broken_cache_peeking_at_the_uniforms_is_detected(pair, monkeypatch):
    target, draft, law = pair
    cache = PeekingCache()
    peek_at_uniforms(cache, monkeypatch)
    samples, used = _cache_calls(target, draft, cache, 40)
    assert used > ROWS // 10
    assert law_pvalue(law, samples, "BROKEN (cache peeking at the uniforms)") < ALPHA


# ---------------------------------------------------------------- drafts whose vocabulary differs by padding rows


@pytest.fixture(scope="module")
def padded_pair():
    """A target of 200 tokens most of whose law (0.79 of the three-token joint) lies past row 198, and
    drafts of 198 rows (q is 0 past them, and the ids the target emits there are fed as row 197) and
    202 rows (cut to 200; its two extra rows copy its row 199, so a clamp in place of the cut shows)."""
    target = tiny_model("llama", vocab=200, seed=23, init=0.25)
    with torch.no_grad():
        target.lm_head.weight[196:] *= 2.5
        target.lm_head.weight[199] = target.lm_head.weight[197]
    narrow, wide = perturbed(target, noise=0.4), perturbed(target, noise=0.4, seed=7)
    narrow.resize_token_embeddings(198, mean_resizing=False)
    wide.resize_token_embeddings(202, mean_resizing=False)
    with torch.no_grad():
        wide.lm_head.weight[200:] = wide.lm_head.weight[199]
        wide.model.embed_tokens.weight[200:] = wide.model.embed_tokens.weight[199]
    law = exact_joint(target)
    assert sum(p for cell, p in law.items() if any(t >= 198 for t in cell)) > 0.5
    return target, narrow, wide, law


@pytest.mark.parametrize("which", ["narrow", "wide"])
def test_sampling_is_exact_with_a_draft_vocabulary_padded_differently(padded_pair, which):
    target, narrow, wide, law = padded_pair
    (samples,) = sample_rows(target, 4, PROMPT.tolist(), rows=SAMPLES, **spec_kwargs(narrow if which == "narrow" else wide))
    assert law_pvalue(law, samples, f"a {which} draft vocabulary") > ALPHA


class ClampedDraft(DraftModelDrafter):
    """Broken: a wider draft draws from all its rows and clamps an id past the target's into range
    (as row 199), reporting q cut to the target's rows, instead of cutting its logits before drawing."""

    def _fit(self, logits):
        return logits

    def _next(self, prefixes, drafts, logits, report):
        token, q, rest = super()._next(prefixes, drafts, logits, report)
        return token.clamp_max(self.vocab - 1), q[:, : self.vocab], rest


def test_broken_clamped_wide_draft_is_detected(padded_pair, monkeypatch):
    # Power: at 3000 rows the joint chi2 was 380 on 69 dof (a noncentrality of ~0.1 a sample), p ~ 1e-44.
    target, _, wide, law = padded_pair
    broken = ClampedDraft(wide, processors(), do_sample=True)
    with pytest.raises(ValueError, match="draft_probs that are not probabilities"):  # its cut q sums below 1: named
        sample_rows(target, 4, PROMPT.tolist(), rows=8, **spec_kwargs(None, candidate_generator=broken))
    monkeypatch.setattr(hf_specdec.proposals.checked.CheckedDrafter, "check", lambda self, proposal, request: proposal)
    (samples,) = sample_rows(target, 4, PROMPT.tolist(), rows=SAMPLES, **spec_kwargs(None, candidate_generator=broken))
    assert law_pvalue(law, samples, "broken: a wider draft's ids clamped") < ALPHA


class FirstPaddedId(DraftModelDrafter):
    """Broken: where the processors leave only ids past its rows, the draft reports q uniform on them
    but always draws the first."""

    def _next(self, prefixes, drafts, logits, report):
        token, q, rest = super()._next(prefixes, drafts, logits, report)
        dead = q[:, : self.draft_vocab].sum(dim=-1) == 0
        return torch.where(dead, self.draft_vocab, token), q, rest


@pytest.mark.parametrize("broken", [False, True])
def test_sampling_when_only_ids_past_the_draft_rows_are_allowed(padded_pair, broken):
    """Before: the narrower draft's scores were all -inf (all NaN once renormalize_logits normalized
    them) and sampling it failed (plain sampling does not). Its q is now uniform on the ids past its rows. Power of the broken variant: at 3000 rows the
    joint chi2 was 494 on 3 dof (it emits 198 with twice its p, below 1/2, the q it is verified with)."""
    target, narrow, _, _ = padded_pair
    suppress = SuppressTokensLogitsProcessor(list(range(198)), device="cpu")
    pipeline = LogitsProcessorList([processors()[0], suppress, *processors()[1:], LogitNormalization()])
    law = exact_joint(target, pipeline=pipeline)
    assert len(law) >= 4
    draft = FirstPaddedId(narrow, pipeline, do_sample=True) if broken else hf_specdec.DraftModelDrafter(narrow, pipeline, True)
    (samples,) = sample_rows(target, 5, PROMPT.tolist(), rows=SAMPLES, suppress_tokens=list(range(198)),
                             renormalize_logits=True, **spec_kwargs(None, candidate_generator=draft))
    pvalue = law_pvalue(law, samples, f"only ids past the draft's rows allowed{' (BROKEN)' if broken else ''}")
    assert pvalue < ALPHA if broken else pvalue > ALPHA


# ---------------------------------------------------------------- a watermark (seeded from each row's last tokens)


class UnwatermarkedQ(DraftModelDrafter):
    """Broken: draws from the watermarked q but reports q without the watermark."""

    def start(self, batch_size):
        super().start(batch_size)
        self.unmarked = RowProcessors(processors(), batch_size)

    def _next(self, prefixes, drafts, logits, report):
        token, q, rest = super()._next(prefixes, drafts, logits, report)
        return token, logits_to_probs(self.unmarked.scores(prefixes, drafts, logits)), rest


@pytest.mark.parametrize("broken", [False, True])
def test_watermarked_sampling_in_a_batch_follows_the_watermarked_law(pair, broken):
    """transformers' WatermarkLogitsProcessor reseeds its greenlist from a row's last tokens at every
    call, so it is row-wise and batches take it (they refused it). Broken: a draft that reports q
    without the watermark. Power: at 3000 rows its joint chi2 was 225 on 24 dof (p ~ 1e-34)."""
    target, draft, _ = pair
    watermark = WatermarkLogitsProcessor(VOCAB, "cpu", greenlist_ratio=0.25, bias=3.0)
    pipeline = LogitsProcessorList([*processors(), watermark])  # last, as generate() appends it
    law = exact_joint(target, pipeline=pipeline)
    drafter = (UnwatermarkedQ if broken else DraftModelDrafter)(draft, pipeline, do_sample=True)
    (samples,) = sample_rows(target, 6, PROMPT.tolist(), rows=SAMPLES, **spec_kwargs(None, candidate_generator=drafter),
                             watermarking_config=WatermarkingConfig(greenlist_ratio=0.25, bias=3.0))
    pvalue = law_pvalue(law, samples, f"a watermark{' (BROKEN: q reported without it)' if broken else ''}")
    assert pvalue < ALPHA if broken else pvalue > ALPHA
