"""What to draft each round, chosen by a cost model fed with what this generate call has measured.

Units: one target forward over one new token costs 1. A draft forward costs `c` (the ratio of draft
to target step time); each extra token in the verifying forward adds `d` (the verify token cost:
verification is memory bound, so 8 tokens cost little more than one step on a CPU, while on a
compute-bound device d is larger). A round that drafts j tokens then costs 1 + j (c + d) and emits
1 + sum_i P_i tokens in expectation, where P_i is the probability that draft tokens 1..i are all
accepted.

Three decisions, each maximising expected tokens per unit of cost (Leviathan et al. 2023, sec. 3.4):

* stop drafting: after drafting token j, drafting token j + 1 adds P_j * a (a: the running per-token
  acceptance) tokens for c + d; it is drafted only if that beats the round's rate so far,
  (1 + sum_{i<=j} P_i) / (1 + j (c + d)). P_j is estimated from the draft's own confidence (its
  probability of the token it proposed), calibrated online against what the target accepted.
* fall back to plain decoding: a round drafts at all only if the first draft token pays for
  itself (first-position acceptance > c + d; in a tree round, the draft's token or the runner-up
  beside it taken); otherwise it is a plain target step, and after `probe_interval` rounds without
  the draft model (plain or lookup) one round drafts again to refresh the estimate. A probe whose own
  first tokens did not pay (accepted in at most a share c + d of the rows) and that leaves drafting
  off doubles the wait before the next one (up to `max_probe_interval`); a draft round that pays
  resets it. A probe costs a draft forward over every row plus a catch-up over the columns the draft
  missed, so in a batch where drafting does not pay, probing every 8 rounds was a steady loss.
* n-gram or draft model (hybrid): an n-gram proposal of length L costs 1 + L d (no draft forward)
  and emits 1 + sum_{i<=L} g^i, with g the running per-token acceptance of proposals after a match
  of that size (optimistic prior, so a match is tried); it is used when that rate is at least the
  draft model's recent rate. L itself is the length that maximises that rate. With `ngram_depths`
  (off by default), g_1 is the first token's acceptance for that size and g_j (j >= 2) that of token
  j given the ones before it, per depth over all sizes (a copy that has started tends to go on), and
  the proposal emits 1 + sum_{i<=L} g_1 ... g_i.

* the draft's prefill: before the draft model has encoded the prompt, drafting costs that encoding
  too, P = rho * u * n for n prompt tokens (rho: draft over target prefill time per token; u: the
  target's encoding of one prompt token, measured from the prompt's; d until then, or pinned as
  `draft_prefill_cost` = rho * u). Over the R tokens still to generate,
  a draft of rate r then has the effective rate R' / (R' / r + P), R' = R (1 - s) the tokens it is
  expected to draft (s: the share of rounds so far in which retrieval beat a warm draft, shrunk
  toward 0): it is used only where that beats the alternative (retrieval, or a plain step at rate
  1), so a long prompt with a short answer, or retrieval that keeps paying, never pays the draft's
  prefill. With retrieval (single rows) and in batches, the draft also waits until the rounds taken
  without it have lost, against a warm draft's expected rate, as much as its prefill costs (ski
  rental: at most twice the cost of the best choice in hindsight): the share, and how long the
  answers will be, are unknown in the first rounds, when the decision is made. A single row does not
  wait in a round where retrieval has no node worth verifying and the prefill is small against the
  drafting it serves (`prefill_is_small`): the expected-value rule alone decides there.

Both costs are measured online from the rounds' wall times: c from draft time per draft step over
the target's one-token step time at that moment (a running ratio, so it holds when rows leave a
batch; a first draft forward that catches up on more than two columns is not a step and is left
out; one stalled round counts as at most `outlier_factor` times the estimate), d from a
least-squares fit of verify time against the verify width (forgetting old rounds exponentially).
Until a fit is possible, priors stand in. The prior for d is measured before the first speculative
round when costs are not pinned: the first two rounds are plain (the prompt's encoding, over n
columns, then one one-token step), and d0 = (T_prefill / T_step - 1) / (n - 1). On a CPU whose
forward is bound by reading the weights (the case speculation is built for) d0 is a few hundredths;
on one that computes a many-token forward at the cost of as many steps (seen on a 2-core AVX2 EPYC
without bf16 instructions: a bf16 forward over 2, 5 and 9 tokens costs 1.8, 4.2 and 7.7 steps) d0
is close to 1, and then no round drafts: speculation there could only lose, and guessing with the
optimistic prior had made the first rounds cost several steps each (0.75x on the README's command).
`speculative_generate` remembers d0 per target model (device, threads, rows), so later calls on the
same model start speculating at once.
Verify time is not linear in width on a CPU: past a knee (9 tokens) the forward stops being bound by
reading the weights and each token costs about twice as much. One row's verify forward over w
tokens is priced 1 + d (w - 1) + e max(0, w - 9), with e fitted alongside d once rounds on both
sides of the knee have been timed; trees and lookup lengths are chosen on that curve.
A CPU's GEMM kernels need not follow a line at all: on the packed 1.5B target on a 2-core AVX-512
EPYC a forward over 2 tokens costs 1.15-1.25 one-token steps and one over 5 tokens 0.78-0.92 (the
eval's cost table, run greedy-widths, docs/evaluation.md#older-runs). So a single row also prices each verify width by
its own running mean time once a few rounds of that width were timed (`price_by_width`;
`verify_curve` pins the prices), the line pricing the widths not timed yet. Nodes and draft lengths
are then chosen for the best rate over every length, not by whether the next token pays: a tree
takes the prefix of its best-first nodes with the highest expected tokens per unit of cost, and the draft goes on while stopping at some
later length beats stopping now (on a line, where the rate has one peak, both are the marginal rules).

None of this touches exactness: every decision depends only on the past and on the draft's own
proposals, and each drafted position is still verified by the rejection rule. Measured costs come
from wall time, so the draft lengths (and, under sampling, which random numbers a seeded run
consumes) depend on timing; pin `draft_cost` and `verify_cost` for runs that must repeat exactly.
Pure Python (no torch, no transformers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from .stats import DRAFT, NGRAM, NONE


def _ema(old: float, new: float, weight: float) -> float:
    return (1 - weight) * old + weight * new


@dataclass(frozen=True)
class PolicySettings:
    """The cost model's fixed settings for one generate call."""

    max_draft_tokens: int = 8  # most draft-model tokens per round
    adaptive: bool = True  # False: draft max_draft_tokens every round (the model only arbitrates n-gram vs draft)
    draft_cost: float | None = None  # pin c instead of measuring it
    verify_cost: float | None = None  # pin d instead of measuring it
    prior_draft_cost: float = 0.4  # c before the first measurement (a 3x smaller draft on a CPU)
    # d before two verify widths have been timed: memory-bound verification, where 8 tokens cost about
    # 1.2 one-token steps (a 1.5B model on 2 CPU cores); the online fit replaces it within a few rounds.
    prior_verify_cost: float = 0.03
    # Rows in the batch: before the fit, one more verify column costs `rows` tokens of target compute,
    # d = prior_verify_cost x rows (measured, run batch-widths, docs/evaluation.md#older-runs: 0.12 at batch 4, 0.20 at 8).
    rows: int = 1
    # Wide verify forwards: past `verify_knee` tokens each more token costs e on top of d (on a CPU a
    # forward leaves the memory-bound regime; on the real pair's cost table d is 0.02-0.03 below 9
    # tokens and 0.04-0.05 above, docs/evaluation.md, the bf16 table). e is fitted online from
    # rounds on both sides of the knee (single rows only; a batch prices columns at d x rows).
    verify_knee: int = 9
    verify_knee_cost: float | None = None  # pin e instead of measuring it (pinning d alone pins e at its prior)
    prior_verify_knee_cost: float = 0.02
    # Price each verify width by its own measured time, not only by the line above (single rows): a
    # CPU's GEMM kernels need not cost more for more tokens (the packed 1.5B target on a 2-core
    # AVX-512 EPYC: 2 tokens 1.15-1.25 steps, 5 tokens 0.78-0.92, 9 tokens 0.95-1.14;
    # run greedy-widths, docs/evaluation.md#older-runs). Online, a width's price is the running mean of its rounds' times
    # over the step once `width_observations` rounds of that width have been timed (the line prices
    # the others); `verify_curve` pins the prices (entry i: a forward over i + 1 tokens, in target
    # steps; wider ones extend its last segment).
    price_by_width: bool = True
    verify_curve: tuple[float, ...] | None = None
    width_observations: int = 3
    # rho: draft prefill time over the target's for the same tokens. Measured on the real pair (0.5B
    # int8 draft, 1.5B target, 2 CPU cores, 380-1300-token prompts): 0.31-0.37.
    prefill_ratio: float = 0.35
    # Pin the draft's encoding of one prompt token, in target steps (P / n), instead of rho times the
    # target's own encoding of one token as measured from the prompt's (`prefill_cost`).
    draft_prefill_cost: float | None = None
    # The draft's prefill is spread over the tokens the draft is expected to draft: the tokens still
    # to generate times the share of rounds in which retrieval would not beat a warm draft. The share
    # starts from this many pseudo-rounds in which retrieval lost (so one lucky lookup decides nothing).
    retrieval_prior_rounds: float = 2.0
    probe_interval: int = 8  # rounds without the draft model (plain or lookup) before drafting is tried again
    # After a probe that leaves drafting off, the wait before the next probe is multiplied by this
    # (exponential backoff), up to max_probe_interval; a draft round that pays restores probe_interval.
    probe_backoff: float = 2.0
    max_probe_interval: int = 64
    ngram_prior_observations: float = 2.0  # weight of the all-sizes acceptance in a new size's (or depth's) estimate
    # Lookup positions 2 .. ngram_depths each get an acceptance (the last shared by every deeper
    # position); 0 (the default): one acceptance per match size for every position. Off by default:
    # on the tuning split it changed greedy by 1% and lost under sampling (see SpeculativeConfig).
    ngram_depths: int = 0
    # Ski rental for the draft's prefill (single rows with retrieval; batches): a cold draft is started only
    # once the rounds taken without it have lost, against a warm draft's expected rate, this many
    # times what its prefill costs. 0: no such wait (the expected-value rule alone decides).
    prefill_patience: float = 1.0
    # A single row's tree round with no retrieved node worth verifying starts a cold draft without that
    # wait when its prefill lowers the draft's expected rate over the tokens left by at most this share.
    small_prefill_share: float = 0.1
    ema_weight: float = 0.2  # weight of the newest round in running estimates
    outlier_factor: float = 2.0  # a round's time counts as at most this many times the estimate's
    calibration_bins: int = 10  # draft-confidence bins for the calibration of P(accept | confidence)
    calibration_prior: float = 2.0  # pseudo-observations per bin at acceptance = bin centre

    def __post_init__(self) -> None:
        if self.max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
        for name in ("draft_cost", "verify_cost", "verify_knee_cost"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.verify_curve is not None:
            check_verify_curve(self.verify_curve)
        if self.ngram_depths < 0:
            raise ValueError(f"ngram_depths must be >= 0, got {self.ngram_depths}")
        if not self.outlier_factor > 1:
            raise ValueError(f"outlier_factor must be > 1, got {self.outlier_factor}")
        if self.verify_knee < 1:
            raise ValueError(f"verify_knee must be >= 1, got {self.verify_knee}")
        if self.probe_interval < 1 or self.max_probe_interval < self.probe_interval or self.probe_backoff < 1:
            raise ValueError(
                "need 1 <= probe_interval <= max_probe_interval and probe_backoff >= 1, got "
                f"{self.probe_interval}, {self.max_probe_interval} and {self.probe_backoff}"
            )


@dataclass
class PolicyState:
    """What the cost model has measured so far in this generate call."""

    target_warm: bool = False  # the target's prompt encoding (first round) is behind us
    draft_warm: bool = False  # the draft's prompt encoding is behind us
    # c as measured: each draft step's time over the target's one-token step time at that moment, so
    # that c stays right when rows leave the batch (both steps get cheaper) or while no draft runs.
    draft_cost_ratio: float | None = None
    # Exponentially weighted sums for the fit seconds = t1 * (1 + d * (width - 1)).
    fit_n: float = 0.0
    fit_x: float = 0.0  # width - 1
    fit_y: float = 0.0  # seconds
    fit_xx: float = 0.0
    fit_xy: float = 0.0
    # ... and for the knee feature z = max(0, width - verify_knee): seconds = t1 (1 + d x + e z).
    fit_z: float = 0.0
    fit_zz: float = 0.0
    fit_xz: float = 0.0
    fit_zy: float = 0.0
    first_acceptance: float = 0.7  # running acceptance of draft position 1 (optimistic: try drafting)
    token_acceptance: float = 0.7  # running acceptance of any reached draft position
    ngram_acceptance: float = 0.8  # running per-token acceptance of n-gram proposals (optimistic), all sizes
    # The acceptance per size n of the match a proposal follows (1-gram matches are weaker clues than
    # 3-gram ones): of every position, or with `ngram_depths` of the first token only; a size not seen
    # yet starts from `ngram_acceptance`.
    ngram_acceptance_by_size: dict[int, float] = field(default_factory=dict)
    ngram_seen_by_size: dict[int, int] = field(default_factory=dict)  # positions observed per size
    # With `ngram_depths`, deeper positions, all sizes: P(token j accepted | tokens 1..j-1 were), per
    # depth j >= 2 (the last bucket holds every depth from it on). A copy that has started tends to
    # go on: on the real pair 0.48 at position 1 against 0.55 / 0.83 / 0.6-0.9 at 2 / 3 / 4-8
    # (summarization, T = 0.7).
    ngram_acceptance_by_depth: dict[int, float] = field(default_factory=dict)
    ngram_seen_by_depth: dict[int, int] = field(default_factory=dict)
    draft_rate: float | None = None  # running tokens per unit cost of draft-model rounds
    retrieval_wins: float = 0.0  # rounds in which retrieval's best tree beat the warm draft's expected rate
    retrieval_rounds: float = 0.0  # rounds in which that was compared
    cold_regret: float = 0.0  # target steps lost, against a warm draft, by rounds taken while the draft was cold
    # Per verify width (single rows): the running mean of its rounds' target seconds, and how many
    # rounds of that width were timed (`PolicySettings.price_by_width`).
    width_seconds: dict[int, float] = field(default_factory=dict)
    width_seen: dict[int, int] = field(default_factory=dict)
    plain_streak: int = 0
    # The first round's (the prompt's encoding) target seconds and columns, and the verify cost d0
    # measured from it and the first one-token step (None until then, or when it could not be).
    prefill_seconds: float = 0.0
    prefill_columns: int = 0
    measured_verify_cost: float | None = None
    costs_seen: bool = False  # a round after the prompt's encoding has been timed
    probe_wait: int = 0  # rounds without the draft before the next probe (0: probe_interval; backoff raises it)
    probing: bool = False  # the draft was asked for as a probe and has not been observed yet
    calib_accepted: list[float] = field(default_factory=list)
    calib_reached: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class CostEstimates:
    """The cost model's estimates at the end of a generate call, in target steps (see the module
    docstring): what decided whether and how far each round drafted. A drafted token pays for
    itself only when its chance of acceptance beats `draft_cost + verify_cost`."""

    draft_cost: float  # c: one draft forward
    verify_cost: float  # d: one more token in the verifying forward
    verify_knee_cost: float  # e: what each verify token past the knee adds on top of d
    measured_verify_cost: float | None  # d0, from the prompt's encoding and one step (None: not measured)
    first_acceptance: float  # running acceptance of the first draft token
    drafting_pays: bool  # first_acceptance > draft_cost + verify_cost at the end of the call
    draft_cost_pinned: bool  # c was given (draft_cost=), not measured
    verify_cost_pinned: bool  # d was given (verify_cost=), not measured

    def describe(self) -> str:
        """One line for a person: the costs and whether a drafted token pays on this machine."""
        how = lambda pinned: "pinned" if pinned else "measured"  # noqa: E731
        line = (f"draft step c = {self.draft_cost:.2f} ({how(self.draft_cost_pinned)}), verify d = "
                f"{self.verify_cost:.2f} a token ({how(self.verify_cost_pinned)}): "
                f"a drafted token pays when accepted more often than c + d = {self.draft_cost + self.verify_cost:.2f}"
                f" (first-token acceptance {self.first_acceptance:.2f})")
        if self.verify_cost >= SLOW_VERIFY:
            line += (f"; here one more token in a forward costs {self.verify_cost:.2f} of a step, so little can pay: "
                     "speculation needs a forward bound by reading the weights (a GPU, a CPU with bf16 "
                     "instructions such as AVX-512 BF16 or AMX for a bf16 model, or on other CPUs a float32 "
                     "target packed for oneDNN: hf_specdec.pack_linears, CLI --pack)")
        return line


# A verify cost d at or above this (in target steps per token) means the machine computes a forward
# over k tokens at several steps' cost: speculation is then near break-even at best.
SLOW_VERIFY = 0.3


def check_verify_curve(curve) -> None:
    """A pinned verify curve: a non-empty sequence of finite prices >= 0, the first (one token) > 0."""
    try:
        values = [float(v) for v in curve]
    except (TypeError, ValueError):
        raise ValueError(f"verify_curve must be a sequence of numbers (target steps per width), got {curve!r}") from None
    if not values or not all(math.isfinite(v) and v >= 0 for v in values) or not values[0] > 0:
        raise ValueError(f"verify_curve needs prices >= 0 per width, the first (one token) > 0, got {curve!r}")


def curve_pricer(curve: tuple[float, ...]) -> Callable[[int], float]:
    """width -> price from a pinned curve (entry i: width i + 1), wider widths on its last segment."""
    slope = max(0.0, curve[-1] - curve[-2]) if len(curve) > 1 else 0.0
    return lambda width: curve[width - 1] if width <= len(curve) else curve[-1] + slope * (width - len(curve))


def curve_slopes(curve: tuple[float, ...], knee: int) -> tuple[float, float]:
    """(d, e) of a pinned curve, as the line would have them: d the least-squares slope of price
    against width up to the knee over the price of one token, e the slope past it less d."""
    step, xs = curve[0], list(range(min(len(curve), knee)))
    if len(xs) < 2:
        return 0.0, 0.0
    ys = [curve[x] for x in xs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    d = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs) / step)
    e = 0.0
    if len(curve) > knee:
        e = max(0.0, (curve[-1] - curve[knee - 1]) / (len(curve) - knee) / step - d)
    return d, e


