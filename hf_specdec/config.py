"""Speculative decoding settings (plain data, no transformers import)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeConfig:
    """Settings of one speculative `generate` call.

    Everything that shapes the *output distribution* (temperature, top-k, top-p, penalties, ...)
    lives in transformers' `GenerationConfig` and is applied identically to draft and target;
    these settings only change speed, never the distribution.
    """

    # Draft-model tokens per round: the maximum when `adaptive` (the cost model stops earlier),
    # the exact count otherwise (k in Leviathan et al. 2023).
    num_draft_tokens: int = 8
    # Optional temperature used for the draft only (q hotter or colder than p). None: the draft is
    # warped exactly like the target. Exactness holds for any q, because q is always the
    # distribution the draft token was actually sampled from.
    draft_temperature: float | None = None
    # Cost-model draft lengths, early stop on low draft confidence, fallback to plain decoding
    # (`hf_specdec.policy.DraftPolicy`).
    adaptive: bool = True
    # Hybrid drafts: propose the continuation of an earlier occurrence of the last n tokens
    # (n = ngram_max_size .. ngram_min_size) when the cost model expects it to beat the draft model.
    ngram: bool = True
    ngram_max_size: int = 3
    # The shortest match proposed. None: 1 in tree rounds (single rows), where every round also scores
    # the lookups it did not verify, so a weak 1-gram is dropped within a few rounds; 2 in chains and
    # batches, where 1-grams were measured worse on 4 of 7 categories (run onegram, docs/evaluation.md#older-runs). An
    # explicit value is used everywhere.
    ngram_min_size: int | None = None
    ngram_max_tokens: int = 32
    # How far back a lookup measures its match (the signal SAM-Decoding chooses by): past the
    # n-gram itself, as long as the earlier tokens agree too, up to this many. The cost model keeps
    # its running acceptance per match size, matches longer than ngram_max_size bucketed by powers of
    # two (4-7, 8-15, 16-31, 32), and a lookup follows the occurrences with the longest match, the
    # earliest first. Greedy outputs of the real pair (standard preset, every position whose suffix
    # occurred before): the longest match's continuation was the next token 0.63 of the time after a
    # 3-token match, 0.89 / 0.86 / 0.97 after 4-7 / 8-15 / 16+ (summarization); 0.56 after 2 and 1.0
    # after every longer one (HumanEval; run match-length, docs/evaluation.md#older-runs). 0 (or at most ngram_max_size):
    # sizes are n-gram sizes, the most recent occurrence first.
    ngram_match_cap: int = 32
    # With ngram_depths > 0 the cost model learns a lookup's acceptance per match size for its first
    # token and per depth for tokens 2 .. ngram_depths (the last shared by deeper ones): a copy that
    # has started tends to go on (real pair, summarization at T = 0.7: 0.48 at the first token, 0.55
    # / 0.83 / 0.6-0.9 at 2 / 3 / 4-8). 0 (default): one acceptance per match size for every token.
    # Off because it did not pay on the tuning split (run tuning-levers, docs/evaluation.md#older-runs): greedy
    # modelled time 1% lower, and under sampling retrieval trees won more rounds and kept the draft
    # model out longer (summarization 11% slower modelled).
    ngram_depths: int = 0
    # Ski rental for the draft's prefill (single rows with retrieval trees; batches with lookup): a
    # cold draft starts only once the rounds taken without it have lost, against a warm draft's
    # expected rate, this many times what its prefill costs (`hf_specdec.policy.PolicySettings`);
    # a single row does not wait in a round where retrieval has no node worth verifying and the prefill
    # is small (`PolicySettings.small_prefill_share`: a short prompt). 0: no wait. In batches it took
    # the batch-2 and -4 study from 1.08x / 1.05x to 1.10x / 1.10x plain batched
    # (run batch-study, docs/evaluation.md#older-runs, one run).
    prefill_patience: float = 1.0
    # Trees of candidates (one row): every distinct retrieved continuation (up to tree_max_branches)
    # and the draft model's chain, merged into one trie and verified in one target forward with a tree
    # attention mask; the cost model keeps the nodes that pay, at most tree_max_nodes. False: one
    # chain per round from one source. None (default): trees for greedy decoding, chains when
    # sampling. Measured on the real pair (standard preset, T = 0.7, top-p 0.95, packed, one run,
    # run sampling-trees-vs-chains, docs/evaluation.md#older-runs): chains 1.17x [1.07, 1.31] the speed of trees, paired
    # over 35 prompts (1.16x modelled), ahead in 6 of 7 categories; a second run 1.06x [0.97, 1.18]
    # (1.09x modelled, run sampling-default, docs/evaluation.md#older-runs); in greedy decoding trees are level by
    # wall and 4% ahead modelled (run greedy-probe-fix, docs/evaluation.md#older-runs). True: trees when sampling too.
    tree: bool | None = None
    tree_max_branches: int = 8
    tree_max_nodes: int = 24
    # Reduced-vocabulary draft head: the draft proposes only token ids below this (the tokenizer's
    # most frequent merges, for BPE vocabularies ordered by merge rank), plus the prompt's tokens and
    # the EOS tokens. None: the full vocabulary. Exact either way (q is zero outside the subset).
    draft_vocab_size: int | None = None
    # The draft encodes only the last `draft_window` tokens of the prompt (and everything generated
    # after it): a long prompt's draft prefill then costs `draft_window` tokens, at some cost in
    # acceptance where the draft needed the rest (on the real pair's 380-1300-token summarization and
    # RAG prompts, 256 beat the whole prompt in wall clock in all four greedy/sampling cells, modelled
    # in three: run draft-prefill, docs/evaluation.md#older-runs). Single-row calls only; a batch's draft reads the whole prompt.
    # None: the whole prompt. Exact either way (q is whatever the draft computed). "auto" (default): 64
    # tokens in greedy calls, 256 when sampling. Greedy replays of the standard preset's 35 prompts
    # (run prefill-priced, docs/evaluation.md#older-runs): 64 against 256, summarization 1.021 against 0.960 and RAG 1.162
    # against 1.121 over the faster transformers method (modelled, geometric means), translation 0.985x,
    # math 1.031x; a greedy round needs the draft's argmax, which reads less context than its whole
    # distribution. In seeded sampling replays 64 lost RAG (3 of 5 prompts slower, 0.995x plain against
    # 1.225x): sampling keeps 256. Standard greedy run with it: docs/evaluation.md (current results).
    draft_window: int | None | str = "auto"
    # Pin the draft/target step cost ratio c instead of measuring it online.
    draft_cost: float | None = None
    # Pin the cost d of one more token in the verifying forward (in target steps) instead of fitting
    # it online. With both costs pinned, the cost model reads no clock: seeded runs repeat exactly.
    verify_cost: float | None = None
    # Pin e, the extra cost of each verify token past the knee (9 tokens; `hf_specdec.policy`). With
    # verify_cost pinned and this not, e is its prior (0.02): pinned runs never read the clock.
    verify_knee_cost: float | None = None
    # Price each verify width (single rows) by its own measured time as well as by the line through
    # d and e: on some CPUs a forward over more tokens is not dearer (the packed 1.5B target on a
    # 2-core AVX-512 EPYC: 2 tokens 1.15-1.25 target steps, 5 tokens 0.78-0.92), and the cost model then
    # fills a round up to a cheaper width (`hf_specdec.policy`). False: the line only.
    price_by_width: bool = True
    # Pin the price of a verify forward per width instead of measuring it: entry i the price of i + 1
    # tokens in target steps (the first normally 1.0), wider forwards on its last segment. With
    # draft_cost also pinned, the cost model reads no clock. d and e, unless pinned, are the curve's.
    verify_curve: tuple[float, ...] | None = None
    # Pin the draft's encoding of one prompt token, in target steps, instead of measuring it online
    # (0.35 times the target's own, timed on the prompt's encoding; `hf_specdec.policy`). The cost
    # model weighs it before starting a cold draft. With the other costs pinned and this not, it is
    # priced 0.35 d (d: one more verify token), as pinned runs read no clock.
    draft_prefill_cost: float | None = None

    def window_for(self, do_sample: bool) -> int | None:
        """The draft's window in a greedy (`do_sample=False`) or sampling call ("auto": 64 or 256)."""
        if self.draft_window == "auto":
            return 256 if do_sample else 64
        return self.draft_window

    def lookup_min_size(self, trees: bool) -> int:
        """The shortest n-gram match proposed, in tree rounds or not (`ngram_min_size`)."""
        if self.ngram_min_size is not None:
            return self.ngram_min_size
        return 1 if trees else min(2, self.ngram_max_size)

    def __post_init__(self) -> None:
        # Types first (a bool is not a number here, though Python says True == 1), then ranges.
        for name in ("num_draft_tokens", "ngram_max_size", "ngram_max_tokens", "tree_max_branches", "tree_max_nodes"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("ngram_depths", "ngram_match_cap"):
            _check_int(name, getattr(self, name), minimum=0)
        for name in ("ngram_min_size", "draft_vocab_size"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1, none="or None")
        for name in ("adaptive", "ngram", "price_by_width"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.tree is not None and not isinstance(self.tree, bool):
            raise ValueError(f"tree must be True, False or None (trees for greedy decoding only), got {self.tree!r}")
        if self.draft_temperature is not None:
            _check_number("draft_temperature", self.draft_temperature, positive=True)
        _check_number("prefill_patience", self.prefill_patience)
        for name in ("draft_cost", "verify_cost", "verify_knee_cost", "draft_prefill_cost"):
            if getattr(self, name) is not None:
                _check_number(name, getattr(self, name))
        if self.ngram_min_size is not None and self.ngram_min_size > self.ngram_max_size:
            raise ValueError(
                f"need 1 <= ngram_min_size <= ngram_max_size, got {self.ngram_min_size} and {self.ngram_max_size}"
            )
        window = self.draft_window
        if window is not None and window != "auto" and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"draft_window must be a positive integer, None or 'auto', got {window!r}")
        if self.verify_curve is not None:
            from .policy import check_verify_curve

            check_verify_curve(self.verify_curve)
            object.__setattr__(self, "verify_curve", tuple(float(v) for v in self.verify_curve))


def _check_int(name: str, value, minimum: int, none: str = "") -> None:
    """A ValueError naming `name` unless `value` is an int (not a bool) of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {kind}{' ' + none if none else ''}, got {value!r}")


def _check_number(name: str, value, positive: bool = False) -> None:
    """A ValueError naming `name` unless `value` is a finite real number, >= 0 (or > 0 if `positive`)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'} (or None), got {value!r}")
