"""Side-by-side evaluation: plain decoding, transformers' assisted generation, transformers' prompt
lookup decoding and hf_specdec, on Spec-Bench (six tasks) and HumanEval, greedy and sampling.

    python evals/run_eval.py --preset quick                      # real pair, ~20 min on 2 CPU cores
    accelerate launch --multi_gpu --num_processes 2 evals/run_eval.py ...   # prompts split across
                                                                  # processes (CPU-only: torchrun + gloo)
    python evals/run_eval.py --target tiny --draft tiny --preset quick --out runs/tiny   # offline check
    python evals/run_eval.py --prompts my_prompts.jsonl --preset standard   # one's own prompts (docs/evaluation.md)

For every prompt, in one process, the methods run interleaved (plain first, then the others) with
the same max_new_tokens; speedup = method tokens/s over plain tokens/s for that prompt
(`common.speedup_over_plain`), and each category reports the median. Writes <out>/records.jsonl (one
line per prompt, mode and method), <out>/summary.json, <out>/summary.md and PNG plots. While it runs,
each process appends finished prompts to <out>/records.partial.rank<N>.jsonl: a stopped run keeps
what it measured (`--from-records` summarises it, beside it unless --out is given).
Batched throughput is `evals/batch_study.py`; the bars table of a summary is `evals/bars.py`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # evals/ is a folder of scripts, not a package

import hf_specdec  # noqa: E402
from common import (  # noqa: E402
    CATEGORIES, MODES, SPLITS, ForwardTimer, check_categories, geomean_of_medians_interval, median_interval, drafts_by_precision, geometric_mean, load_pair, load_prompt_file, load_prompts,
    read_prompt_file,
    add_options,
    median_or_none, pooled_stats, round_log, speedup_over_plain, step_time, tree_counts, with_scored,
    draft_length, existing_path, positive_int,
)
from costs import CostTable, measure  # noqa: E402
from hf_specdec.diagnostics import greedy_divergence  # noqa: E402
from hf_specdec.pair import DRAFT, TARGET, check_same_vocabulary, load_model  # noqa: E402
from hf_specdec.stats import geometric_tokens_per_round  # noqa: E402

METRIC = HERE / "metrics" / "speculative_acceptance"
METHODS = ("plain", "assisted", "prompt_lookup", "hf_specdec")
# hf_specdec with one lever (or all) switched off, for the ablation table (`--ablation`). hf_specdec
# itself runs the library defaults (adaptive draft length, hybrid n-gram drafts) with the draft
# quantized to int8 weights (`--draft-bits`, lever 3); "bf16" rows use the unquantized draft. With
# --pack the draft is packed for every method, hf_specdec's with int8 copies for its one-token steps
# (`pack_linears(decode_bits=8)`), the "bf16" one (assisted, hf_bf16_draft) without them.
ABLATIONS = {
    "hf_k5_model_only": dict(adaptive=False, ngram=False, num_draft_tokens=5, draft="bf16"),  # all levers off
    "hf_bf16_draft": dict(draft="bf16"),
    "hf_no_adaptive": dict(adaptive=False, num_draft_tokens=5),
    "hf_no_ngram": dict(ngram=False),
    "hf_chain": dict(tree=False),  # one chain per round (no trees of candidates in greedy calls)
    # The draft encodes the prompt's last 256 tokens in greedy calls too (the default gives greedy 64,
    # sampling 256: `SpeculativeConfig.draft_window`).
    "hf_window256": dict(draft_window=256),
    "hf_min2": dict(ngram_min_size=2),  # no 1-gram matches, in trees either
}
# hf_specdec with another draft (`--second-draft`, e.g. a distilled one: evals/distill.py), quantized as
# the first and, where a saved cost table has no price for it, priced as the first (same architecture).
SECOND_DRAFT = {"hf_second_draft": dict(draft="second")}
HF_METHODS = ("hf_specdec", *ABLATIONS, *SECOND_DRAFT)
# Not in the defaults: transformers' assisted generation given the same quantized draft as hf_specdec.
EXTRA_METHODS = ("assisted_quantized",)
ALL_METHODS = METHODS + EXTRA_METHODS + tuple(ABLATIONS) + tuple(SECOND_DRAFT)


@dataclass(frozen=True)
class Preset:
    prompts_per_category: int | None  # None: every prompt
    max_new_tokens: int


PRESETS = {
    "quick": Preset(prompts_per_category=1, max_new_tokens=64),  # 7 prompts, ~13 min on 2 cores (real pair)
    "standard": Preset(prompts_per_category=5, max_new_tokens=64),  # 35 prompts, ~1 h on 2 cores (real pair)
    "full": Preset(prompts_per_category=None, max_new_tokens=128),  # every prompt of the split: 322 (--split all: 644)
}


DEFAULT_OUT = "runs/eval"


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation run, as `main` performs it: the preset already resolved into
    `prompts_per_category` and `max_new_tokens` (`preset` is kept for the record)."""

    target: str = TARGET.name  # registry name, local folder, hub id, or "tiny"
    draft: str = DRAFT.name
    preset: str = "quick"
    categories: tuple[str, ...] = CATEGORIES
    modes: tuple[str, ...] = tuple(MODES)
    methods: tuple[str, ...] = METHODS  # must include "plain", the baseline of every speedup
    out: Path = Path(DEFAULT_OUT)
    num_draft_tokens: int | None = None  # None: hf_specdec's default (max) draft length
    prompts_per_category: int | None = PRESETS["quick"].prompts_per_category  # None: every prompt
    max_new_tokens: int = PRESETS["quick"].max_new_tokens
    device_map: str | None = None  # e.g. "auto" for a target too large for one device
    threads: int = 0  # torch threads per process (0: torch's default)
    draft_bits: int = 8  # weight-only quantization of hf_specdec's draft (16: none)
    split: str | None = "report"  # prompts of the report split (odd ids), "tuning" (even ids), "all"; None: a file's
    cost_table: Path | None = None  # a saved cost table to price work with (None: measure one at the start)
    second_draft: str | None = None  # another draft for the hf_second_draft method (registry name or folder)
    pack: bool = False  # every method on the float32 oneDNN-packed pair (hf_specdec.pack_linears)
    prompts_file: Path | None = None  # one's own prompts (common.read_prompt_file) instead of the presets' sets

    def __post_init__(self) -> None:
        # Each mode and method once (a repeat would count its prompts twice), plain first: every other
        # method is compared with plain's output on the same prompt and mode, so plain must have run.
        methods = tuple(dict.fromkeys(self.methods))
        if "plain" in methods:
            methods = ("plain", *(m for m in methods if m != "plain"))
        object.__setattr__(self, "methods", methods)
        object.__setattr__(self, "modes", tuple(dict.fromkeys(self.modes)))
        if self.prompts_file is not None:  # a file is taken as it is: the presets' categories and split do not apply
            if self.categories == CATEGORIES:
                object.__setattr__(self, "categories", ())
            object.__setattr__(self, "split", None)


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    preset = PRESETS[args.preset]
    methods = args.methods + [m for m in ABLATIONS if args.ablation and m not in args.methods]
    return EvalConfig(
        target=args.target, draft=args.draft, preset=args.preset,
        categories=tuple(args.categories or ()) if args.prompts or args.categories else CATEGORIES,
        modes=tuple(args.modes), methods=tuple(methods), out=Path(args.out or DEFAULT_OUT),
        num_draft_tokens=args.num_draft_tokens,
        prompts_per_category=(args.prompts_per_category if args.prompts or args.prompts_per_category is not None
                              else preset.prompts_per_category),  # one's own file: all of it unless capped
        max_new_tokens=args.max_new_tokens or preset.max_new_tokens, device_map=args.device_map,
        threads=args.threads, draft_bits=args.draft_bits, split=_split(args),
        cost_table=Path(args.cost_table) if args.cost_table else None, second_draft=args.second_draft,
        pack=args.pack, prompts_file=Path(args.prompts) if args.prompts else None,
    )


