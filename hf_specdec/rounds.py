"""The six stages of a round, each a short function over the `DecodeState` and plain data:

    proposal, trace = propose(state)           # 1. the planner picks the nodes, the sources propose them
    verdict = verify(state, proposal)          # 2. one target forward, the acceptance rule per row
    commit(state, proposal, verdict)           # 3. caches and the work sequence
    emission = emit(state, verdict)            # 4. stopping criteria, streamer, output scores
    observe(state, proposal, trace, verdict, emission)  # 5. statistics, the sink, the planner
    retire(state, emission.finished)           # 6. finished rows leave; holes are compacted

With continuous batching, `admit(state)` lets waiting prompts join before each round.

Device reads: a round reads the device at most three times, each one copy: the draft's tokens and
confidences (`DraftModelDrafter.propose`), the verdict (accepted counts and emitted tokens; for a
tree every node's argmax), and the stopping criteria's answers. Everything else the planner and the
lookups need is host data (`RaggedBatch` keeps each row's tokens and its mask on the host, so a
compaction reads nothing). On a CPU a few more reads make sampling cheaper (`sampling.reads_are_free`);
an acceptance sink adds its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .cache import add_row, clear as clear_caches, extend, extend_tree, keep_path, pad_front, rollback
from .host import to_device
from .planner import Planner, RoundPlan
from .proposals import DraftRequest, Proposal
from .proposals.tree import SIBLING, Trie, ancestors_mask, depths, path_tokens, retrieval_reach, tree_depth, tree_proposal
from .sampling import logits_to_probs
from .stats import CACHE, DRAFT, NGRAM, NONE, AcceptanceStats, RoundRecord
from .verify import greedy_tree_verification, greedy_verification, lazy_speculative_sampling, reads_are_free

if TYPE_CHECKING:
    from .generate import DecodeState

TREE_BRANCHES = 8  # retrieved continuations merged into a tree


@dataclass
class Trace:
    """The planner's record of a round (host data): what it estimated and why, for `observe` and the sink."""

    seconds: float = 0.0  # proposing, wall time
    lag: int = 0  # columns the draft's cache lacked before it drafted (more than 2: its first forward caught up)
    plan: RoundPlan | None = None
    match_sizes: list[int] = field(default_factory=list)  # per row, the n-gram match its retrieval follows
    match_sources: list[str] = field(default_factory=list)  # per row, where it was retrieved: NGRAM (the row) or CACHE
    unverified: dict[int, list[int]] = field(default_factory=dict)  # row -> a retrieved continuation not verified
    retrieved: set[int] = field(default_factory=set)  # chain rounds: rows verifying their retrieved continuation
    estimates: list[float] | None = None  # per verified node of one row, P(accepted) as planned


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
    # the id that fills masked columns is fed to the models: the pad id where it has an embedding row, else 0
    rows = state.model.get_input_embeddings().weight.shape[0]
    filler = state.pad_token_id if 0 <= state.pad_token_id < rows else 0
    for prompt in prompts:
        front = batch.widen(prompt.shape[0], filler)
        if front:
            pad_front(state.caches, front)
        batch.add_row(prompt, requests.max_new_tokens(len(batch.prompts), prompt, state.generation_config), filler)
        ids, mask = batch.ids[-1:], batch.mask[-1:]
        add_row(state.model, state.cache, ids, mask)
        state.drafter.add_row(ids, mask)
        state.processors.add_row()
        state.row_stats.append(AcceptanceStats())
        state.outputs.add_row()
    state.planner.set_rows(batch.size)


def propose(state: DecodeState) -> tuple[Proposal, Trace]:
    """1. Draft. The planner chooses this round's nodes: retrieved ones, the draft model's (drafted,
    then priced by their confidences), or none (a plain target step); the sources propose them."""
    start, batch, planner = state.clock.now(), state.batch, state.planner
    if state.lookup is not None:
        state.lookup.sync(batch.prompt_host, batch.generated, batch.rows)  # the rows' new tokens, for each other
    room = 0 if planner.measuring else batch.remaining() - 1  # a round emits at most k + 1 tokens a row
    longest = batch.longest()  # host state: the positions the longest row has fed
    if state.max_positions is not None:  # a table of positions (GPT-2): fed tokens must not pass its last row
        _check_positions(longest, state.max_positions)
        room = min(room, state.max_positions - longest)
    draft_room = state.drafter.room(longest)  # the draft's context length bounds it (None: no bound)
    request = DraftRequest(batch.ids, batch.mask, batch.prefixes(),
                           max(0, min(state.config.num_draft_tokens, room, room if draft_room is None else draft_room)),
                           batch.host_sequences(), confidences=planner.adaptive, generator=state.generator)
    cached = state.drafter.cache.get_seq_length() if state.drafter.cache is not None else batch.width
    trace = Trace(lag=batch.width - cached)
    if room <= 0:
        proposal = Proposal.nothing(batch.size, batch.ids.device)
    elif state.trees:
        proposal = _propose_tree(state, request, room, trace)
    else:
        proposal = _propose_chains(state, request, room, trace)
    trace.seconds = state.clock.now() - start
    return proposal, trace


