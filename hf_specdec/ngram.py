"""N-gram lookup drafts: continuations copied from earlier in the sequence (prompt or generated text).

When the last few tokens occurred before, the tokens that followed them then are a free guess for
what follows now (Saxena 2023, "prompt lookup decoding"; transformers' `PromptLookupCandidateGenerator`).
Such a proposal has no distribution behind it: its q is a point mass on the proposed token. The
rejection rule stays exact with a point mass: x is accepted with probability min(1, p(x) / 1) = p(x),
and on rejection the next token is drawn from normalize(max(0, p - q)), which is p with x removed,
renormalised (`hf_specdec.verify.speculative_sampling` handles both; greedy acceptance is unchanged).
"""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import CandidateGenerator


def ngram_lookup(
    sequence: torch.Tensor,  # [seq]: one row's real tokens (prompt + generated)
    max_ngram: int,
    min_ngram: int,
    max_tokens: int,
) -> tuple[torch.Tensor, int]:  # [<= max_tokens] proposed continuation, matched n-gram size (0: none)
    """The continuation of the most recent earlier occurrence of the sequence's last n tokens, trying
    n = max_ngram down to min_ngram. Returns an empty tensor and 0 when nothing matches."""
    length = sequence.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = sequence[length - n :]
        windows = sequence[: length - 1].unfold(0, n, 1)  # [length - n, n]: every earlier n-gram
        starts = (windows == suffix).all(dim=1).nonzero().flatten()
        for start in reversed(starts.tolist()):  # the most recent occurrence with a continuation
            follow = start + n
            if follow < length:
                return sequence[follow : follow + max_tokens], n
    return sequence.new_empty(0), 0


class NgramCandidateGenerator(CandidateGenerator):
    """transformers' `CandidateGenerator` contract over `ngram_lookup`, one row at a time.

    `get_candidates(input_ids)` returns `(input_ids + proposal, None)`: no logits, so the decode loop
    treats each proposal as a point mass. Usable on its own via
    `speculative_generate(..., candidate_generator=NgramCandidateGenerator())`.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, max_tokens: int = 10):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_ngram, self.min_ngram, self.max_tokens = max_ngram, min_ngram, max_tokens

    def get_candidates(self, input_ids: torch.LongTensor) -> tuple[torch.LongTensor, None]:
        if input_ids.shape[0] != 1:
            raise ValueError(f"NgramCandidateGenerator proposes for one row at a time, got {input_ids.shape[0]}")
        proposal, _ = ngram_lookup(input_ids[0], self.max_ngram, self.min_ngram, self.max_tokens)
        return torch.cat([input_ids, proposal[None]], dim=1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        pass
