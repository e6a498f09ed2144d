"""The `custom_generate` entry point: exact speculative decoding inside `model.generate`.

    out = target.generate(**inputs, custom_generate=hf_specdec.speculative_generate,
                          assistant=draft, num_draft_tokens=5, do_sample=True, temperature=0.7)

`generate()` prepares everything as for plain decoding (GenerationConfig, the LogitsProcessorList,
stopping criteria, a DynamicCache for the target) and hands it to `speculative_generate`, which
runs rounds until every row has finished. A round is six stages, each a short function over the
`DecodeState` and plain data (`Proposal`, `Verdict`, `Emission`):

    proposal = propose(state)                  # 1. draft: the cost model picks a source, it proposes
    verdict = verify(state, proposal)          # 2. one target forward, the acceptance rule per row
    commit(state, proposal, verdict)           # 3. caches and the work sequence
    emission = emit(state, verdict)            # 4. stopping criteria, streamer, output scores
    observe(state, proposal, verdict, emission)  # 5. statistics, the sink, the cost model
    retire(state, emission.finished)           # 6. finished rows leave; holes are compacted

With continuous batching (`hf_specdec.generate_continuous`), `admit(state)` lets waiting prompts
join before each round.

Output is distributed exactly as plain sampling from the target (greedy: token for token
identical to plain greedy).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import Cache, GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor
from transformers.generation.stopping_criteria import MaxLengthCriteria
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .batch import RaggedBatch
from .cache import (
    UnsupportedCacheError, add_row, can_gather, clear as clear_caches, check_cache, extend, extend_tree, keep_path, make_rollbackable, new_cache,
    pad_front, rollback,
)
from .config import SpeculativeConfig
from .continuous import Requests
from .policy import CostEstimates, DraftPolicy, PolicySettings
from .proposals import (
    CandidateGeneratorDrafter, Drafter, DraftModelDrafter, DraftRequest, NgramDrafter, Proposal, with_draft_temperature,
)
from .proposals.tree import SIBLING, Trie, ancestors_mask, depths, path_tokens, retrieval_reach, tree_proposal
from .sampling import RowProcessors, logits_to_probs
from .stats import DRAFT, NGRAM, NONE, AcceptanceSink, AcceptanceStats, RoundRecord, open_sink
from .verify import greedy_tree_verification, greedy_verification, lazy_speculative_sampling, tree_speculative_sampling

logger = logging.getLogger(__name__)


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """transformers' decoder-only generate output, plus `acceptance` (an `AcceptanceStats`) and
    `cost_model` (a `CostEstimates`: the draft and verify costs the call decided with)."""

    acceptance: AcceptanceStats | None = None  # the whole batch
    acceptance_per_row: list[AcceptanceStats] | None = None  # one per input row
    cost_model: CostEstimates | None = None


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
    candidate_generator: Drafter | CandidateGenerator | None = None,
    spec_streamer: BaseStreamer | None = None,
    adaptive: bool | None = None,
    ngram: bool | None = None,
    draft_vocab_size: int | None = None,
    draft_cost: float | None = None,
    verify_cost: float | None = None,
    verify_knee_cost: float | None = None,
    price_by_width: bool | None = None,
    verify_curve: tuple[float, ...] | list[float] | None = None,
    draft_prefill_cost: float | None = None,
    tree: bool | None = None,
    draft_window: int | None | str = "default",
    speculative_config: SpeculativeConfig | None = None,
    requests: Requests | None = None,
    **model_kwargs: Any,
) -> SpeculativeDecoderOnlyOutput | torch.LongTensor:
    """Speculative decoding as a transformers custom generation strategy. Beyond what `generate()`
    passes: the draft (`assistant`, or a `candidate_generator`), `acceptance_sink`, `generator`,
    `spec_streamer`, the `SpeculativeConfig` settings one by one or as `speculative_config` (explicit
    ones win) and `requests` (continuous batching); docs/usage.md documents each. Returns the
    sequences, or with `return_dict_in_generate=True` a `SpeculativeDecoderOnlyOutput`."""
    config = check_arguments({k: v for k, v in locals().items() if k in _OWN_ARGUMENTS})  # before any model work
    if streamer is None:
        _refuse_dropped_streamer(spec_streamer)
    _validate(model, assistant, candidate_generator, input_ids, generation_config, synced_gpus, model_kwargs,
              streaming=streamer is not None or spec_streamer is not None)
    if requests is not None:
        config, stopping_criteria = _continuous(config, logits_processor, stopping_criteria, candidate_generator,
                                                input_ids, streamer or spec_streamer)
    state = _start(
        model, input_ids, logits_processor, stopping_criteria, generation_config, config, assistant,
        candidate_generator, generator, streamer or spec_streamer, acceptance_sink, model_kwargs, requests,
    )
    if streamer is None and spec_streamer is not None:
        spec_streamer.put(input_ids.cpu())  # generate() sends the prompt to a `streamer=` it forwards; not to ours
    try:
        _decode(state)
    finally:
        state.close_sink()
    return _finish(state)


def _decode(state: "DecodeState") -> None:
    """Rounds until every row has finished (and, with continuous batching, no prompt is left)."""
    requests = state.requests
    while True:
        if requests is not None:
            admit(state)
        if not state.batch.size:
            if requests is None or requests.exhausted:
                return
            requests.wait()
            continue
        proposal = propose(state)
        verdict = verify(state, proposal)
        commit(state, proposal, verdict)
        emission = emit(state, verdict)
        observe(state, proposal, verdict, emission)
        retire(state, emission.finished)


# d0 (`DraftPolicy.measuring_costs`) as measured by earlier calls on the same target model, per device,
# torch thread count and batch rows: only a model's first call spends two rounds measuring it.
_MEASURED_VERIFY_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _resolve_config(base: SpeculativeConfig | None, **overrides: Any) -> SpeculativeConfig:
    """`base` (or the defaults) with every explicitly given argument replacing its field. None means
    "not given", except for `draft_window`, whose None (the whole prompt) differs from its default:
    there "not given" is the string "default"."""
    given = {k: v for k, v in overrides.items() if v is not None and not (k == "draft_window" and v == "default")}
    if overrides.get("draft_window", "default") is None:
        given["draft_window"] = None
    return dataclasses.replace(base or SpeculativeConfig(), **given)


# ---------------------------------------------------------------- the state a round works on


class Clock:
    """Wall time. On CUDA the device's queued work is waited for only when someone reads the times
    to decide something (the cost model); times that only feed statistics are host times there."""

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
    lookup: NgramDrafter | None  # n-gram lookup for hybrid drafts (per row in a batch), or None
    trees: bool  # rounds propose trees of candidates (one row, full-attention caches, config.tree)
    policy: DraftPolicy  # the cost model
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

    @property
    def caches(self) -> tuple[Cache | None, ...]:
        """The caches that change together: rolled back, row-selected and compacted as one."""
        return (self.cache, self.drafter.cache)


@dataclass(frozen=True)
class Verdict:
    """What verification decided, per active row."""

    num_accepted: torch.Tensor  # [rows] int64
    emitted: torch.Tensor  # [rows, k + 1]: accepted drafts, the recovered or bonus token, then PAD_TOKEN
    tokens: list[list[int]]  # per row, the accepted drafts and the extra token (host copy of `emitted`)
    target_scores: torch.Tensor  # [rows, n, vocab]: processed target scores at the first n positions
    target_logits: torch.Tensor  # [rows, k + 1, vocab]: raw target logits
    target_probs: torch.Tensor | None  # [rows, n, vocab]: p at those positions (sampling chains), else None
    seconds: float  # wall time of the stage
    path: list[int] | None = None  # trees: the accepted nodes, root first
    columns: int = 0  # columns the target's forward took in (the whole prompt in the first round)

    @property
    def accepted(self) -> list[int]:
        return [len(t) - 1 for t in self.tokens]


@dataclass(frozen=True)
class Emission:
    """What emission did, per active row."""

    counts: list[int]  # tokens emitted (the verdict's tokens, cut after a stop)
    finished: list[bool]  # a stopping criterion ended the row


# ---------------------------------------------------------------- the round


def admit(state: DecodeState) -> None:
    """0. Continuous batching: prompts that are waiting join while the batch has free rows. Each is
    appended as a left-padded row of the work sequence (the batch is left-padded first if the prompt
    is longer), and every cache gets a row holding the same columns as the others
    (`cache.pad_front`, `cache.add_row`); it proposes and is verified from this round on."""
    requests, batch = state.requests, state.batch
    prompts = requests.take(requests.max_batch_size - batch.size)
    if not prompts:
        return
    if not batch.size:  # everything finished: start from empty caches
        batch.clear()
        clear_caches(state.caches)
    pad = _pad_token_id(state.generation_config)
    for prompt in prompts:
        front = batch.widen(prompt.shape[0], pad)
        if front:
            pad_front(state.caches, front)
        batch.add_row(prompt, requests.max_new_tokens(len(batch.prompts), prompt, state.generation_config), pad)
        ids, mask = batch.ids[-1:], batch.mask[-1:]
        add_row(state.model, state.cache, ids, mask)
        state.drafter.add_row(ids, mask)
        state.processors.add_row()
        state.row_stats.append(AcceptanceStats())
        state.outputs.add_row()
    state.policy.set_rows(batch.size)


def propose(state: DecodeState) -> Proposal:
    """1. Draft. The cost model picks this round's source: the draft model, an n-gram lookup, or
    nothing (a plain target step); the source proposes up to k tokens per row."""
    start, batch = state.clock.now(), state.batch
    room = batch.remaining() - 1  # a round emits at most k + 1 tokens a row
    if state.policy.measuring_costs:  # the prompt's encoding and one step are timed before anything is guessed
        room = 0
    draft_room = state.drafter.room(batch.longest())  # the draft's context length bounds it (None: no bound)
    request = DraftRequest(batch.ids, batch.mask, batch.prefixes(),
                           max_tokens=min(state.config.num_draft_tokens, room, room if draft_room is None else draft_room),
                           clock=state.clock.now if state.policy.measures_time else None)
    if state.trees and room > 0:
        return dataclasses.replace(_propose_tree(state, request, room), seconds=state.clock.now() - start)
    if state.lookup is not None and room > 0 and batch.size > 1:
        return dataclasses.replace(_propose_rows(state, request, room), seconds=state.clock.now() - start)
    lookup = None
    if state.lookup is not None and room > 0:
        lookup = state.lookup.propose(dataclasses.replace(request, max_tokens=room))
    prefill = state.drafter.prefill_tokens(batch.width)
    size = None if lookup is None else lookup.match_sizes[0]
    source, length = state.policy.plan(0 if lookup is None else lookup.num_tokens, prefill, room, size) if room > 0 else (NONE, 0)
    if source == DRAFT and not request.max_tokens:  # the draft's context is full: a lookup if it pays, or a plain step
        length = state.policy.ngram_length(lookup.num_tokens, 1, size)[0] if lookup is not None and lookup.num_tokens else 0
        source = NGRAM if length else NONE
    if source == NGRAM:
        proposal = lookup.first(length)
    elif source == DRAFT:
        keep_drafting = state.policy.stop_rule(batch.size, request.max_tokens)
        proposal = state.drafter.propose(dataclasses.replace(request, keep_drafting=keep_drafting))
    else:
        proposal = Proposal.nothing(batch.size, batch.ids.device)
    return dataclasses.replace(proposal, seconds=state.clock.now() - start)


def _propose_rows(state: DecodeState, request: DraftRequest, room: int) -> Proposal:
    """A batch round with lookup: each row whose n-gram lookup is expected to beat the draft model
    proposes its lookup (a point mass chain, its own length); the draft model runs for the batch if
    any other row is to draft; rows left over propose nothing (length 0, a plain step inside the
    same target forward). Verified with per-row lengths (`verify.speculative_sampling`)."""
    policy, rows, device = state.policy, state.batch.size, request.ids.device
    prefill = state.drafter.prefill_tokens(request.ids.shape[1])
    # A cold draft starts only once the rounds without it have lost as much as its prefill costs
    # (ski rental, as for trees): a batch of short answers never pays the draft's prefill.
    draft = bool(request.max_tokens) and policy.should_draft(prefill, room) and policy.prefill_earned(prefill)
    draft_rate = policy.expected_draft_rate(prefill, room)
    retrieved, sizes = {}, [0] * rows
    for r, (tokens, size) in enumerate(state.lookup.match_rows(dataclasses.replace(request, max_tokens=room))):
        length, rate = policy.ngram_length(tokens.numel(), rows, size) if tokens.numel() else (0, 0.0)
        if length and (not draft or rate >= draft_rate):
            retrieved[r], sizes[r] = tokens[:length], size
    chain = None
    if draft and len(retrieved) < rows:
        keep_drafting = policy.stop_rule(rows, request.max_tokens)
        chain = state.drafter.propose(dataclasses.replace(request, keep_drafting=keep_drafting))
    if not retrieved:
        return chain if chain is not None else Proposal.nothing(rows, device)
    drafted = 0 if chain is None else chain.num_tokens
    k = max([drafted] + [t.numel() for t in retrieved.values()])
    tokens = torch.zeros((rows, k), dtype=torch.long, device=device)
    lengths, sources = [], []
    q = None
    if chain is not None and chain.draft_probs is not None:  # sampled drafts: q per row, one-hot for lookups
        q = torch.zeros((rows, k, chain.draft_probs.shape[-1]), dtype=chain.draft_probs.dtype, device=device)
    for r in range(rows):
        if r in retrieved:
            row = retrieved[r]
            if q is not None:
                q[r, torch.arange(row.numel(), device=device), row] = 1.0
            sources.append(NGRAM)
        else:
            row = tokens.new_empty(0) if chain is None else chain.tokens[r]
            if q is not None:
                q[r, :drafted] = chain.draft_probs[r]
            sources.append(DRAFT if drafted else NONE)
        tokens[r, : row.numel()] = row
        lengths.append(row.numel())
    return Proposal(
        tokens=tokens, draft_probs=q, source=DRAFT if drafted else NGRAM,
        confidences=None if chain is None else chain.confidences, forwards=0 if chain is None else chain.forwards,
        lengths=torch.tensor(lengths, device=device), sources=sources, match_sizes=sizes,
        catchup_seconds=0.0 if chain is None else chain.catchup_seconds,
    )


def _propose_tree(state: DecodeState, request: DraftRequest, room: int) -> Proposal:
    """A tree round (one row): every distinct retrieved continuation, as a trie; verified alone when
    the cost model expects it to beat the draft model, else merged with the draft model's chain. The
    cost model keeps the nodes that pay (`DraftPolicy.select_nodes`)."""
    policy, config, device = state.policy, state.config, request.ids.device
    continuations, size = state.lookup.retrieve(dataclasses.replace(request, max_tokens=room), config.tree_max_branches)
    retrieved = Trie()
    for continuation in continuations:
        retrieved.insert(continuation, NGRAM, count=True)
    acceptance = policy.ngram_curve(size, policy.settings.ngram_depths)  # by depth, the last for any deeper
    reach = retrieval_reach(retrieved, acceptance)
    keep = policy.select_nodes(reach, [], 0, config.tree_max_nodes)
    prefill = state.drafter.prefill_tokens(request.ids.shape[1])  # the draft's prompt, until it is encoded
    rate = policy.tree_rate(reach, keep) if keep else 0.0
    if prefill:
        policy.note_retrieval(rate >= policy.expected_draft_rate())
    # The ski-rental wait for a cold draft (`prefill_earned`) hedges against paying its prefill while
    # retrieval could carry the answer (and before the answer's length is known). A round with no
    # retrieved node worth verifying, whose draft prefill is small against the drafting it serves
    # (`prefill_is_small`), does not wait: the expected-value rule alone (`should_draft`) decides.
    waits = bool(keep) or not policy.prefill_is_small(prefill, room)
    draft = bool(request.max_tokens) and policy.should_draft(prefill, room) and (not waits or policy.prefill_earned(prefill))
    if keep and (not draft or rate >= policy.expected_draft_rate(prefill, room)):
        return dataclasses.replace(tree_proposal(retrieved, keep, None, NGRAM, device), match_sizes=[size],
                                   estimates=[reach[j] for j in keep])
    unverified = (continuations[0], size) if continuations else None
    if not draft:
        return dataclasses.replace(Proposal.nothing(1, device), unverified=unverified)
    chain = state.drafter.propose(dataclasses.replace(request, keep_drafting=policy.stop_rule(1, request.max_tokens)))
    if not chain.num_tokens:
        return dataclasses.replace(chain, unverified=unverified)
    merged = Trie()
    nodes = merged.insert(chain.tokens[0].tolist(), DRAFT, count=False)
    confidences = chain.confidences[0] if chain.confidences else None
    draft_acceptance = {
        j: policy.calibrated(confidences[j]) if confidences else policy.state.token_acceptance
        for j in range(chain.num_tokens)
    }
    # Greedy drafts: the draft's runner-up beside each chain node. It is accepted when the chain
    # token is not and the target's choice is the runner-up: estimated as (1 - a) q2 / (1 - q1).
    siblings = {}
    for j, (token, prob) in enumerate(chain.runners_up[0] if chain.runners_up else []):
        node = merged.add(-1 if j == 0 else nodes[j - 1], token, SIBLING)
        siblings[node] = (1 - draft_acceptance[j]) * min(1.0, prob / max(1e-6, 1 - confidences[j]))
    for continuation in continuations:
        merged.insert(continuation, NGRAM, count=True)
    reach = retrieval_reach(merged, acceptance, draft_acceptance, siblings)
    keep = policy.select_nodes(reach, list(range(chain.num_tokens)), chain.forwards, config.tree_max_nodes)
    if any(merged.origins[j] == NGRAM for j in keep):
        unverified = None
    return dataclasses.replace(tree_proposal(merged, keep, chain, DRAFT, device), match_sizes=[size], unverified=unverified,
                               catchup_seconds=chain.catchup_seconds, estimates=[reach[j] for j in keep])


def verify(state: DecodeState, proposal: Proposal) -> Verdict:
    """2. One target forward over the pending column(s) and the k drafts; p at each position with
    that row's own prefix; then the rule per row: greedy accepts while the argmaxes agree, sampling
    applies the rejection rule with p computed only as far as some row still needs it."""
    if proposal.tree is not None:
        return _verify_tree(state, proposal)
    start, batch, drafts = state.clock.now(), state.batch, proposal.tokens  # drafts: [rows, k]
    k = proposal.num_tokens
    ids = torch.cat([batch.ids, drafts], dim=1)  # [rows, seq + k]
    mask = None if batch.mask is None else torch.nn.functional.pad(batch.mask, (0, k), value=1)
    columns = ids.shape[1] - state.cache.get_seq_length()
    logits = extend(state.model, state.cache, ids, mask, num_logits=k + 1)  # [rows, k + 1, vocab]
    prefixes, scores = batch.prefixes(), []
    if state.generation_config.do_sample:

        def target_probs_at(first: int, stop: int) -> torch.Tensor:  # [rows, stop - first, vocab]
            scores.append(state.processors.positions(prefixes, drafts, logits[:, first:stop], first))
            return logits_to_probs(scores[-1])

        num_accepted, emitted, target_probs = lazy_speculative_sampling(
            drafts, proposal.draft_probs, target_probs_at, state.generator, lengths=proposal.lengths
        )
    else:
        scores.append(state.processors.positions(prefixes, drafts, logits))  # [rows, k + 1, vocab]
        num_accepted, emitted = greedy_verification(drafts, scores[0], lengths=proposal.lengths)
        target_probs = None
    host = torch.cat([num_accepted[:, None], emitted], dim=1).tolist()  # the round's one device-to-host copy
    tokens = [row[1 : row[0] + 2] for row in host]
    target_scores = scores[0] if len(scores) == 1 else torch.cat(scores, dim=1)  # [rows, n, vocab]
    return Verdict(num_accepted, emitted, tokens, target_scores, logits, target_probs, seconds=state.clock.now() - start,
                   columns=columns)


def _verify_tree(state: DecodeState, proposal: Proposal) -> Verdict:
    """2 (trees, one row). One target forward over the pending token(s) and every node, each node
    seeing only its ancestors; p (or the argmax) at a node, with its own branch as the processors'
    prefix, computed only for the nodes the walk reaches."""
    start, batch, tree = state.clock.now(), state.batch, proposal.tree
    tokens = proposal.tokens[0].tolist()
    columns = batch.ids.shape[1] - state.cache.get_seq_length() + len(tokens)
    logits = extend_tree(state.model, state.cache, batch.ids, proposal.tokens, ancestors_mask(tree.parents),
                         depths(tree.parents))[0]  # [n + 1, vocab]: after the last real token, then after each node
    prefixes, scores = batch.prefixes(), {}

    def scores_at(node: int) -> torch.Tensor:  # [vocab]
        branch = torch.tensor([path_tokens(tokens, tree.parents, node)], dtype=torch.long, device=logits.device)
        scores[node] = state.processors.scores(prefixes, branch, logits[node + 1][None])[0]
        return scores[node]

    if state.generation_config.do_sample:
        q = None if proposal.draft_probs is None else proposal.draft_probs[0]
        path, extra = tree_speculative_sampling(tokens, tree.parents, q, lambda n: logits_to_probs(scores_at(n)), state.generator)
    else:
        path, extra = greedy_tree_verification(tokens, tree.parents, lambda n: int(scores_at(n).argmax()))
    walk = [-1] + path
    emitted = [tokens[j] for j in path] + [extra]
    return Verdict(
        num_accepted=torch.tensor([len(path)], device=logits.device),
        emitted=torch.tensor([emitted], dtype=torch.long, device=logits.device), tokens=[emitted],
        target_scores=torch.stack([scores[n] for n in walk])[None], target_logits=logits[[n + 1 for n in walk]][None],
        target_probs=None, seconds=state.clock.now() - start, path=path, columns=columns,
    )


def commit(state: DecodeState, proposal: Proposal, verdict: Verdict) -> None:
    """3. Both caches keep the draft columns some row accepted (in the other rows they become masked
    holes) and drop the rest; the work sequence grows by those columns and each row's extra token.
    After a tree, the target's cache keeps the accepted branch's columns, the draft's the part of its
    own chain that was accepted."""
    m = max(verdict.accepted)
    rows = torch.arange(state.batch.size, device=verdict.emitted.device)
    extra = verdict.emitted[rows, verdict.num_accepted]  # [rows]: each row's recovered or bonus token
    if proposal.tree is not None:
        keep_path(state.cache, state.batch.width, verdict.path, proposal.num_tokens)
        rollback([state.drafter.cache], state.batch.width + proposal.tree.chain_accepted(verdict.path))
        state.batch.append_round(verdict.emitted[:, :m], verdict.num_accepted, extra)
    else:
        rollback([state.cache], state.batch.width + m)
        # Rows that proposed a lookup hold the draft's tokens in the draft's cache, not theirs: the
        # draft re-reads the round's accepted tokens next time it runs.
        mixed = proposal.sources is not None and proposal.forwards > 0
        rollback([state.drafter.cache], state.batch.width + (0 if mixed else m))
        state.batch.append_round(proposal.tokens[:, :m], verdict.num_accepted, extra)
    state.drafter.update(state.batch.ids, verdict.target_scores, m)


def emit(state: DecodeState, verdict: Verdict) -> Emission:
    """4. Each row's tokens go out one at a time through the stopping criteria, so that a stop inside
    the block (EOS, max_length, a user criterion) ends the row exactly there; then to the streamer
    and, when asked for, to the output scores and logits."""
    counts, finished = [], []
    for i, row in enumerate(state.batch.rows):
        tokens = verdict.tokens[i]
        try:
            count, done = _first_stop(state, i, tokens, verdict.target_scores[i])
        except Exception as error:
            if state.requests is None:
                raise
            count, done = 0, True  # continuous batching: this request fails alone, the others go on
            state.requests.fail(row, error)
        state.batch.record(i, tokens[:count])
        state.outputs.add(row, verdict.target_scores[i, :count], verdict.target_logits[i, :count])
        if state.streamer is not None:
            state.streamer.put(torch.tensor(tokens[:count]))
        counts.append(count)
        finished.append(done)
    return Emission(counts, finished)


def observe(state: DecodeState, proposal: Proposal, verdict: Verdict, emission: Emission) -> None:
    """5. Statistics for the batch and each row, one record per row for the sink, and the cost model."""
    k, accepted = proposal.num_tokens, verdict.accepted
    for i, row in enumerate(state.batch.rows):
        length = proposal.length(i)
        for counters in (state.stats, state.row_stats[row]):
            counters.record(length, accepted[i], emission.counts[i])
        state.row_stats[row].rounds += 1
        if state.write_record is not None:
            state.write_record(RoundRecord(
                round=state.stats.rounds, row=row, draft_tokens=proposal.tokens[i, :length].tolist(),
                num_accepted=accepted[i], emitted_tokens=verdict.tokens[i][: emission.counts[i]],
                expected_acceptance=_expected_acceptance(proposal, verdict, i),
                draft_seconds=proposal.seconds, target_seconds=verdict.seconds, source=proposal.source_of(i),
                parents=None if proposal.tree is None else proposal.tree.parents, path=verdict.path,
                accepted_from=_accepted_from(proposal, i, accepted[i], verdict.path),
                cache_length=state.cache.get_seq_length(), estimated_acceptance=proposal.estimates,
            ))
    state.stats.count_round(proposal.source, proposal.forwards, proposal.seconds, verdict.seconds)
    state.policy.observe_timing(proposal.seconds, proposal.forwards, verdict.seconds, k + 1, proposal.catchup_seconds,
                                verdict.columns)
    if proposal.sources is not None:  # a batch mixing sources: each source learns from its own rows
        drafted = [i for i, source in enumerate(proposal.sources) if source == DRAFT]
        if drafted:
            confidences = None if proposal.confidences is None else [proposal.confidences[i] for i in drafted]
            state.policy.observe_round(DRAFT, proposal.length(drafted[0]), [accepted[i] for i in drafted], confidences)
        for i, source in enumerate(proposal.sources):
            if source == NGRAM:
                state.policy.observe_lookup(proposal.length(i), accepted[i], proposal.match_sizes[i])
        if not drafted:  # a round without the draft model: it counts toward the next probe, lookups or not
            state.policy.observe_round(NONE, 0, [])
    elif proposal.tree is None:
        state.policy.observe_round(proposal.source, k, accepted, proposal.confidences, proposal.match_sizes)
    else:
        tree = proposal.tree
        state.policy.observe_tree(
            tree.chain, tree.chain_accepted(verdict.path), proposal.confidences[0] if proposal.confidences else None,
            tree.retrieval_events(verdict.path), proposal.match_sizes[0] if proposal.match_sizes else None,
            first_hit=bool(verdict.path) and tree.from_draft(verdict.path[0]), emitted=len(verdict.path) + 1, width=k + 1,
        )
    if proposal.unverified is not None:
        continuation, size = proposal.unverified
        state.policy.observe_unverified(continuation, verdict.tokens[0][: emission.counts[0]], size)
    if (state.trees or state.batch.size > 1) and not proposal.forwards and state.drafter.prefill_tokens(state.batch.width):
        # a round without the cold draft (the ski-rental wait of tree rounds and batch rounds); a batch's
        # rows emitted this many tokens each on average, for one batch step's price
        counts = emission.counts[: state.batch.size]
        state.policy.observe_cold_round(proposal.num_tokens + 1, sum(counts) / max(1, len(counts)))


def retire(state: DecodeState, finished: list[bool]) -> None:
    """6. Finished rows leave the batch and both caches; holes are compacted away once they pile up."""
    if state.requests is not None:
        for i, done in enumerate(finished):
            if done:
                row = state.batch.rows[i]
                state.requests.finished(row, state.batch.prompts[row], state.batch.generated[row], state.row_stats[row])
    if any(finished):
        ending = state.requests is None and all(finished)  # the call ends: caches are left for `_finish`
        state.batch.select([i for i, done in enumerate(finished) if not done], () if ending else state.caches)
        if state.batch.size:
            state.policy.set_rows(state.batch.size)  # the verify-cost prior and lookup pricing follow the batch
    if state.batch.should_compact(state.caches):
        state.batch.compact(state.caches)


# ---------------------------------------------------------------- helpers of the stages


def _first_stop(
    state: DecodeState,
    i: int,  # active row
    tokens: list[int],  # accepted tokens plus the recovered/bonus token
    scores: torch.Tensor,  # [>= len(tokens), vocab]: the target scores they were chosen under
) -> tuple[int, bool]:
    """(tokens to emit, finished): the tokens up to and including the first a criterion stops on."""
    before = state.batch.real_sequence(i)  # [1, len]
    sequence = torch.cat([before, torch.tensor([tokens], dtype=torch.long, device=before.device)], dim=1)
    left = state.batch.left(i)  # the row's own max_new_tokens (in a static batch max_length says the same)
    for j in range(len(tokens)):
        if j + 1 >= left or bool(state.stopping_criteria(sequence[:, : before.shape[1] + j + 1], scores[j : j + 1]).all()):
            return j + 1, True
    return len(tokens), False


def _accepted_from(proposal: Proposal, i: int, accepted: int, path: list[int] | None) -> str:
    """The source(s) of a row's accepted tokens: the proposal's source, or for a tree the draft model
    (its chain and its runners-up) and/or retrieval along the accepted path."""
    if not accepted:
        return ""
    if proposal.tree is None:
        return proposal.source_of(i)
    tree = proposal.tree
    sources = {DRAFT if tree.from_draft(j) else NGRAM for j in path}
    return f"{DRAFT}+{NGRAM}" if len(sources) == 2 else sources.pop()


def _expected_acceptance(proposal: Proposal, verdict: Verdict, i: int) -> list[float] | None:
    """P(accept) = sum_t min(p(t), q(t)) = 1 - TV(p, q) per draft position of active row i (sampling
    only; p(x) for a point mass), at the positions whose p was computed: every reached position, and
    perhaps a few after it."""
    if verdict.target_probs is None or proposal.tree is not None:
        return None
    n = min(proposal.length(i), verdict.target_probs.shape[1])
    target_probs = verdict.target_probs[i, :n]  # [n, vocab]
    if proposal.draft_probs is None:
        return target_probs.gather(-1, proposal.tokens[i, :n, None])[:, 0].tolist()
    return torch.minimum(target_probs, proposal.draft_probs[i, :n]).sum(-1).tolist()


def _continuous(config, logits_processor, stopping_criteria, candidate_generator, input_ids, streamer):
    """Continuous batching's checks and settings: (config, stopping criteria)."""
    if candidate_generator is not None and not isinstance(candidate_generator, Drafter):
        raise ValueError("continuous batching needs the draft model or an hf_specdec Drafter; a transformers "
                         "CandidateGenerator runs one row at a time")
    if streamer is not None:
        raise ValueError("streamers take one row; continuous batching runs many")
    if config.draft_vocab_size is not None:
        raise ValueError("draft_vocab_size is chosen from the prompt, and continuous batching has many: leave it unset")
    if input_ids.shape[0] != 1:
        raise ValueError("continuous batching starts from one prompt (the others join as it runs)")
    if any(isinstance(p, MinNewTokensLengthLogitsProcessor) for p in logits_processor or []):
        raise ValueError("min_new_tokens counts from one prompt length in transformers' processor; "
                         "continuous batching has many (use min_length, or one generate call per prompt)")
    # Rows join and leave: no tree (single rows only), no draft window; max_new_tokens counts per row.
    config = dataclasses.replace(config, tree=False, draft_window=None)
    stopping_criteria = StoppingCriteriaList([c for c in stopping_criteria if not isinstance(c, MaxLengthCriteria)])
    return config, stopping_criteria


