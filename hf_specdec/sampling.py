"""Logits -> processed scores -> probabilities -> token: the one path both models go through.

The draft's q and the target's p are computed by the same `RowProcessors` type with the same
`LogitsProcessorList` (the one `generate()` builds from the GenerationConfig: temperature, top-k,
top-p, min-p, repetition penalty, no-repeat n-gram, bad words, ...), each time with the prefix the
token at that position actually follows. That is what makes q and p comparable: a processor that
is applied to one and not the other (or with another prefix) silently breaks exactness.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor
from transformers.generation import logits_process as lp

from .verify import SPARSE_FRACTION, draw, reads_are_free

# Dense top-p (no top-k before it): the highest entries among which the cut is sought, and how near a
# candidate's remaining mass may come to 1 - top_p before transformers' own code decides (its float32
# sums over the sorted vocabulary and ours over the candidates differ by far less than this).
NUCLEUS_CANDIDATES = 256  # the real target's nucleus at T 0.7, top-p 0.95: median 1 token, largest 174 of 352
NUCLEUS_MARGIN = 1e-4

# transformers processors that treat every row alike and keep no per-row state: safe to apply to a
# single row. (Repetition penalty keeps per-row padding lengths; `RowProcessors` slices them.)
ROW_INDEPENDENT = tuple(
    getattr(lp, name)
    for name in (
        "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TopHLogitsWarper",
        "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "NoRepeatNGramLogitsProcessor",
        "NoBadWordsLogitsProcessor", "SequenceBiasLogitsProcessor", "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor", "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor",
        "InfNanRemoveLogitsProcessor", "ExponentialDecayLengthPenalty", "LogitNormalization",
        "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor",
        "WatermarkLogitsProcessor",  # its greenlist is seeded from the row's last tokens at every call
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

# transformers processors that keep state between calls or read the batch as pairs of rows. A
# speculative round calls the pipeline at several positions, for both models, and rolls back what
# the target rejects, so such a processor would see other calls than plain decoding makes and the
# output would silently differ (classifier-free guidance: `guidance_scale` runs its own forward over
# the unconditional prompt and keeps that cache). Refused, with a row or a batch.
STATEFUL = tuple(
    getattr(lp, name)
    for name in (
        "UnbatchedClassifierFreeGuidanceLogitsProcessor", "ClassifierFreeGuidanceLogitsProcessor",
        "WhisperTimeStampLogitsProcessor", "WhisperNoSpeechDetection", "AlternatingCodebooksLogitsProcessor",
        "DiaEOSDelayPatternLogitsProcessor", "DiaClassifierFreeGuidanceLogitsProcessor",
        "SynthIDTextWatermarkLogitsProcessor",  # counts its calls and keeps a context history
    )
    if hasattr(lp, name)
)

# A LogitsProcessorList or anything with the same call signature: (input_ids, scores) -> scores.
Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Prefixes:
    """What the logits processors see for each active row: its real sequence (prompt with its left
    padding, then what it generated), exactly as plain `generate()` would show it; never the work
    sequence with its masked holes.

    `stacked` is the same as one [rows, len] tensor when every row has the same length (always for
    a single row, and for a batch until rows accept different numbers of tokens)."""

    sequences: tuple[torch.Tensor, ...]  # one [len_b] per active row
    rows: tuple[int, ...]  # the original batch index of each active row
    stacked: torch.Tensor | None  # [rows, len], or None when the lengths differ

    @classmethod
    def of(cls, sequences: list[torch.Tensor], rows: list[int]) -> "Prefixes":
        same = len({s.shape[0] for s in sequences}) == 1
        return cls(tuple(sequences), tuple(rows), torch.stack(sequences) if same else None)

    @classmethod
    def from_tensor(cls, ids: torch.Tensor, rows: list[int]) -> "Prefixes":  # ids: [rows, len]
        return cls(tuple(ids.unbind(0)), tuple(rows), ids)


class RowProcessors:
    """One logits-processor pipeline, applied to each active row with that row's own prefix.

    Rows of a batch may have generated different numbers of tokens; padding their prefixes to one
    length would change what processors such as repetition penalty or min-length see, so such rows
    are processed one by one with per-row pipelines (built once, here). Rows whose prefixes have one
    length go through the batched pipeline in one call.
    """

    def __init__(self, processor: LogitsProcessorList | None, batch_size: int):
        check_stateless(processor)
        self.pipeline = _fast(processor)
        self.per_row = _row_pipelines(self.pipeline, batch_size) if batch_size > 1 else [self.pipeline]
        pipeline = list(self.pipeline or [])
        # by exact type: a subclass of a warper may read input_ids or its rows (a processor of the user's)
        self.prefix_free = all(type(p) in PREFIX_FREE + (SparseTopPLogitsWarper,) for p in pipeline)
        self.row_independent = all(type(p) in ROW_INDEPENDENT + (SparseTopPLogitsWarper,) for p in pipeline)
        self.batch_size = batch_size

    def add_row(self) -> None:
        """A row joins the batch (continuous batching) with an unpadded prompt of its own: its
        pipeline is the batch's, with no padding for repetition penalty to skip."""
        row = None
        if self.pipeline is not None:
            _check_row_safe(self.pipeline)
            row = _row_pipeline(self.pipeline, lambda ignored: torch.zeros_like(ignored[:1]))
        self.per_row.append(row)
        self.batch_size = -1  # the batch pipeline's per-row state no longer matches any set of rows

    def scores(
        self,
        prefixes: Prefixes,
        drafts: torch.Tensor,  # [rows, i]: the draft tokens between the real prefix and this position
        logits: torch.Tensor,  # [rows, vocab]: raw model logits for the next token
    ) -> torch.Tensor:  # [rows, vocab] float32 scores
        """The pipeline at one position, as `generate()` applies it."""
        if self.pipeline is None:
            return logits.float()
        scores = logits.to(torch.float32, copy=True)  # processors may write in place; keep raw logits intact
        if prefixes.stacked is not None and (self.row_independent or len(prefixes.rows) == self.batch_size):
            return self.pipeline(torch.cat([prefixes.stacked, drafts], dim=1), scores)
        return torch.cat(
            [
                self.per_row[row](torch.cat([seq, drafts[b]])[None], scores[b : b + 1])
                for b, (row, seq) in enumerate(zip(prefixes.rows, prefixes.sequences))
            ]
        )

    def positions(
        self,
        prefixes: Prefixes,
        drafts: torch.Tensor,  # [rows, k]
        logits: torch.Tensor,  # [rows, n, vocab]: raw logits at positions start..start+n-1 of the k + 1
        start: int = 0,
    ) -> torch.Tensor:  # [rows, n, vocab] float32 scores
        """The pipeline at several positions, each with its own prefix (real + the drafts before it).
        When no processor reads the prefix (temperature, top-k, top-p, ...), all positions go through
        the pipeline in one call: the same row-wise operations, far less per-call overhead."""
        rows, n, vocab = logits.shape
        if self.pipeline is None:
            return logits.float()
        if self.prefix_free:
            flat = logits.reshape(rows * n, vocab).to(torch.float32, copy=True)
            any_prefix = drafts.new_zeros((rows * n, 1))  # never read
            return self.pipeline(any_prefix, flat).view(rows, n, vocab)
        return torch.stack(
            [self.scores(prefixes, drafts[:, : start + i], logits[:, i]) for i in range(n)], dim=1
        )


