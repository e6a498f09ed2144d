"""Draft tokens from a small draft model with its own KV cache."""

from __future__ import annotations

import logging
import numbers
import threading
import weakref

import torch
from transformers import LogitsProcessorList, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from ..cache import add_row, extend, hide_prefix, new_cache, rollback
from ..config import _check_int, as_int
from ..sampling import Prefixes, RowProcessors, logits_to_probs, sample
from ..stats import DRAFT
from ..verify import reads_are_free
from .base import Drafter, DraftRequest, Proposal

logger = logging.getLogger(__name__)

def context_length(config) -> int | None:
    """The most positions a model reads (`max_position_embeddings`, GPT-2's `n_positions`), or None."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _confidences(values: list[float]) -> list[float]:
    """Probabilities read back from the draft, NaN (scores that were all NaN: a user's processor) as 0."""
    return [v if v == v else 0.0 for v in values]


_CLAIMS = threading.Lock()  # DraftModelDrafter.start: one check-and-claim at a time


class DraftModelDrafter(Drafter):
    """Draft tokens one draft forward each, from q = softmax(processors(prefix, draft logits)): the
    same `RowProcessors` path as the target's p, with each row's real prefix plus its drafts so far.

    Sampling: each token is drawn from q, and q is returned (`Proposal.draft_probs`). Greedy: each
    token is the argmax, a point mass (`draft_probs=None`). The draft's probability of each token
    (`Proposal.confidences`) is computed only when the planner asks for it (`DraftRequest.confidences`).

    `window`: the draft encodes only the last `window` tokens of the sequence it first sees (the
    prompt) and everything after them, so a long prompt's draft prefill costs `window` tokens. Its
    cache still has the sequence's length (zero columns in front, masked out in every forward).
    Exact like any draft: q is whatever the draft computed. The window is for single rows only.

    The draft's context length (`context_length`, from its config) bounds what it reads: `room`
    says how many tokens it can still draft, the window is shrunk to fit in it, and a row joining
    wider than the context retires the draft for the rest of the call (its cache becomes None; the
    loop then takes lookups or plain steps). Nothing is fed past the draft's last position.

    `vocab`: the width of the distributions it proposes from, the target's vocabulary (the loop sets
    it). A draft whose embedding has a few padding rows more or fewer than the target's (Qwen2.5-0.5B
    for 7B, the Pythia sizes) scores the target's ids: its logits are cut to `vocab` rows, or filled
    with -inf past its own (q is 0 there, so it never drafts them), and an id past its rows that the
    target emitted is fed to it as its last row; where the processors leave only ids past its rows,
    q is uniform on those. Exact like any draft: q is what it proposes from.
    """

    source = DRAFT

    def __init__(
        self,
        model: PreTrainedModel,
        logits_processor: LogitsProcessorList | None,
        do_sample: bool,
        generator: torch.Generator | None = None,
        window: int | None = None,  # encode only the last `window` prompt tokens (None: all of them)
        vocab: int | None = None,  # the target's vocabulary size, where the draft's differs by padding rows
    ):
        _check_drafter_arguments(model, logits_processor, do_sample, generator, window, vocab)
        self.model = model
        self.logits_processor = logits_processor
        self.do_sample = bool(do_sample)  # None, as GenerationConfig().do_sample is: greedy
        self.generator = generator
        self._drawing = generator  # what this round draws with: `generator`, else the call's (`DraftRequest.generator`)
        self.draft_vocab = model.get_output_embeddings().weight.shape[0]  # the rows the draft scores
        self.vocab = self.draft_vocab if vocab is None else int(as_int(vocab))  # the rows it proposes over (the target's)
        self.max_positions = context_length(model.config)
        window = None if window is None else int(as_int(window))
        if window is not None and self.max_positions is not None:
            window = max(1, min(window, self.max_positions // 2))  # room to draft after the window
        self.window = window
        self._past: tuple = (None, None)  # (key, scores) of `_uniform_past`
        self._user: weakref.ref | None = None  # the thread of the call using it, while one does
        self._fresh(1)

    def start(self, batch_size: int) -> None:
        """Per-call state lives on the drafter (its cache above all): one call at a time, the others refused."""
        with _CLAIMS:
            user, me = self._user and self._user(), threading.current_thread()
            if user is not None and user.is_alive():  # released when a call ends, however it ends
                where = f"another thread ({user.name})" if user is not me else ("this thread (a call made inside another, "
                                                                              "from its sink, streamer or criteria)")
                raise ValueError(f"this {type(self).__name__} is in use by a call in {where}: it keeps the call's draft "
                                 "cache, so concurrent calls need one each (or pass assistant=draft, which makes one per call)")
            self._fresh(batch_size)
            self._user = weakref.ref(me)  # claimed once started: a start that failed claims nothing

    def finish(self) -> None:
        self._user = None

    def holder(self) -> threading.Thread | None:
        """The thread of the call that holds it (between `start` and `finish`), or None."""
        return self._user and self._user()

    def __getstate__(self) -> dict:  # a copy (say, taken during a call) is free: the call holds the original only
        return {**self.__dict__, "_user": None}

    def _fresh(self, batch_size: int) -> None:
        if self.window is not None and batch_size > 1:
            raise ValueError(f"a draft window (draft_window={self.window}) works on one row at a time; got a batch of {batch_size}")
        self.cache = new_cache(self.model)
        self.processors = RowProcessors(self.logits_processor, batch_size)
        self.hidden = 0  # zero columns in front of the cache (a windowed prompt)

    def add_row(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        if self.window is not None:
            raise ValueError("a draft window works on one row at a time; continuous batching adds rows")
        length = int(mask.sum())  # the row's positions (its columns less padding and holes)
        if self.cache is not None and self.max_positions is not None and length >= self.max_positions:
            logger.warning("a prompt of %d tokens joined, as long as the draft's context of %d positions or longer: "
                           "the draft model is not used for the rest of this call", length, self.max_positions)
            self.cache = None
        if self.cache is not None:
            add_row(self.model, self.cache, self._feed(ids), mask)
        self.processors.add_row()

    def room(self, longest: int) -> int | None:
        if self.cache is None:  # retired: a row longer than the draft's context joined
            return 0
        if self.max_positions is None:
            return None
        # Positions count real tokens (holes and padding take none), less those a window hides; a cold
        # draft will encode at most `window` of them.
        if self.cache.get_seq_length():
            seen = longest - self.hidden
        else:
            seen = longest if self.window is None else min(longest, self.window)
        # drafting j tokens feeds positions up to seen + j - 2 (the last draft is never fed)
        return max(0, self.max_positions - seen + 1)

    def prefill_tokens(self, width: int) -> int:
        if self.cache is None or self.cache.get_seq_length():
            return 0
        return width if self.window is None else min(width, self.window)

    def _logits(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:  # [rows, vocab]
        """The draft's raw logits after `ids`, feeding what its cache lacks (the prompt, or its last
        `window` tokens, on the first call), as a [rows, vocab] row over the target's ids."""
        ids = self._feed(ids)
        if self.window is not None and not self.cache.get_seq_length() and ids.shape[1] > self.window:
            self.hidden = ids.shape[1] - self.window
            window_mask = None if mask is None else mask[:, self.hidden :]
            logits = extend(self.model, self.cache, ids[:, self.hidden :], window_mask, num_logits=1)
            hide_prefix(self.cache, self.hidden)
            return self._fit(logits[:, -1])
        if self.hidden:
            mask = torch.ones_like(ids) if mask is None else mask.clone()
            mask[:, : self.hidden] = 0
        return self._fit(extend(self.model, self.cache, ids, mask, num_logits=1)[:, -1])

    def _feed(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` as the draft can embed them: a target id past the draft's rows becomes its last row."""
        return ids.clamp_max(self.draft_vocab - 1) if self.vocab > self.draft_vocab else ids

    def _uniform_past(self, like: torch.Tensor) -> torch.Tensor:
        """[vocab] scores 0 past the draft's rows and -inf on them, made once per width, device and dtype."""
        key = (self.vocab, like.device, like.dtype)
        if self._past[0] != key:
            past = torch.arange(self.vocab, device=like.device) >= self.draft_vocab
            self._past = key, torch.zeros(self.vocab, device=like.device, dtype=like.dtype).masked_fill(~past, float("-inf"))
        return self._past[1]

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, draft_vocab] logits as [rows, vocab]: cut, or -inf past the draft's rows."""
        extra = self.vocab - logits.shape[-1]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
        return logits[:, : self.vocab] if extra else logits

    def propose(self, request: DraftRequest) -> Proposal:
        """`request.max_tokens` tokens per row, one draft forward each, with no read of the device
        until the last: the tokens (and with `request.confidences` the draft's probability of each,
        and its runner-up in greedy drafts) come back in one copy."""
        ids, mask, width = request.ids, request.mask, request.ids.shape[1]
        if self.cache is None or not request.max_tokens:  # retired (see the class doc), or asked for nothing
            return Proposal.nothing(ids.shape[0], ids.device)
        probs, reports = [], []
        self._drawing = self.generator if self.generator is not None else request.generator  # its own, else the call's
        for j in range(request.max_tokens):
            # Feed what the draft cache lacks: the prompt on the first round, then the last emitted
            # token(s) (several after an all-accepted, n-gram or plain round), then one token.
            logits = self._logits(ids, mask)  # [rows, vocab]
            token, q, report = self._next(request.prefixes, ids[:, width:], logits, request.confidences)
            probs.append(q)
            reports.append(report)
            ids = torch.cat([ids, token[:, None]], dim=1)
            mask = None if mask is None else torch.nn.functional.pad(mask, (0, 1), value=1)
            if request.keep_drafting is not None and j + 1 < request.max_tokens and report:
                if not request.keep_drafting(_confidences(report[0].tolist())):  # a read per token: the CPU only
                    break
        tokens = ids[:, width:]  # [rows, k]
        parts = [tokens.double(), *(torch.stack(part, dim=1) for part in zip(*reports))]  # each [rows, k]
        host = torch.stack(parts).tolist()  # the one read: [parts, rows, k]
        confidences = runners_up = None
        if request.confidences:
            confidences = [_confidences(row) for row in host[1]]
            if not self.do_sample:
                runners_up = [list(zip((int(t) for t in tr), _confidences(pr))) for tr, pr in zip(host[2], host[3])]
        return Proposal(
            tokens=tokens, draft_probs=torch.stack(probs, dim=1) if self.do_sample else None,  # [rows, k, vocab]
            source=self.source, host=[[int(t) for t in row] for row in host[0]], forwards=tokens.shape[1],
            confidences=confidences, runners_up=runners_up,
        )

    def _next(
        self,
        prefixes: Prefixes,
        drafts: torch.Tensor,  # [rows, j]: drafted so far this round
        logits: torch.Tensor,  # [rows, vocab]: raw draft logits
        report: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """(token [rows], q [rows, vocab] or None, and when `report` on the device: the draft's
        probability of the token, and for greedy drafts its runner-up and the runner-up's probability)."""
        scores = self.processors.scores(prefixes, drafts, logits)  # [rows, vocab]
        if self.vocab > self.draft_vocab:  # processors that leave only ids past the draft's rows: q uniform on those
            dead = ~(scores > float("-inf")).any(dim=-1, keepdim=True)  # [rows, 1]: nothing finite (NaN after a renormalization)
            scores = torch.where(dead, self._uniform_past(scores), scores)
        if self.do_sample:
            q = logits_to_probs(scores)
            # a row whose scores went NaN or infinite (a draft overflowing) is NaN throughout (softmax): it drafts from
            # a uniform q there, still exact; where reads are free the rows are rewritten only if one needs it
            bad = q[:, :1].isnan()
            if not reads_are_free(q.device) or bool(bad.any()):
                q = q.masked_fill(bad, 1.0 / q.shape[-1])
            token = sample(q, self._drawing)
        else:
            q, token = None, scores.argmax(dim=-1)
        if not report:
            return token, q, []
        probs = q if q is not None else logits_to_probs(scores)
        q_token = probs.gather(-1, token[:, None])[:, 0].double()  # [rows]
        if self.do_sample:
            return token, q, [q_token]
        second = probs.scatter(-1, token[:, None], -1.0).max(dim=-1)  # the best other token
        return token, q, [q_token, second.indices.double(), second.values.double()]


def _check_drafter_arguments(model, logits_processor, do_sample, generator, window, vocab) -> None:
    """DraftModelDrafter's arguments, named here rather than failing in the loop."""
    head = getattr(model, "get_output_embeddings", None) if isinstance(model, torch.nn.Module) else None  # compiled too
    if not callable(head) or head() is None:
        raise ValueError(f"DraftModelDrafter takes a transformers causal LM with its output head, got {type(model).__name__}")
    if logits_processor is not None and not (isinstance(logits_processor, (list, tuple))
                                             and all(callable(p) for p in logits_processor)):
        raise ValueError(f"logits_processor must be a LogitsProcessorList (or None), got {type(logits_processor).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator (or None), got {type(generator).__name__}")
    if do_sample is not None and not isinstance(do_sample, bool):  # "no" would have sampled
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}")
    for name, value in (("window", window), ("vocab", vocab)):
        if value is not None:
            _check_int(name, as_int(value), 1)


def inner_drafter(candidate_generator) -> DraftModelDrafter | None:
    """The `DraftModelDrafter` inside a candidate_generator: itself, a `DraftCandidateGenerator`'s, or
    one of those wrapped in a `CandidateGeneratorDrafter`; None for any other source."""
    inner = getattr(candidate_generator, "candidate_generator", candidate_generator)
    inner = getattr(inner, "drafter", inner)
    return inner if isinstance(inner, DraftModelDrafter) else None


class DraftCandidateGenerator(CandidateGenerator, Drafter):
    """transformers' `CandidateGenerator` contract over `DraftModelDrafter`, one unpadded batch at a time.
    It is a `Drafter` too: passed as `candidate_generator=`, it drafts through its `DraftModelDrafter`
    (planner, batches and all), with a fresh cache per call.

    `get_candidates(input_ids)` returns `(candidate_ids, candidate_logits)`:
      * candidate_ids:    [batch, seq + k] the input followed by k draft tokens;
      * candidate_logits: [batch, k, vocab] log q, the *processed* draft distribution each draft token
                          was drawn from (softmax gives q back), or None for greedy drafts.
    `update_candidate_strategy(input_ids, scores, num_matches)` rolls the draft cache back to the
    accepted prefix, as transformers' assisted loop expects of its generators.
    """

    def __init__(
        self,
        draft_model: PreTrainedModel,
        logits_processor: LogitsProcessorList | None,
        num_draft_tokens: int,
        do_sample: bool,
        generator: torch.Generator | None = None,
        vocab: int | None = None,  # the target's vocabulary size, where the draft's differs by padding rows
    ):
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, numbers.Integral) or num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be a positive integer, got {num_draft_tokens!r}")
        self.drafter = DraftModelDrafter(draft_model, logits_processor, do_sample, generator, vocab=vocab)
        self.num_draft_tokens = int(num_draft_tokens)
        self._seen: torch.Tensor | None = None  # [batch, len]: the sequence the draft cache was built on

    @torch.no_grad()  # called outside generate() too: no graph kept
    def get_candidates(self, input_ids: torch.LongTensor) -> tuple[torch.LongTensor, torch.Tensor | None]:
        # Keep the cached prefix that input_ids still starts with (everything before its last token,
        # after a verification); a sequence that does not continue the last one starts afresh.
        keep = min(self.drafter.cache.get_seq_length(), input_ids.shape[1] - 1)
        seen = self._seen
        if seen is None or seen.shape[0] != input_ids.shape[0] or not torch.equal(seen[:, :keep], input_ids[:, :keep]):
            self.drafter._fresh(input_ids.shape[0])  # transformers' own loop: no call to claim it for, nor end
        rollback([self.drafter.cache], keep)
        rows = list(range(input_ids.shape[0]))
        room = self.drafter.room(input_ids.shape[1])  # the draft's context length bounds it
        limit = self.num_draft_tokens if room is None else min(self.num_draft_tokens, room)
        request = DraftRequest(input_ids, None, Prefixes.from_tensor(input_ids, rows), limit)
        proposal = self.drafter.propose(request)
        logits = None if proposal.draft_probs is None else proposal.draft_probs.log()
        self._seen = torch.cat([input_ids, proposal.tokens], dim=1)
        return self._seen, logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        rollback([self.drafter.cache], input_ids.shape[1] - 1)

    @property
    def num_drafting_tokens(self) -> int:  # transformers' assisted loop reads it (its own generators define it)
        return self.num_draft_tokens

    # --- the Drafter protocol, delegated ---

    source = DRAFT

    @property
    def cache(self):
        return self.drafter.cache

    def start(self, batch_size: int) -> None:
        self.drafter.start(batch_size)

    def finish(self) -> None:
        self.drafter.finish()

    def propose(self, request: DraftRequest) -> Proposal:
        return self.drafter.propose(request)

    def prefill_tokens(self, width: int) -> int:
        return self.drafter.prefill_tokens(width)

    def room(self, longest: int) -> int | None:
        return self.drafter.room(longest)

    def add_row(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        self.drafter.add_row(ids, mask)