def _check_positions(length: int, table: int) -> None:
    """A row of `length` tokens feeds its last at position length - 1: past a learned table's last row
    plain generate() fails too (an IndexError inside the model); this says why, before the forward."""
    if length > table:
        raise ValueError(f"the target looks positions up in a table of {table} rows (n_positions or "
                         f"max_position_embeddings) and a row now holds {length} tokens, so its next forward needs "
                         f"position {length - 1}, past the table (plain generate() fails here too). Ask for at most "
                         f"max_length={table + 1} tokens in all, prompt included, or shorten the prompt")


def _lookup_reach(state: DecodeState, tokens: list[int], size: int, source: str,
                  shares: list[float] | None = None) -> list[float]:
    """P(a retrieved chain's tokens 1..i all accepted), at its source's acceptance for its match size,
    times, for a cached chain, the share of earlier occurrences that went on that way at each token
    (`RetrievalCache.lookup_shares`; a tree's retrieved nodes get the share of the distinct
    continuations instead, `retrieval_reach`)."""
    a, out = state.planner.acceptance.lookup_at(size, source), []
    for j in range(len(tokens)):
        out.append(a * (shares[j] if shares else 1.0) * (out[-1] if out else 1.0))
    return out


def _propose_chains(state: DecodeState, request: DraftRequest, room: int, trace: Trace) -> Proposal:
    """Chains, for one row or a batch: per row its lookup or the draft model's chain, as the planner
    says; each row's length its own (verified with per-row lengths, a row of length 0 a plain step).
    Which rows take their lookup is decided before the draft runs, and how many drafted tokens are
    verified by the planner's stop rule, each token kept on what the tokens before it said: under
    sampling a drafted token must not be kept or dropped by its own value (that would bias q)."""
    planner, rows = state.planner, state.batch.size
    found = (state.lookup.match_rows(dataclasses.replace(request, max_tokens=room), state.batch.rows)
             if state.lookup else [([], 0, NGRAM)] * rows)
    lookups = [(tokens, size) for tokens, size, _ in found]
    trace.match_sizes, trace.match_sources = [size for _, size in lookups], [source for _, _, source in found]
    reach = [_lookup_reach(state, tokens, size, source, _shares(state, i, source))
             for i, (tokens, size, source) in enumerate(found)]
    trace.plan = plan = planner.plan(reach, request.max_tokens, state.drafter.prefill_tokens(request.ids.shape[1]), room)
    if not plan.draft:
        chains = [tokens[: len(nodes)] for (tokens, _), nodes in zip(lookups, plan.nodes)]
        trace.unverified = {r: tokens for r, ((tokens, _), chain) in enumerate(zip(lookups, chains)) if tokens and not chain}
        trace.retrieved = {r for r, chain in enumerate(chains) if chain}
        return _point_masses(chains, request.ids.device) if any(chains) else Proposal.nothing(rows, request.ids.device)
    expected = sum(planner.acceptance.draft_reach(plan.draft))  # a draft row's expected accepted tokens
    use_lookup = [sum(r) > expected for r in reach]
    trace.unverified = {r: tokens for r, (tokens, _) in enumerate(lookups) if tokens and not use_lookup[r]}
    chain, stopped = _draft(state, request, plan)
    if chain.confidences is None or not planner.adaptive:  # verified as drafted
        return chain
    # the stop rule already ended a chain drafted token by token; a planned one is cut by it now
    drafted = chain.num_tokens if stopped else planner.stopped_length(chain.confidences, request.max_tokens)
    if not any(use_lookup):
        return chain.first([drafted] * rows)
    lengths = lookup_lengths(planner, reach, chain.confidences, use_lookup, drafted)
    retrieved = [tokens[:n] if lookup else None for (tokens, _), n, lookup in zip(lookups, lengths, use_lookup)]
    trace.retrieved = {r for r, lookup in enumerate(use_lookup) if lookup}
    return _mixed(chain, retrieved, [drafted if t is None else len(t) for t in retrieved])


