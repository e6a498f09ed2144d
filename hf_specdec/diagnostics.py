"""Where a speculative greedy output leaves plain greedy, and by how small a margin.

Greedy speculative decoding emits exactly plain greedy's tokens in exact arithmetic. In bf16 the
verification forward (k + 1 tokens at once) and plain decoding (one token per forward) may round a
logit differently; when plain decoding's top two scores are tied or nearly so, that flips the argmax
and the outputs part, for every method that verifies blocks (transformers' own included), without
the acceptance rule being involved. Reporting the first differing token together with plain
decoding's top-two margin there tells the two cases apart: a margin of 0 (an exact tie) or within
bf16 rounding is arithmetic, a large margin would be a bug.

Pure torch, no transformers import: used by the `hf-specdec` command and `evals/greedy_divergence.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _one_row(values, name: str) -> torch.Tensor:
    """`values` as a 1-D tensor: a list, or one row of a [1, n] batch (`out.sequences`, an `out.scores` entry)."""
    values = torch.as_tensor(values)
    if values.dim() == 2 and values.shape[0] == 1:
        values = values[0]
    if values.dim() != 1:
        raise ValueError(f"{name} must be one row: shape (n,) or (1, n), got {tuple(values.shape)}")
    return values


def first_divergence(reference: torch.Tensor, other: torch.Tensor) -> int | None:
    """Index of the first generated token where two outputs differ, or None when they are equal.

    reference: (n,) token ids (plain greedy's generated tokens); other: (m,) token ids. When one is a
    proper prefix of the other, they differ at min(n, m): one stopped where the other went on.
    """
    reference, other = _one_row(reference, "reference"), _one_row(other, "other")
    n = min(len(reference), len(other))
    differs = (reference[:n] != other[:n]).nonzero()
    if len(differs):
        return int(differs[0])
    return None if len(reference) == len(other) else n


def top_two_margin(scores: torch.Tensor) -> float:
    """Largest minus second-largest score at one position; 0.0 is an exact tie.

    scores: (vocab,) the scores greedy took its argmax over (logits, after any processors). Computed
    in float32 so that a bf16 tie reads as exactly 0.
    """
    scores = _one_row(scores, "scores")
    if scores.numel() < 2:
        raise ValueError(f"scores need at least two entries for a margin, got {scores.numel()}")
    top2 = scores.float().topk(2).values
    if bool(torch.isneginf(top2[1])):  # nothing or one token left: -inf - -inf would be NaN
        return 0.0 if bool(torch.isneginf(top2[0])) else math.inf
    if bool(top2[0] == top2[1]):  # an exact tie, +inf ones included (inf - inf would be NaN)
        return 0.0
    return float(top2[0] - top2[1])


def bf16_step(value: float) -> float:
    """The spacing of bf16 numbers at `value`: 2^(e - 7) for |value| in [2^e, 2^(e+1)) (8 significant
    bits). Two logits of this size that differ by one step may be rounded either way by a forward
    over more tokens."""
    return math.ldexp(1.0, math.frexp(abs(value))[1] - 8) if value else math.ldexp(1.0, -133)


@dataclass(frozen=True)
class Divergence:
    """The first generated token where an output leaves plain greedy, and plain's margin there."""

    position: int  # index among the generated tokens
    margin: float | None  # plain decoding's top-two score margin at `position`; None when unknown
    top: float | None = None  # plain decoding's top score there (sets the size of one bf16 step)

    @property
    def margin_in_bf16_steps(self) -> float | None:
        """The margin in units of one bf16 step at the top score's magnitude: 0 is an exact tie, 1 is
        adjacent bf16 numbers; anything above 1 cannot be bf16 rounding and is a bug to chase."""
        if self.margin is None or self.top is None:
            return None
        return self.margin / bf16_step(self.top)

    @property
    def exact_tie(self) -> bool:
        """Plain decoding's top two scores are equal: either token is a correct greedy choice."""
        return self.margin == 0.0

    def describe(self) -> str:
        text = f"first difference at generated token {self.position}"
        if self.margin is None:
            return text
        text += f"; plain decoding's top-two logit margin there: {self.margin:.4f}"
        return text + (" (an exact tie: either token is a correct greedy choice)" if self.exact_tie else "")


def greedy_divergence(
    reference: torch.Tensor, other: torch.Tensor, reference_scores: Sequence[torch.Tensor]
) -> Divergence | None:
    """Divergence of `other` from `reference`, or None when they are equal.

    reference: (n,) plain greedy's generated token ids; other: (m,) another method's (or (1, n) rows of
    `out.sequences`, or lists); reference_scores: n tensors of shape (vocab,) or (1, vocab), plain greedy's scores at each generated token (`output_scores=True`,
    one row of each entry). The margin is None where the scores stop short of the divergence (the
    other output ran past plain's last token).
    """
    position = first_divergence(reference, other)
    if position is None:
        return None
    if position >= len(reference_scores):
        return Divergence(position, None)
    scores = _one_row(reference_scores[position], "reference_scores entries")
    return Divergence(position, top_two_margin(scores), float(scores.float().max()))
