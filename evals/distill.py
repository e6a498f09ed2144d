"""Distil the draft toward the target on tuning-split prompts, then compare acceptance before and after
on the report split (`hf_specdec.distill`: on-policy samples, forward KL or total variation, a subset
of the draft's layers; checkpoints every few steps, resumed on a rerun with the same --out).

    python evals/distill.py --steps 300 --divergence tv --out runs/distill    # real pair, ~1 h on 2 CPU cores
    python evals/distill.py --target tiny --draft tiny --steps 20 --out runs/tiny-distill   # offline, seconds

The trained draft is saved to <out>/draft (a model folder: `--draft <out>/draft` in the CLI and the
eval load it, and quantize it to int8 like the original). Acceptance is teacher-forced on the plain
greedy outputs of a recorded run (`--records`, the report split's; see `self_spec.py`): per token,
greedy (argmaxes agree) and sampling (sum min(p, q) at T = 0.7, top-p 0.95), per category. Writes
<out>/report.md and <out>/summary.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import CATEGORIES, add_options, apply_threads, load_pair, load_prompts  # noqa: E402
from hf_specdec.distill import DIVERGENCES, DistillConfig, Distiller  # noqa: E402
from self_spec import acceptance, summarise, teacher_texts  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, "target", "draft")
    parser.add_argument("--records", default=str(HERE / "results" / "standard" / "records.jsonl"))
    parser.add_argument("--divergence", choices=DIVERGENCES, default="tv")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--train-layers", nargs="+", type=int, default=None, help="decoder layer indices (default: the last two)")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    add_options(parser, "threads", out="runs/distill")
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    out = Path(args.out)
    target, draft, tokenizer = load_pair(args.target, args.draft, "cpu")
    original = copy.deepcopy(draft)
    train_prompts = [p["input_ids"] for p in load_prompts(tokenizer, CATEGORIES, None, "tuning")]
    config = DistillConfig(divergence=args.divergence, steps=args.steps, lr=args.lr, new_tokens=args.new_tokens,
                           train_layers=None if args.train_layers is None else tuple(args.train_layers),
                           checkpoint_every=args.checkpoint_every)
    distiller = Distiller(target, draft, config, out)
    print(f"{len(train_prompts)} tuning-split prompts; starting at step {distiller.step_count} of {config.steps}")
    losses = distiller.train(train_prompts)
    folder = distiller.save_draft(out / "draft", tokenizer)

    prompts, tokens = teacher_texts(target, tokenizer, Path(args.records), args.target == "tiny")
    distilled = distiller.draft.to(original.dtype)
    rows = acceptance(target, {"before": original, "after": distilled}, [], prompts, tokens)
    summary = summarise(rows, {}, 0.0)
    window = max(1, len(losses) // 5)
    first, last = statistics.fmean(losses[:window]), statistics.fmean(losses[-window:])
    lines = [f"# Distilled draft: acceptance before and after ({len(prompts)} report-split prompts)", "",
             "    python evals/distill.py " + " ".join(argv if argv is not None else sys.argv[1:]), "",
             f"Training: {config.steps} steps on {len(train_prompts)} tuning-split prompts, {config.divergence}, lr {config.lr}, "
             f"{config.new_tokens} on-policy tokens a step, layers {list(distiller.trained_layers)} trained "
             f"({sum(p.numel() for p in distiller.params.values()) / 1e6:.1f} M parameters), {distiller.seconds / 60:.0f} min "
             f"of training on {torch.get_num_threads()} threads. Training divergence (on-policy, each step on another "
             f"prompt), mean of the first and the last {window} steps: {first:.4f} -> {last:.4f}. Draft saved to {folder}.", "",
             "Teacher-forced on plain greedy outputs, drafts in their saved dtype (not quantized): greedy, the argmaxes "
             "agree; sampling, sum min(p, q) at T = 0.7, top-p 0.95.", "",
             "Per token, per category:", "",
             "| draft | mode | " + " | ".join(CATEGORIES) + " | all |", "| --- | --- |" + " --- |" * (len(CATEGORIES) + 1)]
    for name, entry in summary.items():
        for mode in ("greedy", "sampling"):
            cells = [f"{entry[mode]['per_category'].get(c, float('nan')):.3f}" for c in CATEGORIES]
            lines.append(f"| {name} | {mode} | " + " | ".join(cells) + f" | {entry[mode]['overall']:.3f} |")
    positions = len(next(iter(summary.values()))["greedy"]["per_position"])
    lines += ["", "Per chain position (conditional: of the chains that reached position j, the share accepted there; "
              "all categories):", "",
              "| draft | mode | " + " | ".join(str(j) for j in range(1, positions + 1)) + " |",
              "| --- | --- |" + " --- |" * positions]
    for name, entry in summary.items():
        for mode in ("greedy", "sampling"):
            cells = ["-" if v is None else f"{v:.3f}" for v in entry[mode]["per_position"]]
            lines.append(f"| {name} | {mode} | " + " | ".join(cells) + " |")
    lines += ["", "Greedy, position 1 by category (where the chain most often breaks):", "",
              "| draft | " + " | ".join(CATEGORIES) + " |", "| --- |" + " --- |" * len(CATEGORIES)]
    for name, entry in summary.items():
        by = entry["greedy"]["per_category_position"]
        cells = [f"{by[c][0]:.3f}" if c in by and by[c][0] is not None else "-" for c in CATEGORIES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(dict(config=config.__dict__, losses=losses, train_seconds=distiller.seconds, summary=summary)))
    print(text)


if __name__ == "__main__":
    main()
