"""The planner against fixed strategies under several cost regimes (issue 37's robustness table).

A fixed strategy's work (its forwards: how many, how wide, over how much context) does not depend on
costs, so it is produced once and repriced under every cost table; only the planner, which chooses
from the costs it is given, is replayed once per regime (`evals/replay.py --cost-table T`).

    # fixed-k draft chains in greedy decoding, from one teacher-forced draft pass per prompt (exact:
    # a greedy chain from position t accepts the run of positions where the draft's argmax, given the
    # recorded plain greedy prefix, equals the next recorded token, capped at k)
    python evals/regimes.py simulate --out runs/fixed-greedy
    # fixed-k chains when sampling are replayed for real (seeded, as the eval seeds them)
    python evals/replay.py --cost-table T --out runs/fixed-k4 --modes sampling \\
        --settings '{"adaptive": false, "ngram": false, "num_draft_tokens": 4}'
    # the table: per regime, mode and category, the planner's median modelled speedup over plain
    # against the best fixed strategy's (plain; lookup-only chains: transformers' prompt lookup, from
    # the records; draft chains with k = 2, 4, 6, 8)
    # old code against new under one table (medians per category, and paired per prompt and seed)
    python evals/regimes.py compare --cost-table evals/results/standard/cost_table.json \\
        --old runs/old-s0,runs/old-s1 --new runs/new-s0,runs/new-s1
    python evals/regimes.py table --regime bf16=evals/results/standard/cost_table.json:runs/new-bf16 \\
        --regime accel=evals/results/gpu-handwritten/cost_table.json:runs/new-accel \\
        --fixed runs/fixed-greedy runs/fixed-k2 runs/fixed-k4 runs/fixed-k6 runs/fixed-k8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import REQUIRED, add_options, apply_threads, geometric_mean, load_pair, load_prompts, speedup_over_plain  # noqa: E402
from costs import CostTable  # noqa: E402

KS = (2, 4, 6, 8)
STANDARD = HERE / "results" / "standard" / "records.jsonl"


def read_records(path: Path) -> list[dict]:
    records = [json.loads(line) for line in open(path)]
    for r in records:  # older records hold work and tokens as Python reprs
        for key in ("work", "tokens"):
            if isinstance(r.get(key), str):
                r[key] = json.loads(r[key].replace("'", '"'))
    return records


def greedy_chain_work(prompt: int, window: int, agree: list[bool], k: int, budget: int) -> dict:
    """The forwards of hf_specdec with a fixed draft length k (adaptive=False, ngram=False) on a greedy
    output whose positions the draft predicts as `agree` says, `budget` new tokens at most."""
    target, draft, t, full = [], [], 0, False
    while t < len(agree):
        k_round = min(k, budget - t - 1)  # a round emits at most k + 1 tokens
        context = prompt + t
        if k_round <= 0:  # a plain step
            target.append([1, context - 1] if t else [prompt, 0])
            t += 1
            continue
        if not t:  # the draft encodes its window of the prompt; the target the prompt and the drafts
            draft.append([min(prompt, window), 0])
            target.append([prompt + k_round, 0])
        else:
            draft.append([2 if full else 1, context - (2 if full else 1)])
            target.append([k_round + 1, context - 1])
        draft += [[1, context + i] for i in range(k_round - 1)]
        accepted = 0
        while accepted < k_round and t + accepted < len(agree) and agree[t + accepted]:
            accepted += 1
        full = accepted == k_round
        t += accepted + 1
    return {"target": target, "hf": draft}


@torch.no_grad()
def simulate(args) -> None:
    """Fixed-k greedy work for every report-split prompt of the records, one draft pass each."""
    from hf_specdec import SpeculativeConfig
    from hf_specdec.pair import DRAFT, TARGET

    records = read_records(Path(args.records))
    _, draft, tokenizer = load_pair(TARGET.name, DRAFT.name, "cpu")  # bf16 as loaded, as the replay's
    by_id = {p["id"]: p for p in load_prompts(tokenizer, sorted({r["category"] for r in records}), None, "all")}
    window = SpeculativeConfig().window_for(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "replay.jsonl", "w") as sink:
        for plain in (r for r in records if r["method"] == "plain" and r["mode"] == "greedy"):
            prompt, output = by_id[plain["id"]]["input_ids"], plain["tokens"]
            seen = prompt[-window:] + output[:-1]
            logits = draft(torch.tensor([seen])).logits[0, len(prompt[-window:]) - 1 :]  # predicts output[0], ...
            agree = (logits.argmax(dim=-1) == torch.tensor(output)).tolist()
            for k in KS:
                work = greedy_chain_work(len(prompt), window, agree, k, args.max_new_tokens)
                sink.write(json.dumps(dict(id=plain["id"], category=plain["category"], mode="greedy", method=f"fixed_k{k}",
                                           new_tokens=plain["new_tokens"], work=work)) + "\n")
            print(plain["category"], plain["id"], f"draft agrees at {sum(agree)}/{len(agree)} positions", flush=True)


def medians(rows: list[dict], plain: dict, table: CostTable, engine: str) -> dict:
    """mode -> category -> median over prompts of the modelled speedup over plain of `rows` (one method).
    Where a prompt has several seeds (sample paths), its rate is its tokens over its modelled seconds
    summed over them, plain's likewise over plain's seeds: a path that ends after a few tokens weighs
    what its tokens weigh."""
    totals: dict = {}
    for r in rows:
        if (r["mode"], r["id"]) not in plain or not r.get("new_tokens"):
            continue
        t = totals.setdefault((r["mode"], r["id"], r["category"]), [0, 0.0])
        t[0] += r["new_tokens"]
        t[1] += table.modelled_seconds(r["work"], r["mode"], engine)
    out: dict = {}
    for (mode, prompt, category), (tokens, seconds) in totals.items():
        bases = plain[(mode, prompt)]
        value = speedup_over_plain(tokens, seconds, sum(b["new_tokens"] for b in bases),
                                   sum(table.modelled_seconds(b["work"], mode, "transformers") for b in bases))
        out.setdefault(mode, {}).setdefault(category, []).append(value)
    return {mode: {c: statistics.median(v) for c, v in cats.items()} for mode, cats in out.items()}


def read_folders(spec: str) -> list[dict]:
    """Records of one or more replay folders (comma-separated: one per seed)."""
    return [json.loads(x) for folder in spec.split(",") for x in open(Path(folder) / "replay.jsonl")]


def table_command(args) -> dict:
    records = read_records(Path(args.records))
    plain: dict = {}
    for r in records + (read_folders(args.plain) if args.plain else []):
        if r["method"] == "plain":
            plain.setdefault((r["mode"], r["id"]), []).append(r)
    lookup = [r for r in records + (read_folders(args.lookup) if args.lookup else []) if r["method"] == "prompt_lookup"]
    fixed_rows: dict[str, list[dict]] = {"lookup (transformers)": lookup}
    for spec in args.fixed:
        named, _, folders = spec.rpartition("=")
        for r in read_folders(folders):
            name = named or (r["method"] if r["method"].startswith("fixed_") else f"fixed_{Path(folders).name}")
            fixed_rows.setdefault(name.replace("fixed_fixed-", "fixed_"), []).append(r)
    lines, summary = [], {}
    for spec in args.regime:
        name, _, rest = spec.partition("=")
        table_path, _, replay_dir = rest.partition(":")
        table = CostTable.load(Path(table_path))
        if "hf" not in table.forwards:
            table.alias("hf", "bf16")
        planner = medians(read_folders(replay_dir), plain, table, "hf_specdec")
        fixed = {n: medians(rows, plain, table, "transformers" if n.startswith("lookup") else "hf_specdec")
                 for n, rows in fixed_rows.items()}
        for mode in sorted(planner):
            lines += [f"### {name}, {mode}", "", "| category | planner | best fixed | which | planner / best |", "|---|---|---|---|---|"]
            ratios = []
            for category in sorted(planner[mode]):
                options = {"plain": 1.0, **{n: f[mode][category] for n, f in fixed.items() if category in f.get(mode, {})}}
                best = max(options, key=options.get)
                ratio = planner[mode][category] / options[best]
                ratios.append(ratio)
                lines.append(f"| {category} | {planner[mode][category]:.2f} | {options[best]:.2f} | {best} | {ratio:.3f} |")
                summary.setdefault(name, {}).setdefault(mode, {})[category] = dict(planner=planner[mode][category],
                                                                                   best=options[best], which=best, ratio=ratio)
            geo = geometric_mean(planner[mode].values())
            lines += [f"| **geometric mean** | **{geo:.2f}** | | | min ratio **{min(ratios):.3f}** |", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return summary


def paired_ratios(old: list[list[dict]], new: list[list[dict]], table: CostTable) -> dict:
    """mode -> category -> the per-prompt ratios of old over new modelled time per token, old and new
    paired by seed (the i-th folder of each) and prompt."""
    per_token = lambda r: table.modelled_seconds(r["work"], r["mode"], "hf_specdec") / r["new_tokens"]  # noqa: E731
    out: dict = {}
    for old_rows, new_rows in zip(old, new):
        before = {(r["mode"], r["id"]): r for r in old_rows if r.get("new_tokens")}
        for r in new_rows:
            if r.get("new_tokens") and (r["mode"], r["id"]) in before:
                ratio = per_token(before[r["mode"], r["id"]]) / per_token(r)
                out.setdefault(r["mode"], {}).setdefault(r["category"], []).append(ratio)
    return out


def compare_command(args) -> None:
    """Old code against new, one cost table, one or more seeds (comma-separated folders, paired in
    order): per mode and category the median modelled speedup of each (seeds pooled, as `medians`
    pools them), their ratio, and the paired geometric mean over prompts and seeds of old / new
    modelled time per token."""
    records = read_records(Path(args.records))
    plain = {(r["mode"], r["id"]): [r] for r in records if r["method"] == "plain"}
    table = CostTable.load(Path(args.cost_table))
    if "hf" not in table.forwards:
        table.alias("hf", "bf16")
    runs = [[[json.loads(x) for x in open(Path(d) / "replay.jsonl")] for d in spec.split(",")] for spec in (args.old, args.new)]
    if len(runs[0]) != len(runs[1]):
        raise SystemExit(f"--old has {len(runs[0])} folders and --new {len(runs[1])}: one each per seed, in the same order")
    old, new = (medians([r for rows in seeds for r in rows], plain, table, "hf_specdec") for seeds in runs)
    paired = paired_ratios(*runs, table)
    lines = []
    for mode in sorted(new):
        lines += [f"### {mode}", "", "| category | old | new | new / old (medians) | paired, geometric mean of old / new time per token |",
                  "|---|---|---|---|---|"]
        for category in sorted(new[mode]):
            lines.append(f"| {category} | {old[mode][category]:.2f} | {new[mode][category]:.2f} | "
                         f"{new[mode][category] / old[mode][category]:.3f} | {geometric_mean(paired[mode][category]):.3f} |")
        go, gn = geometric_mean(old[mode].values()), geometric_mean(new[mode].values())
        every = [x for ratios in paired[mode].values() for x in ratios]
        lines += [f"| **geometric mean** | **{go:.2f}** | **{gn:.2f}** | **{gn / go:.3f}** | "
                  f"**{geometric_mean(every):.3f}** over {len(every)} pairs |", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="fixed-k greedy work from one teacher-forced draft pass per prompt")
    add_options(sim, out=REQUIRED)
    add_options(sim, "threads")
    sim.add_argument("--records", default=str(STANDARD))
    sim.add_argument("--max-new-tokens", type=int, default=64)
    tab = sub.add_parser("table", help="the planner against the best fixed strategy, per regime, mode and category")
    tab.add_argument("--records", default=str(STANDARD))
    tab.add_argument("--regime", action="append", required=True, help="NAME=COST_TABLE:PLANNER_REPLAY_DIR[,DIR,...] (one folder per seed)")
    tab.add_argument("--fixed", nargs="+", default=[],
                     help="folders with replay.jsonl of fixed strategies, or NAME=DIR,DIR,... (one folder per seed)")
    tab.add_argument("--plain", default=None, help="replay folders of plain under other seeds (comma-separated)")
    tab.add_argument("--lookup", default=None, help="replay folders of transformers' prompt lookup under other seeds")
    tab.add_argument("--out", default=None, help="write the markdown table here")
    cmp = sub.add_parser("compare", help="old code against new under one cost table")
    cmp.add_argument("--records", default=str(STANDARD))
    cmp.add_argument("--cost-table", required=True)
    cmp.add_argument("--old", required=True, help="replay folders of the old code (comma-separated: one per seed)")
    cmp.add_argument("--new", required=True, help="replay folders of the new code, seeds in the same order")
    cmp.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.command == "simulate":
        apply_threads(args.threads)
        simulate(args)
    elif args.command == "compare":
        compare_command(args)
    else:
        table_command(args)


if __name__ == "__main__":
    main()
