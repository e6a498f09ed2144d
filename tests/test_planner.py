"""The planner (`hf_specdec.planner`): its cost curve, acceptance model and one `plan` rule, unit by
unit; then through `generate`, where every setting must keep greedy output identical to plain greedy
(sampling exactness is in test_exactness.py) and must actually be exercised (asserted through the
round statistics)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import hf_specdec
from conftest import perturbed, tiny_model
from hf_specdec import Costs
from hf_specdec.cache import rollback
from hf_specdec.config import lazy_scored, unscored
from hf_specdec.planner import MAX_PROBE, PROBE, TIMED, Acceptance, CostCurve, Planner
from hf_specdec.proposals import DraftModelDrafter, DraftRequest, NgramCandidateGenerator, ngram_lookup, ngram_match
from hf_specdec.quantize import quantize_weights
from hf_specdec.sampling import Prefixes
from hf_specdec.stats import CACHE, DRAFT, NGRAM, NONE
from hf_specdec.verify import lazy_speculative_sampling

# A prompt that repeats itself, so n-gram lookup has matches from the first round.
REPEATING = torch.tensor([[1, 5, 9, 2, 7, 3, 5, 9, 2, 7, 3, 5, 9]])


def spec(model, draft, prompt=REPEATING, **kwargs):
    kwargs.setdefault("do_sample", False)
    return model.generate(
        prompt, attention_mask=torch.ones_like(prompt), custom_generate=hf_specdec.speculative_generate, assistant=draft,
        return_dict_in_generate=True, **kwargs,
    )


def plain(model, prompt=REPEATING, **kwargs):
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, **kwargs)


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
    reference = plain(target, max_new_tokens=30)
    out = spec(target, None, candidate_generator=NgramCandidateGenerator(), max_new_tokens=30)
    assert torch.equal(out.sequences, reference)


# ---------------------------------------------------------------- the cost curve


def test_pinned_costs_price_every_width_and_read_no_clock():
    line = CostCurve(Costs(draft_step=0.2, verify=0.05))
    assert not line.measuring and [line.verify_price(w) for w in (1, 2, 9)] == pytest.approx([1.0, 1.05, 1.4])
    assert line.draft_step == 0.2 and line.prefill(100) == pytest.approx(0.35 * 0.05 * 100)
    dip = CostCurve(Costs(draft_step=0.2, verify=(1.0, 1.2, 0.9, 0.95), draft_prefill=0.01))
    assert [dip.verify_price(w) for w in range(1, 5)] == [1.0, 1.2, 0.9, 0.95]
    assert dip.verify_price(7) == pytest.approx(0.95 + 3 * 0.05)  # the last segment extended
    assert dip.prefill(100) == pytest.approx(1.0)
    dip.observe(width=3, seconds=99.0)  # pinned: timings change nothing
    assert dip.verify_price(3) == 0.9
    for bad in [dict(draft_step=-1.0), dict(draft_step=0.1, verify=()), dict(draft_step=0.1, verify=(0.0, 1.0)),
                dict(draft_step=0.1, verify=(1.0, float("nan"))), dict(draft_step=0.1, verify="fast"),
                dict(draft_step=True), dict(draft_step=0.1, position=-0.1), dict(draft_step=0.1, position=None),
                dict(draft_step=0.2, verify=(1.0, 0.0)),  # a free width: generate() divided by zero
                dict(draft_step=0.2, position=5.0)]:  # scoring a position dearer than a whole step: negative prices
        with pytest.raises(ValueError):
            Costs(**bad)
    with pytest.raises(ValueError, match="costs must be"):
        hf_specdec.SpeculativeConfig(costs={"draft_step": 0.1})
    with pytest.raises(ValueError, match=r"draft_step must be a finite number >= 0, got None"):  # said '(or None)'
        Costs(draft_step=None)
    with pytest.raises(ValueError, match="1 by definition"):  # seconds, not steps: every price was off by 5x
        Costs(draft_step=0.2, verify=(0.2, 0.21, 0.23))
    assert Costs(draft_step=0.2, verify=(1.0004, 1.05)).verify_price(1) == 1.0004  # a table rounded to 4 places


def test_the_verify_slope_is_measured_from_the_prompt_and_one_step_before_anything_is_drafted():
    """Unmeasured costs: the first two rounds are plain (`measuring`). The prompt's encoding over 41
    columns and one step then give d0. A target whose forward costs as many steps as it takes tokens
    (a CPU without bf16 instructions: 4.0 s for the prompt, 0.1 s a step) reads d0 = 0.975 and drafts
    nothing; a weight-bound one (0.2 s for the prompt) reads 0.025 and drafts."""

    def after(prompt_seconds: float) -> Planner:
        planner = Planner(8)
        assert planner.curve.measuring
        planner.curve.observe(width=1, seconds=prompt_seconds, columns=41)  # round 0: the prompt
        assert planner.curve.measuring  # round 1 is a plain step too
        planner.curve.observe(width=1, seconds=0.1)
        assert not planner.curve.measuring
        return planner

    slow, fast = after(4.0), after(0.2)
    assert slow.curve.slope0 == pytest.approx(0.975) and fast.curve.slope0 == pytest.approx(0.025)
    assert slow.plan([[]], draft_room=8).draft == 0 and fast.plan([[]], draft_room=8).draft > 0
    assert slow.curve.verify_price(5) == pytest.approx(1 + 4 * 0.975)
    # the draft's prefill is priced from the prompt's encoding: 4.0 s / 41 columns over 0.1 s a step
    assert slow.curve.prefill(10) == pytest.approx(0.35 * 4.0 / 41 / 0.1 * 10)
    told = slow.estimates()  # what the output and the CLI report: little can pay here
    assert told.measured_verify_cost == pytest.approx(0.975) and not told.drafting_pays and not told.pinned
    assert "little can pay" in told.describe() and "little can pay" not in fast.estimates().describe()


def test_a_clock_that_reads_zero_divides_by_nothing():
    """A forward timed at 0 s (a coarse or mocked clock) prices like a very fast one, never a ZeroDivisionError."""
    curve = CostCurve(None)
    for width in (9, 1, 1, 1, 1, 3, 3, 3, 3):
        curve.observe(width, 0.0, draft_steps=2, draft_seconds=0.0, columns=width)
    prices = [curve.verify_price(w) for w in (1, 2, 3, 5)] + [curve.prefill(10), curve.draft_step]
    assert all(math.isfinite(p) and p >= 0 for p in prices) and curve.verify_price(1) > 0


def test_each_width_is_priced_by_its_own_time_once_timed_and_the_line_prices_the_rest():
    """A CPU's kernels need not cost more for more tokens (the packed 1.5B target: 2 tokens 1.2
    steps, 5 tokens 0.9): once a width was timed TIMED times its own mean prices it."""
    curve = CostCurve(None)
    curve.observe(width=1, seconds=1.0, columns=20)
    curve.observe(width=1, seconds=0.1)
    for _ in range(TIMED):
        curve.observe(width=2, seconds=0.12)
        curve.observe(width=5, seconds=0.09)
        curve.observe(width=1, seconds=0.1)
    assert curve.step_seconds() == pytest.approx(0.1, rel=0.1)
    assert curve.verify_price(2) == pytest.approx(1.2, rel=0.1) and curve.verify_price(5) == pytest.approx(0.9, rel=0.1)
    assert curve.verify_price(3) == pytest.approx(1 + 2 * (curve.verify_price(9) - 1) / 8)  # untimed: the line
    # a stalled round moves a width's price by at most OUTLIER times its prediction's share
    before = curve.verify_price(5)
    curve.observe(width=5, seconds=100.0)
    assert curve.verify_price(5) < 1.5 * before
    # c: a running ratio of the draft's step to the target's
    curve.observe(width=5, seconds=0.09, draft_steps=4, draft_seconds=0.12)
    assert curve.draft_step == pytest.approx(0.3, rel=0.15)
    # rows: a 2-row step feeds the tokens a 1-row forward over 2 does, and is priced by its time; c stays
    curve.rows = 2
    assert curve.step_seconds() == pytest.approx(0.12, rel=0.1) and curve.verify_price(1) == 1.0
    assert curve.draft_step == pytest.approx(0.3, rel=0.15)


def test_what_one_row_count_measured_prices_another():
    """A forward is timed by the tokens it feeds: 8 rows' rounds price a 4-row batch's widths (rows
    finish and leave), where keyed by (rows, width) the curve knew nothing and fell back to d0."""
    seconds = lambda tokens: 0.17 + 0.006 * tokens  # noqa: E731  (the shape measured at 8 rows on a Xeon)
    curve = CostCurve(None, rows=8)
    curve.observe(width=1, seconds=2.0, columns=100)
    curve.observe(width=1, seconds=seconds(8))
    for width in (2, 3, 6):
        curve.observe(width=width, seconds=seconds(8 * width))
    assert curve.verify_price(6) == pytest.approx(seconds(48) / seconds(8))
    curve.rows = 4
    assert curve.verify_price(6) == pytest.approx(seconds(24) / seconds(4))
    assert curve.step_seconds() == pytest.approx(seconds(4))


# ---------------------------------------------------------------- the acceptance model


def test_draft_acceptance_per_depth_and_calibration():
    acceptance = Acceptance(4)
    assert acceptance.draft_reach(3) == pytest.approx([0.7, 0.49, 0.343])
    for _ in range(30):  # the first token always taken, the second never
        acceptance.observe_draft(drafted=4, accepted=1, first_hit=True, confidences=[0.95, 0.15, 0.5, 0.5], weight=0.2)
    reach = acceptance.draft_reach(4)
    assert reach[0] > 0.99 and reach[1] < 0.01
    assert acceptance.draft_seen[2:] == [0, 0]  # never reached: the pooled estimate of deeper tokens stands in
    assert acceptance.draft_at(2) == acceptance.draft_at(3) == acceptance.pooled < 0.05
    assert acceptance.calibrated(0.95) > 0.9 and acceptance.calibrated(0.15) < 0.1  # confidence as it turned out
    assert acceptance.calibrated(0.55) == pytest.approx(0.55)  # an untouched bin: its centre


def test_lookup_acceptance_is_kept_per_match_size_and_unverified_lookups_are_scored():
    acceptance = Acceptance(4)
    for _ in range(20):
        acceptance.observe_lookup(1, False)
        acceptance.observe_lookup(3, True)
    assert acceptance.lookup_at(1) < 0.1 < 0.9 < acceptance.lookup_at(3)
    assert acceptance.lookup_at(8) == acceptance.lookup_at(3)  # a longer match starts from the nearest shorter
    before = acceptance.lookup_at(2)
    acceptance.score_unverified([4, 5, 6], [4, 5, 9], size=2)  # accepted, accepted, rejected: stop there
    assert acceptance.matches().seen[2] == 3 and acceptance.lookup_at(2) != before
    acceptance.score_unverified([], [1, 2], size=2)  # nothing proposed: nothing learned
    assert acceptance.matches().seen[2] == 3


def test_cached_acceptance_is_learned_per_unit_of_share():
    """A cached token is priced as acceptance x share; the acceptance is learned so that the product is
    unbiased. Tokens kept with probability 0.8 x share, half of them at share 0.5 (kept 40%), half at
    share 1 (kept 80%): the estimate settles near 0.8, so a share-1 token is priced near 0.8. Learning
    plain acceptance (ignoring the shares the price multiplies by) settles near 0.6, counting each
    share twice (0.6 for a share-1 token, 0.3 for a share-0.5 one)."""
    acceptance = Acceptance(4)
    pattern = [(1.0, True)] * 4 + [(1.0, False)] + [(0.5, True)] * 2 + [(0.5, False)] * 3  # 0.8 and 0.4 kept
    for _ in range(40):
        for share, kept in pattern:
            acceptance.observe_lookup(4, kept, CACHE, share)
    assert acceptance.lookup_at(4, CACHE) == pytest.approx(0.8, abs=0.06)
    assert acceptance.matches(CACHE).pooled == pytest.approx(0.8, abs=0.06)
    for _ in range(40):  # in-row lookup (share 1): a running mean of what was kept, as before
        acceptance.observe_lookup(4, True)
    assert acceptance.lookup_at(4) > 0.99 and acceptance.lookup_at(4) <= 1.0


def test_ngram_match_sizes_follow_the_longest_match():
    sequence = [7, 1, 2, 3, 9, 4, 1, 2, 3]
    tokens, size = ngram_match(sequence, 3, 1, 4)
    assert tokens == [9, 4, 1, 2] and size == 3
    assert ngram_match(sequence, 3, 2, 4, 32)[1] == 3
    assert ngram_match([1, 2, 3, 4], 3, 2, 4) == ([], 0)


# ---------------------------------------------------------------- one plan rule


def test_best_nodes_keep_the_prefix_of_best_first_nodes_with_the_best_rate():
    planner = Planner(8, costs=Costs(draft_step=0.2, verify=0.1))
    nodes, rate = planner.best_nodes([[0.9, 0.8, 0.05]])
    assert nodes == [[0, 1]] and rate == pytest.approx((1 + 1.7) / 1.2)  # 0.05 does not pay for 0.1 a node
    # a tree: a branch's nodes are taken by reach, whatever their order
    nodes, _ = planner.best_nodes([[0.9, 0.3, 0.6, 0.5]])
    assert nodes == [[0, 1, 2, 3]]
    nodes, _ = planner.best_nodes([[0.9, 0.3, 0.6, 0.5]], most=2)
    assert nodes == [[0, 2]]
    # a batch: the forward widens by the longest chain, and each row counts its own tokens
    nodes, rate = planner.best_nodes([[0.9, 0.8], [0.95], []])
    assert nodes == [[0, 1], [0], []] and rate == pytest.approx((3 + 2.65) / 1.2)
    # cost already spent (the draft's forwards) lowers the rate but not which nodes pay
    assert planner.best_nodes([[0.9, 0.8, 0.05]], base=1.0)[0] == [[0, 1]]
    # a dipping curve: a dear width is crossed to reach a cheaper one
    dip = Planner(8, costs=Costs(draft_step=0.2, verify=(1.0, 1.5, 1.5, 1.5, 0.9)))
    assert dip.best_nodes([[0.3, 0.2, 0.1, 0.05]])[0] == [[0, 1, 2, 3]]
    assert dip.best_nodes([[0.3, 0.1, 0.05]])[0] == [[]]  # three nodes (width 4) cost 1.5 for 1.45 tokens


def test_the_draft_length_maximises_expected_tokens_per_cost():
    planner = Planner(8, costs=Costs(draft_step=0.1, verify=0.02))
    planner.acceptance.draft, planner.acceptance.draft_seen = [0.9] * 8, [1] * 8
    k, rate = planner.draft_length(8)
    rates = [(1 + sum(0.9 ** i for i in range(1, j + 1))) / (j * 0.1 + 1 + 0.02 * j) for j in range(1, 9)]
    assert k == 1 + rates.index(max(rates)) and rate == pytest.approx(max(rates))
    planner.acceptance.draft = [0.9, 0.1] + [0.9] * 6
    assert planner.draft_length(8)[0] == 1  # a weak second token ends the chain
    assert planner.draft_length(0) == (0, 0.0)


def test_lazy_pricing_pays_for_the_positions_the_lazy_rule_is_expected_to_score():
    # Sampling on a CPU scores p in chunks ([0, 4), then 8 more, ...) up to the first rejection, so a
    # chain's positions from 4 on are scored only as often as its first 4 tokens are all accepted.
    # Measured against the rule itself: point-mass drafts accepted with chance 0.9 each, one row a call.
    torch.manual_seed(0)
    width, vocab, calls = 10, 4, 2000
    p = torch.full((1, width, vocab), 0.1 / (vocab - 1))
    p[..., 0] = 0.9  # the drafted token (0) is accepted with chance p(0) / 1
    drafts, skipped = torch.zeros(1, width - 1, dtype=torch.long), 0
    for _ in range(calls):
        asked = []
        lazy_speculative_sampling(drafts, None, lambda a, b: asked.append(b - a) or p[:, a:b])
        skipped += width - sum(asked)
    reach = [0.9 ** i for i in range(1, width)]
    assert unscored(width, reach) == pytest.approx(6 * (1 - 0.9 ** 4))  # 2.06; reach[4] (0.59) would give 2.46
    assert skipped / calls == pytest.approx(unscored(width, reach), abs=0.2)  # 3 standard errors
    assert unscored(4, reach) == 0.0  # the first chunk is always scored
    # the planner: a position at 0.1 of a step inside each width's price; priced lazily (sampling, one
    # row, pinned) a sure chain's tail is nearly free and the planner verifies more of it
    costs = Costs(draft_step=0.2, verify=tuple(1 + 0.11 * w for w in range(24)), position=0.1)
    chain = [[0.6 * 0.9 ** i for i in range(20)]]
    eager, lazy = Planner(8, costs=costs), Planner(8, costs=costs, lazy=True)
    assert lazy.curve.verify_price(10, chain[0]) == pytest.approx(costs.verify_price(10) - 0.1 * unscored(10, chain[0]))
    assert eager.curve.verify_price(10, chain[0]) == costs.verify_price(10)
    assert len(eager.best_nodes(chain)[0][0]) == 8 and len(lazy.best_nodes(chain)[0][0]) == 19
    lazy.set_rows(2)  # a batch is priced every position (the chunk waits for the batch's last row)
    assert lazy.curve.verify_price(10, chain[0]) == costs.verify_price(10)


def test_the_plan_drafts_when_that_beats_retrieval_and_plain_steps():
    planner = Planner(8, costs=Costs(draft_step=0.1, verify=0.02))
    assert planner.plan([[]], draft_room=8).draft > 0  # the optimistic prior: draft
    assert planner.plan([[]], draft_room=0).draft == 0  # no room for the draft
    strong = [[0.99 ** i for i in range(1, 11)]]  # a retrieved chain that is nearly sure
    plan = planner.plan(strong, draft_room=8)
    assert plan.draft == 0 and plan.nodes == [list(range(10))]
    fixed = Planner(5, adaptive=False, costs=Costs(draft_step=5.0, verify=0.02))
    assert fixed.plan(strong, draft_room=8).draft == 5 and fixed.plan([[]], draft_room=3).draft == 3


def test_drafting_that_does_not_pay_is_probed_with_backoff():
    planner = Planner(4, costs=Costs(draft_step=0.9, verify=0.05))
    planner.acceptance.draft, planner.acceptance.draft_seen = [0.1] * 4, [1] * 4
    waits = []
    for _ in range(3):
        rounds = 0
        while not planner.plan([[]], draft_room=4).probe:
            assert planner.plan([[]], draft_room=4).draft == 0
            planner.observe_without_draft()
            rounds += 1
        waits.append(rounds)
        planner.observe_draft([1], [0], [False], None, probe=True)  # the probe failed
    assert waits == [PROBE, 2 * PROBE, 4 * PROBE]
    for _ in range(20):  # the draft turns good: a paying round resets the wait
        planner.observe_draft([4], [4], [True], None)
    assert planner.plan([[]], draft_room=4).draft > 0 and planner.probe_wait == PROBE
    planner.probe_wait = 10 ** 6
    assert min(MAX_PROBE, 2 * 10 ** 6) == MAX_PROBE  # the wait's cap, as observe_draft applies it


def test_a_cold_drafts_prefill_is_spread_over_what_it_will_draft():
    planner = Planner(8, costs=Costs(draft_step=0.25, verify=0.03, draft_prefill=0.01))
    warm = planner.draft_length(8)[1]
    assert planner.draft_length(8, prefill=40, remaining=64)[1] == pytest.approx(64 / (64 / warm + 0.4))
    assert planner.plan([[]], 8, prefill=40, remaining=64).draft > 0  # a short prompt's prefill pays
    assert planner.plan([[]], 8, prefill=3000, remaining=4).draft == 0  # a long prompt, four tokens: never
    # rounds in which retrieval beat a warm draft shrink what the draft is expected to draft
    strong = [[0.99 ** i for i in range(1, 11)]]
    for _ in range(10):
        planner.plan(strong, 8, prefill=40, remaining=64)
    assert planner.retrieval_won == 10 and planner.draft_length(8, 40, 64)[1] < 64 / (64 / warm + 0.4)


def test_batch_rounds_move_the_estimates_as_much_as_one_row():
    one, batch = Planner(4), Planner(4, rows=8)
    one.observe_draft([4], [0], [False], None)
    batch.observe_draft([4] * 8, [0] * 8, [False] * 8, None)
    assert batch.acceptance.draft[0] == pytest.approx(one.acceptance.draft[0], abs=0.02)


# ---------------------------------------------------------------- through generate


@pytest.mark.parametrize(
    "settings",
    [
        dict(),  # library defaults, costs measured
        dict(costs=Costs(draft_step=0.05, verify=0.02)),  # cheap drafts: long rounds
        dict(costs=Costs(draft_step=5.0, verify=0.02)),  # dear drafts: plain or lookup rounds, and probes
        dict(ngram=False, costs=Costs(draft_step=0.05, verify=0.02)),
        dict(tree=False, costs=Costs(draft_step=0.05, verify=0.02)),
    ],
    ids=["defaults", "cheap", "dear", "no-ngram", "chains"],
)
def test_greedy_identity_with_settings(arch, settings):
    target = tiny_model(arch, seed=4)
    draft = perturbed(target, noise=0.3)
    out = spec(target, draft, max_new_tokens=40, **settings)
    assert torch.equal(out.sequences, plain(target, max_new_tokens=40))
    stats = out.acceptance
    assert stats.emitted == 40 and stats.rounds == stats.target_forwards
    cost = settings.get("costs")
    if cost is not None and cost.draft_step > 1:
        assert stats.draft_forwards < stats.rounds  # most rounds go without the draft
    if settings.get("ngram", True) and cost is not None:
        assert stats.ngram_rounds > 0 or any(stats.drafted_per_position)
    if cost is not None and cost.draft_step < 1:
        assert len(stats.drafted_per_position) > 1  # some round verified more than one drafted token


def test_the_first_two_rounds_of_an_unpinned_call_are_plain_steps():
    """The first call on a target measures d0 in two plain rounds; the next call on it does not."""
    target = tiny_model("llama", seed=5)
    draft = perturbed(target, noise=0.1)
    records = []
    out = spec(target, draft, max_new_tokens=30, acceptance_sink=records.append)
    assert [r.source for r in records[:2]] == [NONE, NONE]
    assert torch.equal(out.sequences, plain(target, max_new_tokens=30))
    assert out.cost_model.measured_verify_cost is not None and not out.cost_model.pinned
    # a second call on the same model: d0 is remembered (the same number, not a new timing), not measured again
    again = spec(target, draft, max_new_tokens=30)
    assert again.cost_model.measured_verify_cost == out.cost_model.measured_verify_cost
    pinned = []
    told = spec(tiny_model("llama", seed=6), draft, max_new_tokens=30, costs=Costs(draft_step=0.05, verify=0.02),
                acceptance_sink=pinned.append).cost_model
    assert pinned[0].source != NONE  # pinned costs: nothing is measured first
    assert told.pinned and (told.draft_cost, told.measured_verify_cost) == (0.05, None)
    assert told.verify_cost == pytest.approx(0.02)


def test_pinned_costs_make_seeded_sampling_repeat_exactly():
    target = tiny_model("llama", seed=5)
    draft = perturbed(target, noise=0.1)
    runs = []
    for _ in range(2):
        records = []
        out = spec(target, draft, max_new_tokens=30, do_sample=True, top_k=10, generator=torch.Generator().manual_seed(3),
                   costs=Costs(draft_step=0.1, verify=0.02), acceptance_sink=records.append)
        runs.append((out.sequences.tolist(), [(r.source, r.draft_tokens, r.num_accepted) for r in records]))
    assert runs[0] == runs[1] and any(source == DRAFT for source, _, _ in runs[0][1])


def test_ngram_rounds_leave_the_draft_behind_and_it_catches_up():
    """After n-gram rounds the draft cache is shorter than the sequence; its next forward feeds the
    missing tokens at once. Caches never hold more than the sequence."""
    target = tiny_model("llama", seed=5)
    draft = perturbed(target, noise=0.3)
    records = []
    out = spec(target, draft, max_new_tokens=60, tree=False, costs=Costs(draft_step=0.05, verify=0.02),
               acceptance_sink=records.append)
    sources = [r.source for r in records]
    assert NGRAM in sources and DRAFT in sources
    assert torch.equal(out.sequences, plain(target, max_new_tokens=60))
    assert out.cache.get_seq_length() <= out.sequences.shape[1]


@pytest.mark.parametrize("draft_step", [0.05, 0.6])  # long rounds; plain steps and probes
def test_batched_greedy_mixes_lookup_and_draft_rows(draft_step):
    target = tiny_model("llama", seed=8)
    draft = perturbed(target, noise=0.3)
    ids = torch.tensor([[0, 0, 1, 5, 9, 2, 5, 9], [1, 8, 4, 8, 4, 8, 4, 8]])
    mask = (ids != 0).long()
    reference = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    records = []
    out = target.generate(ids, attention_mask=mask, custom_generate=hf_specdec.speculative_generate, assistant=draft,
                          do_sample=False, max_new_tokens=30, costs=Costs(draft_step=draft_step, verify=0.06),
                          return_dict_in_generate=True, acceptance_sink=records.append)
    assert torch.equal(out.sequences, reference)
    assert out.acceptance.drafted > 0
    by_row = {row: {r.source for r in records if r.row == row} for row in (0, 1)}
    assert NGRAM in by_row[1]  # row 1 repeats itself: its lookup is proposed, per row


def test_a_cold_draft_that_cannot_pay_for_its_prefill_is_never_run(arch):
    target = tiny_model(arch, seed=11)
    draft = perturbed(target, noise=0.1)
    prompt = torch.randint(2, 64, (1, 600), generator=torch.Generator().manual_seed(0))
    costs = Costs(draft_step=0.25, verify=0.03)
    out = spec(target, draft, prompt=prompt, max_new_tokens=4, ngram=False, costs=costs, draft_window=256)
    assert torch.equal(out.sequences, plain(target, prompt, max_new_tokens=4))
    assert out.acceptance.draft_forwards == 0 and out.acceptance.plain_rounds == 4
    out = spec(target, draft, prompt=prompt[:, :40], max_new_tokens=4, ngram=False, costs=costs)
    assert out.acceptance.draft_forwards > 0  # a short prompt's prefill pays


def test_speculative_config_and_bad_values():
    target = tiny_model("llama", seed=9)
    config = hf_specdec.SpeculativeConfig(num_draft_tokens=3, adaptive=False, ngram=False)
    out = spec(target, target, max_new_tokens=12, speculative_config=config)
    assert len(out.acceptance.drafted_per_position) == 3  # fixed k = 3 from the config
    assert out.acceptance.drafted_per_position[0] >= out.acceptance.rounds - 1  # every round but the last drafts
    for bad, message in [
        (dict(costs=0.5), "costs"),
        (dict(tree="yes"), "tree"),
        (dict(speculative_config=hf_specdec.SpeculativeConfig(), num_draft_tokens=0), "num_draft_tokens"),
    ]:
        with pytest.raises(ValueError, match=message):
            spec(target, target, max_new_tokens=3, **bad)
    with pytest.raises(ValueError, match="ngram_min_size"):
        hf_specdec.SpeculativeConfig(ngram_min_size=4)  # longer than the longest n-gram matched
    with pytest.raises(ValueError, match="ngram_max_size"):  # a removed setting is named, not ignored
        spec(target, target, max_new_tokens=3, ngram_max_size=2)
    with pytest.raises(TypeError):
        hf_specdec.SpeculativeConfig(prefill_patience=1.0)  # a removed setting is not silently accepted
    default = hf_specdec.SpeculativeConfig()  # 1-gram matches in tree rounds only; an explicit value everywhere
    assert default.ngram_min_size == 1  # in trees and chains: a 1-token match is priced by its own acceptance
    assert len(hf_specdec.config.SETTINGS) <= 12
    import numpy as np  # a sweep's integers are taken as the ints they are; a float is not a number of tokens

    swept = hf_specdec.SpeculativeConfig(num_draft_tokens=np.int64(3), draft_window=torch.tensor(64))
    assert (swept.num_draft_tokens, swept.draft_window) == (3, 64) and type(swept.num_draft_tokens) is int
    with pytest.raises(ValueError, match="num_draft_tokens must be a positive integer"):
        hf_specdec.SpeculativeConfig(num_draft_tokens=np.float64(3.0))
    # prices: numpy floats (a measured table's values) are the floats they are; a bool, NaN or text is not a price
    costs = hf_specdec.Costs(draft_step=np.float32(0.25), verify=np.float64(0.03), position=np.float32(0.5))
    assert (costs.draft_step, costs.position) == (0.25, 0.5) and type(costs.draft_step) is float
    for bad in (True, float("nan"), "0.1", -0.1):
        with pytest.raises(ValueError, match="draft_step must be a finite number"):
            hf_specdec.Costs(draft_step=bad)


def test_a_removed_keyword_is_refused_by_name():
    target = tiny_model("llama", seed=9)
    with pytest.raises(ValueError, match="draft_cost"):
        spec(target, target, max_new_tokens=3, draft_cost=0.1)


def test_greedy_identity_with_a_quantized_draft():
    target = tiny_model("qwen2", seed=6)
    reference = plain(target, max_new_tokens=30)
    for bits in (8, 4):
        draft = quantize_weights(perturbed(target, noise=0.1), bits, group_size=32)
        out = spec(target, draft, max_new_tokens=30, costs=Costs(draft_step=0.05, verify=0.02), ngram=False)
        assert torch.equal(out.sequences, reference), bits
        assert out.acceptance.accepted > 0


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
    reference = plain(target, prompt, max_new_tokens=40)
    widths = _forward_widths(draft)
    out = spec(target, draft, prompt=prompt, max_new_tokens=40, draft_window=16, costs=Costs(draft_step=0.1, verify=0.03))
    assert torch.equal(out.sequences, reference)
    assert widths and widths[0] == 16 and out.acceptance.accepted > 0
    # A batch's draft encodes the whole prompt (the window is for single rows).
    widths.clear()
    batch = torch.cat([prompt, prompt])
    out = target.generate(batch, custom_generate=hf_specdec.speculative_generate, assistant=draft, do_sample=False,
                          max_new_tokens=4, draft_window=16, costs=Costs(draft_step=0.1, verify=0.03), ngram=False)
    assert torch.equal(out, target.generate(batch, do_sample=False, max_new_tokens=4)) and widths[0] == prompt.shape[1]
    with pytest.raises(ValueError, match="draft_window"):
        hf_specdec.SpeculativeConfig(draft_window=0)


def test_a_lookup_beside_drafted_rows_is_sized_for_the_batch():
    """In a batch round where some rows verify the draft's chain and one its lookup, the lookup's
    length is chosen for the batch: each column past the drafted chains widens all 8 rows' forward.
    Sized as if the row were alone (best_nodes of that row only), it took all 8 tokens."""
    from hf_specdec.rounds import lookup_lengths

    planner = Planner(8, costs=Costs(draft_step=0.5, verify=0.2))  # a column costs 0.2 of a step
    lookup = [0.6 ** (i + 1) for i in range(8)]
    reach = [lookup] + [[] for _ in range(7)]
    confidences = [[0.9]] * 8
    use_lookup = [True] + [False] * 7
    alone = len(planner.best_nodes([lookup])[0][0])
    batch = lookup_lengths(planner, reach, confidences, use_lookup, drafted=1)
    assert alone >= 2 and batch == [1] + [0] * 7  # only the column the drafted chains already pay for
    # once every row verifies a lookup of its own, the extra columns pay for the batch again
    assert lookup_lengths(planner, [lookup] * 8, confidences, [True] * 8, drafted=1)[0] >= 2


def test_each_round_records_the_positions_its_target_scored():
    # What the eval's cost model charges (`RoundRecord.scored`): greedy scores every proposed position;
    # sampling on a CPU scores chunk by chunk ([0, 4), [4, 12), ...) up to the row's first rejection.
    target = tiny_model(vocab=64)
    draft = perturbed(target, 0.5)
    prompt = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 13, 5, 9, 2, 7, 3, 11, 13, 5, 9, 2, 7, 3, 11, 13, 5, 9]])
    records = []
    spec(target, draft, prompt, max_new_tokens=40, acceptance_sink=records.append, tree=False)
    assert records and all(r.scored == len(r.draft_tokens) + 1 for r in records)
    records.clear()
    torch.manual_seed(1)
    spec(target, draft, prompt, max_new_tokens=60, do_sample=True, top_p=0.9, acceptance_sink=records.append,
         costs=Costs(draft_step=0.05, verify=0.01))
    assert all(r.scored == lazy_scored(len(r.draft_tokens), r.num_accepted) for r in records)
    assert [lazy_scored(20, n) for n in (0, 3, 4, 11, 12, 20)] == [4, 4, 12, 12, 21, 21]  # the evals charge this
    assert any(r.scored < len(r.draft_tokens) + 1 for r in records)  # the lazy rule stopped early somewhere


def test_planner_arguments_are_checked_by_name():
    for bad, name in [(dict(max_draft=0), "max_draft"), (dict(max_draft=2.5), "max_draft"), (dict(max_draft=8, rows=0), "rows"),
                      (dict(max_draft=8, costs={"draft_step": 0.2}), "costs"), (dict(max_draft=10**12), "at most 1024")]:
        with pytest.raises(ValueError, match=name):  # each was taken and failed later, or priced nothing
            Planner(**bad)
    assert Planner(np.int64(8), rows=np.int64(2)).rows == 2  # a sweep's numpy values


def test_numpy_settings_are_taken_and_a_planners_adaptive_is_checked():
    """Before: Costs(verify=np.array([...])) was told 'verify must be a finite number' (a list works),
    SpeculativeConfig(adaptive=np.True_) was refused though numpy integers are taken, and Planner(adaptive="no")
    was taken as true."""
    from hf_specdec import Planner, SpeculativeConfig

    curve = [1.0, 1.1, 1.3]
    assert Costs(draft_step=0.2, verify=np.array(curve)).verify == tuple(curve)
    assert Costs(draft_step=0.2, verify=torch.tensor(curve, dtype=torch.float64)).verify == tuple(curve)
    assert SpeculativeConfig(adaptive=np.True_, tree=np.False_).adaptive is True
    with pytest.raises(ValueError, match="Planner's adaptive must be True or False"):
        Planner(4, adaptive="no")