def _split(args: argparse.Namespace) -> str | None:
    """--split picks from the presets' sets (default report); one's own file is taken as it is."""
    if args.prompts and args.split is not None:
        raise SystemExit("--split picks from the presets' prompt sets; a --prompts file is taken as it is (use "
                         "--categories or --prompts-per-category to take part of it)")
    return None if args.prompts else (args.split or "report")


def check_config(config: EvalConfig) -> None:
    """Refuse a bad run before any model loads."""
    if set(config.methods) - set(ALL_METHODS) or "plain" not in config.methods or len(set(config.methods)) < 2:
        raise SystemExit(f"methods must include plain and at least one method to compare with it, from "
                         f"{', '.join(ALL_METHODS)}; got {list(config.methods)}")
    if ("hf_second_draft" in config.methods) != (config.second_draft is not None):
        raise SystemExit("--second-draft PATH and the method hf_second_draft go together: give both or neither")
    bad = set(config.modes) - set(MODES)
    if bad:
        raise SystemExit(f"unknown mode {sorted(bad)}; choose from {', '.join(MODES)}")
    if config.prompts_file is not None:  # read now: a bad file is named before any model loads
        read_prompt_file(config.prompts_file, config.categories, config.prompts_per_category)
    else:
        check_categories(config.categories)
    if config.prompts_file is None and config.split not in SPLITS:
        raise SystemExit(f"unknown split {config.split!r}; choose from {', '.join(SPLITS)}")


# ---------------------------------------------------------------- one prompt


def run_method(method, target, drafts, input_ids, mode_kwargs, max_new_tokens, num_draft_tokens, seed, pins):
    """One generate call: (sequences, seconds, hf_specdec stats or None, per-round records, plain
    greedy's scores or None). input_ids: (1, prompt_len). `pins`: per draft name, hf_specdec's
    costs from the cost table, so that its decisions depend on the table, not on the clock."""
    kwargs = dict(max_new_tokens=max_new_tokens, **mode_kwargs)
    rounds = []
    if method == "plain" and not mode_kwargs.get("do_sample"):
        kwargs.update(return_dict_in_generate=True, output_scores=True)  # to explain any greedy mismatch
    if method == "assisted":
        kwargs["assistant_model"] = drafts["bf16"]  # transformers' own method, with the draft as loaded
    elif method == "assisted_quantized":
        kwargs["assistant_model"] = drafts["hf"]  # transformers' method with hf_specdec's (quantized) draft
    elif method == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = 10
    elif method in HF_METHODS:
        kwargs.update(custom_generate=hf_specdec.speculative_generate, return_dict_in_generate=True,
                      acceptance_sink=rounds.append)
        if num_draft_tokens is not None:
            kwargs["num_draft_tokens"] = num_draft_tokens
        ablation = dict(ABLATIONS.get(method, SECOND_DRAFT.get(method, {})))
        draft = ablation.pop("draft", "hf")
        kwargs.update(assistant=drafts[draft], **pins[draft])
        kwargs.update(ablation)  # an ablation's settings win over the pinned costs
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    seconds = time.perf_counter() - start
    if method in HF_METHODS:
        return out.sequences, seconds, out.acceptance, rounds, None
    if "output_scores" in kwargs:
        return out.sequences, seconds, None, rounds, [s[0] for s in out.scores]
    return out, seconds, None, rounds, None


