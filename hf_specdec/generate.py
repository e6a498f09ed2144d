"""The `custom_generate` entry point: exact speculative decoding inside `model.generate`.

    out = target.generate(**inputs, custom_generate=hf_specdec.speculative_generate,
                          assistant=draft, num_draft_tokens=5, do_sample=True, temperature=0.7)

`generate()` prepares everything as for plain decoding (GenerationConfig, the LogitsProcessorList,
stopping criteria, a DynamicCache for the target) and hands it to `speculative_generate`, which
checks its arguments (`hf_specdec.arguments`), builds the call's `DecodeState` and runs rounds of
six stages (`hf_specdec.rounds`) until every row has finished. Output is distributed exactly as
plain sampling from the target (greedy: token for token identical to plain greedy).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import Cache, GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import MaxTimeCriteria
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .arguments import (OWN_ARGUMENTS, StreamerNotForwardedError, call_defaults, check_arguments, continuous_settings,
                        draft_model, kept_streamer, refuse_dropped_streamer, validate, validate_retrieval_cache)
from .batch import RaggedBatch
from .cache import (UnsupportedCacheError, can_gather, column_bound, gather_problem, make_rollbackable, new_cache, rollback,
                    stop_recording)
from .config import NGRAM_MAX_SIZE, Costs, SpeculativeConfig
from .continuous import Requests, learned_positions
from .planner import CostEstimates, Planner
from .proposals import CandidateGeneratorDrafter, Drafter, DraftModelDrafter, NgramCandidateGenerator, NgramDrafter
from .proposals.checked import CheckedDrafter
from .proposals.draft_model import DraftCandidateGenerator, context_length, inner_drafter
from .retrieval import Retrieval, RetrievalCache
from .rounds import admit, commit, emit, flush_records, observe, propose, retire, verify
from .sampling import RowProcessors
from .stats import CACHE, AcceptanceSink, AcceptanceStats, RoundRecord, open_sink
from .verify import reads_are_free

logger = logging.getLogger(__name__)

__all__ = ["SpeculativeDecoderOnlyOutput", "StreamerNotForwardedError", "speculative_generate"]


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """transformers' decoder-only generate output, plus `acceptance` (an `AcceptanceStats`) and
    `cost_model` (a `CostEstimates`: the draft and verify costs the call decided with)."""

    acceptance: AcceptanceStats | None = None  # the whole batch
    acceptance_per_row: list[AcceptanceStats] | None = None  # one per input row (forwards, seconds: its rounds')
    cost_model: CostEstimates | None = None


@torch.no_grad()  # generate() calls it under no_grad; a direct call under grad mode recorded graphs
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
    acceptance_sink: AcceptanceSink | None = None,
    generator: torch.Generator | None = None,
    candidate_generator: Drafter | CandidateGenerator | None = None,
    spec_streamer: BaseStreamer | None = None,
    speculative_config: SpeculativeConfig | None = None,
    requests: Requests | None = None,
    retrieval_cache: RetrievalCache | None = None,
    # --- the `SpeculativeConfig` settings, one by one (None: the config's, or the default) ---
    num_draft_tokens: int | None = None,
    adaptive: bool | None = None,
    ngram: bool | None = None,
    ngram_min_size: int | None = None,
    tree: bool | None = None,
    tree_max_nodes: int | None = None,
    draft_window: int | None | str = "default",
    costs: Costs | None = None,
    **model_kwargs: Any,
) -> SpeculativeDecoderOnlyOutput | torch.LongTensor:
    """Speculative decoding as a transformers custom generation strategy. Beyond what `generate()`
    passes: the draft (`assistant`, or a `candidate_generator`), `acceptance_sink`, `generator`,
    `spec_streamer`, the `SpeculativeConfig` settings one by one or as `speculative_config` (explicit
    ones win), `retrieval_cache` (earlier outputs as a retrieval source; its rows join it) and `requests`
    (continuous batching); docs/usage.md documents each. Returns the sequences, or a `SpeculativeDecoderOnlyOutput`."""
    own = {k: v for k, v in locals().items() if k in OWN_ARGUMENTS}
    stream = streamer or spec_streamer
    kept = None if streamer is not None else kept_streamer()  # generate() put the prompt into it
    dropped = None if kept is spec_streamer else kept  # refused below, and ended on any error
    try:
        config, assistant = check_arguments(own), draft_model(assistant)  # before any model work
        logits_processor, stopping_criteria, generation_config = call_defaults(
            model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, requests is not None)
        if streamer is None:
            refuse_dropped_streamer(spec_streamer, assistant, generation_config.num_return_sequences, model)
        validate(model, assistant, candidate_generator, input_ids, generation_config, synced_gpus, model_kwargs,
                 streaming=stream is not None, continuous=requests is not None)
        validate_retrieval_cache(model, retrieval_cache)
        if requests is not None:
            config, stopping_criteria = continuous_settings(
                config, logits_processor, stopping_criteria, candidate_generator, input_ids, stream, requests.max_batch_size)
        state = _start(model, input_ids, logits_processor, stopping_criteria, generation_config, config, assistant,
                       candidate_generator, generator, stream, acceptance_sink, model_kwargs, requests, retrieval_cache)
        # generate() sends the prompt to a `streamer=` it forwards or keeps; not to ours
        _run(state, prompt=None if streamer is not None or kept is spec_streamer else input_ids)
        output = _finish(state)
    except BaseException:  # validation included: a consumer iterating the streamer must not wait forever
        _end_quietly(stream, dropped)
        raise
    if stream is not None:  # last, once: a failure above ends it quietly instead
        stream.end()
    return output


def _end_quietly(*streamers: BaseStreamer | None) -> None:
    for streamer in streamers:
        if streamer is not None:
            try:
                streamer.end()
            except Exception:
                pass


def _run(state: "DecodeState", prompt: torch.Tensor | None = None) -> None:
    """The prompt to the streamer (where given) and `_decode`, then, however it ends, the sink closed and
    the rows joined to the retrieval cache."""
    try:
        if prompt is not None:
            state.streamer.put(prompt.cpu())
        _decode(state)
    finally:  # each step whatever the one before raised: a failing sink must not leave rows open in the cache
        try:
            try:
                flush_records(state)
            finally:
                state.close_sink()
        finally:
            state.drafter.finish()
            if state.lookup is not None:
                state.lookup.close(state.batch.generated)  # the call's rows join the cache (searchable in later calls)


def _decode(state: "DecodeState") -> None:
    """Rounds until every row has finished (and, with continuous batching, no prompt is left)."""
    requests = state.requests
    if requests is not None:
        requests.decoding = True  # a failure from here on is the stream's (`StreamError`), not the call's
    while True:
        if requests is not None:
            admit(state)
        if not state.batch.size:
            if requests is None or requests.exhausted:
                return
            requests.wait()
            continue
        proposal, trace = propose(state)
        verdict = verify(state, proposal)
        commit(state, proposal, verdict)
        emission = emit(state, verdict)
        observe(state, proposal, trace, verdict, emission)
        retire(state, emission.finished)


# d0 (`CostCurve.measuring`) as measured by earlier calls on the same target model, per device, torch
# thread count and batch rows: only a model's first call spends two rounds measuring it.
_MEASURED_VERIFY_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Clock:
    """Wall time. On CUDA the device's queued work is waited for only when someone reads the times
    to decide something (the planner); times that only feed statistics are host times there."""

    def __init__(self, device: torch.device, synchronize: bool):
        self.synchronize = synchronize and device.type == "cuda"
        self.device = device

    def now(self) -> float:
        if self.synchronize:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


@dataclass
class DecodeState:
    """Everything a speculative generate call carries from round to round."""

    model: PreTrainedModel
    cache: Cache  # the target's
    batch: RaggedBatch  # work sequence with holes, mask, active rows, each row's generated tokens
    processors: RowProcessors  # the target's logits-processor pipeline, per row
    drafter: Drafter  # the draft source: the draft model, or the user's
    lookup: Retrieval | None  # in-row lookup and the retrieval cache (per row in a batch), or None
    trees: bool  # rounds propose trees of candidates (one row, greedy, full-attention caches, config.tree)
    planner: Planner
    config: SpeculativeConfig
    generation_config: GenerationConfig
    stopping_criteria: StoppingCriteriaList
    streamer: BaseStreamer | None
    generator: torch.Generator | None
    clock: Clock
    stats: AcceptanceStats  # the whole batch
    row_stats: list[AcceptanceStats]  # per original row
    outputs: "_Outputs"
    write_record: Callable[[RoundRecord], None] | None
    close_sink: Callable[[], None]
    requests: Requests | None = None  # continuous batching: where waiting prompts come from and results go
    cost_key: tuple = ()  # (device, threads, rows): where this call's measured d0 is remembered
    pad_token_id: int = 0  # what finished rows and padding hold
    # A static batch with no EOS: plain generate() keeps decoding a row a criterion stopped (there is no
    # EOS to pad it with) until every row has stopped. Per original row, the new tokens it stopped at.
    held: dict[int, int] | None = None
    max_positions: int | None = None  # the target's table of learned positions (GPT-2): its rows; None: rotary
    # Sink records held back once a row is held (their tokens past the batch's end are cut when it ends), each
    # with its row's generated length before that round
    pending: list[tuple[RoundRecord, int]] = field(default_factory=list)

    @property
    def caches(self) -> tuple[Cache | None, ...]:
        """The caches that change together: rolled back, row-selected and compacted as one."""
        return (self.cache, self.drafter.cache)


def _start(
    model, input_ids, logits_processor, stopping_criteria, generation_config, config, assistant,
    candidate_generator, generator, streamer, acceptance_sink, model_kwargs, requests=None, retrieval_cache=None,
) -> DecodeState:
    """The state of a fresh call: the draft source, the planner, the batch, the counters."""
    rows, vocab = input_ids.shape[0], model.get_output_embeddings().weight.shape[0]
    drafter, foreign = _drafter(config, assistant, candidate_generator, logits_processor, generation_config,
                                generator, input_ids, vocab)
    _start_drafter(drafter, inner_drafter(candidate_generator), rows, vocab)
    try:  # a failure below must not leave the drafter claimed by this call
        # A foreign generator is used as it is, every round; our drafters take part in the planner.
        planner = Planner(config.num_draft_tokens, config.adaptive and not foreign, config.costs, rows,
                          lazy=bool(generation_config.do_sample) and reads_are_free(input_ids.device))
        cost_key = (str(model.device), torch.get_num_threads(), rows)  # whose d0 a call may reuse
        known = _MEASURED_VERIFY_COSTS.get(model, {}).get(cost_key)
        if known is not None and planner.curve.measuring:  # measured by an earlier call: no rounds spent on it
            planner.curve.slope0 = known
        cache = make_rollbackable(model_kwargs["cache"] if model_kwargs.get("cache") is not None else new_cache(model))
        unpadded = model_kwargs.get("attention_mask") is None or bool(model_kwargs["attention_mask"].all())
        use_lookup = config.ngram and not foreign and planner.adaptive
        tree_problem = column_bound(model)[1]  # (a target whose attention sees holes: refused in `validate`)
        trees = (config.tree and use_lookup and not generation_config.do_sample and rows == 1 and unpadded
                 and can_gather((cache, drafter.cache)) and tree_problem is None)  # else chains
        lookup = None
        if use_lookup:  # in-row lookup, and rows retrieving from each other (and earlier calls, with a cache)
            if retrieval_cache is None and (rows > 1 or requests is not None):
                retrieval_cache = RetrievalCache()  # this call's own: rows sampling one prompt share their text
            if retrieval_cache is not None:  # what its proposals earned in earlier calls carries over
                planner.acceptance.retrieval[CACHE] = retrieval_cache.acceptance
            lookup = Retrieval(NgramDrafter(NGRAM_MAX_SIZE, config.ngram_min_size), retrieval_cache,
                               planner.acceptance.lookup_at, vocab=vocab)
        if requests is not None and (problem := gather_problem({"target": cache, "draft": drafter.cache})):
            raise UnsupportedCacheError(problem)
        write_record, close_sink = open_sink(acceptance_sink)
        batch = RaggedBatch(input_ids, model_kwargs.get("attention_mask"),
                            generation_config.max_length - input_ids.shape[1])
        if requests is not None:  # the first prompt's own budget, if it came with one
            batch.limits[0] = requests.max_new_tokens(0, input_ids[0], generation_config)
        return DecodeState(
            model=model, cache=cache, batch=batch, processors=RowProcessors(logits_processor, rows), drafter=drafter,
            lookup=lookup, trees=trees, planner=planner, config=config, generation_config=generation_config,
            stopping_criteria=stopping_criteria, streamer=streamer, generator=generator,
            clock=Clock(model.device, synchronize=planner.curve.pinned is None and planner.adaptive),
            stats=AcceptanceStats(), row_stats=[AcceptanceStats() for _ in range(rows)],
            outputs=_Outputs(generation_config, rows), write_record=write_record, close_sink=close_sink,
            requests=requests, cost_key=cost_key, pad_token_id=_pad_token_id(generation_config),
            held={} if requests is None and rows > 1 and not any(  # a deadline stops all
                hasattr(c, "eos_token_id") or isinstance(c, MaxTimeCriteria) for c in stopping_criteria) else None,
            max_positions=context_length(model.config) if learned_positions(model) else None,
        )
    except BaseException:
        drafter.finish()
        raise


def _start_drafter(drafter: Drafter, inner: DraftModelDrafter | None, rows: int, vocab: int) -> None:
    """`drafter.start`; a start that claimed the user's drafter and then raised (a subclass refusing after
    `super().start()`) releases it (a start refused because another call holds it claimed nothing)."""
    free = inner is None or inner.holder() is None
    try:
        drafter.start(rows)
    except BaseException:
        if free and inner is not None and inner.holder() is threading.current_thread():
            inner.finish()
        raise
    if inner is not None:
        inner.vocab = vocab  # once this call holds it: not under a call in another thread


def _drafter(
    config, assistant, candidate_generator, logits_processor, generation_config, generator, input_ids, vocab: int
) -> tuple[Drafter, bool]:
    """(the draft source, whether it is a foreign transformers generator, wrapped here once). A draft
    model of ours proposes over the target's `vocab` ids (its own may differ by padding rows)."""
    if candidate_generator is not None and isinstance(config.draft_window, int):
        logger.warning("draft_window=%d shapes the draft built from assistant=; a candidate_generator drafts as it was "
                       "made (DraftModelDrafter(draft, ..., window=%d) for a window)", config.draft_window, config.draft_window)
    sample = bool(generation_config.do_sample)
    if isinstance(candidate_generator, Drafter):  # ours as they are; one's own (subclasses too) checked
        if type(candidate_generator) in (DraftModelDrafter, NgramDrafter, DraftCandidateGenerator):
            return candidate_generator, False
        return CheckedDrafter(candidate_generator, vocab, sample), False
    if candidate_generator is not None:
        wrapped = CandidateGeneratorDrafter(candidate_generator)
        return (wrapped if type(candidate_generator) is NgramCandidateGenerator else CheckedDrafter(wrapped, vocab, sample)), True
    # The window needs full-attention layers (zero columns hidden by the mask) and a single row.
    window = None
    if input_ids.shape[0] == 1 and can_gather([new_cache(assistant)]):
        window = config.window_for(bool(generation_config.do_sample))
    elif isinstance(config.draft_window, int):
        logger.warning("draft_window=%d is for one row with a full-attention draft; %s: the draft encodes whole "
                       "prompts", config.draft_window, f"this call has {input_ids.shape[0]} rows"
                       if input_ids.shape[0] > 1 else "this draft has sliding-window layers")
    return DraftModelDrafter(assistant, logits_processor, bool(generation_config.do_sample), generator, window=window,
                             vocab=vocab), False


