"""The `custom_generate` entry point: exact speculative decoding inside `model.generate`.

    out = target.generate(**inputs, custom_generate=hf_specdec.speculative_generate,
                          assistant=draft, num_draft_tokens=5, do_sample=True, temperature=0.7)

`generate()` prepares everything as for plain decoding (GenerationConfig, the LogitsProcessorList,
stopping criteria, a DynamicCache for the target) and hands it to `speculative_generate`, which
runs rounds of: draft k tokens, verify them with one target forward, accept a prefix, roll both
caches back, emit. Output is distributed exactly as plain sampling from the target (greedy: token
for token identical to plain greedy).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .batch import RaggedBatch
from .cache import check_cache, extend, make_rollbackable, new_cache, rollback
from .candidates import DraftCandidateGenerator, with_draft_temperature
from .config import SpeculativeConfig
from .ngram import ngram_lookup
from .policy import DRAFT, NGRAM, NONE, DraftPolicy
from .sampling import logits_to_probs, process_positions, row_pipelines
from .stats import AcceptanceSink, AcceptanceStats, RoundRecord, open_sink
from .verify import greedy_verification, speculative_sampling

logger = logging.getLogger(__name__)


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """transformers' decoder-only generate output, plus `acceptance` (an `AcceptanceStats`)."""

    acceptance: AcceptanceStats | None = None  # the whole batch
    acceptance_per_row: list[AcceptanceStats] | None = None  # one per input row


