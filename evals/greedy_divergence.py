"""Where a speculative greedy output leaves plain greedy, and by how small a margin.

    python evals/greedy_divergence.py --prompt-id 81 [--dtype bfloat16|float32]
    python evals/greedy_divergence.py --batch-size 8        # the batch study's prompts, per row
    python evals/greedy_divergence.py --records evals/results/standard/records.jsonl   # an eval's mismatches

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
from batch_study import BATCH_CATEGORIES, batch_prompts, left_pad  # noqa: E402
from common import CATEGORIES, load_prompts  # noqa: E402
from hf_specdec.diagnostics import Divergence, first_divergence, greedy_divergence, top_two_margin  # noqa: E402
from hf_specdec.pair import DRAFT, TARGET, load_model  # noqa: E402


def main(prompt_id: str, dtype: str, max_new_tokens: int) -> None:
    """One eval prompt: plain greedy against assisted generation and hf_specdec, in `dtype`."""
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
    scores = [step[0] for step in plain.scores]  # one (vocab,) row per generated token
    methods = {
        "assisted": dict(assistant_model=draft),
        "hf_specdec": dict(custom_generate=hf_specdec.speculative_generate, assistant=draft),
    }
    for name, kwargs in methods.items():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), **common, **kwargs)
        a, b = plain.sequences[0, ids.shape[1]:], out.sequences[0, ids.shape[1]:]
        divergence = greedy_divergence(a, b, scores)
        if divergence is None:
            print(f"{name} ({dtype}): identical to plain greedy over {len(a)} tokens")
            continue
        j = divergence.position
        tokens = ", ".join(f"{who} {int(t[j])} {tokenizer.decode(t[j])!r}" for who, t in (("plain", a), (name, b)) if j < len(t))
        print(f"{name} ({dtype}): {divergence.describe()} ({tokens})")


def batch_check(batch_size: int, max_new_tokens: int) -> None:
    """The batch study's prompts: plain batched greedy against hf_specdec batched greedy, per row."""
    target, tokenizer = load_model(TARGET.name)
    draft, _ = load_model(DRAFT.name)
    prompts = batch_prompts(tokenizer, BATCH_CATEGORIES, 8)
    pad = tokenizer.pad_token_id
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        ids, mask = left_pad([p["input_ids"] for p in chunk], pad, target.device)
        common = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, attention_mask=mask,
                      return_dict_in_generate=True, output_scores=True)
        plain = target.generate(ids, **common)
        spec = target.generate(ids, **common, custom_generate=hf_specdec.speculative_generate, assistant=draft)
        for row, prompt in enumerate(chunk):
            scores = [step[row] for step in plain.scores]  # one (vocab,) row per generated token
            divergence = greedy_divergence(plain.sequences[row, ids.shape[1]:], spec.sequences[row, ids.shape[1]:], scores)
            print(f"batch {batch_size} prompt {prompt['id']}: {'identical' if divergence is None else divergence.describe()}")


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
        j = first_divergence(torch.tensor(plain["tokens"]), torch.tensor(r["tokens"]))
        if j is None:  # the same generated tokens: nothing to explain
            continue
        with torch.no_grad():
            logits = target(torch.tensor([prompts[r["id"]]["input_ids"] + plain["tokens"][:j]])).logits[0, -1]  # (vocab,)
        print(f"prompt {r['id']} ({r['category']}) {r['method']}: {Divergence(j, top_two_margin(logits)).describe()}")


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
