"""evals/repetition_batch_model.py: a batched forward is noted by the tokens it feeds (rows x new
tokens) at the context its cache held, and the summary prices plain and hf_specdec with one table."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "evals"))

import repetition_batch_model as batch_model  # noqa: E402
from costs import CostTable  # noqa: E402


def test_a_batched_forward_is_noted_by_the_tokens_it_feeds():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    fed = batch_model.TokensFed(model)
    ids = torch.tensor([[1, 2, 3, 4]] * 3)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, min_new_tokens=3)
    assert fed.take() == [[12, 0, 3], [3, 4, 3], [3, 5, 3]]  # the prompt: 3 rows x 4 tokens; then one column a step
    assert fed.take() == []


def test_a_batched_call_is_priced_by_tokens_fed_and_positions_scored():
    table = CostTable.load(ROOT / "evals" / "results" / "standard" / "cost_table.json")
    table.alias("hf", "bf16")
    position = table.position["sampling"]
    plain = dict(workload="w", method="plain", new_tokens=8, work={"target": [[8, 0, 2]] + [[2, 8 + i, 2] for i in range(3)]})
    ours = dict(workload="w", method="hf_specdec", new_tokens=8,
                work={"target": [[8, 0, 2], [6, 8, 2]], "hf": [[8, 0, 2], [2, 4, 2]], "scored": [2, 4]})
    plain_seconds = (table.forward("target", 8, 0) + sum(table.forward("target", 2, 8 + i) for i in range(3))
                     + (2 + 3 * 2) * position["transformers"])  # the prompt's position a row, then every row's
    our_seconds = (table.forward("target", 8, 0) + table.forward("target", 6, 8) + table.forward("hf", 8, 0)
                   + table.forward("hf", 2, 4) + (2 + 4 + 2 + 2) * position["hf_specdec"])  # scored; a draft's one a row
    assert abs(batch_model.modelled_seconds(plain["work"], table, "transformers") - plain_seconds) < 1e-12
    assert abs(batch_model.modelled_seconds(ours["work"], table, "hf_specdec") - our_seconds) < 1e-12
    assert f"**{plain_seconds / our_seconds:.2f}x**" in batch_model.summary([plain, ours], {"bf16": table})
