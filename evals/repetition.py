"""Repetition across calls (issue 39): n sampled answers to one prompt, hf_specdec alone against
hf_specdec with one shared `hf_specdec.RetrievalCache`, modelled under a cost table.

    python evals/repetition.py --out runs/repetition          # both workloads, 5 prompts x 8 samples x 2 methods
    python evals/repetition.py --out runs/repetition --reprice evals/results/gpu-handwritten/cost_table.json
    python evals/repetition.py --out runs/rep-smoke --limit 1 --samples 2 --max-new-tokens 8   # a quick look
    python evals/repetition.py --target tiny --draft tiny --out runs/rep-tiny --limit 1 --samples 2   # offline

Two workloads that repeat across calls, each run sequentially (n separate generate calls a prompt,
sample i seeded with torch.manual_seed(seed + i)):

* pass_at_k: the report-split HumanEval problems the standard preset picks (5, evenly spaced, as
  `common.load_prompts` picks them), each problem's prompt continued as the HumanEval harness does
  (`--humaneval-chat`: the eval's chat-formatted prompt instead), temperature 0.8, top-p 0.95;
* self_consistency: the report-split Spec-Bench math_reasoning prompts the standard preset picks,
  chat-formatted, temperature 0.7, top-p 1.0.

Methods: `hf_specdec` (default settings, each call alone) and `hf_specdec+cache` (one RetrievalCache a
workload, shared by every call of every prompt in order: sample 2 of a prompt retrieves from sample 1).
hf_specdec's costs are pinned from the first `--cost-table` as `evals/replay.py` pins them (same window
and mode), so a run repeats exactly; its work is priced with that table (engine "hf_specdec"). Plain
sampling is not run: its work for a call's number of new tokens is known (a prefill of the prompt,
then one one-token target forward per further token at the growing context), priced with engine
"transformers". Modelled speedup = (tokens / method's modelled s) / (tokens / plain's modelled s).
Further tables (`--cost-table` again, or `--reprice`) reprice the same work; hf_specdec's choices were
made under the first. A position is priced at the table's row for the workload where it has one
(`--measure-positions`: timed with the processors generate() builds for its calls, top-k 50 included),
else at its "sampling" row (`evals/results/top-k-positions/cost_table.json` times it as the standard
preset's calls run, with top-k 50; older tables timed it without, a full-vocabulary sort).

Both workloads sample with top-k 50 as well: transformers' generate() adds it to do_sample=True unless
top_k is given, and every run of this script has drawn its samples so. It matters to the prices:
after top-k, hf_specdec's top-p sorts 50 entries (`SparseTopPLogitsWarper`), transformers' still
sorts the whole vocabulary (`evals/results/workload-positions/`).

pass@k (pass_at_k only): the problem's prompt, then the completion cut at the first top-level
"\\ndef ", "\\nclass ", "\\nif __name__" or "\\nprint(" (the HumanEval harness's stop sequences; with
`--humaneval-chat`, the code of the answer's first ``` block, cut after the function it restates), then
the problem's test and `check(entry_point)`, run by `python -I -c` in a temporary folder with a
timeout and a memory limit, a pass only where check() returned (`passes`; model-written code, not
sandboxed: `--no-execute` skips it). Unbiased estimator
1 - C(n-c, k) / C(n, k), for k = 1 and k = n.

Writes <out>/records.jsonl (one line per call) and <out>/results.md (also printed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import hf_specdec  # noqa: E402
from common import (  # noqa: E402
    HUMANEVAL, MODES, ForwardTimer, add_options, apply_threads, load_pair, load_prompts, speedup_over_plain, with_scored,
    cost_table_file, out_folder, positive_int,
)
import costs  # noqa: E402
from costs import CostTable, load_table, plain_work  # noqa: E402
from run_eval import PRESETS  # noqa: E402

MODE = "sampling"  # the cost table's row that prices positions and pins hf_specdec's costs
METHODS = ("hf_specdec", "hf_specdec+cache")
STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(")  # the HumanEval harness's stop sequences
REPORT_PROMPTS = PRESETS["standard"].prompts_per_category  # the standard preset's prompts per category (5)
DEFAULT_TABLE = HERE / "results" / "top-k-positions" / "cost_table.json"  # positions timed as the calls run


@dataclass(frozen=True)
class Workload:
    name: str
    category: str  # common.CATEGORIES
    temperature: float
    top_p: float
    top_k: int | None = 50  # transformers' default for generate(do_sample=True), which every run has used

    def sampling(self) -> dict:
        """generate()'s sampling arguments for this workload, every processor named (none left to defaults)."""
        return dict(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


WORKLOADS = {
    "pass_at_k": Workload("pass_at_k", "humaneval", 0.8, 0.95),
    "self_consistency": Workload("self_consistency", "math_reasoning", 0.7, 1.0),
}


# ---------------------------------------------------------------- pricing


def position_mode(table: CostTable, workload: str) -> str:
    """The table's row that prices one of `workload`'s positions: its own, measured with its processors
    (`--measure-positions`), else the "sampling" row."""
    return workload if workload in table.position else MODE


def price(record: dict, table: CostTable) -> tuple[float, float]:
    """(hf_specdec's modelled seconds, plain's modelled seconds for the same number of new tokens)."""
    mode = position_mode(table, record["workload"])
    ours = table.modelled_seconds(record["work"], mode, "hf_specdec")
    plain = table.modelled_seconds(plain_work(record["prompt_tokens"], record["new_tokens"]), mode, "transformers")
    return ours, plain


# ---------------------------------------------------------------- pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator: 1 - C(n - c, k) / C(n, k), for c of n samples passing."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def code_of(completion: str) -> str:
    """The code of an answer: its first ``` block (to the closing fence or the end), else the whole."""
    if "```" not in completion:
        return completion
    after = completion.split("```", 1)[1]
    after = after.split("\n", 1)[1] if "\n" in after else ""  # drop the fence's language tag
    return after.split("```", 1)[0]


def cut_at_stops(code: str, start: int = 0) -> str:
    """`code` up to the first stop sequence found from `start` on."""
    ends = [i for i in (code.find(stop, start) for stop in STOPS) if i >= 0]
    return code[: min(ends)] if ends else code


def program(problem: dict, completion: str, chat: bool = False) -> str:
    """The problem's prompt, the completion cut at the stop sequences (and at a closing fence), the
    test and its call. `chat`: the completion answers the chat-formatted prompt: its code is its first
    ``` block, and an answer restating the function (a chat model's usual answer) is cut after it."""
    entry = problem["entry_point"]
    if not chat:
        body = problem["prompt"] + cut_at_stops(completion).split("\n```", 1)[0]
    else:
        code = code_of(completion)
        at = code.find(f"def {entry}(")
        body = problem["prompt"] + ("\n" + cut_at_stops(code, at) if at >= 0 else cut_at_stops(code))
    return body + "\n" + problem["test"] + f"\ncheck({entry})\n"


def _limits() -> None:  # in the child, before it runs: memory, CPU time and the size of what it writes
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    resource.setrlimit(resource.RLIMIT_CPU, (20, 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))  # its output goes to a file


def passes(source: str, timeout: float = 10.0) -> bool:
    """Whether `python -I -c source` runs to its end within `timeout`, in a fresh temporary folder:
    exits 0 having printed a sentinel appended after `source` (for a program, after `check(...)`
    returned), as the HumanEval harness counts a pass only where the check ran. A completion that
    exits 0 before the check (`exit(0)`, `sys.exit(0)`, `os._exit(0)` at top level) fails. The child
    runs in a session of its own, and its whole process group is killed once it exits or times out
    (children it forked do not linger). Not a sandbox: the code runs as this user, with memory and CPU
    limits only (it can write files elsewhere or signal other processes); isolating it fully (a
    container) is out of scope."""
    sentinel = f"check ran to completion {secrets.token_hex(8)}"
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryFile() as output:  # a file: no pipe a child holds
        child = subprocess.Popen([sys.executable, "-I", "-c", f"{source}\nprint({sentinel!r})\n"], cwd=folder,
                                 stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.DEVNULL,
                                 env={"PATH": os.environ.get("PATH", "")}, start_new_session=True,
                                 preexec_fn=_limits if os.name == "posix" else None)
        exited = _exited(child, timeout)
        if os.name == "posix":
            try:
                os.killpg(child.pid, signal.SIGKILL)  # before the child is reaped: its group id is still its own
            except ProcessLookupError:
                pass
        else:
            child.kill()
        code = child.wait()
        output.seek(0)
        return exited and code == 0 and sentinel.encode() in output.read()


def _exited(child: subprocess.Popen, timeout: float) -> bool:
    """Whether `child` exits within `timeout`; on POSIX it is left unreaped (its pid, its process
    group's id, cannot be reused until it is)."""
    if not hasattr(os, "waitid"):
        try:
            child.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    deadline = time.monotonic() + timeout
    while os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


# ---------------------------------------------------------------- running


def one_call(target, draft, prompt: dict, workload: Workload, table: CostTable, max_new_tokens: int, timers: dict,
             cache, seed: int) -> dict:
    """One hf_specdec call with costs pinned from `table` as evals/replay.py pins them; its record."""
    ids = torch.tensor([prompt["input_ids"]])
    window = hf_specdec.SpeculativeConfig().window_for(True)
    pins = table.pinned_costs(ids.shape[1], "hf", window, position_mode(table, workload.name))
    extra = {} if cache is None else dict(retrieval_cache=cache)
    rounds = []
    for timer in timers.values():
        timer.take()
    torch.manual_seed(seed)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **workload.sampling(),
                          custom_generate=hf_specdec.speculative_generate, assistant=draft, return_dict_in_generate=True,
                          acceptance_sink=rounds.append, **pins, **extra)
    work = with_scored({name: w for name, (_, w) in ((n, t.take_with_work()) for n, t in timers.items()) if w}, rounds)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    return dict(prompt_tokens=ids.shape[1], new_tokens=len(tokens), tokens=tokens, work=work,
                target_forwards=len(work.get("target", [])), rounds=len(rounds),
                cache_rounds=sum(r.retrieval == "cache" for r in rounds),
                ngram_rounds=sum(r.retrieval == "ngram" for r in rounds),
                # per round: what it verified (the draft's chain, or the retrieval source), its length, how many kept
                log=[[r.retrieval or r.source, len(r.draft_tokens), r.num_accepted] for r in rounds])


