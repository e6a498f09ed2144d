"""Repetition inside one call (issue 39): n samples of a prompt as n rows of one batch, or as a stream
through `generate_continuous`, timed on the wall clock against plain batched sampling.

    python evals/repetition_wall.py --out runs/rep-wall --limit 1 --samples 8 --max-new-tokens 128
    python evals/repetition_wall.py --target tiny --draft tiny --out runs/rep-wall-tiny --limit 1 --samples 2 \\
        --max-new-tokens 8 --reps 1        # offline, a quick look

Why the wall clock: the cost tables (`evals/costs.py`) price one row; a forward over 8 rows is not
priced by them, so batched work is timed, not modelled. This machine is shared and has 2 cores: run
nothing beside it. Methods, per prompt, interleaved (the order rotates every repetition):

* `plain`: `model.generate` with the prompt repeated as n rows, sampling (transformers' own loop);
* `hf_specdec`: the same n rows through `speculative_generate`: the call's own retrieval cache lets
  each row retrieve from the other rows' text so far (a batch always has one);
* `hf_specdec+cache`: the same, with one `RetrievalCache` shared by every prompt's call and repetition
  (a later call retrieves from all earlier ones, as a server reusing one cache would);
* `continuous` (`--continuous`): every prompt's n samples as one stream through
  `hf_specdec.generate_continuous(max_batch_size=n)` (which shares one cache across the stream), timed
  once a repetition against the sum of that repetition's plain calls.

`--sequential` times the other shape of issue 39's pass_at_k target: each sample its own one-row call
(plain; hf_specdec; hf_specdec with one RetrievalCache shared by every call of the workload, in order),
the three interleaved call by call, their order rotating; speedups are pooled and, per sample, a
geometric mean of paired ratios with a 95% interval. The sampling arguments are the workload's
(`repetition.Workload.sampling`: top-k 50 named, as generate() adds it).

hf_specdec's draft is weight-only int8 in groups of 32 (`--draft-bits`; 16: as loaded), as the CLI
quantizes it by default and as the standard preset's hf_specdec ran it: it is the draft the cost tables'
"hf" row times, the row `evals/repetition.py` prices the draft's steps at (that script runs the draft as
loaded, whose tokens differ from the int8 draft's only by rounding).

Each method first runs once untimed (8 new tokens), then each call is seeded with
torch.manual_seed(seed + repetition). Tokens: each row's new tokens up to
and including its first EOS (plain pads the rest). Rate = tokens / wall seconds; speedup = a method's
pooled rate over plain's, per workload; intervals are the min-max over repetitions. hf_specdec's
costs are measured online (the default; a batch's forwards are not in the pinned single-row prices).
pass@k is computed from the outputs (HumanEval tests run as `evals/repetition.py` runs them).

Writes <out>/records.jsonl (one line per call) and <out>/results.md (also printed).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import hf_specdec  # noqa: E402
from common import add_options, apply_threads, hf_draft, load_pair  # noqa: E402
from repetition import WORKLOADS, pass_at_k, passes, program, workload_prompts  # noqa: E402

BATCHED = ("plain", "hf_specdec", "hf_specdec+cache")  # also --sequential's, one row a call


def rotated(methods, turn: int) -> list:
    """`methods` starting at `turn` (modulo their count): no method always first."""
    k = turn % len(methods)
    return list(methods[k:]) + list(methods[:k])


def row_tokens(rows: torch.Tensor, eos: set[int]) -> list[list[int]]:
    """Each row's new tokens up to and including its first EOS."""
    out = []
    for row in rows.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.append(row[:end])
    return out


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])


def batched_call(target, draft, prompt: dict, workload, method: str, n: int, max_new_tokens: int, seed: int,
                 cache) -> tuple[list[list[int]], float]:
    """One call of `method` with the prompt as n rows: (each row's tokens, wall seconds)."""
    ids = torch.tensor([prompt["input_ids"]] * n)
    kwargs = dict(max_new_tokens=max_new_tokens, **workload.sampling())
    if method != "plain":
        kwargs.update(custom_generate=hf_specdec.speculative_generate, assistant=draft)
        if cache is not None:
            kwargs["retrieval_cache"] = cache
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    seconds = time.perf_counter() - start
    return row_tokens(out[:, ids.shape[1]:], eos_ids(target)), seconds


def continuous_call(target, draft, prompts: list[dict], workload, n: int, max_new_tokens: int,
                    seed: int) -> tuple[list[tuple[str, list[int]]], float]:
    """Every prompt's n samples as one stream: ([(prompt id, tokens)], wall seconds)."""
    stream = [p["input_ids"] for p in prompts for _ in range(n)]
    torch.manual_seed(seed)
    start = time.perf_counter()
    results = hf_specdec.generate_continuous(target, stream, assistant=draft, max_batch_size=n,
                                             max_new_tokens=max_new_tokens, **workload.sampling())
    seconds = time.perf_counter() - start
    eos = eos_ids(target)
    owners = [p["id"] for p in prompts for _ in range(n)]
    return [(owners[r.index], row_tokens(r.tokens[None], eos)[0]) for r in results], seconds


