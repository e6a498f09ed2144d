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
    # sampling, paired: every fixed strategy priced on the outputs the planner sampled (plain and
    # prompt lookup exactly, fixed draft chains in expectation given the output; one forward of each
    # model per output), so the sample paths' own spread (a prompt's output copied from the prompt,
    # or not) no longer decides a cell
    python evals/regimes.py paths --regime h200=evals/results/gpu-h200/cost_table.json:runs/s0,runs/s1 --out paths.md
    # the models `paths` relies on, against recorded prompt-lookup and fixed-k sampling runs
    python evals/regimes.py check --lookup runs/lookup-s1 --fixed 2=runs/k2-s0 4=runs/k4-s2
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

from common import (  # noqa: E402
    MODES, REQUIRED, add_options, apply_threads, cost_table_file, existing_path, geometric_mean, load_pair, load_prompts,
    positive_int, speedup_over_plain,
)
from costs import CostTable, load_table, plain_work  # noqa: E402
from hf_specdec.config import lazy_scored  # noqa: E402

KS = (2, 4, 6, 8)
STANDARD = HERE / "results" / "standard" / "records.jsonl"


def read_records(path: Path) -> list[dict]:
    """run_eval.py's records at `path` (given as --records), each line checked and named if it is not one."""
    from run_eval import read_records as checked

    records = checked(path, "--records")
    for r in records:  # older records hold work and tokens as Python reprs
        for key in ("work", "tokens"):
            if isinstance(r.get(key), str):
                r[key] = json.loads(r[key].replace("'", '"'))
    return records


def greedy_chain_work(prompt: int, window: int, agree: list[bool], k: int, budget: int, lazy: bool = False) -> dict:
    """The forwards of hf_specdec with a fixed draft length k (adaptive=False, ngram=False) on a greedy
    output whose positions the draft predicts as `agree` says, `budget` new tokens at most; `lazy`:
    with the positions each target forward scores when sampling on a CPU ("scored", `lazy_scored`)."""
    target, draft, scored, t, full = [], [], [], 0, False
    while t < len(agree):
        k_round = min(k, budget - t - 1)  # a round emits at most k + 1 tokens
        context = prompt + t
        if k_round <= 0:  # a plain step
            target.append([1, context - 1] if t else [prompt, 0])
            scored.append(1)
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
        scored.append(lazy_scored(k_round, accepted))
        t += accepted + 1
    return {"target": target, "hf": draft, **({"scored": scored} if lazy else {})}


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


def _report(lines: list[str], out: str | None) -> None:
    """Print a markdown report, and write it to `out` when given."""
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


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
        name, table, replay_dir = read_regime(spec)
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
    _report(lines, args.out)
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
    table = load_table(Path(args.cost_table))
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
    _report(lines, args.out)



# ---------------------------------------------------------------- fixed strategies on the planner's own sample paths


def read_regime(spec: str) -> tuple[str, CostTable, str]:
    """NAME=COST_TABLE:DIR[,DIR,...] -> (name, the table, the planner's replay folders)."""
    name, _, rest = spec.partition("=")
    table_path, _, folders = rest.partition(":")
    return name, load_table(Path(table_path)), folders


def eos_and_vocab(model) -> tuple[list[int], int]:
    """The model's end-of-sequence ids (a list, empty for none) and its vocabulary size."""
    eos = model.generation_config.eos_token_id
    return [] if eos is None else eos if isinstance(eos, list) else [eos], model.config.get_text_config().vocab_size


def warpers_of(mode: str, warpers: tuple[float, float] | None = None):
    """The logits processors generation builds for `mode` (or a sampled call's (temperature, top-p)):
    none when greedy; a top-p of 1 adds no warper."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    processors = LogitsProcessorList()
    if MODES[mode].get("do_sample", False):
        temperature, top_p = warpers or (MODES[mode]["temperature"], MODES[mode]["top_p"])
        processors.append(TemperatureLogitsWarper(temperature))
        if top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p))
    return processors


def lookup_work(prompt: list[int], tokens: list[int], mode: str, eos: list[int], vocab: int, max_new_tokens: int = 64,
                warpers: tuple[float, float] | None = None) -> dict:
    """transformers' prompt lookup's forwards (prompt_lookup_num_tokens=10, as the eval runs it) on an
    output it would have produced: a retrieved token is kept when it equals the token the target draws
    there, so given the output its rounds are fixed, in sampling as in greedy decoding. Its own
    candidate generator proposes them (checked: `regimes.py check`, tests/test_regimes_eval.py).
    `warpers`: (temperature, top-p) of a sampled output, where not the mode's."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    generator = PromptLookupCandidateGenerator(eos_token_id=torch.tensor(eos, dtype=torch.long), num_output_tokens=10, max_matching_ngram_size=2,
                                               max_length=len(prompt) + max_new_tokens, logits_processor=warpers_of(mode, warpers),
                                               vocab_size=vocab)
    seen, cached, done, forwards = list(prompt), 0, 0, []
    while done < len(tokens):
        candidates = generator.get_candidates(torch.tensor([seen]))[0][0, len(seen):].tolist()
        forwards.append([len(seen) - cached + len(candidates), cached])
        kept = 0
        while kept < len(candidates) and done + kept < len(tokens) and candidates[kept] == tokens[done + kept]:
            kept += 1
        take = min(kept + 1, len(tokens) - done)
        cached, seen, done = len(seen) + kept, seen + tokens[done: done + take], done + take
    return {"target": forwards}


