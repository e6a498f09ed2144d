"""A retrieval cache shared across calls and rows: earlier outputs as a source of free proposals.

In-row lookup (`hf_specdec.proposals.ngram`) copies continuations from the row's own prompt and
output. Much real use repeats across requests instead: n samples of one prompt (pass@k, self-
consistency), the same boilerplate in many answers, agent loops. `RetrievalCache` keeps the token
sequences of earlier outputs (each with the tail of the prompt it answered, so a new answer to the
same prompt matches from its first token) and proposes the continuations of the longest match of a
row's last tokens, ranked by how often each continuation followed (SuffixDecoding's scoring,
arXiv:2411.04975). The speculation length is the planner's: it keeps an acceptance per match length
for this source, and longer matches earn longer chains (`hf_specdec.planner`).

Structure. Not a suffix tree: an index from each n-gram (n = 1..`index_ngram`) to the positions
where it ends, over one token store with a separator between sequences. A query looks up the
occurrences of its last n tokens for the longest n indexed, measures each occurrence's match further
back (up to `max_match` tokens), keeps those in the longest match's bucket and merges what followed
them into a trie whose counts rank the continuations. At the sizes a process holds (0.1 to 1
million tokens) a lookup costs about 0.2 ms in Python (docs/design.md#retrieval-across-calls-and-rows); building `arctic-inference`'s C++
suffix tree is not an option here (0.1 onwards ships as source only, built against vLLM; the
registry's wheels, 0.0.1-0.0.4, predate the suffix tree).

Exactness. A proposal is a point mass on tokens that were decided before the round (earlier calls,
earlier rounds of other rows): it does not depend on this round's random numbers, so the rejection
rule keeps the output distribution the target's. Rows append their emitted tokens after each round;
another row sees them from the next round on.

Memory is bounded by `max_tokens` (the oldest tenth or so evicted at once, nothing rebuilt); one lock, so
calls in several threads of one process may share a cache; `save` / `load` keep it on disk as JSON.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import json
import numbers
import operator
import os
import stat
import sys
import threading
from collections import deque
from pathlib import Path
from typing import AbstractSet, Iterable, Mapping, Sequence

import torch

from .config import as_int
from .planner import MatchAcceptance
from .proposals.tree import Trie, match_bucket
from .stats import CACHE, NGRAM

SEPARATOR = -1  # between sequences in the store: no match or continuation crosses it
FORMAT = "hf_specdec.RetrievalCache/1"


def _measure(tokens: list[int], end: int, query: list[int], n: int, cap: int) -> int:
    """How many tokens before `end` in `tokens` equal the query's last ones (at least the n indexed)."""
    matched = n
    while matched < min(cap, len(query)):
        j = end - matched - 1
        if j < 0 or tokens[j] != query[len(query) - matched - 1]:
            break
        matched += 1
    return matched


def _evidence(matched: int, end: int, start: int, context: int, query: list[int], cap: int) -> int:
    """How many of a match's `matched` tokens count, for a match ending at `end` in a sequence starting
    at `start` whose first `context` tokens are the prompt it answered: all of them where the match
    reaches back to that prompt's first stored token (or as far as a match is measured), else only
    those in the output (0: none). Every chat prompt ends in the same assistant header; counted, it
    made "header + The" a 5-token match and offered a new prompt another prompt's answer."""
    if matched >= min(end - start, cap, len(query)):
        return matched
    return max(0, min(matched, end - start - context))


def _follows(tokens: list[int], end: int, max_tokens: int) -> list[int]:
    """What follows position `end` in `tokens`, up to a separator, at most `max_tokens`."""
    out = []
    while len(out) < max_tokens and end < len(tokens) and tokens[end] != SEPARATOR:
        out.append(tokens[end])
        end += 1
    return out


def _token_id(token) -> int:
    """An integer token id >= 0 (an int, a numpy integer, a 0-d integer tensor), never a rounded float,
    a bool or a character."""
    try:
        value = None if isinstance(token, bool) or getattr(token, "dtype", None) == torch.bool else operator.index(token)
    except TypeError:
        value = None
    if value is None or value < 0:
        raise ValueError(f"RetrievalCache: token ids must be integers >= 0, got {token!r} "
                         "(pass token ids, e.g. tokenizer(text).input_ids, not text or floats)")
    return value


