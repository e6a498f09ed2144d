"""Speculative generation with hf_specdec, side by side with plain decoding of the same prompt.

    python examples/tiny_models.py    # tiny random models built from configs, offline, seconds

Prints the generated ids, the speedup over plain decoding and the acceptance figures.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_specdec


def tiny_pair(seed: int = 0):
    """An 8-layer random target and its first layer as the draft: random weights, so the text is noise,
    the mechanics are real. The target's later layers write small updates into the residual stream (as a
    trained model's deeper layers often do), so the one-layer draft agrees with it often; with seven more
    full-size random layers it would agree with it about never, and nothing would be drafted."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, initializer_range=0.2)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(LATER_LAYER_SCALE)
            layer.mlp.down_proj.weight.mul_(LATER_LAYER_SCALE)
    draft_config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})
    draft = LlamaForCausalLM(draft_config).eval()
    draft.load_state_dict(target.state_dict(), strict=False)  # shares embeddings, head and first layer
    return target, draft


LATER_LAYER_SCALE = 0.02  # the size of the later layers' updates, relative to a random layer's


def main(max_new_tokens: int, num_draft_tokens: int, sample: bool) -> None:
    target, draft = tiny_pair()
    prompt = torch.tensor([[1, 17, 42, 99, 7]])
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=sample, temperature=0.7 if sample else None)
    target.generate(prompt, max_new_tokens=4)  # warm up

    start = time.perf_counter()
    plain = target.generate(prompt, **kwargs)
    plain_s = time.perf_counter() - start
    start = time.perf_counter()
    out = target.generate(prompt, custom_generate=hf_specdec.speculative_generate, assistant=draft,
                          num_draft_tokens=num_draft_tokens, return_dict_in_generate=True, **kwargs)
    spec_s = time.perf_counter() - start

    stats = out.acceptance
    print("generated ids:", out.sequences[0, prompt.shape[1]:].tolist())
    if not sample:
        print("identical to plain greedy:", torch.equal(out.sequences, plain))
    print(f"speedup over plain decoding: {plain_s / spec_s:.2f}x ({plain_s:.2f}s plain, {spec_s:.2f}s speculative)")
    print(f"acceptance rate {stats.acceptance_rate:.2f}, {stats.mean_tokens_per_round:.2f} tokens per target forward, "
          f"per position {[round(r, 2) for r in stats.per_position_rate]}")


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=positive, default=64)
    parser.add_argument("--num-draft-tokens", type=positive, default=5)
    parser.add_argument("--sample", action="store_true", help="sample at temperature 0.7 instead of greedy")
    args = parser.parse_args()
    main(args.max_new_tokens, args.num_draft_tokens, args.sample)