def evaluate_prompt(config: EvalConfig, prompt: dict, index: int, target, drafts, timers, max_new_tokens: int,
                    table: CostTable) -> list[dict]:
    """Every mode and method of `config` on one prompt, plain first: one record each."""
    input_ids = torch.tensor([prompt["input_ids"]], device=target.device)
    records = []
    for mode in config.modes:
        window = hf_specdec.SpeculativeConfig().window_for(bool(MODES[mode].get("do_sample")))  # the default's
        pins = {name: table.pinned_costs(input_ids.shape[1], name, window, mode) for name in drafts}
        plain = None  # (record, sequences, scores) of plain decoding in this mode
        for method in config.methods:
            for timer in timers.values():
                timer.take()
            base = dict(id=prompt["id"], category=prompt["category"], mode=mode, method=method)
            try:
                seqs, seconds, stats, rounds, scores = run_method(
                    method, target, drafts, input_ids, MODES[mode], max_new_tokens, config.num_draft_tokens, index, pins
                )
            except (ValueError, NotImplementedError) as err:  # e.g. a method that does not support sampling
                records.append(dict(base, error=str(err).splitlines()[0]))
                continue
            taken = {name: timer.take_with_work() for name, timer in timers.items()}
            draft_d = [d for name, (durations, _) in taken.items() if name != "target" for d in durations]
            record = dict(base, **_measurements(input_ids, seqs, seconds, taken["target"][0], draft_d))
            record["work"] = with_scored({name: work for name, (_, work) in taken.items() if work}, rounds or [])
            record["modelled_seconds"] = table.modelled_seconds(record["work"], mode, _engine(method))
            if method == "plain":
                plain = (record, seqs, scores)
            else:
                record.update(_against_plain(record, seqs, plain, mode))
                record.update(_acceptance(method, record, stats, rounds))
            records.append(record)
    return records


def _engine(method: str) -> str:
    """Whose processing and sampling a method pays per position (priced by the cost table)."""
    return "hf_specdec" if method in HF_METHODS else "transformers"


def _measurements(input_ids, seqs, seconds, target_d: list[float], draft_d: list[float]) -> dict:
    """input_ids: (1, prompt_len); seqs: (1, prompt_len + new); target_d, draft_d: forward durations."""
    new_tokens = seqs.shape[1] - input_ids.shape[1]
    return dict(
        prompt_tokens=input_ids.shape[1], new_tokens=new_tokens, seconds=seconds,
        target_forwards=len(target_d), draft_forwards=len(draft_d),
        target_step_s=step_time(target_d), draft_step_s=step_time(draft_d),
        target_prefill_s=target_d[0] if target_d else None, draft_prefill_s=draft_d[0] if draft_d else 0.0,
        forward_seconds=sum(target_d) + sum(draft_d),
        tokens_per_target_forward=new_tokens / max(1, len(target_d)),
        tokens=seqs[0, input_ids.shape[1] :].tolist(),
    )


def _against_plain(record: dict, seqs: torch.Tensor, plain: tuple[dict, torch.Tensor] | None, mode: str) -> dict:
    """Speedup, greedy identity, draft/target step cost and the cost model's prediction, each
    against plain decoding of the same prompt and mode (None where plain did not run first)."""
    if plain is None:
        return dict(speedup=None, cost_ratio=None, predicted_speedup=None)
    base, plain_seqs, plain_scores = plain
    out = dict(speedup=speedup_over_plain(record["new_tokens"], record["seconds"], base["new_tokens"], base["seconds"]))
    if mode == "greedy":
        out["matches_plain"] = bool(torch.equal(seqs, plain_seqs))
        prompt_len = record["prompt_tokens"]
        divergence = greedy_divergence(plain_seqs[0, prompt_len:], seqs[0, prompt_len:], plain_scores or [])
        if divergence is not None:  # where the outputs part, and how close plain's top two were there
            out["divergence"] = dict(position=divergence.position, margin=divergence.margin, top=divergence.top,
                                     margin_bf16_steps=divergence.margin_in_bf16_steps)
    draft_step, target_step = record["draft_step_s"], base["target_step_s"]
    out["cost_ratio"] = draft_step / target_step if draft_step and target_step else None
    out["predicted_speedup"] = _predicted_speedup(record, base)
    return out


def _acceptance(method, record, stats, rounds) -> dict:
    if method in HF_METHODS:
        return dict(
            ngram_rounds=stats.ngram_rounds, plain_rounds=stats.plain_rounds,
            loop_draft_seconds=stats.draft_seconds, loop_target_seconds=stats.target_seconds,
            drafted=stats.drafted, accepted=stats.accepted, rounds=stats.rounds,
            acceptance_rate=stats.acceptance_rate, token_acceptance=stats.token_acceptance,
            per_position_drafted=stats.drafted_per_position, per_position_reached=stats.reached_per_position,
            per_position_accepted=stats.accepted_per_position, round_log=round_log(rounds),
            **tree_counts(rounds),
        )
    if method in ("assisted", "assisted_quantized"):
        # Each target forward verifies one block and emits accepted + 1 tokens; each draft forward
        # proposes one token (approximate: transformers does not report what it drafted).
        counts = dict(drafted=record["draft_forwards"], accepted=max(0, record["new_tokens"] - record["target_forwards"]))
        return dict(counts, acceptance_rate=pooled_stats([counts]).acceptance_rate)
    return {}


