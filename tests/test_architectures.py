"""Architectures whose attention is not only a function of the mask and the position ids, and MLA.

A probe over 49 architectures built from configs found four that failed (the others equal plain greedy,
or are refused by name for their sliding-window or recurrent layers): BLOOM and Falcon with ALiBi crashed
in a tree forward; GPT-Neo's local attention and MPT's column-position ALiBi count masked holes and tree
columns, so batches and trees silently differed; MLA models (DeepSeek-V3, MiniCPM3) crashed in batches,
their keys and values having different head sizes.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_specdec
from conftest import perturbed

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, initializer_range=0.3, bos_token_id=1, eos_token_id=None, pad_token_id=0,
              tie_word_embeddings=False)
LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024)
CONFIGS = {
    "bloom": dict(hidden_size=32, n_layer=2, n_head=4),
    "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False,
                   multi_query=True, alibi=True),
    "gpt_neo": dict(hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=1024, window_size=16,
                    attention_types=[[["global", "local"], 1]]),
    "mpt": dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=1024),
    "roberta": dict(LLAMA_LIKE, is_decoder=True, max_position_embeddings=256),
    "roformer": dict(LLAMA_LIKE, is_decoder=True, embedding_size=32, max_position_embeddings=256),
    "trocr": dict(d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64, max_position_embeddings=256),
    "rwkv": dict(hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64, context_length=256),
    "cpmant": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, dim_head=8, dim_ff=64),
    "deepseek_v3": dict(LLAMA_LIKE, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4),
}
PINNED = dict(costs=hf_specdec.Costs(draft_step=0.05, verify=0.02))  # cheap drafts: trees are built where allowed


def build(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **COMMON, **CONFIGS[kind]))
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return model.eval()


def batch():
    gen = torch.Generator().manual_seed(7)
    ids, mask = torch.zeros(3, 20, dtype=torch.long), torch.zeros(3, 20, dtype=torch.long)
    for i, n in enumerate((20, 9, 5)):
        ids[i, 20 - n:], mask[i, 20 - n:] = torch.randint(2, VOCAB, (n,), generator=gen), 1
    return ids, mask


def speculative(target, draft, ids, **kwargs):
    return target.generate(ids, custom_generate=hf_specdec.speculative_generate, assistant=draft, do_sample=False, **kwargs)


REPETITIVE = torch.tensor([[5, 9, 12, 5, 9, 30, 5, 9, 12, 41, 5, 9, 12, 7, 5, 9]])  # lookups: trees worth building


@pytest.mark.parametrize("kind", ["bloom", "falcon", "gpt_neo", "mpt"])
def test_models_whose_attention_reads_columns_decode_one_row_with_chains(kind):
    """Trees fall back to chains for them (BLOOM and Falcon crashed in the tree forward; GPT-Neo and MPT
    differed); one row equals plain greedy."""
    target = build(kind)
    draft = perturbed(target, noise=0.05)
    for prompt in (REPETITIVE, torch.randint(2, VOCAB, (1, 70), generator=torch.Generator().manual_seed(5))):
        records = []
        out = speculative(target, draft, prompt, max_new_tokens=40, acceptance_sink=records.append, **PINNED)
        assert torch.equal(out, target.generate(prompt, do_sample=False, max_new_tokens=40))
        assert records and all(r.parents is None for r in records)  # no tree round


@pytest.mark.parametrize("kind", ["gpt_neo", "mpt"])
def test_batches_and_streams_are_refused_where_holes_would_count(kind):
    target = build(kind)
    draft = perturbed(target, noise=0.05)
    ids, mask = batch()
    with pytest.raises(hf_specdec.UnsupportedCacheError, match="GPT-Neo's local attention|window of 16|MPT's ALiBi"):
        speculative(target, draft, ids, attention_mask=mask, max_new_tokens=40)
    with pytest.raises(hf_specdec.UnsupportedCacheError, match="holes"):
        hf_specdec.generate_continuous(target, [[5, 6, 7], [8, 9]], assistant=draft, max_new_tokens=4, max_batch_size=2)
    if kind == "gpt_neo":  # a batch that cannot outgrow the window is taken, and is exact
        short = dict(attention_mask=mask[:, -6:], max_new_tokens=1)
        assert torch.equal(speculative(target, draft, ids[:, -6:], **short), target.generate(ids[:, -6:], do_sample=False, **short))


def test_models_numbering_positions_their_own_way():
    """RoBERTa's family numbers positions from its padding id when given none, while generate() gives them
    from 0: each forward now gets them as generate() gives them (chains differed silently). RoFormer and
    TrOCR take no position ids and number tokens by cache columns: trees fell back to nothing and differed
    silently, now they are chains; a batch, whose holes they would count, is refused by name."""
    prompt = REPETITIVE
    for kind in ("roberta", "roformer", "trocr"):
        target = build(kind)
        draft = perturbed(target, noise=0.05)
        plain = target.generate(prompt, do_sample=False, max_new_tokens=30)
        for settings in (PINNED, dict(tree=False, adaptive=False, num_draft_tokens=4)):
            assert torch.equal(speculative(target, draft, prompt, max_new_tokens=30, **settings), plain), (kind, settings)
    ids, mask = batch()
    with pytest.raises(hf_specdec.UnsupportedCacheError, match="TrOCRForCausalLM takes no position ids"):
        speculative(target, draft, ids, attention_mask=mask, max_new_tokens=10)


def test_models_without_a_cache_that_can_be_cut_are_refused_by_name():
    """RWKV keeps a recurrent state outside the cache (a single row crashed inside keep_path, a batch
    differed silently); CPM-Ant's cache holds more columns than the tokens given (a raw crash)."""
    rwkv = build("rwkv")
    with pytest.raises(hf_specdec.UnsupportedCacheError, match="RwkvForCausalLM.*takes no key-value cache"):
        speculative(rwkv, rwkv, REPETITIVE, max_new_tokens=5)
    cpmant = build("cpmant")
    with pytest.raises(hf_specdec.UnsupportedCacheError, match="CpmAntForCausalLM holds .* cached positions"):
        speculative(cpmant, cpmant, REPETITIVE, max_new_tokens=5)
    # Falcon-H1's layers are linear attention *and* a DynamicLayer subclass: they passed the layer check and
    # crashed inside transformers; Gemma 3n's shared layers were called linear attention
    for kind, settings, named in (
            ("falcon_h1", dict(LLAMA_LIKE, head_dim=8), "LinearAttentionAndFullAttentionLayer .linear attention"),
            ("gemma3n_text", dict(LLAMA_LIKE, num_hidden_layers=4, num_kv_shared_layers=2, head_dim=8,
                                  layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4,
                                  vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, intermediate_size=[64] * 4,
                                  activation_sparsity_pattern=[0.0] * 4, laurel_rank=4), "DummyLayer .layers without keys")):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **COMMON, **settings)).eval()
        with pytest.raises(hf_specdec.UnsupportedCacheError, match=named):
            speculative(model, model, REPETITIVE, max_new_tokens=5)


