"""The round planner: what each round verifies, chosen by expected tokens per unit of cost.

Units: a target forward over one new token costs 1. Three parts (docs/design.md#the-planner):

* `CostCurve`: a target forward over w new tokens at the batch's row count, a draft step (c), the
  draft's encoding of a prompt token. Pinned (`Costs`; sampling one row on a CPU, positions past the
  lazy rule's first chunk priced by their reach), or measured online per tokens fed (rows x width): a
  count's running mean once timed `TIMED` times, a least-squares line through the means for the others,
  before that a slope d0 from the prompt's encoding and the first plain step (d0 near 1: no drafting).
* `Acceptance`: for the draft model, per depth the running P(token i accepted | the ones before it
  were), and its confidence calibrated against what the target accepted; per retrieval source
  (`MatchAcceptance`), per match size, from lookups verified and those scored against the output.
* `Planner`: one rule. Candidate nodes with their reach (P(the node and its ancestors are accepted))
  are taken best first and the prefix with the most expected tokens per unit of cost is kept
  (`best_nodes`: one row widens its forward by a column a node, a batch by its longest chain). The
  draft runs when its planned chain (`draft_length`; a cold draft also pays its prefill, spread over
  what it is expected to draft: `_cold`) beats retrieval; its tokens are kept by `stop_rule`, token
  j + 1 on what tokens 1..j said. Drafting that does not pay is retried after `PROBE` rounds (doubling).

Exactness does not depend on any of this: every decision is a function of the past rounds and of the draft's own
tokens before the one decided on, never of the uniforms that verify them. Seeded runs repeat with `costs=` pinned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .config import PREFILL_RATIO, Costs, check_planner
from .stats import NGRAM, CostEstimates

EMA = 0.2  # weight of the newest round in running estimates
TIMED = 3  # rounds of a width timed before its own mean prices it
OUTLIER = 2.0  # a round's time counts as at most this many times the curve's prediction
PRIOR_DRAFT_STEP = 0.4  # c before the first draft step is timed (a 3x smaller draft)
PRIOR_SLOPE = 0.03  # d per row before anything is timed: memory-bound verification
PRIOR_DRAFT, PRIOR_LOOKUP = 0.7, 0.8  # acceptance priors (optimistic, so each source is tried)
BINS, BIN_PRIOR = 10, 2.0  # confidence calibration: bins, pseudo-observations per bin
PROBE, MAX_PROBE = 8, 64  # rounds without the draft before it is tried again (doubling after a failed try)


def _ema(old: float, new: float, weight: float, scale: float = 1.0) -> float:  # old + weight (new - scale old)
    return (1 - weight * scale) * old + weight * new


class CostCurve:
    """Prices in target one-token steps at the current row count: pinned, or measured online, where a
    forward is timed by the tokens it feeds (rows x width), so what one row count taught prices another."""

    def __init__(self, pinned: Costs | None, rows: int = 1, lazy: bool = False):
        self.pinned, self.rows, self.lazy = pinned, rows, lazy  # lazy: one row's chain priced by its reach
        self.seconds: dict[int, float] = {}  # new tokens fed (rows x width) -> running mean seconds
        self.seen: dict[int, int] = {}
        self.draft_ratio: float | None = None  # c as timed: draft step over the target's step
        self.slope0: float | None = None  # d0, from the prompt's encoding and one step
        self.prompt: tuple[float, int] = (0.0, 0)  # the target's prompt encoding: seconds, columns
        self.rounds = 0  # rounds observed

    @property
    def measuring(self) -> bool:
        """True while the first two rounds (the prompt's encoding, one step) are timed for d0."""
        return self.pinned is None and self.slope0 is None and self.rounds < 2

    def _line(self) -> tuple[float, float] | None:
        """(a step's seconds, d) at the current row count: least squares through the means over tokens
        fed; one token count: the prior slope."""
        means, rows = self.seconds, self.rows
        if not means:
            return None
        prior = PRIOR_SLOPE * rows if self.slope0 is None else self.slope0
        if len(means) == 1:
            (x, s), = means.items()
            return s / (1 + prior * (x / rows - 1)), prior
        mx, my = sum(means) / len(means), sum(means.values()) / len(means)
        slope = sum((x - mx) * (s - my) for x, s in means.items()) / sum((x - mx) ** 2 for x in means)
        step = my - slope * (mx - rows)
        if step <= 0:
            return my / (1 + prior * (mx / rows - 1)), prior
        return step, min(1.0, max(0.0, slope * rows / step))

    def step_seconds(self) -> float | None:
        """A one-token forward's seconds: its own running mean once timed, else the line's intercept."""
        if self.seen.get(self.rows, 0) >= TIMED:
            return self.seconds[self.rows]
        line = self._line()
        return None if line is None else line[0]

    def verify_price(self, width: int, reach: Sequence[float] | None = None) -> float:
        """A target forward over `width` new tokens in every row, in one-token steps (`Costs.verify_price`)."""
        if self.pinned is not None:
            return self.pinned.verify_price(width, reach if self.lazy and self.rows == 1 else None)
        line = self._line()
        if line is None:
            slope = PRIOR_SLOPE * self.rows if self.slope0 is None else self.slope0
            return 1.0 + slope * (width - 1)
        if self.seen.get(self.rows * width, 0) >= TIMED:
            return self.seconds[self.rows * width] / self.step_seconds()
        return 1.0 + line[1] * (width - 1)

    @property
    def draft_step(self) -> float:
        if self.pinned is not None:
            return self.pinned.draft_step
        return PRIOR_DRAFT_STEP if self.draft_ratio is None else self.draft_ratio

    def prefill(self, tokens: int) -> float:
        """The draft encoding `tokens` prompt tokens, in target steps."""
        if self.pinned is not None:
            return self.pinned.prefill_per_token() * tokens
        seconds, columns = self.prompt
        step = self.step_seconds()
        per_token = seconds / columns / step if step and columns >= 8 else self.verify_price(2) - 1.0
        return PREFILL_RATIO * per_token * tokens

    def observe(self, width: int, seconds: float, draft_steps: int = 0, draft_seconds: float = 0.0,
                columns: int = 0) -> None:
        """One round's target forward over `width` new tokens (`columns` fed) and `draft_steps` timed
        draft steps. The first round's (the prompt's encoding) sets d0 and the draft's prefill price."""
        self.rounds, seconds = self.rounds + 1, max(seconds, 1e-9)  # a clock that read 0: never divided by
        if self.pinned is not None:
            return
        if self.rounds == 1:
            self.prompt = (seconds, columns or width)
            return
        if self.slope0 is None and self.rounds == 2 and width == 1 and self.prompt[1] >= 8 and seconds > 0:
            self.slope0 = min(1.0, max(0.0, (self.prompt[0] / seconds - 1) / (self.prompt[1] - 1)))
        step = self.step_seconds()
        if step:  # a stalled round (another process, a collection) moves the estimates a little
            seconds = min(seconds, OUTLIER * step * self.verify_price(width))
        key, n = self.rows * width, self.seen.get(self.rows * width, 0)
        self.seconds[key] = _ema(self.seconds.get(key, seconds), seconds, max(EMA, 1 / (n + 1)))
        self.seen[key] = n + 1
        step = self.step_seconds()
        if draft_steps and step:
            ratio = draft_seconds / draft_steps / step
            old = self.draft_ratio
            self.draft_ratio = ratio if old is None else _ema(old, min(ratio, OUTLIER * old), EMA)


class Acceptance:
    """Per source, the estimated chance that a proposed node is accepted."""

    def __init__(self, depth: int):
        self.draft = [PRIOR_DRAFT] * depth  # P(draft token i accepted | the ones before it were)
        self.draft_seen = [0] * depth
        self.pooled = PRIOR_DRAFT  # the same for every depth past the first, pooled: where a depth has no estimate yet
        self.hits = [BIN_PRIOR * (b + 0.5) / BINS for b in range(BINS)]  # calibration: accepted per bin
        self.tries = [BIN_PRIOR] * BINS  # ... and reached per bin
        self.retrieval: dict[str, MatchAcceptance] = {}  # per retrieval source (in-row lookup, the cache)

    def draft_at(self, i: int) -> float:
        """P(draft token i + 1 accepted | the ones before it were): its depth's estimate, or the pooled
        one where that depth was never reached (not stuck at the prior where the draft stops short)."""
        return self.draft[i] if self.draft_seen[i] or i == 0 else self.pooled

    def draft_reach(self, k: int) -> list[float]:
        """P(draft tokens 1..i all accepted), i = 1..k, before drafting."""
        out, p = [], 1.0
        for i in range(min(k, len(self.draft))):
            p *= self.draft_at(i)
            out.append(p)
        return out

    def calibrated(self, confidence: float) -> float:
        """P(the target accepts a draft token | the draft gave it probability `confidence`)."""
        b = min(max(int(confidence * BINS), 0), BINS - 1)
        return self.hits[b] / self.tries[b]

    def lookup_at(self, size: int | None, source: str = NGRAM) -> float:
        """The acceptance of a token `source` retrieved after a match of `size` tokens."""
        return self.matches(source).at(size)

    def matches(self, source: str = NGRAM) -> "MatchAcceptance":
        return self.retrieval.setdefault(source, MatchAcceptance())  # at the prior when first asked

    def observe_draft(self, drafted: int, accepted: int, first_hit: bool, confidences: Sequence[float] | None,
                      weight: float) -> None:
        """One row's draft chain of `drafted` tokens, `accepted` of them accepted; `first_hit`: the
        draft's first forward paid (its token, or in a tree the runner-up beside it, was taken)."""
        for i in range(min(accepted + 1, drafted)):
            hit = float(first_hit if i == 0 else i < accepted)
            if i:
                self.pooled = _ema(self.pooled, hit, weight / 2)
            start = self.draft_at(i)
            self.draft[i] = _ema(start, hit, weight)
            self.draft_seen[i] += 1
            if confidences is not None:
                b = min(max(int(confidences[i] * BINS), 0), BINS - 1)
                self.hits[b] += float(i < accepted)
                self.tries[b] += 1

    def observe_lookup(self, size: int | None, accepted: bool, source: str = NGRAM, share: float = 1.0) -> None:
        """One token `source` retrieved (`share`: see MatchAcceptance), reached by verification (or scored)."""
        self.matches(source).observe(size, accepted, share)

    def score_unverified(self, proposed: Sequence[int], emitted: Sequence[int], size: int | None,
                         source: str = NGRAM, shares: Sequence[float] | None = None) -> None:
        """A continuation the round did not verify, against the tokens it emitted (unbiased: see the module)."""
        for j, (mine, actual) in enumerate(zip(proposed, emitted)):
            self.observe_lookup(size, mine == actual, source, shares[j] if shares else 1.0)
            if mine != actual:
                break


class MatchAcceptance:
    """One retrieval source's acceptance, per size of the match a continuation follows and pooled, per unit
    of a token's share (`RetrievalCache.lookup_shares`; 1 in-row): a token moves it by accepted - share x it."""

    def __init__(self) -> None:
        self.pooled = PRIOR_LOOKUP  # retrieved tokens, all match sizes
        self.per_size: dict[int, float] = {}
        self.seen: dict[int, int] = {}

    def at(self, size: int | None) -> float:
        """That size's estimate, else the nearest shorter size's (no weaker a clue), else the pooled one."""
        if size in self.per_size:
            return min(1.0, self.per_size[size])
        shorter = [s for s in tuple(self.per_size) if size and s < size]  # tuple(): one step, whatever other threads add
        return min(1.0, max(self.pooled, self.per_size[max(shorter)]) if shorter else self.pooled)

    def observe(self, size: int | None, accepted: bool, share: float = 1.0) -> None:
        self.pooled = _ema(self.pooled, float(accepted), EMA / 2, share)
        if size:
            n, start = self.seen.get(size, 0), self.per_size.get(size, self.at(size))
            self.per_size[size] = _ema(start, float(accepted), max(EMA / 2, 1 / (n + 3)), share)
            self.seen[size] = n + 1


@dataclass(frozen=True)
class RoundPlan:
    """What a round verifies: `draft` draft-model tokens (0: none; the nodes to verify among them are
    chosen once they are drafted), or else per row the retrieved nodes `nodes` (empty: a plain step)."""

    draft: int
    nodes: list[list[int]]
    rate: float  # expected tokens per unit of cost
    probe: bool = False  # the draft runs to refresh its estimates, not because it pays


class Planner:
    """Plans each round of one generate call (see the module docstring)."""

    def __init__(self, max_draft: int, adaptive: bool = True, costs: Costs | None = None, rows: int = 1, lazy: bool = False):
        max_draft, rows = check_planner(max_draft, rows, costs, adaptive)
        self.max_draft, self.adaptive = max_draft, bool(adaptive)
        self.curve = CostCurve(costs, rows, lazy)
        self.acceptance = Acceptance(max_draft)
        self.without_draft = 0  # rounds since the draft model last ran
        self.probe_wait = PROBE
        self.retrieval_won, self.compared = 0.0, 0.0  # rounds where retrieval beat a warm draft, of those compared

    @property
    def rows(self) -> int:
        return self.curve.rows

    @property
    def measuring(self) -> bool:
        """The round must be a plain step: the curve is measuring d0 (and decisions depend on it)."""
        return self.adaptive and self.curve.measuring

    def set_rows(self, rows: int) -> None:
        """The batch now has `rows` rows (finished rows left, or prompts joined): prices follow."""
        self.curve.rows = rows

    def best_nodes(self, reach: list[list[float]], base: float = 0.0, most: int | None = None,
                   keep: list[list[int]] | None = None) -> tuple[list[list[int]], float]:
        """(per row the nodes to verify, sorted; expected tokens per unit of cost). `reach[r][j]`: P(row
        r's node j and its ancestors accepted), children after their parent. `keep` first; then the rest
        best first, up to `most`, and the prefix with the best rate is kept. `base`: cost already spent."""
        rows = len(reach)
        chosen = [sorted(k) for k in keep] if keep else [[] for _ in range(rows)]
        taken = {(r, j) for r in range(rows) for j in chosen[r]}
        order = sorted(((-p, r, j) for r, row in enumerate(reach) for j, p in enumerate(row)
                        if p > 0 and (r, j) not in taken))
        tokens = rows + sum(reach[r][j] for r, j in taken)
        width = lambda counts: 1 + (sum(counts) if rows == 1 else max(counts, default=0))  # noqa: E731
        counts, chain = [len(c) for c in chosen], sorted((reach[r][j] for r, j in taken), reverse=True)
        best_rate, best = tokens / (base + self.curve.verify_price(width(counts), chain)), 0
        limit = len(order) if most is None else max(0, most - len(taken))
        for n, (p, r, _) in enumerate(order[:limit], start=1):
            tokens -= p
            counts[r] += 1
            chain.append(-p)  # one row: a chain's nodes in order (a tree, greedy, is never priced lazily)
            rate = tokens / (base + self.curve.verify_price(width(counts), chain))
            if rate > best_rate:
                best_rate, best = rate, n
        for _, r, j in order[:best]:
            chosen[r].append(j)
        return [sorted(c) for c in chosen], best_rate

    def draft_length(self, most: int, prefill: int = 0, remaining: int = 0) -> tuple[int, float]:
        """(k, rate): the draft length with the best expected tokens per unit of cost for the batch, its
        prefill spread over what it is expected to draft (`_cold`); (0, 0.0) when it cannot draft."""
        rows, c = self.rows, self.curve.draft_step
        best, best_rate, gain = 0, 0.0, 0.0
        for k, p in enumerate(reach := self.acceptance.draft_reach(most), start=1):
            gain += p
            rate = rows * (1 + gain) / (k * c + self.curve.verify_price(1 + k, reach))
            if rate > best_rate:
                best, best_rate = k, rate
        return best, self._cold(best_rate, prefill, remaining) if best else 0.0

    def _cold(self, rate: float, prefill: int, remaining: int) -> float:
        """A draft rate with its prefill of `prefill` tokens spread over what it is expected to draft."""
        if not prefill:
            return rate
        share = self.retrieval_won / (self.compared + 2.0)  # two pseudo-rounds in which retrieval lost
        drafted = max(1.0, remaining * self.rows * (1 - share))
        return drafted / (drafted / rate + self.curve.prefill(prefill))

    def _with_draft(self, retrieved: list[list[float]], k: int, merge: bool, most: int | None) -> float:
        """Expected tokens per unit of cost of a round drafting k tokens: in a tree (`merge`) the chain
        beside the retrieved nodes, in chains each row's better one; the nodes that pay kept."""
        chain = self.acceptance.draft_reach(k)
        candidates = [retrieved[0] + chain] if merge else [r if sum(r) > sum(chain) else chain for r in retrieved]
        return self.best_nodes(candidates, base=k * self.curve.draft_step, most=most)[1]

    def stop_rule(self, most: int) -> Callable[[list[float]], bool]:
        """A fresh `keep_drafting(confidences)` for one round (where reads are free): given per row the
        draft's probability of its last token, whether to draft another (up to `most`): while stopping
        later (further tokens reaching as `Acceptance.draft` says) beats stopping now, for the batch."""
        c, price, alpha = self.curve.draft_step, self.curve.verify_price, self.acceptance.draft_at
        reach, chain = [], []  # per row, P(its drafted tokens so far are all accepted); one row: that after each token
        tokens, j = 0.0, 0  # the batch's expected tokens so far; tokens drafted

        def keep_drafting(confidences: list[float]) -> bool:
            nonlocal tokens, j
            calibrated = [self.acceptance.calibrated(x) for x in confidences]
            reach[:] = [r * q for r, q in zip(reach, calibrated)] if reach else calibrated
            tokens, j = (tokens or len(reach)) + sum(reach), j + 1  # each row also emits one token of the target's
            chain.append(reach[0])
            now, tail, gain, ahead = tokens / (j * c + price(j + 1, chain)), sum(reach), 0.0, chain[:]
            for later in range(j + 1, most + 1):
                tail *= alpha(later - 1)
                gain += tail
                ahead.append(tail)  # one row (the only chain priced by its reach): P(token `later` reached)
                if (tokens + gain) / (later * c + price(later + 1, ahead)) > now:
                    return True
            return False

        return keep_drafting

    def stopped_length(self, confidences: list[Sequence[float]], most: int) -> int:
        """How many of the drafted tokens (per row their confidences) the stop rule keeps: token j + 1
        on what tokens 1..j said, never on its own value (a stopping time: exact under sampling)."""
        keep, drafted = self.stop_rule(most), min(len(c) for c in confidences)
        length = 1
        while length < drafted and keep([c[length - 1] for c in confidences]):
            length += 1
        return length

    def plan(self, retrieved: list[list[float]], draft_room: int, prefill: int = 0, remaining: int = 0,
             most: int | None = None, merge: bool = False) -> RoundPlan:
        """This round, from per row the reach of each retrieved node, at most `draft_room` draft tokens,
        the draft's `prefill` tokens to encode, the `remaining` tokens, at most `most` nodes; `merge`: a
        tree round (the draft's chain joins the retrieved nodes rather than replacing a row's lookup)."""
        nodes, rate = self.best_nodes(retrieved, most=most)
        if not draft_room:
            return RoundPlan(0, nodes, rate)
        if not self.adaptive:
            return RoundPlan(min(self.max_draft, draft_room), [[] for _ in retrieved], 0.0)
        k = self.draft_length(min(self.max_draft, draft_room))[0]
        warm = self._with_draft(retrieved, k, merge, most)
        if prefill:  # would retrieval take this round from a draft already warm?
            self.compared += 1
            self.retrieval_won += float(rate >= warm)
        draft_rate = self._cold(warm, prefill, remaining)
        if draft_rate > rate:
            return RoundPlan(k, [[] for _ in retrieved], draft_rate)
        plain = self.rows / self.curve.verify_price(1)
        if self.without_draft >= self.probe_wait and draft_rate <= plain and not prefill:
            return RoundPlan(max(1, k), [[] for _ in retrieved], draft_rate, probe=True)
        return RoundPlan(0, nodes, rate)

    def observe_draft(self, drafted: list[int], accepted: list[int], first_hits: list[bool],
                      confidences: list[Sequence[float]] | None, probe: bool = False) -> None:
        """A round in which the draft model ran: per row that verified its chain, the tokens drafted and
        accepted, whether its first forward paid, and its confidences."""
        self.without_draft = 0
        weight = EMA / max(1, len(drafted))  # a batch moves the estimates as much as one row
        for r, (k, n, hit) in enumerate(zip(drafted, accepted, first_hits)):
            self.acceptance.observe_draft(k, n, hit, None if confidences is None else confidences[r], weight)
        if not self.adaptive:
            return
        if self.draft_length(self.max_draft)[1] > self.rows / self.curve.verify_price(1):  # drafting pays
            self.probe_wait = PROBE
        elif probe:
            self.probe_wait = min(MAX_PROBE, 2 * self.probe_wait)

    def observe_without_draft(self) -> None:
        """A round without the draft model (plain, or retrieval only)."""
        self.without_draft += 1

    def estimates(self) -> CostEstimates:
        """The estimates as they stand (the output's `cost_model`)."""
        d = self.curve.verify_price(2) - 1.0
        first = self.acceptance.draft[0] if self.acceptance.draft else 0.0
        return CostEstimates(draft_cost=self.curve.draft_step, verify_cost=d, measured_verify_cost=self.curve.slope0,
                             first_acceptance=first, drafting_pays=first > self.curve.draft_step + d,
                             pinned=self.curve.pinned is not None)
