"""How acceptance behaves on the real pair: four analyses, one command.

    python evals/analyses.py --preset quick --out runs/analyses     # ~20 min on 2 CPU cores
    python evals/analyses.py --target tiny --draft tiny --out runs/tiny-analyses   # offline, seconds

1. Geometric law. Greedy hf_specdec with a fixed draft length k = 1..8 (model drafts only, no
   adaptive length, no n-gram lookup): measured tokens per target forward against
   (1 - a^(k+1)) / (1 - a), a = the measured per-token acceptance (accepted / reached).
2. Acceptance by draft position. accepted / reached at positions 1..8 per category (the k = 8 runs).
3. Acceptance against temperature. Sampling with temperature only (no top-k/top-p), k = 4:
   a = accepted / reached for T in TEMPERATURES, against the exact per-position acceptance
   probability sum_t min(p(t), q(t)) = 1 - TV(p, q) that hf_specdec logs for every drafted position
   (averaged over reached positions). T = 0 is greedy, where the rule accepts iff the argmaxes agree.
4. Quantized drafts. The draft with bf16, int8 and int4 weights (`hf_specdec.quantize`: torch's CPU
   weight-only kernels), target fixed, greedy, k = 5: acceptance, draft step cost (draft forward /
   plain target forward, timed in the same run) and end-to-end speedup over plain decoding on the
   same prompt (plain and the three drafts interleaved per prompt).

Writes <out>/records.jsonl, <out>/summary.json, <out>/report.md and four PNGs.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_specdec  # noqa: E402
from common import (  # noqa: E402
    CATEGORIES, ForwardTimer, add_options, apply_threads, load_pair, load_prompts, median_or_none, pooled_stats,
    speedup_over_plain, step_time,
)
from hf_specdec.stats import geometric_tokens_per_round  # noqa: E402

KS = tuple(range(1, 9))
TEMPERATURES = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0)
QUANT = {"bf16": None, "int8": dict(bits=8), "int4 (g32)": dict(bits=4, group_size=32)}
PRESETS = {
    "quick": dict(per_category=1, max_new_tokens=48),
    "full": dict(per_category=5, max_new_tokens=64),
}


def spec_run(target, draft, ids, k, max_new_tokens, seed, **mode):
    rounds = []
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        custom_generate=hf_specdec.speculative_generate, assistant=draft, num_draft_tokens=k, adaptive=False,
        ngram=False, return_dict_in_generate=True, acceptance_sink=rounds.append, **mode,
    )
    seconds = time.perf_counter() - start
    stats = out.acceptance
    expected = [e for r in rounds if r.expected_acceptance for e in r.expected_acceptance[: min(r.num_accepted + 1, len(r.draft_tokens))]]
    return dict(
        seconds=seconds, new_tokens=out.sequences.shape[1] - ids.shape[1], rounds=stats.rounds,
        drafted=stats.drafted, accepted=stats.accepted, reached=sum(stats.reached_per_position),
        emitted=stats.emitted, reached_per_position=stats.reached_per_position,
        accepted_per_position=stats.accepted_per_position, expected_acceptance_sum=sum(expected),
        expected_acceptance_n=len(expected),
    )


def collect(target, drafts, prompts, max_new_tokens, parts, timers) -> list[dict]:
    from tqdm.auto import tqdm

    jobs = []
    for i, p in enumerate(prompts):
        if "law" in parts:
            jobs += [("law", i, p, k) for k in KS]
        if "temperature" in parts:
            jobs += [("temperature", i, p, t) for t in TEMPERATURES if t > 0]
        if "quant" in parts:
            jobs.append(("quant", i, p, None))
    records = []
    for part, i, p, x in tqdm(jobs, desc="analyses"):
        ids = torch.tensor([p["input_ids"]], device=target.device)
        base = dict(part=part, id=p["id"], category=p["category"])
        if part == "law":
            records.append({**base, "k": x, **spec_run(target, drafts["bf16"], ids, x, max_new_tokens, i, do_sample=False)})
        elif part == "temperature":
            mode = dict(do_sample=True, temperature=x, top_k=None, top_p=None)
            records.append({**base, "temperature": x, **spec_run(target, drafts["bf16"], ids, 4, max_new_tokens, i, **mode)})
        else:
            # plain and each draft precision, interleaved on this prompt; costs from forward timings
            timers["target"].take()
            start = time.perf_counter()
            plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
            plain_seconds = time.perf_counter() - start
            plain_step = step_time(timers["target"].take())
            plain_tokens = plain.shape[1] - ids.shape[1]
            for name, draft in drafts.items():
                timers[name].take()
                run = spec_run(target, draft, ids, 5, max_new_tokens, i, do_sample=False)
                draft_step = step_time(timers[name].take())
                records.append({**base, "draft": name, **run, "plain_step_s": plain_step, "draft_step_s": draft_step,
                                "cost_ratio": draft_step / plain_step if draft_step and plain_step else None,
                                "speedup": speedup_over_plain(run["new_tokens"], run["seconds"], plain_tokens, plain_seconds)})
    return records


# ---------------------------------------------------------------- summaries


def summarise(records) -> dict:
    """Every rate pooled over prompts through `pooled_stats` (hf_specdec.AcceptanceStats)."""
    summary = {}
    law = [r for r in records if r["part"] == "law"]
    if law:
        summary["geometric_law"] = _geometric_law(law)
        summary["acceptance_by_position"] = _acceptance_by_position(law)
    temp = [r for r in records if r["part"] == "temperature"]
    if temp or law:
        summary["temperature"] = _temperature(temp, law)
    quant = [r for r in records if r["part"] == "quant"]
    if quant:
        summary["quantized_drafts"] = _quantized_drafts(quant)
    return summary


def _law_row(rows, k: int) -> dict:
    """Measured tokens per target forward at draft length k against the geometric law at the
    measured per-token acceptance a = accepted / reached."""
    stats = pooled_stats(rows)
    a, measured = stats.token_acceptance, stats.mean_tokens_per_round
    law = geometric_tokens_per_round(a, k)
    return dict(k=k, token_acceptance=a, acceptance_rate=stats.acceptance_rate, measured_tokens_per_forward=measured,
                geometric=law, gap=measured - law)


def _geometric_law(law: list[dict]) -> dict:
    def rows_by_k(rs):
        return [_law_row([r for r in rs if r["k"] == k], k) for k in KS if any(r["k"] == k for r in rs)]

    rows = rows_by_k(law)
    per_category = {}
    for c in CATEGORIES:
        rs = [r for r in law if r["category"] == c]
        if rs:
            per_category[c] = dict(token_acceptance=pooled_stats(rs).token_acceptance,
                                   largest_gap=max(abs(row["gap"]) for row in rows_by_k(rs)))
    return dict(rows=rows, largest_gap=max(abs(r["gap"]) for r in rows), per_category=per_category)


def _acceptance_by_position(law: list[dict]) -> dict:
    """accepted / reached at each position of the deepest fixed-k runs, per category (None where a
    position was never reached)."""
    deepest = max(r["k"] for r in law)
    by_position = {}
    for c in CATEGORIES:
        rs = [r for r in law if r["category"] == c and r["k"] == deepest]
        if rs:
            stats = pooled_stats(rs)
            reached = (stats.reached_per_position + [0] * deepest)[:deepest]
            accepted = (stats.accepted_per_position + [0] * deepest)[:deepest]
            by_position[c] = dict(rate=[a / n if n else None for a, n in zip(accepted, reached)], reached=reached)
    return dict(k=deepest, categories=by_position)


def _temperature(temp: list[dict], law: list[dict]) -> list[dict]:
    """Measured a against the mean exact acceptance probability 1 - TV(p, q) the library logs."""
    rows = []
    greedy = [r for r in law if r["k"] == 4]
    if greedy:
        rows.append(dict(temperature=0.0, token_acceptance=pooled_stats(greedy).token_acceptance, one_minus_tv=None,
                         note="greedy, k=4 runs of part 1"))
    for t in TEMPERATURES:
        rs = [r for r in temp if r["temperature"] == t]
        if rs:
            n = sum(r["expected_acceptance_n"] for r in rs)
            rows.append(dict(temperature=t, token_acceptance=pooled_stats(rs).token_acceptance,
                             one_minus_tv=sum(r["expected_acceptance_sum"] for r in rs) / n if n else None))
    return rows


def _quantized_drafts(quant: list[dict]) -> list[dict]:
    rows = []
    for name in QUANT:
        rs = [r for r in quant if r["draft"] == name]
        if rs:
            stats = pooled_stats(rs)
            rows.append(dict(draft=name, acceptance_rate=stats.acceptance_rate, token_acceptance=stats.token_acceptance,
                             tokens_per_forward=stats.mean_tokens_per_round,
                             cost_ratio=median_or_none(r["cost_ratio"] for r in rs),
                             median_speedup=statistics.median(r["speedup"] for r in rs),
                             per_category_speedup={r["category"]: r["speedup"] for r in rs}))
    return rows


def report(summary, config) -> str:
    f = lambda v, s="": "-" if v is None else f"{v:.2f}{s}"  # noqa: E731
    lines = [f"# Acceptance analyses ({config['preset']}, {config['prompts']} prompts, {config['max_new_tokens']} new tokens)", ""]
    if "geometric_law" in summary:
        g = summary["geometric_law"]
        lines += ["## 1. Geometric law (greedy, fixed k, model drafts only)", "",
                  "| k | per-token acceptance a | accepted/drafted | measured tokens / target forward | (1-a^(k+1))/(1-a) | gap |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['k']} | {f(r['token_acceptance'])} | {f(r['acceptance_rate'])} | {f(r['measured_tokens_per_forward'])} | "
                  f"{f(r['geometric'])} | {r['gap']:+.2f} |" for r in g["rows"]]
        lines += ["", f"Largest gap (all prompts pooled): {g['largest_gap']:.2f} tokens. Per category, largest |gap| over k: "
                  + ", ".join(f"{c} {v['largest_gap']:.2f}" for c, v in g["per_category"].items()), ""]
        p = summary["acceptance_by_position"]
        lines += [f"## 2. Acceptance by draft position (accepted / reached, k = {p['k']}, greedy)", "",
                  "| category | " + " | ".join(str(i + 1) for i in range(p["k"])) + " |", "| --- |" + " --- |" * p["k"]]
        for c, v in p["categories"].items():
            lines.append(f"| {c} | " + " | ".join(f"{x:.2f} ({n})" if x is not None else "-" for x, n in zip(v["rate"], v["reached"])) + " |")
        lines += ["", "(in brackets: how many times the position was reached)", ""]
    if "temperature" in summary:
        lines += ["## 3. Acceptance against temperature (k = 4, temperature only)", "",
                  "| T | measured a (accepted / reached) | mean sum_t min(p, q) = 1 - TV |", "| --- | --- | --- |"]
        lines += [f"| {r['temperature']:g} | {f(r['token_acceptance'])} | {f(r['one_minus_tv'])} |" for r in summary["temperature"]]
        lines.append("")
    if "quantized_drafts" in summary:
        lines += ["## 4. Quantized drafts (greedy, k = 5, target bf16)", "",
                  "| draft weights | acceptance (accepted/drafted) | per-token acceptance | tokens / target forward | draft/target step cost | median speedup |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['draft']} | {f(r['acceptance_rate'])} | {f(r['token_acceptance'])} | {f(r['tokens_per_forward'])} | "
                  f"{f(r['cost_ratio'])} | {f(r['median_speedup'], 'x')} |" for r in summary["quantized_drafts"]]
        lines.append("")
    return "\n".join(lines)


def plot(summary, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "geometric_law" in summary:
        rows = summary["geometric_law"]["rows"]
        fig, ax = plt.subplots(figsize=(5.5, 4))
        ax.plot([r["k"] for r in rows], [r["measured_tokens_per_forward"] for r in rows], "o-", label="measured")
        ax.plot([r["k"] for r in rows], [r["geometric"] for r in rows], "s--", label="(1-a^(k+1))/(1-a), measured a")
        ax.set_xlabel("draft length k")
        ax.set_ylabel("tokens per target forward")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "geometric_law.png", dpi=120)
        plt.close(fig)
        p = summary["acceptance_by_position"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for c, v in p["categories"].items():
            xs = [i + 1 for i, x in enumerate(v["rate"]) if x is not None]
            ax.plot(xs, [x for x in v["rate"] if x is not None], "o-", label=c)
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted / reached")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "acceptance_by_position.png", dpi=120)
        plt.close(fig)
    if summary.get("temperature"):
        rows = summary["temperature"]
        fig, ax = plt.subplots(figsize=(5.5, 4))
        ax.plot([r["temperature"] for r in rows], [r["token_acceptance"] for r in rows], "o-", label="measured a")
        tv = [r for r in rows if r["one_minus_tv"] is not None]
        ax.plot([r["temperature"] for r in tv], [r["one_minus_tv"] for r in tv], "s--", label="mean sum min(p, q)")
        ax.set_xlabel("temperature (0 = greedy)")
        ax.set_ylabel("per-token acceptance")
        ax.set_ylim(0, 1.05)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "acceptance_vs_temperature.png", dpi=120)
        plt.close(fig)
    if "quantized_drafts" in summary:
        rows = summary["quantized_drafts"]
        fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
        for ax, key, title in zip(axes, ("token_acceptance", "cost_ratio", "median_speedup"),
                                  ("per-token acceptance", "draft / target step cost", "speedup over plain")):
            ax.bar([r["draft"] for r in rows], [r[key] or 0 for r in rows])
            ax.set_title(title)
        fig.tight_layout()
        fig.savefig(out / "quantized_drafts.png", dpi=120)
        plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, "target", "draft")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--parts", nargs="+", default=["law", "temperature", "quant"], choices=["law", "temperature", "quant"])
    parser.add_argument("--categories", nargs="+", default=list(CATEGORIES))
    parser.add_argument("--max-new-tokens", type=int, default=None)
    add_options(parser, "threads", out="runs/analyses")
    parser.add_argument("--from-records", default=None, help="rebuild report and plots from a records.jsonl")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[args.preset]
    max_new_tokens = args.max_new_tokens or preset["max_new_tokens"]
    if args.from_records:
        records = [json.loads(line) for line in Path(args.from_records).read_text().splitlines()]
        config = dict(preset=args.preset, prompts=len({r["id"] for r in records}), max_new_tokens=max_new_tokens)
    else:
        apply_threads(args.threads)
        from hf_specdec.quantize import quantize_weights

        target, draft, tokenizer = load_pair(args.target, args.draft, "cpu" if not torch.cuda.is_available() else "cuda", None)
        drafts = {}
        for name, q in QUANT.items():
            try:
                drafts[name] = draft if q is None else quantize_weights(copy.deepcopy(draft), **q)
            except ValueError as err:  # e.g. int4 needs layer widths the tiny offline models lack
                print(f"skipping the {name} draft: {err}")
        timers = {"target": ForwardTimer(target), **{name: ForwardTimer(d) for name, d in drafts.items()}}
        prompts = load_prompts(tokenizer, args.categories, preset["per_category"])
        target.generate(torch.tensor([prompts[0]["input_ids"]], device=target.device), max_new_tokens=4)  # warm-up
        for d in drafts.values():
            spec_run(target, d, torch.tensor([prompts[0]["input_ids"]], device=target.device), 2, 4, 0, do_sample=False)
        records = collect(target, drafts, prompts, max_new_tokens, args.parts, timers)
        with open(out / "records.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        config = dict(preset=args.preset, prompts=len(prompts), max_new_tokens=max_new_tokens, target=args.target,
                      draft=args.draft, parts=args.parts, torch_threads=torch.get_num_threads())
    summary = summarise(records)
    (out / "summary.json").write_text(json.dumps(dict(config=config, summary=summary), indent=2))
    text = report(summary, config)
    (out / "report.md").write_text(text + "\n")
    plot(summary, out)
    print(text)


if __name__ == "__main__":
    main()