def _start(
    model, input_ids, logits_processor, stopping_criteria, generation_config, config, assistant,
    candidate_generator, generator, streamer, acceptance_sink, model_kwargs, requests=None,
) -> DecodeState:
    """The state of a fresh call: the draft source, the cost model, the batch, the counters."""
    rows = input_ids.shape[0]
    drafter, foreign = _drafter(config, assistant, candidate_generator, logits_processor, generation_config,
                                generator, input_ids)
    drafter.start(rows)
    use_lookup = config.ngram and not foreign
    # A foreign generator is used as it is, every round; our drafters take part in the cost model.
    policy = DraftPolicy(PolicySettings(
        max_draft_tokens=config.num_draft_tokens, adaptive=config.adaptive and not foreign,
        draft_cost=config.draft_cost, verify_cost=config.verify_cost, verify_knee_cost=config.verify_knee_cost, rows=rows,
        price_by_width=config.price_by_width, verify_curve=config.verify_curve,
        prefill_patience=config.prefill_patience, ngram_depths=config.ngram_depths,
        draft_prefill_cost=config.draft_prefill_cost,
    ))
    cost_key = (str(model.device), torch.get_num_threads(), rows)  # whose d0 a call may reuse
    known = _MEASURED_VERIFY_COSTS.get(model, {}).get(cost_key)
    if known is not None and policy.measuring_costs:  # measured by an earlier call: no rounds spent on it
        policy.state.measured_verify_cost, policy.state.costs_seen = known, True
    decides_on_time = policy.measures_time and (policy.settings.adaptive or use_lookup)
    cache = make_rollbackable(model_kwargs.get("cache") or new_cache(model))
    unpadded = model_kwargs.get("attention_mask") is None or bool(model_kwargs["attention_mask"].all())
    wants_trees = (not generation_config.do_sample) if config.tree is None else config.tree  # None: greedy only
    trees = wants_trees and use_lookup and rows == 1 and unpadded and can_gather((cache, drafter.cache))
    lookup = None
    if use_lookup:
        lookup = NgramDrafter(config.ngram_max_size, config.lookup_min_size(trees), config.ngram_max_tokens,
                              config.ngram_match_cap)
    if requests is not None and not can_gather((cache, drafter.cache)):
        raise UnsupportedCacheError("continuous batching needs full-attention cache layers in both models "
                                    "(rows join by gathering cache columns; sliding-window layers keep a window)")
    write_record, close_sink = open_sink(acceptance_sink)
    batch = RaggedBatch(input_ids, model_kwargs.get("attention_mask"), generation_config.max_length - input_ids.shape[1])
    if requests is not None:  # the first prompt's own budget, if it came with one
        batch.limits[0] = requests.max_new_tokens(0, input_ids[0], generation_config)
    return DecodeState(
        model=model, cache=cache,
        # generate() drops an all-ones attention mask; a batch needs one (for holes) all the same.
        batch=batch,
        processors=RowProcessors(logits_processor, rows), drafter=drafter, lookup=lookup, trees=trees, policy=policy,
        config=config, generation_config=generation_config, stopping_criteria=stopping_criteria,
        streamer=streamer, generator=generator, clock=Clock(model.device, synchronize=decides_on_time),
        stats=AcceptanceStats(), row_stats=[AcceptanceStats() for _ in range(rows)],
        outputs=_Outputs(generation_config, rows), write_record=write_record, close_sink=close_sink,
        requests=requests, cost_key=cost_key,
    )