def _finish(state: DecodeState) -> SpeculativeDecoderOnlyOutput | torch.LongTensor:
    measured = state.planner.curve.slope0  # remembered for the next call on this model
    if measured is not None and state.planner.curve.pinned is None:
        _MEASURED_VERIFY_COSTS.setdefault(state.model, {})[state.cost_key] = measured
    stats = state.stats
    logger.debug("speculative_generate: %d rounds, acceptance %.3f, %.2f tokens/round",
                 stats.rounds, stats.acceptance_rate, stats.mean_tokens_per_round)
    sequences = state.batch.sequences(state.pad_token_id)
    cache = _settle_cache(state, sequences)  # also a user-passed cache, whatever is returned
    output = sequences
    if state.generation_config.return_dict_in_generate:
        scores, logits = state.outputs.stacked()
        output = SpeculativeDecoderOnlyOutput(
            sequences=sequences, scores=scores, logits=logits,
            cache=None if state.generation_config.use_cache is False else cache,
            acceptance=stats, acceptance_per_row=state.row_stats, cost_model=state.planner.estimates(),
        )
    return output


def _settle_cache(state: DecodeState, sequences: torch.Tensor) -> Cache | None:
    """Leaves the target's cache (the user's own, if one was passed) as plain generate() leaves it, for a
    follow-up call with `cache=`, and returns it: for a single row, every token of `sequences` but the
    last (tokens accepted past a stop are cut). A batch's or a stream's columns hold this loop's holes
    and padding, which a plain call would misread: that cache is emptied (`Cache.reset`; a follow-up
    call encodes its whole input) and None is returned."""
    kept = state.requests is None and sequences.shape[0] == 1  # a single row never has holes
    if kept:
        rollback([state.cache], sequences.shape[1] - 1)
        kept = state.cache.get_seq_length() == sequences.shape[1] - 1
    if not kept:
        state.cache.reset()
    stop_recording(state.cache)
    return state.cache if kept else None


