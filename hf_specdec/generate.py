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

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache import check_cache, extend, make_rollbackable, new_cache, rollback
from .candidates import DraftCandidateGenerator, with_draft_temperature
from .config import SpeculativeConfig
from .sampling import logits_to_probs, process_logits
from .stats import AcceptanceSink, AcceptanceStats, RoundRecord, open_sink
from .verify import greedy_verification, speculative_sampling

logger = logging.getLogger(__name__)


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """transformers' decoder-only generate output, plus `acceptance` (an `AcceptanceStats`)."""

    acceptance: AcceptanceStats | None = None


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
    **model_kwargs: Any,
) -> SpeculativeDecoderOnlyOutput | torch.LongTensor:
    """Speculative decoding as a transformers custom generation strategy.

    Args (beyond those `generate()` passes to every decoding method):
        assistant: the draft model; must share the target's vocabulary.
        num_draft_tokens: draft tokens per round (default `SpeculativeConfig.num_draft_tokens`).
        draft_temperature: optional temperature for the draft only (q hotter or colder than p).
        acceptance_sink: a callable receiving one `RoundRecord` per round, or a path that gets
            them as JSON Lines.
        generator: a `torch.Generator` for all sampling (seeded runs repeat exactly).
        candidate_generator: a transformers `CandidateGenerator` to use instead of `assistant`.
            If it returns no logits, its proposals are point masses (q = one-hot), which is exact.
        spec_streamer: a streamer (e.g. `TextStreamer`). transformers does not forward `streamer=`
            to a `custom_generate` *callable*, so pass it under this name; the directory form
            (`hf_specdec.CUSTOM_GENERATE_DIR`) accepts the standard `streamer=`.

    Returns the sequences tensor, or with `return_dict_in_generate=True` a
    `SpeculativeDecoderOnlyOutput` whose `acceptance` holds the statistics.
    """
    config = SpeculativeConfig(
        num_draft_tokens=SpeculativeConfig.num_draft_tokens if num_draft_tokens is None else num_draft_tokens,
        draft_temperature=draft_temperature,
    )
    _validate(model, assistant, candidate_generator, input_ids, generation_config, synced_gpus, model_kwargs)
    do_sample = bool(generation_config.do_sample)
    target_cache = make_rollbackable(model_kwargs.get("cache") or new_cache(model))
    attention_mask = model_kwargs.get("attention_mask")  # [batch, seq] or None (generate drops all-ones masks)
    if candidate_generator is None:
        draft_processor = logits_processor
        if config.draft_temperature is not None and do_sample:
            draft_processor = with_draft_temperature(logits_processor, config.draft_temperature)
        candidate_generator = DraftCandidateGenerator(
            assistant, draft_processor, config.num_draft_tokens, do_sample, generator
        )
    elif isinstance(candidate_generator, DraftCandidateGenerator):
        candidate_generator.reset()  # a generator passed in may hold the cache of an earlier call
    write_record, close_sink = open_sink(acceptance_sink)
    stats = AcceptanceStats()
    output = _Outputs(generation_config)
    if streamer is None and spec_streamer is not None:
        # generate() already sent the prompt to a `streamer=` it forwards; not to ours.
        streamer = spec_streamer
        streamer.put(input_ids.cpu())

    try:
        while True:
            prefix_len = input_ids.shape[1]
            # Never draft past max_length: the round emits at most k + 1 tokens.
            k = max(0, min(config.num_draft_tokens, generation_config.max_length - prefix_len - 1))

            # 1. Draft: k candidate tokens and the processed draft scores they were drawn from.
            draft_start = time.perf_counter()
            candidate_ids, draft_scores = _get_candidates(candidate_generator, input_ids, attention_mask, k)
            draft_seconds = time.perf_counter() - draft_start
            draft_tokens = candidate_ids[:, prefix_len:]  # [batch, k]
            k = draft_tokens.shape[1]
            candidate_mask = _pad_mask(attention_mask, k)

            # 2. Verify: one target forward over the last emitted token(s) plus the k drafts; then the
            #    target's scores at each of the k + 1 positions, each with its own prefix.
            target_start = time.perf_counter()
            target_logits = extend(model, target_cache, candidate_ids, candidate_mask, num_logits=k + 1)
            target_scores = torch.stack(
                [
                    process_logits(logits_processor, candidate_ids[:, : prefix_len + i], target_logits[:, i])
                    for i in range(k + 1)
                ],
                dim=1,
            )  # [batch, k + 1, vocab]
            target_seconds = time.perf_counter() - target_start

            # 3. Accept: the longest acceptable prefix plus one recovered or bonus token.
            draft_probs = _draft_probs(draft_scores, draft_tokens, target_scores.shape[-1]) if do_sample else None
            if do_sample:
                target_probs = logits_to_probs(target_scores)  # [batch, k + 1, vocab]
                num_accepted, emitted = speculative_sampling(draft_tokens, draft_probs, target_probs, generator)
            else:
                num_accepted, emitted = greedy_verification(draft_tokens, target_scores)

            # 4. Roll back: both caches keep the prefix plus the accepted drafts (batch 1: row 0).
            n = int(num_accepted[0])
            rollback((target_cache, getattr(candidate_generator, "cache", None)), prefix_len + n)
            candidate_generator.update_candidate_strategy(input_ids, target_scores, n)

            # 5. Emit, token by token through the stopping criteria, so a stop inside the block
            #    (EOS, max_length, a user criterion) ends the sequence exactly there.
            input_ids, num_emitted, finished = _append_until_stop(
                input_ids, emitted[:, : n + 1], target_scores, stopping_criteria
            )
            attention_mask = _pad_mask(attention_mask, num_emitted)
            output.add(target_scores[:, :num_emitted], target_logits[:, :num_emitted])
            if streamer is not None:
                streamer.put(input_ids[0, -num_emitted:].cpu())

            # 6. Record.
            stats.rounds += 1
            stats.target_forwards += 1
            stats.draft_seconds += draft_seconds
            stats.target_seconds += target_seconds
            stats.record(k, n, num_emitted)
            if write_record is not None:
                write_record(
                    RoundRecord(
                        round=stats.rounds - 1,
                        row=0,
                        draft_tokens=draft_tokens[0].tolist(),
                        num_accepted=n,
                        emitted_tokens=input_ids[0, -num_emitted:].tolist(),
                        expected_acceptance=_expected_acceptance(draft_probs, target_scores),
                        draft_seconds=draft_seconds,
                        target_seconds=target_seconds,
                    )
                )
            if finished:
                break
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

    if not generation_config.return_dict_in_generate:
        return input_ids
    return SpeculativeDecoderOnlyOutput(
        sequences=input_ids, scores=output.scores, logits=output.logits, cache=target_cache, acceptance=stats
    )