def _predicted_speedup(record, plain) -> float | None:
    """Cost model: time = prefill + (forwards - 1) x median step, for the target and the draft, with
    the forward counts and step times measured in this run; plain decoding the same way, scaled to
    the method's number of tokens. Whatever the measured speedup falls short of this is time spent
    outside model forwards (sampling, processors, Python) or in steps dearer than the median."""
    if plain is None or not plain["target_step_s"] or not record["target_step_s"]:
        return None

    def model_time(forwards, step, prefill):
        return 0.0 if not forwards else (prefill if prefill is not None else step) + (forwards - 1) * (step or 0.0)

    spent = model_time(record["target_forwards"], record["target_step_s"], record.get("target_prefill_s"))
    spent += model_time(record["draft_forwards"], record["draft_step_s"], record.get("draft_prefill_s"))
    per_token = plain["target_step_s"]
    plain_time = (plain.get("target_prefill_s") or per_token) + (record["new_tokens"] - 1) * per_token
    return plain_time / spent


# ---------------------------------------------------------------- summary


def attach_speedups(records) -> None:
    """Each method record's speedup over plain on the same prompt and mode, recomputed here so that
    summaries rebuilt from older records use the same definition (`speedup_over_plain`)."""
    plain = {(r["id"], r["mode"]): r for r in records if r["method"] == "plain" and "error" not in r}
    for r in records:
        base = plain.get((r["id"], r["mode"]))
        if r["method"] != "plain" and "error" not in r and base is not None:
            r["speedup"] = speedup_over_plain(r["new_tokens"], r["seconds"], base["new_tokens"], base["seconds"])
            r["plain_seconds_same_tokens"] = base["seconds"] * r["new_tokens"] / base["new_tokens"]
            r["time_ratio"] = base["seconds"] / r["seconds"]  # Spec-Bench's speedup: plain wall time / method's
            if r.get("modelled_seconds") and base.get("modelled_seconds"):
                r["modelled_speedup"] = speedup_over_plain(
                    r["new_tokens"], r["modelled_seconds"], base["new_tokens"], base["modelled_seconds"])


def categories_of(records) -> list[str]:
    """The records' categories: the presets' in their order, then one's own in the order they came."""
    seen = list(dict.fromkeys(r["category"] for r in records))
    return [c for c in CATEGORIES if c in seen] + [c for c in seen if c not in CATEGORIES]


def summarise(records, metric) -> dict:
    attach_speedups(records)
    summary = {}
    for mode in MODES:
        for method in (m for m in ALL_METHODS if m != "plain"):  # plain is the baseline
            per_category = {}
            for category in categories_of(records):
                rows = [r for r in records if (r["mode"], r["method"], r["category"]) == (mode, method, category)]
                ok = [r for r in rows if "error" not in r and r.get("speedup") is not None]
                if ok:
                    per_category[category] = _category_entry(mode, method, ok, metric)
                elif rows:
                    per_category[category] = dict(prompts=len(rows), error=rows[0]["error"])
            if per_category:
                summary.setdefault(mode, {})[method] = _method_entry(records, mode, method, per_category)
    return summary


def _method_entry(records, mode: str, method: str, per_category: dict) -> dict:
    """Geometric means over categories of the per-category medians, wall and modelled, with bootstrap
    90% intervals (prompts resampled within categories)."""
    rows = [r for r in records if (r["mode"], r["method"]) == (mode, method) and r.get("speedup")]
    groups = [[r["speedup"] for r in rows if r["category"] == c] for c in per_category]
    modelled = [[r["modelled_speedup"] for r in rows if r["category"] == c and r.get("modelled_speedup")]
                for c in per_category]
    entry = dict(categories=per_category,
                 geomean_speedup=geometric_mean(v.get("median_speedup") for v in per_category.values()),
                 geomean_interval=geomean_of_medians_interval([g for g in groups if g]))
    if all(modelled) and all(v.get("median_modelled_speedup") for v in per_category.values()):
        entry.update(geomean_modelled_speedup=geometric_mean(v["median_modelled_speedup"] for v in per_category.values()),
                     geomean_modelled_interval=geomean_of_medians_interval(modelled))
    return entry


def _category_entry(mode: str, method: str, ok: list[dict], metric) -> dict:
    """One method's figures on one category and mode, from its successful records."""
    speedups = [r["speedup"] for r in ok]
    entry = dict(
        prompts=len(ok),
        median_speedup=statistics.median(speedups),
        speedup_interval=median_interval(speedups),
        # Spec-Bench's figures: mean accepted tokens per target forward ("#MAT"; emitted tokens per
        # verification, bonus included) and speedup as a wall-time ratio (plain time / method time).
        tokens_per_target_forward=sum(r["new_tokens"] for r in ok) / sum(r["target_forwards"] for r in ok),
        median_time_ratio=median_or_none(r.get("time_ratio") for r in ok),
        predicted_speedup=median_or_none(r["predicted_speedup"] for r in ok),
        cost_ratio=median_or_none(r["cost_ratio"] for r in ok),
    )
    modelled = [r["modelled_speedup"] for r in ok if r.get("modelled_speedup")]
    if len(modelled) == len(ok):
        entry.update(median_modelled_speedup=statistics.median(modelled), modelled_interval=median_interval(modelled))
        # Wall clock and the cost table disagree by more than 15%: noise, or work the table misses.
        entry["wall_vs_modelled_flag"] = abs(entry["median_speedup"] / entry["median_modelled_speedup"] - 1) > 0.15
    if "drafted" in ok[0]:
        entry["acceptance_rate"] = pooled_stats(ok).acceptance_rate
    if method in HF_METHODS:
        entry.update(_hf_entry(ok, metric))
    if mode == "greedy":
        entry["all_match_plain"] = all(r.get("matches_plain", False) for r in ok)
        steps = [r["divergence"]["margin_bf16_steps"] for r in ok if r.get("divergence")]
        # Every mismatch must be a bf16 near-tie (at most one bf16 step); a larger margin is a bug.
        entry["mismatches"] = sum(not r.get("matches_plain", False) for r in ok)
        entry["mismatches_beyond_one_bf16_step"] = sum(s is None or s > 1 for s in steps)
    return entry


