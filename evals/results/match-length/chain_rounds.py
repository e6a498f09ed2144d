"""Rounds a one-chain lookup needs to reproduce each plain greedy output, by retrieval rule.

Each round proposes up to 10 tokens copied from one earlier occurrence, chosen by the rule; the
round emits the tokens that agree with the recorded output and one more (as verification would).
No model is run: it reads a run's records and the prompts. Rules: `pl` transformers' prompt lookup
(the earliest occurrence of the last 2 tokens, else of the last one), `recent` the most recent
occurrence of the last 3 / 2 / 1 tokens (hf_specdec before `ngram_match_cap`), `earliest3` the
earliest, `longest` the occurrence whose match reaches furthest back (most recent among equals),
`longest_earliest` the same, earliest among equals (hf_specdec with `ngram_match_cap`).

usage (from the repository root): python evals/results/match-length/chain_rounds.py RECORDS CATEGORIES
"""
import json
import sys

sys.path.insert(0, "evals")
import torch  # noqa: E402
from common import load_prompts  # noqa: E402
from lookup_replay import prompt_lookup_chain  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from hf_specdec.pair import TARGET, _local_folder  # noqa: E402
from hf_specdec.proposals import ngram_match  # noqa: E402
from hf_specdec.proposals.tree import match_length  # noqa: E402

L = 10


def occurrences(seq, k):
    """Starts of the earlier occurrences of the last k tokens (ascending)."""
    return [i for i in range(len(seq) - k) if seq[i : i + k] == seq[len(seq) - k :]]


def by_size(seq, pick):
    """The continuation of the occurrence `pick(starts, k)` chooses, for the longest k of 3, 2, 1 that occurs."""
    for k in (3, 2, 1):
        starts = occurrences(seq, k)
        if starts:
            start = pick(starts, k)
            return seq[start + k : start + k + L]
    return []


def library(seq, cap):
    """hf_specdec's own chain lookup (`ngram_match`: 3 / 2 / 1 tokens; with `cap`, the longest match)."""
    return ngram_match(torch.tensor(seq), 3, 1, L, match_cap=cap)[0].tolist()


RULES = {
    "pl": lambda s: prompt_lookup_chain(s, 2, L),  # transformers' prompt lookup (evals/lookup_replay.py)
    "recent": lambda s: library(s, 0),
    "earliest3": lambda s: by_size(s, lambda starts, k: starts[0]),
    "longest": lambda s: by_size(s, lambda starts, k: max(starts, key=lambda i: (match_length(s, i, k, 64), i))),
    "longest_earliest": lambda s: library(s, 64),
}


def main(path, categories):
    records = [json.loads(line) for line in open(path)]
    plain = [r for r in records if r["method"] == "plain" and r["category"] in categories]
    tokenizer = AutoTokenizer.from_pretrained(_local_folder(TARGET.name, torch.bfloat16))
    prompts = {p["id"]: p for p in load_prompts(tokenizer, categories, None, "all")}
    print("rounds per prompt, in record order:", [r["id"] for r in plain])
    for name, rule in RULES.items():
        per = []
        for r in plain:
            seq, out, t, rounds = list(prompts[r["id"]]["input_ids"]), r["tokens"], 0, 0
            while t < len(out):
                proposal, a = rule(seq + out[:t]), 0
                while a < len(proposal) and t + a < len(out) and proposal[a] == out[t + a]:
                    a += 1
                t, rounds = t + a + 1, rounds + 1
            per.append(rounds)
        print(f"{name:17} {sum(per):5} {per}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
