"""Tiny configs per architecture, for `probe.py`: random weights, vocabulary 96, 2 layers, windows of 16."""
import copy, torch
from transformers import AutoConfig, AutoModelForCausalLM

V = 96
L = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
         max_position_embeddings=1024)
SW = 16
NAMES = ('biogpt', 'bloom', 'codegen', 'cohere', 'cohere2', 'deepseek_v2', 'deepseek_v3', 'exaone4', 'falcon', 'falcon_alibi', 'falcon_mamba', 'falcon_newarch', 'gemma', 'gemma2', 'gemma3', 'glm4', 'gpt2', 'gpt_bigcode', 'gpt_neo', 'gpt_neox', 'gpt_oss', 'gptj', 'granite', 'helium', 'jamba', 'llama', 'llama4', 'mamba', 'minicpm3', 'ministral', 'mistral', 'mixtral', 'mpt', 'nemotron', 'olmo', 'olmo2', 'olmo3', 'olmoe', 'opt', 'persimmon', 'phi', 'phi3', 'qwen2', 'qwen2_moe', 'qwen2_sw', 'qwen3', 'qwen3_moe', 'qwen3_next', 'qwen3_sw', 'smollm3', 'stablelm', 'starcoder2', 'vaultgemma', 'xglm')  # every configuration of spec()

def spec(arch, window=SW):
    """model_type, kwargs. `window` is the sliding window where the arch has one."""
    s = {
        "llama": ("llama", dict(L)),
        "gpt2": ("gpt2", dict(n_embd=32, n_layer=2, n_head=4, n_positions=1024)),
        "mistral": ("mistral", dict(L, sliding_window=window)),
        "mixtral": ("mixtral", dict(L, sliding_window=window, num_local_experts=4, num_experts_per_tok=2)),
        "qwen2": ("qwen2", dict(L)),
        "qwen2_sw": ("qwen2", dict(L, use_sliding_window=True, sliding_window=window, max_window_layers=0)),
        "qwen3": ("qwen3", dict(L, head_dim=8)),
        "qwen3_sw": ("qwen3", dict(L, head_dim=8, use_sliding_window=True, sliding_window=window, max_window_layers=0)),
        "qwen3_moe": ("qwen3_moe", dict(L, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)),
        "qwen2_moe": ("qwen2_moe", dict(L, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
        "phi": ("phi", dict(L, partial_rotary_factor=0.5)),
        "phi3": ("phi3", dict(L, sliding_window=window)),
        "gemma": ("gemma", dict(L, head_dim=8)),
        "gemma2": ("gemma2", dict(L, head_dim=8, sliding_window=window, query_pre_attn_scalar=8)),
        "gemma3": ("gemma3_text", dict(L, head_dim=8, sliding_window=window, query_pre_attn_scalar=8, sliding_window_pattern=2,
                                        layer_types=["sliding_attention", "full_attention"])),
        "olmo": ("olmo", dict(L)),
        "olmo2": ("olmo2", dict(L)),
        "olmo3": ("olmo3", dict(L, sliding_window=window, layer_types=["sliding_attention", "full_attention"])),
        "falcon": ("falcon", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False, multi_query=True, alibi=False)),
        "falcon_alibi": ("falcon", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True, multi_query=True)),
        "falcon_newarch": ("falcon", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True)),
        "gpt_neox": ("gpt_neox", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=1024)),
        "gptj": ("gptj", dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=1024)),
        "gpt_neo": ("gpt_neo", dict(hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=1024, window_size=window,
                                     attention_types=[[["global", "local"], 1]])),
        "bloom": ("bloom", dict(hidden_size=32, n_layer=2, n_head=4)),
        "opt": ("opt", dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=1024, word_embed_proj_dim=32)),
        "stablelm": ("stablelm", dict(L)),
        "starcoder2": ("starcoder2", dict(L, sliding_window=window)),
        "cohere": ("cohere", dict(L)),
        "cohere2": ("cohere2", dict(L, sliding_window=window, layer_types=["sliding_attention", "full_attention"])),
        "gpt_bigcode": ("gpt_bigcode", dict(n_embd=32, n_layer=2, n_head=4, n_positions=1024)),
        "codegen": ("codegen", dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=1024, n_ctx=1024)),
        "mpt": ("mpt", dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=1024)),
        "granite": ("granite", dict(L)),
        "smollm3": ("smollm3", dict(L)),
        "ministral": ("ministral", dict(L, head_dim=8, sliding_window=window, layer_types=["sliding_attention", "full_attention"])),
        "llama4": ("llama4_text", dict(L, head_dim=8, intermediate_size_mlp=64, num_local_experts=2, num_experts_per_tok=1,
                                         attention_chunk_size=window, interleave_moe_layer_step=1, no_rope_layers=[1, 0],
                                         layer_types=["chunked_attention", "full_attention"])),
        "deepseek_v3": ("deepseek_v3", dict(L, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                               n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)),
        "gpt_oss": ("gpt_oss", dict(L, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
                                      layer_types=["sliding_attention", "full_attention"])),
        "jamba": ("jamba", dict(L, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                 expert_layer_offset=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, use_mamba_kernels=False)),
        "mamba": ("mamba", dict(hidden_size=32, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=4, use_mambapy=False)),
        "falcon_mamba": ("falcon_mamba", dict(hidden_size=32, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=4)),
        "qwen3_next": ("qwen3_next", dict(L, head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
                                            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)),
        "exaone4": ("exaone4", dict(L, sliding_window=window, layer_types=["sliding_attention", "full_attention"])),
        "deepseek_v2": ("deepseek_v2", dict(L, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                               n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)),
        "minicpm3": ("minicpm3", dict(L, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)),
        "glm4": ("glm4", dict(L, head_dim=8)),
        "olmoe": ("olmoe", dict(L, num_experts=4, num_experts_per_tok=2)),
        "persimmon": ("persimmon", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=1024)),
        "xglm": ("xglm", dict(d_model=32, ffn_dim=64, num_layers=2, attention_heads=4, max_position_embeddings=1024)),
        "biogpt": ("biogpt", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=1024)),
        "helium": ("helium", dict(L, head_dim=8)),
        "nemotron": ("nemotron", dict(L, head_dim=8)),
        "vaultgemma": ("vaultgemma", dict(L, head_dim=8, sliding_window=window, query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"])),
    }[arch]
    return copy.deepcopy(s)


def build(arch, seed=0, init=0.3, window=SW, layers=None):
    mtype, kw = spec(arch, window)
    if layers is not None:
        for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
            if k in kw:
                kw[k] = layers
        if "layer_types" in kw:
            kw["layer_types"] = kw["layer_types"][:layers]
        if "attention_types" in kw:
            kw["attention_types"] = [[["local"], 1]]
        if "no_rope_layers" in kw:
            kw["no_rope_layers"] = kw["no_rope_layers"][:layers]
    torch.manual_seed(seed)
    common = dict(vocab_size=V, initializer_range=init, bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    cfg = AutoConfig.for_model(mtype, **common, **kw)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval()


def perturbed(model, noise, seed=123):
    """`evals/tiny.py`'s noisy copy of `model`, seeded as the tests' drafts are."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tiny import perturbed as noisy_copy

    return noisy_copy(model, noise, seed)
