"""A source of one's own, checked: what the rejection rule relies on, named when a proposal breaks it.

The loop verifies what a source proposes exactly only if the proposal is what it claims: ids the
target can embed, at most the tokens asked for, one row per batch row, and q (when given) a
distribution over the target's vocabulary that gives each proposed token mass (a token q could not
have drawn makes p/q meaningless). The library's own sources hold to that by construction; a
`Drafter` of one's own (a subclass included) or a transformers `CandidateGenerator` is wrapped in
`CheckedDrafter` at the entry point, and each proposal is checked before the loop uses it, at the
price of reading it to the host once a round. A q that is a distribution but not the one the tokens
were drawn from cannot be detected; that stays the source's contract (docs/usage.md).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from ..host import to_device
from ..sampling import Prefixes
from ..verify import probability_flaws
from .base import Drafter, DraftRequest, Proposal


class CheckedDrafter(Drafter):
    """`inner`, its answers checked (see the module docstring); `vocab`: the target's vocabulary size;
    `do_sample`: whether q is used (greedy verification reads no q, so none is kept or checked)."""

    def __init__(self, inner: Drafter, vocab: int, do_sample: bool = True):
        self.inner, self.vocab, self.do_sample = inner, vocab, do_sample
        self.source, self.max_rows = inner.source, inner.max_rows
        self.name = type(getattr(inner, "candidate_generator", inner)).__name__

    @property
    def cache(self):
        return self.inner.cache

    def start(self, batch_size: int) -> None:
        self.inner.start(batch_size)

    def finish(self) -> None:
        self.inner.finish()

    # A source of one's own is handed copies of what the loop keeps (the work sequence, at first the caller's
    # input_ids; the scores the output and stopping criteria read): one written in place would change the
    # output without a word. The library's own sources are not wrapped and pay nothing.
    def add_row(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        self.inner.add_row(ids.clone(), mask.clone())

    def update(self, ids: torch.Tensor, target_scores: torch.Tensor, num_accepted: int) -> None:
        self.inner.update(ids.clone(), target_scores.clone(), num_accepted)

    def room(self, longest: int) -> int | None:
        room = self.inner.room(longest)
        if room is not None:
            self._count("room", room)
        return room

    def prefill_tokens(self, width: int) -> int:
        return self._count("prefill_tokens", self.inner.prefill_tokens(width))

    def propose(self, request: DraftRequest) -> Proposal:
        prefixes = request.prefixes
        mine = dataclasses.replace(request, ids=request.ids.clone(), host=[list(row) for row in request.host],
                                   mask=None if request.mask is None else request.mask.clone(),
                                   prefixes=Prefixes.of([s.clone() for s in prefixes.sequences], list(prefixes.rows)))
        return self.check(self.inner.propose(mine), request)

    def _count(self, what: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"the candidate_generator ({self.name}).{what}() must return an integer >= 0, got {value!r}")
        return int(value)

    def _fail(self, problem: str) -> None:
        raise ValueError(f"the candidate_generator ({self.name}) proposed {problem}")

    def check(self, proposal: Proposal, request: DraftRequest) -> Proposal:
        """`proposal` as the loop needs it (int64 tokens on the work sequence's device, `host` filled),
        or a ValueError naming what breaks the rule's assumptions."""
        if not isinstance(proposal, Proposal):
            self._fail(f"a {type(proposal).__name__}, not an hf_specdec Proposal")
        rows, tokens = request.ids.shape[0], proposal.tokens
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[0] != rows \
                or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            self._fail(f"tokens {shape}: they must be an integer tensor [rows={rows}, k]")
        for name, value in (("tokens", tokens), ("draft_probs", proposal.draft_probs)):
            if isinstance(value, torch.Tensor) and value.is_meta:
                self._fail(f"{name} on the meta device, which holds no values")
        if proposal.host is not None and (not isinstance(proposal.host, (list, tuple))
                                          or not all(isinstance(row, (list, tuple)) for row in proposal.host)):
            self._fail(f"host={proposal.host!r}: Proposal.host is a list of token ids per row (or None)")
        if tokens.shape[1] > request.max_tokens:
            self._fail(f"{tokens.shape[1]} tokens a row, more than the {request.max_tokens} asked for (request.max_tokens)")
        if proposal.tree is not None:  # trees are built in the loop (greedy), never taken from a source
            self._fail("a tree: a source proposes chains (one per row); the loop builds trees itself")
        tokens = tokens.to(device=request.ids.device, dtype=torch.long)
        read = tokens.tolist()  # the one read (with q, one more: `_check_q`)
        host = read if proposal.host is None else [list(map(int, row)) for row in proposal.host]
        if len(host) != rows or any(row != full[: len(row)] for row, full in zip(host, read)):
            self._fail("a host copy that is not each row's first tokens (Proposal.host must match tokens)")
        if any(not 0 <= t < self.vocab for row in host for t in row):
            self._fail(f"token ids outside the target's vocabulary [0, {self.vocab})")
        if any(len(row) < len(full) for row, full in zip(host, read)):  # padding past a row's length: fed, never kept
            lengths = to_device([len(h) for h in host], tokens.device)
            tokens = torch.where(torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None], tokens, 0)
        confidences, runners_up = proposal.confidences, proposal.runners_up
        for name, value in (("sources", proposal.sources), ("confidences", confidences), ("runners_up", runners_up)):
            if value is not None and (len(value) != rows or (name != "sources" and any(
                    len(v) < len(h) for v, h in zip(value, host)))):
                self._fail(f"{name} for {len(value)} rows where there are {rows} (and one entry per proposed token)")
        if confidences is not None:
            confidences = [list(c[: len(h)]) for c, h in zip(confidences, host)]
            if not all(math.isfinite(c) for row in confidences for c in row):
                self._fail("confidences that are not finite numbers")
        if runners_up is not None:
            runners_up = [list(r[: len(h)]) for r, h in zip(runners_up, host)]
            if not all(0 <= int(t) < self.vocab and math.isfinite(p) for row in runners_up for t, p in row):
                self._fail(f"runners_up outside the vocabulary [0, {self.vocab}) or with probabilities not finite")
        q = proposal.draft_probs if self.do_sample else None
        if q is not None:
            q = self._check_q(q, tokens, host)
        return Proposal(tokens, q, proposal.source, host, proposal.sources, None, proposal.forwards, confidences, runners_up)

    def _check_q(self, q: torch.Tensor, tokens: torch.Tensor, host: list[list[int]]) -> torch.Tensor:
        """q on the tokens' device, checked at the proposed positions in one read."""
        rows, k = tokens.shape
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != (rows, k, self.vocab):
            self._fail(f"draft_probs {tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}: they must "
                       f"be q, [rows={rows}, k={k}, vocab={self.vocab}]")
        q = q.to(tokens.device)
        lengths = to_device([len(h) for h in host], tokens.device)  # [rows]
        proposed = torch.arange(k, device=tokens.device)[None, :] < lengths[:, None]  # [rows, k]
        not_probs, unlikely = torch.stack(probability_flaws(q, proposed, tokens)).tolist()  # the rule's own check
        if not_probs:
            self._fail("draft_probs that are not probabilities (non-negative, summing to 1 over the vocabulary: "
                       "softmax of the scores each token was drawn from)")
        if unlikely:
            self._fail("a token its draft_probs give probability 0 (each token must be drawn from its q)")
        return q