def lookup_lengths(planner: Planner, reach: list[list[float]], confidences: list[list[float]],
                   use_lookup: list[bool], drafted: int) -> list[int]:
    """How many retrieved tokens each row that verifies its lookup beside drafted rows gets (0 for
    the drafted rows): chosen for the batch with the drafted chains kept, since a lookup longer than
    the drafted chains widens every row's forward and pays only if the batch gains by it."""
    calibrated = [[] if lookup else list(itertools.accumulate(map(planner.acceptance.calibrated, c[:drafted]),
                                                              operator.mul))
                  for c, lookup in zip(confidences, use_lookup)]
    keep = [[] if lookup else list(range(drafted)) for lookup in use_lookup]
    nodes = planner.best_nodes([r if lookup else c for r, c, lookup in zip(reach, calibrated, use_lookup)],
                               keep=keep)[0]
    return [len(n) if lookup else 0 for n, lookup in zip(nodes, use_lookup)]


def _draft(state: DecodeState, request: DraftRequest, plan: RoundPlan) -> tuple[Proposal, bool]:
    """(the draft model's chain, whether the stop rule already ended it): where reading the device is
    free (the CPU), drafted token by token while the planner's stop rule says the next one pays;
    elsewhere the planned length, read once."""
    if state.planner.adaptive and not plan.probe and reads_are_free(request.ids.device):
        stop = state.planner.stop_rule(request.max_tokens)
        return state.drafter.propose(dataclasses.replace(request, keep_drafting=stop)), True
    return state.drafter.propose(dataclasses.replace(request, max_tokens=plan.draft)), False


def _point_masses(chains: list[list[int]], device: torch.device) -> Proposal:
    """Retrieved chains (host tokens) as one proposal, each row its own length."""
    k = max(len(c) for c in chains)
    tokens = to_device([c + [0] * (k - len(c)) for c in chains], device)
    return Proposal(tokens, None, source=NGRAM if any(chains) else NONE, host=chains,
                    sources=[NGRAM if c else NONE for c in chains])


def _mixed(chain: Proposal, retrieved: list[list[int] | None], lengths: list[int]) -> Proposal:
    """A batch round in which some rows verify their lookup (point masses, `retrieved[r]`) and the
    others the draft model's chain, each cut to its length."""
    rows, device = len(lengths), chain.tokens.device
    k = max(lengths + [len(t) for t in retrieved if t is not None])
    tokens = torch.nn.functional.pad(chain.tokens, (0, max(0, k - chain.num_tokens)))[:, :k].clone()
    q = None
    if chain.draft_probs is not None:  # sampled drafts: q per row, one-hot for lookups
        q = torch.nn.functional.pad(chain.draft_probs, (0, 0, 0, max(0, k - chain.num_tokens)))[:, :k].clone()
    host, sources = [], []
    for r in range(rows):
        row = retrieved[r]
        if row is None:
            host.append(chain.host[r][: lengths[r]])
            sources.append(DRAFT if lengths[r] else NONE)
            continue
        ids = to_device(row, device)
        tokens[r, : len(row)] = ids
        if q is not None:
            q[r, : len(row)] = torch.nn.functional.one_hot(ids, q.shape[-1]).to(q.dtype)
        host.append(row)
        sources.append(NGRAM if row else NONE)
    return dataclasses.replace(chain, tokens=tokens, draft_probs=q, host=host, sources=sources,
                               source=DRAFT if DRAFT in sources else NGRAM if NGRAM in sources else NONE,
                               confidences=[c[:m] for c, m in zip(chain.confidences, lengths)], runners_up=None)


