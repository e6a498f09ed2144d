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
        answer = self.candidate_generator.get_candidates(request.ids)
        if not isinstance(answer, tuple) or len(answer) != 2 or not isinstance(answer[0], torch.Tensor) or answer[0].dim() != 2:
            raise ValueError(f"{self.source}.get_candidates must return (candidate_ids [1, length + k], candidate_logits "
                             f"[1, k, vocab] or None), got {type(answer).__name__}")
        candidate_ids, candidate_logits = answer
        if candidate_ids.shape[0] != 1 or candidate_ids.shape[1] < width:  # by shape: no read of the device a round
            raise ValueError(f"{self.source}.get_candidates must return candidate_ids [1, length + k] that start with the "
                             f"input_ids it was given (length {width}), then the k candidates; got "
                             f"{tuple(candidate_ids.shape)}, shorter than them (only the new tokens?)")
        new = candidate_ids.shape[1] - width  # the candidates after input_ids
        if candidate_logits is not None and (not isinstance(candidate_logits, torch.Tensor) or candidate_logits.dim() != 3
                                             or candidate_logits.shape[1] != max(0, new)):
            raise ValueError(f"{self.source}.get_candidates returned candidate_logits of shape "
                             f"{tuple(getattr(candidate_logits, 'shape', ()))} for {max(0, new)} new candidates: they must "
                             "be [1, k, vocab], one row of scores per new candidate (not the whole sequence's)")
        # A generator may propose more than fits before max_length: keep the first max_tokens.
        tokens = candidate_ids[:, width : width + request.max_tokens]  # [1, k]
        k = tokens.shape[1]
        q = None if candidate_logits is None else logits_to_probs(candidate_logits[:, :k])  # [1, k, vocab]
        return Proposal(tokens, q, source=self.source)

    def update(self, ids: torch.Tensor, target_scores: torch.Tensor, num_accepted: int) -> None:
        self.candidate_generator.update_candidate_strategy(ids, target_scores, num_accepted)
