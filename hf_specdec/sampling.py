"""Logits -> processed scores -> probabilities -> token: the one path both models go through.

The draft's q and the target's p are computed by the same two functions with the same
`LogitsProcessorList` (the one `generate()` builds from the GenerationConfig: temperature, top-k,
top-p, min-p, repetition penalty, no-repeat n-gram, bad words, ...), each time with the prefix the
token at that position actually follows. That is what makes q and p comparable: a processor that
is applied to one and not the other (or with another prefix) silently breaks exactness.
"""

from __future__ import annotations

from typing import Callable

import torch

# A LogitsProcessorList or anything with the same call signature: (input_ids, scores) -> scores.
Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def process_logits(
    processor: Processor | None,
    prefix_ids: torch.Tensor,  # [batch, prefix_len]: the tokens this position follows
    logits: torch.Tensor,  # [batch, vocab]: raw model logits for the next token
) -> torch.Tensor:  # [batch, vocab] float32 scores
    """Apply the generation-config pipeline to one position, as `generate()` does."""
    scores = logits.float()
    return processor(prefix_ids, scores) if processor is not None else scores


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