def _drafter(
    config, assistant, candidate_generator, logits_processor, generation_config, generator, input_ids
) -> tuple[Drafter, bool]:
    """(the draft source, whether it is a foreign transformers generator, wrapped here once)."""
    if isinstance(candidate_generator, Drafter):
        return candidate_generator, False
    if candidate_generator is not None:
        return CandidateGeneratorDrafter(candidate_generator), True
    draft_processor = logits_processor
    if config.draft_temperature is not None and generation_config.do_sample:
        draft_processor = with_draft_temperature(logits_processor, config.draft_temperature)
    vocabulary = None
    if config.draft_vocab_size is not None:
        vocab = assistant.get_output_embeddings().weight.shape[0]
        vocabulary = _draft_vocabulary(config.draft_vocab_size, vocab, input_ids, generation_config)
    # The window needs full-attention layers (zero columns hidden by the mask) and a single row.
    window = None
    if input_ids.shape[0] == 1 and can_gather([new_cache(assistant)]):
        window = config.window_for(bool(generation_config.do_sample))
    drafter = DraftModelDrafter(assistant, draft_processor, bool(generation_config.do_sample), generator, vocabulary,
                                window=window)
    return drafter, False


def _finish(state: DecodeState) -> SpeculativeDecoderOnlyOutput | torch.LongTensor:
    measured = state.policy.state.measured_verify_cost  # remembered for the next call on this model
    if measured is not None:
        _MEASURED_VERIFY_COSTS.setdefault(state.model, {})[state.cost_key] = measured
    if state.streamer is not None:
        state.streamer.end()
    stats = state.stats
    logger.debug("speculative_generate: %d rounds, acceptance %.3f, %.2f tokens/round",
                 stats.rounds, stats.acceptance_rate, stats.mean_tokens_per_round)
    sequences = state.batch.sequences(_pad_token_id(state.generation_config))
    cache = _settle_cache(state, sequences)  # also a user-passed cache, whatever is returned
    if not state.generation_config.return_dict_in_generate:
        return sequences
    scores, logits = state.outputs.stacked()
    return SpeculativeDecoderOnlyOutput(
        sequences=sequences, scores=scores, logits=logits, cache=cache,
        acceptance=stats, acceptance_per_row=state.row_stats, cost_model=state.policy.estimates(),
    )


