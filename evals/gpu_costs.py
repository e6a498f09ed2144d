"""The cost table of the real pair's architectures on an accelerator, without their weights.

    python evals/gpu_costs.py --device cuda --out runs/gpu/costs      # on the device machine (~2 minutes)
    python evals/gpu_costs.py --dry-run --out runs/gpu-dry/costs      # on a CPU: two layers, a small grid
    python evals/gpu_costs.py --check --out unused                    # the configs build (meta device), instantly
    python evals/gpu_costs.py --handwritten --out evals/results/gpu-handwritten   # the regime written by hand

Random-weight models built from the real pair's `config.json` files (`evals/configs/`, a few KB: a
forward's time does not depend on the weights' values), in bf16, timed with `costs.measure` (the
same table the CPU evals write, so `--cost-table` and `evals/replay.py` read it): the target's
forward over 1 to 64 new tokens at several context lengths, the draft's (one grid, named "bf16" and
aliased "hf": an accelerator runs the draft as loaded), both prefills, one position's processing per
mode. Beside it, batch_costs.json: the target's forward at batch sizes 1 to 16 (context 256), per
width, and the draft's one-token step at each batch size. Also writes cost_table.md: every forward
as a multiple of the target's one-token step at that context.

`--dry-run` runs the whole script on the CPU with each model cut to two layers and a small grid: it
checks that the configs load, the models build and the table is written, in seconds.
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

from common import REQUIRED, add_options  # noqa: E402
from costs import CostTable, measure, sync  # noqa: E402

CONFIGS = HERE / "configs"
TARGET_CONFIG, DRAFT_CONFIG = CONFIGS / "qwen2.5-coder-1.5b-instruct.json", CONFIGS / "qwen2.5-coder-0.5b-instruct.json"
MODES = {"greedy": dict(do_sample=False), "sampling": dict(do_sample=True, temperature=0.7, top_p=0.95)}  # common.MODES
WIDTHS = (1, 2, 3, 5, 9, 17, 33, 64)
CONTEXTS = (64, 256, 1024)
PREFILLS = (16, 64, 256, 1024)
BATCHES = (1, 2, 4, 8, 16)
BATCH_WIDTHS = (1, 2, 3, 5, 9, 17)
DRY = dict(widths=(1, 2, 5), contexts=(16, 64), prefills=(16, 64), batches=(1, 2), batch_widths=(1, 3), reps=1)


def build(config_path: Path, device: str, dtype: torch.dtype, layers: int | None = None):
    """A random-weight causal LM of the architecture in `config_path` (optionally cut to `layers`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = json.loads(config_path.read_text())
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    if layers is not None:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@torch.no_grad()
def batch_grid(model, vocab: int, batches, widths, context: int, reps: int) -> list[list[float]]:
    """[batch][width] seconds of one forward over `width` new tokens per row on `context` cached ones."""
    from hf_specdec.cache import new_cache, rollback

    gen = torch.Generator().manual_seed(1)
    out = []
    for batch in batches:
        cache = new_cache(model)
        model(input_ids=torch.randint(4, vocab, (batch, context), generator=gen).to(model.device), cache=cache,
              use_cache=True, logits_to_keep=1)
        row = []
        for width in widths:
            ids = torch.randint(4, vocab, (batch, width), generator=gen).to(model.device)
            times = []
            for _ in range(reps + 1):  # the first is a warm-up
                sync(model.device)
                start = time.perf_counter()
                model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=width)
                sync(model.device)
                times.append(time.perf_counter() - start)
                rollback([cache], context)
            row.append(statistics.median(times[1:]))
        out.append(row)
    return out



def describe(table: CostTable, batch: dict) -> str:
    """Markdown: each forward over the target's one-token step at its context."""
    lines = ["# Cost table", "", "Target forward over w new tokens, in one-token target steps, per context:", "",
             "| context | step (ms) | " + " | ".join(f"w={w}" for w in table.widths) + " |",
             "|---|---|" + "---|" * len(table.widths)]
    for context, row in zip(table.contexts, table.forwards["target"]):
        lines.append(f"| {context} | {1000 * row[0]:.2f} | " + " | ".join(f"{t / row[0]:.2f}" for t in row) + " |")
    lines += ["", "Draft step over target step (c), per context: " + ", ".join(
        f"{c}: {d[0] / t[0]:.2f}" for c, d, t in zip(table.contexts, table.forwards["bf16"], table.forwards["target"]))]
    lines += ["", "Prefill (ms) of n tokens, target / draft: " + ", ".join(
        f"{n}: {1000 * t:.1f} / {1000 * d:.1f}" for n, t, d in zip(table.prefills, table.prefill["target"], table.prefill["bf16"]))]
    lines += ["", "Position processing (ms): " + ", ".join(
        f"{mode} {engine} {1000 * s:.3f}" for mode, engines in table.position.items() for engine, s in engines.items())]
    if batch:
        lines += ["", f"Target forward at batch b over w new tokens a row, context {batch['context']}, in batch-1 "
                  "one-token steps:", "", "| batch | " + " | ".join(f"w={w}" for w in batch["widths"]) + " | draft step |",
                  "|---|" + "---|" * (len(batch["widths"]) + 1)]
        step = batch["target"][0][0]
        for b, row, draft in zip(batch["batches"], batch["target"], batch["draft"]):
            lines.append(f"| {b} | " + " | ".join(f"{t / step:.2f}" for t in row) + f" | {draft[0] / step:.2f} |")
    return "\n".join(lines) + "\n"