def _hf_entry(ok: list[dict], metric) -> dict:
    """hf_specdec's own figures: rounds by kind, where the time went, per-token acceptance against
    the geometric law, and the `evaluate` metric over the logged rounds."""
    stats = pooled_stats(ok)
    k = max(1, round(stats.drafted / max(1, stats.rounds)))  # the law assumes a fixed k: the mean drafted
    entry = dict(
        ngram_rounds=sum(r.get("ngram_rounds", 0) for r in ok), plain_rounds=sum(r.get("plain_rounds", 0) for r in ok),
        rounds=sum(r["rounds"] for r in ok), token_acceptance=stats.token_acceptance,
        per_position_acceptance=stats.per_position_rate,
        geometric_tokens_per_round=geometric_tokens_per_round(stats.token_acceptance, k),
    )
    trees = sum(r.get("tree_rounds", 0) for r in ok)
    entry["trees"] = dict(
        rounds=trees,
        mean_nodes=sum(r.get("tree_nodes", 0) for r in ok) / trees if trees else None,
        mean_path=sum(r.get("tree_path", 0) for r in ok) / trees if trees else None,
        accepted_from={k: sum(r.get("accepted_from", {}).get(k, 0) for r in ok) for k in ("draft", "ngram", "draft+ngram")},
    )
    if all("forward_seconds" in r and "loop_target_seconds" in r for r in ok):
        # Where the time goes: model forwards (hooks), processors/sampling/verification around them
        # (the loop's timers minus the forwards), everything else.
        total = sum(r["seconds"] for r in ok)
        forwards = sum(r["forward_seconds"] for r in ok)
        loop = sum(r["loop_target_seconds"] + r["loop_draft_seconds"] for r in ok)
        entry["time_split"] = dict(forwards=forwards / total, processing=(loop - forwards) / total, other=(total - loop) / total)
    log = [step for r in ok for step in r["round_log"]]
    entry["metric"] = metric.compute(
        drafted=[d for d, _, _ in log], accepted=[a for _, a, _ in log], emitted=[e for _, _, e in log],
        seconds=sum(r["seconds"] for r in ok), baseline_seconds=sum(r["plain_seconds_same_tokens"] for r in ok),
    )
    return entry


