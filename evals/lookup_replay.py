"""Replay retrieval strategies against recorded outputs, without running a model.

Greedy decoding is deterministic: given a run's plain greedy output for a prompt, the target's argmax
after every prefix of prompt + output is known (up to bf16 ties), so how many tokens a lookup
proposal gets accepted in each round can be computed exactly by walking the proposal along the
known output. Each round is priced with a cost table (`costs.CostTable`, the same pricing as the
eval's modelled seconds), so strategies compare deterministically, in seconds rather than the hour a
real run takes. Only lookups can be replayed (a draft model's proposals need the draft).

Sampling (`--mode sampling`) replays against a run's plain *sampled* outputs, and is exact in law for
point-mass proposals: verifying a retrieved child x accepts it with probability p(x), and a later
sibling y, after x was rejected, with p(y) / (1 - p(x)), which is P(next token = x) and P(next token = y
| next token != x) under plain sampling. So coupling verification with the recorded sample (accept the
child equal to the sampled token, if any) gives rounds with exactly the law a real run has, and every
strategy is scored against the same texts (paired), where real sampled runs of two methods differ in
their texts as well as their proposals. (transformers' prompt lookup verifies under sampling in just
this way: it samples each position from p and accepts while the samples equal the candidates.)

Strategies:
  prompt_lookup  transformers' PromptLookupCandidateGenerator: the earliest match of the last 2 (else 1)
                 tokens, its next 10 tokens, every round;
  retrieval_*    hf_specdec's retrieval trees with the library's cost model (DraftPolicy with the
                 draft priced out, as the eval's hf_retrieval_only), costs pinned from the table:
                 minimum match 2 or 1 token, 4 or 8 branches, with and without the verify knee.

    python evals/lookup_replay.py --records evals/results/standard/records.jsonl \
        --cost-table evals/results/standard/cost_table.json --categories summarization rag

Modelled speedups over plain (the record's own plain modelled seconds), per prompt and the category
medians; `recorded` lists the run's own modelled speedups for comparison (the replay of prompt lookup
and of hf_retrieval_only reproduces them within a few percent: run lookup-replay, docs/evaluation.md#older-runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import REQUIRED, add_options  # noqa: E402
from costs import CostTable  # noqa: E402

from hf_specdec.policy import DraftPolicy, PolicySettings  # noqa: E402
from hf_specdec.proposals.base import Tree  # noqa: E402
from hf_specdec.proposals.tree import Trie, depths, retrieval_reach, retrieve, subtree  # noqa: E402
from hf_specdec.verify import greedy_tree_verification  # noqa: E402
from hf_specdec.stats import NGRAM  # noqa: E402


def accepted_walk(tokens: list[int], parents: list[int], truth: list[int]) -> list[int]:
    """Greedy tree verification (the library's) against the known continuation `truth`: the accepted
    nodes. The target's argmax after a node at depth i is truth[i + 1]; past the end of `truth`, none."""
    depth = depths(parents)

    def argmax_at(node: int) -> int:
        i = 0 if node < 0 else depth[node] + 1
        return truth[i] if i < len(truth) else -1

    return greedy_tree_verification(tokens, parents, argmax_at)[0]


def prompt_lookup_chain(sequence: list[int], max_ngram: int = 2, num_tokens: int = 10) -> list[int]:
    """transformers' prompt lookup: the earliest earlier occurrence of the last n tokens (n = max_ngram
    down to 1) with a continuation; its next `num_tokens` tokens."""
    length = len(sequence)
    for n in range(min(max_ngram, length - 1), 0, -1):
        tail = sequence[-n:]
        for start in range(length - n):
            if sequence[start : start + n] == tail and start + n < length:
                return sequence[start + n : start + n + num_tokens]
    return []


class Replay:
    """One prompt's rounds under a strategy; `run` returns the modelled seconds and the round log."""

    def __init__(self, table: CostTable, engine: str, mode: str = "greedy"):
        self.table, self.engine, self.mode = table, engine, mode

    def price(self, width: int, context: int) -> float:
        positions = width if context > 0 else 1
        return self.table.forward("target", width, context) + positions * self.table.position[self.mode][self.engine]

    def run(self, prompt: list[int], output: list[int], propose) -> tuple[float, list[tuple[int, int]]]:
        """`propose(sequence, room) -> (tokens, parents, observe)`; observe(path) is told the accepted nodes."""
        seq, pos, seconds, log = list(prompt), 0, 0.0, []
        context = 0
        while pos < len(output):
            room = len(output) - pos - 1
            tokens, parents, observe = propose(seq, room) if room > 0 else ([], [], None)
            path = accepted_walk(tokens, parents, output[pos:])
            emitted = len(path) + 1
            width = (len(seq) - context) + len(tokens)
            seconds += self.price(width, context)
            if observe is not None:
                observe(path)
            seq += output[pos : pos + emitted]
            pos += emitted
            context = len(seq) - 1  # the last emitted token is fed with the next round
            log.append((len(tokens), emitted))
        return seconds, log


def prompt_lookup(max_ngram: int = 2, num_tokens: int = 10):
    def propose(seq, room):
        chain = prompt_lookup_chain(seq, max_ngram, min(num_tokens, room))
        return chain, list(range(-1, len(chain) - 1)), None

    return propose


def retrieval(verify_cost: float, knee_cost: float, min_ngram: int = 2, max_ngram: int = 3, branches: int = 4,
              max_nodes: int = 24, max_tokens: int = 32):
    policy = DraftPolicy(PolicySettings(draft_cost=1000.0, verify_cost=verify_cost, verify_knee_cost=knee_cost))

    def propose(seq, room):
        import torch

        continuations, size = retrieve(torch.tensor(seq), max_ngram, min_ngram, min(max_tokens, room), branches)
        trie = Trie()
        for continuation in continuations:
            trie.insert(continuation, NGRAM, count=True)
        reach = retrieval_reach(trie, policy.ngram_curve(size, policy.settings.ngram_depths))
        keep = policy.select_nodes(reach, [], 0, max_nodes)
        if not keep:
            return [], [], None
        tokens, parents = subtree(trie, keep)

        def observe(path):
            events = Tree(parents, chain=0, retrieved=[True] * len(parents)).retrieval_events(path)
            policy.observe_tree(0, 0, None, events, size)

        return tokens, parents, observe

    return propose


def load_cases(records_path: Path, categories, mode: str = "greedy") -> list[dict]:
    from transformers import AutoTokenizer

    from common import load_prompts
    from hf_specdec.pair import cache_dir

    tokenizer = AutoTokenizer.from_pretrained(cache_dir() / "qwen2.5-coder-1.5b-instruct" / "safetensors-bfloat16")
    records = [json.loads(line) for line in open(records_path)]
    plain = {r["id"]: r for r in records if r["method"] == "plain" and r["mode"] == mode and r["category"] in categories}
    prompts = {p["id"]: p for p in load_prompts(tokenizer, categories, None, "all") if p["id"] in plain}
    best = {}
    for r in records:
        if r["mode"] == mode and r["id"] in plain and r.get("modelled_speedup"):
            best.setdefault(r["id"], {})[r["method"]] = r["modelled_speedup"]
    return [dict(id=i, category=plain[i]["category"], prompt=prompts[i]["input_ids"], output=plain[i]["tokens"],
                 plain_seconds=plain[i]["modelled_seconds"], recorded=best.get(i, {})) for i in plain]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=Path, required=True, help="a run's records.jsonl (plain outputs)")
    parser.add_argument("--mode", choices=["greedy", "sampling"], default="greedy",
                        help="replay against the plain greedy or the plain sampled outputs (see above)")
    add_options(parser, cost_table=REQUIRED)
    parser.add_argument("--categories", nargs="+", default=["summarization", "rag"])
    parser.add_argument("--out", type=Path, help="write the per-prompt and per-category figures here (JSON)")
    args = parser.parse_args(argv)
    table = CostTable.load(Path(args.cost_table))
    cases = load_cases(args.records, args.categories, args.mode)
    strategies = {  # retrieval_<minimum match>_<branches>: 2gram_4 were the defaults before 1gram_8
        "prompt_lookup": lambda d, e: (prompt_lookup(), "transformers"),
        "retrieval_2gram_4": lambda d, e: (retrieval(d, e), "hf_specdec"),
        "retrieval_1gram_4": lambda d, e: (retrieval(d, e, min_ngram=1), "hf_specdec"),
        "retrieval_1gram_8": lambda d, e: (retrieval(d, e, min_ngram=1, branches=8), "hf_specdec"),
        "retrieval_2gram_8": lambda d, e: (retrieval(d, e, min_ngram=2, branches=8), "hf_specdec"),
        "retrieval_1gram_8_no_knee": lambda d, e: (retrieval(d, 0.0, min_ngram=1, branches=8), "hf_specdec"),
    }
    out = {}
    for case in cases:
        pins = table.pinned_costs(len(case["prompt"]))
        row = {}
        for name, make in strategies.items():
            propose, engine = make(pins["verify_cost"], pins["verify_knee_cost"])
            seconds, log = Replay(table, engine, args.mode).run(case["prompt"], case["output"], propose)
            row[name] = case["plain_seconds"] / seconds
        out[case["id"]] = dict(category=case["category"], replayed=row, recorded=case["recorded"])
        print(case["id"], case["category"], " ".join(f"{k} {v:.2f}" for k, v in row.items()),
              "| recorded", " ".join(f"{k} {v:.2f}" for k, v in case["recorded"].items()))
    medians = {}
    for category in args.categories:
        rows = [v for v in out.values() if v["category"] == category]
        medians[category] = {k: statistics.median(r["replayed"][k] for r in rows) for k in strategies}
        print(category, " ".join(f"{k} {v:.2f}" for k, v in medians[category].items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(prompts=out, category_medians=medians), indent=1))
    return out


if __name__ == "__main__":
    main()
