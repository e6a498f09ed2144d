"""Loop overhead as a benchmark: time a speculative decoding loop spends outside model forwards.

    python evals/overhead.py                                   # vocab 151936, k 5, 200 tokens, 3 repeats
    python evals/overhead.py --repeats 2 --out runs/overhead   # the figure quoted in BENCH.md
    python evals/overhead.py --profile                         # + where hf_specdec's own time goes
    python evals/overhead.py --baseline HEAD~1                 # + the library as it was at a git revision
    python evals/overhead.py --vocab 256 --max-new-tokens 20 --repeats 1   # seconds (the test)

On a GPU a 1.5B forward takes ~15 ms, so the time a speculative loop spends outside model forwards
(sampling, logits processors, cache bookkeeping, Python) decides how much of the acceptance turns
into speed there. This script measures it on a tiny target and a tiny draft built from configs (no
downloads) that keep the real Qwen vocabulary of 151,936 tokens, so every full-vocabulary operation
(softmax, top-p sort, argmax, one-hot, copies of [k, vocab] scores) costs what it costs on the real
pair, while a forward costs about a millisecond.

For greedy decoding and for sampling (T 0.7, top-p 0.95), interleaved per repeat (A B C A B C ...)
after one warm-up call each, it times three `generate` calls on the same random prompt:

* plain decoding, `target.generate(ids, max_new_tokens=N)`;
* transformers' assisted generation with a fixed k (`num_assistant_tokens=k`, schedule "constant",
  `assistant_confidence_threshold=0`, set on the draft's generation_config);
* hf_specdec with a fixed k and draft-model proposals only (`adaptive=False, ngram=False`).

Public forward hooks on both models (`evals/common.py`'s ForwardTimer) time every forward;
overhead = wall time of the generate call - time inside forwards, and a round is one target
forward (for plain decoding, one step). The table gives the overhead per round (median over
repeats), tokens per round and the ratio hf_specdec / transformers per mode; greedy also checks that
hf_specdec's output equals plain greedy. Writes <out>/overhead.json and <out>/overhead.md.

Target (issue 10): hf_specdec's overhead per round <= 0.5x transformers' overhead per round, in
both modes (`meets_target` in the json).

`--profile` runs hf_specdec once more per mode under cProfile, switched off inside every model
forward by the same hooks, and prints the 25 functions with the most self time outside forwards.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))  # evals/ is a folder of scripts

import hf_specdec  # noqa: E402
from common import MODES, ForwardTimer, add_options  # noqa: E402
from costs import sync  # noqa: E402
from tiny import perturbed  # noqa: E402

LIBRARIES = {"hf_specdec": hf_specdec}  # plus "baseline" (hf_specdec at --baseline REV) when asked for

QWEN_VOCAB = 151936
METHODS = ("plain", "transformers", "hf_specdec")
TARGET_RATIO = 0.5  # issue 10: hf_specdec <= 0.5x transformers' overhead per round
PAD_ID = 0


# ---------------------------------------------------------------- models


def tiny_pair(vocab: int, hidden: int, layers: int, noise: float, init: float, seed: int, device, dtype):
    """(target, draft): a Qwen2-shaped target from a config and the same weights plus Gaussian noise
    (as tests/conftest.py's `perturbed`), so the draft agrees often but not always. `init` is the
    weight std: 0.3 gives peaked next-token distributions. No EOS: every call emits N tokens."""
    torch.manual_seed(seed)
    heads = max(1, hidden // 16)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=8192,
        initializer_range=init, bos_token_id=1, eos_token_id=None, pad_token_id=PAD_ID,
    )
    target = Qwen2ForCausalLM(config).eval()
    draft = perturbed(target, noise, seed + 1)
    for model in (target, draft):
        model.generation_config.pad_token_id = PAD_ID
        model.generation_config.eos_token_id = None
    return target.to(device=device, dtype=dtype), draft.to(device=device, dtype=dtype)


def fix_assistant_length(draft, k: int) -> None:
    """Make transformers' assisted generation draft exactly k tokens every round.

    transformers 5.24 (generation/candidate_generator.py, AssistedCandidateGenerator) deep-copies the
    draft's generation_config per call and fills only the fields that are None with its defaults
    (num_assistant_tokens 20, schedule "constant", confidence threshold 0.4): the draft length is
    `num_assistant_tokens`, changed between rounds only by the "heuristic" schedules; a threshold
    > 0 adds a ConfidenceCriteria that stops drafting early (and, with sklearn, retunes itself), so
    it is set to 0, which is not None (kept) and falsy (no criterion, no retuning)."""
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0


# ---------------------------------------------------------------- timing


def generate_kwargs(method: str, draft, mode: str, max_new_tokens: int, k: int) -> dict:
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=PAD_ID, **MODES[mode])
    if method == "transformers":
        kwargs["assistant_model"] = draft
    elif method in LIBRARIES:
        kwargs.update(custom_generate=LIBRARIES[method].speculative_generate, assistant=draft, num_draft_tokens=k,
                      adaptive=False, ngram=False, return_dict_in_generate=True)
    elif method != "plain":
        raise ValueError(method)
    return kwargs


def run_once(method, target, draft, timers, ids, mode, max_new_tokens, k, seed, profiler=None) -> dict:
    """One timed generate call: wall time, forward time and counts, the new tokens. A `profiler`
    (cProfile.Profile) is enabled around the generate call only."""
    kwargs = generate_kwargs(method, draft, mode, max_new_tokens, k)
    for timer in timers.values():
        timer.take()
    torch.manual_seed(seed)
    sync(target.device)
    if profiler is not None:
        profiler.enable()
    start = time.perf_counter()
    try:
        out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        sync(target.device)
        wall = time.perf_counter() - start
    finally:
        if profiler is not None:
            profiler.disable()
    seqs = out.sequences if method in LIBRARIES else out
    target_d, draft_d = timers["target"].take(), timers["draft"].take()
    forward = sum(target_d) + sum(draft_d)
    rounds = len(target_d)
    new_tokens = seqs.shape[1] - ids.shape[1]
    record = dict(
        wall_ms=1e3 * wall, forward_ms=1e3 * forward, target_forward_ms=1e3 * sum(target_d),
        draft_forward_ms=1e3 * sum(draft_d), target_forwards=rounds, draft_forwards=len(draft_d),
        new_tokens=new_tokens, overhead_ms=1e3 * (wall - forward),
        overhead_ms_per_round=1e3 * (wall - forward) / max(1, rounds),
        overhead_ms_per_token=1e3 * (wall - forward) / max(1, new_tokens),
        tokens_per_round=new_tokens / max(1, rounds),
    )
    if method in LIBRARIES:
        record["acceptance_rate"] = out.acceptance.acceptance_rate
    return record, seqs


def summarise_method(method: str, runs: list[dict]) -> dict:
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    entry = dict(
        overhead_ms_per_round=med("overhead_ms_per_round"), overhead_ms_per_token=med("overhead_ms_per_token"),
        tokens_per_round=med("tokens_per_round"), rounds=med("target_forwards"), draft_forwards=med("draft_forwards"),
        new_tokens=med("new_tokens"), wall_ms=med("wall_ms"), forward_ms=med("forward_ms"),
        forward_ms_per_round=statistics.median(r["forward_ms"] / max(1, r["target_forwards"]) for r in runs),
        runs=runs,
    )
    if method == "plain":
        entry["overhead_ms_per_step"] = entry["overhead_ms_per_round"]
    if method == "transformers":
        # transformers reports no acceptance; each target forward emits accepted + 1 tokens.
        drafted = sum(r["draft_forwards"] for r in runs)
        entry["acceptance_rate"] = sum(r["new_tokens"] - r["target_forwards"] for r in runs) / max(1, drafted)
    if method == "hf_specdec":
        entry["acceptance_rate"] = statistics.median(r["acceptance_rate"] for r in runs)
    return entry


# ---------------------------------------------------------------- profile


class ProfileOutsideForwards:
    """cProfile switched off inside every forward of the given models (by forward hooks), so its
    self times are time outside forwards. Caveat: disabling closes the frames open at that moment
    (generate, the decode loop), so their own bytecode time after the first forward is not counted;
    the functions they call are."""

    def __init__(self, *models):
        self.profile = cProfile.Profile()
        self._models = models
        self._handles = []

    def __enter__(self):
        # The hooks only switch a profile that is running (inside the profiled generate call).
        self._active = False
        for model in self._models:
            # prepend / append: off before the ForwardTimer starts, on after it stops (nested inside it).
            self._handles.append(model.register_forward_pre_hook(self._pre, prepend=True))
            self._handles.append(model.register_forward_hook(self._post))
        return self

    def enable(self):
        self._active = True
        self.profile.enable()

    def disable(self):
        self.profile.disable()
        self._active = False

    def _pre(self, *args):
        if self._active:
            self.profile.disable()

    def _post(self, *args):
        if self._active:
            self.profile.enable()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()

    def top(self, n: int, rounds: int, overhead_ms: float) -> tuple[list[dict], float]:
        stats = pstats.Stats(self.profile, stream=io.StringIO()).stats
        rows = []
        for (path, line, name), (_, calls, self_s, cum_s, _) in stats.items():
            rows.append(dict(function=_function_name(path, line, name), calls=calls, self_ms=1e3 * self_s,
                             self_ms_per_round=1e3 * self_s / max(1, rounds), cumulative_ms=1e3 * cum_s,
                             share_of_overhead=1e3 * self_s / overhead_ms if overhead_ms > 0 else None))
        total = sum(r["self_ms"] for r in rows)
        rows.sort(key=lambda r: -r["self_ms"])
        return rows[:n], total


def _function_name(path: str, line: int, name: str) -> str:
    if path == "~":  # a builtin: "{method 'sort' of 'torch._C.TensorBase' objects}"
        return name
    for marker in ("site-packages/", "/hf_specdec/", "/evals/", "/lib/python"):
        if marker in path:
            path = path.split(marker, 1)[1] if marker != "/hf_specdec/" else "hf_specdec/" + path.split(marker, 1)[1]
            break
    return f"{path}:{line}({name})"


def profile_hf_specdec(target, draft, timers, ids, mode, max_new_tokens, k, seed, top_n=25) -> dict:
    with ProfileOutsideForwards(target, draft) as prof:
        record, _ = run_once("hf_specdec", target, draft, timers, ids, mode, max_new_tokens, k, seed, profiler=prof)
    rows, profiled_ms = prof.top(top_n, record["target_forwards"], record["overhead_ms"])
    lines = [f"## hf_specdec under cProfile, {mode}: {record['target_forwards']} rounds, "
             f"{record['overhead_ms']:.0f} ms outside forwards (profiler included), "
             f"{profiled_ms:.0f} ms of it attributed to functions",
             "", "| self ms | ms/round | share | calls | function |", "| ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        share = f"{100 * r['share_of_overhead']:.1f}%" if r["share_of_overhead"] is not None else "-"
        lines.append(f"| {r['self_ms']:.1f} | {r['self_ms_per_round']:.2f} | {share} | {r['calls']} | `{r['function']}` |")
    return dict(mode=mode, record=record, profiled_ms=profiled_ms, top=rows, text="\n".join(lines))


# ---------------------------------------------------------------- report


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"# Loop overhead (vocab {cfg['vocab']}, k = {cfg['k']}, {cfg['max_new_tokens']} new tokens, "
        f"{cfg['repeats']} repeats, {cfg['device']}, {cfg['dtype']}, {cfg['torch_threads']} threads)",
        "",
        "Overhead = wall time of the generate call - time inside model forwards; a round is one target "
        "forward (plain decoding: one step). Medians over repeats.",
        "",
        "| mode | method | overhead ms / round | overhead ms / token | tokens / round | rounds | draft forwards "
        "| forward ms / round | wall ms | vs transformers |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, entry in result["modes"].items():
        base = entry["methods"]["transformers"]["overhead_ms_per_round"]
        for method in entry["methods"]:
            m = entry["methods"][method]
            label = "plain (per step)" if method == "plain" else method
            rel = m["overhead_ms_per_round"] / base if base else float("nan")
            lines.append(
                f"| {mode} | {label} | {m['overhead_ms_per_round']:.2f} | {m['overhead_ms_per_token']:.2f} | "
                f"{m['tokens_per_round']:.2f} | {m['rounds']:g} | {m['draft_forwards']:g} | "
                f"{m['forward_ms_per_round']:.2f} | {m['wall_ms']:.0f} | {rel:.2f}x |"
            )
    lines.append("")
    for mode, entry in result["modes"].items():
        ratio = entry["ratio_hf_specdec_over_transformers"]
        verdict = "met" if entry["meets_target"] else "NOT met"
        line = f"- {mode}: hf_specdec / transformers overhead per round = {ratio:.2f}x (target <= {TARGET_RATIO}x: {verdict})"
        if "greedy_identical" in entry:
            line += f"; hf_specdec output == plain greedy: {entry['greedy_identical']}"
            line += f"; transformers output == plain greedy: {entry['transformers_identical']}"
            for method, where in entry.get("divergence", {}).items():
                line += (f"; {method} leaves plain at token {where['position']}, where plain's top-two margin is "
                         f"{where['margin']} ({where['bf16_steps']} bf16 steps: "
                         f"{'a tie' if where['bf16_steps'] is not None and where['bf16_steps'] <= 1 else 'NOT a tie'})")
        lines.append(line)
    return "\n".join(lines)


def divergences(target, ids, max_new_tokens: int, outputs: dict) -> dict:
    """Per method whose first greedy output differs from plain's: where, and plain decoding's top-two
    margin there in bf16 steps (at most 1: a rounding tie, the only acceptable cause in bf16)."""
    from hf_specdec.diagnostics import greedy_divergence

    plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                            output_scores=True, return_dict_in_generate=True)
    n = ids.shape[1]
    reference, scores = plain.sequences[0, n:].cpu(), [s[0].cpu() for s in plain.scores]
    found = {}
    for method, outs in outputs.items():
        if method == "plain" or not outs:
            continue
        where = greedy_divergence(reference, outs[0][0, n:], scores)
        if where is not None:
            steps = where.margin_in_bf16_steps
            found[method] = dict(position=where.position, margin=where.margin,
                                 bf16_steps=None if steps is None else round(steps, 2))
    return found


# ---------------------------------------------------------------- main


def main(vocab=QWEN_VOCAB, k=5, max_new_tokens=200, repeats=3, prompt_tokens=64, modes=tuple(MODES),
         out="runs/overhead", device="cpu", dtype="float32", threads=0, hidden=64, layers=2, noise=0.01,
         init=0.3, seed=0, profile=False, baseline=None) -> dict:
    from tqdm.auto import tqdm

    methods_run = METHODS
    if baseline:  # the library as it was at a git revision, interleaved with the others
        import tempfile

        from common import import_baseline

        LIBRARIES["baseline"] = import_baseline(baseline, Path(tempfile.mkdtemp(prefix="hf_specdec_baseline-")))
        methods_run = METHODS + ("baseline",)

    if threads:
        torch.set_num_threads(threads)
    bad = set(modes) - set(MODES)
    if bad:
        raise SystemExit(f"unknown mode {sorted(bad)}; choose from {', '.join(MODES)}")
    device = torch.device(device)
    target, draft = tiny_pair(vocab, hidden, layers, noise, init, seed, device, getattr(torch, dtype))
    fix_assistant_length(draft, k)
    gen = torch.Generator().manual_seed(seed + 2)
    ids = torch.randint(4, vocab, (1, prompt_tokens), generator=gen).to(device)
    timers = {"target": ForwardTimer(target), "draft": ForwardTimer(draft)}

    result = dict(config=dict(
        vocab=vocab, k=k, max_new_tokens=max_new_tokens, repeats=repeats, prompt_tokens=prompt_tokens,
        modes=list(modes), device=str(device), dtype=dtype, torch_threads=torch.get_num_threads(), hidden=hidden,
        layers=layers, noise=noise, initializer_range=init, seed=seed, architecture="qwen2",
        target_params=sum(p.numel() for p in target.parameters()), mode_kwargs={m: MODES[m] for m in modes},
        torch=torch.__version__, transformers=transformers.__version__, hf_specdec=hf_specdec.__version__,
        python=platform.python_version(), machine=platform.machine(), target_ratio=TARGET_RATIO, baseline=baseline,
    ), modes={})

    bar = tqdm(total=len(modes) * len(methods_run) * (repeats + 1), desc="overhead", file=sys.stderr)
    for mode in modes:
        runs = {m: [] for m in methods_run}
        outputs = {m: [] for m in methods_run}
        for method in methods_run:  # warm-up: first calls pay one-off allocations and lazy imports
            bar.set_postfix(mode=mode, method=method, phase="warm-up")
            run_once(method, target, draft, timers, ids, mode, min(max_new_tokens, 16), k, seed)
            bar.update()
        for repeat in range(repeats):
            for method in methods_run:  # interleaved: A B C A B C ...
                bar.set_postfix(mode=mode, method=method, repeat=repeat)
                record, seqs = run_once(method, target, draft, timers, ids, mode, max_new_tokens, k, seed + repeat)
                runs[method].append(record)
                outputs[method].append(seqs.cpu())
                bar.update()
        methods = {m: summarise_method(m, runs[m]) for m in methods_run}
        hf, tr = methods["hf_specdec"]["overhead_ms_per_round"], methods["transformers"]["overhead_ms_per_round"]
        ratio = hf / tr if tr > 0 else None
        entry = dict(methods=methods, ratio_hf_specdec_over_transformers=ratio,
                     meets_target=ratio is not None and ratio <= TARGET_RATIO)
        if not MODES[mode]["do_sample"]:
            same = lambda m: all(torch.equal(a, b) for a, b in zip(outputs[m], outputs["plain"]))  # noqa: E731
            entry["greedy_identical"] = same("hf_specdec")
            entry["transformers_identical"] = same("transformers")
            entry["divergence"] = divergences(target, ids, max_new_tokens, outputs)
        result["modes"][mode] = entry
    bar.close()

    if profile:
        result["profile"] = {}
        for mode in modes:
            prof = profile_hf_specdec(target, draft, timers, ids, mode, max_new_tokens, k, seed)
            print(prof["text"], end="\n\n")
            result["profile"][mode] = prof

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(result)
    (out / "overhead.json").write_text(json.dumps(result, indent=2))
    md = table + "\n"
    if profile:
        md += "\n" + "\n\n".join(result["profile"][m]["text"] for m in modes) + "\n"
    (out / "overhead.md").write_text(md)
    print(table)
    print(f"wrote {out}/overhead.json and {out}/overhead.md")
    return result


parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--vocab", type=int, default=QWEN_VOCAB, help="vocabulary size (default: Qwen's 151936)")
parser.add_argument("--k", "--num-draft-tokens", dest="k", type=int, default=5, help="fixed draft length")
parser.add_argument("--max-new-tokens", type=int, default=200)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--prompt-tokens", type=int, default=64)
parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
add_options(parser, out="runs/overhead")
parser.add_argument("--device", default="cpu")
parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
add_options(parser, "threads")
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--noise", type=float, default=0.01, help="draft = target + noise x weight std")
parser.add_argument("--init", type=float, default=0.3, help="initializer_range (0.3: peaked distributions)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--profile", action="store_true", help="also profile hf_specdec outside forwards (cProfile)")
parser.add_argument("--baseline", default=None, metavar="REV",
                    help="also run hf_specdec as it was at this git revision (method 'baseline')")

if __name__ == "__main__":
    args = parser.parse_args()
    main(vocab=args.vocab, k=args.k, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
         prompt_tokens=args.prompt_tokens, modes=tuple(args.modes), out=args.out, device=args.device,
         dtype=args.dtype, threads=args.threads, hidden=args.hidden, layers=args.layers, noise=args.noise,
         init=args.init, seed=args.seed, profile=args.profile, baseline=args.baseline)