def _settle_cache(state: DecodeState, sequences: torch.Tensor) -> Cache | None:
    """Leaves the target's cache (the user's own, if one was passed) as plain generate() leaves it, for a
    follow-up call with `cache=`, and returns it: for a single row, every token of `sequences` but the
    last (tokens accepted past a stop are cut). A batch's or a stream's columns hold this loop's holes
    and padding, which a plain call would misread: that cache is emptied (`Cache.reset`; a follow-up
    call encodes its whole input) and None is returned."""
    if state.requests is None and sequences.shape[0] == 1:  # a single row never has holes
        rollback([state.cache], sequences.shape[1] - 1)
        if state.cache.get_seq_length() == sequences.shape[1] - 1:
            return state.cache
    state.cache.reset()
    return None


def _draft_vocabulary(
    size: int, vocab: int, input_ids: torch.Tensor, generation_config: GenerationConfig
) -> torch.Tensor:
    """Token ids the reduced draft head scores: ids below `size`, the prompt's tokens, EOS tokens."""
    eos = generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    parts = [torch.arange(min(size, vocab), device=input_ids.device), input_ids.flatten(), torch.tensor(eos, dtype=torch.long, device=input_ids.device)]
    return torch.cat(parts).unique()


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
        if self.scores is not None:
            self.scores[row].extend(scores.unbind(0))
        if self.logits is not None:
            self.logits[row].extend(logits.float().unbind(0))

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
            filler[self.pad_token_id] = 0.0
        longest = max(len(row) for row in per_row)
        return tuple(
            torch.stack([row[t] if t < len(row) else filler for row in per_row]) for t in range(longest)
        )


