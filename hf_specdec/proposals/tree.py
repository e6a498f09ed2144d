"""Trees of candidates: every retrieved continuation and the draft model's chain, merged into one trie
that the target verifies in one forward.

A tree is stored flat: node j has a token and a parent (-1: the row's last real token, the root), and
parents come before their children. Trees are verified greedily (`hf_specdec.verify.greedy_tree_verification`):
the walk follows the target's argmax, so every node is a point mass and the output is plain greedy's.

Retrieval (`ngram_continuations`): every earlier occurrence of the sequence's last n tokens (the
longest n that occurs, as in prompt lookup), most recent first, contributes the tokens that followed
it. Merged into a trie, each node counts the occurrences that pass through it, so count(child) /
count(node) estimates how often the text continued that way. It is a scan over the row's host copy,
not a suffix automaton: at the few thousand tokens a generate call sees, it costs well under a
millisecond and reads nothing from the device.

Draft-model siblings: for a greedy draft, the draft's runner-up at each chain position is added as a
point-mass sibling of the chain node (a leaf: it is not expanded, so it costs no draft forward). The
draft does not draft whole tree levels.

Which nodes are verified is the planner's choice (`Planner.best_nodes`): every node gets an
estimated probability that verification reaches and accepts it (`retrieval_reach`), and nodes are
taken best first while they raise the round's expected tokens per unit of cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..host import to_device
from ..stats import DRAFT, NGRAM, NONE
from .base import Proposal, Tree

SIBLING = "sibling"  # a greedy draft's runner-up at a chain position, as a point-mass sibling of the chain node


@dataclass
class Trie:
    """A token trie under the root (the row's last real token). Nodes are appended, never moved."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # retrieved continuations through the node
    origins: list[str] = field(default_factory=list)  # DRAFT (the draft model's chain), SIBLING or NGRAM
    children: dict[int, list[int]] = field(default_factory=dict)  # node (-1: root) -> child nodes, in order
    root_count: int = 0  # retrieved continuations in all

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, node: int, token: int) -> int | None:
        return next((c for c in self.children.get(node, ()) if self.tokens[c] == token), None)

    def add(self, node: int, token: int, origin: str) -> int:
        self.tokens.append(token)
        self.parents.append(node)
        self.counts.append(0)
        self.origins.append(origin)
        self.children.setdefault(node, []).append(len(self.tokens) - 1)
        return len(self.tokens) - 1

    def insert(self, tokens: list[int], origin: str, count: bool) -> list[int]:
        """Walk down from the root along `tokens`, creating nodes as needed; returns the nodes.
        `count`: the sequence is one retrieved continuation (adds to the counts on its path)."""
        node, path = -1, []
        if count:
            self.root_count += 1
        for token in tokens:
            found = self.child(node, token)
            node = self.add(node, token, origin) if found is None else found
            if count:
                self.counts[node] += 1
            path.append(node)
        return path


def ngram_continuations(
    sequence: torch.Tensor | Sequence[int],  # one row's real tokens
    max_ngram: int,
    min_ngram: int,
    max_tokens: int,
    max_branches: int,
) -> list[list[int]]:
    """Up to `max_branches` distinct continuations (each at most `max_tokens` long) of the earlier
    occurrences of the sequence's last n tokens, most recent occurrence first, for the longest n in
    max_ngram..min_ngram that occurs. Empty when nothing matches. The first one is `ngram_lookup`'s."""
    host = sequence.tolist() if isinstance(sequence, torch.Tensor) else sequence
    return retrieve(host, max_ngram, min_ngram, max_tokens, max_branches)[0]


def retrieve(
    host: Sequence[int], max_ngram: int, min_ngram: int, max_tokens: int, max_branches: int, match_cap: int = 0
) -> tuple[list[list[int]], int]:
    """`ngram_continuations` of a host sequence and the size of the match they follow (0: no match).
    With `match_cap` above n, each occurrence's match is measured further back (`match_length`) and
    only the occurrences whose match falls in the longest one's size bucket (`match_bucket`)
    contribute, longest first, then earliest; the size returned is that bucket."""
    host, length = list(host), len(host)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix, first = host[length - n :], host[length - n]
        # every earlier occurrence (it ends before the last token, so it has a continuation)
        starts = [i for i in range(length - n) if host[i] == first and host[i : i + n] == suffix]
        if not starts:
            continue
        starts, size = longest_matches(host, starts, n, max_ngram, match_cap)
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for start in starts:
            continuation = tuple(host[start + n : start + n + max_tokens])
            if continuation and continuation not in seen:
                seen.add(continuation)
                out.append(list(continuation))
                if len(out) == max_branches:
                    break
        return out, size
    return [], 0


def match_length(host: list[int], start: int, n: int, cap: int) -> int:
    """How many tokens the occurrence of the last n tokens at `start` matches: n, plus every token
    before it that equals the one before the sequence's suffix, at most `cap` in all."""
    length, matched = len(host), n
    while matched < cap and start - 1 - (matched - n) >= 0:
        if host[start - 1 - (matched - n)] != host[length - 1 - matched]:
            break
        matched += 1
    return matched


def match_bucket(matched: int, max_ngram: int) -> int:
    """The size a match of `matched` tokens is counted under: itself up to `max_ngram`, then powers of
    two (4-7 as 4, 8-15 as 8, ... with max_ngram = 3), never below max_ngram + 1."""
    if matched <= max_ngram:
        return matched
    return max(max_ngram + 1, 1 << (matched.bit_length() - 1))


