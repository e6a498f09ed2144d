"""Side-by-side evaluation: plain decoding, transformers' assisted generation, transformers' prompt
lookup decoding and hf_specdec, on Spec-Bench (six tasks) and HumanEval, greedy and sampling.

    python evals/run_eval.py --preset quick                      # real pair, ~20 min on 2 CPU cores
    accelerate launch --multi_gpu --num_processes 2 evals/run_eval.py ...   # prompts split across
                                                                  # processes (CPU-only: torchrun + gloo)
    python evals/run_eval.py --target tiny --draft tiny --preset quick --out runs/tiny   # offline check

For every prompt, in one process, the methods run interleaved (plain first, then the others) with
the same max_new_tokens; speedup = method tokens/s over plain tokens/s for that prompt (under
sampling the two samples may differ in length, so a time ratio alone would mislead; under greedy
the outputs match and the two definitions agree), and each category reports the median. Writes <out>/records.jsonl (one line per prompt, mode and method),
<out>/summary.json, <out>/summary.md and PNG plots.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # evals/ is a folder of scripts, not a package

import hf_specdec  # noqa: E402
from hf_specdec.pair import DRAFT, TARGET, check_same_vocabulary, load_model  # noqa: E402

SPEC_BENCH = HERE / "data" / "spec_bench" / "question.jsonl"
HUMANEVAL = HERE / "data" / "humaneval" / "HumanEval.jsonl"
METRIC = HERE / "metrics" / "speculative_acceptance"
# Spec-Bench's evaluation groups MT-bench's eight categories as one task, "mt_bench".
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "humaneval")
METHODS = ("plain", "assisted", "prompt_lookup", "hf_specdec")
# hf_specdec with one lever (or all) switched off, for the ablation table (`--ablation`). hf_specdec
# itself runs the library defaults (adaptive draft length, hybrid n-gram drafts) with the draft
# quantized to int8 weights (`--draft-bits`, lever 3); "bf16" rows use the unquantized draft.
ABLATIONS = {
    "hf_k5_model_only": dict(adaptive=False, ngram=False, num_draft_tokens=5, draft="bf16"),  # all levers off
    "hf_bf16_draft": dict(draft="bf16"),
    "hf_no_adaptive": dict(adaptive=False, num_draft_tokens=5),
    "hf_no_ngram": dict(ngram=False),
    "hf_bf16_vocab32k": dict(draft_vocab_size=32768, draft="bf16"),
}
HF_METHODS = ("hf_specdec", *ABLATIONS)
# Not in the defaults: transformers' assisted generation given the same quantized draft as hf_specdec.
EXTRA_METHODS = ("assisted_quantized",)
MODES = {"greedy": dict(do_sample=False), "sampling": dict(do_sample=True, temperature=0.7, top_p=0.95)}


@dataclass(frozen=True)
class Preset:
    prompts_per_category: int | None  # None: every prompt
    max_new_tokens: int


PRESETS = {
    "quick": Preset(prompts_per_category=1, max_new_tokens=64),  # 7 prompts, ~13 min on 2 cores (real pair)
    "standard": Preset(prompts_per_category=3, max_new_tokens=64),  # 21 prompts, ~40 min
    "full": Preset(prompts_per_category=None, max_new_tokens=128),  # all 644 prompts
}


# ---------------------------------------------------------------- prompts


def load_prompts(tokenizer, categories, per_category: int | None) -> list[dict]:
    """Chat-formatted prompts, `per_category` of each category, evenly spaced through the file."""
    from datasets import load_dataset

    unknown = set(categories) - set(CATEGORIES)
    if unknown:
        raise SystemExit(f"unknown category {sorted(unknown)}; choose from {', '.join(CATEGORIES)}")
    spec_bench = load_dataset("json", data_files=str(SPEC_BENCH), split="train")
    humaneval = load_dataset("json", data_files=str(HUMANEVAL), split="train")
    pools = {c: [] for c in categories}
    for row in spec_bench:
        category = "mt_bench" if row["category"] in MT_BENCH else row["category"]
        if category in pools:
            pools[category].append((str(row["question_id"]), row["turns"][0]))
    if "humaneval" in pools:
        for row in humaneval:
            text = f"Complete the following Python function.\n\n```python\n{row['prompt']}```"
            pools["humaneval"].append((row["task_id"], text))
    prompts = []
    for category in categories:
        pool = pools[category]
        n = len(pool) if per_category is None else min(per_category, len(pool))
        for i in range(n):
            prompt_id, text = pool[(i * len(pool)) // n]
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            prompts.append(dict(id=prompt_id, category=category, input_ids=ids[0].tolist()))
    return prompts


# ---------------------------------------------------------------- timing


class ForwardTimer:
    """Counts and times every forward of a model (public nn.Module hooks; nothing patched)."""

    def __init__(self, *models: torch.nn.Module):
        self.durations: list[float] = []
        self._start = 0.0
        for model in dict.fromkeys(models):  # the same model once
            model.register_forward_pre_hook(self._pre)
            model.register_forward_hook(self._post)

    def _pre(self, module, args):
        self._start = time.perf_counter()

    def _post(self, module, args, output):
        self.durations.append(time.perf_counter() - self._start)

    def take(self) -> list[float]:
        out, self.durations = self.durations, []
        return out


def step_time(durations: list[float]) -> float | None:
    """Median forward time excluding the first (the prefill)."""
    return statistics.median(durations[1:]) if len(durations) > 1 else None


def run_method(method, target, draft, input_ids, mode_kwargs, max_new_tokens, num_draft_tokens, seed):
    """One generate call: (sequences, seconds, hf_specdec stats or None, per-round records)."""
    kwargs = dict(max_new_tokens=max_new_tokens, **mode_kwargs)
    rounds = []
    if method == "assisted":
        kwargs["assistant_model"] = draft["bf16"]  # transformers' own method, with the draft as loaded
    elif method == "assisted_quantized":
        kwargs["assistant_model"] = draft["hf"]  # transformers' method with hf_specdec's (quantized) draft
    elif method == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = 10
    elif method in HF_METHODS:
        kwargs.update(
            custom_generate=hf_specdec.speculative_generate, assistant=draft, return_dict_in_generate=True,
            acceptance_sink=rounds.append,
        )
        if num_draft_tokens is not None:
            kwargs["num_draft_tokens"] = num_draft_tokens
        kwargs.update(ABLATIONS.get(method, {}))
        kwargs["assistant"] = draft[kwargs.pop("draft", "hf")]
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    seconds = time.perf_counter() - start
    if method in HF_METHODS:
        return out.sequences, seconds, out.acceptance, rounds
    return out, seconds, None, rounds


def evaluate_prompt(prompt, target, draft, timers, modes, methods, max_new_tokens, num_draft_tokens, index):
    device = target.device
    input_ids = torch.tensor([prompt["input_ids"]], device=device)
    records = []
    for mode in modes:
        plain_out, plain_rate, plain_target_steps, plain_record = None, None, None, None
        for method in methods:
            timers["target"].take(), timers["draft"].take()
            try:
                seqs, seconds, stats, rounds = run_method(
                    method, target, draft, input_ids, MODES[mode], max_new_tokens, num_draft_tokens, seed=index
                )
            except (ValueError, NotImplementedError) as err:  # e.g. a method that does not support sampling
                records.append(dict(id=prompt["id"], category=prompt["category"], mode=mode, method=method,
                                    error=str(err).splitlines()[0]))
                continue
            target_d, draft_d = timers["target"].take(), timers["draft"].take()
            new_tokens = seqs.shape[1] - input_ids.shape[1]
            record = dict(
                id=prompt["id"], category=prompt["category"], mode=mode, method=method,
                prompt_tokens=input_ids.shape[1], new_tokens=new_tokens, seconds=seconds,
                target_forwards=len(target_d), draft_forwards=len(draft_d),
                target_step_s=step_time(target_d), draft_step_s=step_time(draft_d),
                target_prefill_s=target_d[0] if target_d else None, draft_prefill_s=draft_d[0] if draft_d else 0.0,
                forward_seconds=sum(target_d) + sum(draft_d),
                tokens_per_target_forward=new_tokens / max(1, len(target_d)),
                tokens=seqs[0, input_ids.shape[1] :].tolist(),
            )
            if method == "plain":
                plain_out, plain_rate, plain_target_steps = seqs, new_tokens / seconds, record["target_step_s"]
                plain_record = record
            else:
                record["speedup"] = (new_tokens / seconds) / plain_rate if plain_rate else None
                if mode == "greedy" and plain_out is not None:
                    record["matches_plain"] = bool(torch.equal(seqs, plain_out))
                record.update(_acceptance(method, record, stats, rounds))
                record["cost_ratio"] = (
                    record["draft_step_s"] / plain_target_steps if record["draft_step_s"] and plain_target_steps else None
                )
                record["predicted_speedup"] = _predicted_speedup(record, plain_record)
            records.append(record)
    return records


def _acceptance(method, record, stats, rounds) -> dict:
    if method in HF_METHODS:
        return dict(
            ngram_rounds=stats.ngram_rounds, plain_rounds=stats.plain_rounds,
            loop_draft_seconds=stats.draft_seconds, loop_target_seconds=stats.target_seconds,
            drafted=stats.drafted, accepted=stats.accepted, rounds=stats.rounds,
            acceptance_rate=stats.acceptance_rate, token_acceptance=stats.token_acceptance,
            per_position_drafted=stats.drafted_per_position, per_position_reached=stats.reached_per_position,
            per_position_accepted=stats.accepted_per_position,
            round_log=[(len(r.draft_tokens), r.num_accepted, len(r.emitted_tokens)) for r in rounds],
        )
    if method in ("assisted", "assisted_quantized"):
        # Each target forward verifies one block and emits accepted + 1 tokens; each draft forward
        # proposes one token (approximate: transformers does not report what it drafted).
        accepted = record["new_tokens"] - record["target_forwards"]
        drafted = max(1, record["draft_forwards"])
        return dict(drafted=drafted, accepted=accepted, acceptance_rate=max(0, accepted) / drafted)
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


def _round_stats(rows) -> hf_specdec.AcceptanceStats:
    """AcceptanceStats rebuilt from the logged rounds of hf_specdec records."""
    stats = hf_specdec.AcceptanceStats()
    for r in rows:
        for drafted, accepted, emitted in r["round_log"]:
            stats.rounds += 1
            stats.record(drafted, accepted, emitted)
    return stats


def geometric_mean(values):
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _per_token_speedups(records) -> None:
    """speedup = (method tokens / s) / (plain tokens / s) on the same prompt and mode; recomputed
    here so that summaries rebuilt from older records use the same definition."""
    plain = {(r["id"], r["mode"]): r for r in records if r["method"] == "plain" and "error" not in r}
    for r in records:
        base = plain.get((r["id"], r["mode"]))
        if r["method"] != "plain" and "error" not in r and base is not None:
            r["speedup"] = (r["new_tokens"] / r["seconds"]) / (base["new_tokens"] / base["seconds"])
            r["plain_seconds_same_tokens"] = base["seconds"] * r["new_tokens"] / base["new_tokens"]


def summarise(records, metric) -> dict:
    _per_token_speedups(records)
    summary = {}
    for mode in MODES:
        for method in METHODS + EXTRA_METHODS + tuple(ABLATIONS):
            if method == "plain":
                continue
            per_category = {}
            for category in CATEGORIES:
                rows = [r for r in records if (r["mode"], r["method"], r["category"]) == (mode, method, category)]
                if not rows:
                    continue
                ok = [r for r in rows if "error" not in r]
                if not ok:
                    per_category[category] = dict(prompts=len(rows), error=rows[0]["error"])
                    continue
                entry = dict(
                    prompts=len(ok),
                    median_speedup=statistics.median(r["speedup"] for r in ok),
                    tokens_per_target_forward=sum(r["new_tokens"] for r in ok) / sum(r["target_forwards"] for r in ok),
                    predicted_speedup=_median([r["predicted_speedup"] for r in ok]),
                    cost_ratio=_median([r["cost_ratio"] for r in ok]),
                )
                if "drafted" in ok[0]:
                    entry["acceptance_rate"] = sum(max(0, r["accepted"]) for r in ok) / max(1, sum(r["drafted"] for r in ok))
                if method in HF_METHODS:
                    entry["ngram_rounds"] = sum(r.get("ngram_rounds", 0) for r in ok)
                    entry["plain_rounds"] = sum(r.get("plain_rounds", 0) for r in ok)
                    entry["rounds"] = sum(r["rounds"] for r in ok)
                    if all("forward_seconds" in r and "loop_target_seconds" in r for r in ok):
                        # Where the time goes: model forwards (hooks), processors/sampling/verification
                        # around them (the loop's timers minus the forwards), everything else.
                        total = sum(r["seconds"] for r in ok)
                        forwards = sum(r["forward_seconds"] for r in ok)
                        loop = sum(r["loop_target_seconds"] + r["loop_draft_seconds"] for r in ok)
                        entry["time_split"] = dict(
                            forwards=forwards / total, processing=(loop - forwards) / total, other=(total - loop) / total
                        )
                    rounds = _round_stats(ok)
                    alpha, k = rounds.token_acceptance, max(1, round(rounds.drafted / max(1, rounds.rounds)))
                    entry["token_acceptance"] = alpha
                    entry["per_position_acceptance"] = rounds.per_position_rate
                    entry["geometric_tokens_per_round"] = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0
                if method in HF_METHODS:
                    log = [step for r in ok for step in r["round_log"]]
                    entry["metric"] = metric.compute(
                        drafted=[d for d, _, _ in log], accepted=[a for _, a, _ in log], emitted=[e for _, _, e in log],
                        seconds=sum(r["seconds"] for r in ok),
                        baseline_seconds=sum(r["plain_seconds_same_tokens"] for r in ok),
                    )
                if mode == "greedy":
                    entry["all_match_plain"] = all(r.get("matches_plain", False) for r in ok)
                per_category[category] = entry
            if per_category:
                summary.setdefault(mode, {})[method] = dict(
                    categories=per_category,
                    geomean_speedup=geometric_mean(v.get("median_speedup") for v in per_category.values()),
                )
    return summary


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def markdown_table(summary) -> str:
    lines = []
    for mode, methods in summary.items():
        lines += [f"### {mode}", "", "| method | category | speedup | acceptance | token acceptance | tokens/target fwd | geometric law | cost ratio | predicted | greedy match |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for method, block in methods.items():
            for category, e in block["categories"].items():
                if "error" in e:
                    lines.append(f"| {method} | {category} | n/a ({e['error'][:60]}) | | | | | | | |")
                    continue
                lines.append(
                    f"| {method} | {category} | {e['median_speedup']:.2f}x | {_fmt(e.get('acceptance_rate'))} | "
                    f"{_fmt(e.get('token_acceptance'))} | {e['tokens_per_target_forward']:.2f} | {_fmt(e.get('geometric_tokens_per_round'))} | "
                    f"{_fmt(e.get('cost_ratio'))} | {_fmt(e.get('predicted_speedup'), 'x')} | "
                    f"{'yes' if e.get('all_match_plain') else ('NO' if 'all_match_plain' in e else '-')} |"
                )
            if block["geomean_speedup"]:
                lines.append(f"| {method} | **geomean** | **{block['geomean_speedup']:.2f}x** | | | | | | | |")
        lines.append("")
    return "\n".join(lines)


def _fmt(value, suffix=""):
    return "-" if value is None else f"{value:.2f}{suffix}"


def plot(records, summary, out: Path, num_draft_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    # 1. Speedup by category, one panel per mode.
    fig, axes = plt.subplots(1, len(summary), figsize=(7 * len(summary), 4), squeeze=False)
    for ax, (mode, methods) in zip(axes[0], summary.items()):
        width = 0.8 / max(1, len(methods))
        for j, (method, block) in enumerate(methods.items()):
            values = [block["categories"].get(c, {}).get("median_speedup") or 0 for c in CATEGORIES]
            ax.bar([i + j * width for i in range(len(CATEGORIES))], values, width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(CATEGORIES))], CATEGORIES, rotation=30, ha="right")
        ax.set_ylabel("speedup over plain (median)")
        ax.set_title(mode)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup_by_category.png", dpi=120)
    plt.close(fig)

    # 2. hf_specdec acceptance by draft position, per category and mode.
    fig, axes = plt.subplots(1, len(MODES), figsize=(12, 4), squeeze=False)
    for ax, mode in zip(axes[0], MODES):
        for category in CATEGORIES:
            rows = [r for r in records if (r["mode"], r["method"], r["category"]) == (mode, "hf_specdec", category)]
            rows = [r for r in rows if "error" not in r]
            if not rows:
                continue
            stats = _round_stats(rows)
            k = len(stats.reached_per_position)
            ax.plot(range(1, k + 1), stats.per_position_rate, marker="o", label=category)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted / reached")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"hf_specdec, {mode}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=120)
    plt.close(fig)

    # 3. Measured tokens per round against the geometric law (1 - a^(k+1)) / (1 - a), where a is the
    #    per-token acceptance accepted / reached (not accepted / drafted, which is tied to tokens per
    #    round by an identity and would make the comparison circular). The law assumes a fixed k, so
    #    it is drawn for the fixed-length ablation (k = 5, model drafts only) when that ran.
    fixed = "hf_k5_model_only"
    rows = [r for r in records if r["method"] == fixed and "error" not in r]
    if not rows:
        return
    k = ABLATIONS[fixed]["num_draft_tokens"]
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    curve_a = [i / 100 for i in range(100)]
    ax.plot(curve_a, [(1 - a ** (k + 1)) / (1 - a) for a in curve_a], color="black", label=f"(1-a^(k+1))/(1-a), k={k}")
    for mode, marker in zip(MODES, "os"):
        per_prompt = [_round_stats([r]) for r in rows if r["mode"] == mode]
        ax.scatter([s.token_acceptance for s in per_prompt], [s.mean_tokens_per_round for s in per_prompt],
                   marker=marker, label=mode, alpha=0.7)
    ax.set_xlabel("per-token acceptance a = accepted / reached (per prompt)")
    ax.set_ylabel(f"tokens per round (measured, {fixed})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tokens_per_round_vs_geometric.png", dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- batched throughput

BATCH_CATEGORIES = ("mt_bench", "translation", "qa", "math_reasoning", "humaneval")  # short prompts


def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def batch_throughput(target, draft, tokenizer, prompts, batch_sizes, max_new_tokens, num_draft_tokens) -> list[dict]:
    """Greedy throughput (generated tokens / second) of plain batched decoding and hf_specdec at each
    batch size, over the same prompts, the two interleaved chunk by chunk."""
    from tqdm.auto import tqdm

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = []
    for size in batch_sizes:
        totals = {"plain": [0, 0.0], "hf_specdec": [0, 0.0]}
        match, acceptance = True, []
        chunks = [prompts[i : i + size] for i in range(0, len(prompts) - size + 1, size)]
        for chunk in tqdm(chunks, desc=f"batch {size}"):
            ids, mask = left_pad([p["input_ids"] for p in chunk], pad_id, target.device)
            outputs = {}
            for method in ("plain", "hf_specdec"):
                kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
                if method == "hf_specdec":
                    kwargs.update(custom_generate=hf_specdec.speculative_generate, assistant=draft,
                                  num_draft_tokens=num_draft_tokens, return_dict_in_generate=True)
                start = time.perf_counter()
                out = target.generate(ids, attention_mask=mask, **kwargs)
                seconds = time.perf_counter() - start
                seqs = out.sequences if method == "hf_specdec" else out
                if method == "hf_specdec":
                    acceptance.append(out.acceptance)
                # Generated tokens: up to and including each row's EOS (padding after it is not work).
                new = seqs[:, ids.shape[1] :]
                totals[method][0] += int(sum(_generated_length(row, tokenizer.eos_token_id, pad_id) for row in new))
                totals[method][1] += seconds
                outputs[method] = seqs
            match &= torch.equal(outputs["plain"], outputs["hf_specdec"])
        merged = acceptance[0]
        for stats in acceptance[1:]:
            merged = merged.merge(stats)
        plain_tps = totals["plain"][0] / totals["plain"][1]
        spec_tps = totals["hf_specdec"][0] / totals["hf_specdec"][1]
        rows.append(dict(batch_size=size, prompts=len(chunks) * size, plain_tokens_per_s=plain_tps,
                         hf_specdec_tokens_per_s=spec_tps, ratio=spec_tps / plain_tps,
                         acceptance_rate=merged.acceptance_rate, all_match_plain=bool(match)))
    return rows


def _generated_length(row: torch.Tensor, eos_id, pad_id) -> int:
    tokens = row.tolist()
    if eos_id is not None and eos_id in tokens:
        return tokens.index(eos_id) + 1
    while tokens and tokens[-1] == pad_id:
        tokens.pop()
    return len(tokens)


def batch_table(rows) -> str:
    lines = ["| batch size | prompts | plain tok/s | hf_specdec tok/s | hf_specdec / plain | acceptance | greedy match |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['batch_size']} | {r['prompts']} | {r['plain_tokens_per_s']:.2f} | {r['hf_specdec_tokens_per_s']:.2f} | "
                     f"{r['ratio']:.2f}x | {r['acceptance_rate']:.2f} | {'yes' if r['all_match_plain'] else 'NO'} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def load_pair(target_name, draft_name, device, device_map):
    if target_name == "tiny" or draft_name == "tiny":
        from tiny import tiny_pair

        target, draft, tokenizer = tiny_pair()
        return target.to(device), draft.to(device), tokenizer
    target, tokenizer = load_model(target_name, device=device, device_map=device_map)
    draft, draft_tokenizer = load_model(draft_name, device=target.device)
    check_same_vocabulary(tokenizer, draft_tokenizer, target, draft)
    return target, draft, tokenizer


def drafts_by_precision(draft, bits: int) -> dict:
    """{"bf16": the draft as loaded, "hf": the one hf_specdec uses (weight-only quantized to `bits`)}."""
    if bits == 16:
        return {"bf16": draft, "hf": draft}
    import copy

    from hf_specdec.quantize import quantize_weights

    return {"bf16": draft, "hf": quantize_weights(copy.deepcopy(draft), bits)}


def main(target, draft, preset, categories, modes, methods, out, num_draft_tokens, prompts_per_category,
         max_new_tokens, device_map, threads, batch_sizes=None, draft_bits=8):
    import evaluate
    from accelerate import Accelerator
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    if threads:
        torch.set_num_threads(threads)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    settings = PRESETS[preset]
    per_category = prompts_per_category if prompts_per_category is not None else settings.prompts_per_category
    max_new_tokens = max_new_tokens or settings.max_new_tokens
    known = METHODS + EXTRA_METHODS + tuple(ABLATIONS)
    if set(methods) - set(known) or "plain" not in methods:
        raise SystemExit(f"methods must include plain and come from {', '.join(known)}; got {methods}")
    bad = set(modes) - set(MODES)
    if bad:
        raise SystemExit(f"unknown mode {sorted(bad)}; choose from {', '.join(MODES)}")

    target_model, draft_model, tokenizer = load_pair(target, draft, accelerator.device, device_map)
    draft_model = drafts_by_precision(draft_model, draft_bits)
    if batch_sizes:
        return run_batch_study(target_model, draft_model["hf"], tokenizer, categories, per_category, batch_sizes,
                               max_new_tokens, num_draft_tokens, Path(out), dict(target=target, draft=draft, preset=preset))
    prompts = load_prompts(tokenizer, categories, per_category)
    timers = {"target": ForwardTimer(target_model), "draft": ForwardTimer(*draft_model.values())}
    # Warm up every method once on the first prompt (first calls pay one-off allocation costs).
    evaluate_prompt(prompts[0], target_model, draft_model, timers, modes, methods, 8, num_draft_tokens, 0)

    records = []
    with accelerator.split_between_processes(list(enumerate(prompts))) as local:
        bar = tqdm(local, desc=f"rank {accelerator.process_index}", disable=not accelerator.is_local_main_process)
        for index, prompt in bar:
            records += evaluate_prompt(
                prompt, target_model, draft_model, timers, modes, methods, max_new_tokens, num_draft_tokens, index
            )
            spec = [r for r in records if r["method"] == "hf_specdec" and "speedup" in r]
            if spec:
                bar.set_postfix(hf_specdec=f"{statistics.median(r['speedup'] for r in spec):.2f}x")
    records = gather_object(records)
    if not accelerator.is_main_process:
        return None

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    metric = evaluate.load(str(METRIC))
    summary = summarise(records, metric)
    config = dict(target=target, draft=draft, preset=preset, categories=list(categories), modes=list(modes),
                  methods=list(methods), num_draft_tokens=num_draft_tokens, draft_bits=draft_bits, prompts_per_category=per_category,
                  max_new_tokens=max_new_tokens, processes=accelerator.num_processes, torch_threads=torch.get_num_threads(),
                  torch=torch.__version__, transformers=__import__("transformers").__version__)
    with open(out / "records.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    (out / "summary.json").write_text(json.dumps(dict(config=config, summary=summary), indent=2))
    table = markdown_table(summary)
    (out / "summary.md").write_text(f"# Evaluation ({preset}, {len(prompts)} prompts, {max_new_tokens} new tokens)\n\n{table}\n")
    plot(records, summary, out, num_draft_tokens)
    print(table)
    print(f"wrote {out}/records.jsonl, summary.json, summary.md and plots")
    return summary


def replot(records_path: Path, out: Path, num_draft_tokens: int) -> dict:
    """Summary, table and plots again from a records.jsonl (no generation)."""
    import evaluate

    records = [json.loads(line) for line in records_path.read_text().splitlines()]
    summary = summarise(records, evaluate.load(str(METRIC)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(dict(config=dict(from_records=str(records_path)), summary=summary), indent=2))
    table = markdown_table(summary)
    (out / "summary.md").write_text(f"# Evaluation (from {records_path})\n\n{table}\n")
    plot(records, summary, out, num_draft_tokens)
    print(table)
    return summary


def run_batch_study(target, draft, tokenizer, categories, per_category, batch_sizes, max_new_tokens,
                    num_draft_tokens, out: Path, config: dict):
    categories = [c for c in categories if c in BATCH_CATEGORIES] or list(BATCH_CATEGORIES)
    per = max(per_category or 1, math.ceil(max(batch_sizes) / len(categories)))
    prompts = load_prompts(tokenizer, categories, per)
    # Round-robin over categories so every chunk mixes them; as many prompts as the largest batch.
    by_category = [[p for p in prompts if p["category"] == c] for c in categories]
    prompts = [p for group in itertools.zip_longest(*by_category) for p in group if p is not None][: max(batch_sizes)]
    target.generate(torch.tensor([prompts[0]["input_ids"]], device=target.device), max_new_tokens=4)  # warm-up
    rows = batch_throughput(target, draft, tokenizer, prompts, batch_sizes, max_new_tokens, num_draft_tokens)
    out.mkdir(parents=True, exist_ok=True)
    config.update(batch_sizes=list(batch_sizes), max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens,
                  categories=categories, torch_threads=torch.get_num_threads())
    (out / "batch_throughput.json").write_text(json.dumps(dict(config=config, rows=rows), indent=2))
    table = batch_table(rows)
    (out / "batch_throughput.md").write_text(f"# Batched greedy throughput ({len(prompts)} prompts, {max_new_tokens} new tokens)\n\n{table}\n")
    print(table)
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=TARGET.name, help="registry name, local folder, hub id, or 'tiny'")
    parser.add_argument("--draft", default=DRAFT.name, help="registry name, local folder, hub id, or 'tiny'")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--categories", nargs="+", default=list(CATEGORIES), metavar="CATEGORY")
    parser.add_argument("--modes", nargs="+", default=list(MODES), metavar="MODE")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), metavar="METHOD")
    parser.add_argument("--out", default="runs/eval")
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="override hf_specdec's default (max) draft length")
    parser.add_argument("--draft-bits", type=int, choices=(4, 8, 16), default=8,
                        help="weight-only quantization of hf_specdec's draft (16: none); assisted uses the draft as loaded")
    parser.add_argument("--ablation", action="store_true", help=f"also run hf_specdec with levers off: {', '.join(ABLATIONS)}")
    parser.add_argument("--prompts-per-category", type=int, default=None, help="override the preset")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="override the preset")
    parser.add_argument("--device-map", default=None, help="e.g. 'auto' for a target too large for one device")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    parser.add_argument("--from-records", default=None, help="only rebuild summary and plots from a records.jsonl")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="instead of the method comparison: greedy throughput of plain batched decoding and "
                             "hf_specdec at these batch sizes, on as many short prompts as the largest batch")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    if args.from_records:
        replot(Path(args.from_records), Path(args.out), args.num_draft_tokens)
        sys.exit(0)
    methods = args.methods + [m for m in ABLATIONS if args.ablation and m not in args.methods]
    main(args.target, args.draft, args.preset, args.categories, args.modes, methods, args.out,
         args.num_draft_tokens, args.prompts_per_category, args.max_new_tokens, args.device_map, args.threads,
         args.batch_sizes, args.draft_bits)
