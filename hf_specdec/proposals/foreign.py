"""Any transformers `CandidateGenerator` as a `Drafter`: the one wrapper, applied at the entry point."""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from ..sampling import logits_to_probs
from .base import Drafter, DraftRequest, Proposal


class CandidateGeneratorDrafter(Drafter):
    """Wraps transformers' contract: `get_candidates(input_ids) -> (candidate_ids, candidate_logits)`
    and `update_candidate_strategy(input_ids, scores, num_matches)`. One row at a time (the contract
    has no attention mask). Candidate logits are taken as processed draft scores (softmax gives q);
    a generator that returns none makes point-mass proposals, which is exact.
    """

    def __init__(self, candidate_generator: CandidateGenerator):
        self.candidate_generator = candidate_generator
        self.source = type(candidate_generator).__name__

    def propose(self, request: DraftRequest) -> Proposal:
        width = request.ids.shape[1]
        candidate_ids, candidate_logits = self.candidate_generator.get_candidates(request.ids)
        # A generator may propose more than fits before max_length: keep the first max_tokens.
        tokens = candidate_ids[:, width : width + request.max_tokens]  # [1, k]
        k = tokens.shape[1]
        q = None if candidate_logits is None else logits_to_probs(candidate_logits[:, :k])  # [1, k, vocab]
        return Proposal(tokens, q, source=self.source)

    def update(self, ids: torch.Tensor, target_scores: torch.Tensor, num_accepted: int) -> None:
        self.candidate_generator.update_candidate_strategy(ids, target_scores, num_accepted)
