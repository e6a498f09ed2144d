"""Speculative decoding settings (plain data, no transformers import)."""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, fields
from typing import Sequence

# The draft's encoding of one prompt token, over the target's (measured on the real pair: 0.31-0.37).
PREFILL_RATIO = 0.35


# The longest n-gram a lookup matches (in-row, and the match sizes the planner tells apart). Not a
# setting: on the standard preset 2 instead of 3 changed no output and no round (a lookup follows the
# occurrence whose match reaches furthest back, whatever n; evals/results/planner/sixth/).
NGRAM_MAX_SIZE = 3
MAX_DRAFT_TOKENS = 1024  # a draft chain longer than this cannot pay: a forward of the draft for each token

# Sampling on a CPU scores p lazily (`verify.lazy_speculative_sampling`): positions [0, 4), then 8
# more, then 16, ..., while the row has rejected nothing.
LAZY_FIRST_CHUNK = 4


def lazy_scored(drafted: int, accepted: int) -> int:
    """The positions the lazy rule scores in one row's chain round of `drafted` tokens, `accepted` of
    them kept: chunk by chunk up to the one holding the first rejection (or the bonus position)."""
    end, size = LAZY_FIRST_CHUNK, LAZY_FIRST_CHUNK
    while end <= accepted:
        size *= 2
        end += size
    return min(drafted + 1, end)


def unscored(width: int, reach: Sequence[float]) -> float:
    """The expected positions of a chain forward over `width` new tokens that the lazy rule does not
    score: the chunk from position b on is scored only if the first b tokens are accepted (reach[b - 1])."""
    start, size, skipped = LAZY_FIRST_CHUNK, 2 * LAZY_FIRST_CHUNK, 0.0
    while start < width:
        skipped += (1.0 - (reach[start - 1] if start <= len(reach) else 0.0)) * (min(width, start + size) - start)
        start, size = start + size, 2 * size
    return skipped


@dataclass(frozen=True)
class Costs:
    """Pinned prices, in target one-token steps: with them no decision reads the clock, so seeded
    runs repeat exactly (`hf_specdec.planner`; unpinned, the planner measures the same three online).

    `verify`: a number d (a forward over w tokens costs 1 + d (w - 1)), or the price of each width
    (entry i: w = i + 1; wider forwards extend the last segment). `draft_prefill`: the draft's
    encoding of one prompt token; None: 0.35 of the target's, taken as the verify curve's slope.
    `position`: the part of each width's price that scoring one position costs when sampling (the
    processors; top-p sorts the vocabulary), so positions the lazy rule is not expected to reach are
    not paid for (`unscored`; one row on a CPU)."""

    draft_step: float
    verify: float | tuple[float, ...] = 0.03
    draft_prefill: float | None = None
    position: float = 0.0

    def __post_init__(self) -> None:
        _check_number("draft_step", self.draft_step)
        if getattr(self.verify, "ndim", None) == 1:  # a numpy array or a tensor of prices: the list it holds
            object.__setattr__(self, "verify", self.verify.tolist())
        if isinstance(self.verify, (list, tuple)):
            values = tuple(self.verify)
            for value in values:
                _check_number("verify (each width's price)", value)
            if not values or not all(v > 0 for v in values):
                raise ValueError(f"verify needs a price per width, each > 0 (a forward is never free), got {self.verify!r}")
            if abs(values[0] - 1.0) > 1e-3:  # seconds, or a curve over another unit: every price would be off
                raise ValueError(f"verify's first entry is a one-token forward's price, 1 by definition (prices are in "
                                 f"target one-token steps), got {values[0]!r}: divide the curve by it")
            object.__setattr__(self, "verify", tuple(float(v) for v in values))
        else:
            _check_number("verify", self.verify)
        if self.draft_prefill is not None:
            _check_number("draft_prefill", self.draft_prefill)
        _check_number("position", self.position)
        if self.position >= self.verify_price(1):
            raise ValueError(f"position (scoring one position, part of a one-token step's price) must be below that "
                             f"step's price {self.verify_price(1):g}, got {self.position!r}")
        for name in ("draft_step", "draft_prefill", "position") + (() if isinstance(self.verify, tuple) else ("verify",)):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))  # a numpy float as the float it is

    def verify_price(self, width: int, reach: Sequence[float] | None = None) -> float:
        """A target forward over `width` new tokens, in one-token steps; with `reach` (a chain sampled
        lazily: P(its tokens 1..i + 1 accepted) at i), less the positions it is not expected to score."""
        curve = self.verify
        if not isinstance(curve, tuple):
            price = 1.0 + curve * (width - 1)
        elif width <= len(curve):
            price = curve[width - 1]
        else:
            price = curve[-1] + max(0.0, curve[-1] - curve[-2] if len(curve) > 1 else 0.0) * (width - len(curve))
        unpaid = self.position * unscored(width, reach) if reach is not None else 0.0
        return max(price - unpaid, 1e-3)  # a large `position` against a flat curve: never free

    def prefill_per_token(self) -> float:
        """The draft's encoding of one prompt token, in target steps."""
        if self.draft_prefill is not None:
            return self.draft_prefill
        return PREFILL_RATIO * max(0.0, self.verify_price(9) - self.verify_price(1)) / 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """Settings of one speculative `generate` call; each is also a keyword argument of `generate`.

    Everything that shapes the *output distribution* (temperature, top-k, top-p, penalties, ...)
    lives in transformers' `GenerationConfig` and is applied identically to draft and target;
    these settings only change speed, never the distribution.
    """

    # Draft-model tokens per round: the most the planner drafts (`adaptive`), or every round's count.
    num_draft_tokens: int = 8
    # The planner chooses each round's proposal by expected tokens per unit of cost (`hf_specdec.planner`).
    # False: the draft model drafts num_draft_tokens every round (no lookups, no plain steps).
    adaptive: bool = True
    # Retrieval: propose the continuation of an earlier occurrence of the last n tokens of the row
    # (n = NGRAM_MAX_SIZE down to ngram_min_size; a 1-token match is priced by its own acceptance).
    ngram: bool = True
    ngram_min_size: int = 1
    # Trees (one row, greedy): the retrieved continuations, the draft's chain and its runners-up in
    # one trie, verified in one forward with a tree attention mask; at most tree_max_nodes nodes.
    # False: chains. Sampling verifies chains: sampled trees of a RetrievalCache's continuations did
    # not pay on held-out prompts under a second cost table, nor on this CPU's wall clock
    # (evals/results/sampled-trees/held-out/), and were deleted.
    tree: bool = True
    tree_max_nodes: int = 24
    # The draft encodes only the last `draft_window` tokens of the prompt and all it generates after
    # (single rows): a long prompt's draft prefill then costs that many tokens. None: the whole
    # prompt. "auto": 64 tokens in greedy calls, 256 when sampling. Exact either way.
    draft_window: int | None | str = "auto"
    # Pinned prices (`Costs`); None: measured online from the rounds' wall times.
    costs: Costs | None = None

    def window_for(self, do_sample: bool) -> int | None:
        """The draft's window in a greedy (`do_sample=False`) or sampling call ("auto": 64 or 256)."""
        if self.draft_window == "auto":
            return 256 if do_sample else 64
        return self.draft_window

    def __post_init__(self) -> None:
        # Types first (a bool is not a number here, though Python says True == 1), then ranges. An integer of
        # numpy or torch (a sweep's value) is taken as the int it is.
        for name in ("num_draft_tokens", "tree_max_nodes", "ngram_min_size", "draft_window"):
            object.__setattr__(self, name, as_int(getattr(self, name)))
        for name in ("num_draft_tokens", "tree_max_nodes"):
            _check_int(name, getattr(self, name), minimum=1)
        if self.num_draft_tokens > MAX_DRAFT_TOKENS:  # the planner keeps an estimate per depth: memory grows with it
            raise ValueError(f"num_draft_tokens must be at most {MAX_DRAFT_TOKENS} (draft steps a round, each a forward of "
                             f"the draft), got {self.num_draft_tokens}")
        _check_int("ngram_min_size", self.ngram_min_size, minimum=1)
        if self.ngram_min_size > NGRAM_MAX_SIZE:
            raise ValueError(f"ngram_min_size must be at most {NGRAM_MAX_SIZE} (the longest n-gram a lookup matches), "
                             f"got {self.ngram_min_size}")
        for name in ("adaptive", "ngram", "tree"):
            value = getattr(self, name)
            if _numpy_bool(value):  # a sweep's value, kept as the bool it is
                object.__setattr__(self, name, bool(value))
            elif not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        window = self.draft_window
        if window is not None and window != "auto" and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"draft_window must be a positive integer, None or 'auto', got {window!r}")
        _check_costs("costs", self.costs)