def handwritten_table(step: float = 0.015, draft_ratio: float = 0.6) -> CostTable:
    """An accelerator-like regime written by hand, not measured: a target forward costs one step
    (`step` seconds) whatever its width up to 64 new tokens (1.5 steps at 128) and whatever its
    context; a draft step costs `draft_ratio` of a target step; a prefill of n tokens costs
    (1 + n / 1024) of the model's step; processing a position costs 0.05 ms greedy and 0.2 ms sampling
    for both engines."""
    widths, contexts, prefills = [1, 2, 3, 5, 9, 17, 33, 64, 128], [64, 256, 1024], [16, 64, 256, 1024]
    row = lambda s: [s] * 8 + [1.5 * s]  # noqa: E731
    draft = step * draft_ratio
    return CostTable(
        widths=widths, contexts=contexts,
        forwards={"target": [row(step)] * 3, "bf16": [row(draft)] * 3, "hf": [row(draft)] * 3},
        prefills=prefills,
        prefill={name: [s * (1 + n / 1024) for n in prefills] for name, s in (("target", step), ("bf16", draft), ("hf", draft))},
        position={"greedy": {"transformers": 5e-5, "hf_specdec": 5e-5}, "sampling": {"transformers": 2e-4, "hf_specdec": 2e-4}},
    )


def main(argv=None) -> CostTable:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    add_options(parser, out=REQUIRED)
    parser.add_argument("--reps", type=int, default=5, help="passes over the grid; each cell is their median")
    parser.add_argument("--dry-run", action="store_true", help="CPU, two layers, a small grid: checks the script runs")
    parser.add_argument("--check", action="store_true",
                        help="only build both models on the meta device (no memory, no timing) and print their sizes")
    parser.add_argument("--handwritten", action="store_true",
                        help="write the hand-written accelerator-like table (`handwritten_table`) instead of measuring")
    parser.add_argument("--mean", nargs="+", metavar="COST_TABLE", type=Path,
                        help="write the elementwise mean of these measured cost_table.json files (same grid) to --out")
    args = parser.parse_args(argv)
    if args.mean:
        table = CostTable.mean([CostTable.load(path) for path in args.mean])
        Path(args.out).mkdir(parents=True, exist_ok=True)
        table.save(Path(args.out) / "cost_table.json")
        text = describe(table, {}) + "\nThe elementwise mean of " + ", ".join(str(p) for p in args.mean) + "\n"
        (Path(args.out) / "cost_table.md").write_text(text)
        print(text)
        return table
    if args.handwritten:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        handwritten_table().save(Path(args.out) / "cost_table.json")
        print(f"wrote {args.out}/cost_table.json (hand-written, not measured)")
        return None
    if args.check:
        for path in (TARGET_CONFIG, DRAFT_CONFIG):
            model = build(path, "meta", torch.bfloat16)
            print(f"{path.name}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B "
                  f"parameters, {model.config.num_hidden_layers} layers, vocab {model.config.vocab_size}")
        return None
    grid = dict(widths=WIDTHS, contexts=CONTEXTS, prefills=PREFILLS, batches=BATCHES, batch_widths=BATCH_WIDTHS,
                reps=args.reps)
    device, layers = args.device, None
    if args.dry_run:
        grid, device, layers = DRY, "cpu", 2
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu_costs.py: torch sees no CUDA device (use --dry-run on a CPU)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = build(TARGET_CONFIG, device, torch.bfloat16, layers)
    draft = build(DRAFT_CONFIG, device, torch.bfloat16, layers)
    vocab = target.config.vocab_size
    for model in (target, draft):  # warm-up: kernels chosen, memory pools grown
        model(input_ids=torch.randint(4, vocab, (1, 32)).to(device))
    table = measure(target, {"bf16": draft}, vocab, MODES, reps=grid["reps"], widths=grid["widths"],
                    contexts=grid["contexts"], prefills=grid["prefills"])
    table.alias("hf", "bf16")  # the eval's hf_specdec draft: on an accelerator, the draft as loaded
    context = grid["contexts"][min(1, len(grid["contexts"]) - 1)]
    batch = dict(context=context, batches=list(grid["batches"]), widths=list(grid["batch_widths"]),
                 target=batch_grid(target, vocab, grid["batches"], grid["batch_widths"], context, grid["reps"]),
                 draft=batch_grid(draft, vocab, grid["batches"], (1,), context, grid["reps"]))
    table.save(out / "cost_table.json")
    (out / "batch_costs.json").write_text(json.dumps(batch, indent=1))
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu (dry run)"
    text = describe(table, batch) + f"\nDevice: {name}; torch {torch.__version__}\n"
    (out / "cost_table.md").write_text(text)
    print(text)
    return table


if __name__ == "__main__":
    main()