def _propose_tree(state: DecodeState, request: DraftRequest, room: int, trace: Trace) -> Proposal:
    """A tree round (one row, greedy): every distinct retrieved continuation as a trie, verified alone
    when the planner expects that to beat the draft model; else merged with the draft's chain and its
    runners-up, and the nodes that pay kept (`Planner.best_nodes`)."""
    planner, device, most = state.planner, request.ids.device, state.config.tree_max_nodes
    continuations, size, source = state.lookup.retrieve(dataclasses.replace(request, max_tokens=room), TREE_BRANCHES,
                                                        state.batch.rows[0])
    trace.match_sizes, trace.match_sources = [size], [source]
    retrieved = Trie()
    for continuation in continuations:
        retrieved.insert(continuation, NGRAM, count=True)
    acceptance = planner.acceptance.lookup_at(size, source)
    reach = retrieval_reach(retrieved, acceptance)
    prefill = state.drafter.prefill_tokens(request.ids.shape[1])
    trace.plan = plan = planner.plan([reach], request.max_tokens, prefill, room, most=most, merge=True)
    if not plan.draft:
        keep = plan.nodes[0]
        if not keep:
            trace.unverified = {0: continuations[0]} if continuations else {}
            return Proposal.nothing(1, device)
        trace.estimates, trace.retrieved = [reach[j] for j in keep], {0}
        return tree_proposal(retrieved, keep, None, NGRAM, device)
    chain, _ = _draft(state, request, plan)
    if chain.confidences is None or not planner.adaptive:
        trace.unverified = {0: continuations[0]} if continuations else {}
        return chain
    merged = Trie()
    nodes = merged.insert(chain.host[0], DRAFT, count=False)
    draft_acceptance = {j: planner.acceptance.calibrated(c) for j, c in enumerate(chain.confidences[0])}
    # Greedy drafts: the draft's runner-up beside each chain node, accepted when the chain token is not
    # and the target's choice is the runner-up: estimated as (1 - a) q2 / (1 - q1).
    siblings = {}
    for j, (token, prob) in enumerate(chain.runners_up[0] if chain.runners_up else []):
        node = merged.add(-1 if j == 0 else nodes[j - 1], token, SIBLING)
        siblings[node] = (1 - draft_acceptance[j]) * min(1.0, prob / max(1e-6, 1 - chain.confidences[0][j]))
    for continuation in continuations:
        merged.insert(continuation, NGRAM, count=True)
    reach = retrieval_reach(merged, acceptance, draft_acceptance, siblings)
    keep = planner.best_nodes([reach], base=chain.forwards * planner.curve.draft_step, most=most)[0][0]
    if continuations and not any(merged.origins[j] == NGRAM for j in keep):
        trace.unverified = {0: continuations[0]}
    trace.estimates = [reach[j] for j in keep]
    trace.retrieved = set() if all(merged.origins[j] == DRAFT for j in keep) else {0}  # all DRAFT: the drafter's chain
    return tree_proposal(merged, keep, chain, DRAFT, device)


def verify(state: DecodeState, proposal: Proposal) -> Verdict:
    """2. One target forward over the pending column(s) and the k drafts; p at each position with
    that row's own prefix; then the rule per row: greedy accepts while the argmaxes agree, sampling
    applies the rejection rule with p computed only as far as some row still needs it (on a CPU)."""
    if proposal.tree is not None:
        return _verify_tree(state, proposal)
    start, batch, drafts = state.clock.now(), state.batch, proposal.tokens  # drafts: [rows, k]
    k = proposal.num_tokens
    lengths = None
    if proposal.host is not None and any(len(h) != k for h in proposal.host):
        lengths = to_device([len(h) for h in proposal.host], drafts.device)
    ids = torch.cat([batch.ids, drafts], dim=1)  # [rows, seq + k]
    mask = None if batch.mask is None else torch.nn.functional.pad(batch.mask, (0, k), value=1)
    columns = ids.shape[1] - state.cache.get_seq_length()
    logits = extend(state.model, state.cache, ids, mask, num_logits=k + 1)  # [rows, k + 1, vocab]
    prefixes, scores = batch.prefixes(), []
    if state.generation_config.do_sample:

        def target_probs_at(first: int, stop: int) -> torch.Tensor:  # [rows, stop - first, vocab]
            scores.append(state.processors.positions(prefixes, drafts, logits[:, first:stop], first))
            return logits_to_probs(scores[-1])

        num_accepted, emitted, target_probs = lazy_speculative_sampling(  # inputs the loop built: not checked
            drafts, proposal.draft_probs, target_probs_at, state.generator, lengths=lengths, check=False
        )
    else:
        scores.append(state.processors.positions(prefixes, drafts, logits))  # [rows, k + 1, vocab]
        num_accepted, emitted = greedy_verification(drafts, scores[0], lengths=lengths, check=False)
        target_probs = None
    host = torch.cat([num_accepted[:, None], emitted], dim=1).tolist()  # the verdict's one device read
    tokens = [row[1 : row[0] + 2] for row in host]
    target_scores = scores[0] if len(scores) == 1 else torch.cat(scores, dim=1)  # [rows, n, vocab]
    return Verdict(num_accepted, emitted, tokens, target_scores, logits, target_probs, seconds=state.clock.now() - start,
                   columns=columns)