def longest_matches(host: list[int], starts: list[int], n: int, max_ngram: int, cap: int) -> tuple[list[int], int]:
    """(occurrences, size): of the occurrences `starts` (ascending) of the last n tokens, those in the
    longest match's size bucket, longest first, then earliest (as transformers' prompt lookup takes
    the first match: replayed on the real pair's greedy outputs, the earliest of equal matches
    continued them in fewer rounds than the most recent, run match-length, docs/evaluation.md#older-runs); and that size.
    With `cap` <= n: every occurrence, most recent first, and size n."""
    if cap <= n:
        return starts[::-1], n
    matched = {start: match_length(host, start, n, cap) for start in starts}
    size = max(match_bucket(m, max_ngram) for m in matched.values())
    kept = [start for start in starts if match_bucket(matched[start], max_ngram) == size]
    return sorted(kept, key=lambda start: (-matched[start], start)), size


def retrieval_reach(
    trie: Trie,
    acceptance: float,
    draft_acceptance: dict[int, float] | None = None,
    sibling_acceptance: dict[int, float] | None = None,
) -> list[float]:
    """For every node, an estimate of P(verification accepts it): a retrieved node is accepted with
    the running acceptance of retrievals `acceptance` times the share of continuations that
    took it there (count(node) / count(parent)). When its parent's first child is a draft-model node
    that the target accepts with probability a (`draft_acceptance`), a retrieved sibling is only
    reached when the draft node is not accepted: its estimate is scaled by (1 - a). Draft nodes get
    the product of `draft_acceptance` down their chain, a SIBLING node its parent's estimate times
    `sibling_acceptance` (P(accepted | parent reached))."""
    draft_acceptance, sibling_acceptance = draft_acceptance or {}, sibling_acceptance or {}
    reach: list[float] = []
    for j, parent in enumerate(trie.parents):
        above = 1.0 if parent < 0 else reach[parent]
        if trie.origins[j] == DRAFT:
            reach.append(above * draft_acceptance.get(j, acceptance))
            continue
        if trie.origins[j] == SIBLING:
            reach.append(above * sibling_acceptance.get(j, 0.0))
            continue
        total = trie.root_count if parent < 0 else trie.counts[parent]
        share = trie.counts[j] / total if total else 0.0
        estimate = above * acceptance * share
        first = trie.children[parent][0]
        if first != j and trie.origins[first] == DRAFT:
            estimate *= 1.0 - draft_acceptance.get(first, acceptance)
        reach.append(estimate)
    return reach


def subtree(trie: Trie, keep: list[int]) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the nodes `keep` (parents included, in node order), renumbered."""
    keep = sorted(keep)
    index = {node: i for i, node in enumerate(keep)}
    tokens = [trie.tokens[n] for n in keep]
    parents = [-1 if trie.parents[n] < 0 else index[trie.parents[n]] for n in keep]
    return tokens, parents


def tree_proposal(trie: Trie, keep: list[int], chain: Proposal | None, source: str, device: torch.device) -> Proposal:
    """The proposal verifying nodes `keep` of `trie`, which holds `chain`'s tokens (when a draft chain
    is given) as its first nodes; the kept ones among them are a prefix of the chain. A plain chain
    when the kept nodes do not branch and come from one source (verified by the chain rule); a `Tree`
    otherwise. Greedy only: every node is a point mass."""
    tokens, parents = subtree(trie, keep)
    kept = sorted(keep)
    drafted, forwards = 0, 0 if chain is None else chain.forwards
    while chain is not None and drafted < min(len(kept), chain.num_tokens) and kept[drafted] == drafted:
        drafted += 1
    ids = to_device([tokens], device)  # [1, n]
    if parents == list(range(-1, len(parents) - 1)) and drafted in (0, len(tokens)):  # a chain from one source
        if drafted:
            return chain.first([drafted])
        # retrieved tokens only (none: a plain step); after a draft ran, the draft's cache holds its own
        # tokens (`sources` says so)
        kind = NGRAM if tokens else NONE
        return Proposal(ids, None, source=kind if forwards or not tokens else source, host=[tokens], forwards=forwards,
                        sources=[kind] if forwards else None)
    return Proposal(
        ids, draft_probs=None, source=source, host=[tokens], forwards=forwards, tree=Tree(parents, drafted, [trie.counts[n] > 0 for n in kept]),
        confidences=None if chain is None or chain.confidences is None else [chain.confidences[0][:drafted]],
    )


def ancestors_mask(parents: list[int]) -> torch.Tensor:  # [n, n] bool: [j, i] = node i is j or an ancestor of j
    """Which nodes each node sees in the tree attention mask (itself and its ancestors)."""
    n = len(parents)
    seen = torch.zeros((n, n), dtype=torch.bool, device="cpu")  # host-side, whatever the default device
    for j, parent in enumerate(parents):
        if parent >= j:
            raise ValueError(f"tree node {j} has parent {parent}: parents must come before their children")
        if parent >= 0:
            seen[j] = seen[parent]
        seen[j, j] = True
    return seen


def depths(parents: list[int]) -> list[int]:
    """Depth of each node (children of the root: 0)."""
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out


def tree_depth(parents: list[int]) -> int:
    """The most tokens a tree can accept: the nodes on its longest root-to-leaf path."""
    return 1 + max(depths(parents), default=-1)


def path_tokens(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """The tokens from the root down to `node` (inclusive; empty for the root, -1)."""
    out = []
    while node >= 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


__all__ = [
    "Trie", "ancestors_mask", "depths", "longest_matches", "match_bucket", "match_length", "ngram_continuations",
    "path_tokens", "retrieval_reach", "retrieve", "subtree",
]
