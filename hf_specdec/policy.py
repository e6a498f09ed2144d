"""What to draft each round, chosen by a cost model fed with what this generate call has measured.

Units: one target forward over one new token costs 1. A draft forward costs `c` (the measured ratio
of draft to target step time); each extra token in the verifying forward adds `d` (the verify
token cost: verification is memory bound, so 8 tokens cost ~1.2 single steps on the CPU we measure
on, not 8). A round that drafts j tokens then costs 1 + j (c + d) and emits 1 + sum_i P_i tokens in
expectation, where P_i is the probability that draft tokens 1..i are all accepted.

Three decisions, each maximising expected tokens per unit of cost (Leviathan et al. 2023, sec. 3.4):

* stop drafting: after drafting token j, drafting token j + 1 adds P_j * a (a: the running per-token
  acceptance) tokens for c + d; it is drafted only if that beats the round's rate so far,
  (1 + sum_{i<=j} P_i) / (1 + j (c + d)). P_j is estimated from the draft's own confidence (its
  probability of the token it proposed), calibrated online against what the target accepted.
* fall back to plain decoding: a round drafts at all only if the first draft token pays for
  itself (first-position acceptance > c + d); otherwise it is a plain target step, and every
  `probe_interval` plain rounds one round drafts again to refresh the estimate.
* n-gram or draft model (hybrid): an n-gram proposal of length L costs 1 + L d (no draft forward)
  and emits 1 + sum_{i<=L} g^i, with g the running per-token acceptance of n-gram proposals
  (optimistic prior, so a match is tried); it is used when that rate is at least the draft model's
  recent rate. L itself is the length that maximises that rate.

None of this touches exactness: every decision depends only on the past and on the draft's own
proposals, and each drafted position is still verified by the rejection rule. The measured costs
come from wall time, so with `draft_cost=None` the draft lengths (and, under sampling, which random
numbers a seeded run consumes) depend on timing; pin `draft_cost` for runs that must repeat exactly.
Pure Python (no torch, no transformers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DRAFT, NGRAM, NONE = "draft", "ngram", "none"  # where a round's proposal came from


def _ema(old: float, new: float, weight: float) -> float:
    return (1 - weight) * old + weight * new


@dataclass
class DraftPolicy:
    """Online cost model for one generate call (see the module docstring).

    adaptive: choose draft lengths and fall back to plain rounds; False drafts `max_draft_tokens`
        every round (the cost model then only arbitrates between n-gram and draft proposals).
    draft_cost: pin the draft/target cost ratio instead of measuring it.
    """

    max_draft_tokens: int = 8
    adaptive: bool = True
    draft_cost: float | None = None
    verify_token_cost: float = 0.03  # extra cost per verified token; ~0.024 measured greedy on 2 CPU cores
    prior_draft_cost: float = 0.4
    probe_interval: int = 8  # plain rounds before drafting is tried again
    ema_weight: float = 0.2
    calibration_bins: int = 10
    calibration_prior: float = 2.0  # pseudo-observations per bin at acceptance = bin centre

    # --- measured state ---
    draft_step_seconds: float | None = None
    target_step_seconds: float | None = None
    first_acceptance: float = 0.7  # running acceptance of draft position 1 (optimistic: try drafting)
    token_acceptance: float = 0.7  # running acceptance of any reached draft position
    ngram_acceptance: float = 0.8  # running per-token acceptance of n-gram proposals (optimistic)
    draft_rate: float | None = None  # running tokens per unit cost of draft-model rounds
    plain_streak: int = 0
    calib_accepted: list[float] = field(default_factory=list)
    calib_reached: list[float] = field(default_factory=list)
    # within the current draft
    _p_all: list[float] = field(default_factory=list)
    _expected: list[float] = field(default_factory=list)
    _drafted: int = 0

    def __post_init__(self) -> None:
        if self.max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
        if self.draft_cost is not None and not self.draft_cost >= 0:
            raise ValueError(f"draft_cost must be >= 0, got {self.draft_cost}")
        n = self.calibration_bins
        self.calib_accepted = [self.calibration_prior * (i + 0.5) / n for i in range(n)]
        self.calib_reached = [self.calibration_prior] * n

    # ------------------------------------------------------------ costs

    @property
    def cost(self) -> float:
        """c: one draft forward in units of one target step."""
        if self.draft_cost is not None:
            return self.draft_cost
        if self.draft_step_seconds is None or not self.target_step_seconds:
            return self.prior_draft_cost
        return self.draft_step_seconds / self.target_step_seconds

    def observe_timing(self, draft_seconds: float, draft_forwards: int, target_seconds: float, width: int) -> None:
        """One round's wall times; `width` tokens went through the verifying forward. Call it only
        for rounds without a prefill (the first round encodes the whole prompt)."""
        if draft_forwards > 0:
            step = draft_seconds / draft_forwards
            self.draft_step_seconds = step if self.draft_step_seconds is None else _ema(self.draft_step_seconds, step, self.ema_weight)
        step = target_seconds / (1 + self.verify_token_cost * (width - 1))
        self.target_step_seconds = step if self.target_step_seconds is None else _ema(self.target_step_seconds, step, self.ema_weight)

    # ------------------------------------------------------------ the round plan

    def ngram_length(self, available: int) -> tuple[int, float]:
        """(L, rate): the n-gram proposal length maximising expected tokens per cost, and that rate."""
        g, d = self.ngram_acceptance, self.verify_token_cost
        best, best_rate, tokens, p = 0, 1.0, 1.0, 1.0
        for length in range(1, available + 1):
            p *= g
            tokens += p
            rate = tokens / (1 + length * d)
            if rate > best_rate:
                best, best_rate = length, rate
        return best, best_rate

    def expected_draft_rate(self) -> float:
        if self.draft_rate is not None:
            return self.draft_rate
        return (1 + self.first_acceptance) / (1 + self.cost + self.verify_token_cost)

    def should_draft(self) -> bool:
        """Draft this round, or take a plain target step (adaptive fallback with periodic probes)."""
        if not self.adaptive or self.first_acceptance > self.cost + self.verify_token_cost:
            return True
        return self.plain_streak >= self.probe_interval

    def plan(self, ngram_available: int) -> tuple[str, int]:
        """(source, length) for this round: NGRAM with L tokens, DRAFT (length decided while
        drafting, at most max_draft_tokens), or NONE (a plain step)."""
        draft = self.should_draft()
        if ngram_available:
            length, rate = self.ngram_length(ngram_available)
            if length and (not draft or rate >= self.expected_draft_rate()):
                return NGRAM, length
        return (DRAFT, self.max_draft_tokens) if draft else (NONE, 0)

    # ------------------------------------------------------------ while drafting

    def calibrated(self, confidence: float) -> float:
        """P(target accepts a draft token | the draft gave it probability `confidence`)."""
        b = min(int(confidence * self.calibration_bins), self.calibration_bins - 1)
        return self.calib_accepted[b] / self.calib_reached[b]

    def start_draft(self, rows: int) -> None:
        self._p_all, self._expected, self._drafted = [1.0] * rows, [1.0] * rows, 0

    def keep_drafting(self, confidences: list[float]) -> bool:
        """After one more drafted token per row (its draft probability): draft another one?"""
        self._drafted += 1
        j = self._drafted
        if j >= self.max_draft_tokens:
            return False
        if not self.adaptive:
            return True
        step = self.cost + self.verify_token_cost
        for r, conf in enumerate(confidences):
            self._p_all[r] *= self.calibrated(conf)
            self._expected[r] += self._p_all[r]
        return any(
            p * self.token_acceptance / step > expected / (1 + j * step)
            for p, expected in zip(self._p_all, self._expected)
        )

    # ------------------------------------------------------------ after verification

    def observe_round(
        self,
        source: str,
        num_drafted: int,
        num_accepted: list[int],  # per row
        confidences: list[list[float]] | None = None,  # per row, per drafted position (DRAFT rounds)
    ) -> None:
        if source == NONE:
            self.plain_streak += 1
            return
        self.plain_streak = 0
        w = self.ema_weight
        for r, n in enumerate(num_accepted):
            reached = min(n + 1, num_drafted)
            for i in range(reached):
                accepted = float(i < n)
                if source == NGRAM:
                    self.ngram_acceptance = _ema(self.ngram_acceptance, accepted, w / 2)
                    continue
                self.token_acceptance = _ema(self.token_acceptance, accepted, w / 2)
                if i == 0:
                    self.first_acceptance = _ema(self.first_acceptance, accepted, w)
                if confidences is not None:
                    b = min(int(confidences[r][i] * self.calibration_bins), self.calibration_bins - 1)
                    self.calib_accepted[b] += accepted
                    self.calib_reached[b] += 1
            if source == DRAFT:
                rate = (n + 1) / (1 + num_drafted * (self.cost + self.verify_token_cost))
                self.draft_rate = rate if self.draft_rate is None else _ema(self.draft_rate, rate, w)
