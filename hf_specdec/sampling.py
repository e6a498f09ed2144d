"""Logits -> processed scores -> probabilities -> token: the one path both models go through.

The draft's q and the target's p are computed by the same two functions with the same
`LogitsProcessorList` (the one `generate()` builds from the GenerationConfig: temperature, top-k,
top-p, min-p, repetition penalty, no-repeat n-gram, bad words, ...), each time with the prefix the
token at that position actually follows. That is what makes q and p comparable: a processor that
is applied to one and not the other (or with another prefix) silently breaks exactness.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor
from transformers.generation import logits_process as lp

# transformers processors that treat every row alike and keep no per-row state: safe to apply to a
# single row. (Repetition penalty keeps per-row padding lengths; `row_pipelines` slices them.)
ROW_INDEPENDENT = tuple(
    getattr(lp, name)
    for name in (
        "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TopHLogitsWarper",
        "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "NoRepeatNGramLogitsProcessor",
        "NoBadWordsLogitsProcessor", "SequenceBiasLogitsProcessor", "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor", "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor",
        "InfNanRemoveLogitsProcessor", "ExponentialDecayLengthPenalty", "LogitNormalization",
        "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor",
    )
    if hasattr(lp, name)
)

# Processors that never read input_ids: one call can process many positions' scores at once.
PREFIX_FREE = tuple(
    getattr(lp, name)
    for name in (
        "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TopHLogitsWarper",
        "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "InfNanRemoveLogitsProcessor",
        "LogitNormalization",
    )
    if hasattr(lp, name)
)

# A LogitsProcessorList or anything with the same call signature: (input_ids, scores) -> scores.
Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def process_logits(
    processor: Processor | Sequence[Processor] | None,
    prefix_ids: torch.Tensor | Sequence[torch.Tensor],  # [batch, prefix_len], or one [len_b] per row
    logits: torch.Tensor,  # [batch, vocab]: raw model logits for the next token
) -> torch.Tensor:  # [batch, vocab] float32 scores
    """Apply the generation-config pipeline to one position, as `generate()` does.

    In a batch, rows may have generated different numbers of tokens. `prefix_ids` is then a list of
    per-row prefixes and `processor` a list of per-row pipelines (`row_pipelines`), applied row by
    row: padding the prefixes to one length would change what processors such as repetition
    penalty or min-length see.
    """
    scores = logits.to(torch.float32, copy=True)  # some processors write in place; keep raw logits intact
    if isinstance(prefix_ids, torch.Tensor):
        return processor(prefix_ids, scores) if processor else scores
    return torch.cat(
        [pipeline(p[None], scores[b : b + 1]) if pipeline else scores[b : b + 1]
         for b, (pipeline, p) in enumerate(zip(processor, prefix_ids))]
    )


def process_positions(
    processor: Processor | Sequence[Processor] | None,
    real: torch.Tensor | Sequence[torch.Tensor],  # [batch, seq], or one [len_b] per row
    draft_tokens: torch.Tensor,  # [batch, k]
    logits: torch.Tensor,  # [batch, k + 1, vocab]: raw logits after real, real + d1, ..., real + d1..dk
    start: int = 0,
    stop: int | None = None,
) -> torch.Tensor:  # [batch, stop - start, vocab] float32 scores
    """`process_logits` at positions start..stop-1 of the k + 1, each with its own prefix (real + the
    drafts before it). When no processor reads the prefix (temperature, top-k, top-p, ...), the
    positions go through the pipeline in one call: the same row-wise operations, far less per-call
    overhead."""
    stop = logits.shape[1] if stop is None else stop
    logits = logits[:, start:stop]
    batch, positions, vocab = logits.shape
    if (
        isinstance(real, torch.Tensor)
        and isinstance(processor, LogitsProcessorList)
        and all(isinstance(p, PREFIX_FREE) for p in processor)
    ):
        flat = logits.reshape(batch * positions, vocab)
        return process_logits(processor, real.repeat_interleave(positions, dim=0), flat).view(batch, positions, vocab)
    return torch.stack(
        [
            process_logits(processor, with_drafts(real, draft_tokens[:, : start + i]), logits[:, i])
            for i in range(positions)
        ],
        dim=1,
    )


def row_pipelines(processor: LogitsProcessorList | None, batch: int) -> list[LogitsProcessorList | None]:
    """One pipeline per row, for applying processors to rows of different lengths separately.

    Raises for processors whose behaviour may depend on the row's place in the batch, unless we know
    how to take that row's slice (repetition penalty's per-row padding lengths)."""
    if not processor:
        return [processor] * batch
    unknown = [type(p).__name__ for p in processor if not isinstance(p, ROW_INDEPENDENT + (RepetitionPenaltyLogitsProcessor,))]
    if unknown:
        raise ValueError(
            f"batched speculative decoding applies logits processors row by row, and {', '.join(unknown)} "
            "is not known to allow that; run such a generation one row at a time."
        )
    rows = []
    for b in range(batch):
        row = LogitsProcessorList()
        for p in processor:
            if isinstance(p, RepetitionPenaltyLogitsProcessor) and isinstance(p.prompt_ignore_length, torch.Tensor):
                p = copy.copy(p)
                p.prompt_ignore_length = p.prompt_ignore_length[b : b + 1]
            row.append(p)
        rows.append(row)
    return rows


def with_drafts(
    real: torch.Tensor | Sequence[torch.Tensor],  # [batch, seq], or one [len_b] per row
    drafts: torch.Tensor,  # [batch, i]: the draft tokens before the position being scored
) -> torch.Tensor | list[torch.Tensor]:
    """The prefix a drafted position follows: the row's real sequence, then the drafts before it."""
    if isinstance(real, torch.Tensor):
        return torch.cat([real, drafts], dim=1)
    return [torch.cat([r, drafts[b]]) for b, r in enumerate(real)]


def logits_to_probs(scores: torch.Tensor) -> torch.Tensor:  # [..., vocab] -> [..., vocab]
    """Processed scores -> the distribution that is sampled from (temperature etc. are processors)."""
    return torch.softmax(scores.float(), dim=-1)


def sample(
    probs: torch.Tensor,  # [batch, vocab]
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [batch] int64
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def select_token(
    scores: torch.Tensor,  # [batch, vocab]: processed scores
    do_sample: bool,
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [batch] int64
    """Greedy: argmax of the processed scores (what plain greedy `generate` does). Sampling: a draw
    from `logits_to_probs(scores)`."""
    return sample(logits_to_probs(scores), generator) if do_sample else scores.argmax(dim=-1)