def speculative_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,  # [batch, prompt_len]
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: BaseStreamer | None = None,
    # --- hf_specdec's own arguments (transformers forwards unknown generate() kwargs by name) ---
    assistant: PreTrainedModel | None = None,
    num_draft_tokens: int | None = None,
    draft_temperature: float | None = None,
    acceptance_sink: AcceptanceSink | None = None,
    generator: torch.Generator | None = None,
    candidate_generator: CandidateGenerator | None = None,
    spec_streamer: BaseStreamer | None = None,
    adaptive: bool | None = None,
    ngram: bool | None = None,
    draft_vocab_size: int | None = None,
    draft_cost: float | None = None,
    speculative_config: SpeculativeConfig | None = None,
    **model_kwargs: Any,
) -> SpeculativeDecoderOnlyOutput | torch.LongTensor:
    """Speculative decoding as a transformers custom generation strategy.

    Args (beyond those `generate()` passes to every decoding method):
        assistant: the draft model; must share the target's vocabulary.
        num_draft_tokens: draft-model tokens per round: the maximum with `adaptive` (default 8), the
            exact count without.
        draft_temperature: optional temperature for the draft only (q hotter or colder than p).
        acceptance_sink: a callable receiving one `RoundRecord` per round, or a path that gets
            them as JSON Lines.
        generator: a `torch.Generator` for all sampling (seeded runs repeat exactly).
        candidate_generator: a transformers `CandidateGenerator` to use instead of `assistant`.
            If it returns no logits, its proposals are point masses (q = one-hot), which is exact.
        spec_streamer: a streamer (e.g. `TextStreamer`). transformers does not forward `streamer=`
            to a `custom_generate` *callable*, so pass it under this name; the directory form
            (`hf_specdec.CUSTOM_GENERATE_DIR`) accepts the standard `streamer=`.
        adaptive: cost-model draft lengths, early stop, fallback to plain rounds (default True).
        ngram: hybrid drafts, n-gram lookup proposals as point masses (default True; one row only).
        draft_vocab_size: reduced-vocabulary draft head (default None: the full vocabulary).
        draft_cost: pin the draft/target cost ratio instead of measuring it.
        speculative_config: a `SpeculativeConfig` with all of the above; explicit arguments override it.

    Returns the sequences tensor, or with `return_dict_in_generate=True` a
    `SpeculativeDecoderOnlyOutput` whose `acceptance` holds the statistics.
    """
    overrides = dict(
        num_draft_tokens=num_draft_tokens, draft_temperature=draft_temperature, adaptive=adaptive, ngram=ngram,
        draft_vocab_size=draft_vocab_size, draft_cost=draft_cost,
    )
    config = dataclasses.replace(
        speculative_config or SpeculativeConfig(), **{k: v for k, v in overrides.items() if v is not None}
    )
    _validate(model, assistant, candidate_generator, input_ids, generation_config, synced_gpus, model_kwargs)
    if input_ids.shape[0] > 1 and (streamer is not None or spec_streamer is not None):
        raise ValueError("streamers take one row, as in transformers; got a batch of %d rows" % input_ids.shape[0])
    do_sample = bool(generation_config.do_sample)
    target_cache = make_rollbackable(model_kwargs.get("cache") or new_cache(model))
    # The cost model drives the default draft-model generator; a user's own generator drafts as it likes.
    policy = None
    if candidate_generator is None:
        draft_processor = logits_processor
        if config.draft_temperature is not None and do_sample:
            draft_processor = with_draft_temperature(logits_processor, config.draft_temperature)
        policy = DraftPolicy(max_draft_tokens=config.num_draft_tokens, adaptive=config.adaptive, draft_cost=config.draft_cost)
        candidate_generator = DraftCandidateGenerator(
            assistant, draft_processor, config.num_draft_tokens, do_sample, generator, policy=policy
        )
        if config.draft_vocab_size is not None:
            candidate_generator.restrict_vocabulary(_draft_vocabulary(
                config.draft_vocab_size, assistant.get_output_embeddings().weight.shape[0], input_ids, generation_config
            ))
    elif isinstance(candidate_generator, DraftCandidateGenerator):
        candidate_generator.reset()  # a generator passed in may hold the cache of an earlier call
    use_ngram = policy is not None and config.ngram and input_ids.shape[0] == 1
    # Rows that accepted different numbers of tokens get their processors applied row by row.
    target_rows = row_pipelines(logits_processor, input_ids.shape[0]) if input_ids.shape[0] > 1 else None
    if isinstance(candidate_generator, DraftCandidateGenerator):
        candidate_generator.prepare_batch(input_ids.shape[0])
    caches = (target_cache, getattr(candidate_generator, "cache", None))
    # generate() drops an all-ones attention mask; a batch needs one (for holes) all the same.
    batch = RaggedBatch(input_ids, model_kwargs.get("attention_mask"))
    write_record, close_sink = open_sink(acceptance_sink)
    stats = AcceptanceStats()
    row_stats = [AcceptanceStats() for _ in range(input_ids.shape[0])]
    output = _Outputs(generation_config, input_ids.shape[0])
    if streamer is None and spec_streamer is not None:
        # generate() already sent the prompt to a `streamer=` it forwards; not to ours.
        streamer = spec_streamer
        streamer.put(input_ids.cpu())

    draft_warm = False  # the draft's first forward encodes the prompt: not a step to time
    try:
        while batch.size:
            seq_len = batch.ids.shape[1]
            # Never draft past max_length: a round emits at most k + 1 tokens per row.
            k = max(0, min(config.num_draft_tokens, batch.remaining(generation_config.max_length) - 1))
            real = batch.real_sequences()  # what processors see: tensor, or one sequence per row
            processor = logits_processor if isinstance(real, torch.Tensor) else [target_rows[r] for r in batch.rows]

            # 1. Draft: the cost model picks the source (draft model, n-gram lookup, or nothing: a plain
            #    step); then k candidate tokens per row and the processed draft scores they were drawn
            #    from (None for n-gram proposals: point masses).
            source, confidences = DRAFT, None
            draft_start = _clock(model.device)
            forwards_before = getattr(candidate_generator, "forwards", 0)
            if policy is not None:
                proposal = None
                if use_ngram and k > 0:
                    proposal, _ = ngram_lookup(
                        batch.real_sequence(0)[0], config.ngram_max_size, config.ngram_min_size,
                        min(config.ngram_max_tokens, batch.remaining(generation_config.max_length) - 1),
                    )
                source, length = policy.plan(0 if proposal is None else proposal.shape[0]) if k > 0 else (NONE, 0)
            if source == NGRAM:
                candidate_ids, draft_scores = torch.cat([batch.ids, proposal[None, :length]], dim=1), None
            elif source == NONE:
                candidate_ids, draft_scores = batch.ids, None
            else:
                candidate_ids, draft_scores = _get_candidates(candidate_generator, batch, k, real)
                confidences = getattr(candidate_generator, "last_confidences", None)
            draft_seconds = _clock(model.device) - draft_start
            draft_forwards = getattr(candidate_generator, "forwards", 0) - forwards_before
            draft_tokens = candidate_ids[:, seq_len:]  # [active, k]
            k = draft_tokens.shape[1]

            # 2. Verify: one target forward over the pending column(s) plus the k drafts; then the
            #    target's scores at each position, each with its row's own prefix.
            # 3. Accept: per row, the longest acceptable prefix plus one recovered or bonus token.
            target_start = _clock(model.device)
            target_logits = extend(model, target_cache, candidate_ids, _pad_mask(batch.mask, k), num_logits=k + 1)
            draft_probs = target_probs = None
            if do_sample:
                draft_probs = _draft_probs(draft_scores, draft_tokens, target_logits.shape[-1])  # [active, k, vocab]
                num_accepted, emitted, target_scores, target_probs = _verify_sampling(
                    processor, real, draft_tokens, draft_probs, target_logits, generator
                )  # target_scores: [active, positions processed <= k + 1, vocab]
            else:
                target_scores = process_positions(processor, real, draft_tokens, target_logits)  # [active, k + 1, vocab]
                num_accepted, emitted = greedy_verification(draft_tokens, target_scores)
            target_seconds = _clock(model.device) - target_start

            # 4. Roll back: both caches keep the draft columns some row accepted (the others' slots
            #    there become masked holes); columns every row rejected are cropped.
            m = int(num_accepted.max())
            rollback(caches, seq_len + m)
            rows = torch.arange(batch.size, device=emitted.device)
            batch.append_round(draft_tokens[:, :m], num_accepted, emitted[rows, num_accepted])
            candidate_generator.update_candidate_strategy(batch.ids, target_scores, m)
            if policy is not None:
                if stats.rounds > 0 and (draft_forwards == 0 or draft_warm):  # skip prefills: not steps
                    policy.observe_timing(draft_seconds, draft_forwards, target_seconds, k + 1)
                draft_warm = draft_warm or draft_forwards > 0
                policy.observe_round(source, k, num_accepted.tolist(), confidences)

            # 5. Emit, row by row and token by token through the stopping criteria, so that a stop
            #    inside the block (EOS, max_length, a user criterion) ends that row exactly there.
            finished = []
            for i, row in enumerate(batch.rows):
                n = int(num_accepted[i])
                num_emitted, done = _emit(batch, i, emitted[i, : n + 1].tolist(), target_scores[i], stopping_criteria)
                finished.append(done)
                output.add(row, target_scores[i, :num_emitted], target_logits[i, :num_emitted])
                if streamer is not None:
                    streamer.put(torch.tensor(batch.generated[row][-num_emitted:]))

                # 6. Record.
                for counters in (stats, row_stats[row]):
                    counters.record(k, n, num_emitted)
                row_stats[row].rounds += 1
                if write_record is not None:
                    write_record(
                        RoundRecord(
                            round=stats.rounds,
                            row=row,
                            draft_tokens=draft_tokens[i].tolist(),
                            num_accepted=n,
                            emitted_tokens=batch.generated[row][-num_emitted:],
                            expected_acceptance=_expected_acceptance(draft_probs, target_probs, i),
                            draft_seconds=draft_seconds,
                            target_seconds=target_seconds,
                            source=source,
                        )
                    )
            stats.rounds += 1
            stats.ngram_rounds += source == NGRAM
            stats.plain_rounds += source == NONE
            stats.target_forwards += 1
            stats.draft_seconds += draft_seconds
            stats.target_seconds += target_seconds

            # 7. Finished rows leave the batch; holes are compacted away when they pile up.
            if any(finished):
                keep = torch.tensor([i for i, done in enumerate(finished) if not done], dtype=torch.long)
                batch.select(keep.to(batch.ids.device), caches)
            if batch.should_compact():
                batch.compact(caches)
    finally:
        close_sink()
    stats.draft_forwards = getattr(candidate_generator, "forwards", 0)
    if streamer is not None:
        streamer.end()
    logger.debug(
        "speculative_generate: %d rounds, acceptance %.3f, %.2f tokens/round",
        stats.rounds,
        stats.acceptance_rate,
        stats.mean_tokens_per_round,
    )

    sequences = batch.sequences(_pad_token_id(generation_config))
    if not generation_config.return_dict_in_generate:
        return sequences
    scores, logits = output.stacked()
    return SpeculativeDecoderOnlyOutput(
        sequences=sequences,
        scores=scores,
        logits=logits,
        cache=target_cache,
        acceptance=stats,
        acceptance_per_row=row_stats,
    )


