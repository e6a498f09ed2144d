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
from .policy import DraftPolicy
from .sampling import Processor, logits_to_probs, process_logits, row_pipelines, sample, with_drafts

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


class VocabularySubsetHead:
    """The draft's output layer restricted to a token subset: logits outside it are -inf, so q is
    zero there and such tokens are never proposed. Exact for any subset (q is still the distribution
    the draft token was drawn from); only acceptance can suffer, when the target wants a token
    outside the subset. It saves the matrix product over the rest of the vocabulary: for a 0.5B draft
    with a 152k vocabulary, the output layer is over a quarter of the weights read per step.
    """

    def __init__(self, output_embeddings: torch.nn.Module, token_ids: torch.Tensor, vocab: int):
        self.token_ids = token_ids.unique()  # sorted
        self.weight = output_embeddings.weight[self.token_ids].detach().contiguous()  # [subset, hidden]
        bias = getattr(output_embeddings, "bias", None)
        self.bias = None if bias is None else bias[self.token_ids].detach()
        self.vocab = vocab

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
        logits = torch.nn.functional.linear(hidden, self.weight, self.bias)
        full = logits.new_full((*logits.shape[:-1], self.vocab), -float("inf"))
        return full.index_copy_(-1, self.token_ids, logits)


class DraftCandidateGenerator(CandidateGenerator):
    """Proposes up to `num_draft_tokens` tokens per round from a draft model with its own `DynamicCache`.

    `get_candidates(input_ids)` returns `(candidate_ids, candidate_logits)`:
      * candidate_ids:    [batch, seq + k] the input followed by k draft tokens;
      * candidate_logits: [batch, k, vocab] the *processed* draft scores; softmax of row i is q_i,
                          exactly the distribution draft token i was drawn from.
    With a `DraftPolicy`, k is decided while drafting (the policy sees the draft's probability of each
    token it proposed, kept in `last_confidences`). The draft cache (`self.cache`) is rolled back by
    the decode loop, together with the target's.
    """

    def __init__(
        self,
        draft_model: PreTrainedModel,
        logits_processor: Processor | None,
        num_draft_tokens: int,
        do_sample: bool,
        generator: torch.Generator | None = None,
        policy: DraftPolicy | None = None,
    ):
        self.model = draft_model
        self.logits_processor = logits_processor
        self.num_draft_tokens = num_draft_tokens
        self.do_sample = do_sample
        self.generator = generator
        self.policy = policy
        self.head: VocabularySubsetHead | None = None
        self.reset()

    def reset(self) -> None:
        """Forget the previous sequence: a fresh cache and counters (called at the start of generate)."""
        self.cache = new_cache(self.model)
        self.row_processors: list | None = None  # per-row pipelines, for batches (see `prepare_batch`)
        self.forwards = 0  # draft forward passes in this generate call
        self.last_confidences: list[list[float]] = []  # per row, per drafted token: its draft probability

    def prepare_batch(self, batch_size: int) -> None:
        """Per-row processor pipelines, for rows that have generated different numbers of tokens."""
        self.row_processors = row_pipelines(self.logits_processor, batch_size) if batch_size > 1 else None

    def restrict_vocabulary(self, token_ids: torch.Tensor | None) -> None:
        """Draft only tokens in `token_ids` (None: the whole vocabulary)."""
        if token_ids is None:
            self.head = None
            return
        vocab = self.model.get_output_embeddings().weight.shape[0]
        self.head = VocabularySubsetHead(self.model.get_output_embeddings(), token_ids, vocab)

    def get_candidates(
        self,
        input_ids: torch.LongTensor,  # [batch, seq]
        attention_mask: torch.Tensor | None = None,  # [batch, seq]: 0 for padding and holes; None if none
        num_tokens: int | None = None,  # fewer than num_draft_tokens near max_length
        prefixes: list[torch.Tensor] | None = None,  # per row, the real sequence (for the processors)
        rows: list[int] | None = None,  # original batch index of each row (with `prefixes`)
    ) -> tuple[torch.LongTensor, torch.Tensor]:  # [batch, seq + k], [batch, k, vocab]
        """Draft up to k tokens per row. `input_ids` may contain masked holes (batched decoding); the
        logits processors then see each row's real sequence, `prefixes`, plus its drafts so far."""
        k = self.num_draft_tokens if num_tokens is None else min(num_tokens, self.num_draft_tokens)
        ids, mask, scores, confidences = input_ids, attention_mask, [], []
        processor = self.logits_processor if prefixes is None else [self.row_processors[r] for r in rows]
        if self.policy is not None:
            self.policy.start_draft(input_ids.shape[0])
        for j in range(k):
            # Forward over what the draft cache lacks: the whole prompt on the first round, then the
            # last emitted token(s) (several after an all-accepted or an n-gram round), then one.
            logits = extend(self.model, self.cache, ids, mask, num_logits=1, head=self.head)[:, -1]  # [batch, vocab]
            self.forwards += 1
            step_prefixes = ids if prefixes is None else with_drafts(prefixes, ids[:, input_ids.shape[1] :])
            step_scores = process_logits(processor, step_prefixes, logits)  # [batch, vocab]
            if self.do_sample:
                probs = logits_to_probs(step_scores)
                token = sample(probs, self.generator)  # [batch]
                confidence = probs.gather(-1, token[:, None])[:, 0]
            else:
                token = step_scores.argmax(dim=-1)
                confidence = logits_to_probs(step_scores).gather(-1, token[:, None])[:, 0] if self.policy else None
            scores.append(step_scores)
            ids = torch.cat([ids, token[:, None]], dim=-1)
            if mask is not None:
                mask = torch.nn.functional.pad(mask, (0, 1), value=1)
            if confidence is not None:
                confidences.append(confidence.tolist())
            if self.policy is not None and j + 1 < k and not self.policy.keep_drafting(confidences[-1]):
                break
        self.last_confidences = [list(c) for c in zip(*confidences)]
        vocab = self.model.get_output_embeddings().weight.shape[0]
        empty = input_ids.new_empty((input_ids.shape[0], 0, vocab), dtype=torch.float32)
        return ids, torch.stack(scores, dim=1) if scores else empty

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Draft lengths are chosen by `self.policy` (fed by the decode loop), not here."""
