"""Speculative decoding settings (plain data, no transformers import)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeConfig:
    """Settings of one speculative `generate` call.

    Everything that shapes the *output distribution* (temperature, top-k, top-p, penalties, ...)
    lives in transformers' `GenerationConfig` and is applied identically to draft and target;
    these settings only change speed, never the distribution.
    """

    # Draft tokens proposed per round (k in Leviathan et al. 2023). 5 is transformers' default
    # for assisted generation and a reasonable value when a draft step costs ~1/3 of a target step.
    num_draft_tokens: int = 5
    # Optional temperature used for the draft only (q hotter or colder than p). None: the draft is
    # warped exactly like the target. Exactness holds for any q, because q is always the
    # distribution the draft token was actually sampled from.
    draft_temperature: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be a positive integer, got {self.num_draft_tokens!r}")
        if self.draft_temperature is not None and not self.draft_temperature > 0:
            raise ValueError(f"draft_temperature must be > 0 (or None), got {self.draft_temperature!r}")
