"""Self-speculation on the real pair: does a draft made of the target's own first layers pay?

    python evals/self_spec.py --out runs/self-spec        # ~15 min on 2 CPU cores
    python evals/self_spec.py --target tiny --draft tiny --out runs/tiny-self-spec   # offline, seconds

The draft is `hf_specdec.early_exit_draft(target, L)`: the target's first L of N layers, then its own
final norm and head (no second model, no copied weight). Compared with the 0.5B draft (bf16 and the
int8 copy hf_specdec uses) on the report split:

1. Acceptance, teacher-forced on plain greedy outputs (`--records`: a run's records.jsonl with plain
   greedy tokens; the report split's). One target forward per prompt with `output_hidden_states`
   gives every early exit's logits at every generated position; each 0.5B draft needs one forward of
   its own. Greedy: the share of positions where the draft's argmax is the target's (what greedy
   verification accepts there). Sampling (T = 0.7, top-p 0.95, p and q warped alike): the mean of
   sum_t min(p(t), q(t)), the probability that the rule accepts a draft token at that position.
2. Cost: one draft step (one token over a warm cache at a prompt's length) over one target step,
   timed interleaved, c; the verify cost d per extra token from the cost table (`--cost-table`: the
   least-squares slope of the target's forward time against width, up to 9 tokens, over its step).
3. Predicted speedup of a chain of k model drafts with i.i.d. acceptance a: (1 - a^(k+1)) / (1 - a)
   tokens per round at a cost of 1 + d k + c k target steps, the best k in 1..8. It ignores the
   draft's prefill and the cost model's early stops, the same way for every draft.
4. Measured (`--measure-prompts`, one per category): plain, hf_specdec with the best early exit and
   hf_specdec with the int8 draft, model drafts only (`ngram=False`, costs pinned: c measured in 2,
   d from the table), interleaved per prompt; wall-clock speedup and tokens per target forward.

Writes <out>/summary.json and <out>/report.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_specdec  # noqa: E402
from common import CATEGORIES, add_options, apply_threads, drafts_by_precision, load_pair, load_prompts  # noqa: E402
from costs import CostTable  # noqa: E402
from hf_specdec.cache import extend, new_cache, rollback  # noqa: E402
from hf_specdec.self_draft import decoder_layers  # noqa: E402

SAMPLING = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.95)])
KS = range(1, 9)


def teacher_texts(target, tokenizer, records: Path, tiny: bool) -> tuple[list[dict], dict[str, list[int]]]:
    """(report-split prompts, their plain greedy continuations by prompt id): from a run's records,
    or, for the tiny offline pair (no records), generated here (16 tokens)."""
    prompts = load_prompts(tokenizer, CATEGORIES, 1 if tiny else 5, "report")
    if tiny:
        tokens = {}
        for p in prompts:
            ids = torch.tensor([p["input_ids"]])
            tokens[p["id"]] = target.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        return prompts, tokens
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    tokens = {r["id"]: r["tokens"] for r in rows if r["method"] == "plain" and r["mode"] == "greedy"}
    return [p for p in prompts if p["id"] in tokens], tokens


def warped(logits: torch.Tensor) -> torch.Tensor:  # [positions, vocab] -> probabilities
    return torch.softmax(SAMPLING(None, logits.float()), dim=-1)


def agreement(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[list[bool], list[float]]:
    """Per position: greedy acceptance (argmaxes agree) and sampling acceptance sum min(p, q)."""
    greedy = (p_logits.argmax(-1) == q_logits.argmax(-1)).tolist()
    sampled = torch.minimum(warped(p_logits), warped(q_logits)).sum(-1).tolist()
    return greedy, sampled


@torch.no_grad()
def acceptance(target, drafts: dict, layers: list[int], prompts: list[dict], tokens: dict[str, list[int]]) -> list[dict]:
    """Per prompt and draft: the per-position greedy and sampling acceptances (teacher-forced)."""
    head = target.get_output_embeddings()
    base, _, _ = decoder_layers(target)
    norm = _final_norm(base)
    rows = []
    for prompt in tqdm(prompts, desc="acceptance"):
        ids = torch.tensor([prompt["input_ids"] + tokens[prompt["id"]]], device=target.device)
        start = len(prompt["input_ids"]) - 1  # the position that predicts the first generated token
        out = target(ids, output_hidden_states=True, logits_to_keep=ids.shape[1] - start)
        p_logits = out.logits[0, :-1]  # [new tokens, vocab]: predictions of each generated token
        results = {}
        for layer in layers:
            q_logits = head(norm(out.hidden_states[layer][0, start:-1]))
            results[f"exit{layer}"] = agreement(p_logits, q_logits)
        for name, draft in drafts.items():
            q_logits = draft(ids, logits_to_keep=ids.shape[1] - start).logits[0, :-1]
            results[name] = agreement(p_logits, q_logits)
        for name, (greedy, sampled) in results.items():
            rows.append(dict(id=prompt["id"], category=prompt["category"], draft=name, greedy=greedy, sampling=sampled))
    return rows


def _final_norm(base):
    """The norm after the last decoder layer (Llama / Qwen2 `norm`, GPT-2 `ln_f`)."""
    for name in ("norm", "ln_f", "final_layer_norm"):
        if hasattr(base, name):
            return getattr(base, name)
    raise ValueError(f"cannot find the final norm of {type(base).__name__}")


@torch.no_grad()
def step_costs(target, drafts: dict, layers: list[int], prompt: list[int], repeats: int = 5) -> dict[str, float]:
    """Per draft: one-token step time over a warm cache at the prompt's length, over the target's
    (medians of `repeats` interleaved steps)."""
    models = {"target": target, **{f"exit{layer}": hf_specdec.early_exit_draft(target, layer) for layer in layers}, **drafts}
    ids = torch.tensor([prompt], device=target.device)
    grown = torch.cat([ids, ids[:, -1:]], dim=1)
    caches = {}
    for name, model in models.items():
        caches[name] = new_cache(model)
        extend(model, caches[name], ids, None, 1)
    times = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            extend(model, caches[name], grown, None, 1)
            times[name].append(time.perf_counter() - start)
            rollback([caches[name]], ids.shape[1])
    step = statistics.median(times["target"])
    return {name: statistics.median(t) / step for name, t in times.items() if name != "target"}


def verify_slope(table: CostTable, context: int) -> float:
    """d: the least-squares slope of the target's forward time against width (up to 9 tokens) at
    `context`, over its one-token step (what the cost table pinned as d before per-width prices)."""
    widths = [w for w in table.widths if w <= 9]
    xs, ys = [w - 1 for w in widths], [table.forward("target", w, context) for w in widths]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, slope / table.forward("target", 1, context))


def best_chain(a: float, c: float, d: float) -> tuple[float, int]:
    """(predicted speedup, k) of the best chain length for i.i.d. acceptance a."""
    options = []
    for k in KS:
        tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
        options.append((tokens / (1 + d * k + c * k), k))
    return max(options)


def per_position(sequences: list[list[float]], k: int = 8) -> list[float | None]:
    """Conditional acceptance at chain positions 1..k from per-token acceptances (teacher-forced):
    a chain may start at every token; position j's rate is the sum over starts of the product of the
    first j acceptances over the sum of the product of the first j - 1, over the starts with j tokens
    left (greedy: of the chains that accepted j - 1 tokens, the fraction that accept the j-th). None
    where no start reached position j."""
    num, den = [0.0] * k, [0.0] * k
    for values in sequences:
        for start in range(len(values)):
            product = 1.0
            for j, value in enumerate(values[start : start + k]):
                den[j] += product
                product *= value
                num[j] += product
    return [n / d if d > 0 else None for n, d in zip(num, den)]


def summarise(rows: list[dict], costs: dict[str, float], d: float) -> dict:
    names = list(dict.fromkeys(r["draft"] for r in rows))
    out = {}
    for name in names:
        mine = [r for r in rows if r["draft"] == name]
        entry = dict(cost=costs.get(name))
        for mode in ("greedy", "sampling"):
            per_category = {}
            for category in CATEGORIES:
                values = [v for r in mine if r["category"] == category for v in r[mode]]
                if values:
                    per_category[category] = statistics.fmean(values)
            overall = statistics.fmean(v for r in mine for v in r[mode])
            entry[mode] = dict(per_category=per_category, overall=overall, per_position=per_position([r[mode] for r in mine]),
                               per_category_position={c: per_position([r[mode] for r in mine if r["category"] == c])
                                                      for c in per_category})
            if costs.get(name) is not None:
                speedup, k = best_chain(overall, costs[name], d)
                entry[mode].update(predicted_speedup=speedup, best_k=k)
        out[name] = entry
    return out


@torch.no_grad()
def measure(target, draft_int8, layer: int, prompts: list[dict], costs: dict[str, float], d: float,
            max_new_tokens: int) -> list[dict]:
    """Plain, hf_specdec with exit `layer` and with the int8 draft, interleaved per prompt (greedy)."""
    self_draft = hf_specdec.early_exit_draft(target, layer)
    methods = {
        "plain": {},
        f"exit{layer}": dict(assistant=self_draft, costs=hf_specdec.Costs(draft_step=costs[f"exit{layer}"], verify=d)),
        "int8": dict(assistant=draft_int8, costs=hf_specdec.Costs(draft_step=costs["int8"], verify=d)),
    }
    rows = []
    for prompt in tqdm(prompts, desc="measured runs"):
        ids = torch.tensor([prompt["input_ids"]], device=target.device)
        for name, extra in methods.items():
            kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                          attention_mask=torch.ones_like(ids))
            if extra:
                kwargs.update(custom_generate=hf_specdec.speculative_generate, ngram=False,
                              return_dict_in_generate=True, **extra)
            start = time.perf_counter()
            out = target.generate(ids, **kwargs)
            seconds = time.perf_counter() - start
            row = dict(id=prompt["id"], category=prompt["category"], method=name, seconds=seconds)
            if extra:
                row.update(tokens_per_forward=out.acceptance.mean_tokens_per_round,
                           acceptance=out.acceptance.acceptance_rate)
            rows.append(row)
    return rows


def report(summary: dict, measured: list[dict], config: dict) -> str:
    lines = [f"# Self-speculation against the 0.5B draft ({config['prompts']} prompts, report split)", "",
             f"    {config['command']}", "",
             "Teacher-forced acceptance on plain greedy outputs, per token (greedy: argmaxes agree; sampling: "
             "sum min(p, q) at T = 0.7, top-p 0.95); c = draft step / target step; predicted speedup of the "
             f"best chain length with d = {config['verify_cost']:.3f}.", "",
             "| draft | c | greedy acceptance | best k | predicted greedy | sampling acceptance | best k | predicted sampling |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, entry in summary.items():
        g, s = entry["greedy"], entry["sampling"]
        cost = "-" if entry["cost"] is None else f"{entry['cost']:.2f}"
        lines.append(f"| {name} | {cost} | {g['overall']:.3f} | {g.get('best_k', '-')} | {g.get('predicted_speedup', 0):.2f}x "
                     f"| {s['overall']:.3f} | {s.get('best_k', '-')} | {s.get('predicted_speedup', 0):.2f}x |")
    lines += ["", "Greedy acceptance per category:", "",
              "| draft | " + " | ".join(CATEGORIES) + " |", "| --- |" + " --- |" * len(CATEGORIES)]
    for name, entry in summary.items():
        cells = [f"{entry['greedy']['per_category'].get(c, float('nan')):.2f}" for c in CATEGORIES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if measured:
        plain = {r["id"]: r["seconds"] for r in measured if r["method"] == "plain"}
        lines += ["", "Measured, greedy, model drafts only (`ngram=False`), interleaved per prompt:", "",
                  "| method | median wall speedup over plain | tokens per target forward | acceptance |",
                  "| --- | --- | --- | --- |"]
        for method in dict.fromkeys(r["method"] for r in measured if r["method"] != "plain"):
            mine = [r for r in measured if r["method"] == method]
            speed = statistics.median(plain[r["id"]] / r["seconds"] for r in mine)
            lines.append(f"| {method} | {speed:.2f}x | {statistics.median(r['tokens_per_forward'] for r in mine):.2f} "
                         f"| {statistics.median(r['acceptance'] for r in mine):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, "target", "draft")
    parser.add_argument("--records", default=str(HERE / "results" / "standard" / "records.jsonl"),
                        help="a run's records.jsonl: its plain greedy outputs are the teacher-forced texts")
    add_options(parser, cost_table=str(HERE / "results" / "standard" / "cost_table.json"))
    parser.add_argument("--layers", nargs="+", type=int, default=[8, 12, 16, 20, 24])
    parser.add_argument("--measure-prompts", type=int, default=1, help="prompts per category for the measured runs (0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    add_options(parser, "threads", out="runs/self-spec")
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, draft, tokenizer = load_pair(args.target, args.draft, "cpu")
    drafts = drafts_by_precision(draft, 8)
    drafts = {"bf16": drafts["bf16"], "int8": drafts["hf"]}
    n_layers = target.config.num_hidden_layers
    layers = [layer for layer in args.layers if 1 <= layer < n_layers] or [max(1, n_layers // 2)]
    tiny = args.target == "tiny"
    prompts, tokens = teacher_texts(target, tokenizer, Path(args.records), tiny)
    d = 0.03 if tiny else verify_slope(CostTable.load(Path(args.cost_table)), 512)
    print(f"{len(prompts)} prompts; early exits at {layers} of {n_layers} layers; d = {d:.3f}")
    rows = acceptance(target, drafts, layers, prompts, tokens)
    median_prompt = sorted(prompts, key=lambda p: len(p["input_ids"]))[len(prompts) // 2]["input_ids"]
    costs = step_costs(target, drafts, layers, median_prompt)
    summary = summarise(rows, costs, d)
    best = max(layers, key=lambda layer: summary[f"exit{layer}"]["greedy"]["predicted_speedup"])
    chosen = [p for c in CATEGORIES for p in [q for q in prompts if q["category"] == c][: args.measure_prompts]]
    measured = measure(target, drafts["int8"], best, chosen, costs, d, 16 if tiny else args.max_new_tokens) if chosen else []
    config = dict(prompts=len(prompts), layers=layers, verify_cost=d, best_layer=best,
                  command="python evals/self_spec.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    (out / "summary.json").write_text(json.dumps(dict(config=config, summary=summary, measured=measured, rows=rows)))
    text = report(summary, measured, config)
    (out / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
