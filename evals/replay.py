"""Deterministic replay: the standard preset modelled under any cost table, on this CPU.

    python evals/replay.py --cost-table evals/results/gpu-handwritten/cost_table.json \\
        --out evals/results/gpu-handwritten            # both modes, the 35 report-split prompts (~30 min)
    python evals/replay.py --cost-table T --out D --modes greedy --limit 2    # a quick look
    python evals/replay.py --cost-table T --out D --explain-only   # margins where greedy left the recorded plain greedy

A method's work (its forwards: how many, how wide, over how much context) depends on the tokens, not
on the machine, except hf_specdec's: its cost model chooses what to propose from the costs it is
given. So plain decoding and transformers' methods are not rerun: their recorded work in
`--records` (a standard-preset run) is repriced with `--cost-table`. hf_specdec is rerun on the
real pair, every prompt of the records' report split, with its costs pinned from that same table
(`CostTable.pinned_costs`, as the eval pins them, so no decision reads the clock and the replay
repeats exactly), and its work priced with the table too. Sampling is seeded per prompt as the eval
seeds it; its texts differ from the recorded plain texts, so a prompt's speedup compares rates
(tokens per modelled second), as the eval does.

Writes <out>/replay.jsonl (one hf_specdec record per prompt and mode: work, rounds by source, tree
rounds, whether greedy output equals the recorded plain greedy) and <out>/replay.md: per mode and
category the median modelled speedup over plain of each method, their geometric mean over
categories, and hf_specdec's choices (share of rounds that drafted, looked up, verified a tree, or
took a plain step; a tree round verified the draft's chain merged with retrieved continuations, or
retrieved continuations alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import hf_specdec  # noqa: E402
from common import (  # noqa: E402
    MODES, REQUIRED, ForwardTimer, add_options, apply_threads, geometric_mean, load_pair, load_prompts, speedup_over_plain,
    with_scored, existing_path, json_object, positive_int,
)
import costs  # noqa: E402
from costs import CostTable  # noqa: E402
from regimes import read_records  # noqa: E402

RECORDED = ("plain", "assisted", "prompt_lookup")  # repriced from the records
ENGINES = {"plain": "transformers", "assisted": "transformers", "prompt_lookup": "transformers",
           "hf_specdec": "hf_specdec"}


def choices(rounds: list) -> dict[str, int]:
    """hf_specdec's rounds by what they verified (one row: one record a round)."""
    out = {"draft": 0, "lookup": 0, "tree with draft": 0, "lookup tree": 0, "plain": 0}
    for r in rounds:
        if r.parents is not None:
            out["tree with draft" if r.source == "draft" else "lookup tree"] += 1
        elif r.source == "draft" and r.draft_tokens:
            out["draft"] += 1
        elif r.source == "ngram" and r.draft_tokens:
            out["lookup"] += 1
        else:
            out["plain"] += 1
    return out


def replay_prompt(target, draft, prompt: dict, mode: str, seed: int, table: CostTable, max_new_tokens: int,
                  timers: dict, settings: dict, method: str = "hf_specdec") -> dict:
    """One call of `method` on `prompt` (hf_specdec with costs pinned from `table`; plain or
    transformers' prompt lookup as the eval runs them); its record."""
    ids = torch.tensor([prompt["input_ids"]])
    rounds = []
    kwargs = {}
    if method == "hf_specdec":
        config = {k: v for k, v in settings.items() if k in hf_specdec.config.SETTINGS}  # an ablated window is priced
        window = hf_specdec.SpeculativeConfig(**config).window_for(mode == "sampling")
        pins = table.pinned_costs(ids.shape[1], "hf", window, mode)
        kwargs = dict(custom_generate=hf_specdec.speculative_generate, assistant=draft, acceptance_sink=rounds.append,
                      **{**pins, **settings})
    elif method == "prompt_lookup":
        kwargs = dict(prompt_lookup_num_tokens=10)  # as evals/run_eval.py runs it
    elif method == "assisted":
        kwargs = dict(assistant_model=draft)
    for timer in timers.values():
        timer.take()
    torch.manual_seed(seed)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **MODES[mode],
                          return_dict_in_generate=True, **kwargs)
    work = {name: w for name, (_, w) in ((n, t.take_with_work()) for n, t in timers.items()) if w}
    work = with_scored(work, rounds)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    return dict(id=prompt["id"], category=prompt["category"], mode=mode, method=method, seed=seed, new_tokens=len(tokens),
                tokens=tokens, work=work, modelled_seconds=table.modelled_seconds(work, mode, ENGINES[method]),
                choices=choices(rounds), rounds=len(rounds),
                log=[[r.source[0] + ("t" if r.parents is not None else "") + (r.retrieval[:1] if r.retrieval else ""),
                      len(r.draft_tokens), r.num_accepted, len(r.emitted_tokens)] for r in rounds])