def _verify_tree(state: DecodeState, proposal: Proposal) -> Verdict:
    """2 (trees, one row, greedy). One target forward over the pending token(s) and every node, each
    node seeing only its ancestors; the processed scores at every node (its own branch as the
    processors' prefix), their argmaxes read in one copy, and the walk on the host."""
    start, batch, tree = state.clock.now(), state.batch, proposal.tree
    tokens = proposal.host_tokens()[0]
    columns = batch.ids.shape[1] - state.cache.get_seq_length() + len(tokens)
    logits = extend_tree(state.model, state.cache, batch.ids, proposal.tokens, ancestors_mask(tree.parents),
                         depths(tree.parents))[0]  # [n + 1, vocab]: after the last real token, then after each node
    prefixes = batch.prefixes()
    scores = []
    for node in range(-1, len(tokens)):
        branch = to_device([path_tokens(tokens, tree.parents, node)], logits.device)
        scores.append(state.processors.scores(prefixes, branch, logits[node + 1][None])[0])
    scores = torch.stack(scores)  # [n + 1, vocab]
    argmax = scores.argmax(dim=-1).tolist()  # the verdict's one device read
    path, extra = greedy_tree_verification(tokens, tree.parents, lambda node: argmax[node + 1])
    walk = to_device([n + 1 for n in [-1] + path], logits.device)
    emitted = [tokens[j] for j in path] + [extra]
    return Verdict(
        num_accepted=to_device([len(path)], logits.device),
        emitted=to_device([emitted], logits.device), tokens=[emitted],
        target_scores=scores.index_select(0, walk)[None], target_logits=logits.index_select(0, walk)[None],
        target_probs=None, seconds=state.clock.now() - start, path=path, columns=columns,
    )


def commit(state: DecodeState, proposal: Proposal, verdict: Verdict) -> None:
    """3. Both caches keep the draft columns some row accepted (in the other rows they become masked
    holes) and drop the rest; the work sequence grows by those columns and each row's extra token.
    After a tree, the target's cache keeps the accepted branch's columns, the draft's the part of its
    own chain that was accepted."""
    accepted = verdict.accepted
    m = max(accepted)
    rows = torch.arange(state.batch.size, device=verdict.emitted.device)
    extra = verdict.emitted[rows, verdict.num_accepted]  # [rows]: each row's recovered or bonus token
    if proposal.tree is not None:
        keep_path(state.cache, state.batch.width, verdict.path, proposal.num_tokens)
        rollback([state.drafter.cache], state.batch.width + proposal.tree.chain_accepted(verdict.path))
        state.batch.append_round(verdict.emitted[:, :m], verdict.num_accepted, extra, accepted)
    else:
        rollback([state.cache], state.batch.width + m)
        # Rows that proposed a lookup hold the draft's tokens in the draft's cache, not theirs: the
        # draft re-reads the round's accepted tokens next time it runs.
        mixed = proposal.sources is not None and proposal.forwards > 0 and NGRAM in proposal.sources
        rollback([state.drafter.cache], state.batch.width + (0 if mixed else m))
        state.batch.append_round(proposal.tokens[:, :m], verdict.num_accepted, extra, accepted)
    state.drafter.update(state.batch.ids, verdict.target_scores, m)


