"""The proposal a source makes each round, what a source is asked, and the protocol every source follows."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Callable
import torch
from transformers import Cache

from ..sampling import Prefixes


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for every active row: chains, or one row's tree (a chain is the tree whose every
    node's parent is the node before it).

    A chain: node j of a row follows node j - 1, node 0 follows the row's last real token. A tree
    (one row): `tree` gives each node's parent (-1: the last real token); its first `tree.chain`
    nodes are the draft model's chain, the only nodes `draft_probs` and `confidences` cover, and every
    other node is a point mass (see `hf_specdec.proposals.tree` and `hf_specdec.verify`).
    """

    tokens: torch.Tensor  # [rows, k] int64: the draft tokens (k may be 0: a plain step)
    # [rows, k, vocab]: q, the distribution each token was drawn from. None: point masses (n-gram
    # lookups, greedy drafts), verified as q = one-hot(token).
    draft_probs: torch.Tensor | None
    source: str  # "draft", "ngram", "none", or a foreign generator's class name
    # Per row the tokens on the host (the source read them once, or never had them on the device);
    # rows shorter than k end early (their proposal length). None: read from `tokens` when needed.
    host: list[list[int]] | None = None
    sources: list[str] | None = None  # a batch mixing sources: per row; None: every row from `source`
    tree: "Tree | None" = None  # the shape of a tree proposal (one row); None: chains
    forwards: int = 0  # draft forward passes spent on this proposal
    # What a draft model says of its own tokens (read with them, in one copy): per row, per token its
    # probability (`confidences`), and for greedy drafts its runner-up there (token, probability).
    confidences: list[list[float]] | None = None
    runners_up: list[list[tuple[int, float]]] | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    def length(self, row: int) -> int:
        """How many tokens `row` really proposed."""
        return self.num_tokens if self.host is None else len(self.host[row])

    def source_of(self, row: int) -> str:
        return self.source if self.sources is None else self.sources[row]

    def host_tokens(self) -> list[list[int]]:
        """Per row its tokens on the host (one read when the source left none)."""
        return self.host if self.host is not None else self.tokens.tolist()

    @classmethod
    def nothing(cls, rows: int, device: torch.device) -> "Proposal":
        """No draft at all: the round is a plain target step."""
        return cls(torch.empty((rows, 0), dtype=torch.long, device=device), None, source="none", host=[[] for _ in range(rows)])

    def first(self, lengths: list[int]) -> "Proposal":
        """Each row's chain cut to its length in `lengths` (the tensor to the longest)."""
        n = max(lengths, default=0)
        host = self.host_tokens()
        return replace(
            self,
            tokens=self.tokens[:, :n],
            draft_probs=None if self.draft_probs is None else self.draft_probs[:, :n],
            host=[row[:m] for row, m in zip(host, lengths)],
            confidences=None if self.confidences is None else [c[:m] for c, m in zip(self.confidences, lengths)],
            runners_up=None if self.runners_up is None else [r[:m] for r, m in zip(self.runners_up, lengths)],
        )


@dataclass(frozen=True)
class Tree:
    """The shape of a one-row tree proposal."""

    parents: list[int]  # per node: its parent node, -1 for the row's last real token; parents first
    chain: int  # nodes 0..chain-1 are the draft model's chain (each its parent's first child)
    retrieved: list[bool]  # per node: some retrieved continuation passes through it

    def chain_accepted(self, path: list[int]) -> int:
        """How many leading accepted nodes are draft-chain nodes (the draft cache keeps those)."""
        n = 0
        while n < len(path) and n < self.chain and path[n] == n:
            n += 1
        return n

    def from_draft(self, node: int) -> bool:
        """Whether the draft model proposed `node`: a chain node, or a runner-up beside one (a node no
        retrieval proposed). For the walk's first node: whether the draft's first forward paid."""
        return node < self.chain or not self.retrieved[node]

    def retrieval_events(self, path: list[int]) -> list[bool]:
        """Per node the walk reached (the root, then each accepted node) that has retrieved children:
        whether the walk went on through one of them."""
        children: dict[int, list[int]] = {}
        for j, parent in enumerate(self.parents):
            children.setdefault(parent, []).append(j)
        out = []
        for step, node in enumerate([-1] + path):
            if any(self.retrieved[c] for c in children.get(node, ())):
                out.append(step < len(path) and self.retrieved[path[step]])
        return out


@dataclass(frozen=True)
class DraftRequest:
    """What a source is given each round."""

    ids: torch.Tensor  # [rows, seq]: the work sequence (may contain masked holes in a batch)
    mask: torch.Tensor | None  # [rows, seq]: 1 for real tokens, 0 for padding and holes; None if none
    prefixes: Prefixes  # each row's real sequence, for logits processors
    max_tokens: int  # propose at most this many tokens per row
    host: list[list[int]] = ()  # each row's real sequence on the host, for lookups (no device read)
    confidences: bool = False  # a draft model reports its probability of each token (and greedy runners-up)
    # Where reading the device is free (the CPU): after each drafted token, given per row the draft's
    # probability of it, whether to draft another (the planner's early stop). None: draft max_tokens.
    keep_drafting: Callable[[list[float]], bool] | None = None
    generator: torch.Generator | None = None  # the call's, for a sampling source built without one of its own


class Drafter(ABC):
    """A source of draft tokens for the speculative loop.

    `cache` is a KV cache that must stay in step with the target's: the loop rolls it back, selects
    its rows and compacts its columns together with the target's (in `hf_specdec.cache`). Sources
    without a model keep it None.
    """

    source: str = "draft"
    cache: Cache | None = None
    max_rows: int | None = None  # the most rows it proposes for at once (None: any batch)

    def start(self, batch_size: int) -> None:
        """A new generate call begins (fresh cache and per-call state)."""

    def finish(self) -> None:
        """The call has ended, however it ended."""

    @abstractmethod
    def propose(self, request: DraftRequest) -> Proposal:
        """Up to request.max_tokens draft tokens per row."""

    def add_row(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Continuous batching: a row joins the batch, appended last; `ids`, `mask` [1, width] are
        its row of the work sequence (a left-padded prompt). A source with a cache must give it that
        row's columns (`hf_specdec.cache.add_row`), and per-row state a new entry."""
        if self.cache is not None and self.cache.get_seq_length() > 0:
            raise NotImplementedError(f"{type(self).__name__} keeps a cache but cannot add a row to it (continuous batching)")

    def room(self, longest: int) -> int | None:
        """How many tokens this source can still propose per row when the longest row holds
        `longest` real tokens; a draft model's context length bounds it. None: no bound."""
        return None

    def prefill_tokens(self, width: int) -> int:
        """Tokens this source must encode before it can propose for a sequence of `width` tokens
        (a draft model's prompt, while its cache is empty); the planner prices them. 0 once warm."""
        return 0

    def update(self, ids: torch.Tensor, target_scores: torch.Tensor, num_accepted: int) -> None:
        """After verification: the work sequence `ids` [rows, seq] now ends with the accepted tokens
        and each row's extra token; `target_scores` [rows, n, vocab] are the target's processed
        scores at the verified positions; `num_accepted` is the most any row accepted. Sources that
        learn from the outcome (transformers' `update_candidate_strategy`) do it here."""