class SparseTopPLogitsWarper(lp.TopPLogitsWarper):
    """transformers' top-p, without sorting the whole vocabulary.

    transformers' `TopPLogitsWarper` sorts all 152k entries (Qwen2.5) at every position: 9 to 12 ms
    on one core of this project's CPU, 5% of a target step for each position scored. Its rule
    (ascending sort, softmax, cumulative sum, remove where the sum is at most 1 - top_p, keep at least
    min_tokens_to_keep) keeps a token exactly when the tokens above it hold less than top_p, so only
    the top of the order matters. On the CPU this computes the same rule on fewer entries:

    - when every row has at most SPARSE_FRACTION of the vocabulary finite (after top-k or min-p), it
      sorts just the finite entries (the -inf ones can never be kept);
    - otherwise it takes the NUCLEUS_CANDIDATES highest (`topk`, 0.3 ms) with their probabilities
      under the whole vocabulary's normaliser, and cuts among them where the mass above reaches top_p.
      A row whose nucleus reaches past the candidates is left to transformers' own code.

    Both fall back to transformers' code, so that ties are broken and sums rounded as it does them:
    a row where tied scores straddle the cut (its unstable sort decides which of them survive); in the
    dense case a row where a candidate's remaining mass is within NUCLEUS_MARGIN of 1 - top_p (float32
    sums in another order round differently, by far less); and a filter_value other than -inf. In the
    sparse case the softmax normaliser is a sum over fewer entries, so a token within float32 rounding
    of the cut can still differ. `tests/test_sampling.py` compares both with transformers on random,
    peaked and tied inputs.
    """

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # scores: [rows, vocab]
        vocab = scores.shape[-1]
        if not reads_are_free(scores.device) or vocab < 1024 or self.filter_value != -float("inf"):
            return super().__call__(input_ids, scores)
        finite = int(torch.isfinite(scores).sum(dim=-1).max())
        if 0 < finite <= vocab * SPARSE_FRACTION:
            return self._sparse(input_ids, scores, finite)
        return self._dense(input_ids, scores) if finite > 0 else super().__call__(input_ids, scores)

    def _sparse(self, input_ids: torch.Tensor, scores: torch.Tensor, finite: int) -> torch.Tensor:
        candidates = scores.topk(finite, dim=-1).indices  # [rows, finite]: every finite entry (and some -inf)
        sorted_logits, order = scores.gather(-1, candidates).sort(dim=-1)  # ascending, like transformers
        remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - self.top_p)  # [rows, finite]
        remove[..., -self.min_tokens_to_keep :] = False
        if bool(self._ties_at_cut(sorted_logits, remove.sum(dim=-1, keepdim=True)).any()):
            return super().__call__(input_ids, scores)  # its sort decides which tied tokens survive
        removed = candidates.gather(-1, order).masked_fill(~remove, -1)  # [rows, finite]: token ids, -1 if kept
        out = scores.clone()
        rows = torch.arange(scores.shape[0], device=scores.device)[:, None].expand_as(removed)
        hit = removed >= 0
        out[rows[hit], removed[hit]] = self.filter_value
        return out

    def _dense(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        top, index = scores.topk(min(NUCLEUS_CANDIDATES, scores.shape[-1]), dim=-1)  # [rows, m], descending
        norm = self._normaliser(scores)
        probs = (top.float() - norm).exp()
        below = 1 - (probs.cumsum(dim=-1) - probs)  # transformers' ascending cumulative sum at each candidate
        remove = below <= (1 - self.top_p)
        remove[..., : self.min_tokens_to_keep] = False
        removed = remove.sum(dim=-1, keepdim=True)  # a suffix of the candidates: `below` only falls
        theirs = (~torch.isfinite(norm[:, 0]) | ~remove[:, -1]  # the nucleus reaches past the candidates
                  | ((below - (1 - self.top_p)).abs() < NUCLEUS_MARGIN).any(dim=-1)  # too near the cut to call
                  | self._ties_at_cut(top.flip(-1), removed))  # a tie straddles the cut
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, index, ~remove)
        out = scores.masked_fill(~keep, self.filter_value)
        if bool(theirs.any()):  # those rows by transformers' code (it treats each row alone)
            out[theirs] = super().__call__(input_ids[theirs] if input_ids.shape[0] == scores.shape[0] else input_ids,
                                           scores[theirs])
        return out

    @staticmethod
    def _normaliser(scores: torch.Tensor) -> torch.Tensor:  # [rows, vocab] -> [rows, 1]
        """log of softmax's denominator over the whole vocabulary (the candidates' probabilities are
        their share of all of it, as in transformers' softmax over the sorted vocabulary)."""
        return torch.logsumexp(scores.float(), dim=-1, keepdim=True)

    @staticmethod
    def _ties_at_cut(
        sorted_logits: torch.Tensor,  # [rows, n] ascending
        cut: torch.Tensor,  # [rows, 1]: how many are removed (removal is a prefix of the sorted order)
    ) -> torch.Tensor:  # [rows] bool
        """Per row, whether the last removed and the first kept score are equal (and finite)."""
        n = sorted_logits.shape[-1]
        last_removed = sorted_logits.gather(-1, (cut - 1).clamp_min(0))
        first_kept = sorted_logits.gather(-1, cut.clamp_max(n - 1))
        return ((cut > 0) & (cut < n) & (last_removed == first_kept) & torch.isfinite(first_kept))[:, 0]