def emit(state: DecodeState, verdict: Verdict) -> Emission:
    """4. Each row's tokens are checked against the stopping criteria one prefix at a time (all rows'
    answers read in one copy), so that a stop inside the block (EOS, max_length, a user criterion)
    ends the row exactly there; then they go to the streamer and, when asked for, to the output
    scores and logits."""
    answers, failed = _criteria(state, verdict)
    done = torch.stack(answers).tolist() if answers else []  # the criteria's one device read
    counts, finished, held = [], [], state.held
    for i, row in enumerate(state.batch.rows):
        tokens, left = verdict.tokens[i], state.batch.left(i)
        count, stopped = len(tokens), i in failed
        for j in range(len(tokens)):
            if j + 1 >= left:
                count, stopped = j + 1, True
                if state.requests is not None and done[i * verdict.emitted.shape[1] + j]:
                    state.requests.stopped_at_budget(row)  # EOS on a learned table's last position: plain ends fine
                break
            if not stopped and done[i * verdict.emitted.shape[1] + j] and (held is None or row not in held):
                if held is None:
                    count, stopped = j + 1, True
                    break
                held[row] = len(state.batch.generated[row]) + j + 1  # it decodes on, as in plain generate()
        if i in failed:
            count = 0
            state.requests.fail(row, failed[i])
        state.batch.record(i, tokens[:count])
        state.outputs.add(row, verdict.target_scores[i, :count], verdict.target_logits[i, :count])
        if state.streamer is not None:
            state.streamer.put(torch.tensor(tokens[:count], device="cpu"))
        counts.append(count)
        finished.append(stopped)
    if held is not None and all(row in held or done for row, done in zip(state.batch.rows, finished)):
        _end_held(state, counts, finished)
    return Emission(counts, finished)


def _end_held(state: DecodeState, counts: list[int], finished: list[bool]) -> None:
    """Every row of a batch without EOS has stopped: as plain generate() ends the batch at the step the
    last one stopped, rows past it are cut back to it, rows short of it decode on until they reach it."""
    batch, outputs = state.batch, state.outputs
    end = max(state.held.get(row, len(tokens)) for row, tokens in enumerate(batch.generated))
    flush_records(state, end)
    active = {row: i for i, row in enumerate(batch.rows)}
    for row, tokens in enumerate(batch.generated):  # rows that already left at their budget too
        extra = len(tokens) - end
        if extra > 0:
            del tokens[end:]
            for per_row in (outputs.scores, outputs.logits):
                if per_row is not None:
                    del per_row[row][end:]
            counted = extra - (counts[active[row]] if row in active else 0)  # emitted in earlier rounds
            for stats in (state.stats, state.row_stats[row]):
                stats.emitted -= max(0, counted)
        if row in active:
            batch.limits[row] = end
            if extra >= 0:
                i = active[row]
                counts[i], finished[i] = max(0, counts[i] - extra), True


def flush_records(state: DecodeState, end: int | None = None) -> None:
    """Write the records held back while rows were held, their emitted tokens cut at the batch's `end`."""
    pending, state.pending = state.pending, []  # taken first: a sink that raises is not given them twice
    for record, start in pending:
        if end is not None:
            record.emitted_tokens = record.emitted_tokens[: max(0, end - start)]
        state.write_record(record)


_ROW_BY_ROW = ("a stopping criterion answered {} values for one row: hf_specdec asks the criteria about each row "
               "on its own (input_ids of shape [1, length]; rows of a batch differ in length), so a criterion must "
               "answer per row of the input_ids it is given, not by a row's place in the batch")


def _criteria(state: DecodeState, verdict: Verdict) -> tuple[list[torch.Tensor], dict[int, Exception]]:
    """Per row and emitted-token slot, whether the stopping criteria stop after that token (device
    bools, `emitted.shape[1]` slots a row, padded with False), and the rows whose criterion raised
    (continuous batching: that request fails alone; otherwise the error propagates). The criteria are
    asked token by token and, where an answer is on the host or reads are free, not past a stop (as in
    plain decoding); on an accelerator they may be asked about the rest of the round before one read."""
    answers, failed, slots = [], {}, verdict.emitted.shape[1]
    no = torch.zeros((), dtype=torch.bool, device=verdict.emitted.device)
    yes = ~no  # a criterion answering with a Python bool: one of these, no upload per token
    free = reads_are_free(verdict.emitted.device)
    for i, tokens in enumerate(verdict.tokens):
        row = []
        # the scores as plain decoding hands them over: every step's so far ([1, vocab] each: this row's), or
        # None where output_scores is off
        earlier = None if state.outputs.scores is None else state.outputs.scores[state.batch.rows[i]]
        try:
            before = state.batch.real_sequence(i)  # [1, len]
            sequence = torch.cat([before, verdict.emitted[i : i + 1, : len(tokens)]], dim=1)
            for j in range(len(tokens)):
                scores = None if earlier is None else (*earlier, *verdict.target_scores[i, : j + 1].split(1))
                stop = state.stopping_criteria(sequence[:, : before.shape[1] + j + 1], scores)
                if isinstance(stop, torch.Tensor) and stop.numel() != 1:  # a shape: no device read
                    raise ValueError(_ROW_BY_ROW.format(stop.numel()))
                on_host = not isinstance(stop, torch.Tensor)
                row.append((yes if stop else no) if on_host else stop.all())
                if bool(stop) if on_host else free and bool(row[-1]):
                    break  # not asked past a stop
        except Exception as error:
            if state.requests is None:
                raise
            failed[i], row = error, []
        answers.extend(row + [no] * (slots - len(row)))
    return answers, failed


