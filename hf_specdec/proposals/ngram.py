"""N-gram lookup drafts: continuations copied from earlier in the sequence (prompt or generated text).

When the last few tokens occurred before, the tokens that followed them then are a free guess for
what follows now (Saxena 2023, "prompt lookup decoding"; transformers' `PromptLookupCandidateGenerator`).
Such a proposal has no distribution behind it: its q is a point mass on the proposed token. The
rejection rule stays exact with a point mass: x is accepted with probability min(1, p(x) / 1) = p(x),
and on rejection the next token is drawn from normalize(max(0, p - q)), which is p with x removed,
renormalised (`hf_specdec.verify`, `draft_probs=None`; greedy acceptance is unchanged).
"""

from __future__ import annotations

import numbers
from typing import Sequence

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..config import NGRAM_MAX_SIZE, SpeculativeConfig, as_int
from ..host import to_device
from ..stats import NGRAM
from .base import Drafter, DraftRequest, Proposal
from .tree import retrieve

_DEFAULTS = SpeculativeConfig()  # one set of defaults for the hybrid and the stand-alone generator


MAX_TOKENS = 32  # the longest continuation retrieved
MATCH_CAP = 32  # how far back a match is measured (`hf_specdec.proposals.tree.longest_matches`)


def ngram_lookup(
    sequence: torch.Tensor,  # [seq]: one row's real tokens (prompt + generated)
    max_ngram: int,
    min_ngram: int,
    max_tokens: int,
) -> torch.Tensor:  # [<= max_tokens]: the proposed continuation (empty when nothing matches)
    """The continuation of the most recent earlier occurrence of the sequence's last n tokens, trying
    n = max_ngram down to min_ngram."""
    tokens, _ = ngram_match(sequence.tolist(), max_ngram, min_ngram, max_tokens)
    return to_device(tokens, sequence.device)


def ngram_match(
    host: Sequence[int], max_ngram: int, min_ngram: int, max_tokens: int, match_cap: int = 0
) -> tuple[list[int], int]:
    """`ngram_lookup`'s continuation (host tokens) and the size of the match it follows (0: no
    match). The planner keeps a running acceptance per match size: a 1-token match is a weaker clue
    than a 3-token one. With `match_cap` above n, the occurrence followed is the one whose match
    reaches furthest back (the earliest among equals) and the size is its bucket
    (`hf_specdec.proposals.tree.longest_matches`)."""
    continuations, size = retrieve(host, max_ngram, min_ngram, max_tokens, 1, match_cap)
    return (continuations[0], size) if continuations else ([], 0)


class NgramDrafter(Drafter):
    """`ngram_lookup` over the row's real sequence, as point-mass proposals. One row only."""

    source = NGRAM
    max_rows = 1

    def __init__(
        self,
        max_ngram: int = NGRAM_MAX_SIZE,
        min_ngram: int = _DEFAULTS.ngram_min_size,
        max_tokens: int = MAX_TOKENS,
        match_cap: int = MATCH_CAP,
    ):
        max_ngram, min_ngram, max_tokens, match_cap = map(as_int, (max_ngram, min_ngram, max_tokens, match_cap))  # torch ints
        for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram), ("max_tokens", max_tokens),
                            ("match_cap", match_cap)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        max_ngram, min_ngram, max_tokens, match_cap = int(max_ngram), int(min_ngram), int(max_tokens), int(match_cap)
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
        tokens, _ = self.match_rows(request)[0]
        ids = to_device([tokens], request.ids.device)  # [1, L]
        return Proposal(ids, draft_probs=None, source=self.source, host=[tokens])

    def match_rows(self, request: DraftRequest) -> list[tuple[list[int], int]]:
        """Each row's lookup (host tokens, empty where nothing matches) and the size of the match it
        follows (`ngram_match`), from the rows' host sequences: no device read."""
        budget = min(self.max_tokens, request.max_tokens)
        host = request.host or [row.tolist() for row in request.prefixes.sequences]  # a request built without it
        return [ngram_match(seq, self.max_ngram, self.min_ngram, budget, self.match_cap) for seq in host]

    def retrieve(self, request: DraftRequest, max_branches: int) -> tuple[list[list[int]], int]:
        """Every distinct continuation (up to `max_branches`) of the row's last n-gram, for a tree
        proposal, and the size of the match they follow (0: none; `hf_specdec.proposals.tree.retrieve`)."""
        if len(request.host) != 1:
            raise ValueError(f"n-gram lookup proposes for one row at a time, got {len(request.host)}")
        budget = min(self.max_tokens, request.max_tokens)
        return retrieve(request.host[0], self.max_ngram, self.min_ngram, budget, max_branches, self.match_cap)


class NgramCandidateGenerator(CandidateGenerator):
    """transformers' `CandidateGenerator` contract over `ngram_lookup`, one row at a time.

    `get_candidates(input_ids)` returns `(input_ids + proposal, None)`: no logits, so the decode loop
    treats each proposal as a point mass. Usable on its own via
    `speculative_generate(..., candidate_generator=NgramCandidateGenerator())`, where its proposals
    are cut to `num_draft_tokens` (default 8) like any foreign generator's.
    """

    def __init__(
        self,
        max_ngram: int = NGRAM_MAX_SIZE,
        min_ngram: int = _DEFAULTS.ngram_min_size,
        max_tokens: int = MAX_TOKENS,
    ):
        self.drafter = NgramDrafter(max_ngram, min_ngram, max_tokens)

    def get_candidates(self, input_ids: torch.LongTensor) -> tuple[torch.LongTensor, None]:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError("NgramCandidateGenerator proposes for one row at a time: input_ids must be [1, length], "
                             f"got shape {tuple(input_ids.shape)}")
        proposal = ngram_lookup(input_ids[0], self.drafter.max_ngram, self.drafter.min_ngram, self.drafter.max_tokens)
        return torch.cat([input_ids, proposal[None]], dim=1), None

    @property
    def num_drafting_tokens(self) -> int:  # transformers' assisted loop reads it (its own generators define it)
        return self.drafter.max_tokens

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Nothing to learn: lookups depend on the sequence only."""