class DraftPolicy:
    """Online cost model for one generate call (see the module docstring)."""

    def __init__(self, settings: PolicySettings | None = None, state: PolicyState | None = None):
        self.settings = settings or PolicySettings()
        self.state = state or PolicyState()
        if not self.state.calib_reached:
            n, prior = self.settings.calibration_bins, self.settings.calibration_prior
            self.state.calib_accepted = [prior * (i + 0.5) / n for i in range(n)]
            self.state.calib_reached = [prior] * n

    def set_rows(self, rows: int) -> None:
        """The batch now has `rows` rows (continuous batching): the verify-cost prior scales with it."""
        if rows != self.settings.rows:
            self.settings = replace(self.settings, rows=rows)

    # ------------------------------------------------------------ costs

    def _fit(self) -> tuple[float, float] | None:
        """(t1, d) from the weighted least-squares line through (width - 1, seconds), or None while
        the widths seen are too alike to separate slope from intercept."""
        s = self.state
        if s.fit_n <= 0:
            return None
        mx, my = s.fit_x / s.fit_n, s.fit_y / s.fit_n
        var = s.fit_xx / s.fit_n - mx * mx
        if var < 0.25:  # widths within about +-0.5 of each other
            return None
        slope = (s.fit_xy / s.fit_n - mx * my) / var
        t1 = my - slope * mx
        if t1 <= 0:
            return None
        return t1, min(1.0, max(0.0, slope / t1))

    def _knee_fit(self) -> tuple[float, float, float] | None:
        """(t1, d, e) from the weighted least-squares plane through (width - 1, knee excess, seconds),
        or None until widths on both sides of the knee separate the two slopes."""
        s = self.state
        if s.fit_n <= 0:
            return None
        n = s.fit_n
        mx, mz, my = s.fit_x / n, s.fit_z / n, s.fit_y / n
        vxx, vzz, vxz = s.fit_xx / n - mx * mx, s.fit_zz / n - mz * mz, s.fit_xz / n - mx * mz
        vxy, vzy = s.fit_xy / n - mx * my, s.fit_zy / n - mz * my
        det = vxx * vzz - vxz * vxz
        # z's spread left over after x explains what it can (det / vxx), in tokens squared
        if vxx < 0.25 or det < 0.25 * vxx:
            return None
        bx, bz = (vxy * vzz - vzy * vxz) / det, (vzy * vxx - vxy * vxz) / det
        t1 = my - bx * mx - bz * mz
        if t1 <= 0:
            return None
        return t1, min(1.0, max(0.0, bx / t1)), min(1.0, max(0.0, bz / t1))

    @property
    def knee_cost(self) -> float:
        """e: what each verify token past the knee costs on top of d, in target steps (0 in a batch)."""
        if self.settings.rows > 1:
            return 0.0
        if self.settings.verify_knee_cost is not None:
            return self.settings.verify_knee_cost
        if self.settings.verify_curve is not None:
            return curve_slopes(self.settings.verify_curve, self.settings.verify_knee)[1]
        if self.settings.verify_cost is not None:  # d pinned: the curve reads no clock either (e = prior)
            return self.settings.prior_verify_knee_cost
        fit = self._knee_fit()
        return self.settings.prior_verify_knee_cost if fit is None else fit[2]

    def verify_pricer(self) -> Callable[[int], float]:
        """width -> one verifying forward over `width` tokens (the pending one included), in target
        steps, with d and e read once (the fits are not recomputed inside loops over widths). Single
        rows with `price_by_width`: the pinned curve, or each width timed often enough at its own
        measured price and the line for the others; otherwise the line 1 + d (w - 1) + e (w - knee)+."""
        d, e, knee = self.verify_cost, self.knee_cost, self.settings.verify_knee
        line = lambda width: 1.0 + d * (width - 1) + e * max(0, width - knee)  # noqa: E731
        settings = self.settings
        if settings.rows > 1 or not settings.price_by_width:
            return line
        if settings.verify_curve is not None:
            return curve_pricer(settings.verify_curve)
        if settings.verify_cost is not None:  # d pinned: pinned runs read no clock
            return line
        measured = self.width_prices()
        return (lambda width: measured.get(width, line(width))) if measured else line

    def width_prices(self) -> dict[int, float]:
        """Verify widths timed in at least `width_observations` rounds: their running mean time over
        the target's step (the fit's intercept), in target steps."""
        step, s = self.target_step_seconds, self.state
        if not step:
            return {}
        return {w: seconds / step for w, seconds in s.width_seconds.items()
                if s.width_seen.get(w, 0) >= self.settings.width_observations}

    @property
    def plain_rate(self) -> float:
        """Tokens per unit of cost of a plain step (1 unless one-token forwards are priced otherwise)."""
        return 1.0 / max(1e-9, self.verify_width_cost(1))

    def verify_width_cost(self, width: int) -> float:
        """One verifying forward over `width` tokens, in target steps (`verify_pricer`)."""
        return self.verify_pricer()(width)

    @property
    def verify_cost(self) -> float:
        """d: one more token in the verifying forward, in units of one target step."""
        if self.settings.verify_cost is not None:
            return self.settings.verify_cost
        if self.settings.verify_curve is not None:
            return curve_slopes(self.settings.verify_curve, self.settings.verify_knee)[0]
        if self.settings.rows == 1 and self.settings.verify_knee_cost is None:
            knee = self._knee_fit()
            if knee is not None:
                return knee[1]
        fit = self._fit()
        if fit is not None:
            return fit[1]
        measured = self.state.measured_verify_cost
        return min(1.0, self.settings.prior_verify_cost * self.settings.rows if measured is None else measured)

    @property
    def target_step_seconds(self) -> float | None:
        """The target's one-token step time, from the fit (or from the mean time at the mean width)."""
        s = self.state
        if s.fit_n <= 0:
            return None
        fit = self._knee_fit() if self.settings.rows == 1 else None
        fit = fit or self._fit()
        if fit is not None:
            return fit[0]
        return (s.fit_y / s.fit_n) / (1 + self.verify_cost * (s.fit_x / s.fit_n))

    @property
    def cost(self) -> float:
        """c: one draft forward in units of one target step."""
        if self.settings.draft_cost is not None:
            return self.settings.draft_cost
        ratio = self.state.draft_cost_ratio
        return self.settings.prior_draft_cost if ratio is None else ratio

    @property
    def measuring_costs(self) -> bool:
        """True while the round should be a plain step because the target's costs are still being
        measured (the prompt's encoding and one step, when d is not pinned and decisions are adaptive)."""
        return self.settings.adaptive and not self._verify_pinned and not self.state.costs_seen

    @property
    def _verify_pinned(self) -> bool:
        return self.settings.verify_cost is not None or self.settings.verify_curve is not None

    @property
    def measures_time(self) -> bool:
        """Whether decisions read wall time (then the loop must time rounds accurately)."""
        return self.settings.draft_cost is None or not self._verify_pinned

    def observe_timing(
        self, draft_seconds: float, draft_forwards: int, target_seconds: float, width: int, catchup_seconds: float = 0.0,
        columns: int | None = None,
    ) -> None:
        """One round's wall times; `width` tokens went through the verifying forward. A round in which
        either model encoded the prompt (its first forward) is not a step and is skipped.
        `catchup_seconds`: the part of `draft_seconds` spent in a first draft forward that fed the
        draft more than two columns it had not seen (after plain or lookup rounds; in a batch that is
        that many tokens per row); it is not a draft step and is left out of c. `columns`: the columns
        the target's forward took in (the whole prompt in the first round; default `width`)."""
        s = self.state
        if not s.target_warm:
            s.prefill_seconds, s.prefill_columns = target_seconds, columns or width
        if not s.target_warm or (draft_forwards > 0 and not s.draft_warm):
            s.target_warm, s.draft_warm = True, s.draft_warm or draft_forwards > 0
            return
        if not s.costs_seen:
            s.costs_seen = True
            # d0, as the docstring says; from 8 columns on (a shorter prompt's time is mostly overhead and
            # noise, divided by few columns: the fixed prior stands, as before)
            if width == 1 and s.prefill_columns >= 8 and target_seconds > 0:
                d0 = (s.prefill_seconds / target_seconds - 1) / (s.prefill_columns - 1)
                s.measured_verify_cost = min(1.0, max(0.0, d0))
        w = self.settings.ema_weight
        # A shared machine stalls now and then (another process, a collection): a round slower than
        # `outlier_factor` times what the estimates predict counts as that factor, so one stall moves
        # the estimates a little and a lasting slowdown still moves them within a few rounds.
        cap = self.settings.outlier_factor
        step_now = self.target_step_seconds
        if step_now:
            target_seconds = min(target_seconds, cap * step_now * self.verify_width_cost(width))
        x, y = width - 1, target_seconds
        decay = 1 - w / 2  # remember about the last 2 / w rounds
        s.fit_n = decay * s.fit_n + 1
        s.fit_x = decay * s.fit_x + x
        s.fit_y = decay * s.fit_y + y
        s.fit_xx = decay * s.fit_xx + x * x
        s.fit_xy = decay * s.fit_xy + x * y
        z = max(0, width - self.settings.verify_knee)
        s.fit_z = decay * s.fit_z + z
        s.fit_zz = decay * s.fit_zz + z * z
        s.fit_xz = decay * s.fit_xz + x * z
        s.fit_zy = decay * s.fit_zy + z * y
        if self.settings.rows == 1:  # this width's own price (`price_by_width`): a running mean, then the EMA
            seen = s.width_seen.get(width, 0)
            s.width_seconds[width] = _ema(s.width_seconds.get(width, y), y, max(w, 1 / (seen + 1)))
            s.width_seen[width] = seen + 1
        steps = draft_forwards - (1 if catchup_seconds > 0 else 0)
        if steps > 0:
            # the fit was updated above, so the target's step time is known here
            ratio = max(0.0, draft_seconds - catchup_seconds) / steps / self.target_step_seconds
            if s.draft_cost_ratio is None:
                s.draft_cost_ratio = ratio
            else:
                s.draft_cost_ratio = _ema(s.draft_cost_ratio, min(ratio, cap * s.draft_cost_ratio), w)

    # ------------------------------------------------------------ the round plan

    def ngram_acceptance_for(self, size: int | None) -> float:
        """Running acceptance of proposals that follow an n-gram match of `size` tokens (of their first
        token only, with `ngram_depths`)."""
        if not size:
            return self.state.ngram_acceptance
        known = self.state.ngram_acceptance_by_size
        return known[size] if size in known else self._size_prior(size)

    def _size_prior(self, size: int) -> float:
        """Where a match size's estimate starts: the nearest shorter size's estimate (a longer match is
        no weaker a clue), at least the all-sizes value."""
        known = self.state.ngram_acceptance_by_size
        shorter = max((k for k in known if k < size), default=None)
        return max(self.state.ngram_acceptance, known[shorter]) if shorter is not None else self.state.ngram_acceptance

    def ngram_acceptance_at(self, size: int | None, depth: int) -> float:
        """P(lookup token `depth` (1-based) is accepted | the ones before it were), for a match of `size`."""
        if depth <= 1 or not self.settings.ngram_depths:
            return self.ngram_acceptance_for(size)
        bucket = min(depth, self.settings.ngram_depths)
        return self.state.ngram_acceptance_by_depth.get(bucket, self.state.ngram_acceptance)

    def ngram_curve(self, size: int | None, length: int) -> list[float]:
        """`ngram_acceptance_at` for depths 1 .. length (at least 1)."""
        return [self.ngram_acceptance_at(size, depth) for depth in range(1, max(1, length) + 1)]

    def _observe_ngram(self, size: int | None, accepted: float, depth: int = 1) -> None:
        """One lookup position reached (accepted 1.0 or 0.0) at `depth` (1: the first token after the
        match). The match size's estimate learns from every position, or with `ngram_depths` from the
        first only, deeper ones updating their depth's. Each such estimate starts from a prior weighted
        as `ngram_prior_observations` observations (a size's `_size_prior`, a depth's the all-positions
        value): a running mean at first (a size that fails is dropped within a few rounds), the moving
        average later."""
        s, w = self.state, self.settings.ema_weight / 2
        s.ngram_acceptance = _ema(s.ngram_acceptance, accepted, w)
        if depth > 1 and self.settings.ngram_depths:
            estimates, seen_by, key = s.ngram_acceptance_by_depth, s.ngram_seen_by_depth, min(depth, self.settings.ngram_depths)
        elif size:
            estimates, seen_by, key = s.ngram_acceptance_by_size, s.ngram_seen_by_size, size
        else:
            return
        seen = seen_by.get(key, 0)
        weight = max(w, 1 / (seen + 1 + self.settings.ngram_prior_observations))
        if key not in estimates:  # a new size or depth starts from its prior
            estimates[key] = s.ngram_acceptance if estimates is s.ngram_acceptance_by_depth else self._size_prior(key)
        estimates[key] = _ema(estimates[key], accepted, weight)
        seen_by[key] = seen + 1

    def ngram_length(self, available: int, rows: int = 1, size: int | None = None) -> tuple[int, float]:
        """(L, rate): the n-gram proposal length maximising expected tokens per cost, and that rate,
        for a match of `size` tokens (each position at its own acceptance, `ngram_acceptance_at`). In a
        batch of `rows`, one row's lookup widens the verify forward for every row: each column is
        priced at d x rows against that row's gain (the batch's plain rate is rows tokens a step)."""
        d = self.verify_cost * rows
        price = self.verify_pricer() if rows == 1 else (lambda width: 1 + (width - 1) * d)
        best, best_rate, tokens, p = 0, 1.0 / price(1), 1.0, 1.0
        for length, g in enumerate(self.ngram_curve(size, available), start=1):
            p *= g
            tokens += p
            rate = tokens / price(length + 1)
            if rate > best_rate:
                best, best_rate = length, rate
        return best, best_rate

    def prefill_cost(self, tokens: int) -> float:
        """P: the draft encoding `tokens` tokens, in target steps: `draft_prefill_cost` per token if
        pinned, else rho times what one token of the prompt's encoding cost the target
        (`encoding_cost`)."""
        per_token = self.settings.draft_prefill_cost
        if per_token is None:
            per_token = self.settings.prefill_ratio * self.encoding_cost
        return per_token * tokens

    @property
    def encoding_cost(self) -> float:
        """The target's encoding of one prompt token, in target steps: the prompt's encoding time over
        its columns and the step, once a step has been timed (from 8 columns: a shorter prompt's time is
        mostly overhead), else d. A forward bound by reading the weights encodes a token for about d;
        one bound by compute does not (the packed 1.5B target on a 2-core AVX-512 EPYC: d 0.00-0.01 on
        its verify curve, a prompt token 0.036 steps), so d priced the draft's prefill at almost
        nothing there. A cost model that reads no clock (costs pinned) keeps d: pin
        `draft_prefill_cost` with the others."""
        s, step = self.state, self.target_step_seconds if self.measures_time else None
        if step and s.prefill_columns >= 8 and s.prefill_seconds > 0:
            return s.prefill_seconds / s.prefill_columns / step
        return self.verify_cost

    @property
    def retrieval_share(self) -> float:
        """The share of rounds in which retrieval beats a warm draft (`note_retrieval`), shrunk toward 0."""
        s = self.state
        return s.retrieval_wins / (s.retrieval_rounds + self.settings.retrieval_prior_rounds)

    def note_retrieval(self, wins: bool) -> None:
        """One round's comparison: retrieval's best tree against the draft's expected rate, the draft's
        prefill left out (whether retrieval would take this round from a draft already warm)."""
        self.state.retrieval_rounds += 1
        self.state.retrieval_wins += float(wins)

    def observe_cold_round(self, width: int, emitted: int) -> None:
        """A round taken while the draft was cold: `width` tokens verified, `emitted` emitted. It lost
        what it cost beyond what a warm draft would have spent on the same tokens."""
        self.state.cold_regret += max(0.0, self.verify_width_cost(width) - emitted / self.expected_draft_rate())

    def prefill_earned(self, prefill: int) -> bool:
        """Whether the rounds without the draft have lost enough to pay for its prefill (ski rental:
        never more than twice the best choice in hindsight, whatever retrieval does next)."""
        if not self.settings.adaptive or not prefill:
            return True
        return self.state.cold_regret >= self.settings.prefill_patience * self.prefill_cost(prefill)

    def prefill_is_small(self, prefill: int, remaining: int) -> bool:
        """Whether the draft's prefill lowers its expected rate over the `remaining` tokens by at most
        `small_prefill_share` (a short prompt: on the real pair 3-8% for 40-150-token prompts and 64 new
        tokens; a long prompt's 256-token window about 15%). Hedging such a prefill by the ski-rental
        wait costs about as much as the prefill itself (the wait ends when the rounds without the draft
        have lost that much) and, in traced qa / math / mt_bench prompts, 3-7 plain rounds at the start."""
        if not prefill:
            return True
        return self.expected_draft_rate(prefill, remaining) >= (1 - self.settings.small_prefill_share) * self.expected_draft_rate()

    def expected_draft_rate(self, prefill: int = 0, remaining: int | None = None) -> float:
        """Expected tokens per unit of cost of draft-model rounds; with `prefill` tokens still to
        encode in the draft, spread over the tokens the draft is expected to draft: the `remaining`
        ones times the share of rounds retrieval would not take (`retrieval_share`)."""
        rate = self.state.draft_rate
        if rate is None:
            rate = (1 + self.state.first_acceptance) / (self.cost + self.verify_width_cost(2))
        if prefill and remaining:
            drafted = remaining * (1 - self.retrieval_share)
            rate = drafted / (drafted / rate + self.prefill_cost(prefill))
        return rate

    def should_draft(self, prefill: int = 0, remaining: int | None = None) -> bool:
        """Draft this round, or take a plain target step (adaptive fallback with periodic probes).
        A draft whose prefill would not pay over the `remaining` tokens is not started."""
        if not self.settings.adaptive:
            return True
        if prefill and remaining and self.expected_draft_rate(prefill, remaining) <= self.plain_rate:
            return False
        if self.drafting_pays():
            return True
        if self.state.plain_streak >= (self.state.probe_wait or self.settings.probe_interval):
            self.state.probing = True
            return True
        return False

    def drafting_pays(self) -> bool:
        """Whether the first draft token is expected to pay for itself (acceptance > c + d)."""
        return self.state.first_acceptance > self.cost + self.verify_cost

    def estimates(self) -> CostEstimates:
        """The estimates as they stand (for the output and for people; decisions read the properties)."""
        return CostEstimates(
            draft_cost=self.cost, verify_cost=self.verify_cost, verify_knee_cost=self.knee_cost,
            measured_verify_cost=self.state.measured_verify_cost, first_acceptance=self.state.first_acceptance,
            drafting_pays=self.drafting_pays(),
            draft_cost_pinned=self.settings.draft_cost is not None, verify_cost_pinned=self._verify_pinned,
        )

    def plan(
        self, ngram_available: int, prefill: int = 0, remaining: int | None = None, ngram_size: int | None = None
    ) -> tuple[str, int]:
        """(source, length) for this round: NGRAM with L tokens, DRAFT (length decided while
        drafting, at most max_draft_tokens), or NONE (a plain step). `prefill`, `remaining`: as for
        `expected_draft_rate`; `ngram_size`: the size of the match the lookup follows."""
        draft = self.should_draft(prefill, remaining)
        if ngram_available:
            length, rate = self.ngram_length(ngram_available, size=ngram_size)
            if length and (not draft or rate >= self.expected_draft_rate(prefill, remaining)):
                return NGRAM, length
        return (DRAFT, self.settings.max_draft_tokens) if draft else (NONE, 0)

    def select_nodes(self, reach: list[float], fixed: list[int], draft_forwards: int, max_nodes: int) -> list[int]:
        """Tree nodes to verify: the `fixed` ones (the draft chain, already drafted), then the other
        nodes best first (by estimated acceptance r, `reach`, non-increasing from parent to child, so
        parents come before children), as many as maximise the round's expected tokens per unit of
        cost. On a price line (convex: d a node, plus e past the knee) that is every node that pays
        for itself in turn, r * C > d' * E with E tokens for cost C so far; with measured per-width
        prices (`price_by_width`) a dearer width may be crossed to reach a cheaper one."""
        price, chosen = self.verify_pricer(), list(fixed)
        tokens = 1.0 + sum(reach[j] for j in fixed)
        base = draft_forwards * self.cost
        best_rate, best = tokens / (base + price(1 + len(chosen))), len(chosen)
        fixed_set = set(fixed)
        for j in sorted((j for j in range(len(reach)) if j not in fixed_set), key=lambda j: (-reach[j], j)):
            if len(chosen) >= max_nodes or reach[j] <= 0:
                break
            chosen.append(j)
            tokens += reach[j]
            rate = tokens / (base + price(1 + len(chosen)))
            if rate > best_rate:
                best_rate, best = rate, len(chosen)
        return sorted(chosen[:best])

    def tree_rate(self, reach: list[float], nodes: list[int], draft_forwards: int = 0) -> float:
        """Expected tokens per unit of cost of verifying `nodes`."""
        return (1.0 + sum(reach[j] for j in nodes)) / (draft_forwards * self.cost + self.verify_width_cost(1 + len(nodes)))

    # ------------------------------------------------------------ while drafting

    def calibrated(self, confidence: float) -> float:
        """P(target accepts a draft token | the draft gave it probability `confidence`)."""
        b = min(int(confidence * self.settings.calibration_bins), self.settings.calibration_bins - 1)
        return self.state.calib_accepted[b] / self.state.calib_reached[b]

    def stop_rule(self, rows: int, max_tokens: int | None = None) -> Callable[[list[float]], bool] | None:
        """A fresh `keep_drafting(confidences)` for one round of `rows` rows: after each drafted token
        (given, per row, the draft's probability of it), whether to draft another, for the batch as a
        whole (tokens summed over rows, per unit of the batch's cost), looking no further than
        `max_tokens` drafted tokens (default max_draft_tokens). None when not adaptive (draft
        max_draft_tokens)."""
        if not self.settings.adaptive:
            return None
        p_all, expected, drafted = [1.0] * rows, [1.0] * rows, [0]
        step = max(self.cost + self.verify_cost, 1e-9)  # free drafts (c = d = 0): keep drafting
        price, c = self.verify_pricer(), self.cost
        most = min(self.settings.max_draft_tokens, max_tokens or self.settings.max_draft_tokens)

        def keep_drafting(confidences: list[float]) -> bool:
            drafted[0] += 1
            j = drafted[0]
            for r, conf in enumerate(confidences):
                p_all[r] *= self.calibrated(conf)
                expected[r] += p_all[r]
            if rows == 1:
                # Draft on while stopping at some later length j' (its tokens each accepted with the
                # running per-token acceptance) beats stopping now, the round costing j c + price(j + 1).
                # On a price line that is the next token paying for itself (below); with measured
                # per-width prices a dear width may be crossed to reach a cheaper one.
                a, now = self.state.token_acceptance, expected[0] / (j * c + price(j + 1))
                gain, p = 0.0, p_all[0]
                for later in range(j + 1, most + 1):
                    p *= a
                    gain += p
                    if (expected[0] + gain) / (later * c + price(later + 1)) > now:
                        return True
                return False
            # The batch pays one draft forward and one verify column for every row: one more token
            # is drafted when the rows' summed expected gain beats the batch's rate so far.
            return sum(p_all) * self.state.token_acceptance / step > sum(expected) / (1 + j * step)

        return keep_drafting

    # ------------------------------------------------------------ after verification

    def observe_round(
        self,
        source: str,
        num_drafted: int,
        num_accepted: list[int],  # per row
        confidences: list[list[float]] | None = None,  # per row, per drafted position (DRAFT rounds)
        match_sizes: list[int] | None = None,  # per row, the n-gram match size (NGRAM rounds)
        first_hits: list[bool] | None = None,  # per row, whether the draft's first forward was accepted (default: n > 0)
        rate: float | None = None,  # the round's tokens per unit cost (default: (n + 1) / (k c + price(k + 1)))
    ) -> None:
        """One round: the draft model's estimates from a DRAFT round (first-token and per-token
        acceptance, calibration, the rate of draft rounds, the probe backoff), the lookup's from an
        NGRAM round; any other source (a user's drafter, a transformers candidate generator) counts as
        the draft model. Every round without the draft model (NONE or NGRAM) counts toward the next
        probe: a lookup that keeps finding matches must not keep a draft with one bad start off for
        good. Tree rounds (one row) pass `first_hits` (the walk's first node came from the draft's first
        forward: its token, or the runner-up beside it) and `rate` (the tree's emitted tokens for its
        cost, for that one row)."""
        s = self.state
        if source in (NONE, NGRAM):
            s.plain_streak += 1
            if source == NGRAM:
                for r, n in enumerate(num_accepted):
                    self.observe_lookup(num_drafted, n, None if match_sizes is None else match_sizes[r])
            return
        s.plain_streak = 0
        # The running estimates move as much per round whatever the batch: each of a round's rows
        # counts 1 / rows (at weight w per row, one bad batch-8 round would move them like eight).
        w = self.settings.ema_weight / max(1, len(num_accepted))
        bins = self.settings.calibration_bins
        hits = [n > 0 for n in num_accepted] if first_hits is None else first_hits
        if rate is None:  # k draft steps and a verify forward over k + 1 tokens at its price (`verify_pricer`)
            round_cost = num_drafted * self.cost + self.verify_width_cost(num_drafted + 1)
        for r, n in enumerate(num_accepted):
            reached = min(n + 1, num_drafted)
            for i in range(reached):
                accepted = float(i < n)
                s.token_acceptance = _ema(s.token_acceptance, accepted, w / 2)
                if i == 0:
                    s.first_acceptance = _ema(s.first_acceptance, float(hits[r]), w)
                if confidences is not None:
                    b = min(int(confidences[r][i] * bins), bins - 1)
                    s.calib_accepted[b] += accepted
                    s.calib_reached[b] += 1
            row_rate = (n + 1) / round_cost if rate is None else rate
            s.draft_rate = row_rate if s.draft_rate is None else _ema(s.draft_rate, row_rate, w)
        # probe backoff: a failed probe doubles the wait, a draft that pays resets it
        wait = s.probe_wait or self.settings.probe_interval
        first = sum(hits) / max(1, len(hits))  # this round's first-token acceptance
        if self.drafting_pays() or first > self.cost + self.verify_cost:
            s.probe_wait = 0
        elif s.probing:
            s.probe_wait = min(self.settings.max_probe_interval, math.ceil(wait * self.settings.probe_backoff))
        s.probing = False

    def observe_lookup(self, num_drafted: int, num_accepted: int, size: int | None) -> None:
        """One row's n-gram proposal of `num_drafted` tokens, `num_accepted` of them accepted, after a
        match of `size` tokens: its acceptance per size (and depth). Unlike `observe_round`, it leaves
        the count of rounds without the draft model alone (a batch's lookup rows are not draft probes)."""
        for i in range(min(num_accepted + 1, num_drafted)):
            self._observe_ngram(size, float(i < num_accepted), depth=i + 1)

    def observe_unverified(self, proposed: list[int], emitted: list[int], size: int | None) -> None:
        """A lookup the round did not verify, scored against the tokens the round emitted: position i
        counts as accepted when it equals the emitted token there, up to the first that does not. Each
        emitted token is distributed as p given the tokens before it (the output is exact), so the
        chance that it equals a proposed x is p(x): what verifying x would have accepted it with. The
        estimate is unbiased, and free: no forward is spent on it."""
        for depth, (mine, actual) in enumerate(zip(proposed, emitted), start=1):
            self._observe_ngram(size, float(mine == actual), depth)
            if mine != actual:
                break

    def observe_tree(
        self,
        chain: int,  # draft-model nodes in the tree (its first nodes, one chain)
        chain_accepted: int,  # how many of them were accepted
        confidences: list[float] | None,  # the draft's probability of each chain node
        # per node the walk reached that had retrieved children: (the depth of those children, 1 for the
        # root's; whether one of them was accepted), as `Tree.retrieval_events` gives them
        retrieval: list[tuple[int, bool]],
        match_size: int | None = None,  # the size of the n-gram match the retrieved branches follow
        first_hit: bool | None = None,  # the walk's first node came from the draft's first forward (default: chain_accepted > 0)
        emitted: int | None = None,  # tokens the round emitted (accepted path and the extra token)
        width: int | None = None,  # columns of the verifying forward (the pending token and every node)
    ) -> None:
        """A tree round: the draft chain is scored as a draft round, with the draft's first forward
        counted as accepted when the walk took its token or the runner-up beside it (a runner-up the
        target takes is a draft that paid, not one that failed), and the round's rate, for comparison
        with retrieval alone, from what the whole tree emitted for its cost; each retrieval event
        updates the per-token acceptance of retrievals. A tree without the draft counts toward the next probe."""
        if chain:
            rate = None
            if emitted is not None and width is not None:
                rate = emitted / (chain * self.cost + self.verify_width_cost(width))
            self.observe_round(DRAFT, chain, [chain_accepted], None if confidences is None else [confidences],
                               first_hits=None if first_hit is None else [first_hit], rate=rate)
        else:
            self.state.plain_streak += 1
        for depth, accepted in retrieval:
            self._observe_ngram(match_size, float(accepted), depth)
