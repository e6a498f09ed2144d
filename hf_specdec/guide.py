"""A draft guided by a lookup's guess: one row's draft model, drafting token by token (the CPU), feeds
the tokens its row's lookup expects next (the row's text and the tokens drafted so far, looked up in
the row and in a `RetrievalCache`) in the same forward as its last token. While the draft's token
equals the guessed one, its next token comes from the logits that forward already computed, so a
chain the lookup foresaw costs fewer draft forwards (`DraftModelDrafter._guided`).

Exactness is untouched: every token is still drawn from the draft's q given the row and the draft's
tokens before it, with the same uniforms; the guess only decides which q are computed early, and a
guess is a function of the past and of the draft's own tokens, never of the round's uniforms.

`Guesses` prices a guess: g guessed tokens give 1 + m + ... + m^g drafted tokens a forward for m the
running chance that the draft draws the guessed token, at the price of a draft forward over 1 + g
tokens (pinned: `Costs.draft_verify`; online: each width's timed mean over a one-token forward's,
before that a prior slope). A guess is as long as that rate is best.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .config import DRAFT_WIDTH_SLOPE, Costs, curve_price

if TYPE_CHECKING:
    from .proposals import DraftRequest

PRIOR_GUESS = 0.5  # P(the draft draws a guessed token) before one is compared
WEIGHT = 0.2  # weight of the newest observation in the running estimates
OUTLIER = 2.0  # a forward's time counts as at most this many times its width's running mean


class Guesses:
    """One call's guessed-token statistics and draft width prices: how many tokens a guess feeds."""

    def __init__(self, pinned: Costs | None):
        self.pinned = pinned
        self.rate = PRIOR_GUESS  # P(the draft draws the guessed token), running
        self.seconds: dict[int, float] = {}  # a guided forward's new tokens -> running mean seconds (online)

    def width_price(self, width: int) -> float:
        """A draft forward over `width` new tokens, in draft steps."""
        if self.pinned is not None:
            return self.pinned.draft_width_price(width)
        one, wide = self.seconds.get(1), self.seconds.get(width)
        return max(1.0, wide / one) if one and wide else curve_price(DRAFT_WIDTH_SLOPE, width)

    def length(self, most: int) -> int:
        """How many guessed tokens a forward feeds (at most `most`): the count with the most expected
        drafted tokens per unit of the forward's price."""
        best, best_rate, tokens, p = 0, 1.0, 1.0, 1.0
        for g in range(1, most + 1):
            p *= self.rate
            tokens += p
            if tokens / self.width_price(1 + g) > best_rate:
                best, best_rate = g, tokens / self.width_price(1 + g)
        return best

    def observe(self, width: int, seconds: float, hits: Sequence[bool]) -> None:
        """A guided forward over `width` new tokens took `seconds` (the host's clock: the CPU only); its
        guessed tokens, in order, as far as the draft's tokens were compared with them: `hits`."""
        for hit in hits:
            self.rate += WEIGHT * (float(hit) - self.rate)
        if self.pinned is None:
            old = self.seconds.get(width)
            self.seconds[width] = seconds if old is None else old + WEIGHT * (min(seconds, OUTLIER * old) - old)


class Guide:
    """One round's guess (`DraftRequest.guess`): what `lookup` (a `Retrieval`) expects after the row's
    text and the tokens drafted so far, as long as `guesses` finds pays, up to the planned chain's end
    (`horizon`); the drafter reports each guided forward back (`observe`)."""

    def __init__(self, guesses: Guesses, lookup, request: DraftRequest, row: int, horizon: int):
        self.guesses, self.lookup = guesses, lookup
        self.host, self.row, self.horizon = request.host[0], row, horizon

    def __call__(self, drafted: list[int]) -> list[int]:
        most = self.guesses.length(self.horizon - len(drafted) - 1)
        return self.lookup.guess(self.host + drafted, most, self.row) if most > 0 else []

    def observe(self, width: int, seconds: float, hits: Sequence[bool]) -> None:
        self.guesses.observe(width, seconds, hits)