def summarize(records: list[dict], replayed: list[dict], table: CostTable) -> tuple[str, dict]:
    """Markdown and figures: per mode and category, each method's median modelled speedup over plain."""
    plain = {(r["mode"], r["id"]): r for r in records if r["method"] == "plain"}
    seconds = lambda r: table.modelled_seconds(r["work"], r["mode"], ENGINES[r["method"]])  # noqa: E731
    rows = [r for r in records if r["method"] in RECORDED[1:]] + replayed
    figures: dict = {}
    for r in rows:
        base = plain.get((r["mode"], r["id"]))
        if base is None or not r.get("new_tokens"):
            continue
        value = speedup_over_plain(r["new_tokens"], seconds(r), base["new_tokens"], seconds(base))
        figures.setdefault(r["mode"], {}).setdefault(r["method"], {}).setdefault(r["category"], []).append(value)
    lines = []
    methods = ("assisted", "prompt_lookup", "hf_specdec")
    summary = {}
    for mode in (m for m in MODES if m in figures):
        categories = sorted({c for by_cat in figures[mode].values() for c in by_cat})
        lines += [f"## {mode}", "", "Median modelled speedup over plain per category (plain = 1.00):", "",
                  "| category | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for category in categories:
            cells = [figures[mode].get(m, {}).get(category) for m in methods]
            lines.append(f"| {category} | " + " | ".join("-" if c is None else f"{statistics.median(c):.2f}" for c in cells) + " |")
        geo = {m: geometric_mean(statistics.median(v) for v in figures[mode].get(m, {}).values()) for m in methods}
        summary[mode] = dict(geomean=geo, per_category={m: {c: statistics.median(v) for c, v in figures[mode].get(m, {}).items()}
                                                       for m in methods})
        lines.append("| **geometric mean** | " + " | ".join("-" if geo[m] is None else f"**{geo[m]:.2f}**" for m in methods) + " |")
        mine = [r for r in replayed if r["mode"] == mode]
        total = {k: sum(r["choices"][k] for r in mine) for k in ("draft", "lookup", "tree with draft", "lookup tree", "plain")}
        count = max(1, sum(total.values()))
        summary[mode]["choices"] = {k: v / count for k, v in total.items()}
        lines += ["", f"hf_specdec's rounds ({count} over {len(mine)} prompts): " + ", ".join(
            f"{k} {100 * v / count:.0f}%" for k, v in total.items())]
        if mode == "greedy":
            same = sum(r.get("same_as_plain", False) for r in mine)
            lines.append(f"Greedy outputs equal to the recorded plain greedy: {same}/{len(mine)}")
        lines.append("")
    return "\n".join(lines), summary


def explain_mismatches(target, by_id: dict, replayed: list[dict], max_new_tokens: int) -> list[str]:
    """For each greedy replay whose output differs from the recorded plain greedy: plain greedy on this
    machine, and where hf_specdec leaves it, the top-two margin of plain decoding there in bf16 steps
    (0: an exact tie; 1: adjacent bf16 numbers, which a forward over more tokens may round the other way)."""
    from hf_specdec.diagnostics import greedy_divergence

    lines = []
    for r in (r for r in replayed if r["mode"] == "greedy" and not r.get("same_as_plain", True)):
        ids = torch.tensor([by_id[r["id"]]["input_ids"]])
        out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
                              output_scores=True)
        here = out.sequences[0, ids.shape[1]:]
        found = greedy_divergence(here, torch.tensor(r["tokens"]), [s[0] for s in out.scores])
        steps = "-" if found is None else f"{found.margin_in_bf16_steps:.1f} bf16 steps"
        lines.append(f"| {r['id']} | {r['category']} | {'-' if found is None else found.position} | "
                     f"{'-' if found is None else f'{found.margin:.4f}'} | {steps} |")
    return lines


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(parser, cost_table=REQUIRED)
    parser.add_argument("--records", type=existing_path, default=str(HERE / "results" / "standard" / "records.jsonl"),
                        help="a standard-preset run's records: its prompts, and the work of plain and transformers' methods")
    add_options(parser, out=REQUIRED)
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    parser.add_argument("--limit", type=positive_int, default=None, help="at most this many prompts a mode (a quick look)")
    parser.add_argument("--ids", nargs="+", default=None, help="only these prompt ids (a quick look)")
    parser.add_argument("--settings", type=json_object, default={}, help="hf_specdec keyword arguments as JSON (an ablation)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, help="the records' preset's (standard: 64)")
    parser.add_argument("--seed-offset", type=int, default=0,
                        help="prompt i is seeded with 1000 * offset + i (0: as the eval seeds it); another offset "
                             "draws other sample paths, for several seeds per prompt")
    parser.add_argument("--method", choices=tuple(ENGINES), default="hf_specdec",
                        help="what to replay: hf_specdec, or plain / transformers' methods under a new seed "
                             "(their work does not depend on costs; the records hold seed 0's)")
    parser.add_argument("--retrieval-cache", action="store_true",
                        help="one hf_specdec.RetrievalCache per mode shared by every prompt's call, in order (the "
                             "standard preset has no repetition across prompts: what the cache costs there)")
    parser.add_argument("--explain-only", action="store_true",
                        help="no replay: read <out>/replay.jsonl and explain its greedy mismatches (margins in bf16 steps)")
    parser.add_argument("--accelerator-path", action="store_true",
                        help="run the loop as on an accelerator, where each device read stalls: no per-token draft "
                             "stop, no CPU-only sparse sampling (hf_specdec.verify.reads_are_free off)")
    parser.add_argument("--eager-prices", action="store_true",
                        help="pin costs without Costs.position (the planner prices every sampled position, as before the "
                             "lazy pricing); the work is modelled the same way")
    add_options(parser, "threads")
    args = parser.parse_args(argv)
    costs.PIN_POSITION = not args.eager_prices
    apply_threads(args.threads)
    if args.accelerator_path:
        from hf_specdec import generate, rounds, sampling, verify  # not `import hf_specdec.x`: that makes hf_specdec local here

        for module in (verify, sampling, rounds, generate):
            module.reads_are_free = lambda device: False
    table = CostTable.load(Path(args.cost_table))
    if "hf" not in table.forwards:
        table.alias("hf", "bf16")
    records = read_records(Path(args.records))
    settings = dict(args.settings)
    from hf_specdec.arguments import OWN_ARGUMENTS, check_arguments

    unknown = sorted(set(settings) - OWN_ARGUMENTS)
    missing = sorted(set(args.ids or ()) - {str(r["id"]) for r in records})
    try:  # before the pair loads: a bad setting, an unknown id, nothing to explain
        if unknown:
            raise ValueError(f"--settings: unknown hf_specdec arguments {unknown}")
        check_arguments(settings)
        if missing:
            raise ValueError(f"--ids: no prompt {missing} in {args.records}")
        if args.explain_only and not (Path(args.out) / "replay.jsonl").exists():
            raise ValueError(f"--explain-only: no {Path(args.out) / 'replay.jsonl'} to explain")
    except ValueError as err:
        parser.error(str(err))
    from hf_specdec.pair import DRAFT, TARGET

    target, draft, tokenizer = load_pair(TARGET.name, DRAFT.name, "cpu")  # bf16 as loaded: an accelerator's draft
    timers = {"target": ForwardTimer(target), "hf": ForwardTimer(draft)}
    by_id = {p["id"]: p for p in load_prompts(tokenizer, sorted({r["category"] for r in records}), None, "all")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.explain_only:
        replayed = [json.loads(line) for line in open(out / "replay.jsonl")]
        lines = explain_mismatches(target, by_id, replayed, args.max_new_tokens)
        text = ("| prompt | category | first differing token | plain's top-two margin | in bf16 steps |\n"
                "|---|---|---|---|---|\n" + "\n".join(lines) + "\n")
        (out / "mismatches.md").write_text(text)
        print(text)
        return {}
    replayed = []
    with open(out / "replay.jsonl", "w") as sink:
        for mode in args.modes:
            if args.retrieval_cache:
                settings = {**settings, "retrieval_cache": hf_specdec.RetrievalCache()}
            order = [r["id"] for r in records if r["method"] == "plain" and r["mode"] == mode]
            plain = {r["id"]: r for r in records if r["method"] == "plain" and r["mode"] == mode}
            for seed, prompt_id in enumerate(order[: args.limit]):
                if args.ids is not None and prompt_id not in args.ids:  # seeded as in the full replay
                    continue
                start = time.perf_counter()
                record = replay_prompt(target, draft, by_id[prompt_id], mode, 1000 * args.seed_offset + seed, table,
                                       args.max_new_tokens, timers, settings, args.method)
                record["same_as_plain"] = record["tokens"] == plain[prompt_id]["tokens"]
                replayed.append(record)
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                print(f"{mode} {record['category']:15s} {prompt_id:>6} {record['choices']} "
                      f"{time.perf_counter() - start:.0f} s", flush=True)
    text, summary = summarize(records, replayed, table)
    header = (f"# Replay of {args.records} priced with {args.cost_table}\n\n"
              f"Command: `python evals/replay.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n")
    (out / "replay.md").write_text(header + text)
    (out / "replay_summary.json").write_text(json.dumps(summary, indent=1))
    print(header + text)
    return summary


if __name__ == "__main__":
    main()