def _draft_vocabulary(
    size: int, vocab: int, input_ids: torch.Tensor, generation_config: GenerationConfig
) -> torch.Tensor:
    """Token ids the reduced draft head scores: ids below `size`, the prompt's tokens, EOS tokens."""
    eos = generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    parts = [torch.arange(min(size, vocab), device=input_ids.device), input_ids.flatten(), torch.tensor(eos, dtype=torch.long, device=input_ids.device)]
    return torch.cat(parts).unique()


def _clock(device: torch.device) -> float:
    """Wall time after the device's queued work: CUDA runs asynchronously, so sync before reading."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _get_candidates(
    candidate_generator: CandidateGenerator,
    batch: RaggedBatch,
    k: int,
    real: torch.Tensor | list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [active, seq + k'], [active, k', vocab] or None
    if k == 0:
        return batch.ids, None
    if isinstance(candidate_generator, DraftCandidateGenerator):
        prefixes = None if isinstance(real, torch.Tensor) else real
        return candidate_generator.get_candidates(batch.ids, batch.mask, num_tokens=k, prefixes=prefixes, rows=batch.rows)
    candidate_ids, candidate_logits = candidate_generator.get_candidates(batch.ids)
    # A foreign generator may propose more than fits before max_length: keep the first k.
    keep = batch.ids.shape[1] + k
    return candidate_ids[:, :keep], None if candidate_logits is None else candidate_logits[:, :k]


def _verify_sampling(
    processor,
    real: torch.Tensor | list[torch.Tensor],
    draft_tokens: torch.Tensor,  # [active, k]
    draft_probs: torch.Tensor,  # [active, k, vocab]: q
    target_logits: torch.Tensor,  # [active, k + 1, vocab]: raw
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rejection rule with p computed lazily, chunk by chunk (positions [0, 4), then 8 more, ...),
    until every row has rejected a draft or reached the bonus position. Positions after a row's
    first rejection never matter, and processing one costs a full-vocabulary pass (top-p sorts the
    vocabulary): with 16-token n-gram proposals that is most of a round's processing.

    Exact: the rule tests draft i with its own uniform draw given that 1..i-1 were accepted, so
    testing a chunk, and continuing with the next chunk when all of it was accepted, is the same
    test. When a chunk is all accepted, the token the rule drew from p at the chunk's last position
    (a would-be bonus) is discarded and that position's draft is tested in the next chunk instead.

    Returns num_accepted [active], emitted [active, k + 1] (accepted drafts, then the recovered or
    bonus token, then -1), the processed target scores and probabilities of the positions computed.
    """
    rows, k = draft_tokens.shape
    num_accepted = torch.zeros(rows, dtype=torch.long, device=draft_tokens.device)
    final = torch.full((rows,), -1, dtype=torch.long, device=draft_tokens.device)
    done = torch.zeros(rows, dtype=torch.bool, device=draft_tokens.device)
    scores, probs = [], []
    start, chunk = 0, 4  # the first draft position this chunk tests
    while True:
        have = sum(s.shape[1] for s in scores)
        end = min(k + 1, start + chunk)  # p is needed at positions [start, end)
        if end > have:
            new = process_positions(processor, real, draft_tokens, target_logits, start=have, stop=end)
            scores.append(new)
            probs.append(logits_to_probs(new))
        p = torch.cat(probs, dim=1)[:, start:end]  # [active, end - start, vocab]
        n, emitted = speculative_sampling(draft_tokens[:, start : end - 1], draft_probs[:, start : end - 1], p, generator)
        open_rows = ~done
        rejected = n < end - 1 - start
        finish = open_rows & (rejected | (end == k + 1))
        num_accepted = torch.where(open_rows, start + n, num_accepted)
        final = torch.where(finish, emitted.gather(1, n[:, None])[:, 0], final)
        done |= finish
        if bool(done.all()):
            break
        start, chunk = end - 1, 2 * chunk
    emitted = torch.cat([draft_tokens, draft_tokens.new_full((rows, 1), -1)], dim=1)
    emitted[torch.arange(rows, device=emitted.device), num_accepted] = final
    emitted[torch.arange(k + 1, device=emitted.device)[None, :] > num_accepted[:, None]] = -1
    return num_accepted, emitted, torch.cat(scores, dim=1), torch.cat(probs, dim=1)