class _Finished:
    """Finished sequences one after another (SEPARATOR after each) and the index from each n-gram
    (n = 1..index_ngram) to the positions just after its occurrences. The cache holds several, oldest
    first, and evicts by dropping the oldest whole: nothing is rebuilt, so no lookup waits on it."""

    def __init__(self, index_ngram: int):
        self.index_ngram = index_ngram
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.starts: list[int] = []  # where each sequence starts in `tokens`
        self.contexts: list[int] = []  # how many of its first tokens are the prompt it answered
        self.largest = -1  # the largest id held

    def add(self, sequence: list[int], context: int) -> None:
        self.starts.append(len(self.tokens))
        self.contexts.append(context)
        self.largest = max([self.largest, *sequence])
        for token in sequence:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(1, min(self.index_ngram, end) + 1):
                if self.tokens[end - n] == SEPARATOR:
                    break
                self.index.setdefault(tuple(self.tokens[end - n : end]), []).append(end)
        self.tokens.append(SEPARATOR)

    def sequences(self) -> list[tuple[list[int], int]]:
        """(tokens, context) of each sequence held, oldest first."""
        ends = [*self.starts[1:], len(self.tokens)]
        return [(self.tokens[a : b - 1], c) for a, b, c in zip(self.starts, ends, self.contexts)]

    def evidence(self, end: int, matched: int, query: list[int], cap: int) -> int:
        """`_evidence` for a match ending at `end` here."""
        i = bisect.bisect_right(self.starts, end - 1) - 1
        return _evidence(matched, end, self.starts[i], self.contexts[i], query, cap)

    def bytes(self) -> int:
        return _bytes(self.tokens, self.index, 1) + _bytes(self.starts, {}, 0) + _bytes(self.contexts, {}, 0)