def run_sequential(target, draft, tokenizer, prompts: dict[str, list[dict]], args, sink) -> list[dict]:
    """`--sequential`: each prompt's n samples as n one-row calls (sample i seeded with seed + i), the
    methods interleaved call by call (their order rotating each sample); hf_specdec+cache shares one
    RetrievalCache across every call of the workload, in order."""
    records = []
    for name, workload_prompts_ in prompts.items():
        workload, shared = WORKLOADS[name], hf_specdec.RetrievalCache()
        problems = {p["id"]: p for p in workload_prompts_ if "problem" in p}
        for method in BATCHED:  # untimed: a process's first calls are slower
            batched_call(target, draft, workload_prompts_[0], workload, method, 1, min(8, args.max_new_tokens),
                         args.seed, None)
        for turn, (prompt, sample) in enumerate((p, i) for p in workload_prompts_ for i in range(args.samples)):
            for method in rotated(BATCHED, turn):
                cache = shared if method == "hf_specdec+cache" else None
                toks, seconds = batched_call(target, draft, prompt, workload, method, 1, args.max_new_tokens,
                                             args.seed + sample, cache)
                rec = record_of(workload, method, prompt["id"], 0, toks, seconds, tokenizer, problems,
                                not args.no_execute)
                rec["sample"] = sample
                records.append(rec)
                sink(rec)
                print(f"{name} {method} {prompt['id']} sample {sample}: {rec['new_tokens']} tokens in {seconds:.1f} s",
                      file=sys.stderr, flush=True)
        print(f"{name}: the shared cache holds {len(shared)} tokens, {shared.memory_bytes() / 1e6:.2f} MB",
              file=sys.stderr, flush=True)
    return records


def paired(records: list[dict], method: str) -> str:
    """`--sequential`: the geometric mean over samples of (method's tokens / s) / (plain's) on the same
    prompt and seed, with a 95% interval (normal, on the logs)."""
    rate = {(r["id"], r["sample"]): r["new_tokens"] / r["seconds"] for r in records if r["method"] == "plain"}
    logs = [math.log(r["new_tokens"] / r["seconds"] / rate[r["id"], r["sample"]]) for r in records
            if r["method"] == method and (r["id"], r["sample"]) in rate]
    if not logs:
        return "-"
    mean = statistics.mean(logs)
    half = 1.96 * (statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0)
    return f"{math.exp(mean):.2f}x [{math.exp(mean - half):.2f}, {math.exp(mean + half):.2f}]"