def _validate(
    model: PreTrainedModel,
    assistant: PreTrainedModel | None,
    candidate_generator: Drafter | CandidateGenerator | None,
    input_ids: torch.Tensor,
    generation_config: GenerationConfig,
    synced_gpus: bool,
    model_kwargs: dict[str, Any],
    streaming: bool = False,
) -> None:
    """Clear errors for what this decode loop cannot do correctly."""
    if input_ids.shape[0] > 1 and streaming:
        raise ValueError("streamers take one row, as in transformers; got a batch of %d rows" % input_ids.shape[0])
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
    if generation_config.num_return_sequences not in (None, 1):
        raise ValueError("hf_specdec does not support num_return_sequences > 1 yet.")
    if input_ids.shape[0] != 1 and candidate_generator is not None and not isinstance(candidate_generator, Drafter):
        raise ValueError(
            f"a custom candidate_generator runs one row at a time, got a batch of {input_ids.shape[0]} rows."
        )
    if synced_gpus:
        raise ValueError("hf_specdec does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP generation).")
    for flag in ("output_attentions", "output_hidden_states"):
        if generation_config.return_dict_in_generate and getattr(generation_config, flag):
            raise ValueError(f"hf_specdec does not return attentions or hidden states ({flag}=True).")
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(
            f"hf_specdec supports DynamicCache only, got cache_implementation={generation_config.cache_implementation!r}."
        )
    _validate_model_inputs(model_kwargs)
    _validate_padding(model_kwargs.get("attention_mask"), input_ids)
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: hf_specdec needs at least one input token (a BOS token will do).")
    check_cache(model_kwargs.get("cache"), "target")
    cached = model_kwargs["cache"].get_seq_length() if model_kwargs.get("cache") is not None else 0
    if cached >= input_ids.shape[1]:
        raise ValueError(f"the cache passed in holds {cached} tokens and the input {input_ids.shape[1]}: a cache "
                         "must hold a prefix of input_ids, with at least the last token left to encode.")
    if assistant is not None:
        _validate_assistant(model, assistant)


