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
from transformers import AutoTokenizer  # noqa: E402

from hf_specdec.pair import TARGET, _local_folder  # noqa: E402

L = 10


def pl(seq):
    n = len(seq)
    for k in (2, 1):
        for i in range(n - k):
            if seq[i : i + k] == seq[n - k :]:
                return seq[i + k : i + k + L]
    return []


def recent(seq):
    n = len(seq)
    for k in (3, 2, 1):
        for i in range(n - k - 1, -1, -1):
            if seq[i : i + k] == seq[n - k :]:
                return seq[i + k : i + k + L]
    return []


def earliest3(seq):
    n = len(seq)
    for k in (3, 2, 1):
        for i in range(n - k):
            if seq[i : i + k] == seq[n - k :]:
                return seq[i + k : i + k + L]
    return []


def _longest(seq, earliest_among_equals, cap=64):
    n, best, nxt = len(seq), 0, None
    for start in range(1, n):
        length = 0
        while length < cap and start - 1 - length >= 0 and seq[start - 1 - length] == seq[n - 1 - length]:
            length += 1
        if length and (length > best or (length == best and not earliest_among_equals)):
            best, nxt = length, start
    return seq[nxt : nxt + L] if best else []


RULES = {"pl": pl, "recent": recent, "earliest3": earliest3,
         "longest": lambda s: _longest(s, False), "longest_earliest": lambda s: _longest(s, True)}


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