def record_of(workload, method: str, prompt_id, rep: int, tokens: list[list[int]], seconds: float, tokenizer,
              problems: dict, execute: bool) -> dict:
    texts = [None if tokenizer is None else tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    passed = None
    if execute and prompt_id in problems and tokenizer is not None:
        prompt = problems[prompt_id]
        passed = [passes(program(prompt["problem"], text, prompt.get("chat", False))) for text in texts]
    return dict(workload=workload.name, method=method, id=prompt_id, rep=rep, rows=len(tokens),
                new_tokens=sum(map(len, tokens)), seconds=seconds, tokens=tokens, texts=texts, passed=passed)


def run(target, draft, tokenizer, prompts: dict[str, list[dict]], args, sink) -> list[dict]:
    records = []
    for name, workload_prompts_ in prompts.items():
        workload = WORKLOADS[name]
        problems = {p["id"]: p for p in workload_prompts_ if "problem" in p}
        shared = hf_specdec.RetrievalCache()
        methods = list(BATCHED) + (["continuous"] if args.continuous else [])
        for method in BATCHED:  # untimed: the first batched forwards of a process are slower (allocations)
            batched_call(target, draft, workload_prompts_[0], workload, method, args.samples,
                         min(8, args.max_new_tokens), args.seed, None)
        for rep in range(args.reps):
            for method in rotated(methods, rep):
                if method == "continuous":
                    done, seconds = continuous_call(target, draft, workload_prompts_, workload, args.samples,
                                                    args.max_new_tokens, args.seed + rep)
                    by_prompt: dict = {}
                    for pid, toks in done:
                        by_prompt.setdefault(pid, []).append(toks)
                    total = sum(len(t) for _, t in done)
                    for pid, toks in by_prompt.items():  # the stream's seconds shared by tokens
                        rec = record_of(workload, method, pid, rep, toks, seconds * sum(map(len, toks)) / max(1, total),
                                        tokenizer, problems, not args.no_execute)
                        records.append(rec)
                        sink(rec)
                    print(f"{name} continuous rep {rep}: {total} tokens in {seconds:.1f} s", file=sys.stderr, flush=True)
                    continue
                for prompt in workload_prompts_:
                    cache = shared if method == "hf_specdec+cache" else None
                    toks, seconds = batched_call(target, draft, prompt, workload, method, args.samples,
                                                 args.max_new_tokens, args.seed + rep, cache)
                    rec = record_of(workload, method, prompt["id"], rep, toks, seconds, tokenizer, problems,
                                    not args.no_execute)
                    records.append(rec)
                    sink(rec)
                    print(f"{name} {method} {prompt['id']} rep {rep}: {rec['new_tokens']} tokens in {seconds:.1f} s "
                          f"({rec['new_tokens'] / seconds:.1f}/s)", file=sys.stderr, flush=True)
    return records


def summary(records: list[dict]) -> tuple[str, list[dict]]:
    """Per workload and method: pooled tokens per second, speedup over plain (pooled; min-max over reps), pass@k."""
    rows, lines = [], []
    sequential = all("sample" in r for r in records)
    head = ["workload", "method", "calls", "new tokens", "tokens / s",
            "speedup over plain, pooled" + ("; per sample, geometric mean [95%]" if sequential else
                                            " batched (min-max over reps)"), "pass@1", "pass@n"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in dict.fromkeys(r["workload"] for r in records):
        mine = [r for r in records if r["workload"] == name]
        rate = lambda rs: sum(r["new_tokens"] for r in rs) / sum(r["seconds"] for r in rs)  # noqa: E731
        plain = [r for r in mine if r["method"] == "plain"]
        reps = sorted({r["rep"] for r in mine})
        for method in dict.fromkeys(r["method"] for r in mine):
            rs = [r for r in mine if r["method"] == method]
            per_rep = [rate([r for r in rs if r["rep"] == k]) / rate([r for r in plain if r["rep"] == k]) for k in reps
                       if any(r["rep"] == k for r in rs) and any(r["rep"] == k for r in plain)]
            row = dict(workload=name, method=method, calls=len(rs), new_tokens=sum(r["new_tokens"] for r in rs),
                       rate=rate(rs), speedup=rate(rs) / rate(plain), low=min(per_rep), high=max(per_rep))
            by_prompt: dict = {}
            for r in rs:
                if r["passed"] is not None:
                    by_prompt.setdefault((r["id"], r["rep"]), []).extend(r["passed"])
            if by_prompt:
                row["pass@1"] = statistics.mean(pass_at_k(len(v), sum(v), 1) for v in by_prompt.values())
                row["pass@n"] = statistics.mean(pass_at_k(len(v), sum(v), len(v)) for v in by_prompt.values())
            rows.append(row)
            cells = [name, method, str(row["calls"]), str(row["new_tokens"]), f"{row['rate']:.2f}",
                     f"{row['speedup']:.2f}x; {paired(mine, method)}" if sequential else
                     f"{row['speedup']:.2f}x ({row['low']:.2f}-{row['high']:.2f})",
                     *(f"{row[k]:.3f}" if k in row else "-" for k in ("pass@1", "pass@n"))]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, "target", "draft", "threads")
    parser.add_argument("--out", required=True)
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--samples", type=int, default=8, help="rows a prompt (n)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=1, help="prompts a workload")
    parser.add_argument("--reps", type=int, default=2, help="repetitions, methods interleaved (batched calls only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--continuous", action="store_true", help="also the whole stream through generate_continuous")
    parser.add_argument("--sequential", action="store_true",
                        help="each sample as its own one-row call instead of n rows (plain, hf_specdec, and hf_specdec "
                             "with one RetrievalCache shared by every call), interleaved call by call")
    parser.add_argument("--no-execute", action="store_true", help="do not run the HumanEval programs")
    parser.add_argument("--draft-bits", type=int, choices=(4, 8, 16), default=8,
                        help="hf_specdec's draft weight-only quantized to these bits, as the CLI's default and the standard "
                             "preset's hf_specdec (and the cost tables' \"hf\" row the modelled runs price it at); 16: as loaded")
    args = parser.parse_args(argv)
    if args.sequential and args.continuous:
        parser.error("--sequential (one-row calls) and --continuous (the n rows as a stream) time different shapes: give one")
    if min(args.samples, args.max_new_tokens, args.limit, args.reps) < 1:
        parser.error("--samples, --max-new-tokens, --limit and --reps must be at least 1")
    apply_threads(args.threads)
    target, draft, tokenizer = load_pair(args.target, args.draft, "cpu")
    draft = hf_draft(draft, args.draft_bits)  # plain never runs the draft
    prompts = workload_prompts(tokenizer, args.workloads, args.limit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "records.jsonl", "w") as sink:
        write = lambda r: (sink.write(json.dumps(r) + "\n"), sink.flush())  # noqa: E731
        records = (run_sequential if args.sequential else run)(target, draft, tokenizer, prompts, args, write)
    text, rows = summary(records)
    command = "python evals/repetition_wall.py " + " ".join(argv if argv is not None else sys.argv[1:])
    bits = "as loaded" if args.draft_bits == 16 else f"weight-only int{args.draft_bits} (groups of 32)"
    (out / "results.md").write_text(f"Command: `{command}`\n\nhf_specdec's draft: {bits}.\n\n" + text)
    print(text)
    return rows


if __name__ == "__main__":
    main()