def observe(state: DecodeState, proposal: Proposal, trace: Trace, verdict: Verdict, emission: Emission) -> None:
    """5. Statistics for the batch and each row, one record per row for the sink, and the planner."""
    accepted = verdict.accepted
    for i, row in enumerate(state.batch.rows):
        # a tree counts its depth: the most tokens it could accept (its nodes are in the record); the rule looked
        # one position past its accepted branch only where that branch has a child there
        length, reached = proposal.length(i), None
        if proposal.tree is not None:
            parents, last = proposal.tree.parents, (verdict.path[-1] if verdict.path else -1)
            length, reached = tree_depth(parents), accepted[i] + (last in parents)
        for counters in (state.stats, state.row_stats[row]):
            counters.record(length, accepted[i], emission.counts[i], reached)
        # the row's own source; the forwards and seconds of the round it took part in (shared with the others)
        state.row_stats[row].count_round(_source(proposal, i), proposal.forwards, trace.seconds, verdict.seconds)
        if state.write_record is not None:
            record = _record(state, proposal, trace, verdict, emission, i, row)
            if state.held:  # a row decodes on past its stop: tokens past the batch's end are cut when it ends
                state.pending.append((record, len(state.batch.generated[row]) - emission.counts[i]))
            else:
                state.write_record(record)
    state.stats.count_round(proposal.source if proposal.num_tokens else NONE, proposal.forwards, trace.seconds,
                            verdict.seconds)
    timed = proposal.forwards if trace.lag <= 2 else 0  # a first forward that caught up (or encoded the prompt) is no step
    state.planner.curve.observe(proposal.num_tokens + 1, verdict.seconds, timed, trace.seconds, verdict.columns)
    if proposal.tree is not None:
        _observe_tree(state, proposal, trace, verdict)
    else:
        _observe_chains(state, proposal, trace, accepted)
    for r, continuation in trace.unverified.items():
        size, source = _match(trace, r)
        state.planner.acceptance.score_unverified(continuation, verdict.tokens[r][: emission.counts[r]], size, source,
                                                  _shares(state, r, source))
    if state.lookup is not None:  # the source each row passed over, scored once
        passed, state.lookup.passed_over = state.lookup.passed_over, {}
        for r, (continuation, size, source) in passed.items():
            state.planner.acceptance.score_unverified(continuation, verdict.tokens[r][: emission.counts[r]], size, source,
                                                      _shares(state, r, source))


def _observe_chains(state: DecodeState, proposal: Proposal, trace: Trace, accepted: list[int]) -> None:
    """The planner learns from each row's chain: the draft model's rows, and the lookups."""
    planner, drafted = state.planner, []
    for i in range(len(accepted)):
        source, length = proposal.source_of(i), proposal.length(i)
        if _retrieved(proposal, trace, i):  # not an n-gram drafter's chain (NgramDrafter as the draft)
            size, origin = _match(trace, i)
            shares = _shares(state, i, origin)
            for j in range(min(accepted[i] + 1, length)):
                planner.acceptance.observe_lookup(size, j < accepted[i], origin, shares[j] if shares else 1.0)
        elif source not in (NONE,) and length:
            drafted.append(i)
    if not drafted:
        planner.observe_without_draft()
        return
    confidences = None if proposal.confidences is None else [proposal.confidences[i] for i in drafted]
    planner.observe_draft([proposal.length(i) for i in drafted], [accepted[i] for i in drafted],
                          [accepted[i] > 0 for i in drafted], confidences, probe=bool(trace.plan and trace.plan.probe))


