"""A tiny offline model pair with a character tokenizer and a chat template, for testing the eval.

Random weights: the text is noise, but every code path of the eval (chat template, four methods,
timing, acceptance, accelerate, summary, plots) runs as on the real pair, in seconds.
"""

from __future__ import annotations

import copy

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    chars = [chr(i) for i in range(32, 127)] + ["\n", "\t"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_pair(seed: int = 0, noise: float = 0.1):
    """(target, draft, tokenizer): the draft is the target with noisy weights, so acceptance is partial."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    target = LlamaForCausalLM(config).eval()
    return target, perturbed(target, noise, seed + 1), tokenizer


def perturbed(model, noise: float, seed: int):
    """A draft that agrees with `model` often but not always: a copy with Gaussian noise of `noise`
    times each weight's std added to every weight."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * noise * param.std().clamp_min(1e-3))
    return draft
