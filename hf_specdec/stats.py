"""Acceptance statistics: plain data, no transformers import."""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Union

# Where a round's proposal came from: the draft model, an n-gram lookup, or nowhere (a plain step).
DRAFT, NGRAM, NONE = "draft", "ngram", "none"
CACHE = "cache"  # a retrieval source: the shared `RetrievalCache` (its proposals are point masses, verified as NGRAM)

# Receives one `RoundRecord` per round: a callable, or a path that gets one JSON object per line.
AcceptanceSink = Union[Callable[["RoundRecord"], None], str, os.PathLike]


@dataclass
class RoundRecord:
    """What happened in one round of one row: drafted, accepted, emitted."""

    round: int  # 0-based round index within the generate call
    row: int  # batch row
    draft_tokens: list[int]  # proposed by the draft, in order
    num_accepted: int  # length of the accepted prefix of draft_tokens
    emitted_tokens: list[int]  # appended to the output (accepted + recovered/bonus, cut at a stop)
    # Per draft position whose p was computed (on a CPU, sampling scores p lazily: it may stop short of the
    # draft's length): sum_t min(p(t), q(t)) = 1 - TV(p, q), the probability that the rule accepts
    # at that position given the prefix (sampling mode only; None in greedy mode).
    expected_acceptance: list[float] | None = None
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    source: str = "draft"  # "draft" (draft model), "ngram" (n-gram lookup, point-mass q) or "none" (plain step)
    # Trees: each draft token's parent (-1: the last real token) and the accepted nodes, root first;
    # num_accepted is then the length of that path. None for a chain.
    parents: list[int] | None = None
    path: list[int] | None = None
    # Where the accepted tokens came from: "draft", "ngram", "draft+ngram" (a tree path through both),
    # or "" when nothing was accepted.
    accepted_from: str = ""
    cache_length: int = 0  # columns the target's cache holds after the round (holes and padding included)
    # Tree rounds (one row): the planner's estimate, per proposed node, of the probability that
    # verification reaches and accepts it (what it chose the tree on; their sum is the accepted
    # tokens it expected). None where it made no such estimate.
    estimated_acceptance: list[float] | None = None
    # Where the row's retrieved tokens came from, when it verified any: "ngram" (its own text) or
    # "cache" (a `RetrievalCache`: earlier outputs, or other rows of the call); "" otherwise.
    retrieval: str = ""
    # Positions at which the target's processors ran (the rows' own, in a batch): every node in greedy
    # decoding; when sampling on a CPU up to the chunk of the batch's last first rejection.
    scored: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class AcceptanceStats:
    """Counters over a generate call. Rates are derived, never stored."""

    rounds: int = 0  # verification rounds (= target forwards)
    drafted: int = 0  # draft tokens proposed (a tree round: its depth, the most it could accept)
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens appended to the output (may be cut short by a stop)
    draft_forwards: int = 0
    target_forwards: int = 0
    ngram_rounds: int = 0  # rounds whose proposal came from n-gram lookup (hybrid drafting)
    plain_rounds: int = 0  # rounds that drafted nothing (the planner chose a plain step)
    draft_seconds: float = 0.0  # wall time inside draft forwards and draft sampling
    target_seconds: float = 0.0  # wall time inside target forwards
    # Index i counts draft position i + 1: how often it was drafted, reached (every earlier position
    # accepted, so the rule looked at it) and accepted.
    drafted_per_position: list[int] = field(default_factory=list)
    reached_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def count_round(self, source: str, draft_forwards: int, draft_seconds: float, target_seconds: float) -> None:
        """Count one round of the batch (one target forward)."""
        self.rounds += 1
        self.target_forwards += 1
        self.ngram_rounds += source == NGRAM
        self.plain_rounds += source == NONE
        self.draft_forwards += draft_forwards
        self.draft_seconds += draft_seconds
        self.target_seconds += target_seconds

    def record(self, num_drafted: int, num_accepted: int, num_emitted: int, num_reached: int | None = None) -> None:
        """Count one row's round. `num_reached`: the positions the rule looked at, where not every position up
        to the first rejection had a token (a tree whose accepted branch ends early)."""
        counts = (num_drafted, num_accepted, num_emitted, num_accepted if num_reached is None else num_reached)
        if any(isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in counts) or not (
                0 <= num_accepted <= counts[3] <= num_drafted and num_emitted >= 0):  # (a stop may cut the emitted)
            raise ValueError(f"a round's counts are integers with 0 <= accepted <= reached <= drafted and emitted >= 0 "
                             f"(checked before any is counted): drafted {num_drafted!r}, accepted {num_accepted!r}, "
                             f"reached {num_reached!r}, emitted {num_emitted!r}")
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.emitted += num_emitted
        grow = num_drafted - len(self.drafted_per_position)
        if grow > 0:
            for counts in (self.drafted_per_position, self.reached_per_position, self.accepted_per_position):
                counts.extend([0] * grow)
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
        reached = min(num_accepted + 1, num_drafted) if num_reached is None else num_reached
        for i in range(reached):  # up to and including the first rejection
            self.reached_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def token_acceptance(self) -> float:
        """accepted / reached: the per-token acceptance probability (alpha in Leviathan et al. 2023)
        if positions were independent; the geometric law E[tokens per round] = (1 - alpha^(k+1)) /
        (1 - alpha) uses this, not `acceptance_rate` (which is (tokens per round - 1) / k by identity)."""
        reached = sum(self.reached_per_position)
        return self.accepted / reached if reached else 0.0

    @property
    def mean_tokens_per_round(self) -> float:
        """Tokens emitted per target forward: the speedup if drafting were free."""
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def per_position_rate(self) -> list[float]:
        """Accepted / reached at each draft position: acceptance given every earlier position accepted."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_per_position, self.reached_per_position)]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            acceptance_rate=self.acceptance_rate,
            token_acceptance=self.token_acceptance,
            mean_tokens_per_round=self.mean_tokens_per_round,
            per_position_rate=self.per_position_rate,
        )
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AcceptanceStats":
        """The counters `to_dict` wrote (say, read back from JSON); its derived rates are recomputed, not read."""
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict):
            raise ValueError(f"AcceptanceStats.from_dict takes the dict to_dict writes, got {type(data).__name__}")
        unknown = set(data) - set(cls().to_dict())  # its counters and derived rates
        if unknown:
            raise ValueError(f"AcceptanceStats.from_dict: unknown fields {sorted(unknown)}; it reads what to_dict writes")
        kept = {name: list(value) if isinstance(value, list) else value for name, value in data.items() if name in names}
        for name, value in kept.items():  # counts: integers >= 0; seconds: finite numbers >= 0
            for v in value if isinstance(value, list) else [value]:
                whole = not name.endswith("seconds")
                if isinstance(v, bool) or not isinstance(v, numbers.Integral if whole else numbers.Real) or not 0 <= v < math.inf:
                    raise ValueError(f"AcceptanceStats.from_dict: {name} must hold {'integers' if whole else 'numbers'} "
                                     f">= 0, got {value!r}")
        return cls(**kept)

    def merge(self, other: "AcceptanceStats") -> "AcceptanceStats":
        """Sum of two sets of counters (e.g. over prompts)."""
        merged = AcceptanceStats()
        for name in (
            "rounds", "drafted", "accepted", "emitted", "draft_forwards", "target_forwards", "ngram_rounds", "plain_rounds"
        ):
            setattr(merged, name, getattr(self, name) + getattr(other, name))
        merged.draft_seconds = self.draft_seconds + other.draft_seconds
        merged.target_seconds = self.target_seconds + other.target_seconds
        n = max(len(self.drafted_per_position), len(other.drafted_per_position))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        for name in ("drafted_per_position", "reached_per_position", "accepted_per_position"):
            setattr(merged, name, [a + b for a, b in zip(pad(getattr(self, name)), pad(getattr(other, name)))])
        return merged


def open_sink(sink: AcceptanceSink | None) -> tuple[Callable[[RoundRecord], None] | None, Callable[[], None]]:
    """Turn a sink argument into (write, close). A path is appended to as JSON Lines."""
    if sink is None:
        return None, lambda: None
    if callable(sink):
        return sink, lambda: None
    try:
        handle = open(os.fspath(sink), "a", encoding="utf-8")
    except OSError as error:  # a missing folder, a directory, no permission
        raise ValueError(f"acceptance_sink: cannot append to {os.fspath(sink)!r}: {error.strerror or error}") from error

    def named(action: Callable[[], None]) -> None:  # a full disk shows at a write or at close: name the sink
        try:
            action()
        except OSError as error:
            raise OSError(error.errno, f"acceptance_sink: cannot write the round records to {os.fspath(sink)!r}: "
                                       f"{error.strerror or error}") from error

    return (lambda record: named(lambda: handle.write(json.dumps(record.to_dict()) + "\n"))), lambda: named(handle.close)


def geometric_tokens_per_round(acceptance: float, k: int) -> float:
    """Expected tokens emitted per round, (1 - a^(k+1)) / (1 - a), and k + 1 when a >= 1.

    Leviathan et al. 2023 (arXiv:2211.17192), eq. 1 (Theorem 3.8's walltime improvement factor is
    this over (kc + 1)): with k draft tokens per round, each accepted independently with probability
    a, a round emits the accepted prefix plus one recovered or bonus token, so the count is a
    geometric variable capped at k + 1. `a` is the per-token acceptance
    (`AcceptanceStats.token_acceptance`, accepted / reached), not accepted / drafted, which is tied
    to tokens per round by an identity and would make a comparison with this law circular.
    """
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0 or not 0 <= acceptance <= 1:  # NaN too
        raise ValueError(f"the geometric law takes an acceptance in [0, 1] and k >= 0 draft tokens, got {acceptance!r}, {k!r}")
    if acceptance >= 1:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


# d at or above this (target steps a token): a wide forward costs several steps, little can pay.
SLOW_VERIFY = 0.3


@dataclass(frozen=True)
class CostEstimates:
    """The planner's estimates at the end of a generate call, in target steps: a drafted token pays
    for itself only when its chance of acceptance beats `draft_cost + verify_cost`."""

    draft_cost: float  # c: one draft forward
    verify_cost: float  # d: one more token in the verifying forward (price of 2 tokens less 1)
    measured_verify_cost: float | None  # d0, from the prompt's encoding and one step (None: not measured)
    # the planner's estimate for the first draft token: a running average (weight 0.2 a round) that starts from a
    # prior of 0.7, so it is that prior in a call where the draft never ran
    first_acceptance: float
    drafting_pays: bool  # first_acceptance > draft_cost + verify_cost at the end of the call
    pinned: bool  # the prices were given (costs=), not measured

    def describe(self) -> str:
        """One line for a person: the costs and whether a drafted token pays on this machine."""
        how = "pinned" if self.pinned else "measured"
        line = (f"draft step c = {self.draft_cost:.2f}, verify d = {self.verify_cost:.2f} a token ({how}): "
                f"a drafted token pays when accepted more often than c + d = {self.draft_cost + self.verify_cost:.2f}"
                f" (first-token acceptance {self.first_acceptance:.2f})")
        if self.verify_cost >= SLOW_VERIFY:
            line += (f"; here one more token in a forward costs {self.verify_cost:.2f} of a step, so little can pay: "
                     "speculation needs a forward bound by reading the weights (a GPU, a CPU with bf16 "
                     "instructions such as AVX-512 BF16 or AMX for a bf16 model, or on other CPUs a float32 "
                     "target packed for oneDNN: hf_specdec.pack_linears, CLI --pack)")
        return line
