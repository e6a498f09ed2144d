"""How fast could n samples a prompt be decoded at best? An oracle bound for issue 39's workloads.

    python evals/repetition_bound.py --out runs/bound                      # 5 prompts x 8 samples a workload
    python evals/repetition_bound.py --out runs/bound-smoke --limit 1 --samples 2 --max-new-tokens 16

Issue 39 asks hf_specdec with a shared `RetrievalCache` for 2.5x plain sampling on pass@k (1.3x
hf_specdec without the cache) and 2x on self-consistency. This script asks how much any planner could
get from the pair, the cost table and the retrieval sources, by decoding with perfect knowledge:

1. n samples a prompt are drawn by plain sampling from the target (`repetition.WORKLOADS`: the
   temperature and top-p of each workload), so they are the outputs any exact method produces in law.
2. Teacher-forced, each sample's target and draft distributions p_t and q_t (same warpers) give the
   draft's coverage of token t: along a fixed sample path, the rejection rule accepts the draft's
   token and emits x_t with probability min(p(x_t), q(x_t)); given that x_t is emitted that is
   a_t = min(1, q(x_t) / p(x_t)), independently across positions.
3. Retrieval covers a run of r_t tokens at position t: the number of tokens of the continuation a
   source proposes that equal the sample's next tokens (a point mass is accepted exactly when it is the
   emitted token). Sources: `ngram` (in-row lookup, the library's `ngram_match`), `cache` (a
   `RetrievalCache` holding every earlier sample of the workload, as the sequential eval fills it,
   plus in-row lookup), `any` (the longest run of the sample's next tokens found anywhere in the
   earlier samples or the row: no retrieval structure can propose more).
4. A dynamic program over positions gives the least expected cost to finish each sample, choosing at
   every position among a plain step, a draft chain of k tokens (k = 1..16, accepted run as the a_t
   say), the retrieved run verified exactly (the oracle verifies r_t tokens, no more), or both in one
   tree (the longer accepted branch wins; "chains only": never both, as hf_specdec's sampling rounds
   are today; "chains extended": a draft chain may be followed by the run retrieved after it). Prices from the cost table as `evals/replay.py` pins them (a target forward over w
   tokens, a draft step); prefills and the draft catching up are free.

The bound is the sample's tokens over that cost, against one target step a token for plain. It is an
upper bound on what any planner gets from these sources under these prices (it knows the a_t and
the runs; a real planner must guess them), not a speedup anyone measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import hf_specdec  # noqa: E402
from common import add_options, apply_threads, geometric_mean, load_pair  # noqa: E402
from costs import load_table  # noqa: E402
from repetition import DEFAULT_TABLE, MODE, WORKLOADS, workload_prompts  # noqa: E402

from hf_specdec.proposals.ngram import MAX_TOKENS, NgramDrafter, ngram_match  # noqa: E402

MAX_K = 16  # the longest draft chain the oracle considers
SOURCES = ("ngram", "cache", "any")
WINDOW = hf_specdec.SpeculativeConfig().window_for(True)  # as evals/repetition.py pins costs


def sample(target, prompt: dict, workload, n: int, max_new_tokens: int, seed: int, eos: set[int]) -> list[list[int]]:
    """n plain samples of the target (one batch of n rows), each cut after its first end token."""
    ids = torch.tensor([prompt["input_ids"]])
    torch.manual_seed(seed)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), **workload.sampling(), max_new_tokens=max_new_tokens,
                          num_return_sequences=n)
    samples = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        samples.append(row[:cut])
    return samples


@torch.no_grad()
def coverage(target, draft, prompt_ids: list[int], tokens: list[int], workload) -> list[float]:
    """a_t = min(1, q(x_t) / p(x_t)) at each sampled token, p and q warped alike."""
    warp = LogitsProcessorList([TemperatureLogitsWarper(workload.temperature)]  # as generate() orders them
                               + ([TopKLogitsWarper(workload.top_k)] if workload.top_k else [])
                               + ([TopPLogitsWarper(workload.top_p)] if workload.top_p < 1.0 else []))
    ids = torch.tensor([prompt_ids + tokens])
    start = len(prompt_ids) - 1
    probs = []
    for model in (target, draft):
        logits = model(ids).logits[0, start:-1].float()  # [n, vocab]: temperature, top-k and top-p read no ids
        logits = warp(torch.zeros(len(tokens), 1, dtype=torch.long), logits)
        probs.append(torch.softmax(logits, dim=-1)[torch.arange(len(tokens)), torch.tensor(tokens)])
    p, q = probs
    return torch.where(p > 0, torch.clamp(q / p.clamp_min(1e-12), max=1.0), torch.zeros_like(p)).tolist()


def run_of(proposal: list[int], actual: list[int]) -> int:
    n = 0
    for mine, real in zip(proposal, actual):
        if mine != real:
            break
        n += 1
    return n


def runs(prompt_ids: list[int], tokens: list[int], cache: hf_specdec.RetrievalCache, earlier: list[list[int]]) -> dict:
    """Per source, r_t at each position t of `tokens` (see the module docstring)."""
    lookup = NgramDrafter()
    seen = _runs_in(earlier)  # every run of up to MAX_TOKENS tokens in the earlier samples
    own = _runs_in([prompt_ids + tokens])  # ... and in the row: where each ends first
    out = {source: [] for source in SOURCES}
    for t in range(len(tokens)):
        host, actual = prompt_ids + tokens[:t], tokens[t:]
        mine = run_of(ngram_match(host, lookup.max_ngram, lookup.min_ngram, MAX_TOKENS, lookup.match_cap)[0], actual)
        found = cache.lookup(host, MAX_TOKENS)[0]
        shared = run_of(found[0], actual) if found else 0
        best = 0  # anywhere: the longest prefix of `actual` seen in the earlier samples or in the row so far
        while best < min(MAX_TOKENS, len(actual)):
            part = tuple(actual[: best + 1])
            if part not in seen and own.get(part, len(host) + 1) > len(host):
                break
            best += 1
        out["ngram"].append(mine)
        out["cache"].append(max(mine, shared))
        out["any"].append(max(best, mine, shared))
    return out


def _runs_in(sequences: list[list[int]]) -> dict[tuple[int, ...], int]:
    """Every run of up to MAX_TOKENS tokens in `sequences`, with the least index its end reaches."""
    out: dict[tuple[int, ...], int] = {}
    for sequence in sequences:
        for i in range(len(sequence)):
            for j in range(i + 1, min(len(sequence), i + MAX_TOKENS) + 1):
                part = tuple(sequence[i:j])
                out[part] = min(out.get(part, j), j)
    return out


def least_cost(accept: list[float], retrieved: list[int] | None, price, draft_step: float,
               kinds: tuple[str, ...] = ("tree",)) -> float:
    """The least expected cost of decoding the whole sample (module docstring, step 4). Rounds besides
    a plain step, a draft chain and a retrieved run (`kinds`): "tree", the draft's chain and the run
    beside it; "extend", the draft's chain followed by the run retrieved after it (taken if the chain
    is, a chain of mixed sources). Neither: a round verifies a draft chain or a run, never both."""
    n = len(accept)
    cost = [0.0] * (n + 1)
    for t in range(n - 1, -1, -1):
        best = price(1) + cost[t + 1]
        r = min(retrieved[t], n - t - 1) if retrieved else 0
        for k in range(1, min(MAX_K, n - t - 1) + 1):
            after = min(retrieved[t + k], n - t - k - 1) if retrieved and "extend" in kinds else 0
            reach, chain, tree, extended = 1.0, 0.0, 0.0, 0.0  # P(first i accepted); E[cost after the round]
            for i in range(k + 1):  # i draft tokens accepted, then a rejection (or all k taken)
                stop = reach * (1 - accept[t + i]) if i < k else reach
                chain += stop * cost[t + i + 1]
                tree += stop * cost[t + max(i, r) + 1]
                extended += stop * cost[t + i + 1 + (after if i == k else 0)]
                if i < k:
                    reach *= accept[t + i]
            best = min(best, k * draft_step + price(k + 1) + chain)
            if r and "tree" in kinds:
                best = min(best, k * draft_step + price(k + r + 1) + tree)
            if after:
                best = min(best, k * draft_step + price(k + after + 1) + extended)
        if r:
            best = min(best, price(r + 1) + cost[t + r + 1])
        cost[t] = best
    return cost[0]


KINDS = {"cache": ("tree",), "cache, chains": (), "cache, extend": ("extend",)}  # the cache's columns


def bound_rows(target, draft, prompts: list[dict], workload, tables: dict, n: int, max_new_tokens: int, seed: int,
               eos: set[int]) -> list[dict]:
    """Per sample: its tokens, and per table and source the bound's speedup over plain."""
    cache, rows = hf_specdec.RetrievalCache(), []
    earlier: list[list[int]] = []
    for p_index, prompt in enumerate(prompts):
        for s_index, tokens in enumerate(sample(target, prompt, workload, n, max_new_tokens, seed + p_index, eos)):
            if not tokens:
                continue
            accept = coverage(target, draft, prompt["input_ids"], tokens, workload)
            retrieved = runs(prompt["input_ids"], tokens, cache, earlier)
            row = dict(workload=workload.name, id=prompt["id"], sample=s_index, tokens=len(tokens),
                       mean_acceptance=statistics.fmean(accept),
                       covered={s: sum(r > 0 for r in v) / len(tokens) for s, v in retrieved.items()}, bound={})
            for label, pins in tables.items():
                costs = pins(len(prompt["input_ids"]))
                row["bound"][label] = {
                    source: len(tokens) / least_cost(accept, retrieved.get(source), costs.verify_price, costs.draft_step)
                    for source in ("draft",) + SOURCES}
                for column, kinds in list(KINDS.items())[1:]:
                    row["bound"][label][column] = len(tokens) / least_cost(
                        accept, retrieved["cache"], costs.verify_price, costs.draft_step, kinds)
            row.update(accept=[round(a, 4) for a in accept], runs=retrieved)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("accept", "runs")}), flush=True)
            cache.add(tokens, prompt["input_ids"])
            earlier.append(tokens)
    return rows


