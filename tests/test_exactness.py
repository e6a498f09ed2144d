"""Generate-level exactness: the joint law of the first emitted tokens equals the target's.

The target's exact distribution over the first `NEW` tokens is enumerated on a tiny vocabulary
with the same processor pipeline generate() builds (repetition penalty, temperature, top-k, top-p).
Samples drawn through `model.generate(custom_generate=...)` are compared with it by a chi-square
goodness-of-fit test at level ALPHA. The same test must reject deliberately broken variants.
"""

from __future__ import annotations


import dataclasses

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.candidate_generator import CandidateGenerator

import hf_specdec
from conftest import chi_square_against, perturbed, tiny_model
from test_tree import tree_rule_without_residuals
from hf_specdec.proposals import DraftModelDrafter, NgramDrafter

ALPHA = 1e-3  # a correct implementation fails each test with probability 0.001
VOCAB, NEW, SAMPLES = 8, 3, 3000
PROMPT = torch.tensor([[1, 5, 2]])
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=5, top_p=0.95, repetition_penalty=1.3)


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
def exact_joint(model, prompt=PROMPT) -> dict[tuple[int, ...], float]:
    """P(first NEW tokens = t) under plain sampling from `model`, by enumeration (full forwards)."""
    pipeline = processors()
    law = {(): 1.0}
    for _ in range(NEW):
        grown = {}
        for prefix, mass in law.items():
            ids = torch.cat([prompt, torch.tensor([prefix], dtype=torch.long, device=prompt.device).reshape(1, -1)], dim=1)
            probs = torch.softmax(pipeline(ids, model(ids).logits[:, -1].float()), -1)[0].double()
            for tok in torch.nonzero(probs).flatten().tolist():
                grown[prefix + (tok,)] = mass * probs[tok].item()
        law = grown
    return law


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", vocab=VOCAB, seed=21, init=0.25)
    draft = perturbed(target, noise=0.4)
    return target, draft, exact_joint(target)


def sample_sequences(target, seed, prompt=PROMPT, samples=SAMPLES, **kwargs) -> list[tuple[int, ...]]:
    """The first NEW tokens of `samples` generate() calls on one prompt."""
    torch.manual_seed(seed)  # plain generate() draws from the global generator; so do we without `generator=`
    out = []
    for _ in range(samples):
        seq = target.generate(prompt, max_new_tokens=NEW, **SAMPLING, **kwargs)
        out.append(tuple(seq[0, prompt.shape[1] :].tolist()))
    return out


def spec_kwargs(draft, **extra):
    """Fixed k = 2 model drafts per round unless a test switches the levers on."""
    settings = {"num_draft_tokens": 2, "adaptive": False, "ngram": False, **extra}
    return dict(custom_generate=hf_specdec.speculative_generate, assistant=draft, **settings)


class UnprocessedQ(DraftModelDrafter):
    """Broken on purpose: samples from the processed q but reports the unprocessed draft distribution,
    so acceptance uses a q other than the one the token was drawn from."""

    def propose(self, request):
        proposal = super().propose(request)
        candidate_ids = torch.cat([request.ids, proposal.tokens], dim=1)
        raw = self.model(candidate_ids).logits[:, request.ids.shape[1] - 1 : -1].float()
        return dataclasses.replace(proposal, draft_probs=torch.softmax(raw, -1))


class TopTokenProposer(CandidateGenerator):
    """Proposes the target's most likely next token twice, with no logits: a point-mass q."""

    def __init__(self, model):
        self.model = model

    def get_candidates(self, input_ids):
        ids = input_ids
        for _ in range(2):
            ids = torch.cat([ids, self.model(ids).logits[:, -1:].argmax(-1)], dim=1)
        return ids, None


@pytest.mark.slow  # ~70 s; the default tier checks the same chain rule with model drafts in
# test_adaptive_draft_lengths_are_exact (same law and processors, lengths 1-3) and the large-vocabulary test
def test_sampling_is_exact(pair):
    target, draft, law = pair
    statistic, dof, pvalue = chi_square_against(law, sample_sequences(target, 0, **spec_kwargs(draft)))
    print(f"\nspeculative: chi2={statistic:.1f} dof={dof} p={pvalue:.3f}")
    assert pvalue > ALPHA


@pytest.mark.slow  # ~33 s; checks the test's enumeration (the reference law), not the library
def test_the_reference_law_is_what_plain_sampling_draws(pair):
    """Validates the enumeration (and so the processor order) against transformers' own sampler."""
    target, _, law = pair
    statistic, dof, pvalue = chi_square_against(law, sample_sequences(target, 1))
    print(f"\nplain sampling: chi2={statistic:.1f} dof={dof} p={pvalue:.3f}")
    assert pvalue > ALPHA


