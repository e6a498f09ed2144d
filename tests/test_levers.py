"""The speed levers: cost-model draft policy, hybrid n-gram drafts, reduced-vocabulary draft head,
quantized drafts. Each must keep greedy output identical to plain greedy (sampling exactness is in
test_exactness.py), and each must actually be exercised (asserted through the round statistics)."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

import hf_specdec
from conftest import perturbed, tiny_model
from hf_specdec.policy import DRAFT, NGRAM, NONE, DraftPolicy, PolicySettings, PolicyState
from hf_specdec.cache import rollback
from hf_specdec.proposals import DraftModelDrafter, DraftRequest, NgramCandidateGenerator, ngram_lookup, ngram_match
from hf_specdec.sampling import Prefixes
from hf_specdec.quantize import quantize_weights

# A prompt that repeats itself, so n-gram lookup has matches from the first round.
REPEATING = torch.tensor([[1, 5, 9, 2, 7, 3, 5, 9, 2, 7, 3, 5, 9]])


def spec(model, draft, prompt=REPEATING, **kwargs):
    return model.generate(
        prompt, custom_generate=hf_specdec.speculative_generate, assistant=draft, do_sample=False,
        return_dict_in_generate=True, **kwargs,
    )


# ---------------------------------------------------------------- n-gram lookup


def test_ngram_lookup_takes_the_most_recent_longest_match():
    seq = torch.tensor([4, 1, 2, 8, 9, 1, 2, 3, 6, 0, 1, 2])
    proposal = ngram_lookup(seq, max_ngram=3, min_ngram=1, max_tokens=3)
    assert proposal.tolist() == [3, 6, 0]  # (1, 2) last occurred at 5..6, followed by 3, 6, 0 (not (2) at 10: 1, 2)
    proposal = ngram_lookup(torch.tensor([7, 3, 7, 3, 5, 7, 3]), 3, 2, max_tokens=10)
    assert proposal.tolist() == [5, 7, 3]  # longest continuation of the latest match
    proposal = ngram_lookup(torch.tensor([1, 2, 3, 4]), 3, 2, max_tokens=5)
    assert proposal.numel() == 0
    proposal = ngram_lookup(torch.tensor([5, 1, 2, 3, 9, 2, 3]), 3, 2, max_tokens=5)
    assert proposal.tolist() == [9, 2, 3]  # (2, 3) at 2..3; the 3-gram (9, 2, 3) never occurred
    proposal = ngram_lookup(torch.tensor([1, 2, 3, 8, 2, 3, 9, 1, 2, 3]), 3, 2, max_tokens=2)
    assert proposal.tolist() == [8, 2]  # the 3-gram (1, 2, 3) beats the more recent 2-gram (2, 3)


def test_ngram_candidate_generator_follows_the_contract_and_is_greedy_exact():
    gen = NgramCandidateGenerator(max_ngram=2, min_ngram=1, max_tokens=4)
    ids, logits = gen.get_candidates(REPEATING)
    assert logits is None and ids[0, : REPEATING.shape[1]].tolist() == REPEATING[0].tolist()
    assert ids[0, REPEATING.shape[1] :].tolist() == [2, 7, 3, 5]
    with pytest.raises(ValueError, match="min_ngram"):
        NgramCandidateGenerator(max_ngram=1, min_ngram=2)
    target = tiny_model("llama", seed=3)
    plain = target.generate(REPEATING, do_sample=False, max_new_tokens=30)
    out = spec(target, None, candidate_generator=NgramCandidateGenerator(), max_new_tokens=30)
    assert torch.equal(out.sequences, plain)


# ---------------------------------------------------------------- the cost model (pure)


def test_policy_falls_back_to_plain_rounds_and_probes_again():
    policy = DraftPolicy(PolicySettings(max_draft_tokens=6, draft_cost=0.5, probe_interval=3))
    assert policy.plan(0) == (DRAFT, 6)  # optimistic start: try drafting
    assert DraftPolicy(PolicySettings(draft_cost=0.9)).plan(0) == (NONE, 0)  # a draft this dear is not even tried
    for _ in range(4):
        policy.observe_round(DRAFT, 1, [0], [[0.2]])  # first draft token always rejected
    assert policy.state.first_acceptance < policy.cost
    plans = []
    for _ in range(4):
        source, _ = policy.plan(0)
        plans.append(source)
        policy.observe_round(source, 0 if source == NONE else 1, [0], None if source == NONE else [[0.2]])
    assert plans == [NONE, NONE, NONE, DRAFT]  # the probe after probe_interval plain rounds
    fixed = DraftPolicy(PolicySettings(max_draft_tokens=6, adaptive=False, draft_cost=0.9), PolicyState(first_acceptance=0.0))
    assert fixed.plan(0) == (DRAFT, 6)


def test_rounds_without_the_draft_count_toward_its_next_probe_lookups_or_not():
    """Drafting off after a bad start: every round without the draft model counts toward the next
    probe, whether it took a plain step, verified a lookup (one row, or a batch's lookup rows, which
    the batched stage observes with `observe_lookup` then observe_round(NONE)) or a retrieval-only
    tree. Lookup rounds used to reset the count, so a draft with one bad start never ran again while
    retrieval kept finding matches (seen on the real pair at batch 4, and in single-row tree rounds:
    qa, math and mt_bench prompts whose draft stopped after three rounds)."""

    def plans(observe_rows, rows=4) -> list[str]:
        policy = DraftPolicy(PolicySettings(draft_cost=0.5, verify_cost=0.1, probe_interval=3, rows=rows), PolicyState(first_acceptance=0.1))
        out = []
        for _ in range(5):
            source = DRAFT if policy.should_draft() else NONE
            out.append(source)
            if source == DRAFT:
                policy.observe_round(DRAFT, 1, [0] * rows, [[0.2]] * rows)
            else:  # rows look up (one token each, accepted), or take a plain step
                observe_rows(policy)
        return out

    def batch_stage(policy):
        for _ in range(2):
            policy.observe_lookup(1, 1, 2)
        policy.observe_round(NONE, 0, [])

    expected = [NONE, NONE, NONE, DRAFT, NONE]
    assert plans(batch_stage) == expected
    assert plans(lambda policy: policy.observe_round(NGRAM, 1, [1], match_sizes=[2]), rows=1) == expected
    assert plans(lambda policy: policy.observe_tree(0, 0, None, [(1, True)], match_size=2), rows=1) == expected
    # any other source is a draft model (a user's drafter, a transformers candidate generator): it is scored
    custom = DraftPolicy(PolicySettings(draft_cost=0.5, verify_cost=0.1), PolicyState(plain_streak=5))
    for _ in range(6):
        custom.observe_round("PromptLookupCandidateGenerator", 1, [0], [[0.2]])
    assert not custom.drafting_pays() and custom.state.plain_streak == 0


def test_a_runner_up_the_target_takes_counts_as_a_draft_that_paid():
    """Tree rounds with the draft's runner-up beside its first token: when the target takes the
    runner-up, the draft's first forward paid (first-token acceptance stays up and drafting stays on),
    and the rate of draft rounds is what the tree emitted for its cost. Counted as a rejection (the
    chain's token alone), three such rounds turned drafting off on a qa prompt of the real pair."""
    settings = PolicySettings(draft_cost=0.3, verify_cost=0.08, verify_knee_cost=0.0)
    rescued, chain_only = DraftPolicy(settings), DraftPolicy(settings)
    for _ in range(6):  # a one-token chain and its runner-up (width 3): the runner-up taken, two tokens emitted
        rescued.observe_tree(1, 0, [0.5], [], first_hit=True, emitted=2, width=3)
        chain_only.observe_tree(1, 0, [0.5], [])
    assert rescued.drafting_pays() and rescued.state.first_acceptance > 0.9
    assert not chain_only.drafting_pays()
    assert rescued.expected_draft_rate() == pytest.approx(2 / (0.3 + 1 + 2 * 0.08))
    assert chain_only.expected_draft_rate() == pytest.approx(1 / (1 + 0.3 + 0.08))
    # calibration and per-token acceptance stay the chain token's own: both policies saw it rejected
    assert rescued.state.token_acceptance == chain_only.state.token_acceptance < 0.7


def test_failed_probes_back_off_and_a_paying_draft_resets_the_wait():
    """Drafting off (first-token acceptance below c + d): probes come after 3, then 6, then 12 (the
    cap) plain rounds while they keep failing. A probe whose draft pays restores the 3-round wait, so
    drafting comes back within a few probes; when it fails again, the next probe is 3 rounds away.
    Without backoff (probe_backoff=1): a probe every 4th round."""

    def run(backoff: float, good: range, rounds: int = 48) -> list[int]:
        policy = DraftPolicy(PolicySettings(draft_cost=0.5, verify_cost=0.1, probe_interval=3, max_probe_interval=12,
                                            probe_backoff=backoff, rows=4), PolicyState(first_acceptance=0.1))
        drafts = []
        for i in range(rounds):
            if policy.should_draft():
                drafts.append(i)
                accepted = i in good  # the draft's first token is accepted on every row, or on none
                policy.observe_round(DRAFT, 1, [int(accepted)] * 4, [[0.9 if accepted else 0.1]] * 4)
            else:
                policy.observe_round(NONE, 0, [])
        return drafts

    assert run(2.0, range(0)) == [3, 10, 23, 36]
    assert run(1.0, range(0)) == list(range(3, 48, 4))
    drafts = run(2.0, range(10, 30))  # the draft pays from round 10 to 29
    assert drafts[:3] == [3, 10, 14]  # the probe at 10 paid: the next one 3 plain rounds later, not 12
    assert set(range(26, 31)) <= set(drafts)  # drafting is back on, every round, before the good stretch ends
    off = min(i for i in range(31, 48) if i not in drafts)  # the first plain round after it
    assert [i for i in drafts if i > off][0] == off + 3


def test_batch_rounds_move_running_acceptance_as_much_as_one_row_round():
    """A round of 8 rows moves the running acceptance about as far as one single-row round (each row
    weighs 1 / rows): one bad batch round does not switch drafting off for the whole batch."""
    one, eight = DraftPolicy(), DraftPolicy(PolicySettings(rows=8))
    one.observe_round(DRAFT, 1, [0], [[0.5]])
    eight.observe_round(DRAFT, 1, [0] * 8, [[0.5]] * 8)
    assert one.state.first_acceptance == pytest.approx(0.56)
    assert 0.55 < eight.state.first_acceptance < 0.58  # weight w per row would give 0.7 x 0.8^8 = 0.12
    assert 0.6 < eight.state.token_acceptance < 0.65


def test_policy_stops_drafting_on_low_confidence_and_continues_on_high():
    def drafted(confidence, cost, most=8):
        keep_drafting = DraftPolicy(PolicySettings(draft_cost=cost, verify_cost=0.03)).stop_rule(1)
        n = 1  # as the draft loop runs it: at most `most` tokens, asking after each but the last
        while n < most and keep_drafting([confidence]):
            n += 1
        return n

    assert drafted(0.99, cost=0.1) == 8
    assert drafted(0.05, cost=0.1) == 1
    assert drafted(0.6, cost=0.1) > drafted(0.6, cost=0.5)  # dearer drafts, shorter rounds
    assert DraftPolicy(PolicySettings(max_draft_tokens=5, adaptive=False, draft_cost=0.1)).stop_rule(1) is None  # k drafted


def test_policy_calibrates_confidence_against_what_was_accepted():
    policy = DraftPolicy(PolicySettings(draft_cost=0.1))
    before = policy.calibrated(0.95)
    for _ in range(50):
        policy.observe_round(DRAFT, 1, [0], [[0.95]])  # confident drafts that the target rejects
    assert policy.calibrated(0.95) < 0.1 < before


def test_policy_prefers_ngram_while_it_pays_and_measures_costs():
    policy = DraftPolicy(PolicySettings(max_draft_tokens=8))
    assert policy.plan(10)[0] == NGRAM  # optimistic prior for n-gram proposals
    for _ in range(30):
        policy.observe_round(NGRAM, 10, [0])  # n-gram proposals always rejected
    assert policy.plan(10)[0] == DRAFT
    policy.observe_timing(draft_seconds=9.0, draft_forwards=3, target_seconds=9.0, width=3)  # prefill: skipped
    assert policy.cost == policy.settings.prior_draft_cost and policy.verify_cost == policy.settings.prior_verify_cost
    # Verify time 0.5 s * (1 + 0.1 (width - 1)), draft steps 0.1 s: c = 0.2 and d = 0.1, measured.
    for width in (1, 3, 9, 5, 2, 9, 1):
        policy.observe_timing(draft_seconds=0.1 * (width - 1), draft_forwards=width - 1,
                              target_seconds=0.5 * (1 + 0.1 * (width - 1)), width=width)
    assert policy.cost == pytest.approx(0.1 / 0.5)
    assert policy.verify_cost == pytest.approx(0.1)
    length, rate = DraftPolicy(state=PolicyState(ngram_acceptance=0.99)).ngram_length(16)
    assert length == 16 and rate > 5
    assert DraftPolicy(state=PolicyState(ngram_acceptance=0.01)).ngram_length(16)[0] == 0  # not worth verifying at all


def test_verify_cost_is_measured_from_the_prompt_and_one_step_before_anything_is_drafted():
    """Unpinned costs: the first two rounds are plain (the cost model is measuring). The prompt's
    encoding over 41 columns and one step then give the prior d0. A target whose forward costs as many
    steps as it takes tokens (a CPU without bf16 instructions: 4.0 s for the prompt, 0.1 s a step)
    reads d0 = 0.975 and drafts nothing; a weight-bound one (0.2 s for the prompt) reads 0.025 and
    drafts. With the old fixed prior (0.03) the slow target would have drafted in round 2."""

    def after(prefill_seconds: float) -> DraftPolicy:
        policy = DraftPolicy(PolicySettings(draft_cost=0.3))
        assert policy.measuring_costs
        policy.observe_timing(0.0, 0, prefill_seconds, width=1, columns=41)  # round 0: the prompt
        assert policy.measuring_costs  # round 1 is a plain step too
        policy.observe_timing(0.0, 0, 0.1, width=1)
        assert not policy.measuring_costs
        return policy

    slow, fast = after(4.0), after(0.2)
    assert slow.verify_cost == pytest.approx(0.975) and slow.plan(0) == (NONE, 0) and slow.plan(8)[0] == NONE
    assert fast.verify_cost == pytest.approx(0.025) and fast.plan(0)[0] == DRAFT
    assert DraftPolicy(PolicySettings(draft_cost=0.3)).plan(0)[0] == DRAFT  # what the fixed prior alone would do
    assert not DraftPolicy(PolicySettings(verify_cost=0.05)).measuring_costs  # pinned: nothing to measure
    # What the output and the CLI report: the slow machine is named as one where little can pay.
    told = slow.estimates()
    assert told.measured_verify_cost == pytest.approx(0.975) and not told.drafting_pays
    assert told.draft_cost_pinned and not told.verify_cost_pinned  # c = 0.3 given, d measured
    assert "c = 0.30 (pinned), verify d = " in told.describe() and " a token (measured)" in told.describe()
    assert "little can pay" in told.describe() and "little can pay" not in fast.estimates().describe()
    assert fast.estimates().drafting_pays


def test_the_first_two_rounds_of_an_unpinned_call_are_plain_steps():
    """The first call on a target measures d0 in two plain rounds; the next call on it does not."""
    target = tiny_model("llama", seed=5)
    draft = perturbed(target, noise=0.1)
    records = []
    out = spec(target, draft, max_new_tokens=30, acceptance_sink=records.append)
    assert [r.source for r in records[:2]] == [NONE, NONE]
    # After the two measuring rounds the cost model decides. A tiny model's timings are mostly overhead,
    # and on a loaded machine (two workers on two cores) the measured costs can say that no round pays
    # (1 failure in the suite runs of 2026-12-01); the rounds are then plain because the costs say so.
    assert any(r.source != NONE for r in records[2:]) or not out.cost_model.drafting_pays
    assert torch.equal(out.sequences, target.generate(REPEATING, do_sample=False, max_new_tokens=30))
    again = []  # a second call on the same model: d0 is remembered, nothing is measured first
    spec(target, draft, max_new_tokens=30, acceptance_sink=again.append)
    assert again[0].source != NONE
    told = out.cost_model
    assert told.measured_verify_cost is not None and not told.draft_cost_pinned and not told.verify_cost_pinned
    pinned = []
    told = spec(tiny_model("llama", seed=6), draft, max_new_tokens=30, draft_cost=0.05, verify_cost=0.02,
                acceptance_sink=pinned.append).cost_model
    assert pinned[0].source != NONE  # pinned costs: nothing is measured first
    assert (told.draft_cost, told.verify_cost, told.measured_verify_cost) == (0.05, 0.02, None)
    assert told.draft_cost_pinned and told.verify_cost_pinned


def test_draft_cost_is_a_ratio_that_leaves_out_catch_up_and_holds_when_rows_leave():
    """c is each draft step over the target's step at that moment: a first draft forward that caught up
    on several columns is left out, and when the batch shrinks (both steps cheaper) c stays."""
    policy = DraftPolicy(PolicySettings(max_draft_tokens=8, rows=4))
    policy.observe_timing(0.0, 0, 9.0, 1)  # the prompt's forward: skipped
    policy.observe_timing(5.0, 3, 0.5, 1)  # the draft's prefill round: skipped
    for width in (1, 3, 5, 2, 4):  # 4 rows: target 0.5 s (1 + 0.1 (w - 1)); draft steps 0.15 s
        policy.observe_timing(0.15 * (width - 1), width - 1, 0.5 * (1 + 0.1 * (width - 1)), width)
    assert policy.cost == pytest.approx(0.3) and policy.verify_cost == pytest.approx(0.1)
    # A round whose first draft forward caught up on a plain streak (0.3 s): c is unmoved; counted
    # as a step, that forward would have raised c (to 0.8 x 0.3 + 0.2 x 0.2 s / 0.5 s).
    policy.observe_timing(0.3 + 0.15 * 2, 3, 0.5 * 1.3, 4, catchup_seconds=0.3)
    assert policy.cost == pytest.approx(0.3)
    policy.observe_timing(0.3 + 0.15 * 2, 3, 0.5 * 1.3, 4)
    assert policy.cost == pytest.approx(0.32)
    # Two rows leave: both models' steps get 40% cheaper; the plain rounds that follow time only the
    # target, and c (a ratio) stays where it was (a ratio of stale seconds would have risen 1.7-fold).
    again = DraftPolicy(PolicySettings(max_draft_tokens=8, rows=4))
    again.observe_timing(0.0, 0, 9.0, 1)
    again.observe_timing(5.0, 3, 0.5, 1)
    for width in (1, 3, 5, 2, 4):
        again.observe_timing(0.15 * (width - 1), width - 1, 0.5 * (1 + 0.1 * (width - 1)), width)
    again.set_rows(2)
    for width in (1, 3, 1, 2, 1, 3, 1, 2) * 3:
        again.observe_timing(0.0, 0, 0.3 * (1 + 0.1 * (width - 1)), width)
    assert again.target_step_seconds == pytest.approx(0.3, rel=0.05)
    assert again.cost == pytest.approx(0.3)


def test_one_stalled_round_moves_the_cost_estimates_little():
    """A round 20 times slower than usual (a stall on a shared machine) counts as at most
    `outlier_factor` times the estimate, in both the verify fit and the draft step."""
    def timed(stall: float) -> DraftPolicy:
        policy = DraftPolicy(PolicySettings(max_draft_tokens=8))
        policy.observe_timing(0.0, 0, 9.0, 1)
        policy.observe_timing(5.0, 3, 0.5, 1)
        for width in (1, 3, 5, 2, 4, 3):
            policy.observe_timing(0.1 * (width - 1), width - 1, 0.5 * (1 + 0.05 * (width - 1)), width)
        policy.observe_timing(0.1 * 2 * stall, 2, 0.5 * 1.1 * stall, 3)
        return policy

    calm, stalled = timed(1.0), timed(20.0)
    assert calm.cost == pytest.approx(0.2) and calm.target_step_seconds == pytest.approx(0.5)
    assert stalled.cost < 0.3 and stalled.target_step_seconds < 0.75
    with pytest.raises(ValueError, match="outlier_factor"):
        PolicySettings(outlier_factor=1.0)
    with pytest.raises(ValueError, match="ngram_depths"):
        PolicySettings(ngram_depths=-1)


def test_the_draft_times_a_catch_up_forward_apart():
    """A draft whose cache lacks more than two columns reports its first forward's time as catch-up."""
    draft = tiny_model("llama", seed=21)
    drafter = DraftModelDrafter(draft, None, do_sample=False)
    ids = torch.randint(2, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    ticks = iter(range(100))
    clock = lambda: float(next(ticks))  # noqa: E731: each reading one second after the last

    def propose(seq):
        request = DraftRequest(seq, None, Prefixes.from_tensor(seq, [0, 1]), max_tokens=3, clock=clock)
        return drafter.propose(request)

    assert propose(ids).catchup_seconds == 0.0  # the prompt (a prefill, not a catch-up)
    rollback([drafter.cache], 12)
    assert propose(torch.cat([ids, ids[:, :2]], dim=1)).catchup_seconds == 0.0  # two new columns: a step
    rollback([drafter.cache], 14)
    assert propose(torch.cat([ids, ids[:, :6]], dim=1)).catchup_seconds == 1.0  # six: timed apart
    assert DraftModelDrafter(draft, None, do_sample=False).propose(
        DraftRequest(ids, None, Prefixes.from_tensor(ids, [0, 1]), max_tokens=2)).catchup_seconds == 0.0  # no clock


def test_policy_keeps_an_acceptance_per_match_size():
    """1-gram matches that keep failing stop being proposed while 3-gram matches still are."""
    policy = DraftPolicy(PolicySettings(max_draft_tokens=8, adaptive=False))
    assert policy.ngram_length(10, size=1)[0] > 0 and policy.ngram_length(10, size=3)[0] > 0  # optimistic priors
    for _ in range(30):
        policy.observe_round(NGRAM, 10, [0], match_sizes=[1])  # 1-gram matches always rejected
        policy.observe_round(NGRAM, 10, [10], match_sizes=[3])  # 3-gram matches always accepted
    assert policy.ngram_length(10, size=1)[0] <= 1  # at most one cheap column on a 3% chance
    assert policy.ngram_length(10, size=3)[0] == 10
    assert policy.plan(10, ngram_size=1)[0] == DRAFT and policy.plan(10, ngram_size=3)[0] == NGRAM
    assert policy.ngram_acceptance_for(2) == policy.state.ngram_acceptance  # unseen size: the all-sizes value
    sequence = torch.tensor([5, 9, 4, 1, 8, 2, 7, 3, 9])
    tokens, size = ngram_match(sequence, 3, 1, 4)
    assert size == 1 and tokens.tolist() == [4, 1, 8, 2]  # only (9) occurred before
    assert ngram_match(sequence, 3, 2, 4)[1] == 0


def test_policy_fits_the_verify_knee_and_prices_wide_rounds_on_it():
    """Verify time with a knee at 9 tokens: d below it, d + e past it; both slopes are recovered, and
    lookup lengths stop where the dearer tokens no longer pay."""
    policy = DraftPolicy(PolicySettings(max_draft_tokens=8))
    assert policy.knee_cost == policy.settings.prior_verify_knee_cost  # nothing timed yet
    policy.observe_timing(0.0, 0, 9.0, 3)  # the prompt's forward: skipped
    for width in (1, 3, 9, 5, 2, 9, 1):  # only narrow rounds: e stays at its prior, d is fitted
        policy.observe_timing(0.0, 0, 0.5 * (1 + 0.05 * (width - 1)), width)
    assert policy.verify_cost == pytest.approx(0.05) and policy.knee_cost == policy.settings.prior_verify_knee_cost
    for width in (17, 25, 13, 1, 33, 9, 21, 3):
        policy.observe_timing(0.0, 0, 0.5 * (1 + 0.05 * (width - 1) + 0.1 * max(0, width - 9)), width)
    assert policy.verify_cost == pytest.approx(0.05) and policy.knee_cost == pytest.approx(0.1)
    assert policy.verify_width_cost(17) == pytest.approx(1 + 0.05 * 16 + 0.1 * 8)
    assert policy.target_step_seconds == pytest.approx(0.5)
    # A lookup accepted 85% of the time: past the knee each token's expected gain is below its price.
    cheap = DraftPolicy(PolicySettings(verify_cost=0.02, verify_knee_cost=0.0), PolicyState(ngram_acceptance=0.85))
    dear = DraftPolicy(PolicySettings(verify_cost=0.02, verify_knee_cost=0.3), PolicyState(ngram_acceptance=0.85))
    assert cheap.ngram_length(30)[0] > 8 and dear.ngram_length(30)[0] <= 8
    assert dear.select_nodes([0.85 ** (j + 1) for j in range(30)], [], 0, 30) == list(range(dear.ngram_length(30)[0]))
    # In a batch a column is priced at d x rows, without the single-row knee.
    assert DraftPolicy(PolicySettings(rows=4, verify_knee_cost=0.3)).knee_cost == 0.0
    with pytest.raises(ValueError, match="verify_knee_cost"):
        PolicySettings(verify_knee_cost=-1.0)


# ---------------------------------------------------------------- verify prices per width

# Verify forwards whose price dips with width (in target steps): the shape measured on the packed
# 1.5B target on a 2-core AVX-512 EPYC (2 tokens 1.2-1.5 steps, 5 tokens 0.7-1.0; the eval's cost tables).
DIP = (1.0, 1.3, 1.15, 0.95, 0.85, 0.9, 0.95, 1.0, 1.05)


def _old_select_nodes(policy, reach, fixed, draft_forwards, max_nodes):
    """The marginal rule select_nodes had before prices per width: add the best node while it pays."""
    price, chosen = policy.verify_pricer(), set(fixed)
    tokens = 1.0 + sum(reach[j] for j in fixed)
    cost = draft_forwards * policy.cost + price(1 + len(fixed))
    for j in sorted((j for j in range(len(reach)) if j not in chosen), key=lambda j: (-reach[j], j)):
        d = price(2 + len(chosen)) - price(1 + len(chosen))
        if len(chosen) >= max_nodes or reach[j] * cost <= d * tokens:
            break
        chosen.add(j)
        tokens, cost = tokens + reach[j], cost + d
    return sorted(chosen)


def test_policy_learns_each_verify_widths_price_and_crosses_a_dear_width_to_a_cheaper_one():
    policy = DraftPolicy(PolicySettings(draft_cost=0.2))
    policy.observe_timing(0.0, 0, 9.0, 40)  # the prompt's forward: skipped
    for width in range(1, 10):  # twice each: not yet enough to price a width on its own
        policy.observe_timing(0.0, 0, 0.4 * DIP[width - 1], width)
        policy.observe_timing(0.0, 0, 0.4 * DIP[width - 1], width)
    assert policy.width_prices() == {}
    line = policy.verify_pricer()
    assert line(5) >= line(2)  # the line through them has no dip (its slope is clamped at 0)
    for width in range(1, 10):
        policy.observe_timing(0.0, 0, 0.4 * DIP[width - 1], width)
    price = policy.verify_pricer()
    for width in range(1, 10):
        assert price(width) / price(1) == pytest.approx(DIP[width - 1])
    off = DraftPolicy(dataclasses.replace(policy.settings, price_by_width=False), policy.state)  # the line only
    assert price(17) == pytest.approx(off.verify_pricer()(17))  # never timed: on the line
    # Four weak retrieved nodes: the first alone does not pay (0.2 tokens for 0.3 steps), four together
    # cost less than a plain step. The marginal rule stops at none; the priced curve takes all four.
    reach = [0.2, 0.15, 0.12, 0.1]
    assert policy.select_nodes(reach, [], 0, 24) == [0, 1, 2, 3]
    assert _old_select_nodes(policy, reach, [], 0, 24) == []
    assert policy.tree_rate(reach, [0, 1, 2, 3]) == pytest.approx(1.57 / (0.85 * price(1)))
    # Off (the eval's hf_linear_verify ablation): the line only, whatever was timed.
    assert off.verify_pricer()(5) >= off.verify_pricer()(2)
    # In a batch columns are priced on the line, d x rows: per-width times are single-row ones.
    batch = DraftPolicy(PolicySettings(rows=4))
    batch.observe_timing(0.0, 0, 9.0, 40)
    for width in range(1, 10):
        for _ in range(3):
            batch.observe_timing(0.0, 0, 0.4 * DIP[width - 1], width)
    assert batch.width_prices() == {}


def test_a_pinned_verify_curve_prices_every_width_and_reads_no_clock():
    policy = DraftPolicy(PolicySettings(draft_cost=0.2, verify_curve=DIP))
    assert not policy.measures_time and not policy.measuring_costs
    price = policy.verify_pricer()
    assert [price(w) for w in range(1, 10)] == list(DIP)
    assert price(12) == pytest.approx(DIP[-1] + 3 * (DIP[-1] - DIP[-2]))  # the last segment extended
    assert policy.select_nodes([0.2, 0.15, 0.12, 0.1], [], 0, 24) == [0, 1, 2, 3]
    assert policy.plain_rate == 1.0
    # d and e are the curve's unless pinned: a dip has no upward slope below the knee
    assert policy.verify_cost == 0.0 and policy.estimates().verify_cost_pinned
    assert DraftPolicy(PolicySettings(verify_curve=DIP, verify_cost=0.05)).verify_cost == 0.05
    # The stop rule looks past a dear width: a curve flat to 2 tokens, dear at 3-4, cheap from 5.
    step = (1.0, 1.0, 1.4, 1.4, 0.9, 0.9, 0.9, 0.9, 0.9)
    curved = DraftPolicy(PolicySettings(draft_cost=0.05, verify_curve=step), PolicyState(token_acceptance=0.7))
    keep = curved.stop_rule(1)
    assert keep([0.95])  # 1 drafted: stopping costs 1.05; 4 drafted costs 1.1 for far more tokens
    assert keep([0.95]) and keep([0.95])
    # ... unless the round may not draft that far (stop at 1: 1.95 tokens for 1.05 beats 2.62 for 1.5)
    assert curved.stop_rule(1, max_tokens=2)([0.95]) is False
    for bad in [(), (0.0, 1.0), (1.0, -0.5), (1.0, float("nan")), "fast"]:
        with pytest.raises(ValueError, match="verify_curve"):
            PolicySettings(verify_curve=bad)
        with pytest.raises(ValueError, match="verify_curve"):
            hf_specdec.SpeculativeConfig(verify_curve=bad)
    with pytest.raises(ValueError, match="price_by_width"):
        hf_specdec.SpeculativeConfig(price_by_width="yes")
    assert hf_specdec.SpeculativeConfig(verify_curve=[1, 0.9]).verify_curve == (1.0, 0.9)


@pytest.mark.parametrize("seed", range(20))
def test_on_a_price_line_nodes_and_draft_lengths_are_chosen_as_before(seed):
    """With the line (no per-width prices) the best-prefix node choice and the look-ahead stop rule
    make the marginal rules' choices: the rate is unimodal on a convex price."""
    gen = torch.Generator().manual_seed(seed)
    d, e, c = (torch.rand(3, generator=gen) * torch.tensor([0.3, 0.3, 0.6])).tolist()
    policy = DraftPolicy(PolicySettings(draft_cost=c, verify_cost=d, verify_knee_cost=e, price_by_width=False),
                         PolicyState(token_acceptance=0.3 + 0.6 * torch.rand(1, generator=gen).item()))
    reach = sorted(torch.rand(30, generator=gen).pow(3).tolist(), reverse=True)
    fixed = list(range(int(torch.randint(0, 5, (1,), generator=gen))))
    assert policy.select_nodes(reach, fixed, len(fixed), 24) == _old_select_nodes(policy, reach, fixed, len(fixed), 24)
    keep, step = policy.stop_rule(1), max(c + d, 1e-9)
    p_all, expected = 1.0, 1.0
    for j, conf in enumerate(torch.rand(7, generator=gen).tolist(), start=1):
        p_all *= policy.calibrated(conf)
        expected += p_all
        old = p_all * policy.state.token_acceptance / step > expected / (1 + j * step)
        assert keep([conf]) == old


def test_greedy_identity_with_a_pinned_dipping_verify_curve(arch):
    target = tiny_model(arch, seed=4)
    draft = perturbed(target, noise=0.3)
    plain = target.generate(REPEATING, do_sample=False, max_new_tokens=40)
    sinks = ([], [])
    for sink in sinks:
        out = spec(target, draft, max_new_tokens=40, draft_cost=0.1, verify_curve=DIP, acceptance_sink=sink.append)
        assert torch.equal(out.sequences, plain) and out.cost_model.verify_cost_pinned
    widths = [[len(r.draft_tokens) for r in sink] for sink in sinks]
    assert widths[0] == widths[1]  # pinned: the same work twice
    line_sink = []
    line = spec(target, draft, max_new_tokens=40, draft_cost=0.1, verify_cost=0.03, acceptance_sink=line_sink.append)
    assert torch.equal(line.sequences, plain)
    # One or two nodes (2-3 tokens, dearer than 4-5 on the curve) only where no more candidates were
    # there (the last rounds, with under 6 tokens of the budget left); on the line such rounds are common.
    def narrow(sink):
        emitted, count = 0, 0
        for r in sink:
            count += len(r.draft_tokens) in (1, 2) and 40 - emitted >= 6
            emitted += len(r.emitted_tokens)
        return count

    assert narrow(sinks[0]) * 3 <= narrow(line_sink) and narrow(line_sink) >= 3


def test_lookup_acceptance_is_kept_per_depth_and_sets_the_proposal_length():
    """Lookups whose first token is accepted half the time but whose later tokens then always are
    (a copy, once started, goes on): the first position is learned per match size, deeper ones per
    depth, and the chosen length is the whole continuation. The default model pools every position
    into one acceptance (about 0.9 here), which overstates the first token's 0.5."""
    policy = DraftPolicy(PolicySettings(max_draft_tokens=8, verify_cost=0.03, draft_cost=0.3, ngram_depths=4))
    for round_ in range(60):
        accepted = 10 if round_ % 2 else 0
        policy.observe_round(NGRAM, 10, [accepted], match_sizes=[2])
    assert policy.ngram_acceptance_for(2) == pytest.approx(0.5, abs=0.1)
    assert policy.ngram_acceptance_at(2, 2) > 0.95 and policy.ngram_acceptance_at(2, 9) == policy.ngram_acceptance_at(2, 4)
    assert policy.ngram_curve(2, 3)[0] == policy.ngram_acceptance_for(2)
    assert policy.ngram_length(16, size=2)[0] == 16
    pooled = DraftPolicy(PolicySettings(max_draft_tokens=8, verify_cost=0.03, draft_cost=0.3))
    for round_ in range(60):
        pooled.observe_round(NGRAM, 10, [10 if round_ % 2 else 0], match_sizes=[2])
    assert pooled.ngram_acceptance_at(2, 1) == pooled.ngram_acceptance_at(2, 5) == pytest.approx(0.9, abs=0.05)
    # Tree rounds report each retrieval event with its depth; events below the root move the depth's estimate.
    tree = DraftPolicy(PolicySettings(max_draft_tokens=8, ngram_depths=4))
    for _ in range(20):
        tree.observe_tree(0, 0, None, [(1, True), (2, False)], match_size=3)
    assert tree.ngram_acceptance_for(3) > 0.95 and tree.ngram_acceptance_at(3, 2) < 0.1


def test_policy_learns_lookups_it_did_not_verify():
    """A lookup the round did not verify is scored against what the round emitted, up to the first
    token that differs: a match size that keeps missing loses its optimistic prior without ever being
    verified, and one that keeps matching keeps it."""
    policy = DraftPolicy(PolicySettings(max_draft_tokens=8))
    prior = policy.ngram_acceptance_for(1)
    assert policy.ngram_length(10, size=1)[0] > 0
    for _ in range(3):
        policy.observe_unverified([4], [7], size=2)
    # a running mean from the prior (2 pseudo-observations): about 0.8 * 2 / 5, not a slow average's 0.8 * 0.9^3
    assert policy.ngram_acceptance_for(2) < 0.35 < prior * 0.9 ** 3
    for _ in range(30):
        policy.observe_unverified([4, 5, 6], [7, 5, 6], size=1)  # first token differs: one rejection
        policy.observe_unverified([1, 2, 3, 8], [1, 2, 3], size=3)  # three accepted, the fourth not emitted
    assert policy.ngram_acceptance_for(1) < 0.1 < prior
    assert policy.ngram_acceptance_for(3) > prior
    assert policy.ngram_length(10, size=1)[0] <= 1 and policy.plan(10, ngram_size=1)[0] == DRAFT
    before = policy.ngram_acceptance_for(2)
    policy.observe_unverified([], [1, 2], size=2)  # nothing proposed: nothing learned
    assert policy.ngram_acceptance_for(2) == before


# ---------------------------------------------------------------- greedy identity with the levers on


@pytest.mark.parametrize(
    "levers",
    [
        dict(),  # library defaults, costs measured
        dict(draft_cost=0.05),  # cheap drafts: long adaptive rounds
        dict(draft_cost=5.0),  # dear drafts: plain fallback and probes
        dict(draft_vocab_size=20, draft_cost=0.05),
        dict(ngram=False, draft_cost=0.05),
    ],
    ids=["defaults", "cheap", "dear", "vocab20", "no-ngram"],
)
def test_greedy_identity_with_levers(arch, levers):
    target = tiny_model(arch, seed=4)
    draft = perturbed(target, noise=0.3)
    plain = target.generate(REPEATING, do_sample=False, max_new_tokens=40)
    out = spec(target, draft, max_new_tokens=40, **levers)
    assert torch.equal(out.sequences, plain)
    stats = out.acceptance
    assert stats.emitted == 40 and stats.rounds == stats.target_forwards
    if levers.get("draft_cost") == 5.0:
        assert stats.plain_rounds > 0
    if levers.get("ngram", True):
        assert stats.ngram_rounds > 0
    if levers.get("draft_cost") == 0.05:
        assert len(stats.drafted_per_position) > 1  # some round drafted more than one token


def test_ngram_rounds_leave_the_draft_behind_and_it_catches_up():
    """After n-gram rounds the draft cache is shorter than the sequence; its next forward feeds the
    missing tokens at once. Caches never hold more than the sequence."""
    target = tiny_model("llama", seed=5)
    draft = perturbed(target, noise=0.3)
    records = []
    out = spec(target, draft, max_new_tokens=60, draft_cost=0.05, acceptance_sink=records.append)
    sources = [r.source for r in records]
    assert NGRAM in sources and DRAFT in sources
    assert torch.equal(out.sequences, target.generate(REPEATING, do_sample=False, max_new_tokens=60))
    assert out.cache.get_seq_length() <= out.sequences.shape[1]


def test_greedy_identity_with_a_quantized_draft():
    target = tiny_model("qwen2", seed=6)
    plain = target.generate(REPEATING, do_sample=False, max_new_tokens=30)
    for bits in (8, 4):
        draft = quantize_weights(perturbed(target, noise=0.1), bits, group_size=32)
        out = spec(target, draft, max_new_tokens=30, draft_cost=0.05, ngram=False)
        assert torch.equal(out.sequences, plain), bits
        assert out.acceptance.accepted > 0


def test_reduced_vocabulary_draft_never_proposes_outside_it():
    target = tiny_model("llama", seed=7)
    draft = copy.deepcopy(target)  # agrees with the target wherever the subset allows
    records = []
    prompt = torch.tensor([[1, 5, 9, 2]])
    out = spec(target, draft, prompt=prompt, max_new_tokens=40, draft_vocab_size=16, ngram=False, draft_cost=0.05, verify_cost=0.03,
               acceptance_sink=records.append)
    allowed = set(range(16)) | {1, 5, 9, 2}
    proposed = {t for r in records for t in r.draft_tokens}
    assert proposed and proposed <= allowed
    assert torch.equal(out.sequences, target.generate(prompt, do_sample=False, max_new_tokens=40))
    generated = set(out.sequences[0, prompt.shape[1] :].tolist())
    assert generated - allowed, "the test needs the target to want tokens outside the subset"


@pytest.mark.parametrize("draft_cost", [0.05, 0.6])  # long adaptive rounds; plain steps and probes
def test_batched_greedy_with_the_default_levers(draft_cost):
    target = tiny_model("llama", seed=8)
    draft = perturbed(target, noise=0.3)
    ids = torch.tensor([[0, 0, 1, 5, 9, 2, 5, 9], [1, 8, 4, 8, 4, 8, 4, 8]])
    mask = (ids != 0).long()
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    records = []
    out = target.generate(ids, attention_mask=mask, custom_generate=hf_specdec.speculative_generate, assistant=draft,
                          do_sample=False, max_new_tokens=30, draft_cost=draft_cost, verify_cost=0.06,
                          return_dict_in_generate=True, acceptance_sink=records.append)
    assert torch.equal(out.sequences, plain)
    assert out.acceptance.drafted > 0
    by_row = {row: {r.source for r in records if r.row == row} for row in (0, 1)}
    assert "ngram" in by_row[1]  # row 1 repeats itself: its lookup is proposed, per row
    if draft_cost > 0.5:
        assert out.acceptance.plain_rounds > 0


def test_speculative_config_and_bad_lever_values():
    target = tiny_model("llama", seed=9)
    config = hf_specdec.SpeculativeConfig(num_draft_tokens=3, adaptive=False, ngram=False)
    out = spec(target, target, max_new_tokens=12, speculative_config=config)
    assert len(out.acceptance.drafted_per_position) == 3  # fixed k = 3 from the config
    assert out.acceptance.drafted_per_position[0] >= out.acceptance.rounds - 1  # every round but the last drafts
    for bad, message in [
        (dict(draft_vocab_size=0), "draft_vocab_size"),
        (dict(draft_cost=-1.0), "draft_cost"),
        (dict(speculative_config=hf_specdec.SpeculativeConfig(), num_draft_tokens=0), "num_draft_tokens"),
    ]:
        with pytest.raises(ValueError, match=message):
            spec(target, target, max_new_tokens=3, **bad)
    with pytest.raises(ValueError, match="ngram_min_size"):
        hf_specdec.SpeculativeConfig(ngram_min_size=4, ngram_max_size=3)
    with pytest.raises(ValueError, match="prefill_patience"):
        hf_specdec.SpeculativeConfig(prefill_patience=-1.0)
    default = hf_specdec.SpeculativeConfig()  # 1-gram matches in tree rounds only; an explicit value everywhere
    assert default.lookup_min_size(trees=True) == 1 and default.lookup_min_size(trees=False) == 2
    assert hf_specdec.SpeculativeConfig(ngram_min_size=3).lookup_min_size(trees=True) == 3


# ---------------------------------------------------------------- the draft's prefill: counted, windowed


def test_policy_counts_the_drafts_prefill():
    policy = DraftPolicy(PolicySettings(draft_cost=0.25, verify_cost=0.03))
    warm = policy.expected_draft_rate()
    assert warm > 1 and policy.plan(0) == (DRAFT, 8)
    # 2000 prompt tokens cost rho * d * 2000 = 21 target steps: not worth it for 8 tokens, worth it for 1000.
    assert policy.prefill_cost(2000) == pytest.approx(0.35 * 0.03 * 2000)
    assert policy.expected_draft_rate(2000, 8) < 1 < policy.expected_draft_rate(2000, 1000) < warm
    assert policy.plan(0, prefill=2000, remaining=8) == (NONE, 0)
    assert policy.plan(0, prefill=2000, remaining=1000)[0] == DRAFT
    # Retrieval that would lose to a warm draft wins while the draft is still cold.
    policy.state.ngram_acceptance = 0.3
    assert policy.plan(4)[0] == DRAFT and policy.should_draft(300, 60)
    assert policy.plan(4, prefill=300, remaining=60)[0] == NGRAM
    # The prefill is spread over the tokens the draft is expected to draft: where retrieval keeps
    # beating a warm draft, a cold draft that would pay over all 200 remaining tokens is not started.
    assert policy.retrieval_share == 0.0 and policy.should_draft(300, 200)
    policy.note_retrieval(True)
    assert policy.retrieval_share == pytest.approx(1 / 3)  # two pseudo-rounds lost: one win decides little
    assert policy.should_draft(300, 200)
    for _ in range(30):
        policy.note_retrieval(True)
    assert policy.retrieval_share > 0.9 and not policy.should_draft(300, 200)
    assert policy.expected_draft_rate() == warm  # a warm draft's rate is unchanged
    for _ in range(60):
        policy.note_retrieval(False)
    assert policy.should_draft(300, 200)


def test_the_drafts_prefill_is_priced_from_the_prompts_encoding_not_the_verify_slope():
    """Where one more verify token costs the target nothing (d = 0: a flat verify curve, as the packed
    1.5B target's on a 2-core AVX-512 CPU nearly is), a prompt token still costs it compute: the draft's
    prefill is priced at rho times the target's encoding of one prompt token, timed on the prompt's,
    not at rho d (which had priced it at nothing, so that the ski rental never waited). Pinned, it is
    `draft_prefill_cost` per token; a cost model that reads no clock keeps rho d."""
    flat = (1.0, 1.0, 1.0, 1.0, 1.0)
    policy = DraftPolicy(PolicySettings(verify_curve=flat))  # c not pinned: the clock is read
    assert policy.verify_cost == 0.0 and policy.prefill_cost(256) == 0.0  # nothing timed yet: rho d
    policy.observe_timing(0.0, 0, 16.0, width=1, columns=400)  # the prompt: 400 columns in 16 s
    for _ in range(3):
        policy.observe_timing(0.0, 0, 0.4, width=1)  # plain steps of 0.4 s
    assert policy.encoding_cost == pytest.approx(16.0 / 400 / 0.4)  # 0.1 step a prompt token
    assert policy.prefill_cost(256) == pytest.approx(0.35 * 0.1 * 256)
    assert not policy.prefill_earned(256)  # the ski rental now waits for ~9 steps of loss
    short = DraftPolicy(PolicySettings(verify_curve=flat))
    short.observe_timing(0.0, 0, 2.0, width=1, columns=5)  # 5 columns: mostly overhead, not a price
    short.observe_timing(0.0, 0, 0.4, width=1)
    assert short.prefill_cost(256) == 0.0
    pinned = DraftPolicy(PolicySettings(verify_curve=flat, draft_cost=0.2))  # reads no clock
    pinned.observe_timing(0.0, 0, 16.0, width=1, columns=400)
    pinned.observe_timing(0.0, 0, 0.4, width=1)
    assert pinned.prefill_cost(256) == 0.0
    pinned_prefill = DraftPolicy(PolicySettings(verify_curve=flat, draft_cost=0.2, draft_prefill_cost=0.01))
    assert pinned_prefill.prefill_cost(256) == pytest.approx(2.56)
    with pytest.raises(ValueError, match="draft_prefill_cost"):
        hf_specdec.SpeculativeConfig(draft_prefill_cost=-0.1)


def test_a_pinned_draft_prefill_cost_reaches_the_cost_model(arch):
    """Through `generate`: a 300-token prompt, all of it in the draft (trees on), costs pinned. A free draft prefill starts
    the draft in the first round that may guess (round 2); one priced at 0.01 step a token (3 steps)
    only once the rounds without it have lost that much, or never; one at 1 step a token never. The
    outputs equal greedy."""
    target = tiny_model(arch, seed=11)
    draft = perturbed(target, noise=0.1)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 64, (1, 300), generator=gen)
    plain = target.generate(prompt, do_sample=False, max_new_tokens=40)
    first = {}
    for per_token in (0.0, 0.01, 1.0):
        rounds = []
        out = spec(target, draft, prompt, max_new_tokens=40, draft_cost=0.25, verify_cost=0.03,
                   draft_prefill_cost=per_token, acceptance_sink=rounds.append, draft_window=None)
        assert torch.equal(out.sequences, plain)
        first[per_token] = min((r.round for r in rounds if r.source == "draft"), default=math.inf)
    assert first[0.0] <= 2 < first[0.01] and first[1.0] == math.inf


def test_a_cold_draft_waits_until_the_rounds_without_it_have_lost_its_prefill():
    """Ski rental: rounds taken while the draft is cold add what they lost against a warm draft's
    expected rate; the draft may start once that reaches its prefill's cost, and rounds whose
    retrieval beat the draft add nothing."""
    policy = DraftPolicy(PolicySettings(draft_cost=0.25, verify_cost=0.03))
    cost, rate = policy.prefill_cost(300), policy.expected_draft_rate()
    assert policy.prefill_earned(0) and not policy.prefill_earned(300)
    policy.observe_cold_round(width=12, emitted=8)  # retrieval that beat a warm draft: no loss
    assert policy.state.cold_regret == 0.0
    rounds = 0
    while not policy.prefill_earned(300):
        policy.observe_cold_round(width=1, emitted=1)  # a plain step: lost 1 - 1 / rate
        rounds += 1
    assert policy.state.cold_regret == pytest.approx(rounds * (1 - 1 / rate))
    assert rounds == math.ceil(cost / (1 - 1 / rate)) > 1
    assert DraftPolicy(PolicySettings(prefill_patience=0.0)).prefill_earned(300)
    assert DraftPolicy(PolicySettings(adaptive=False)).prefill_earned(300)


def test_with_retrieval_a_long_prompts_draft_starts_only_after_its_prefill_is_earned(arch):
    target = tiny_model(arch, seed=11)
    draft = perturbed(target, noise=0.1)
    prompt = torch.randint(2, 64, (1, 600), generator=torch.Generator().manual_seed(0))
    plain = target.generate(prompt, do_sample=False, max_new_tokens=40)
    rounds = []
    out = spec(target, draft, prompt=prompt, max_new_tokens=40, draft_cost=0.25, verify_cost=0.03,
               acceptance_sink=rounds.append, draft_window=256)
    assert torch.equal(out.sequences, plain)
    sources = [r.source for r in rounds]
    assert DRAFT in sources  # 40 tokens pay for the draft's 256-token window in the end ...
    # ... but only after the rounds without it have lost what its prefill costs, replayed from the records
    first = sources.index(DRAFT)
    replay = DraftPolicy(PolicySettings(draft_cost=0.25, verify_cost=0.03))
    for r in rounds[: first - 1]:
        replay.observe_cold_round(len(r.draft_tokens) + 1, len(r.emitted_tokens))
    assert not replay.prefill_earned(256)  # not earned a round earlier ...
    replay.observe_cold_round(len(rounds[first - 1].draft_tokens) + 1, len(rounds[first - 1].emitted_tokens))
    assert replay.prefill_earned(256)  # ... earned by the round before the draft's first


def test_with_nothing_retrieved_a_cold_draft_that_pays_starts_at_once(arch):
    """The ski-rental wait hedges against paying the draft's prefill while retrieval could carry the
    answer: a tree round with nothing retrieved (a prompt without a repeated token) whose draft
    prefill is small (a 40-token prompt) starts the draft in the first round, as the expected-value
    rule says. Waiting there took three to seven plain rounds at the start of qa, math and mt_bench
    prompts on the real pair."""
    target = tiny_model(arch, seed=11)
    draft = perturbed(target, noise=0.1)
    prompt = torch.randperm(60, generator=torch.Generator().manual_seed(1))[None, :40] + 2  # no token twice
    plain = target.generate(prompt, do_sample=False, max_new_tokens=12)
    rounds = []
    out = spec(target, draft, prompt=prompt, max_new_tokens=12, draft_cost=0.25, verify_cost=0.03,
               acceptance_sink=rounds.append)
    assert torch.equal(out.sequences, plain)
    assert rounds[0].source == DRAFT
    # the wait itself is intact: a cold draft whose prefill is not earned yet would not have started
    policy = DraftPolicy(PolicySettings(draft_cost=0.25, verify_cost=0.03))
    assert not policy.prefill_earned(40) and policy.prefill_is_small(40, 12)
    # ... and a prefill that is not small against the drafting it serves still waits, retrieval or not
    warm = policy.expected_draft_rate()
    assert policy.prefill_is_small(0, 12) and not policy.prefill_is_small(600, 64)
    assert policy.expected_draft_rate(600, 64) < 0.9 * warm <= policy.expected_draft_rate(40, 12)


def test_a_cold_draft_that_cannot_pay_for_its_prefill_is_never_run(arch):
    target = tiny_model(arch, seed=11)
    draft = perturbed(target, noise=0.1)
    prompt = torch.randint(2, 64, (1, 600), generator=torch.Generator().manual_seed(0))
    plain = target.generate(prompt, do_sample=False, max_new_tokens=4)
    out = spec(target, draft, prompt=prompt, max_new_tokens=4, ngram=False, draft_cost=0.25, verify_cost=0.03,
               draft_window=256)  # 256 tokens to encode (greedy's default window, 64, could pay for 4 tokens)
    assert torch.equal(out.sequences, plain)
    assert out.acceptance.draft_forwards == 0 and out.acceptance.plain_rounds == 4
    out = spec(target, draft, prompt=prompt[:, :40], max_new_tokens=4, ngram=False, draft_cost=0.25, verify_cost=0.03)
    assert out.acceptance.draft_forwards > 0  # a short prompt's prefill pays


def _forward_widths(model):
    widths = []
    model.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    return widths


def test_draft_window_reads_only_the_last_tokens_of_the_prompt(arch):
    """The windowed draft's q equals that of the same draft given only the window: the zero columns in
    front of its cache are invisible (were they attended, q would differ)."""
    draft = tiny_model(arch, seed=12)
    prompt = torch.randint(2, 64, (1, 30), generator=torch.Generator().manual_seed(1))
    rows = [0]
    widths = _forward_widths(draft)

    def proposal(drafter, ids):
        request = DraftRequest(ids, None, Prefixes.from_tensor(ids, rows), max_tokens=4)
        return drafter.propose(request)

    windowed = DraftModelDrafter(draft, None, do_sample=True, generator=torch.Generator().manual_seed(5), window=8)
    seen = proposal(windowed, prompt)
    assert widths[0] == 8 and windowed.cache.get_seq_length() == 30 + 3 and windowed.hidden == 22
    alone = DraftModelDrafter(draft, None, do_sample=True, generator=torch.Generator().manual_seed(5))
    reference = proposal(alone, prompt[:, -8:])
    assert torch.equal(seen.tokens, reference.tokens)
    torch.testing.assert_close(seen.draft_probs, reference.draft_probs)
    # The next round feeds the accepted tokens only, still blind to the hidden head.
    longer = torch.cat([prompt, seen.tokens[:, :2]], dim=1)
    rollback([windowed.cache], 31)
    rollback([alone.cache], 9)
    torch.testing.assert_close(proposal(windowed, longer).draft_probs, proposal(alone, longer[:, -10:]).draft_probs)
    with pytest.raises(ValueError, match="one row"):
        DraftModelDrafter(draft, None, do_sample=False, window=8).start(2)


def test_generate_with_a_draft_window_is_greedy_exact(arch):
    target = tiny_model(arch, seed=13)
    draft = perturbed(target, noise=0.1)
    prompt = torch.cat([torch.randint(2, 64, (1, 50), generator=torch.Generator().manual_seed(2)), REPEATING], dim=1)
    plain = target.generate(prompt, do_sample=False, max_new_tokens=40)
    widths = _forward_widths(draft)
    out = spec(target, draft, prompt=prompt, max_new_tokens=40, draft_window=16, draft_cost=0.1, verify_cost=0.03)
    assert torch.equal(out.sequences, plain)
    assert widths and widths[0] == 16 and out.acceptance.accepted > 0
    # A batch's draft encodes the whole prompt (the window is for single rows).
    widths.clear()
    batch = torch.cat([prompt, prompt])
    out = target.generate(batch, custom_generate=hf_specdec.speculative_generate, assistant=draft, do_sample=False,
                          max_new_tokens=4, draft_window=16, draft_cost=0.1, verify_cost=0.03, ngram=False)
    assert torch.equal(out, target.generate(batch, do_sample=False, max_new_tokens=4)) and widths[0] == prompt.shape[1]
    with pytest.raises(ValueError, match="draft_window"):
        hf_specdec.SpeculativeConfig(draft_window=0)