class StreamerNotForwardedError(ValueError):
    """`streamer=` was given to `model.generate` with the callable `custom_generate=`: transformers puts
    the prompt into it and does not hand it to the callable, so no token and no end would follow."""


def _refuse_dropped_streamer(spec_streamer: BaseStreamer | None) -> None:
    """transformers' generate() takes `streamer=` itself, puts the prompt into it and calls a callable
    `custom_generate` without it; a consumer iterating a `TextIteratorStreamer` would then wait forever.
    No public route hands the object over, so it is found in generate()'s own frame, ended (the
    consumer wakes up) and refused with an error naming the two forms that stream."""
    from transformers.generation.utils import GenerationMixin

    code = inspect.unwrap(GenerationMixin.generate).__code__
    frame = sys._getframe(2)
    for _ in range(16):  # generate() -> its decorators -> this call
        if frame is None:
            return
        if frame.f_code is code:
            break
        frame = frame.f_back
    else:
        return
    dropped = frame.f_locals.get("streamer")
    if dropped is None or dropped is spec_streamer:
        return
    dropped.end()
    raise StreamerNotForwardedError(
        "streamer= does not reach a callable custom_generate (transformers consumes it and would stream only the "
        "prompt); pass spec_streamer=your_streamer instead, or use the directory form "
        "custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True, which takes streamer=. "
        "The streamer has been ended."
    )