def finish_record(record: dict, prompt: dict, tokenizer, tables: dict[str, CostTable], execute: bool) -> dict:
    """A call's record completed: its text, whether its program passes (HumanEval), its prices."""
    record["text"] = None if tokenizer is None else tokenizer.decode(record["tokens"], skip_special_tokens=True)
    record["passed"] = None
    if execute and record["text"] is not None and "problem" in prompt:
        record["passed"] = passes(program(prompt["problem"], record["text"], prompt.get("chat", True)))
    record["modelled"] = {label: dict(zip(("hf_specdec", "plain"), price(record, t))) for label, t in tables.items()}
    first = record["modelled"][next(iter(tables))]
    record["modelled_seconds"], record["plain_modelled_seconds"] = first["hf_specdec"], first["plain"]
    return record


def run_method(target, draft, tokenizer, prompts: list[dict], workload: Workload, method: str,
               tables: dict[str, CostTable], settings: dict, timers: dict, sink) -> tuple[list[dict], dict]:
    """Every call of `method` on `workload`: n samples a prompt, prompts in order; (records, run)."""
    cache = hf_specdec.RetrievalCache() if method == "hf_specdec+cache" else None
    pin = next(iter(tables.values()))
    records, start = [], time.perf_counter()
    for prompt in prompts:
        for sample in range(settings["samples"]):
            began = time.perf_counter()
            record = one_call(target, draft, prompt, workload, pin, settings["max_new_tokens"], timers, cache,
                              settings["seed"] + sample)
            record = dict(workload=workload.name, id=prompt["id"], sample=sample, method=method, **record)
            records.append(finish_record(record, prompt, tokenizer, tables, settings["execute"]))
            sink(record)
            print(f"{workload.name} {method} {prompt['id']} sample {sample}: {record['new_tokens']} tokens, "
                  f"{record['rounds']} rounds ({record['cache_rounds']} cache), {record['modelled_seconds']:.2f} s "
                  f"modelled, passed {record['passed']}, {time.perf_counter() - began:.1f} s wall", file=sys.stderr,
                  flush=True)
    run = dict(workload=workload.name, method=method, wall_seconds=time.perf_counter() - start,
               cache_tokens=None if cache is None else len(cache),
               cache_bytes=None if cache is None else cache.memory_bytes())
    return records, run