def markdown_table(summary) -> str:
    """Per mode, method and category: wall speedup (median over prompts, bootstrap 90% interval),
    modelled speedup (priced by the cost table; ! where the two differ by more than 15%), Spec-Bench's
    #MAT and wall-time ratio, acceptance, and greedy identity (mismatches, and those beyond one bf16 step)."""
    lines = []
    for mode, methods in summary.items():
        lines += [f"### {mode}", "",
                  "| method | category | speedup [90% CI] | modelled [90% CI] | #MAT | time ratio | acceptance | "
                  "token acceptance | geometric law | greedy mismatches (> 1 bf16 step) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for method, block in methods.items():
            for category, e in block["categories"].items():
                if "error" in e:
                    lines.append(f"| {method} | {_cell(category)} | n/a ({_cell(e['error'][:60])}) | | | | | | | |")
                    continue
                modelled = _ci(e.get("median_modelled_speedup"), e.get("modelled_interval"))
                flag = " !" if e.get("wall_vs_modelled_flag") else ""
                match = f"{e['mismatches']} ({e['mismatches_beyond_one_bf16_step']})" if "mismatches" in e else "-"
                lines.append(
                    f"| {method} | {_cell(category)} (n={e['prompts']}) | {_ci(e['median_speedup'], e.get('speedup_interval'))} | "
                    f"{modelled}{flag} | {e['tokens_per_target_forward']:.2f} | {_fmt(e.get('median_time_ratio'), 'x')} | "
                    f"{_fmt(e.get('acceptance_rate'))} | {_fmt(e.get('token_acceptance'))} | "
                    f"{_fmt(e.get('geometric_tokens_per_round'))} | {match} |"
                )
            if block["geomean_speedup"]:
                modelled = _ci(block.get("geomean_modelled_speedup"), block.get("geomean_modelled_interval"))
                lines.append(f"| {method} | **geomean** | **{_ci(block['geomean_speedup'], block.get('geomean_interval'))}** | "
                             f"{modelled} | | | | | | |")
        lines.append("")
    lines += _tree_table(summary)
    return "\n".join(lines)


def _tree_table(summary) -> list[str]:
    """hf_specdec's tree rounds per mode and category: how many, mean nodes verified, mean accepted
    path, and the accepted tokens by source."""
    lines = ["### trees of candidates (hf_specdec methods)", "",
             "| mode | method | category | tree rounds | mean nodes | mean accepted path | accepted from draft / ngram / both |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for mode, methods in summary.items():
        for method, block in methods.items():
            for category, e in block["categories"].items():
                trees = e.get("trees")
                if not trees:
                    continue
                got = trees["accepted_from"]
                lines.append(f"| {mode} | {method} | {_cell(category)} | {trees['rounds']} | {_fmt(trees['mean_nodes'])} | "
                             f"{_fmt(trees['mean_path'])} | {got['draft']} / {got['ngram']} / {got['draft+ngram']} |")
    return lines + [""]


def _cell(text: str) -> str:
    """Text as one markdown table cell (a category of one's own may hold | or a newline)."""
    return " ".join(str(text).replace("|", "\\|").split())


def _ci(value, interval) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


def _fmt(value, suffix=""):
    return "-" if value is None else f"{value:.2f}{suffix}"


# ---------------------------------------------------------------- plots


def plot(records, summary, out: Path) -> None:
    """speedup_by_category.png, acceptance_by_position.png and (when the fixed-length ablation ran)
    tokens_per_round_vs_geometric.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for draw in (_plot_speedup, _plot_acceptance_by_position, _plot_geometric_law):
        draw(plt, records, summary, out)


def _literal(text: str) -> str:
    """`text` drawn as it is: matplotlib reads the text between two $ as mathtext (a category of one's
    own such as "prices $5 vs $10" was drawn as math, "$\\frac{a$" stopped the plot)."""
    return str(text).replace("$", r"\$")


def _plot_speedup(plt, records, summary, out: Path) -> None:
    """Speedup by category, one panel per mode (none without a method beside plain)."""
    if not summary:
        return
    fig, axes = plt.subplots(1, len(summary), figsize=(7 * len(summary), 4), squeeze=False)
    categories = categories_of(records)
    for ax, (mode, methods) in zip(axes[0], summary.items()):
        width = 0.8 / max(1, len(methods))
        for j, (method, block) in enumerate(methods.items()):
            cells = [block["categories"].get(c, {}) for c in categories]
            values = [e.get("median_speedup") or 0 for e in cells]
            # Bootstrap 90% intervals of the median over prompts, where there are any.
            low = [v - (e.get("speedup_interval") or (v, v))[0] for v, e in zip(values, cells)]
            high = [(e.get("speedup_interval") or (v, v))[1] - v for v, e in zip(values, cells)]
            ax.bar([i + j * width for i in range(len(categories))], values, width, label=method,
                   yerr=[low, high], capsize=2, error_kw=dict(linewidth=0.8))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(categories))], [_literal(c) for c in categories],
                      rotation=30, ha="right")
        ax.set_ylabel("speedup over plain (median, 90% CI)")
        ax.set_title(mode)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup_by_category.png", dpi=120)
    plt.close(fig)


def _plot_acceptance_by_position(plt, records, summary, out: Path) -> None:
    """hf_specdec's accepted / reached by draft position, per category, one panel per mode."""
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(MODES), figsize=(12, 4), squeeze=False)
    for ax, mode in zip(axes[0], MODES):
        for category in categories_of(records):
            rows = [r for r in records if (r["mode"], r["method"], r["category"]) == (mode, "hf_specdec", category)]
            rows = [r for r in rows if "error" not in r]
            if rows:
                rates = pooled_stats(rows).per_position_rate
                ax.plot(range(1, len(rates) + 1), rates, marker="o", label=_literal(category))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted / reached")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"hf_specdec, {mode}")
        if ax.get_legend_handles_labels()[0]:  # a mode this run did not measure stays an empty panel
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=120)
    plt.close(fig)