_CONFIG_ARGUMENTS = ("num_draft_tokens", "draft_temperature", "adaptive", "ngram", "draft_vocab_size", "draft_cost",
                     "verify_cost", "verify_knee_cost", "price_by_width", "verify_curve", "draft_prefill_cost", "tree",
                     "draft_window")


_OWN_ARGUMENTS = frozenset({*_CONFIG_ARGUMENTS, "assistant", "acceptance_sink", "generator", "spec_streamer",
                            "speculative_config"})


def check_arguments(kwargs: dict[str, Any]) -> SpeculativeConfig:
    """`speculative_generate`'s own arguments (by name in `kwargs`) checked by type and range, and the
    call's config: explicit settings over `speculative_config` (or the defaults). `generate_continuous`
    calls it too, before it reads its first prompt."""
    _validate_arguments(kwargs.get("assistant"), kwargs.get("acceptance_sink"), kwargs.get("generator"),
                        kwargs.get("spec_streamer"), kwargs.get("speculative_config"))
    return _resolve_config(kwargs.get("speculative_config"), **{k: kwargs[k] for k in _CONFIG_ARGUMENTS if k in kwargs})


def _validate_arguments(assistant, acceptance_sink, generator, spec_streamer, speculative_config) -> None:
    """Type checks of hf_specdec's own call arguments, before any model work."""
    if assistant is not None and not isinstance(assistant, torch.nn.Module):
        raise ValueError(f"assistant must be a transformers model (the draft), got {type(assistant).__name__}")
    if acceptance_sink is not None and not (callable(acceptance_sink) or isinstance(acceptance_sink, (str, os.PathLike))):
        raise ValueError(f"acceptance_sink must be a callable or a file path, got {type(acceptance_sink).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if spec_streamer is not None and not (callable(getattr(spec_streamer, "put", None)) and callable(getattr(spec_streamer, "end", None))):
        raise ValueError(f"spec_streamer must be a streamer (with put() and end()), got {type(spec_streamer).__name__}")
    if speculative_config is not None and not isinstance(speculative_config, SpeculativeConfig):
        raise ValueError(f"speculative_config must be a SpeculativeConfig, got {type(speculative_config).__name__}")


def _validate_padding(mask: torch.Tensor | None, input_ids: torch.Tensor) -> None:
    """A named error for masks this loop would misread: every row must be left-padded (zeros, then
    ones) with at least one real token; transformers only warns about right padding and returns rows
    that differ from each prompt's own."""
    if mask is None:
        return
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids {tuple(input_ids.shape)}")
    mask = mask.bool()
    padding_after_a_token = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1)  # a 1 followed by a 0
    empty = ~mask.any(dim=1)
    bad = (padding_after_a_token | empty).nonzero()[:, 0].tolist()
    if bad:
        what = "has no real token" if bool(empty[bad[0]]) else "has padding after its tokens (right padding)"
        raise ValueError(
            f"attention_mask row {bad[0]} {what}: hf_specdec needs left-padded batches (zeros, then the prompt), "
            "as transformers' decoder-only generation does; set tokenizer.padding_side = 'left'"
            + (f" ({len(bad)} rows affected)" if len(bad) > 1 else "")
        )


# What generate() puts in model_kwargs for a text prompt, all of which the loop handles itself:
# the mask, the cache, and settings it derives anew for every forward (positions from the mask).
_HANDLED_MODEL_INPUTS = frozenset({
    "attention_mask", "cache", "past_key_values", "use_cache", "logits_to_keep", "position_ids", "cache_position",
    "output_attentions", "output_hidden_states", "return_dict",
})


def _validate_model_inputs(model_kwargs: dict[str, Any]) -> None:
    """Clear errors for forward inputs the loop would otherwise drop (plain generate() passes them to
    every forward, so dropping them would silently change the output)."""
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("hf_specdec starts from input_ids (both models read the same token ids); "
                         "inputs_embeds is not supported: pass the prompt as input_ids.")
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _HANDLED_MODEL_INPUTS)
    if extra:
        raise ValueError(
            f"hf_specdec feeds both models token ids and an attention mask only; got {', '.join(extra)}, which plain "
            "generate() would pass to every forward and hf_specdec would drop. Generate without them, or with "
            "plain generate()."
        )


def _validate_assistant(model: PreTrainedModel, assistant: PreTrainedModel) -> None:
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