def _observe_tree(state: DecodeState, proposal: Proposal, trace: Trace, verdict: Verdict) -> None:
    """A tree round: the draft chain is scored as a draft round, its first forward counted as paid
    when the walk took its token or the runner-up beside it; each retrieval event scores retrieval."""
    tree, path, planner = proposal.tree, verdict.path, state.planner
    if tree.chain:
        confidences = None if proposal.confidences is None else [proposal.confidences[0][: tree.chain]]
        planner.observe_draft([tree.chain], [tree.chain_accepted(path)], [bool(path) and tree.from_draft(path[0])],
                              confidences, probe=bool(trace.plan and trace.plan.probe))
    else:
        planner.observe_without_draft()
    size, source = _match(trace, 0)
    for hit in tree.retrieval_events(path):
        planner.acceptance.observe_lookup(size, hit, source)


def _shares(state: DecodeState, i: int, source: str) -> list[float] | None:
    """Row i's cached continuation's shares this round (`RetrievalCache.lookup_shares`), for the cache's
    tokens; None for in-row lookup (each token counts as a share of 1)."""
    return state.lookup.shares.get(i) if source == CACHE and state.lookup is not None else None


def _match(trace: Trace, i: int) -> tuple[int | None, str]:
    """Row i's retrieval: the size of the match it followed (None: not known) and its source."""
    if not trace.match_sizes:
        return None, NGRAM
    return trace.match_sizes[i], trace.match_sources[i] if trace.match_sources else NGRAM


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
            state.planner.set_rows(state.batch.size)
    if state.batch.should_compact(state.caches):
        state.batch.compact(state.caches)


def _record(state: DecodeState, proposal: Proposal, trace: Trace, verdict: Verdict, emission: Emission,
            i: int, row: int) -> RoundRecord:
    """Active row i's record of the round, for the acceptance sink."""
    accepted = verdict.accepted[i]
    return RoundRecord(
        round=state.stats.rounds, row=row, draft_tokens=proposal.host_tokens()[i][: proposal.length(i)],
        num_accepted=accepted, emitted_tokens=verdict.tokens[i][: emission.counts[i]],
        expected_acceptance=_expected_acceptance(proposal, verdict, i),
        draft_seconds=trace.seconds, target_seconds=verdict.seconds, source=_source(proposal, i),
        parents=None if proposal.tree is None else proposal.tree.parents, path=verdict.path,
        accepted_from=_accepted_from(proposal, i, accepted, verdict.path),
        cache_length=state.cache.get_seq_length(), estimated_acceptance=trace.estimates,
        retrieval=_match(trace, i)[1] if _retrieved(proposal, trace, i) else "",
        scored=verdict.target_scores.shape[1] if proposal.tree is None else len(proposal.tree.parents) + 1,
    )


def _retrieved(proposal: Proposal, trace: Trace, i: int) -> bool:
    """Whether active row i verified retrieved tokens this round (not an n-gram drafter's chain)."""
    if proposal.tree is not None:
        return any(proposal.tree.retrieved)
    return proposal.source_of(i) == NGRAM and proposal.length(i) > 0 and i in trace.retrieved


def _source(proposal: Proposal, i: int) -> str:
    """Row i's source, "none" where it proposed nothing (a source of one's own that found no lookup is a plain step)."""
    return proposal.source_of(i) if proposal.tree is not None or proposal.length(i) else NONE


def _accepted_from(proposal: Proposal, i: int, accepted: int, path: list[int] | None) -> str:
    """The source(s) of a row's accepted tokens: the proposal's source, or for a tree the draft model
    (its chain and its runners-up) and/or retrieval along the accepted path."""
    if not accepted:
        return ""
    if proposal.tree is None:
        return proposal.source_of(i)
    sources = {DRAFT if proposal.tree.from_draft(j) else NGRAM for j in path}
    return f"{DRAFT}+{NGRAM}" if len(sources) == 2 else sources.pop()


def _expected_acceptance(proposal: Proposal, verdict: Verdict, i: int) -> list[float] | None:
    """P(accept) = sum_t min(p(t), q(t)) = 1 - TV(p, q) per draft position of active row i (sampling
    only; p(x) for a point mass), at the positions whose p was computed."""
    if verdict.target_probs is None or proposal.tree is not None:
        return None
    n = min(proposal.length(i), verdict.target_probs.shape[1])
    target_probs = verdict.target_probs[i, :n]  # [n, vocab]
    if proposal.draft_probs is None:
        return target_probs.gather(-1, proposal.tokens[i, :n, None])[:, 0].tolist()
    return torch.minimum(target_probs, proposal.draft_probs[i, :n]).sum(-1).tolist()
