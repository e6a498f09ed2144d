"""Where a speculative greedy output leaves plain greedy, and by how small a margin.

    python evals/greedy_divergence.py --prompt-id 81 [--dtype bfloat16|float32]
    python evals/greedy_divergence.py --batch-size 8        # the batch study's prompts, per row
    python evals/greedy_divergence.py --records evals/results/quick-v3/records.jsonl   # an eval's mismatches

Runs plain greedy, transformers' assisted generation and hf_specdec on one eval prompt and, for each
method whose output differs, prints the first differing position with the top-two logit margin of
plain decoding there. A margin within bf16 rounding (about 0.01-0.1 on logits of this size) means the
verification forward (k + 1 tokens at once) and plain decoding (one token) rounded differently,
not that the acceptance rule is wrong: in float32 the outputs should agree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_specdec  # noqa: E402
from hf_specdec.pair import DRAFT, TARGET, load_model  # noqa: E402
from run_eval import CATEGORIES, load_prompts  # noqa: E402


def main(prompt_id: str, dtype: str, max_new_tokens: int) -> None:
    torch_dtype = getattr(torch, dtype)
    target, tokenizer = load_model(TARGET.name)
    draft, _ = load_model(DRAFT.name)
    target, draft = target.to(torch_dtype), draft.to(torch_dtype)
    prompts = [p for p in load_prompts(tokenizer, CATEGORIES, None) if p["id"] == prompt_id]
    if not prompts:
        raise SystemExit(f"no prompt with id {prompt_id}")
    ids = torch.tensor([prompts[0]["input_ids"]])
    common = dict(max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True, output_scores=True)
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), **common)
    methods = {
        "assisted": dict(assistant_model=draft),
        "hf_specdec": dict(custom_generate=hf_specdec.speculative_generate, assistant=draft),
    }
    for name, kwargs in methods.items():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), **common, **kwargs)
        a, b = plain.sequences[0, ids.shape[1]:], out.sequences[0, ids.shape[1]:]
        n = min(len(a), len(b))
        diff = (a[:n] != b[:n]).nonzero()
        if len(diff) == 0 and len(a) == len(b):
            print(f"{name} ({dtype}): identical to plain greedy over {len(a)} tokens")
            continue
        j = int(diff[0]) if len(diff) else n
        top2 = plain.scores[j][0].float().topk(2)
        print(f"{name} ({dtype}): first difference at generated token {j}: plain {int(a[j])} "
              f"{tokenizer.decode(a[j])!r}, {name} {int(b[j])} {tokenizer.decode(b[j])!r}; "
              f"plain top-2 logit margin there {float(top2.values[0] - top2.values[1]):.4f}")


def batch_check(batch_size: int, max_new_tokens: int) -> None:
    """The batch study's prompts: plain batched greedy against hf_specdec batched greedy, per row."""
    from run_eval import BATCH_CATEGORIES, left_pad

    target, tokenizer = load_model(TARGET.name)
    draft, _ = load_model(DRAFT.name)
    prompts = load_prompts(tokenizer, list(BATCH_CATEGORIES), 2)
    by_category = [[p for p in prompts if p["category"] == c] for c in BATCH_CATEGORIES]
    prompts = [p for pair in zip(*by_category) for p in pair][:8]
    pad = tokenizer.pad_token_id
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        ids, mask = left_pad([p["input_ids"] for p in chunk], pad, target.device)
        common = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, attention_mask=mask,
                      return_dict_in_generate=True, output_scores=True)
        plain = target.generate(ids, **common)
        spec = target.generate(ids, **common, custom_generate=hf_specdec.speculative_generate, assistant=draft)
        for row, prompt in enumerate(chunk):
            a, b = plain.sequences[row, ids.shape[1]:], spec.sequences[row, ids.shape[1]:]
            diff = (a != b).nonzero()
            if len(diff) == 0:
                print(f"batch {batch_size} prompt {prompt['id']}: identical")
                continue
            j = int(diff[0])
            top2 = plain.scores[j][row].float().topk(2)
            print(f"batch {batch_size} prompt {prompt['id']}: first difference at token {j}, plain top-2 margin "
                  f"{float(top2.values[0] - top2.values[1]):.4f}")


def records_check(path: str) -> None:
    """Every greedy mismatch in an eval's records.jsonl: the first differing token and the top-two
    logit margin there, from one target forward over the prompt and plain's tokens before it."""
    import json

    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    target, tokenizer = load_model(TARGET.name)
    prompts = {p["id"]: p for p in load_prompts(tokenizer, CATEGORIES, None)}
    for r in records:
        if r["mode"] != "greedy" or r.get("matches_plain") is not False:
            continue
        plain = next(x for x in records if (x["id"], x["mode"], x["method"]) == (r["id"], "greedy", "plain"))
        a, b = plain["tokens"], r["tokens"]
        j = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        with torch.no_grad():
            logits = target(torch.tensor([prompts[r["id"]]["input_ids"] + a[:j]])).logits[0, -1].float()
        top2 = logits.topk(2)
        print(f"prompt {r['id']} ({r['category']}) {r['method']}: first difference at generated token {j}; "
              f"plain top-2 logit margin there {float(top2.values[0] - top2.values[1]):.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-id", default="81")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=None,
                        help="instead: check the batch study's 8 prompts, batched plain vs batched hf_specdec")
    parser.add_argument("--records", default=None, help="instead: explain every greedy mismatch in an eval's records.jsonl")
    args = parser.parse_args()
    if args.records:
        records_check(args.records)
    elif args.batch_size:
        batch_check(args.batch_size, args.max_new_tokens)
    else:
        main(args.prompt_id, args.dtype, args.max_new_tokens)
