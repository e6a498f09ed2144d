"""How well the draft's confidence predicts acceptance, on recorded outputs (one forward of each model
per output; measurement only):

    python evals/results/sampling-stops/calibration.py sampling DIR1,DIR2   # replay folders (sampled outputs)
    python evals/results/sampling-stops/calibration.py greedy               # the standard records' plain greedy

sampling: over every token x the draft could draw at each output position (weight q(x)), its
acceptance min(1, p(x) / q(x)), by the bin of q(x) (the confidence the stop rule reads); and, given
the output, P(position t + 1 accepted | position t accepted) by the bin of q(y_t). greedy: at each
position whether argmax q = argmax p, by max q. p and q processed as generation processes them.
"""
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1])); sys.path.insert(0, str(HERE.parents[2]))
from common import load_pair, load_prompts  # noqa: E402
from regimes import warpers_of  # noqa: E402
from hf_specdec.pair import DRAFT, TARGET  # noqa: E402

EDGES = torch.tensor([0, .1, .2, .3, .4, .5, .6, .7, .8, .9, .995, 1.01])


def table(weight, hits, label):
    for i in range(len(EDGES) - 1):
        if weight[i] > 0:
            print(f"{label} [{EDGES[i]:.3f}, {EDGES[i + 1]:.3f})  share {weight[i] / weight.sum():.3f}  {hits[i] / weight[i]:.3f}")


def main(mode: str, folders: str = "") -> None:
    torch.set_num_threads(2)
    target, draft, tokenizer = load_pair(TARGET.name, DRAFT.name, "cpu")
    if mode == "greedy":
        records = [json.loads(line) for line in open(HERE.parents[0] / "standard" / "records.jsonl")]
        records = [r for r in records if r["method"] == "plain" and r["mode"] == "greedy"]
        window = 64
    else:
        records = [json.loads(line) for d in folders.split(",") for line in open(Path(d) / "replay.jsonl")]
        window = 256
    for r in records:
        if isinstance(r["tokens"], str):
            r["tokens"] = json.loads(r["tokens"])
    by_id = {p["id"]: p for p in load_prompts(tokenizer, sorted({r["category"] for r in records}), None, "all")}
    processors = warpers_of("sampling")
    n = len(EDGES) - 1
    weight, hits, after, after_hits = (torch.zeros(n, dtype=torch.float64) for _ in range(4))
    for r in records:
        prompt, tokens = by_id[r["id"]]["input_ids"], r["tokens"]
        with torch.no_grad():
            lp = target(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()
            lq = draft(torch.tensor([prompt[-window:] + tokens[:-1]])).logits[0, min(window, len(prompt)) - 1:].float()
        if mode == "greedy":
            q = lq.softmax(-1)
            confidence, token = q.max(-1)
            b = (torch.bucketize(confidence, EDGES, right=True) - 1).clamp(0, n - 1)
            weight.index_add_(0, b, torch.ones_like(confidence, dtype=torch.float64))
            hits.index_add_(0, b, (token == lp.argmax(-1)).double())
            continue
        p, q = processors(None, lp).softmax(-1), processors(None, lq).softmax(-1)
        accept = torch.where(q > 0, (p / q.clamp_min(1e-30)).clamp(max=1.0), torch.zeros_like(p))
        b = (torch.bucketize(q, EDGES, right=True) - 1).clamp(0, n - 1)
        weight.index_add_(0, b.flatten(), q.flatten().double())
        hits.index_add_(0, b.flatten(), (q * accept).flatten().double())
        ys = torch.tensor(tokens)[:, None]
        py, qy = p.gather(-1, ys)[:, 0], q.gather(-1, ys)[:, 0]
        a = torch.where(py > 0, torch.minimum(py, qy) / py.clamp_min(1e-30), torch.zeros_like(py)).double()
        by = (torch.bucketize(qy, EDGES, right=True) - 1).clamp(0, n - 1)
        after.index_add_(0, by[:-1], a[:-1])
        after_hits.index_add_(0, by[:-1], a[:-1] * a[1:])
    table(weight, hits, f"{mode}: P(accepted | confidence in")
    if mode == "sampling":
        table(after, after_hits, "sampling: P(next accepted | this accepted, its confidence in")


if __name__ == "__main__":
    main(*sys.argv[1:])