def test_broken_variant_unprocessed_q_is_detected(pair):
    target, draft, law = pair
    # Power: at 3000 samples this variant gave chi2 ~135 on ~71 dof (noncentrality ~64). At 1.5 x SAMPLES
    # the noncentrality is ~96: expected statistic ~170 on ~74 dof (sd ~23), ~2.4 sd above the 0.999
    # quantile (~117): power 0.994 (scipy ncx2). Seed 2 gives chi2=159.7 on 76 dof, p=7e-8. (2 x SAMPLES
    # took 150 s, the suite's longest test.)
    broken = UnprocessedQ(draft, processors(), do_sample=True)
    samples = sample_sequences(target, 2, samples=3 * SAMPLES // 2, **spec_kwargs(None, candidate_generator=broken))
    statistic, dof, pvalue = chi_square_against(law, samples)
    print(f"\nbroken (unprocessed q): chi2={statistic:.1f} dof={dof} p={pvalue:.2e}")
    assert pvalue < ALPHA


@pytest.mark.slow  # ~60 s; another q variant, kept out of the default tier to hold it under 15 min
def test_sampling_is_exact_with_a_hotter_draft_temperature(pair):
    target, draft, law = pair
    samples = sample_sequences(target, 3, **spec_kwargs(draft, draft_temperature=1.6))
    statistic, dof, pvalue = chi_square_against(law, samples)
    print(f"\ndraft_temperature=1.6: chi2={statistic:.1f} dof={dof} p={pvalue:.3f}")
    assert pvalue > ALPHA


@pytest.mark.slow  # ~60 s; point masses are also tested by the hybrid lookup chi-square and test_verify's Monte Carlo
def test_point_mass_proposals_are_exact(pair):
    target, _, law = pair
    samples = sample_sequences(target, 4, **spec_kwargs(None, candidate_generator=TopTokenProposer(target)))
    statistic, dof, pvalue = chi_square_against(law, samples)
    print(f"\npoint-mass q: chi2={statistic:.1f} dof={dof} p={pvalue:.3f}")
    assert pvalue > ALPHA


def test_law_has_enough_cells_to_have_power(pair):
    """Guard against a degenerate reference (e.g. a near-deterministic target) that every sampler passes."""
    _, _, law = pair
    assert sum(p * SAMPLES >= 5 for p in law.values()) >= 20
    assert max(law.values()) < 0.3


def test_sampling_is_exact_with_a_large_vocabulary():
    """With 2048 tokens, top-k leaves few finite scores, so the CPU fast paths run: the sparse top-p
    (hf_specdec.sampling.SparseTopPLogitsWarper) for both models and the sparse draw
    (hf_specdec.verify.draw). The reference law is enumerated with transformers' own warpers."""
    target = tiny_model("llama", vocab=2048, seed=22, init=0.25)
    draft = perturbed(target, noise=0.4)
    law = exact_joint(target)
    assert sum(p * SAMPLES >= 5 for p in law.values()) >= 20 and max(law.values()) < 0.3
    statistic, dof, pvalue = chi_square_against(law, sample_sequences(target, 12, **spec_kwargs(draft)))
    print(f"\nlarge vocabulary (sparse paths): chi2={statistic:.1f} dof={dof} p={pvalue:.3f}")
    assert pvalue > ALPHA


# ---------------------------------------------------------------- batched


BATCH_PROMPTS = [[1, 5, 2], [1, 3], [1, 6, 4, 7]]


class OverconfidentQ(DraftModelDrafter):
    """Broken on purpose (batched): samples from q but reports its scores doubled, i.e. a sharper q."""

    def propose(self, request):
        proposal = super().propose(request)
        return dataclasses.replace(proposal, draft_probs=torch.softmax(2.0 * proposal.draft_probs.log(), -1))


def sample_batched(target, seed, prompts=BATCH_PROMPTS, **kwargs) -> list[list[tuple[int, ...]]]:
    """The first NEW tokens of each row of `prompts` (left-padded), over SAMPLES generate() calls."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    torch.manual_seed(seed)
    per_row = [[] for _ in prompts]
    for _ in range(SAMPLES):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, **SAMPLING, **kwargs)
        for row in range(len(prompts)):
            per_row[row].append(tuple(out[row, width:].tolist()))
    return per_row


@pytest.fixture(scope="module")
def batch_laws(pair):
    target, _, _ = pair
    return [exact_joint(target, torch.tensor([p])) for p in BATCH_PROMPTS]


@pytest.mark.slow  # ~85 s; in the default tier the mixed batch below (draft rows at adaptive lengths, left-padded,
# beside lookup rows) checks per-row exactness of batched model drafts
def test_batched_sampling_is_exact_per_row(pair, batch_laws):
    target, draft, _ = pair
    per_row = sample_batched(target, 5, **spec_kwargs(draft))
    for row, (law, samples) in enumerate(zip(batch_laws, per_row)):
        statistic, dof, pvalue = chi_square_against(law, samples)
        print(f"\nbatched row {row}: chi2={statistic:.1f} dof={dof} p={pvalue:.3f}")
        assert pvalue > ALPHA


@pytest.mark.slow  # ~90 s; in the default tier a batch's broken q is caught by the mixed-batch variant below
def test_batched_broken_variant_is_detected(pair, batch_laws):
    target, draft, _ = pair
    broken = OverconfidentQ(draft, processors(), do_sample=True)
    per_row = sample_batched(target, 6, **spec_kwargs(None, candidate_generator=broken))
    pvalues = []
    for row, (law, samples) in enumerate(zip(batch_laws, per_row)):
        statistic, dof, pvalue = chi_square_against(law, samples)
        print(f"\nbroken batched row {row}: chi2={statistic:.1f} dof={dof} p={pvalue:.2e}")
        pvalues.append(pvalue)
    assert max(pvalues) < ALPHA  # every row's law is visibly wrong


# ---------------------------------------------------------------- the speed levers (issue 6)


HYBRID_PROMPT = torch.tensor([[1, 5, 2, 6, 1, 5]])  # ends with the 2-gram (1, 5) seen before: lookup proposes 2, 6


@pytest.fixture(scope="module")
def hybrid_law(pair):
    target, _, _ = pair
    return exact_joint(target, HYBRID_PROMPT)


def hybrid_kwargs(draft, sources: list | None = None):
    """Library defaults (adaptive length, hybrid n-gram drafts), cheap pinned costs, k <= 3."""
    sink = None if sources is None else (lambda record: sources.append(record.source))
    return spec_kwargs(draft, adaptive=True, ngram=True, tree=False, draft_cost=0.05, verify_cost=0.03, num_draft_tokens=3,
                       acceptance_sink=sink)


def test_hybrid_ngram_drafts_are_exact(pair, hybrid_law):
    """n-gram proposals are verified as point masses: accepted with probability p(x), residual p
    without x (hf_specdec.ngram). The first round of every call here is an n-gram round."""
    target, draft, _ = pair
    assert sum(p * SAMPLES >= 5 for p in hybrid_law.values()) >= 20 and max(hybrid_law.values()) < 0.3
    sources = []
    samples = sample_sequences(target, 7, HYBRID_PROMPT, **hybrid_kwargs(draft, sources))
    assert sources.count("ngram") >= SAMPLES  # at least one n-gram round per call
    statistic, dof, pvalue = chi_square_against(hybrid_law, samples)
    print(f"\nhybrid n-gram + draft: chi2={statistic:.1f} dof={dof} p={pvalue:.3f} ({sources.count('ngram')} n-gram rounds)")
    assert pvalue > ALPHA


def test_broken_hybrid_ngram_with_a_uniform_q_is_detected(pair, hybrid_law, monkeypatch):
    """Broken on purpose: n-gram proposals verified as if drawn from a uniform q (accept with
    min(1, p(x) / (1/V)) instead of p(x))."""
    target, draft, _ = pair
    real = NgramDrafter.propose

    def uniform_q(self, request):
        proposal = real(self, request)
        return dataclasses.replace(proposal, draft_probs=torch.full((*proposal.tokens.shape, VOCAB), 1.0 / VOCAB))

    monkeypatch.setattr(NgramDrafter, "propose", uniform_q)
    samples = sample_sequences(target, 8, HYBRID_PROMPT, **hybrid_kwargs(draft))
    statistic, dof, pvalue = chi_square_against(hybrid_law, samples)
    print(f"\nBROKEN hybrid (uniform q for lookups): chi2={statistic:.1f} dof={dof} p={pvalue:.2e}")
    assert pvalue < ALPHA


TREE_PROMPT = torch.tensor([[1, 5, 2, 6, 1, 5, 3, 7, 1, 5]])  # (1, 5) seen twice before: two retrieved branches


@pytest.fixture(scope="module")
def tree_law(pair):
    target, _, _ = pair
    return exact_joint(target, TREE_PROMPT)


def tree_kwargs(draft, records: list | None = None):
    """Library defaults with trees (adaptive length, hybrid drafts, trees), pinned cheap costs."""
    sink = None if records is None else records.append
    return spec_kwargs(draft, adaptive=True, ngram=True, tree=True, draft_cost=0.05, verify_cost=0.02,
                       num_draft_tokens=3, acceptance_sink=sink)


@pytest.fixture(params=["retrieval", "draft"])
def tree_kind(request, monkeypatch):
    """Which trees the cost model builds: retrieved branches alone (what it picks here on its own),
    or the draft model's chain with the retrieved branches merged in (forced: the draft's expected
    rate made unbeatable; a speed decision only)."""
    if request.param == "draft":
        monkeypatch.setattr(hf_specdec.DraftPolicy, "expected_draft_rate", lambda self, *args: float("inf"))
    return request.param


def test_trees_of_candidates_are_exact(pair, tree_law, tree_kind):
    """Tree rounds (retrieved branches alone, or merged with the draft model's chain drawn from q)
    verified in one forward by the tree rule (hf_specdec.verify) keep the target's law."""
    target, draft, _ = pair
    records = []
    samples = sample_sequences(target, 9, TREE_PROMPT, **tree_kwargs(draft, records))
    trees = [r for r in records if r.parents is not None and len(set(r.parents)) < len(r.parents)]
    assert len(trees) >= SAMPLES // 2  # most calls verify a branching tree
    with_draft = sum(r.source == "draft" for r in trees)
    assert with_draft >= SAMPLES // 2 if tree_kind == "draft" else with_draft == 0
    statistic, dof, pvalue = chi_square_against(tree_law, samples)
    print(f"\ntrees: chi2={statistic:.1f} dof={dof} p={pvalue:.3f} ({len(trees)} branching trees, {with_draft} with a draft chain)")
    assert pvalue > ALPHA


def test_broken_tree_rule_without_residuals_is_detected(pair, tree_law, monkeypatch):
    """Broken on purpose: every child tested against p itself. Run on draft-chain trees (which hold
    retrieved branches too); the retrieval-only trees reject it as well (p = 6e-13 when measured)."""
    monkeypatch.setattr(hf_specdec.DraftPolicy, "expected_draft_rate", lambda self, *args: float("inf"))
    target, draft, _ = pair
    monkeypatch.setattr(hf_specdec.generate, "tree_speculative_sampling", tree_rule_without_residuals)
    samples = sample_sequences(target, 10, TREE_PROMPT, **tree_kwargs(draft))
    statistic, dof, pvalue = chi_square_against(tree_law, samples)
    print(f"\nBROKEN trees (no residual): chi2={statistic:.1f} dof={dof} p={pvalue:.2e}")
    assert pvalue < ALPHA


SUBSET = torch.tensor([0, 1, 2, 3, 5])  # draft_vocab_size=4 plus the prompt's tokens (1, 5, 2)


def test_reduced_vocabulary_draft_is_exact(pair):
    target, draft, law = pair
    records = []
    samples = sample_sequences(target, 9, **spec_kwargs(draft, draft_vocab_size=4, acceptance_sink=records.append))
    assert {t for r in records for t in r.draft_tokens} <= set(SUBSET.tolist())
    statistic, dof, pvalue = chi_square_against(law, samples)
    print(f"\nreduced-vocabulary draft: chi2={statistic:.1f} dof={dof} p={pvalue:.3f}")
    assert pvalue > ALPHA


class SubsetSampledFullQ(DraftModelDrafter):
    """Broken on purpose: drafts from the reduced-vocabulary head but reports the full-vocabulary q
    (so tokens inside the subset look less likely to the rule than they were)."""

    def propose(self, request):
        proposal = super().propose(request)
        candidate_ids = torch.cat([request.ids, proposal.tokens], dim=1)
        start, pipeline = request.ids.shape[1], processors()
        full = [
            pipeline(candidate_ids[:, :i], self.model(candidate_ids[:, :i]).logits[:, -1].float())
            for i in range(start, candidate_ids.shape[1])
        ]
        return dataclasses.replace(proposal, draft_probs=torch.softmax(torch.stack(full, dim=1), -1))


def test_broken_reduced_vocabulary_with_full_q_is_detected(pair):
    target, draft, law = pair
    broken = SubsetSampledFullQ(draft, processors(), do_sample=True, vocabulary=SUBSET)
    # At 1000 samples: chi2 = 156.5 on 57 dof (the 0.999 quantile is ~97), p = 3e-11: power ~0.99
    samples = sample_sequences(target, 10, samples=SAMPLES // 3, **spec_kwargs(None, candidate_generator=broken))
    statistic, dof, pvalue = chi_square_against(law, samples)
    print(f"\nBROKEN reduced vocabulary (full q reported): chi2={statistic:.1f} dof={dof} p={pvalue:.2e}")
    assert pvalue < ALPHA


def test_adaptive_draft_lengths_are_exact(pair):
    """Draft lengths chosen from the draft's own confidence (early stop) keep the law exact."""
    target, draft, law = pair
    records = []
    kwargs = spec_kwargs(draft, adaptive=True, draft_cost=0.3, verify_cost=0.03, num_draft_tokens=3, acceptance_sink=records.append)
    samples = sample_sequences(target, 11, **kwargs)
    lengths = {len(r.draft_tokens) for r in records if r.source == "draft"}
    assert len(lengths) > 1, f"the policy never varied the draft length: {lengths}"
    statistic, dof, pvalue = chi_square_against(law, samples)
    print(f"\nadaptive draft lengths {sorted(lengths)}: chi2={statistic:.1f} dof={dof} p={pvalue:.3f}")
    assert pvalue > ALPHA


# ---------------------------------------------------------------- batches mixing sources (issue 13)


MIXED_PROMPTS = [[1, 5, 2, 6, 1, 5], [1, 3], [7, 4, 7, 4, 7]]  # rows 0 and 2 have lookup matches, row 1 none


def sample_mixed(target, seed, records, **kwargs) -> list[list[tuple[int, ...]]]:
    return sample_batched(target, seed, MIXED_PROMPTS, acceptance_sink=records.append, **kwargs)


@pytest.fixture(scope="module")
def mixed_laws(pair):
    target, _, _ = pair
    return [exact_joint(target, torch.tensor([p])) for p in MIXED_PROMPTS]


def mixed_kwargs(draft, draft_cost):
    # prefill_patience=0: the draft may start in the first round that guesses (a batch otherwise waits
    # until the rounds without it have lost its prefill's cost), so rows mix sources from the start
    return spec_kwargs(draft, adaptive=True, ngram=True, draft_cost=draft_cost, verify_cost=0.03, num_draft_tokens=3,
                       speculative_config=hf_specdec.SpeculativeConfig(prefill_patience=0.0))


def _rounds_by_sources(records) -> list[set[str]]:
    """The sources of each round's rows (a round writes one record per row, consecutively)."""
    rounds, last = [], None
    for r in records:
        if r.round != last:
            rounds.append(set())
            last = r.round
        rounds[-1].add(r.source)
    return rounds


@pytest.mark.parametrize("draft_cost", [0.05, 5.0])  # lookup rows beside draft rows; beside rows at length 0
def test_batches_mixing_lookup_draft_and_empty_rows_are_exact_per_row(pair, mixed_laws, draft_cost):
    target, draft, _ = pair
    records = []
    per_row = sample_mixed(target, 11, records, **mixed_kwargs(draft, draft_cost))
    sources = {r.source for r in records}
    # Some round verifies a lookup row beside a row of the other kind (draft model, or nothing at all).
    other = "draft" if draft_cost < 1 else "none"
    assert {"ngram", other} <= sources
    assert any({"ngram", other} <= s for s in _rounds_by_sources(records))
    for row, (law, samples) in enumerate(zip(mixed_laws, per_row)):
        statistic, dof, pvalue = chi_square_against(law, samples)
        print(f"\nmixed batch (c={draft_cost}) row {row}: chi2={statistic:.1f} dof={dof} p={pvalue:.3f}")
        assert pvalue > ALPHA


def test_broken_mixed_batch_with_another_rows_q_is_detected(pair, mixed_laws, monkeypatch):
    """Broken on purpose: q handed to the rule one row off (each row verified with the next row's q)."""
    from hf_specdec import generate as generate_module

    real = generate_module._propose_rows

    def shifted(state, request, room):
        proposal = real(state, request, room)
        if proposal.draft_probs is None:
            return proposal
        return dataclasses.replace(proposal, draft_probs=proposal.draft_probs.roll(1, dims=0))

    monkeypatch.setattr(generate_module, "_propose_rows", shifted)
    target, draft, _ = pair
    per_row = sample_mixed(target, 12, [], **mixed_kwargs(draft, 0.05))
    pvalues = [chi_square_against(law, samples)[2] for law, samples in zip(mixed_laws, per_row)]
    print(f"\nBROKEN mixed batch (q of another row): p={[f'{p:.1e}' for p in pvalues]}")
    assert min(pvalues) < 1e-6