def _pad_token_id(generation_config: GenerationConfig) -> int:
    """Finished rows are padded like transformers pads them: pad token, else EOS."""
    for candidate in (generation_config.pad_token_id, generation_config.eos_token_id):
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


class _Outputs:
    """Per-emitted-token scores and logits, per row, collected only when the user asked for them."""

    def __init__(self, generation_config: GenerationConfig, batch: int):
        want = generation_config.return_dict_in_generate
        self.scores = [[] for _ in range(batch)] if want and generation_config.output_scores else None
        self.logits = [[] for _ in range(batch)] if want and generation_config.output_logits else None
        self.pad_token_id = _pad_token_id(generation_config)  # what a finished row's sequence holds

    def add_row(self) -> None:
        for per_row in (self.scores, self.logits):
            if per_row is not None:
                per_row.append([])

    def add(self, row: int, scores: torch.Tensor, logits: torch.Tensor) -> None:  # [n, vocab] each
        if self.scores is not None:  # [1, vocab] each: the stopping criteria read them as plain passes them
            self.scores[row].extend(scores.split(1))
        if self.logits is not None:
            self.logits[row].extend(logits.float().split(1))

    def stacked(self) -> tuple[tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None]:
        """One [batch, vocab] tensor per generated position, like transformers; a row that had
        already finished gets a point mass on its padding there (it emitted no token)."""
        return self._stack(self.scores), self._stack(self.logits)

    def _stack(self, per_row: list[list[torch.Tensor]] | None) -> tuple[torch.Tensor, ...] | None:
        if per_row is None:
            return None
        template = next(t for row in per_row for t in row)
        # A finished row "emits" padding: a point mass on the pad token (0 there, -inf elsewhere), so that
        # compute_transition_scores gives it log-probability 0, as padding (all -inf would give NaN).
        filler = torch.full_like(template, -float("inf"))
        if 0 <= self.pad_token_id < filler.shape[-1]:  # a pad id outside the vocabulary: all -inf, as before
            filler[:, self.pad_token_id] = 0.0
        longest = max(len(row) for row in per_row)
        return tuple(torch.cat([row[t] if t < len(row) else filler for row in per_row]) for t in range(longest))