class _Open:
    """Sequences still growing (rows being generated), each its own token list, under one index from
    each n-gram to (key, position after it): a lookup examines the most recent occurrences among all
    of them at once, so it costs the same at 2 rows or 2,000."""

    def __init__(self, index_ngram: int):
        self.index_ngram = index_ngram
        self.tokens: dict[object, list[int]] = {}
        self.contexts: dict[object, int] = {}  # per key, how many of its first tokens are its prompt's
        self.index: dict[tuple[int, ...], list[tuple[object, int]]] = {}
        self.entries = self.live = 0  # index entries, and those of sequences still open

    def push(self, key: object, token: int) -> None:
        tokens = self.tokens[key]
        tokens.append(token)
        end = len(tokens)
        for n in range(1, min(self.index_ngram, end) + 1):
            self.index.setdefault(tuple(tokens[end - n : end]), []).append((key, end))
        self.entries += min(self.index_ngram, end)
        self.live += min(self.index_ngram, end)

    def pop(self, key: object) -> tuple[list[int], int]:
        """A finished sequence leaves. Its index entries are dropped as lookups meet them, and all at once
        when dead entries outnumber live ones (so memory stays bounded by the open sequences)."""
        tokens, context = self.tokens.pop(key), self.contexts.pop(key)
        self.live -= sum(min(self.index_ngram, end) for end in range(1, len(tokens) + 1))
        if self.entries > 2 * self.live + 1024:
            self.index = {gram: kept for gram, entries in self.index.items()
                          if (kept := [e for e in entries if e[0] in self.tokens])}
            self.entries = self.live
        return tokens, context

    def matches(self, query: list[int], n: int, most: int, cap: int, exclude: object) -> list[tuple[list[int], int, int]]:
        """As `_Finished.matches`, over every open sequence but `exclude`, most recent first."""
        entries = self.index.get(tuple(query[len(query) - n :]))
        out, dead = [], 0
        # the most recent 4 x `most` entries only: at a batch's first rounds thousands of rows end in the
        # same n-gram with nothing after it yet, and scanning them all would cost rows x rows a round
        for key, end in itertools.islice(reversed(entries or ()), 4 * most):
            tokens = self.tokens.get(key)
            if tokens is None:
                dead += 1  # a sequence closed since
            elif key != exclude and end < len(tokens):  # something follows it
                matched = _evidence(_measure(tokens, end, query, n, cap), end, 0, self.contexts[key], query, cap)
                if matched:
                    out.append((tokens, end, matched))
                    if len(out) == most:
                        break
        if dead > most:
            before = len(entries)
            entries[:] = [(key, end) for key, end in entries if key in self.tokens]
            self.entries -= before - len(entries)
        return out

    def __len__(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    def bytes(self) -> int:
        return sum(_bytes(t, {}, 0) for t in self.tokens.values()) + _bytes([], self.index, 2)


def _bytes(tokens: list[int], index: dict, per_entry: int) -> int:
    """Approximate memory of a token list and an index (keys, lists, entries of `per_entry` ints)."""
    total = sys.getsizeof(tokens) + 28 * len(tokens) + sys.getsizeof(index)
    for key, entries in index.items():
        total += sys.getsizeof(key) + sys.getsizeof(entries) + len(entries) * (28 * per_entry + (56 if per_entry > 1 else 0))
    return total


def _last(tokens, n: int):
    """The last `n` of a 1-D sequence, cut before its ids are checked (once a round, at most `n`); anything
    else as given, for `_ids` to name."""
    if isinstance(tokens, Iterable) and not isinstance(tokens, (str, bytes)) and getattr(tokens, "ndim", 1) == 1:
        tokens = list(tokens)
        return tokens[max(0, len(tokens) - n) :]
    return tokens


def _write_whole(path: Path, text: str) -> None:
    """`text` into `path` whole or not at all: written beside it, then moved over it (a failed or
    interrupted write leaves the earlier file as it was). A link is followed (the file it names is
    replaced, the link kept), and a file replaced keeps its permissions."""
    given, path = path, Path(os.path.realpath(path))
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot save to {str(given)!r}: its folder {str(path.parent)!r} does not exist")
    if path.is_dir():
        raise IsADirectoryError(f"cannot save to {str(given)!r}: it is a folder; name a file in it")
    spare = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else None
    spare.unlink(missing_ok=True)  # one a crashed save of an earlier process with this pid left
    try:  # created no more open than the file it replaces (the umask applies), then given its exact mode
        with os.fdopen(os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode), "w") as f:
            f.write(text)
        if mode is not None:
            os.chmod(spare, mode)
        os.replace(spare, path)
    except BaseException:
        spare.unlink(missing_ok=True)
        raise