def run_all(target, draft, tokenizer, prompts: dict[str, list[dict]], tables: dict[str, CostTable], samples: int = 8,
            max_new_tokens: int = 128, seed: int = 0, execute: bool = True, sink=None,
            methods=METHODS) -> tuple[list[dict], list[dict]]:
    """Both methods on each workload of `prompts` ({workload name: prompts}); (records, runs). The
    first table pins hf_specdec's costs; every table prices the work. `tokenizer` None: no texts."""
    timers = {"target": ForwardTimer(target), "hf": ForwardTimer(draft)}
    settings = dict(samples=samples, max_new_tokens=max_new_tokens, seed=seed, execute=execute)
    records, runs = [], []
    for name, workload_prompts in prompts.items():
        for method in methods:
            done, run = run_method(target, draft, tokenizer, workload_prompts, WORKLOADS[name], method, tables,
                                   settings, timers, sink or (lambda record: None))
            records += done
            runs.append(run)
    return records, runs


# ---------------------------------------------------------------- figures


def figures(records: list[dict], run: dict, labels: list[str]) -> dict:
    """One method on one workload: totals, speedups over plain per table, cache, pass@k."""
    calls = [r for r in records if r["workload"] == run["workload"] and r["method"] == run["method"]]
    tokens, forwards = sum(r["new_tokens"] for r in calls), sum(r["target_forwards"] for r in calls)
    rounds = sum(r["rounds"] for r in calls)
    out = dict(run, calls=len(calls), new_tokens=tokens, target_forwards=forwards, rounds=rounds,
               cache_round_share=sum(r["cache_rounds"] for r in calls) / max(1, rounds),
               tokens_per_target_forward=tokens / max(1, forwards), speedup={}, median_speedup={})
    by_prompt = {}
    for r in calls:
        by_prompt.setdefault(r["id"], []).append(r)
    for label in labels:
        out["speedup"][label] = _speedup(calls, label)
        per_prompt = [v for v in (_speedup(rs, label) for rs in by_prompt.values()) if v is not None]
        out["median_speedup"][label] = statistics.median(per_prompt) if per_prompt else None
    passed = {pid: [r["passed"] for r in rs] for pid, rs in by_prompt.items()}
    if calls and all(p is not None for ps in passed.values() for p in ps):
        n = min(len(ps) for ps in passed.values())
        out["pass@1"] = statistics.mean(pass_at_k(len(ps), sum(ps), 1) for ps in passed.values())
        out[f"pass@{n}"] = statistics.mean(pass_at_k(len(ps), sum(ps), n) for ps in passed.values())
    return out


