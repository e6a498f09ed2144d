"""N-gram lookup drafts: continuations copied from earlier in the sequence (prompt or generated text).

When the last few tokens occurred before, the tokens that followed them then are a free guess for
what follows now (Saxena 2023, "prompt lookup decoding"; transformers' `PromptLookupCandidateGenerator`).
Such a proposal has no distribution behind it: its q is a point mass on the proposed token. The
rejection rule stays exact with a point mass: x is accepted with probability min(1, p(x) / 1) = p(x),
and on rejection the next token is drawn from normalize(max(0, p - q)), which is p with x removed,
renormalised (`hf_specdec.verify`, `draft_probs=None`; greedy acceptance is unchanged).
"""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..config import SpeculativeConfig
from ..stats import NGRAM
from .base import Drafter, DraftRequest, Proposal
from .tree import longest_matches, retrieve

_DEFAULTS = SpeculativeConfig()  # one set of defaults for the hybrid and the stand-alone generator


def ngram_lookup(
    sequence: torch.Tensor,  # [seq]: one row's real tokens (prompt + generated)
    max_ngram: int,
    min_ngram: int,
    max_tokens: int,
) -> torch.Tensor:  # [<= max_tokens]: the proposed continuation (empty when nothing matches)
    """The continuation of the most recent earlier occurrence of the sequence's last n tokens, trying
    n = max_ngram down to min_ngram."""
    return ngram_match(sequence, max_ngram, min_ngram, max_tokens)[0]


def ngram_match(
    sequence: torch.Tensor, max_ngram: int, min_ngram: int, max_tokens: int, match_cap: int = 0
) -> tuple[torch.Tensor, int]:
    """`ngram_lookup`'s continuation and the size of the match it follows (0: no match). The cost
    model keeps a running acceptance per match size: a 1-token match is a weaker clue than a 3-token
    one. With `match_cap` above n, the occurrence followed is the one whose match reaches furthest
    back (the earliest among equals) and the size is its bucket (`hf_specdec.proposals.tree.longest_matches`)."""
    length = sequence.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = sequence[length - n :]
        windows = sequence[: length - 1].unfold(0, n, 1)  # [length - n, n]: every earlier n-gram
        starts = (windows == suffix).all(dim=1).nonzero().flatten()
        if starts.numel():  # every occurrence has a continuation (it ends before the last token)
            if match_cap <= n:  # the most recent occurrence
                follow, size = int(starts[-1]) + n, n
            else:
                ordered, size = longest_matches(sequence.tolist(), starts.tolist(), n, max_ngram, match_cap)
                follow = ordered[0] + n
            return sequence[follow : follow + max_tokens], size
    return sequence.new_empty(0), 0


class NgramDrafter(Drafter):
    """`ngram_lookup` over the row's real sequence, as point-mass proposals. One row only."""

    source = NGRAM

    def __init__(
        self,
        max_ngram: int = _DEFAULTS.ngram_max_size,
        min_ngram: int = _DEFAULTS.lookup_min_size(trees=False),
        max_tokens: int = _DEFAULTS.ngram_max_tokens,
        match_cap: int = _DEFAULTS.ngram_match_cap,
    ):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if match_cap < 0:
            raise ValueError(f"match_cap must be >= 0, got {match_cap}")
        self.max_ngram, self.min_ngram, self.max_tokens, self.match_cap = max_ngram, min_ngram, max_tokens, match_cap

    def propose(self, request: DraftRequest) -> Proposal:
        if len(request.prefixes.rows) != 1:
            raise ValueError(f"n-gram lookup proposes for one row at a time, got {len(request.prefixes.rows)}")
        budget = min(self.max_tokens, request.max_tokens)
        sequence = request.prefixes.sequences[0]
        tokens, size = ngram_match(sequence, self.max_ngram, self.min_ngram, budget, self.match_cap)
        return Proposal(tokens[None], draft_probs=None, source=self.source, match_sizes=[size])  # [1, L]

    def lookup_rows(self, request: DraftRequest) -> list[torch.Tensor]:
        """Each row's lookup (any batch size): [<= max_tokens] per row, empty where nothing matches."""
        return [tokens for tokens, _ in self.match_rows(request)]

    def match_rows(self, request: DraftRequest) -> list[tuple[torch.Tensor, int]]:
        """Each row's lookup and the size of the match it follows (`ngram_match`)."""
        budget = min(self.max_tokens, request.max_tokens)
        return [ngram_match(seq, self.max_ngram, self.min_ngram, budget, self.match_cap)
                for seq in request.prefixes.sequences]

    def continuations(self, request: DraftRequest, max_branches: int) -> list[list[int]]:
        """Every distinct continuation (up to `max_branches`, most recent first) of the row's last
        n-gram, for a tree proposal (`hf_specdec.proposals.tree.ngram_continuations`)."""
        return self.retrieve(request, max_branches)[0]

    def retrieve(self, request: DraftRequest, max_branches: int) -> tuple[list[list[int]], int]:
        """`continuations` and the size of the match they follow (0: none)."""
        if len(request.prefixes.rows) != 1:
            raise ValueError(f"n-gram lookup proposes for one row at a time, got {len(request.prefixes.rows)}")
        budget = min(self.max_tokens, request.max_tokens)
        sequence = request.prefixes.sequences[0]
        return retrieve(sequence, self.max_ngram, self.min_ngram, budget, max_branches, self.match_cap)


class NgramCandidateGenerator(CandidateGenerator):
    """transformers' `CandidateGenerator` contract over `ngram_lookup`, one row at a time.

    `get_candidates(input_ids)` returns `(input_ids + proposal, None)`: no logits, so the decode loop
    treats each proposal as a point mass. Usable on its own via
    `speculative_generate(..., candidate_generator=NgramCandidateGenerator())`, where its proposals
    are cut to `num_draft_tokens` (default 8) like any foreign generator's.
    """

    def __init__(
        self,
        max_ngram: int = _DEFAULTS.ngram_max_size,
        min_ngram: int = _DEFAULTS.lookup_min_size(trees=False),
        max_tokens: int = _DEFAULTS.ngram_max_tokens,
    ):
        self.drafter = NgramDrafter(max_ngram, min_ngram, max_tokens)

    def get_candidates(self, input_ids: torch.LongTensor) -> tuple[torch.LongTensor, None]:
        if input_ids.shape[0] != 1:
            raise ValueError(f"NgramCandidateGenerator proposes for one row at a time, got {input_ids.shape[0]}")
        proposal = ngram_lookup(input_ids[0], self.drafter.max_ngram, self.drafter.min_ngram, self.drafter.max_tokens)
        return torch.cat([input_ids, proposal[None]], dim=1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Nothing to learn: lookups depend on the sequence only."""