def test_caches_of_their_own_kind_are_refused_by_name():
    """Before: DeepSeek-V3.2's indexed layers (a DynamicLayer subclass) decoded and differed from plain greedy
    once a sequence passed index_topk (margins up to 1.3, not ties); MiniMax, whose cache class is its own,
    failed inside its forward ('not compatible with cache of type DynamicCache')."""
    mla = {k: v for k, v in CONFIGS["deepseek_v3"].items()}
    for kind, settings, named in (
            ("deepseek_v32", dict(mla, index_n_heads=2, index_head_dim=16, index_topk=8), "DynamicIndexedLayer .a sparse"),
            ("minimax", dict(LLAMA_LIKE, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                             layer_types=["full_attention"] * 2), "MiniMaxForCausalLM. decodes with a cache class of its own")):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **COMMON, **settings)).eval()
        with pytest.raises(hf_specdec.UnsupportedCacheError, match=named):
            speculative(model, model, REPETITIVE, max_new_tokens=24)
        with pytest.raises(hf_specdec.UnsupportedCacheError, match=named):
            hf_specdec.generate_continuous(model, [[5, 6, 7]], assistant=model, max_new_tokens=4)


def test_an_encoders_language_model_head_without_is_decoder_is_refused():
    """BERT's family with is_decoder=False (the config's default) attends in both directions: a verify
    forward let each new token see the ones after it, and greedy output differed silently."""
    torch.manual_seed(0)
    settings = dict(COMMON, **{**LLAMA_LIKE, "max_position_embeddings": 256})
    bidirectional = AutoModelForCausalLM.from_config(AutoConfig.for_model("bert", **settings)).eval()
    with pytest.raises(ValueError, match="is_decoder=False, so it attends in both directions"):
        speculative(bidirectional, bidirectional, REPETITIVE, max_new_tokens=5)
    xlm = AutoModelForCausalLM.from_config(AutoConfig.for_model("xlm", vocab_size=VOCAB, emb_dim=32, n_layers=2, n_heads=4))
    with pytest.raises(ValueError, match="XLM's language-model head"):  # a raw RuntimeError inside its forward before
        speculative(xlm.eval(), xlm, REPETITIVE, max_new_tokens=5)
    causal = AutoModelForCausalLM.from_config(AutoConfig.for_model("bert", **settings, is_decoder=True)).eval()
    causal.generation_config.eos_token_id = None
    assert torch.equal(speculative(causal, perturbed(causal, noise=0.05), REPETITIVE, max_new_tokens=20, **PINNED),
                       causal.generate(REPETITIVE, do_sample=False, max_new_tokens=20))


