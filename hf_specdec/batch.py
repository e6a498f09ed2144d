"""Ragged batches: rows that accept different numbers of draft tokens each round.

Design (the cache length stays common to all rows; rejected slots become masked holes):

* The *work sequence* `ids` [batch, seq] is what both models' caches hold (plus one or two pending
  columns at the end). Every round appends the same columns to every row: the drafts some row
  accepted, then one column with each row's recovered/bonus token. A draft column that row b
  rejected but another row accepted stays in the cache as a *hole*: `mask` is 0 there, so attention
  skips it, and position ids (cumulative sum of the mask) stay contiguous over the real tokens.
  Draft columns that every row rejected are cropped from both caches (`cache.rollback`), so a batch
  of one never has holes and behaves exactly like unbatched decoding.
* Each row's *real sequence* (its prompt, left padding included, plus what it generated) is kept
  apart; that is what logits processors and stopping criteria see, exactly as in plain `generate`.
* Holes cost attention work and memory; when they exceed a quarter of the sequence (and at least
  `COMPACT_MIN_HOLES` columns), `compact` gathers every row's real columns to the right
  (left-padding the shorter rows) in the work sequence and in both caches. Per-round cost stays
  flat: no prefix is ever re-encoded.
* Finished rows leave the batch, so they cost nothing afterwards; their output is padded with the
  pad token, as transformers pads finished rows.
* Continuous batching (`hf_specdec.continuous`): a new row joins on the right of the work sequence
  (left-padded to its width, or the batch is left-padded to the new prompt's length); its real
  sequence is its own prompt, unpadded. Compaction keeps the width bounded over a long stream.
The caches themselves are changed only in `hf_specdec.cache` (rollback, row selection, column
gathering); this module decides *which* rows and columns.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import Cache

from .cache import can_gather, gather_columns, select_rows
from .host import to_device
from .sampling import Prefixes

# Compact only when at least this many columns are holes for the row with the most real tokens.
COMPACT_MIN_HOLES = 32


class RaggedBatch:
    def __init__(
        self,
        prompt: torch.Tensor,  # [batch, prompt_len], left-padded
        attention_mask: torch.Tensor | None,  # [batch, prompt_len] or None (no padding)
        max_new_tokens: int,  # each row generates at most this many tokens
    ):
        batch = prompt.shape[0]
        if attention_mask is not None and attention_mask.dtype != torch.long:  # a float or bool mask, as plain takes
            attention_mask = attention_mask.ne(0).long()  # (columns are counted and sliced by it on the host)
        self.prompts = list(prompt.unbind(0))  # per original row: what processors see before its tokens
        self.limits = [max_new_tokens] * batch  # per original row
        self.ids = prompt  # [active, seq]: the work sequence (with holes)
        # None only while nothing is padded and no hole exists (always the case at batch size 1).
        self.mask = attention_mask if attention_mask is not None or batch == 1 else torch.ones_like(prompt)
        # `mask` on the host (the user's mask read once, before any round), so holes are counted and compacted
        # without a device read; `real`: per active row, its real columns (the ones in its mask), kept as a count
        if attention_mask is not None:
            self.host_mask = attention_mask.tolist()
        else:
            self.host_mask = None if self.mask is None else [[1] * prompt.shape[1] for _ in range(batch)]
        self.real = [prompt.shape[1]] * batch if self.host_mask is None else [sum(row) for row in self.host_mask]
        # its real tokens on the host, for lookups (read once, before any round): no left padding in what is searched
        self.prompt_host = prompt.tolist() if attention_mask is None else [
            [t for t, m in zip(ids, mask) if m] for ids, mask in zip(prompt.tolist(), self.host_mask)]
        self.rows = list(range(batch))  # original row index of each active row
        self.generated: list[list[int]] = [[] for _ in range(batch)]  # per original row
        self.ids_are_real = True  # no hole and no compaction yet: ids rows equal the real sequences
        self._compactable = True  # False once the caches turned out not to allow gathering columns
        self._prefixes: Prefixes | None = None  # memo, until the batch changes

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        """Columns of the work sequence (what the caches hold, plus pending columns)."""
        return self.ids.shape[1]

    def prefixes(self) -> Prefixes:
        """What processors see this round: each active row's real sequence."""
        if self._prefixes is None:
            if self.ids_are_real:
                self._prefixes = Prefixes.from_tensor(self.ids, self.rows)
            else:
                self._prefixes = Prefixes.of([self.real_sequence(i)[0] for i in range(self.size)], self.rows)
        return self._prefixes

    def real_sequence(self, i: int) -> torch.Tensor:  # [1, len]: active row i, for stopping criteria
        row = self.rows[i]
        tail = to_device(self.generated[row], self.ids.device)
        return torch.cat([self.prompts[row], tail])[None]

    def host_sequences(self) -> list[list[int]]:
        """Each active row's prompt and generated tokens on the host (what lookups search)."""
        return [self.prompt_host[row] + self.generated[row] for row in self.rows]

    def remaining(self) -> int:
        """Most tokens any active row may still generate."""
        return max(self.limits[row] - len(self.generated[row]) for row in self.rows)

    def longest(self) -> int:
        """Real tokens (prompt and generated, no padding or holes) in the longest active row: the
        positions a model has read for it. Host state, no device read."""
        return max(len(self.prompts[row]) + len(self.generated[row]) for row in self.rows)

    def left(self, i: int) -> int:
        """Tokens active row i may still generate."""
        row = self.rows[i]
        return self.limits[row] - len(self.generated[row])

    def append_round(
        self,
        draft_tokens: torch.Tensor,  # [active, m]: the draft columns kept (m = most accepted in any row)
        num_accepted: torch.Tensor,  # [active]
        extra_tokens: torch.Tensor,  # [active]: each row's recovered or bonus token
        accepted: list[int],  # num_accepted on the host
    ) -> None:
        """The work sequence grows by the kept draft columns and one column of extra tokens."""
        self._prefixes = None
        m = draft_tokens.shape[1]
        self.ids = torch.cat([self.ids, draft_tokens, extra_tokens[:, None]], dim=1)
        self.real = [real + n + 1 for real, n in zip(self.real, accepted)]
        if self.mask is None:  # batch of one: m == num_accepted, so no hole
            return
        for row, n in zip(self.host_mask, accepted):
            row += [1] * n + [0] * (m - n) + [1]
        positions = torch.arange(m, device=draft_tokens.device)
        kept = (positions[None, :] < num_accepted[:, None]).to(self.mask.dtype)  # [active, m]
        if min(accepted) < m:
            self.ids_are_real = False
        self.mask = torch.cat([self.mask, kept, self.mask.new_ones(self.size, 1)], dim=1)

    def record(self, i: int, tokens: Sequence[int]) -> None:
        """Tokens emitted by active row i (its real sequence grows; the work sequence already has them)."""
        self._prefixes = None
        self.generated[self.rows[i]].extend(tokens)

    def select(self, keep: list[int], caches: tuple[Cache | None, ...]) -> None:
        """Keep only the active rows at positions `keep`, in the work sequence and in the caches."""
        self._prefixes = None
        index = to_device(keep, self.ids.device)
        self.ids = self.ids[index]
        self.mask = None if self.mask is None else self.mask[index]
        self.host_mask = None if self.host_mask is None else [self.host_mask[i] for i in keep]
        self.rows = [self.rows[i] for i in keep]
        self.real = [self.real[i] for i in keep]
        select_rows(caches, index)

    def should_compact(self, caches: tuple[Cache | None, ...]) -> bool:
        """Whether holes have piled up (a quarter of the columns, at least COMPACT_MIN_HOLES) in a
        batch whose caches allow gathering columns."""
        if self.mask is None or not self.size or not self._compactable:
            return False
        holes = self.width - max(self.real)
        if holes < max(COMPACT_MIN_HOLES, self.width // 4):
            return False
        self._compactable = can_gather(caches)  # e.g. sliding-window layers: holes stay (correct, less efficient)
        return self._compactable

    def compact(self, caches: tuple[Cache | None, ...]) -> None:
        """Drop holes and padding from the cached columns: each row's real columns, in order, gathered
        to the right (shorter rows left-padded), segment by segment: up to the shortest cache's length
        in every cache, then up to the next in the caches that hold it (the target runs ahead of a
        draft that sat out lookup and plain rounds: its holes go too). Uncached columns stay."""
        self._prefixes = None
        # An empty cache (a draft that has not run yet) holds the empty prefix of any work sequence.
        live = [c for c in caches if c is not None and c.get_seq_length() > 0]
        start, shift = 0, 0  # the segment's first column: in the sequence as it was, and as compacted so far
        for end in sorted({c.get_seq_length() for c in live}):
            a, b = shift, shift + end - start  # the segment's columns now
            real = [sum(row[a:b]) for row in self.host_mask]  # each row's real columns there (host: no device read)
            width = max(real)
            head = self.mask[:, a:b]
            order = torch.sort(head, dim=1, stable=True).indices[:, b - a - width :]  # each row's real columns, last
            gather_columns([c for c in live if c.get_seq_length() >= b], order, b, a)
            self.ids = torch.cat([self.ids[:, :a], self.ids[:, a:b].gather(1, order), self.ids[:, b:]], dim=1)
            self.mask = torch.cat([self.mask[:, :a], head.gather(1, order), self.mask[:, b:]], dim=1)
            self.host_mask = [row[:a] + [0] * (width - n) + [1] * n + row[b:] for row, n in zip(self.host_mask, real)]
            start, shift = end, a + width
        self.ids_are_real = False

    # ------------------------------------------------------------ continuous batching

    def widen(self, length: int, pad_token_id: int) -> int:
        """Make room for a prompt of `length` tokens: if it is longer than the work sequence, the
        batch gets that many masked columns in front. Returns how many (the caches must follow,
        `cache.pad_front`)."""
        self._prefixes = None
        extra = max(0, length - self.width)
        if self.mask is None:
            self.mask = torch.ones_like(self.ids)
            self.host_mask = [[1] * self.width for _ in range(self.size)]
        if extra:
            self.ids = torch.nn.functional.pad(self.ids, (extra, 0), value=pad_token_id)
            self.mask = torch.nn.functional.pad(self.mask, (extra, 0), value=0)
            self.host_mask = [[0] * extra + row for row in self.host_mask]
            self.ids_are_real = False
        return extra

    def add_row(self, prompt: torch.Tensor, max_new_tokens: int, pad_token_id: int) -> int:
        """A new row (prompt: [len] <= width, see `widen`) joins on the right of the work sequence,
        left-padded; the caches must add it too (`cache.add_row`). Returns its original row index."""
        self._prefixes = None
        pad = self.width - prompt.shape[0]
        ids = torch.nn.functional.pad(prompt, (pad, 0), value=pad_token_id)[None]
        mask = torch.cat([self.mask.new_zeros(pad), self.mask.new_ones(prompt.shape[0])])[None]
        self.ids = torch.cat([self.ids, ids.to(self.ids.device)])
        self.host_mask.append([0] * pad + [1] * prompt.shape[0])
        self.real.append(prompt.shape[0])
        self.prompt_host.append(prompt.tolist())
        self.mask = torch.cat([self.mask, mask.to(self.ids.device)])
        self.ids_are_real = False
        row = len(self.prompts)
        self.prompts.append(prompt)
        self.limits.append(max_new_tokens)
        self.generated.append([])
        self.rows.append(row)
        return row

    def clear(self) -> None:
        """An empty batch drops its columns (the caches must be rolled back to 0 with it)."""
        self._prefixes = None
        self.ids = self.ids[:, :0]
        self.real = []
        self.mask = self.mask[:, :0] if self.mask is not None else None
        self.host_mask = None if self.host_mask is None else []

    def sequences(self, pad_token_id: int) -> torch.Tensor:  # [batch, longest prompt + longest generation]
        width = max(p.shape[0] for p in self.prompts)
        longest = max(len(g) for g in self.generated)
        out = torch.full((len(self.generated), width + longest), pad_token_id, dtype=torch.long, device=self.ids.device)
        for row, (prompt, tokens) in enumerate(zip(self.prompts, self.generated)):
            out[row, width - prompt.shape[0] : width] = prompt
            out[row, width : width + len(tokens)] = to_device(tokens, out.device)
        return out
