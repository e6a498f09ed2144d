"""A draft-model candidate generator following transformers' `CandidateGenerator` contract."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, PreTrainedModel, TemperatureLogitsWarper
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitNormalization,
    MinPLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .cache import extend, new_cache
from .sampling import Processor, process_logits, row_pipelines, select_token, with_drafts

# Warpers that must see the temperature-scaled scores (transformers applies temperature first).
_AFTER_TEMPERATURE = (
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitNormalization,
)


def with_draft_temperature(processor: LogitsProcessorList, temperature: float) -> LogitsProcessorList:
    """The same pipeline with its temperature replaced (or inserted where transformers puts it).

    Used for a draft that should be hotter or colder than the target; exactness is unaffected
    because the draft token is sampled from, and verified against, this very q.
    """
    warper = TemperatureLogitsWarper(temperature)
    out = LogitsProcessorList(p for p in processor if not isinstance(p, TemperatureLogitsWarper))
    position = next((i for i, p in enumerate(out) if isinstance(p, _AFTER_TEMPERATURE)), len(out))
    out.insert(position, warper)
    return out


class DraftCandidateGenerator(CandidateGenerator):
    """Proposes `num_draft_tokens` tokens per round from a draft model with its own `DynamicCache`.

    `get_candidates(input_ids)` returns `(candidate_ids, candidate_logits)`:
      * candidate_ids:    [batch, seq + k] the input followed by k draft tokens;
      * candidate_logits: [batch, k, vocab] the *processed* draft scores; softmax of row i is q_i,
                          exactly the distribution draft token i was drawn from.
    The draft cache (`self.cache`) is rolled back by the decode loop, together with the target's.
    """

    def __init__(
        self,
        draft_model: PreTrainedModel,
        logits_processor: Processor | None,
        num_draft_tokens: int,
        do_sample: bool,
        generator: torch.Generator | None = None,
    ):
        self.model = draft_model
        self.logits_processor = logits_processor
        self.num_draft_tokens = num_draft_tokens
        self.do_sample = do_sample
        self.generator = generator
        self.reset()

    def reset(self) -> None:
        """Forget the previous sequence: a fresh cache and counters (called at the start of generate)."""
        self.cache = new_cache(self.model)
        self.row_processors: list | None = None  # per-row pipelines, for batches (see `prepare_batch`)
        self.forwards = 0  # draft forward passes in this generate call

    def prepare_batch(self, batch_size: int) -> None:
        """Per-row processor pipelines, for rows that have generated different numbers of tokens."""
        self.row_processors = row_pipelines(self.logits_processor, batch_size) if batch_size > 1 else None

    def get_candidates(
        self,
        input_ids: torch.LongTensor,  # [batch, seq]
        attention_mask: torch.Tensor | None = None,  # [batch, seq]: 0 for padding and holes; None if none
        num_tokens: int | None = None,  # fewer than num_draft_tokens near max_length
        prefixes: list[torch.Tensor] | None = None,  # per row, the real sequence (for the processors)
        rows: list[int] | None = None,  # original batch index of each row (with `prefixes`)
    ) -> tuple[torch.LongTensor, torch.Tensor]:  # [batch, seq + k], [batch, k, vocab]
        """Draft k tokens per row. `input_ids` may contain masked holes (batched decoding); the
        logits processors then see each row's real sequence, `prefixes`, plus its drafts so far."""
        k = self.num_draft_tokens if num_tokens is None else min(num_tokens, self.num_draft_tokens)
        ids, mask, scores = input_ids, attention_mask, []
        processor = self.logits_processor if prefixes is None else [self.row_processors[r] for r in rows]
        for _ in range(k):
            # Forward over what the draft cache lacks: the whole prompt on the first round, then the
            # last emitted token (plus the last draft token after an all-accepted round), then one.
            logits = extend(self.model, self.cache, ids, mask, num_logits=1)[:, -1]  # [batch, vocab]
            self.forwards += 1
            step_prefixes = ids if prefixes is None else with_drafts(prefixes, ids[:, input_ids.shape[1] :])
            step_scores = process_logits(processor, step_prefixes, logits)  # [batch, vocab]
            token = select_token(step_scores, self.do_sample, self.generator)  # [batch]
            scores.append(step_scores)
            ids = torch.cat([ids, token[:, None]], dim=-1)
            if mask is not None:
                mask = torch.nn.functional.pad(mask, (0, 1), value=1)
        vocab = self.model.get_output_embeddings().weight.shape[0]
        empty = input_ids.new_empty((input_ids.shape[0], 0, vocab), dtype=torch.float32)
        return ids, torch.stack(scores, dim=1) if scores else empty

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Constant draft length for now; adaptive drafting hooks in here."""

