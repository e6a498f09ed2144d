"""Checks what a new prompt of the standard preset matches in a RetrievalCache holding the earlier calls' outputs
(cache-s0's, in order, with their prompts as context): python evals/results/cache-value/header_matches.py"""
import sys, json
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "evals"))
import hf_specdec
import common
_, tok = common.load_model(common.DRAFT.name, device="cpu")
rows = [json.loads(l) for l in open(Path(__file__).parent / "standard" / "cache-s0" / "replay.jsonl")]
prompts = {p["id"]: p for p in common.load_prompts(tok, sorted({r["category"] for r in rows}), None, "all")}
cache = hf_specdec.RetrievalCache()
for r in rows:
    ids = prompts[r["id"]]["input_ids"]
    found, size, shares = cache.lookup_shares(ids, max_tokens=8)
    if found:
        print(r["category"], r["id"], "match", size, repr(tok.decode(ids[-size:])), "->", repr(tok.decode(found[0])), [round(x, 2) for x in shares[0][:4]])
    else:
        print(r["category"], r["id"], "no match")
    cache.add(r["tokens"], context=ids)