@torch.no_grad()
def acceptance_on_path(target, draft, prompt: list[int], tokens: list[int], window: int | None, mode: str) -> list[float]:
    """Per output token y_t, P(a fixed draft chain's token there was accepted | the output) =
    min(p(y_t), q(y_t)) / p(y_t), p and q processed as generation processes them, from one forward of
    each model over the output (the draft over its window of the prompt, as hf_specdec encodes it).
    Given the output, the rule's acceptances are independent with these chances: P(draft y and keep
    it) = min(p(y), q(y)) and P(output y) = p(y)."""
    processors = warpers_of(mode)
    ys = torch.tensor(tokens)

    def probs(model, context: list[int]) -> torch.Tensor:
        logits = model(torch.tensor([context + tokens[:-1]])).logits[0, len(context) - 1:].float()
        return processors(None, logits).softmax(-1).gather(-1, ys[:, None])[:, 0]

    p, q = probs(target, prompt), probs(draft, prompt[-window:] if window else prompt)
    return torch.where(p > 0, torch.minimum(p, q) / p.clamp_min(1e-30), torch.zeros_like(p)).tolist()


def expected_chain_seconds(prompt: int, window: int | None, accept: list[float], k: int, budget: int, price,
                           position: float = 0.0) -> float:
    """E[modelled seconds | the output] of hf_specdec with a fixed draft length k (adaptive=False,
    ngram=False), the output's position t accepted with chance accept[t]: `greedy_chain_work`'s rounds
    summed over every acceptance pattern by their probabilities (`price(model, width, context)`, which
    counts a target forward's positions as `modelled_seconds` does without "scored"; `position`: a
    position's price, to count instead the positions the lazy rule scores, `lazy_scored`)."""
    n, window = len(accept), window or prompt
    states: dict[tuple[int, bool], float] = {(0, False): 1.0}  # (round start, the last round was full) -> P
    seconds = 0.0
    for t in range(n):
        for full in (False, True):
            chance = states.pop((t, full), 0.0)
            if not chance:
                continue
            k_round, context = min(k, budget - t - 1), prompt + t
            if k_round <= 0:
                seconds += chance * price("target", *([1, context - 1] if t else [prompt, 0]))
                states[t + 1, full] = states.get((t + 1, full), 0.0) + chance
                continue
            if not t:
                forwards = [("hf", min(prompt, window), 0), ("target", prompt + k_round, 0)]
            else:
                forwards = [("hf", 2 if full else 1, context - (2 if full else 1)), ("target", k_round + 1, context - 1)]
            forwards += [("hf", 1, context + i) for i in range(k_round - 1)]
            seconds += chance * sum(price(*f) for f in forwards)
            reach, counted = chance, k_round + 1 if t else 1
            for j in range(k_round + 1):  # j tokens accepted
                ended = j == k_round or t + j >= n
                stop = reach if ended else reach * (1 - accept[t + j])
                seconds += stop * position * (lazy_scored(k_round, j) - counted)
                if t + j + 1 < n:
                    states[t + j + 1, j == k_round] = states.get((t + j + 1, j == k_round), 0.0) + stop
                if ended:
                    break
                reach *= accept[t + j]
    return seconds



