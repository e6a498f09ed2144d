"""Could Token Recycling (Luo et al. 2024, arXiv:2408.08696) pay here? Its acceptance, measured before anyone builds it.

    python evals/recycling.py                    # the 35 report-split prompts of the standard preset (~10 min on 2 cores)
    python evals/recycling.py --per-category 3   # 21 prompts, 3 of each category (304 s of forwards on 2 busy cores)
    python evals/recycling.py --limit 3 --out /tmp/recycling     # a quick look

Token Recycling keeps, for every token id t, the target's top-k next-token candidates from the last
time t was the input at some position (free: they are in the verification logits), in a fixed table;
each round it proposes, from the row's last token, a tree that follows the table (the last token's
top candidates, then their own table entries, ...), verified greedily at no draft cost.

What this measures, per report-split prompt of the standard preset (`evals/results/standard/records.jsonl`):
the prompt's ids and its recorded plain greedy output go through ONE teacher-forced target forward
(bf16, as `load_pair` loads it), which gives the target's top-8 candidates after every token. Then,
position by position over the output (position i: the last real token is seq[i-1], the true next
tokens are the recorded greedy seq[i:]), with the table filled only from inputs at positions up to
i-2 (the logits at i-1 are what the coming round's forward computes; a later input of a token
overwrites its entry):
  - hit@k: the true next token is among table[seq[i-1]][:k], k = 1, 2, 4, 8 (a miss when the table
    has no entry for it; "has entry" is how often it has one);
  - accepted tokens of a proposal walked with the true greedy tokens (the matched path length; the
    round's bonus token is not counted), averaged over positions:
      chain: the top-1 chain from the last token (table[t][0], then its own top-1, ...), depth 6;
      tree: a static 24-node tree of rank paths (`tree_template`: best first by prior 2^-(rank+1)
        per level, at most 8 / 4 / 2 / 1 / 1 / 1 children per node by depth, depth <= 6; with these
        settings it takes 5 nodes at depth 1, 10 at 2, 8 at 3 and 1 at 4), its tokens read from the
        table, as the paper's static template is;
      lookup: this project's in-row n-gram lookup, `ngram_match(seq[:i], 3, 1, 8, 32)`, accepted =
        the common prefix of its continuation with seq[i:] ("matched": how often it proposes at all);
        "lookup n>=2": the same with min_ngram 2 (the project's chain default, `lookup_min_size`);
      lookup else tree: the lookup where it matched, the recycling tree otherwise. With min_ngram 1
        this IS the lookup: the table has an entry for the last token only if it occurred before
        (at j <= i-2), and then a 1-gram lookup matches, so the tree never gets a position the
        lookup leaves; "lookup n>=2 else tree" is the combination that can differ;
      merged: the better of lookup and tree at each position (exactly what a trie holding the
        lookup's chain and the tree accepts: each root path of the trie is a path of one of them).
  - tokens per round with the rounds replayed: from the first output position, each round proposes
    as the figures above do at its position and emits its accepted tokens plus the target's own
    (exact for greedy: the table and the lookup depend on the real tokens only); plain decoding: 1.
Two variants of the table: filled from the prompt's positions too (its prefill logits fill it
before generation, as the paper does), and from generated positions only (inputs at i >= the prompt
length). Per category and over all positions pooled.

Limits: teacher-forced on the recorded greedy outputs, so greedy only (no sampling), and one table
per prompt that starts empty (a table carried across prompts is not measured). The table is fed by
the real sequence's positions only; the method as published also refreshes it from the logits of
every tree node it verifies, rejected branches included (more and fresher entries: not measured). Accepted tokens per
position is an upper bound on what a tree round verifies, before costs: a real round advances by
accepted + 1 and then proposes from there (the replayed rounds count that), and a 24-node tree
costs a 25-wide target forward (33 merged with an 8-token lookup) where plain decoding costs a 1-wide
one and the lookup chain 9 at most. The project's lookup trees (several continuations,
`hf_specdec.proposals.tree.retrieve`) and its draft model are not simulated: the comparison is with
the single lookup chain.

Writes <out>/recycling.md (the tables, also printed) and <out>/recycling.json (the figures).
`--cache FILE` keeps the top-8 arrays (a rerun with another tree skips the forwards).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from hf_specdec.proposals.ngram import ngram_match  # noqa: E402

TOP_K = 8  # candidates kept per token
KS = (1, 2, 4, 8)  # hit@k
BRANCHING = (8, 4, 2, 1, 1, 1)  # most children per node at depth 1, 2, ... (its length: the deepest level)
MAX_NODES = 24
CHAIN_DEPTH = 6
LOOKUP = (3, 1, 8, 32)  # ngram_match(seq[:i], max_ngram, min_ngram, max_tokens, match_cap); also with min_ngram 2
VARIANTS = ("prompt fills", "generated only")
METHODS = ("lookup", "lookup n>=2", "chain", "tree", "lookup else tree", "lookup n>=2 else tree", "merged")
ROUNDS = ("lookup", "lookup n>=2", "tree", "lookup n>=2 else tree", "merged")  # also replayed as rounds
SHARES = ("has_entry", *(f"hit@{k}" for k in KS), "lookup matched", "lookup n>=2 matched")


def tree_template(branching=BRANCHING, max_nodes: int = MAX_NODES) -> list[tuple[int, int]]:
    """A static tree of rank paths, as (parent node, rank) per node (parent -1: the last real token),
    parents before children: the `max_nodes` paths of highest prior, a path's prior being
    prod 2^-(rank+1) over its levels (so: fewest depth + sum of ranks first; ties shallower first, then
    by ranks), with at most branching[d] children per node at depth d + 1."""
    nodes: list[tuple[int, int]] = []
    heap = [(rank + 1, 1, (rank,), -1) for rank in range(branching[0])]  # (cost, depth, rank path, parent)
    heapq.heapify(heap)
    while heap and len(nodes) < max_nodes:
        cost, depth, path, parent = heapq.heappop(heap)
        nodes.append((parent, path[-1]))
        if depth < len(branching):
            for rank in range(branching[depth]):
                heapq.heappush(heap, (cost + rank + 1, depth + 1, path + (rank,), len(nodes) - 1))
    return nodes


def chain_template(depth: int = CHAIN_DEPTH) -> list[tuple[int, int]]:
    return [(d - 1, 0) for d in range(depth)]


def walk(template: list[tuple[int, int]], table: dict[int, list[int]], last: int, truth: list[int]) -> int:
    """Tokens of `truth` a tree accepts: the template's nodes read from `table` from `last` (a node
    whose parent token has no entry, or too few, is absent), walked with the true tokens."""
    tokens: list[int | None] = []
    depth: list[int] = []
    matched: list[bool] = []
    best = 0
    for parent, rank in template:
        above = last if parent < 0 else tokens[parent]
        row = None if above is None else table.get(above)
        token = row[rank] if row is not None and rank < len(row) else None
        d = 1 if parent < 0 else depth[parent] + 1
        ok = (token is not None and d <= len(truth) and token == truth[d - 1]
              and (parent < 0 or matched[parent]))
        tokens.append(token)
        depth.append(d)
        matched.append(ok)
        if ok:
            best = max(best, d)
    return best


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def empty_sums() -> dict:
    return dict(positions=0, **{k: 0 for k in SHARES}, **{m: 0 for m in METHODS}, **{f"rounds: {m}": 0 for m in ROUNDS})


def simulate(seq: list[int], topk, prompt_len: int, fill_from: int, tree=None, chain=None) -> dict:
    """Sums over the output positions prompt_len .. len(seq) - 1 of one sequence (prompt + output).
    topk[j]: the target's top candidates after the input seq[j] (best first); entries of positions
    j >= fill_from and j <= i - 2 are in the table at position i."""
    tree = tree_template() if tree is None else tree
    chain = chain_template() if chain is None else chain
    table: dict[int, list[int]] = {}
    sums = empty_sums()
    per_position: dict[str, list[int]] = {m: [] for m in ROUNDS}
    filled = 0  # the next position whose candidates go in
    for i in range(prompt_len, len(seq)):
        while filled <= i - 2:
            if filled >= fill_from:
                table[seq[filled]] = [int(t) for t in topk[filled]]
            filled += 1
        last, truth = seq[i - 1], seq[i:]
        row = table.get(last)
        sums["positions"] += 1
        sums["has_entry"] += row is not None
        for k in KS:
            sums[f"hit@{k}"] += row is not None and truth[0] in row[:k]
        tree_accepted = walk(tree, table, last, truth)
        lookup = {}
        for name, min_ngram in (("lookup", 1), ("lookup n>=2", 2)):
            continuation, size = ngram_match(seq[:i], LOOKUP[0], min_ngram, *LOOKUP[2:])
            lookup[name] = (common_prefix(continuation, truth), size > 0)
            sums[name] += lookup[name][0]
            sums[f"{name} matched"] += lookup[name][1]
        sums["chain"] += walk(chain, table, last, truth)
        sums["tree"] += tree_accepted
        for name in ("lookup", "lookup n>=2"):
            accepted, matched = lookup[name]
            sums[f"{name} else tree"] += accepted if matched else tree_accepted
        sums["merged"] += max(lookup["lookup"][0], tree_accepted)
        per_position["tree"].append(tree_accepted)
        per_position["merged"].append(max(lookup["lookup"][0], tree_accepted))
        for name in ("lookup", "lookup n>=2"):
            per_position[name].append(lookup[name][0])
        per_position["lookup n>=2 else tree"].append(lookup["lookup n>=2"][0] if lookup["lookup n>=2"][1]
                                                     else tree_accepted)
    for name, accepted in per_position.items():
        sums[f"rounds: {name}"] = rounds(accepted)
    return sums


def rounds(accepted: list[int]) -> int:
    """The rounds a greedy decode of these positions takes when every round proposes as at its first
    position and emits its accepted tokens plus the target's own (the bonus token)."""
    i = n = 0
    while i < len(accepted):
        i += 1 + accepted[i]
        n += 1
    return n