class RetrievalCache:
    """Earlier outputs (and any corpus given), searchable by the last tokens of a row.

    `max_tokens`: the most tokens held, separators included, at least 2 (oldest sequences evicted first,
    the newest's tail always kept; about 600 bytes a token at the default `index_ngram`, more the longer
    the n-grams indexed: `memory_bytes()` counts it). `context`: how many prompt
    tokens before each output are kept with it (a later answer to the same prompt matches them; a
    match's tokens among them count only if it reaches back to the first kept, so a shared chat
    template's header alone proposes nothing; an ending shared by many prompts that is `context` tokens
    or longer, such as a fixed closing instruction, still matches in full: raise `context` past it).
    `index_ngram`: the longest n-gram indexed; matches are measured further back, up to `max_match`.
    `max_occurrences`: the most recent occurrences of an n-gram examined per lookup (per sequence
    being generated, and in the finished ones)."""

    def __init__(self, max_tokens: int = 250_000, context: int = 16, index_ngram: int = 3, max_match: int = 32,
                 max_occurrences: int = 64):
        max_tokens, context, index_ngram, max_match, max_occurrences = map(  # numpy's and torch's ints as ints
            as_int, (max_tokens, context, index_ngram, max_match, max_occurrences))
        for name, value in (("max_tokens", max_tokens), ("index_ngram", index_ngram), ("max_match", max_match),
                            ("max_occurrences", max_occurrences)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"RetrievalCache: {name} must be a positive integer, got {value!r}")
        if max_tokens < 2:
            raise ValueError(f"RetrievalCache: max_tokens must be at least 2 (a token and the separator after it), "
                             f"got {max_tokens}")
        if isinstance(context, bool) or not isinstance(context, numbers.Integral) or context < 0:
            raise ValueError(f"RetrievalCache: context must be an integer >= 0, got {context!r}")
        self.max_tokens, self.context, self.index_ngram = max_tokens, context, index_ngram
        self.max_match, self.max_occurrences = max(max_match, index_ngram), max_occurrences
        self._lock = threading.RLock()
        # finished sequences in segments of about a tenth of max_tokens, oldest first (`_add`)
        self._finished: deque[_Finished] = deque([_Finished(index_ngram)])
        self._open = _Open(index_ngram)  # sequences being generated, by key (a row of a call)
        # P(a token it proposes is accepted), per match size: learned by every call that uses the cache
        # (each call's planner holds this object), so a later call starts from what earlier ones saw
        self.acceptance = MatchAcceptance()
        self.max_token_id = -1  # the largest id ever held (checked against a model's vocabulary before a call)

    # ------------------------------------------------------------------ adding

    def add(self, tokens: Iterable[int], context: Sequence[int] = ()) -> None:
        """One finished sequence (an output, or a document of a corpus), after the last `self.context`
        tokens of `context` (the prompt it answered)."""
        with self._lock:
            tail = self._tail(context)
            self._add([*tail, *self._ids(tokens)], len(tail))  # every id checked before anything is kept

    def open(self, key: object, context: Sequence[int] = ()) -> None:
        """Start a sequence that grows round by round (a row being generated), under `key`; other rows
        and calls retrieve from it as it grows."""
        try:
            hash(key)
        except TypeError:
            raise ValueError(f"RetrievalCache: a sequence's key must be hashable (a tuple, not a list), got {key!r}") from None
        with self._lock:
            if key in self._open.tokens:
                raise ValueError(f"RetrievalCache: a sequence is already open under {key!r}")
            tail = self._tail(context)  # checked first: a refused context leaves nothing open
            self._remember(tail)
            self._open.tokens[key], self._open.contexts[key] = [], len(tail)
            for token in tail:
                self._open.push(key, token)

    def extend(self, key: object, tokens: Sequence[int]) -> None:
        """Append tokens to the open sequence `key`."""
        with self._lock:
            self._check_open(key)
            ids = self._ids(tokens)
            self._remember(ids)
            for token in ids:
                self._open.push(key, token)

    def close(self, key: object) -> None:
        """The open sequence `key` is finished and joins the finished ones."""
        with self._lock:
            self._check_open(key)
            self._add(*self._open.pop(key))

    # ------------------------------------------------------------------ searching

    def lookup(self, query: Sequence[int], max_tokens: int, max_branches: int = 1, min_match: int = 1,
               exclude: object = None) -> tuple[list[list[int]], int]:
        """(continuations, size): up to `max_branches` distinct continuations (each at most `max_tokens`)
        of the occurrences of the query's longest matching suffix (at least `min_match` tokens), the
        most frequent path first; `size` is the match's bucket (`match_bucket`; 0: no match).
        `exclude`: the key of an open sequence not searched (the row's own text, which in-row lookup
        already searches)."""
        return self.lookup_shares(query, max_tokens, max_branches, min_match, exclude)[:2]

    def lookup_shares(self, query: Sequence[int], max_tokens: int, max_branches: int = 1, min_match: int = 1,
                      exclude: object = None) -> tuple[list[list[int]], int, list[list[float]]]:
        """`lookup`, and per continuation, per token, the share of the matched occurrences that went on
        past its parent and did so with that token (SuffixDecoding's frequency score): 1.0 where every
        earlier occurrence that continued continued the same way."""
        query = self._ids(_last(query, self.max_match))  # ids, never rounded floats; anything else named
        most, cap = self.max_occurrences, self.max_match
        max_tokens, max_branches, min_match = map(as_int, (max_tokens, max_branches, min_match))  # torch ints
        for name, value in (("max_tokens", max_tokens), ("max_branches", max_branches), ("min_match", min_match)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"RetrievalCache.lookup: {name} must be an integer, got {value!r}")
        if max_branches < 1 or min_match < 1:
            raise ValueError(f"RetrievalCache.lookup: max_branches and min_match must be >= 1, got {max_branches}, {min_match}")
        if max_tokens < 1:
            return [], 0, []
        with self._lock:  # a match longer than the index's n-grams is found by its last n-gram and measured
            found, seen = [], set()
            for n in range(min(self.index_ngram, len(query)), min(min_match, self.index_ngram) - 1, -1):
                for f in self._matches(query, n, most, cap) + self._open.matches(query, n, most, cap, exclude):
                    if f[2] >= min_match and (id(f[0]), f[1]) not in seen:  # measured long enough, and new
                        seen.add((id(f[0]), f[1]))
                        found.append(f)
                # a shorter n-gram is tried only where what counts of the matches found (`_evidence`) is shorter
                if found and max(f[2] for f in found) >= n:
                    break
            return self._continuations(found, max_tokens, max_branches) if found else ([], 0, [])

    # ------------------------------------------------------------------ size, disk

    def __len__(self) -> int:
        """Tokens held (prompt context and one separator per finished sequence included)."""
        with self._lock:
            return sum(len(f.tokens) for f in self._finished) + len(self._open)

    def memory_bytes(self) -> int:
        """An estimate of the memory held: token lists, the indexes' keys and entries."""
        with self._lock:
            return sum(f.bytes() for f in self._finished) + self._open.bytes()

    def save(self, path: str | Path) -> None:
        """Write the finished sequences and the settings (JSON); sequences still open are not saved."""
        with self._lock:
            sequences, contexts = [], []
            for finished in self._finished:
                for tokens, context in finished.sequences():
                    sequences.append(tokens)
                    contexts.append(context)
            settings = dict(max_tokens=self.max_tokens, context=self.context, index_ngram=self.index_ngram,
                            max_match=self.max_match, max_occurrences=self.max_occurrences)
            learned = dict(pooled=self.acceptance.pooled, per_size=dict(self.acceptance.per_size),  # copies: calls in
                           seen=dict(self.acceptance.seen))  # other threads update them outside the lock
            text = json.dumps({"format": FORMAT, "settings": settings, "sequences": sequences, "contexts": contexts,
                               "acceptance": learned})
        _write_whole(Path(path), text)

    @classmethod
    def load(cls, path: str | Path) -> "RetrievalCache":
        """A new cache, the one `save` wrote: `cache = RetrievalCache.load(path)` (a classmethod: called on a
        cache, it returns a new one and leaves that cache as it was). A file saved before 2026-12-06 has no
        prompt extents: its stored prompts match as they did then (header matches included)."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise  # as open() raises it: `except FileNotFoundError` starts a new cache
        except (OSError, ValueError, RecursionError) as err:  # (JSON nested past the interpreter's depth)
            raise ValueError(f"cannot read a saved hf_specdec.RetrievalCache from {path}: {err}") from err
        found = data.get("format") if isinstance(data, dict) else None
        if found != FORMAT:
            told = "it has no format field" if found is None else f"its format is {found!r}"
            if str(found).startswith(FORMAT.rsplit("/", 1)[0] + "/"):
                told += ", written by another version of hf_specdec"
            raise ValueError(f"{path} is not a saved hf_specdec.RetrievalCache this version reads ({FORMAT}): {told}")
        try:
            cache = cls(**data["settings"])
            learned = data.get("acceptance") or {}
            # an acceptance is kept per unit of share (`MatchAcceptance`), so it may pass 1; it is capped where read
            pooled = _rate(learned.get("pooled", cache.acceptance.pooled))
            per_size = {_size(k): _rate(v) for k, v in learned.get("per_size", {}).items()}
            seen = {_size(k): _count(v) for k, v in learned.get("seen", {}).items()}
            sequences = data["sequences"]
            if not isinstance(sequences, list) or not all(isinstance(t, list) for t in sequences):
                raise ValueError("sequences must be a list of lists of token ids")
            contexts = data.get("contexts", [0] * len(sequences))  # absent (saved before 2026-12-06): none known
            if not isinstance(contexts, list) or len(contexts) != len(sequences):
                raise ValueError("contexts must be a list with one count per sequence")
            with cache._lock:
                for tokens, context in zip(sequences, contexts):
                    ids = cache._ids(tokens)
                    if _count(context) > min(len(ids), cache.context):
                        raise ValueError(f"a sequence of {len(ids)} tokens saved with context={cache.context} "
                                         f"cannot have a context of {context}")
                    cache._add(ids, context)
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"{path} is not a valid saved hf_specdec.RetrievalCache: {type(err).__name__}: {err}") from err
        cache.acceptance.pooled, cache.acceptance.per_size, cache.acceptance.seen = pooled, per_size, seen
        return cache

    # ------------------------------------------------------------------ internals

    def __copy__(self) -> "RetrievalCache":  # a shallow copy would share the store under another lock
        return copy.deepcopy(self)

    def __getstate__(self) -> dict:
        """copy.deepcopy and pickle: everything but the lock and, as `save`, the sequences still open (a running
        call's rows: it closes them in the original, and nothing would close them in the copy)."""
        with self._lock:
            state = {k: v for k, v in self.__dict__.items() if k != "_lock"}
            state["_open"] = _Open(self.index_ngram)
            return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def _check_open(self, key: object) -> None:
        if key not in self._open.tokens:
            raise ValueError(f"RetrievalCache: no sequence is open under {key!r} (open it first)")

    def _ids(self, tokens: Iterable[int], name: str = "tokens") -> list[int]:
        """Checked ids (`_token_id`), where every token enters the store."""
        if isinstance(tokens, (AbstractSet, Mapping)):
            raise ValueError(f"RetrievalCache: {name} must be an ordered sequence of token ids, got a "
                             f"{type(tokens).__name__} (its order is not the text's)")
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable) or getattr(tokens, "ndim", 1) != 1:
            shape = f" of shape {tuple(tokens.shape)}" if hasattr(tokens, "shape") else ""
            raise ValueError(f"RetrievalCache: {name} must be one sequence of token ids, got {type(tokens).__name__}{shape}"
                             " (several sequences, e.g. a batch's rows, are added one at a time)")
        return [_token_id(t) for t in tokens]

    def _remember(self, ids: list[int]) -> None:
        """The largest id held, once the ids are sure to be kept."""
        self.max_token_id = max([self.max_token_id, *ids])

    def _tail(self, context: Sequence[int]) -> list[int]:
        """The last `self.context` tokens of a prompt, the ones stored."""
        tail = self._ids(_last(() if context is None else context, max(1, self.context)), "context")  # None: none
        return tail if self.context else []  # checked even where none is kept

    def _add(self, tokens: list[int], context: int) -> None:
        """A finished sequence whose first `context` tokens are its prompt's."""
        if not tokens:
            return
        kept = tokens[-max(1, int(0.9 * self.max_tokens) - 1) :]  # one sequence longer than the cache: its tail
        tokens, context = kept, max(0, context - (len(tokens) - len(kept)))
        self._remember(tokens)  # what is kept (a sequence's cut head holds no id a target must embed)
        if len(self._finished[-1].tokens) >= max(1, self.max_tokens // 10):
            self._finished.append(_Finished(self.index_ngram))
        self._finished[-1].add(tokens, context)
        held = sum(len(f.tokens) for f in self._finished)
        if held > self.max_tokens:  # the oldest segments go whole (about a tenth each), the newest stays
            while len(self._finished) > 1 and held > self.max_tokens:
                held -= len(self._finished.popleft().tokens)
            self.max_token_id = max([-1, *(f.largest for f in self._finished),
                                     *(max(t, default=-1) for t in self._open.tokens.values())])

    def _matches(self, query: list[int], n: int, most: int, cap: int) -> list[tuple[list[int], int, int]]:
        """(tokens, end, match length) of the most recent `most` occurrences of the query's last n tokens
        in the finished sequences, those that something follows, most recent first."""
        found, gram = [], tuple(query[len(query) - n :])
        for finished in reversed(self._finished):
            ends = finished.index.get(gram, [])[-most:]
            measured = [(end, _measure(finished.tokens, end, query, n, cap)) for end in reversed(ends)
                        if finished.tokens[end] != SEPARATOR]
            counted = [(end, finished.evidence(end, m, query, cap)) for end, m in measured]
            found += [(finished.tokens, end, m) for end, m in counted if m]
            most -= len(ends)
            if most <= 0:
                return found
        return found

    def _continuations(self, found: list[tuple[list[int], int, int]], max_tokens: int,
                       max_branches: int) -> tuple[list[list[int]], int, list[list[float]]]:
        size = max(match_bucket(m, self.index_ngram) for _, _, m in found)
        trie = Trie()
        for tokens, end, matched in found:
            if match_bucket(matched, self.index_ngram) == size:
                trie.insert(_follows(tokens, end, max_tokens), "cache", count=True)
        paths = _by_frequency(trie, max_branches)
        # over the occurrences that went on past the parent: one that stopped there (its sequence, an
        # open row's tokens so far, or max_tokens ran out) says nothing about which way the text goes
        went_on = {parent: sum(trie.counts[c] for c in children) for parent, children in trie.children.items()}
        shares = [[trie.counts[n] / went_on[trie.parents[n]] for n in nodes] for nodes in paths]
        return [[trie.tokens[n] for n in nodes] for nodes in paths], size, shares


def _rate(value) -> float:
    """A saved acceptance: a finite number >= 0 (not a string, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < float("inf"):
        raise ValueError(f"an acceptance must be a finite number >= 0, got {value!r}")
    return float(value)


def _size(key) -> int:
    """A saved match size: the key `save` wrote, a positive integer."""
    size = int(key) if isinstance(key, str) and key.isdigit() else 0
    if size < 1:
        raise ValueError(f"a match size must be a positive integer, got {key!r}")
    return size


def _count(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a count must be an integer >= 0, got {value!r}")
    return value


def _by_frequency(trie: Trie, max_branches: int) -> list[list[int]]:
    """Up to `max_branches` root-to-leaf paths of `trie` (as node lists), the most frequent first
    (compared node by node from the root: the child more continuations took; among equals the first
    inserted, which is the most recent occurrence)."""

    def path(leaf: int) -> list[int]:
        nodes = []
        while leaf >= 0:
            nodes.append(leaf)
            leaf = trie.parents[leaf]
        return nodes[::-1]

    leaves = [path(j) for j in range(len(trie)) if j not in trie.children]
    leaves.sort(key=lambda nodes: ([-trie.counts[n] for n in nodes], nodes))
    return leaves[:max_branches]


class Retrieval:
    """A call's retrieval sources, one lookup per row and round: the row's own text (in-row n-gram
    lookup) and `cache`, which holds earlier outputs and every row of this call as it grows (so rows
    retrieve from each other). Per row, the source whose continuation the planner expects to be
    accepted more often (`estimate(size, source)`) is proposed; the other is scored unverified."""

    def __init__(self, ngram, cache: RetrievalCache | None, estimate, vocab: int | None = None):
        self.ngram, self.cache, self.estimate = ngram, cache, estimate
        self.vocab = vocab  # the target's: a cache shared with a larger model's calls may hold ids past it
        self.min_ngram = ngram.min_ngram
        self._known: dict[int, int] = {}  # row -> its tokens the cache holds (prompt tail + generated)
        self._key = object()  # this call's rows, apart from other calls' in a shared cache
        # per active row, the source this round's lookup did not propose (scored, then cleared, by `rounds.observe`)
        self.passed_over: dict[int, tuple[list[int], int, str]] = {}
        # per active row the cache's continuation found this round: its shares (`RetrievalCache.lookup_shares`)
        self.shares: dict[int, list[float]] = {}

    def sync(self, prompts: list[list[int]], generated: list[list[int]], rows: list[int]) -> None:
        """Bring the cache's copy of each active row up to date; rows no longer active are closed."""
        if self.cache is None:
            return
        for row in [r for r in self._known if r not in rows]:
            self._close(row, generated)
        for row in rows:
            if row not in self._known:
                self.cache.open((self._key, row), prompts[row])
                self._known[row] = 0
            new = generated[row][self._known[row] :]
            if new:
                self.cache.extend((self._key, row), new)
                self._known[row] += len(new)

    def close(self, generated: list[list[int]]) -> None:
        """The call ends: its rows, with their last round's tokens (`generated`, per row), join the
        cache's finished sequences."""
        for row in list(self._known):
            self._close(row, generated)

    def _close(self, row: int, generated: list[list[int]]) -> None:
        known = self._known.pop(row)
        if generated[row][known:]:
            self.cache.extend((self._key, row), generated[row][known:])
        self.cache.close((self._key, row))

    def match_rows(self, request, rows: list[int]) -> list[tuple[list[int], int, str]]:
        """Per active row: (continuation, match size, source); ([], 0, NGRAM) where nothing matches.
        The source not proposed is kept in `passed_over` (active row -> the same triple), to be scored."""
        out, self.passed_over, self.shares = [], {}, {}
        for i, ((tokens, size), row, host) in enumerate(zip(self.ngram.match_rows(request), rows, request.host)):
            found = self._from_cache(host, min(self.ngram.max_tokens, request.max_tokens), 1, row)
            mine, theirs = (tokens, size, NGRAM), (found[0][0] if found[0] else [], found[1], CACHE)
            if found[0]:
                self.shares[i] = found[2][0]
            chosen, other = (theirs, mine) if found[0] and self._better(found[1], size, found[2][0][0]) else (mine, theirs)
            out.append(chosen)
            if other[0]:
                self.passed_over[i] = other
        return out

    def retrieve(self, request, max_branches: int, row: int = 0) -> tuple[list[list[int]], int, str]:
        """One row's distinct continuations (a tree's retrieved branches), their match size and source."""
        continuations, size = self.ngram.retrieve(request, max_branches)
        found = self._from_cache(request.host[0], min(self.ngram.max_tokens, request.max_tokens), max_branches, row)
        self.passed_over, self.shares = {}, ({0: found[2][0]} if found[0] else {})
        if found[0] and self._better(found[1], size, found[2][0][0]):
            if continuations:
                self.passed_over[0] = (continuations[0], size, NGRAM)
            return found[0], found[1], CACHE
        if found[0]:
            self.passed_over[0] = (found[0][0], found[1], CACHE)
        return continuations, size, NGRAM

    def _from_cache(self, host: list[int], max_tokens: int, branches: int,
                    row: int) -> tuple[list[list[int]], int, list[list[float]]]:
        if self.cache is None or max_tokens < 1:
            return [], 0, []
        found, size, shares = self.cache.lookup_shares(host, max_tokens, branches, self.min_ngram, exclude=(self._key, row))
        if self.vocab is not None and any(t >= self.vocab for c in found for t in c):  # cut each before a foreign id
            cut = [next((j for j, t in enumerate(c) if t >= self.vocab), len(c)) for c in found]
            found, shares = [c[:j] for c, j in zip(found, cut)], [s[:j] for s, j in zip(shares, cut)]
            kept = [i for i, c in enumerate(found) if c]
            found, shares = [found[i] for i in kept], [shares[i] for i in kept]
            size = size if found else 0
        return found, size, shares

    def _better(self, cache_size: int, ngram_size: int, share: float) -> bool:
        """The cache's first token (its `share` of the earlier occurrences) is likelier kept than in-row's."""
        return not ngram_size or self.estimate(cache_size, CACHE) * share > self.estimate(ngram_size, NGRAM)


__all__ = ["Retrieval", "RetrievalCache"]
