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
* Finished rows leave the batch (`Cache.batch_select_indices`), so they cost nothing afterwards;
  their output is padded with the pad token, as transformers pads finished rows.
"""

from __future__ import annotations

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer

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
        self._compactable = True  # False once `compact` found a cache layout it cannot gather

    @property
    def size(self) -> int:
        return len(self.rows)

    def real_sequences(self) -> torch.Tensor | list[torch.Tensor]:
        """What processors see: the work ids while they equal the real sequences, else one per row."""
        if self.ids_are_real:
            return self.ids
        return [self.real_sequence(i)[0] for i in range(self.size)]

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
        m = draft_tokens.shape[1]
        self.ids = torch.cat([self.ids, draft_tokens, extra_tokens[:, None]], dim=1)
        if self.mask is None:  # batch of one: m == num_accepted, so no hole
            return
        positions = torch.arange(m, device=draft_tokens.device)
        kept = (positions[None, :] < num_accepted[:, None]).to(self.mask.dtype)  # [active, m]
        if not bool(kept.all()):
            self.ids_are_real = False
        self.mask = torch.cat([self.mask, kept, self.mask.new_ones(self.size, 1)], dim=1)

    def select(self, keep: torch.Tensor, caches: tuple[Cache | None, ...]) -> None:
        """Keep only the active rows at `keep` (indices into the active rows), in caches too."""
        self.ids = self.ids[keep]
        self.mask = None if self.mask is None else self.mask[keep]
        self.rows = [self.rows[i] for i in keep.tolist()]
        for cache in caches:
            if cache is not None:
                cache.batch_select_indices(keep)

    def should_compact(self) -> bool:
        if self.mask is None or self.size < 2 or not self._compactable:
            return False
        holes = self.ids.shape[1] - int(self.mask.sum(dim=1).max())
        return holes >= max(COMPACT_MIN_HOLES, self.ids.shape[1] // 4)

    def compact(self, caches: tuple[Cache | None, ...]) -> bool:
        """Drop holes and padding from the columns every cache holds, right-aligning each row's real
        columns; columns only some cache holds (at most the last draft column) are kept as they are.
        Returns False (and changes nothing) for cache layouts it cannot gather."""
        caches = tuple(c for c in caches if c is not None)
        if not all(type(layer) is DynamicLayer for c in caches for layer in c.layers):
            self._compactable = False  # e.g. sliding-window layers: holes stay (correct, less efficient)
            return False
        cached = min(c.get_seq_length() for c in caches)
        head = self.mask[:, :cached]  # [active, cached]
        width = int(head.sum(dim=1).max())
        # Stable sort puts each row's masked columns first and its real columns, in order, last.
        order = torch.sort(head, dim=1, stable=True).indices[:, -width:]  # [active, width]
        for cache in caches:
            for layer in cache.layers:
                if layer.keys is None or layer.keys.numel() == 0:
                    continue
                index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
                layer.keys = torch.cat([layer.keys[:, :, :cached].gather(2, index), layer.keys[:, :, cached:]], dim=2)
                layer.values = torch.cat([layer.values[:, :, :cached].gather(2, index), layer.values[:, :, cached:]], dim=2)
        self.ids = torch.cat([self.ids[:, :cached].gather(1, order), self.ids[:, cached:]], dim=1)
        self.mask = torch.cat([head.gather(1, order), self.mask[:, cached:]], dim=1)
        self.ids_are_real = False
        return True

    def sequences(self, pad_token_id: int) -> torch.Tensor:  # [batch, prompt_len + longest generation]
        longest = max(len(g) for g in self.generated)
        tail = torch.full((len(self.generated), longest), pad_token_id, dtype=torch.long, device=self.prompt.device)
        for row, tokens in enumerate(self.generated):
            tail[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return torch.cat([self.prompt, tail], dim=1)