def add(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def rates(sums: dict) -> dict:
    """Per-position figures: shares for `SHARES`, mean accepted tokens for `METHODS`, and tokens per
    round (positions / rounds) for `ROUNDS` (plain decoding: 1)."""
    n = max(1, sums["positions"])
    return {"positions": sums["positions"], **{k: v / n for k, v in sums.items() if k in SHARES or k in METHODS},
            **{f"{m} tokens/round": sums["positions"] / max(1, sums[f"rounds: {m}"]) for m in ROUNDS}}


@torch.no_grad()
def top_candidates(model, ids: list[int], k: int = TOP_K) -> torch.Tensor:  # [len(ids), k] int32
    """The target's top-k next tokens after every input of one teacher-forced forward."""
    logits = model(torch.tensor([ids], device=model.device)).logits[0]  # [len, vocab]
    return logits.topk(k, dim=-1).indices.to(torch.int32).cpu()


def load_records(path: Path, limit: int | None, per_category: int | None = None) -> list[dict]:
    """The plain greedy records of a standard-preset run, in its order (replay.py's): the first
    `per_category` of each category when given, then at most `limit`."""
    records = [json.loads(line) for line in open(path)]
    plain = [r for r in records if r["method"] == "plain" and r["mode"] == "greedy"]
    for r in plain:  # older records hold tokens as Python reprs
        if isinstance(r["tokens"], str):
            r["tokens"] = json.loads(r["tokens"])
    if per_category is not None:
        kept, seen = [], {}
        for r in plain:
            seen[r["category"]] = seen.get(r["category"], 0) + 1
            if seen[r["category"]] <= per_category:
                kept.append(r)
        plain = kept
    return plain[:limit]


def candidates(records: list[dict], cache: Path | None, threads: int) -> tuple[dict[str, dict], int]:
    """Per prompt id: seq (prompt + recorded output), prompt_len, category and topk, from `cache` when
    it holds them, else from the target's forwards (written to `cache` when given); and how many
    prompts took a forward here."""
    held = torch.load(cache) if cache is not None and cache.exists() else {}
    missing = [r for r in records if r["id"] not in held]
    if missing:
        from common import apply_threads, load_prompts
        from hf_specdec.pair import TARGET, load_model

        apply_threads(threads)
        target, tokenizer = load_model(TARGET.name, device="cpu")  # the target as load_pair loads it (bf16)
        by_id = {p["id"]: p for p in load_prompts(tokenizer, sorted({r["category"] for r in missing}), None, "all")}
        for r in missing:
            start = time.perf_counter()
            prompt = by_id[r["id"]]["input_ids"]
            seq = prompt + r["tokens"]
            held[r["id"]] = dict(seq=seq, prompt_len=len(prompt), category=r["category"],
                                 topk=top_candidates(target, seq))
            print(f"{r['category']:15s} {r['id']:>14} {len(prompt):5d} + {len(r['tokens']):2d} tokens "
                  f"{time.perf_counter() - start:5.1f} s", flush=True)
            if cache is not None:  # after every prompt: a stopped run keeps what it computed
                cache.parent.mkdir(parents=True, exist_ok=True)
                torch.save(held, cache)
    return {r["id"]: held[r["id"]] for r in records}, len(missing)


def measure(prompts: dict[str, dict], tree, chain) -> dict:
    """{variant: {category or "all": per-position figures}}, positions pooled."""
    out = {}
    for variant in VARIANTS:
        by_category: dict[str, dict] = {}
        for p in prompts.values():
            fill_from = 0 if variant == "prompt fills" else p["prompt_len"]
            sums = simulate(p["seq"], p["topk"].tolist(), p["prompt_len"], fill_from, tree, chain)
            by_category[p["category"]] = add(by_category.get(p["category"], empty_sums()), sums)
        total = empty_sums()
        for sums in by_category.values():
            total = add(total, sums)
        out[variant] = {**{c: rates(s) for c, s in by_category.items()}, "all": rates(total)}
    return out


def markdown(figures: dict, counts: dict[str, int], tree) -> str:
    depths = []
    for parent, _ in tree:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    shape = ", ".join(f"{depths.count(d)} at depth {d}" for d in sorted(set(depths)))
    lines = [f"Tree: {len(tree)} nodes ({shape}); chain: top-1, depth {CHAIN_DEPTH}; lookup: "
             f"ngram_match(seq[:i], {', '.join(map(str, LOOKUP))}), n>=2: the same with min_ngram 2. Shares (%): of "
             "output positions. Method columns: mean accepted tokens per output position (the matched path "
             "length, bonus token not counted), positions pooled. 'X else tree': X where it matched, the "
             "recycling tree elsewhere; merged: the better of lookup and tree (a trie holding both).", ""]
    for variant in VARIANTS:
        lines += [f"## Table filled from: {variant}", "",
                  "| category | prompts | positions | has entry | hit@1 | hit@2 | hit@4 | hit@8 | lookup matched | "
                  "n>=2 matched | " + " | ".join(METHODS) + " |",
                  "|---|" + "---|" * (3 + len(SHARES) + len(METHODS) - 1)]
        for category, f in figures[variant].items():
            name = "**all**" if category == "all" else category
            n = sum(counts.values()) if category == "all" else counts[category]
            cells = [f"{100 * f[k]:.0f}%" for k in SHARES] + [f"{f[m]:.2f}" for m in METHODS]
            lines.append(f"| {name} | {n} | {f['positions']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Tokens per round, rounds replayed (plain decoding: 1.00)", "",
              "Each round proposes as at its first position and emits accepted + 1 tokens; lookup alone does not "
              "depend on the table.", "",
              "| category | " + " | ".join(f"{v}: {m}" for v in VARIANTS for m in ROUNDS if v == VARIANTS[0] or "tree" in m
                                           or m == "merged") + " |"]
    columns = [(v, m) for v in VARIANTS for m in ROUNDS if v == VARIANTS[0] or "tree" in m or m == "merged"]
    lines.append("|---|" + "---|" * len(columns))
    for category in figures[VARIANTS[0]]:
        name = "**all**" if category == "all" else category
        lines.append(f"| {name} | " + " | ".join(f"{figures[v][category][f'{m} tokens/round']:.2f}" for v, m in columns)
                     + " |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", default=str(HERE / "results" / "standard" / "records.jsonl"),
                        help="a standard-preset run's records: its plain greedy outputs (and their prompt ids)")
    parser.add_argument("--out", default=str(HERE / "results" / "recycling"), help="the folder written to")
    parser.add_argument("--limit", type=int, default=None, help="at most this many prompts (a quick look)")
    parser.add_argument("--per-category", type=int, default=None,
                        help="only the first N prompts of each category (in the records' order)")
    parser.add_argument("--cache", default=None, help="a .pt file holding the top-8 arrays (read if present, else written)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    records = load_records(Path(args.records), args.limit, args.per_category)
    start = time.perf_counter()
    prompts, computed = candidates(records, Path(args.cache) if args.cache else None, args.threads)
    forwards = time.perf_counter() - start
    tree, chain = tree_template(), chain_template()
    figures = measure(prompts, tree, chain)
    counts: dict[str, int] = {}
    for p in prompts.values():
        counts[p["category"]] = counts.get(p["category"], 0) + 1
    command = "python evals/recycling.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (f"# Token Recycling's acceptance, simulated on {args.records}\n\nCommand: `{command.strip()}` "
            f"({len(prompts)} prompts; {computed} forwards here, {forwards:.0f} s; the rest from the cache)\n\n" + markdown(figures, counts, tree))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recycling.md").write_text(text)
    (out / "recycling.json").write_text(json.dumps(dict(
        prompts=sorted(prompts), tree=tree, chain=chain, lookup=LOOKUP, top_k=TOP_K, figures=figures), indent=1))
    print(text)
    return figures


if __name__ == "__main__":
    main()