def _get_candidates(
    candidate_generator: CandidateGenerator,
    input_ids: torch.Tensor,  # [batch, seq]
    attention_mask: torch.Tensor | None,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [batch, seq + k'], [batch, k', vocab] or None
    if k == 0:
        return input_ids, None
    if isinstance(candidate_generator, DraftCandidateGenerator):
        return candidate_generator.get_candidates(input_ids, attention_mask, num_tokens=k)
    candidate_ids, candidate_logits = candidate_generator.get_candidates(input_ids)
    # A foreign generator may propose more than fits before max_length: keep the first k.
    keep = input_ids.shape[1] + k
    return candidate_ids[:, :keep], None if candidate_logits is None else candidate_logits[:, :k]


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
    draft_probs: torch.Tensor | None,  # [batch, k, vocab]
    target_scores: torch.Tensor,  # [batch, k + 1, vocab]
) -> list[float] | None:
    """sum_t min(p(t), q(t)) per draft position of row 0 (sampling only)."""
    if draft_probs is None:
        return None
    k = draft_probs.shape[1]
    target_probs = logits_to_probs(target_scores[:, :k])
    return torch.minimum(target_probs, draft_probs).sum(-1)[0].tolist()


def _append_until_stop(
    input_ids: torch.Tensor,  # [batch, seq]
    emitted: torch.Tensor,  # [batch, n]
    scores: torch.Tensor,  # [batch, >= n, vocab]
    stopping_criteria: StoppingCriteriaList,
) -> tuple[torch.Tensor, int, bool]:
    """Append emitted tokens one at a time; stop right after the first token a criterion stops on."""
    prefix_len = input_ids.shape[1]
    extended = torch.cat([input_ids, emitted], dim=-1)
    for j in range(emitted.shape[1]):
        if stopping_criteria(extended[:, : prefix_len + j + 1], scores[:, j]).all():
            return extended[:, : prefix_len + j + 1], j + 1, True
    return extended, emitted.shape[1], False


def _pad_mask(mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if mask is None else torch.nn.functional.pad(mask, (0, n), value=1)


class _Outputs:
    """Per-emitted-token scores and logits, collected only when the user asked for them."""

    def __init__(self, generation_config: GenerationConfig):
        want = generation_config.return_dict_in_generate
        self.scores = () if want and generation_config.output_scores else None
        self.logits = () if want and generation_config.output_logits else None

    def add(self, scores: torch.Tensor, logits: torch.Tensor) -> None:  # [batch, n, vocab] each
        if self.scores is not None:
            self.scores += tuple(scores.unbind(dim=1))
        if self.logits is not None:
            self.logits += tuple(logits.float().unbind(dim=1))


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
        raise ValueError("hf_specdec does not support num_return_sequences > 1 yet (it runs one row).")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"hf_specdec currently runs batch size 1, got a batch of {input_ids.shape[0]} rows; "
            "generate the rows one at a time."
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