# The settings' names: every one is also a keyword argument of `speculative_generate`.
SETTINGS = tuple(f.name for f in fields(SpeculativeConfig))


def as_int(value):
    """A numpy or torch integer (a sweep's value) as the int it is; anything else (a bool, a float, a
    float tensor, text) as it came, for the checks that follow to name."""
    if isinstance(value, (bool, int)) or not hasattr(value, "__index__"):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def _check_int(name: str, value, minimum: int, maximum: int | None = None) -> None:
    """A ValueError naming `name` unless `value` is an int (not a bool) of at least `minimum` (at most `maximum`)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum is not None and value > maximum):
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {kind}{'' if maximum is None else f' of at most {maximum}'}, got {value!r}")


def check_planner(max_draft, rows, costs, adaptive=True) -> tuple[int, int]:
    """`Planner`'s arguments checked by name; numpy integers (a sweep's values) taken as the ints they are."""
    if not isinstance(adaptive, bool) and not _numpy_bool(adaptive) and not (type(adaptive) is int and adaptive in (0, 1)):
        raise ValueError(f"Planner's adaptive must be True or False, got {adaptive!r}")
    max_draft, rows = as_int(max_draft), as_int(rows)
    _check_int("Planner's max_draft", max_draft, 1, MAX_DRAFT_TOKENS), _check_int("Planner's rows", rows, 1)
    _check_costs("Planner's costs", costs)
    return max_draft, rows


def _numpy_bool(value) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")  # numpy 2 and 1


def _check_costs(name: str, value) -> None:
    if value is not None and not isinstance(value, Costs):
        raise ValueError(f"{name} must be an hf_specdec.Costs (pinned prices) or None, got {type(value).__name__}")


def _check_number(name: str, value, positive: bool = False) -> None:
    """A ValueError naming `name` unless `value` is a finite real number, >= 0 (or > 0 if `positive`)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)  # numpy's too
    if not ok or value < 0 or (positive and value == 0):
        optional = " (or None)" if name == "draft_prefill" else ""
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}{optional}, got {value!r}")