def paths_command(args) -> dict:
    """Each fixed strategy's modelled time on the very outputs the planner sampled (so the comparison
    is paired: a sample path that runs off the prompt's text is the same path for every strategy):
    plain and transformers' prompt lookup exactly (their rounds are fixed by the output), fixed draft
    chains in expectation given the output (`expected_chain_seconds`)."""
    from hf_specdec import SpeculativeConfig
    from hf_specdec.pair import DRAFT, TARGET

    apply_threads(args.threads)
    records = read_records(Path(args.records))
    target, draft, tokenizer = load_pair(TARGET.name, DRAFT.name, "cpu")  # bf16 as loaded, as the replay's
    by_id = {p["id"]: p for p in load_prompts(tokenizer, sorted({r["category"] for r in records}), None, "all")}
    eos, vocab = eos_and_vocab(target)
    window = SpeculativeConfig().window_for(True)
    accepts: dict = {}
    lines, summary = [], {}
    for spec in args.regime:
        name, table, replay_dir = read_regime(spec)
        pooled: dict = {}  # (category, prompt) -> strategy -> seconds summed over seeds
        for r in read_folders(replay_dir):
            if r["mode"] != "sampling" or not r.get("new_tokens"):
                continue
            prompt, tokens, mode = by_id[r["id"]]["input_ids"], r["tokens"], r["mode"]
            key = (r["id"], tuple(tokens))
            if key not in accepts:
                accepts[key] = acceptance_on_path(target, draft, prompt, tokens, window, mode)
            price = lambda model, width, context: table.modelled_seconds({model: [[width, context]]}, mode, "hf_specdec")  # noqa: E731
            seconds = {"planner": table.modelled_seconds(r["work"], mode, "hf_specdec"),
                       "plain": table.modelled_seconds(plain_work(len(prompt), len(tokens)), mode, "transformers"),
                       "lookup (transformers)": table.modelled_seconds(lookup_work(prompt, tokens, mode, eos, vocab, args.max_new_tokens),
                                                                       mode, "transformers")}
            for k in KS:
                seconds[f"fixed_k{k}"] = expected_chain_seconds(len(prompt), window, accepts[key], k, args.max_new_tokens, price,
                                                                 table.position[mode]["hf_specdec"] if "scored" in r["work"] else 0.0)
            total = pooled.setdefault((r["category"], r["id"]), {})
            for strategy, s in seconds.items():
                total[strategy] = total.get(strategy, 0.0) + s
        per_category: dict = {}
        for (category, _), total in pooled.items():
            for strategy, s in total.items():
                per_category.setdefault(category, {}).setdefault(strategy, []).append(total["plain"] / s)
        lines += [f"### {name}, sampling, fixed strategies on the planner's own outputs", "",
                  "| category | planner | plain | lookup | k = 2 | k = 4 | k = 6 | k = 8 | best fixed | planner / best |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        ratios, planner_medians = [], []
        for category in sorted(per_category):
            med = {s: statistics.median(v) for s, v in per_category[category].items()}
            best = max((s for s in med if s != "planner"), key=med.get)
            ratio = med["planner"] / med[best]
            ratios.append(ratio)
            planner_medians.append(med["planner"])
            cells = " | ".join(f"{med[s]:.2f}" for s in ["planner", "plain", "lookup (transformers)"] + [f"fixed_k{k}" for k in KS])
            lines.append(f"| {category} | {cells} | {best} | {ratio:.3f} |")
            summary.setdefault(name, {})[category] = dict(medians=med, best=best, ratio=ratio)
        lines += [f"| **geometric mean** | **{geometric_mean(planner_medians):.2f}** | | | | | | | | min **{min(ratios):.3f}** |", ""]
    _report(lines, args.out)
    return summary


def check_command(args) -> None:
    """The models of `paths` against recorded runs: transformers' prompt lookup's forwards derived from
    each recorded output (`lookup_work`), and each fixed-k chain's forwards from its acceptance
    pattern (`greedy_chain_work`; the pattern read off its target forwards' contexts)."""
    from hf_specdec import SpeculativeConfig
    from hf_specdec.pair import DRAFT, TARGET

    records = read_records(Path(args.records))
    target, _, tokenizer = load_pair(TARGET.name, DRAFT.name, "cpu")
    by_id = {p["id"]: p for p in load_prompts(tokenizer, sorted({r["category"] for r in records}), None, "all")}
    eos, vocab = eos_and_vocab(target)
    lookups = [r for r in records + (read_folders(args.lookup) if args.lookup else []) if r["method"] == "prompt_lookup"]
    same = sum(lookup_work(by_id[r["id"]]["input_ids"], r["tokens"], r["mode"], eos, vocab, args.max_new_tokens)["target"]
               == r["work"]["target"] for r in lookups)
    print(f"prompt lookup: {same} of {len(lookups)} recorded runs derived forward for forward from their outputs")
    chains = 0
    for spec in args.fixed:
        k_text, _, folders = spec.partition("=")
        k, rows = int(k_text), read_folders(folders)
        for r in rows:
            forwards, n = r["work"]["target"], r["new_tokens"]
            prompt = forwards[0][0] - min(k, args.max_new_tokens - 1)
            starts = [0] + [context + 1 - prompt for _, context in forwards[1:]] + [n]
            agree = [a for s, e in zip(starts, starts[1:]) for a in [True] * (e - s - 1) + [False]][:n]
            chains += greedy_chain_work(prompt, SpeculativeConfig().window_for(True), agree, k, args.max_new_tokens) == {
                m: f for m, f in r["work"].items() if m != "scored"}
        print(f"fixed k = {k}: {chains} of {len(rows)} recorded runs reproduced from their acceptance patterns")
        chains = 0


def replay_folders(text: str) -> str:
    """DIR[,DIR,...], each holding a replay.jsonl (or NAME=DIR,...): checked before any model loads."""
    folders = text.rpartition("=")[2]
    for folder in folders.split(","):
        if not (Path(folder) / "replay.jsonl").is_file():
            raise argparse.ArgumentTypeError(f"{folder or '(empty)'} holds no replay.jsonl")
    return text


def regime_spec(text: str) -> str:
    """NAME=COST_TABLE:DIR[,DIR,...]: the table reads as one and each folder holds a replay."""
    name, _, rest = text.partition("=")
    table_path, _, folders = rest.partition(":")
    if not name or not table_path or not folders:
        raise argparse.ArgumentTypeError(f"expected NAME=COST_TABLE:DIR[,DIR,...], got {text!r}")
    cost_table_file(table_path)
    replay_folders(folders)
    return text


def fixed_k(text: str) -> str:
    k, _, folders = text.partition("=")
    if not k.isdigit() or int(k) < 1:
        raise argparse.ArgumentTypeError(f"expected K=DIR,DIR,... with a positive K, got {text!r}")
    return replay_folders(folders)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="fixed-k greedy work from one teacher-forced draft pass per prompt")
    add_options(sim, out=REQUIRED)
    add_options(sim, "threads")
    sim.add_argument("--records", type=existing_path, default=str(STANDARD))
    sim.add_argument("--max-new-tokens", type=positive_int, default=64)
    tab = sub.add_parser("table", help="the planner against the best fixed strategy, per regime, mode and category")
    tab.add_argument("--records", type=existing_path, default=str(STANDARD))
    tab.add_argument("--regime", type=regime_spec, action="append", required=True, help="NAME=COST_TABLE:PLANNER_REPLAY_DIR[,DIR,...] (one folder per seed)")
    tab.add_argument("--fixed", type=replay_folders, nargs="+", default=[],
                     help="folders with replay.jsonl of fixed strategies, or NAME=DIR,DIR,... (one folder per seed)")
    tab.add_argument("--plain", type=replay_folders, default=None, help="replay folders of plain under other seeds (comma-separated)")
    tab.add_argument("--lookup", type=replay_folders, default=None, help="replay folders of transformers' prompt lookup under other seeds")
    tab.add_argument("--out", default=None, help="write the markdown table here")
    cmp = sub.add_parser("compare", help="old code against new under one cost table")
    cmp.add_argument("--records", type=existing_path, default=str(STANDARD))
    cmp.add_argument("--cost-table", type=cost_table_file, required=True)
    cmp.add_argument("--old", type=replay_folders, required=True, help="replay folders of the old code (comma-separated: one per seed)")
    cmp.add_argument("--new", type=replay_folders, required=True, help="replay folders of the new code, seeds in the same order")
    cmp.add_argument("--out", default=None)
    pth = sub.add_parser("paths", help="sampling: the planner against fixed strategies on the planner's own outputs (paired)")
    pth.add_argument("--records", type=existing_path, default=str(STANDARD))
    pth.add_argument("--regime", type=regime_spec, action="append", required=True, help="NAME=COST_TABLE:PLANNER_REPLAY_DIR[,DIR,...] (one folder per seed)")
    pth.add_argument("--max-new-tokens", type=positive_int, default=64)
    pth.add_argument("--out", default=None, help="write the markdown table here")
    add_options(pth, "threads")
    chk = sub.add_parser("check", help="the models of `paths` against recorded prompt-lookup and fixed-k runs")
    chk.add_argument("--records", type=existing_path, default=str(STANDARD))
    chk.add_argument("--lookup", type=replay_folders, default=None, help="replay folders of transformers' prompt lookup under other seeds")
    chk.add_argument("--fixed", type=fixed_k, nargs="*", default=[], help="K=DIR,DIR,...: sampled fixed-k replay folders")
    chk.add_argument("--max-new-tokens", type=positive_int, default=64)
    args = parser.parse_args(argv)
    if args.command == "check":
        check_command(args)
    elif args.command == "simulate":
        apply_threads(args.threads)
        simulate(args)
    elif args.command == "compare":
        compare_command(args)
    elif args.command == "paths":
        paths_command(args)
    else:
        table_command(args)


if __name__ == "__main__":
    main()
