"""Issue 39's batched workload, modelled: n samples of a prompt as n rows of one batch, plain batched
sampling against hf_specdec, every forward priced by a cost table instead of timed.

    python evals/repetition_batch_model.py --out runs/batch-model --limit 2 \\
        --pin evals/results/gpu-h200/cost_table.json --accelerator-path \\
        --cost-table evals/results/gpu-h200/cost_table.json --cost-table evals/results/standard/cost_table.json
    python evals/repetition_batch_model.py --out runs/batch-model-online --limit 2 \\
        --cost-table evals/results/standard/cost_table.json          # costs measured online, as the wall run

The cost tables price one row. A forward over `rows` rows of `width` new tokens is priced here as one
row's forward over rows x width tokens at the same context: the tokens fed. That is the planner's own
online model (`hf_specdec.planner.CostCurve`). It is about right where a forward is bound by compute
(this CPU) and where it is bound by memory up to the table's widest width (an H200: a forward over
64 tokens costs about one step). Attention over each row's context is charged once per forward.
Positions: plain's every row and column; hf_specdec's those its rounds scored, summed over the rows
(`RoundRecord.scored`: on a CPU the lazy rule stops at the first rejection; on the accelerator path
every position).

`--pin T`: hf_specdec's costs are pinned from table T at the prompt's length (`CostTable.pinned_costs`;
pinned prices are per width, so the planner sees a batch forward as one row's, which is what a
memory-bound accelerator sees). Without it they are measured online on this machine.
`--accelerator-path`: the loop runs as on an accelerator (no per-token draft stop, no lazy or sparse
sampling; `hf_specdec.verify.reads_are_free` off), as `evals/replay.py --accelerator-path` does.

Sampling is seeded per call (seed + prompt index), so a run repeats where costs are pinned. Tokens:
each row's new tokens up to and including its first EOS. Speedup: pooled tokens per modelled second
over plain batched sampling's, per workload and table. Writes <out>/records.jsonl and <out>/results.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import hf_specdec  # noqa: E402
from common import add_options, apply_threads, load_pair  # noqa: E402
from costs import CostTable  # noqa: E402
from repetition import WORKLOADS, workload_prompts  # noqa: E402
from repetition_wall import eos_ids, row_tokens  # noqa: E402

MODE = "sampling"


class TokensFed:
    """Notes every forward of a model as [rows x new tokens, tokens already cached, rows] (public hooks)."""

    def __init__(self, model: torch.nn.Module):
        self.work: list[list[int]] = []
        model.register_forward_pre_hook(self._pre, with_kwargs=True)

    def _pre(self, module, args, kwargs):
        ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self.work.append([ids.shape[0] * ids.shape[1], 0 if cache is None else cache.get_seq_length(), ids.shape[0]])

    def take(self) -> list[list[int]]:
        out, self.work = self.work, []
        return out


def call(target, draft, recorders, prompt: dict, workload, method: str, n: int, max_new_tokens: int, seed: int,
         pin: CostTable | None) -> dict:
    ids = torch.tensor([prompt["input_ids"]] * n)
    kwargs = dict(max_new_tokens=max_new_tokens, **workload.sampling())
    rounds = []
    if method == "hf_specdec":
        kwargs.update(custom_generate=hf_specdec.speculative_generate, assistant=draft, acceptance_sink=rounds.append)
        if pin is not None:
            kwargs.update(pin.pinned_costs(ids.shape[1], "hf", 256, MODE))
    for r in recorders.values():
        r.take()
    torch.manual_seed(seed)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    tokens = row_tokens(out[:, ids.shape[1]:], eos_ids(target))
    work = {name: r.take() for name, r in recorders.items()}
    scored: dict[int, int] = {}  # per round, the positions the target's processors ran at, summed over rows
    for r in rounds:
        scored[r.round] = scored.get(r.round, 0) + r.scored
    if scored and len(scored) == len(work["target"]):
        work["scored"] = [scored[i] for i in sorted(scored)]
    return dict(workload=workload.name, id=prompt["id"], method=method, rows=n, new_tokens=sum(map(len, tokens)),
                tokens=tokens, work={k: v for k, v in work.items() if v})


def modelled_seconds(work: dict, table: CostTable, engine: str) -> float:
    """Each forward priced as one row's over the tokens it fed, plus its positions: a target forward's
    rows x width (the prompt's: one a row), or what its round scored; a draft forward's one a row."""
    seconds, positions = 0.0, 0
    scored = work.get("scored")
    for model in ("target", "hf"):
        for i, (fed, context, rows) in enumerate(work.get(model, ())):
            seconds += table.forward(model, fed, context)
            if model == "target" and scored:
                positions += scored[i]
            else:
                positions += fed if model == "target" and context > 0 else rows
    return seconds + positions * table.position[MODE][engine]


def summary(records: list[dict], tables: dict[str, CostTable]) -> str:
    lines = ["| workload | table | plain batched, tokens / modelled s | hf_specdec | speedup |", "|---|---|---|---|---|"]
    for name in dict.fromkeys(r["workload"] for r in records):
        for label, table in tables.items():
            rate = {}
            for method in ("plain", "hf_specdec"):
                mine = [r for r in records if r["workload"] == name and r["method"] == method]
                if not mine:
                    break
                seconds = sum(modelled_seconds(r["work"], table, "transformers" if method == "plain" else "hf_specdec")
                              for r in mine)
                rate[method] = sum(r["new_tokens"] for r in mine) / seconds
            if len(rate) < 2:
                continue
            lines.append(f"| {name} | {label} | {rate['plain']:.1f} | {rate['hf_specdec']:.1f} | "
                         f"**{rate['hf_specdec'] / rate['plain']:.2f}x** |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cost-table", action="append", required=True, help="a table to price the work with")
    parser.add_argument("--pin", default=None, help="pin hf_specdec's costs from this table (else measured online)")
    parser.add_argument("--accelerator-path", action="store_true")
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    add_options(parser, "threads")
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    if args.accelerator_path:
        from hf_specdec import generate, rounds, sampling, verify

        for module in (verify, sampling, rounds, generate):
            module.reads_are_free = lambda device: False
    tables = {Path(t).resolve().parent.name: CostTable.load(Path(t)) for t in args.cost_table}
    pin = None if args.pin is None else CostTable.load(Path(args.pin))
    for table in [*tables.values(), pin]:
        if table is not None and "hf" not in table.forwards:
            table.alias("hf", "bf16")
    from hf_specdec.pair import DRAFT, TARGET

    target, draft, tokenizer = load_pair(TARGET.name, DRAFT.name, "cpu")
    recorders = {"target": TokensFed(target), "hf": TokensFed(draft)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    with open(out / "records.jsonl", "w") as sink:
        for name, prompts in workload_prompts(tokenizer, args.workloads, args.limit).items():
            for i, prompt in enumerate(prompts):
                for method in ("plain", "hf_specdec"):
                    record = call(target, draft, recorders, prompt, WORKLOADS[name], method, args.samples,
                                  args.max_new_tokens, args.seed + i, pin)
                    records.append(record)
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                    print(name, prompt["id"], method, record["new_tokens"], "tokens", flush=True)
    text = (f"# Batched repetition, modelled\n\nCommand: `python evals/repetition_batch_model.py "
            f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n\n" + summary(records, tables))
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