class Pipeline(LogitsProcessorList):
    """transformers' `LogitsProcessorList`, reading each processor's call signature once instead of
    at every call. `LogitsProcessorList.__call__` runs `inspect.signature` on every processor every
    time (about 0.1 ms each on a 2-core CPU), and a round calls the pipeline at several positions for
    both models: on the test suite's tiny models with four processors that was 1.0 s of a 7.2 s
    profile of 200 calls. Against the 30-odd ms a sampled round spends outside the forwards with a
    152k vocabulary (`evals/overhead.py`) it is within noise. Same processors, same order, same
    error for a processor whose extra arguments are missing."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        for processor in self:
            extra = self._extra_parameters(processor)
            if not extra:
                scores = processor(input_ids, scores)
                continue
            if not all(name in kwargs for name in extra):
                raise ValueError(
                    f"Make sure that all the required parameters: {['input_ids', 'scores', *extra]} for "
                    f"{processor.__class__} are passed to the logits processor."
                )
            scores = processor(input_ids, scores, **kwargs)
        return scores

    def _extra_parameters(self, processor) -> tuple[str, ...]:
        known = self.__dict__.setdefault("_parameters", {})
        if id(processor) not in known:  # the list holds its processors, so an id is not reused while it does
            known[id(processor)] = tuple(inspect.signature(processor.__call__).parameters)[2:]
        return known[id(processor)]


def _fast(processor: LogitsProcessorList | None) -> LogitsProcessorList | None:
    """The pipeline with transformers' top-p swapped for `SparseTopPLogitsWarper` (same tokens, faster),
    as a `Pipeline` (signatures read once)."""
    if not processor:
        return None
    return Pipeline(
        SparseTopPLogitsWarper(p.top_p, p.filter_value, p.min_tokens_to_keep) if type(p) is lp.TopPLogitsWarper else p
        for p in processor
    )


def _row_pipelines(processor: LogitsProcessorList | None, batch: int) -> list[LogitsProcessorList | None]:
    """One pipeline per row, for applying processors to rows of different lengths separately.

    Raises for processors whose behaviour may depend on the row's place in the batch, unless we know
    how to take that row's slice (repetition penalty's per-row prompt lengths)."""
    if not processor:
        return [None] * batch
    _check_row_safe(processor)
    return [_row_pipeline(processor, lambda ignored, b=b: ignored[b : b + 1]) for b in range(batch)]


def check_stateless(processor: LogitsProcessorList | None) -> None:
    """Raises for a processor that keeps state between calls (`STATEFUL`): its output would differ."""
    stateful = [type(p).__name__ for p in processor or [] if isinstance(p, STATEFUL)]
    if stateful:
        hint = " (set by guidance_scale)" if any("ClassifierFreeGuidance" in name for name in stateful) else ""
        raise ValueError(
            f"{', '.join(stateful)}{hint} keeps state between calls, and speculative decoding calls the logits "
            "processors at several positions per round for both models, so the output would differ from plain "
            "generate(); hf_specdec does not support it: use plain generate() for this generation."
        )


def row_unsafe(processor: LogitsProcessorList | None) -> list[str]:
    """The processors not known to work row by row (each row its own call, as batches and streams run them)."""
    known = ROW_INDEPENDENT + (RepetitionPenaltyLogitsProcessor, SparseTopPLogitsWarper)  # exact types, as in RowProcessors
    return [type(p).__name__ for p in processor or [] if type(p) not in known]


def _check_row_safe(processor: LogitsProcessorList) -> None:
    unknown = row_unsafe(processor)
    if unknown:
        raise ValueError(
            f"batched speculative decoding (several prompts, or num_return_sequences > 1, which repeats each prompt) "
            f"applies logits processors row by row, and {', '.join(unknown)} is not known to allow that; run such a "
            "generation one row at a time (one call per sample)."
        )


def _row_pipeline(
    processor: LogitsProcessorList, padding: Callable[[torch.Tensor], torch.Tensor]
) -> LogitsProcessorList:
    """`processor` for one row: repetition penalty's per-row padding lengths [batch] replaced by
    `padding(lengths)` ([1], that row's)."""
    row = Pipeline()
    for p in processor:
        if isinstance(p, RepetitionPenaltyLogitsProcessor) and isinstance(p.prompt_ignore_length, torch.Tensor):
            p = copy.copy(p)
            p.prompt_ignore_length = padding(p.prompt_ignore_length)
        row.append(p)
    return row


def logits_to_probs(scores: torch.Tensor) -> torch.Tensor:  # [..., vocab] -> [..., vocab]
    """Processed scores -> the distribution that is sampled from (temperature etc. are processors)."""
    return torch.softmax(scores.float(), dim=-1)


def sample(
    probs: torch.Tensor,  # [batch, vocab]
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [batch] int64
    """A draw from each row of `probs` (`hf_specdec.verify.draw`: sparse on the CPU where it can be)."""
    return draw(probs, generator)