def test_mla_models_batch_and_stream():
    """Keys and values of different head sizes (16 and 8): rows are gathered and added per tensor."""
    target = build("deepseek_v3")
    draft = perturbed(target, noise=0.05)
    ids, mask = batch()
    out = speculative(target, draft, ids, attention_mask=mask, max_new_tokens=30, num_draft_tokens=3, adaptive=False)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in (6, 11, 4, 9)]
    results = hf_specdec.generate_continuous(target, prompts, assistant=draft, max_batch_size=2, max_new_tokens=12,
                                             do_sample=False, **PINNED)
    for result, prompt in zip(results, prompts):
        plain = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[0, len(prompt):]
        assert result.ok and torch.equal(result.tokens, plain)


@pytest.mark.parametrize("rope", [
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [16.0] * 8,
     "original_max_position_embeddings": 16},
    {"rope_type": "dynamic", "factor": 8.0, "rope_theta": 10000.0},
])
def test_rotary_frequencies_chosen_by_a_forwards_length_are_refused_past_their_switch(rope):
    """Before: greedy differed silently once a verify forward reached past the original context (transformers
    picks "longrope" and "dynamic" frequencies by the longest position a forward covers). Within it, exact."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64 if rope["rope_type"] == "longrope" else 16,
                         rope_parameters=rope)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention, so that positions change the argmax
        for name, weight in target.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                weight.mul_(4.0)
    prompt = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(101))
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, custom_generate=hf_specdec.speculative_generate,
                  assistant=target, adaptive=False, num_draft_tokens=4)
    plain = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with pytest.raises(ValueError, match=f"rotary embedding is '{rope['rope_type']}'.*past 16 positions.*reach 50"):
        target.generate(prompt, max_new_tokens=40, **kwargs)
    with pytest.raises(ValueError, match="a stream mixes prompts"):
        hf_specdec.generate_continuous(target, [prompt[0, :4]], assistant=target, max_new_tokens=2)
    # up to 17 tokens in all: the 17th is never fed, so no forward passes 16 positions (7 new tokens were refused)
    assert torch.equal(target.generate(prompt, max_new_tokens=7, **kwargs), target.generate(prompt, max_new_tokens=7, **plain))
    with pytest.raises(ValueError, match="reach 18.*up to 17 tokens"):
        target.generate(prompt, max_new_tokens=8, **kwargs)
    if rope["rope_type"] == "longrope":  # a lone prompt already past the original context: long factors throughout
        longer = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(102))
        out = target.generate(longer, max_new_tokens=30, **kwargs)
        assert torch.equal(out, target.generate(longer, max_new_tokens=30, **plain))
        # a batch: a row that finishes leaves, and the others' positions may fall back under the context
        with pytest.raises(ValueError, match="rotary embedding is 'longrope'"):
            target.generate(longer.repeat(2, 1), max_new_tokens=30, **kwargs)


def _family_models():
    from transformers import (Kosmos2_5Config, Kosmos2_5ForConditionalGeneration, MoshiConfig, MoshiForCausalLM,
                              PaliGemmaConfig, PaliGemmaForConditionalGeneration, ProphetNetConfig, ProphetNetForCausalLM)

    from transformers.models.kosmos2_5.modeling_kosmos2_5 import Kosmos2_5TextForCausalLM  # not exported

    torch.manual_seed(0)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    yield "PaliGemma", ("use_bidirectional_attention=True outside eager attention, so it attends in both directions.*"
                        "attn_implementation='eager'"), PaliGemmaForConditionalGeneration(
        PaliGemmaConfig(text_config=dict(small, model_type="gemma", vocab_size=256, num_key_value_heads=2, head_dim=16),
                        vision_config=dict(small, model_type="siglip_vision_model", image_size=32, patch_size=8),
                        vocab_size=256, image_token_index=255, projection_dim=64, hidden_size=64))
    kosmos = Kosmos2_5Config().to_dict()
    yield "Kosmos-2.5", "works out its positions from input_ids itself", Kosmos2_5ForConditionalGeneration(Kosmos2_5Config(
        text_config=dict(kosmos["text_config"], vocab_size=256, embed_dim=64, ffn_dim=128, layers=2, attention_heads=4),
        vision_config=dict(kosmos["vision_config"], **small), latent_query_num=4))
    yield "ProphetNet", "takes one new token a forward once it has a cache", ProphetNetForCausalLM(ProphetNetConfig(
        vocab_size=256, hidden_size=64, encoder_ffn_dim=128, decoder_ffn_dim=128, num_encoder_layers=2, num_decoder_layers=2,
        num_encoder_attention_heads=4, num_decoder_attention_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    yield "Kosmos-2.5 text", "works out its positions from input_ids itself", Kosmos2_5TextForCausalLM(Kosmos2_5Config(
        text_config=dict(vocab_size=256, embed_dim=64, ffn_dim=128, layers=2, attention_heads=4)).text_config)
    moshi = MoshiConfig().to_dict()
    depth = dict(moshi["depth_decoder_config"], **small, num_key_value_heads=2, head_dim=16, audio_vocab_size=64,
                 vocab_size=256, num_codebooks=2, input_size=64)
    yield "Moshi", "Moshi's cache keeps a sliding window of 16 tokens but its attention mask applies none", MoshiForCausalLM(
        MoshiConfig(**{**moshi, **small, "vocab_size": 256, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 16,
                       "audio_vocab_size": 64, "num_codebooks": 2, "depth_decoder_config": depth}))


def test_models_whose_several_token_forwards_differ_by_family_are_refused_by_name():
    """From a sweep of every causal-LM class in transformers 5.25. Before: PaliGemma (its text model attends both ways),
    Kosmos-2.5 (it numbers positions itself) and Moshi past its window (its cache slides, its mask does not) differed
    from plain greedy without a word; ProphetNet's decoder failed in its own assertion once a round drafted."""
    ids = torch.tensor([[85, 55, 172, 183, 189, 175, 153, 28, 245, 243]])
    for name, message, target in _family_models():
        target.eval().generation_config.eos_token_id = None
        draft = perturbed(target, 0.01)
        with pytest.raises(ValueError, match=message):
            target.generate(ids, max_new_tokens=12, do_sample=False, custom_generate=hf_specdec.speculative_generate,
                            assistant=draft, num_draft_tokens=4, adaptive=False)
        if name in ("Moshi", "PaliGemma"):  # inside its window; on eager attention, whose Gemma mask stays causal
            budget = 5 if name == "Moshi" else 12
            if name == "PaliGemma":
                target.set_attn_implementation("eager")  # a PaliGemma-2 (Gemma 2 text model) loads on eager
            out = target.generate(ids, max_new_tokens=budget, do_sample=False, custom_generate=hf_specdec.speculative_generate,
                                  assistant=draft, num_draft_tokens=4, adaptive=False)
            assert torch.equal(out, target.generate(ids, max_new_tokens=budget, do_sample=False))


def test_a_config_with_several_text_configs_is_read_as_itself():
    """get_text_config raises for configs holding several (MusicGen's text encoder and decoder); the checks that read
    a composite model's text config must not fail there in transformers' ValueError."""
    from transformers import MusicgenConfig

    from hf_specdec.arguments import text_config

    config = MusicgenConfig()
    with pytest.raises(ValueError, match="Multiple valid text configs"):
        config.get_text_config()
    assert text_config(config) is config
