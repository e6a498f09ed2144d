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
The caches themselves are changed only in `hf_specdec.cache` (rollback, row selection, column
gathering); this module decides *which* rows and columns.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import Cache

from .cache import can_gather, gather_columns, select_rows
from .sampling import Prefixes

# Compact only when at least this many columns are holes for the row with the most real tokens.
COMPACT_MIN_HOLES = 32


class RaggedBatch:
    def __init__(
        self,
        prompt: torch.Tensor,  # [batch, prompt_len], left-padded
        attention_mask: torch.Tensor | None,  # [batch, prompt_len] or None (no padding)
    ):
        batch = prompt.shape[0]
        self.prompt = prompt
        self.ids = prompt  # [active, seq]: the work sequence (with holes)
        # None only while nothing is padded and no hole exists (always the case at batch size 1).
        self.mask = attention_mask if attention_mask is not None or batch == 1 else torch.ones_like(prompt)
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
        tail = torch.tensor(self.generated[row], dtype=torch.long, device=self.prompt.device)
        return torch.cat([self.prompt[row], tail])[None]

    def remaining(self, max_length: int) -> int:
        """Most tokens any active row may still generate before max_length."""
        return max(max_length - self.prompt.shape[1] - len(self.generated[row]) for row in self.rows)

    def append_round(
        self,
        draft_tokens: torch.Tensor,  # [active, m]: the draft columns kept (m = most accepted in any row)
        num_accepted: torch.Tensor,  # [active]
        extra_tokens: torch.Tensor,  # [active]: each row's recovered or bonus token
    ) -> None:
        """The work sequence grows by the kept draft columns and one column of extra tokens."""
        self._prefixes = None
        m = draft_tokens.shape[1]
        self.ids = torch.cat([self.ids, draft_tokens, extra_tokens[:, None]], dim=1)
        if self.mask is None:  # batch of one: m == num_accepted, so no hole
            return
        positions = torch.arange(m, device=draft_tokens.device)
        kept = (positions[None, :] < num_accepted[:, None]).to(self.mask.dtype)  # [active, m]
        if not bool(kept.all()):
            self.ids_are_real = False
        self.mask = torch.cat([self.mask, kept, self.mask.new_ones(self.size, 1)], dim=1)

    def record(self, i: int, tokens: Sequence[int]) -> None:
        """Tokens emitted by active row i (its real sequence grows; the work sequence already has them)."""
        self._prefixes = None
        self.generated[self.rows[i]].extend(tokens)

    def select(self, keep: list[int], caches: tuple[Cache | None, ...]) -> None:
        """Keep only the active rows at positions `keep`, in the work sequence and in the caches."""
        self._prefixes = None
        index = torch.tensor(keep, dtype=torch.long, device=self.ids.device)
        self.ids = self.ids[index]
        self.mask = None if self.mask is None else self.mask[index]
        self.rows = [self.rows[i] for i in keep]
        select_rows(caches, index)

    def should_compact(self, caches: tuple[Cache | None, ...]) -> bool:
        """Whether holes have piled up (a quarter of the columns, at least COMPACT_MIN_HOLES) in a
        batch whose caches allow gathering columns."""
        if self.mask is None or self.size < 2 or not self._compactable:
            return False
        holes = self.width - int(self.mask.sum(dim=1).max())
        if holes < max(COMPACT_MIN_HOLES, self.width // 4):
            return False
        self._compactable = can_gather(caches)  # e.g. sliding-window layers: holes stay (correct, less efficient)
        return self._compactable

    def compact(self, caches: tuple[Cache | None, ...]) -> None:
        """Drop holes and padding from the columns every cache holds: each row's real columns, in
        order, gathered to the right (shorter rows left-padded); columns past the shortest cache (the
        target runs ahead of the draft after plain or n-gram rounds) are kept as they are."""
        self._prefixes = None
        cached = min(c.get_seq_length() for c in caches if c is not None)
        head = self.mask[:, :cached]  # [active, cached]
        width = int(head.sum(dim=1).max())
        # Stable sort puts each row's masked columns first and its real columns, in order, last.
        order = torch.sort(head, dim=1, stable=True).indices[:, -width:]  # [active, width]
        gather_columns(caches, order, cached)
        self.ids = torch.cat([self.ids[:, :cached].gather(1, order), self.ids[:, cached:]], dim=1)
        self.mask = torch.cat([head.gather(1, order), self.mask[:, cached:]], dim=1)
        self.ids_are_real = False

    def sequences(self, pad_token_id: int) -> torch.Tensor:  # [batch, prompt_len + longest generation]
        longest = max(len(g) for g in self.generated)
        tail = torch.full((len(self.generated), longest), pad_token_id, dtype=torch.long, device=self.prompt.device)
        for row, tokens in enumerate(self.generated):
            tail[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return torch.cat([self.prompt, tail], dim=1)
