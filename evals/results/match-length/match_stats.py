"""How often the continuation of the longest earlier match is the next token, by match length.

For every position of each plain greedy output in a run's records, the longest suffix of the sequence
so far (prompt + output before it) that occurred earlier is measured (up to 64 tokens), and its most
recent occurrence's next token is compared with the token the target emitted there. Reported per
category and match-length bucket (1, 2, 3, then 4-7, 8-15, 16-31, 32+): positions, share correct.
It reads only the records and the prompts (no model is run); the numbers behind `ngram_match_cap`.

usage (from the repository root): python evals/results/match-length/match_stats.py runs/std-greedy-widths/records.jsonl
"""
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, "evals")
from common import load_prompts  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from hf_specdec.pair import TARGET, _local_folder  # noqa: E402

BUCKETS = (32, 16, 8, 4, 3, 2, 1)


def bucket(length: int) -> int:
    return next((b for b in BUCKETS if length >= b), 0)


def longest_match(seq: list[int], cap: int = 64) -> tuple[int, int | None]:
    """(length, next token) of the longest earlier match of seq's suffix, most recent among equals."""
    n, best, nxt = len(seq), 0, None
    for start in range(n - 1):  # an occurrence ending just before seq[start]
        length = 0
        while length < cap and start - 1 - length >= 0 and seq[start - 1 - length] == seq[n - 1 - length]:
            length += 1
        if length and length >= best:
            best, nxt = length, seq[start]
    return best, nxt


def main(path: str) -> None:
    import torch

    records = [json.loads(line) for line in open(path)]
    plain = [r for r in records if r["method"] == "plain" and r.get("mode", "greedy") == "greedy"]
    tokenizer = AutoTokenizer.from_pretrained(_local_folder(TARGET.name, torch.bfloat16))
    categories = sorted({r["category"] for r in plain})
    prompts = {p["id"]: p for p in load_prompts(tokenizer, categories, None, "all")}
    print(f"{path}: {len(plain)} plain greedy outputs")
    for category in categories:
        stats = collections.defaultdict(lambda: [0, 0])
        for r in (r for r in plain if r["category"] == category):
            seq, out = list(prompts[r["id"]]["input_ids"]), r["tokens"]
            for t, token in enumerate(out):
                length, nxt = longest_match(seq + out[:t])
                if length:
                    stats[bucket(length)][0] += 1
                    stats[bucket(length)][1] += nxt == token
        cells = ", ".join(f"{b}: {n} at {c / n:.2f}" for b, (n, c) in sorted(stats.items()))
        print(f"{category:15} {cells}")


if __name__ == "__main__":
    main(sys.argv[1])