def _draft_probs(
    draft_scores: torch.Tensor | None,  # [batch, k, vocab] processed draft scores, or None
    draft_tokens: torch.Tensor,  # [batch, k]
    vocab: int,
) -> torch.Tensor:  # [batch, k, vocab]: q
    """q: softmax of the processed draft scores, or a point mass on each proposal when the candidate
    generator gives no distribution (e.g. n-gram lookup). A point mass is a valid q: the rule then
    accepts x with probability min(1, p(x)) and the residual is p with x removed, renormalised."""
    if draft_scores is None:
        return torch.nn.functional.one_hot(draft_tokens, vocab).float()
    return logits_to_probs(draft_scores)


def _expected_acceptance(
    draft_probs: torch.Tensor | None,  # [active, k, vocab]
    target_probs: torch.Tensor | None,  # [active, k + 1, vocab]
    i: int,
) -> list[float] | None:
    """sum_t min(p(t), q(t)) = 1 - TV(p, q) per draft position of active row i (sampling only), for
    the positions whose p was computed: every reached position, and perhaps a few after it."""
    if draft_probs is None:
        return None
    k = min(draft_probs.shape[1], target_probs.shape[1])
    return torch.minimum(target_probs[i, :k], draft_probs[i, :k]).sum(-1).tolist()