def report(rows: list[dict], labels: list[str]) -> str:
    lines = ["| workload | table | draft only | + in-row lookup | + cache (library) | + anything retrievable "
             "| cache, chains only | cache, chains extended |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == name]
        for label in labels:
            cells = [geometric_mean(r["bound"][label].get(s) for r in mine) for s in ("draft",) + SOURCES + tuple(KINDS)[1:]]
            lines.append(f"| {name} | {label} | " + " | ".join("-" if c is None else f"{c:.2f}x" for c in cells) + " |")
    lines += ["", "Geometric means over samples of the bound's speedup over plain sampling. Tokens a retrieval",
              "source covers (r_t > 0), and the draft's mean a_t:", ""]
    for name in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == name]
        covered = {s: statistics.fmean(r["covered"][s] for r in mine) for s in SOURCES}
        lines.append(f"- {name}: {len(mine)} samples, draft a_t {statistics.fmean(r['mean_acceptance'] for r in mine):.2f}; "
                     + ", ".join(f"{s} {100 * v:.0f}%" for s, v in covered.items()))
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--limit", type=int, default=None, help="the first prompts of each workload only")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost-table", nargs="+", default=[str(DEFAULT_TABLE)],
                        help="label=path or path: each prices the oracle's rounds (the draft priced as bf16)")
    add_options(parser, "threads")
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    from hf_specdec.pair import DRAFT, TARGET

    target, draft, tokenizer = load_pair(TARGET.name, DRAFT.name, "cpu")
    tables = {}
    for spec in args.cost_table:
        label, _, path = spec.rpartition("=")
        table = load_table(Path(path))
        tables[label or Path(path).parent.name] = (
            lambda length, table=table: table.pinned_costs(length, "hf", WINDOW, MODE)["costs"])
    eos = {tokenizer.eos_token_id, *([target.generation_config.eos_token_id] if isinstance(
        target.generation_config.eos_token_id, int) else target.generation_config.eos_token_id or [])}
    prompts = workload_prompts(tokenizer, args.workloads, args.limit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.workloads:
        rows += bound_rows(target, draft, prompts[name], WORKLOADS[name], tables, args.samples, args.max_new_tokens,
                           args.seed, eos)
    (out / "bound.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = (f"Command: `python evals/repetition_bound.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
            + report(rows, list(tables)))
    (out / "bound.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