def _plot_geometric_law(plt, records, summary, out: Path) -> None:
    """Measured tokens per round against the geometric law (`geometric_tokens_per_round`), a = the
    per-token acceptance accepted / reached. The law assumes a fixed k, so it is drawn for the
    fixed-length ablation (k = 5, model drafts only), when that ran."""
    fixed = "hf_k5_model_only"
    rows = [r for r in records if r["method"] == fixed and "error" not in r]
    if not rows:
        return
    k = ABLATIONS[fixed]["num_draft_tokens"]
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    curve_a = [i / 100 for i in range(100)]
    ax.plot(curve_a, [geometric_tokens_per_round(a, k) for a in curve_a], color="black", label=f"(1-a^(k+1))/(1-a), k={k}")
    for mode, marker in zip(MODES, "os"):
        per_prompt = [pooled_stats([r]) for r in rows if r["mode"] == mode]
        ax.scatter([s.token_acceptance for s in per_prompt], [s.mean_tokens_per_round for s in per_prompt],
                   marker=marker, label=mode, alpha=0.7)
    ax.set_xlabel("per-token acceptance a = accepted / reached (per prompt)")
    ax.set_ylabel(f"tokens per round (measured, {fixed})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tokens_per_round_vs_geometric.png", dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- main


def load_second_draft(name: str, target, tokenizer):
    """(draft, its tokenizer) for `--second-draft`, checked against the target's vocabulary ("tiny": a
    second copy of the tiny offline draft)."""
    if name == "tiny":
        from tiny import tiny_pair

        _, draft, draft_tokenizer = tiny_pair()
        return draft.to(target.device), draft_tokenizer
    draft, draft_tokenizer = load_model(name, device=target.device)
    check_same_vocabulary(tokenizer, draft_tokenizer, target, draft)
    return draft, draft_tokenizer


def _shape(model) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter and buffer names and shapes: two drafts of the same shape cost the same per forward."""
    return [(name, tuple(t.shape)) for name, t in [*model.named_parameters(), *model.named_buffers()]]


PARTIAL = "records.partial.rank{rank}.jsonl"  # per process, while the run goes on


def main(config: EvalConfig) -> dict | None:
    """Run the comparison of `config` (prompts split over accelerate's processes) and, on the main
    process, write records, summary, table and plots; returns the summary there, None elsewhere.
    Exits non-zero, after writing them, where every call of a method failed (its cells all "n/a")."""
    import transformers
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    check_config(config)
    metric = load_metric()  # both before any model loads: neither fails after the work
    out = output_folder(config.out)
    if config.threads:
        torch.set_num_threads(config.threads)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    target, drafts, prompts = _load(config, accelerator.device)
    vocab = target.get_output_embeddings().weight.shape[0]
    modes = {m: MODES[m] for m in config.modes}
    table = _start_table(config, accelerator, target, drafts, vocab, modes)
    timers = _timers(target, drafts)
    # Warm up every method once on the first prompt (first calls pay one-off allocation costs); a
    # method that fails there in every mode (a setting no call accepts) is refused now, not after the run.
    refuse_failed(evaluate_prompt(config, prompts[0], 0, target, drafts, timers, 8, table), "on the warm-up prompt")
    partial = out / PARTIAL.format(rank=accelerator.process_index)
    records = gather_object(_run_prompts(config, accelerator, prompts, (target, drafts, timers, table), partial))
    # The last collective: leave the process group now, on every rank (a rank that exits with gloo's
    # threads still running can die with "terminate called without an active exception").
    accelerator.end_training()
    if not accelerator.is_main_process:
        partial.unlink()
        return None
    end_table = measure(target, drafts, vocab, modes)  # drift of the machine over the run
    summary = summarise(records, metric)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()}
    settings.update(processes=accelerator.num_processes, torch_threads=torch.get_num_threads(),
                    torch=torch.__version__, transformers=transformers.__version__, cost_table_drift=table.drift(end_table),
                    prompts=len(prompts))
    table.save(out / "cost_table.json")
    end_table.save(out / "cost_table_end.json")
    with open(out / "records.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    partial.unlink()
    source = config.prompts_file.name if config.prompts_file is not None else config.preset
    write_summary(out, records, summary, settings, f"{source}, {len(prompts)} prompts, {config.max_new_tokens} new tokens")
    print(f"wrote {out}/records.jsonl, summary.json, summary.md and plots")
    refuse_failed(records, "on every prompt")
    return summary


def output_folder(path) -> Path:
    """`path` made as a folder (--out), or a one-line exit saying why it cannot be written to."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SystemExit(f"--out {out}: cannot create the folder ({err.strerror or err})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise SystemExit(f"--out {out}: the folder is not writable")
    return out


def load_metric():
    """The `evaluate` metric by path (`METRIC`), or a one-line exit naming why it does not load."""
    import evaluate

    try:
        return evaluate.load(str(METRIC))
    except Exception as err:  # evaluate's module cache unwritable, the metric's folder missing
        first = str(err).splitlines()[0] if str(err) else ""
        raise SystemExit(f"the evaluate metric {METRIC} does not load: {type(err).__name__}: {first}") from None


def refuse_failed(records, where: str) -> None:
    """Exits naming each method none of whose `records` succeeded (its every cell would be "n/a")."""
    succeeded = {r["method"] for r in records if "error" not in r}
    failed = {}
    for r in records:
        if r["method"] not in succeeded:
            failed.setdefault(r["method"], r["error"])
    if failed:
        raise SystemExit("; ".join(f"every {method} call failed {where}: {error}" for method, error in failed.items()))


def _load(config: EvalConfig, device):
    """(target, drafts by name as `drafts_by_precision` gives them, with "second" for --second-draft,
    prompts) of `config`."""
    target, draft, tokenizer = load_pair(config.target, config.draft, device, config.device_map, config.pack,
                                         config.draft_bits)
    drafts = drafts_by_precision(draft, config.draft_bits)
    if config.second_draft is not None:
        second, _ = load_second_draft(config.second_draft, target, tokenizer)
        drafts["second"] = drafts_by_precision(second, config.draft_bits)["hf"]
    if config.prompts_file is not None:
        prompts = load_prompt_file(tokenizer, config.prompts_file, config.categories, config.prompts_per_category)
    else:
        prompts = load_prompts(tokenizer, config.categories, config.prompts_per_category, config.split)
    if not prompts:
        raise SystemExit(f"no prompts in split {config.split!r} for {list(config.categories)}")
    return target, drafts, prompts


def _start_table(config: EvalConfig, accelerator, target, drafts, vocab: int, modes: dict) -> CostTable:
    """The cost table that prices every record's work: --cost-table's, else measured now (and again
    at the end), on the main process, which every process then prices its records with."""
    from accelerate.utils import broadcast_object_list

    table = None
    if accelerator.is_main_process:
        table = CostTable.load(config.cost_table) if config.cost_table else measure(target, drafts, vocab, modes)
        if "second" in drafts and "second" not in table.forwards:
            # A saved table from a run without it: priced as the first draft, which is right only for a
            # draft of the same shape (a distilled copy); any other needs a table measured with it.
            if _shape(drafts["second"]) != _shape(drafts["hf"]):
                raise SystemExit(f"{config.cost_table} has no price for --second-draft {config.second_draft}, which is not "
                                 "the first draft's shape; run without --cost-table to measure one")
            table.alias("second", "hf")
    return broadcast_object_list([table])[0]


def _timers(target, drafts: dict) -> dict:
    """One timer per model: the target and each distinct draft, named as in `drafts` (priced by name)."""
    timers = {"target": ForwardTimer(target)}
    for name, model in drafts.items():
        if all(model is not drafts[other] for other in timers if other != "target"):
            timers[name] = ForwardTimer(model)
    return timers


def _run_prompts(config: EvalConfig, accelerator, prompts, models: tuple, partial: Path) -> list[dict]:
    """This process's share of `prompts`, every mode and method; `models`: (target, drafts, timers, cost
    table). Each prompt's records are appended to `partial` as they finish, so a long run that is
    stopped keeps what it measured (`--from-records` summarises a partial file); removed once merged."""
    from tqdm.auto import tqdm

    target, drafts, timers, table = models
    records = []
    with accelerator.split_between_processes(list(enumerate(prompts))) as local, open(partial, "w") as log:
        bar = tqdm(local, desc=f"rank {accelerator.process_index}", disable=not accelerator.is_local_main_process)
        for index, prompt in bar:
            new = evaluate_prompt(config, prompt, index, target, drafts, timers, config.max_new_tokens, table)
            log.writelines(json.dumps(r) + "\n" for r in new)
            log.flush()
            records += new
            spec = [r for r in records if r["method"] == "hf_specdec" and r.get("speedup")]
            if spec:
                bar.set_postfix(hf_specdec=f"{statistics.median(r['speedup'] for r in spec):.2f}x")
    return records


def write_summary(out: Path, records, summary, settings: dict, title: str) -> None:
    """summary.json (strict JSON: a NaN or infinite figure as null), summary.md and the plots; prints
    the table."""
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(finite(dict(config=settings, summary=summary)), indent=2, allow_nan=False)
    (out / "summary.json").write_text(text)
    table = markdown_table(summary)
    (out / "summary.md").write_text(f"# Evaluation ({title})\n\n{table}\n")
    plot(records, summary, out)
    print(table)


def finite(value):
    """`value` with every NaN or infinite float in it as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def replot(records_path: Path, out: Path | None = None) -> dict:
    """Summary, table and plots again from a records.jsonl (no generation), written beside it unless
    `out` is given, with the run's settings from the summary.json beside the records where there is one."""
    records = read_records(records_path)
    if not records:
        raise SystemExit(f"--from-records {records_path}: no records to summarise (a run stopped during its first "
                         "prompt leaves none)")
    if all(r["method"] == "plain" for r in records):
        raise SystemExit(f"--from-records {records_path}: only plain decoding's records, no method to compare with it: "
                         "nothing to summarise")
    metric = load_metric()
    out = output_folder(records_path.parent if out is None else out)
    summary = summarise(records, metric)
    settings = dict(_run_settings(records_path.parent), from_records=str(records_path))
    write_summary(out, records, summary, settings, f"from {records_path}")
    return summary


def read_records(path: Path, flag: str = "--from-records") -> list[dict]:
    """The records of a records.jsonl. Blank lines are skipped, and so is a last line cut short (a
    process killed while writing it), with a warning; any other line that is not a record is named
    (after `flag`, the option that gave the file)."""
    lines = path.read_bytes().decode(errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            if i == last:
                print(f"warning: {path}:{i + 1}: skipped the last line, cut short ({err})", file=sys.stderr)
                continue
            raise SystemExit(f"{flag} {path}:{i + 1}: not a JSON record ({err})") from None
        if not isinstance(record, dict) or not {"id", "category", "mode", "method"} <= set(record):
            raise SystemExit(f"{flag} {path}:{i + 1}: not a record of run_eval.py (it needs id, category, mode "
                             "and method)")
        records.append(record)
    return records


def _run_settings(folder: Path) -> dict:
    """The settings in the summary.json of `folder` ({} where there is none, or it does not read)."""
    try:
        settings = json.loads((folder / "summary.json").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return settings if isinstance(settings, dict) else {}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, "target", "draft")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--categories", nargs="+", default=None, metavar="CATEGORY",
                        help=f"of {', '.join(CATEGORIES)} (default: all), or of the --prompts file's")
    parser.add_argument("--prompts", type=existing_path, default=None, metavar="FILE",
                        help="one's own prompts instead of the presets' sets: a .jsonl, .json, .csv or .parquet file "
                             "(read with datasets; a prompt/text/question/instruction column, optional category and id) "
                             "or a .txt file of one prompt a line; all of them unless --prompts-per-category")
    parser.add_argument("--modes", nargs="+", default=list(MODES), metavar="MODE")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), metavar="METHOD")
    add_options(parser, "out")  # default: DEFAULT_OUT, or with --from-records the records' folder
    parser.add_argument("--num-draft-tokens", type=draft_length, default=None, help="override hf_specdec's default (max) draft length")
    parser.add_argument("--second-draft", default=None,
                        help="another draft (folder or registry name) for the method hf_second_draft, e.g. a distilled one")
    add_options(parser, "draft_bits")  # assisted uses the draft as loaded
    parser.add_argument("--ablation", action="store_true", help=f"also run hf_specdec with levers off: {', '.join(ABLATIONS)}")
    parser.add_argument("--prompts-per-category", type=positive_int, default=None, help="override the preset")
    parser.add_argument("--max-new-tokens", type=positive_int, default=None, help="override the preset")
    add_options(parser, "pack")
    parser.add_argument("--device-map", default=None, help="e.g. 'auto' for a target too large for one device")
    add_options(parser, "threads")  # per process
    parser.add_argument("--from-records", type=existing_path, default=None,
                        help="only rebuild summary and plots from a records.jsonl (or a stopped run's records.partial.rank0.jsonl), "
                             "written beside it unless --out")
    parser.add_argument("--split", choices=SPLITS, default=None,
                        help="prompts with odd ids (report, the default), even ids (tuning: tune defaults here) or all")
    add_options(parser, "cost_table")  # instead of measuring one: hf_specdec's decisions then repeat exactly
    return parser.parse_args(argv)


def cli(argv=None) -> dict | None:
    """The script: a run, or with --from-records a summary rebuilt from records."""
    args = parse_args(argv)
    if args.from_records:
        return replot(Path(args.from_records), Path(args.out) if args.out else None)
    return main(config_from_args(args))


if __name__ == "__main__":
    cli()