def _emit(
    batch: RaggedBatch,
    i: int,  # active row
    tokens: list[int],  # accepted tokens plus the recovered/bonus token
    scores: torch.Tensor,  # [>= len(tokens), vocab]: the target scores they were chosen under
    stopping_criteria: StoppingCriteriaList,
) -> tuple[int, bool]:
    """Append tokens to row i one at a time; stop right after the first a criterion stops on."""
    generated = batch.generated[batch.rows[i]]
    for j, token in enumerate(tokens):
        generated.append(token)
        if bool(stopping_criteria(batch.real_sequence(i), scores[j : j + 1]).all()):
            return j + 1, True
    return len(tokens), False


def _pad_token_id(generation_config: GenerationConfig) -> int:
    """Finished rows are padded like transformers pads them: pad token, else EOS."""
    for candidate in (generation_config.pad_token_id, generation_config.eos_token_id):
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def _pad_mask(mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if mask is None else torch.nn.functional.pad(mask, (0, n), value=1)


class _Outputs:
    """Per-emitted-token scores and logits, per row, collected only when the user asked for them."""

    def __init__(self, generation_config: GenerationConfig, batch: int):
        want = generation_config.return_dict_in_generate
        self.scores = [[] for _ in range(batch)] if want and generation_config.output_scores else None
        self.logits = [[] for _ in range(batch)] if want and generation_config.output_logits else None

    def add(self, row: int, scores: torch.Tensor, logits: torch.Tensor) -> None:  # [n, vocab] each
        if self.scores is not None:
            self.scores[row].extend(scores.unbind(0))
        if self.logits is not None:
            self.logits[row].extend(logits.float().unbind(0))

    def stacked(self) -> tuple[tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None]:
        """One [batch, vocab] tensor per generated position, like transformers; a row that had
        already finished gets -inf there (it emitted no token)."""
        return self._stack(self.scores), self._stack(self.logits)

    @staticmethod
    def _stack(per_row: list[list[torch.Tensor]] | None) -> tuple[torch.Tensor, ...] | None:
        if per_row is None:
            return None
        template = next(t for row in per_row for t in row)
        filler = torch.full_like(template, -float("inf"))
        longest = max(len(row) for row in per_row)
        return tuple(
            torch.stack([row[t] if t < len(row) else filler for row in per_row]) for t in range(longest)
        )


def _validate(
    model: PreTrainedModel,
    assistant: PreTrainedModel | None,
    candidate_generator: CandidateGenerator | None,
    input_ids: torch.Tensor,
    generation_config: GenerationConfig,
    synced_gpus: bool,
    model_kwargs: dict[str, Any],
) -> None:
    """Clear errors for what this decode loop cannot do correctly."""
    if assistant is None and candidate_generator is None:
        raise ValueError(
            "speculative_generate needs a draft model: pass `assistant=draft_model` to generate() "
            "(transformers consumes `assistant_model=` itself before a custom_generate callable sees it)."
        )
    if model.config.is_encoder_decoder:
        raise ValueError("hf_specdec supports decoder-only models; the target is an encoder-decoder model.")
    if generation_config.num_beams != 1:
        raise ValueError(
            f"hf_specdec does not support beam search (num_beams={generation_config.num_beams}); "
            "it implements greedy and multinomial sampling only."
        )
    if getattr(generation_config, "num_return_sequences", 1) not in (None, 1):
        raise ValueError("hf_specdec does not support num_return_sequences > 1 yet.")
    if input_ids.shape[0] != 1 and candidate_generator is not None and not isinstance(
        candidate_generator, DraftCandidateGenerator
    ):
        raise ValueError(
            f"a custom candidate_generator runs one row at a time, got a batch of {input_ids.shape[0]} rows."
        )
    if synced_gpus:
        raise ValueError("hf_specdec does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP generation).")
    for flag in ("output_attentions", "output_hidden_states"):
        if generation_config.return_dict_in_generate and getattr(generation_config, flag, False):
            raise ValueError(f"hf_specdec does not return attentions or hidden states ({flag}=True).")
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(
            f"hf_specdec supports DynamicCache only, got cache_implementation={generation_config.cache_implementation!r}."
        )
    check_cache(model_kwargs.get("cache"), "target")
    if assistant is not None:
        if assistant.config.is_encoder_decoder:
            raise ValueError("the draft model (assistant) must be decoder-only.")
        target_vocab = model.get_output_embeddings().weight.shape[0]
        draft_vocab = assistant.get_output_embeddings().weight.shape[0]
        if target_vocab != draft_vocab:
            raise ValueError(
                f"vocabulary mismatch: the target scores {target_vocab} tokens but the draft scores {draft_vocab}. "
                "Speculative decoding needs a draft that shares the target's tokenizer and vocabulary."
            )
        if assistant.device != model.device:
            raise ValueError(f"the draft is on {assistant.device} but the target is on {model.device}; move them together.")
