"""How a retrieved continuation's acceptance depends on its depth (the evidence behind a per-depth
retrieval acceptance, tried and removed: it gained the planner nothing beyond noise, see
evals/results/planner/third/).

    python evals/lookup_depth.py --out evals/results/lookup-depth

On the recorded plain outputs of a standard-preset run (greedy and sampled; a sampled token equals a
proposed x with probability p(x), the chance that verification would accept x), at every output
position: in-row lookup as hf_specdec does it (`ngram_match` with `NgramDrafter`'s defaults, over the
text before that position, up to 24 tokens), walked against the tokens that really came next. Per
match size (its bucket) and depth bucket (0, 1, 2-3, 4-7, 8-15, 16+): P(the token at that
depth matches | every token before it in the continuation matched), and how many were reached. No
model runs (only the tokenizer, to rebuild the prompts).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import load_prompts  # noqa: E402
from regimes import STANDARD, read_records  # noqa: E402

from hf_specdec.proposals.ngram import NgramDrafter, ngram_match  # noqa: E402

LOOKUP = NgramDrafter()  # in-row lookup with the defaults: n-grams of 3 down to 1, matches measured up to its cap

DEPTH = 24
BUCKETS = (0, 1, 2, 4, 8, 16)  # a depth's bucket: the largest of these at most the depth (depth.bit_length())


def depth_rates(outputs: list[tuple[list[int], list[int]]]) -> dict[tuple[int, int], tuple[int, int]]:
    """(match size, bucket) -> (matched, reached) over every output position of (prompt, output) pairs."""
    reached, matched = collections.Counter(), collections.Counter()
    for prompt, output in outputs:
        sequence = prompt + output
        for t in range(len(prompt), len(sequence)):
            tokens, size = ngram_match(sequence[:t], LOOKUP.max_ngram, LOOKUP.min_ngram, DEPTH, LOOKUP.match_cap)
            for depth, token in enumerate(tokens[: len(sequence) - t]):
                cell = (size, BUCKETS[min(depth.bit_length(), len(BUCKETS) - 1)])
                reached[cell] += 1
                if sequence[t + depth] != token:
                    break
                matched[cell] += 1
    return {cell: (matched[cell], n) for cell, n in reached.items()}


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", default=str(STANDARD))
    parser.add_argument("--out", default=None, help="write README.md with the table here")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from hf_specdec.pair import DRAFT, cache_dir

    folder = cache_dir() / DRAFT.name / "safetensors-bfloat16"
    if not folder.is_dir():
        raise SystemExit(f"no tokenizer at {folder}: run the README's main command once (it installs the pair)")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    records = read_records(Path(args.records))
    by_id = {p["id"]: p for p in load_prompts(tokenizer, sorted({r["category"] for r in records}), None, "all")}
    lines = [f"# Retrieved continuations: acceptance by depth\n\nCommand: `python evals/lookup_depth.py "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n", __doc__.split("\n\n", 2)[2].strip(), ""]
    for mode in ("greedy", "sampling"):
        outputs = [(by_id[r["id"]]["input_ids"], r["tokens"]) for r in records
                   if r["method"] == "plain" and r["mode"] == mode]
        rates = depth_rates(outputs)
        lines += [f"## {mode} ({len(outputs)} plain outputs)", "",
                  "| match size | " + " | ".join(f"depth {b}{'+' if b == 16 else '-' + str(2 * b - 1) if b > 1 else ''}"
                                                for b in BUCKETS) + " |", "|---|" + "---|" * len(BUCKETS)]
        for size in sorted({size for size, _ in rates}):
            cells = [rates.get((size, b)) for b in BUCKETS]
            lines.append(f"| {size} | " + " | ".join("-" if c is None else f"{c[0] / c[1]:.2f} ({c[1]})" for c in cells) + " |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "README.md").write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