def _speedup(calls: list[dict], label: str) -> float | None:
    """Pooled over `calls`: tokens per modelled second against plain's for the same tokens."""
    tokens = sum(r["new_tokens"] for r in calls)
    ours, plain = (sum(r["modelled"][label][k] for r in calls) for k in ("hf_specdec", "plain"))
    return speedup_over_plain(tokens, ours, tokens, plain) if tokens and ours > 0 and plain > 0 else None


def _cell(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def table_lines(rows: list[dict], labels: list[str]) -> list[str]:
    """A markdown table: one row per workload and method."""
    passes_k = sorted({k for r in rows for k in r if k.startswith("pass@")}, key=lambda k: int(k[5:]))
    head = (["workload", "method", "calls", "new tokens", "target forwards", "tokens / target forward",
             "rounds verifying the cache"] + [f"speedup ({label}) overall / median over prompts" for label in labels]
            + passes_k + ["cache tokens", "cache MB", "wall s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["workload"], r["method"], str(r["calls"]), str(r["new_tokens"]), str(r["target_forwards"]),
                 _cell(r["tokens_per_target_forward"]), f"{100 * r['cache_round_share']:.0f}%"]
        cells += [f"{_cell(r['speedup'][label])} / {_cell(r['median_speedup'][label])}" for label in labels]
        cells += [_cell(r.get(k), ".3f") for k in passes_k]
        cells += [_cell(r["cache_tokens"], "d"), _cell(None if r["cache_bytes"] is None else r["cache_bytes"] / 1e6),
                  f"{r['wall_seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(records: list[dict], runs: list[dict], table_paths: dict[str, str], command: str) -> tuple[str, list[dict]]:
    """results.md's text and its rows."""
    labels = list(table_paths)
    rows = [figures(records, run, labels) for run in runs]
    pin = labels[0]
    notes = [
        "# Repetition across calls: n samples a prompt, hf_specdec alone and with a shared RetrievalCache", "",
        f"Command: `{command}`", "",
        f"Cost tables: " + ", ".join(f"{label} = `{path}`" for label, path in table_paths.items()) + ". hf_specdec's "
        f"costs were pinned from {pin}: its choices were made under {pin}"
        + (", and the other tables reprice the same work (they do not replay it)." if len(labels) > 1 else "."),
        "Plain sampling was not run: its modelled time is the known work of plain decoding (a prefill, then one "
        "one-token target forward per further token) for the same number of new tokens as each call, priced with "
        "engine \"transformers\". Speedup = (tokens / method's modelled s) / (tokens / plain's modelled s); median "
        "over prompts pools each prompt's samples. Each position is priced at the table's row for the workload where "
        "it has one (timed with the workload's processors), else at its \"sampling\" row.",
        "Sampled outputs differ between the methods (each call draws its own tokens); pass@k shows both produce "
        "answers of the same quality. \"rounds verifying the cache\": rounds whose retrieved tokens came from the "
        "RetrievalCache (RoundRecord.retrieval == \"cache\"). pass_at_k continues each HumanEval problem's prompt "
        "(the harness's way) unless the command has --humaneval-chat. Wall seconds are informational.", "",
    ]
    return "\n".join(notes + table_lines(rows, labels)) + "\n", rows


def repetition_run(text: str) -> str:
    """argparse type for --lookup-on: a folder this script wrote (its records.jsonl, one per call, by workload)."""
    records = Path(text) / "records.jsonl"
    try:
        first = json.loads(records.open().readline() or "{}")
    except (OSError, ValueError) as error:
        raise argparse.ArgumentTypeError(f"{text}: no readable records.jsonl of evals/repetition.py ({error})") from None
    if "workload" not in first:
        raise argparse.ArgumentTypeError(f"{text}: its records.jsonl is not evals/repetition.py's (no 'workload')")
    return text


def lookup_on_outputs(folder: Path, prompts: dict[str, list[dict]], tables: dict[str, CostTable], target,
                      max_new_tokens: int) -> str:
    """A markdown table: per workload and method of `folder`'s records, the method's speedup over plain
    and transformers' prompt lookup's (prompt_lookup_num_tokens=10) on the same outputs, per table."""
    from regimes import eos_and_vocab, lookup_work

    eos, vocab = eos_and_vocab(target)
    by_id = {(name, p["id"]): p for name, ps in prompts.items() for p in ps}
    totals: dict = {}  # (workload, method) -> table -> [method s, prompt lookup s, plain s]
    for r in map(json.loads, open(folder / "records.jsonl")):
        prompt, workload = by_id.get((r["workload"], r["id"])), WORKLOADS[r["workload"]]
        if prompt is None or not r["new_tokens"]:
            continue
        if len(prompt["input_ids"]) != r["prompt_tokens"]:
            raise SystemExit(f"{folder}: {r['id']} was run on a {r['prompt_tokens']}-token prompt, these options build "
                             f"one of {len(prompt['input_ids'])}: pass the run's own options (--humaneval-chat)")
        work = lookup_work(prompt["input_ids"], r["tokens"], MODE, eos, vocab, max_new_tokens, (workload.temperature, workload.top_p))
        for label, table in tables.items():
            cell = totals.setdefault((r["workload"], r["method"]), {}).setdefault(label, [0.0, 0.0, 0.0])
            ours, plain = price(r, table)
            lookup = table.modelled_seconds(work, position_mode(table, r["workload"]), "transformers")
            cell[0], cell[1], cell[2] = cell[0] + ours, cell[1] + lookup, cell[2] + plain
    labels = list(tables)
    lines = [f"Speedup over plain sampling on the outputs of `{folder}` ({', '.join(labels)}): the method as run, and "
             "transformers' prompt lookup on the same outputs", "",
             "| workload | method | " + " | ".join(f"method ({x}) | prompt lookup ({x})" for x in labels) + " |",
             "|---|---|" + "---|---|" * len(labels)]
    for (workload, method), cells in totals.items():
        lines.append(f"| {workload} | {method} | " + " | ".join(f"{c[2] / c[0]:.2f} | {c[2] / c[1]:.2f}" for c in cells.values()) + " |")
    return "\n".join(lines) + "\n"


def measure_positions(table: CostTable, workloads: list[str], target, tokenizer, path: Path, repeats: int = 5) -> None:
    """`table` with a position row per workload (`position_mode`) and its "sampling" row (the standard
    preset's sampling calls) timed anew: each with the processors generate() builds for those calls
    (`costs.generate_processors`: top-k 50 included where a call leaves top_k out), over the target's
    real logits at recorded positions (`costs.recorded_logits`), the median of `repeats` timings of
    30 positions each; written to `path`."""
    logits = costs.recorded_logits(target, tokenizer)
    calls = {**{name: WORKLOADS[name].sampling() for name in workloads}, "sampling": MODES["sampling"]}
    for name, kwargs in calls.items():
        pickers = costs.position_pickers(target, kwargs)
        timings = [costs.position_seconds(pickers, logits.shape[-1], target.device, reps=30, logits=logits)
                   for _ in range(repeats)]
        table.position[name] = {engine: statistics.median(t[engine] for t in timings) for engine in pickers}
        print(f"{name}: " + ", ".join(f"{e} {s * 1000:.2f} ms" for e, s in table.position[name].items()), flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    table.save(path)


# ---------------------------------------------------------------- the script


def workload_prompts(tokenizer, names: list[str], limit: int | None,
                     humaneval_chat: bool = False, held_out: bool = False) -> dict[str, list[dict]]:
    """Per workload, its report-split prompts as the standard preset picks them (the first `limit`),
    chat-formatted (`common.load_prompts`); `held_out`: `limit` (default 5) of the report split's other
    prompts instead, evenly spaced, none of them a preset's. HumanEval prompts carry their problem
    (prompt, test, entry point) and, unless `humaneval_chat`, are the problem's prompt alone, to be
    continued (the harness's way)."""
    problems = {p["task_id"]: p for p in map(json.loads, HUMANEVAL.read_text().splitlines())}
    out = {}
    for name in names:
        category = WORKLOADS[name].category
        prompts = load_prompts(tokenizer, [category], REPORT_PROMPTS, "report")  # the standard preset's (quick's too)
        if held_out:
            preset = {p["id"] for p in prompts}
            pool = [p for p in load_prompts(tokenizer, [category], None, "report") if p["id"] not in preset]
            n = min(limit or REPORT_PROMPTS, len(pool))
            prompts = [pool[(2 * i + 1) * len(pool) // (2 * n)] for i in range(n)]
        prompts = prompts[:limit]
        for prompt in (p for p in prompts if p["id"] in problems):
            prompt.update(problem=problems[prompt["id"]], chat=humaneval_chat)
            if not humaneval_chat:
                prompt["input_ids"] = tokenizer(problems[prompt["id"]]["prompt"])["input_ids"]
        out[name] = prompts
    return out


def table_labels(paths: list[str]) -> dict[str, str]:
    """{label: path}: each table named by its folder (made unique by position when folders repeat)."""
    labels = {}
    for i, path in enumerate(paths):
        label = Path(path).resolve().parent.name or f"table{i + 1}"
        labels[label if label not in labels else f"{label}#{i + 1}"] = _shown(path)
    return labels


def _shown(path: str) -> str:
    """`path` relative to the repository when inside it (as results.md cites it)."""
    try:
        return Path(path).resolve().relative_to(HERE.parent).as_posix()
    except ValueError:
        return str(Path(path).resolve())


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Repetition across calls (issue 39): hf_specdec alone and with a shared RetrievalCache, "
                    "modelled under a cost table.",
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, "target", "draft", "threads")
    parser.add_argument("--out", type=out_folder, required=True, help="the folder records.jsonl and results.md are written to")
    parser.add_argument("--cost-table", type=cost_table_file, action="append", default=None,
                        help=f"a cost_table.json (default {DEFAULT_TABLE.relative_to(HERE.parent)}); the first pins "
                             "hf_specdec's costs, each one given again reprices the same work")
    parser.add_argument("--reprice", type=cost_table_file, action="append", default=[], help="another table to reprice the work with")
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="run these only (a variant of the library against a recorded run: its cached method)")
    parser.add_argument("--samples", type=positive_int, default=8, help="samples a prompt (n)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--limit", type=positive_int, default=None, help="at most this many prompts a workload")
    parser.add_argument("--held-out", action="store_true",
                        help="report-split prompts no preset uses (evenly spaced; --limit of them, default 5) instead "
                             "of the standard preset's: a lever's check on prompts it was not tuned on")
    parser.add_argument("--seed", type=int, default=0, help="sample i is seeded with seed + i")
    parser.add_argument("--eager-prices", action="store_true",
                        help="pin costs without Costs.position (the planner prices every sampled position, as before the "
                             "lazy pricing); the work is modelled the same way")
    parser.add_argument("--measure-positions", action="store_true",
                        help="no generation: time one position of each workload's processors (transformers' and "
                             "hf_specdec's) on this machine; write the first cost table with those rows added to "
                             "OUT/cost_table.json")
    parser.add_argument("--no-execute", action="store_true", help="do not run the HumanEval programs (no pass@k)")
    parser.add_argument("--humaneval-chat", action="store_true",
                        help="pass_at_k on the chat-formatted HumanEval prompts of the eval (the answer restates the "
                             "~130-token signature and docstring, so 128 new tokens seldom reach the body) instead of "
                             "the problem's prompt continued, as the HumanEval harness does")
    parser.add_argument("--lookup-on", type=repetition_run, default=None, metavar="DIR",
                        help="no generation: transformers' prompt lookup priced on the outputs of DIR/records.jsonl "
                             "(its rounds are fixed by the output: evals/regimes.py lookup_work), beside each method there")
    args = parser.parse_args(argv)
    costs.PIN_POSITION = not args.eager_prices
    if args.samples < 1 or args.max_new_tokens < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--samples, --max-new-tokens and --limit must be at least 1")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    apply_threads(args.threads)
    paths = table_labels([*(args.cost_table or [str(DEFAULT_TABLE)]), *args.reprice])
    tables = {label: load_table(HERE.parent / path) for label, path in paths.items()}
    target, draft, tokenizer = load_pair(args.target, args.draft, "cpu")  # bf16 as loaded, as evals/replay.py
    prompts = workload_prompts(tokenizer, args.workloads, args.limit, args.humaneval_chat, args.held_out)
    if args.lookup_on:
        text = lookup_on_outputs(Path(args.lookup_on), prompts, tables, target, args.max_new_tokens)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "lookup.md").write_text(text)
        print(text)
        return []
    if args.measure_positions:
        measure_positions(tables[next(iter(tables))], args.workloads, target, tokenizer, Path(args.out) / "cost_table.json")
        return []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "records.jsonl", "w") as sink:
        records, runs = run_all(target, draft, tokenizer, prompts, tables, args.samples, args.max_new_tokens,
                                args.seed, not args.no_execute,
                                lambda record: (sink.write(json.dumps(record) + "\n"), sink.flush()), args.methods)
    command = "python evals/repetition.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text, rows = report(records, runs, paths, command)
    (out / "results.md").write_text(text)
    print(text)
    return rows


if __name__ == "__main__":
    main()
