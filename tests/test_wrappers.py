"""Models as PEFT and user code wrap them, and processors that subclass transformers' own. Each case gave
output that differed from plain generate() without a word, or a false refusal. PEFT itself is not a
dependency: its wrappers are imitated by what hf_specdec reads of them (an instance-level
`prepare_inputs_for_generation`, forward pre-hooks by PEFT's function names, a wrapper from a `peft.` module
with `get_base_model`), and peft 0.21 itself was checked by hand (the closing note of this change)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM, LogitsProcessorList, TemperatureLogitsWarper

import hf_specdec
from conftest import perturbed, tiny_model

PROMPT = torch.tensor([[1, 5, 9, 12, 17, 33]])


def spec(target, prompt=PROMPT, **kwargs):
    kwargs = {"max_new_tokens": 12, "do_sample": False, **kwargs}
    return target.generate(prompt, custom_generate=hf_specdec.speculative_generate, **kwargs)


class NoRepeat(TemperatureLogitsWarper):
    """Temperature, and the last token banned: a subclass of a warper that reads input_ids."""

    def __call__(self, input_ids, scores):
        scores = super().__call__(input_ids, scores).clone()
        return scores.scatter_(1, input_ids[:, -1:], -float("inf"))


def test_a_subclass_of_a_warper_sees_the_real_prefix():
    """Before: processors were sorted by isinstance, so this subclass passed as one that never reads input_ids
    and was called with a column of zeros: it banned token 0, not the last one (greedy repeated a token it
    bans), and in a batch it was trusted row by row without a word."""
    target = tiny_model("llama", vocab=64, seed=3, init=1.0)
    draft = perturbed(target, 0.02)
    kwargs = dict(logits_processor=LogitsProcessorList([NoRepeat(1.0)]), max_new_tokens=12, do_sample=False)
    plain = target.generate(PROMPT, **kwargs)
    out = spec(target, assistant=draft, **{k: v for k, v in kwargs.items() if k not in ("max_new_tokens", "do_sample")})
    assert torch.equal(out, plain)
    assert all(a != b for a, b in zip(out[0, 5:-1].tolist(), out[0, 6:].tolist()))
    with pytest.raises(ValueError, match="NoRepeat is not known to allow that"):
        spec(target, PROMPT.repeat(2, 1), assistant=draft, logits_processor=kwargs["logits_processor"])


def test_inputs_prepared_on_the_instance_are_refused():
    """PEFT prompt tuning sets the model's prepare_inputs_for_generation for the call, where it adds its virtual
    tokens. Before: hf_specdec fed token ids to the forward and gave the base model's output."""
    target = tiny_model("llama", vocab=64, seed=3)
    draft = perturbed(target, 0.02)
    original = target.prepare_inputs_for_generation
    target.prepare_inputs_for_generation = lambda *args, **kwargs: original(*args, **kwargs)
    with pytest.raises(ValueError, match="prepare_inputs_for_generation is replaced on the model"):
        spec(target, assistant=draft)
    target.prepare_inputs_for_generation = original  # PEFT's restore: the model's own method, on the instance
    assert torch.equal(spec(target, assistant=draft), target.generate(PROMPT, max_new_tokens=12, do_sample=False))


def _adapter_names_pre_forward_hook(module, args, kwargs):  # PEFT's name; PEFT adds adapter_names=[...] here
    return args, kwargs


def _alora_offsets_pre_forward_hook(module, args, kwargs):
    return args, kwargs


def _seed_shadow_pre_hook(module, args, kwargs):  # ShadowPEFT's, registered for good: it threads a ShadowCache
    return args, kwargs


def test_per_row_adapters_and_alora_are_refused_where_they_would_differ():
    """PEFT's adapter_names= binds one adapter per row when the call starts. Before: a batch lost a row as it
    finished and PEFT's next forward failed inside the decode loop (leaving its hooks on the model, so that
    every later call failed too); aLoRA, which adapts each forward's last positions, would leave a verify
    forward's earlier ones unadapted; ShadowPEFT's own cache failed in a raw size mismatch."""
    target = tiny_model("llama", vocab=64, seed=3)
    draft = perturbed(target, 0.02)
    layer = target.model.layers[0].self_attn.q_proj
    for call in (lambda: spec(target, PROMPT.repeat(2, 1), assistant=draft),
                 lambda: hf_specdec.generate_continuous(target, [[1, 5, 9]], assistant=draft, max_new_tokens=4)):
        layer.register_forward_pre_hook(_adapter_names_pre_forward_hook, with_kwargs=True)
        with pytest.raises(ValueError, match="PEFT adapters per row"):
            call()
        assert not layer._forward_pre_hooks  # PEFT removes them when its call returns; a refused call's, hf_specdec
    handle = layer.register_forward_pre_hook(_adapter_names_pre_forward_hook, with_kwargs=True)
    assert torch.equal(spec(target, assistant=draft), target.generate(PROMPT, max_new_tokens=12, do_sample=False))
    handle.remove()
    layer.register_forward_pre_hook(_alora_offsets_pre_forward_hook, with_kwargs=True)
    with pytest.raises(ValueError, match="aLoRA"):
        spec(target, assistant=draft)
    layer.register_forward_pre_hook(_seed_shadow_pre_hook, with_kwargs=True)
    with pytest.raises(ValueError, match="ShadowPEFT"):
        spec(target, assistant=draft)
    assert list(layer._forward_pre_hooks.values()) == [_seed_shadow_pre_hook]  # ShadowPEFT's own stay


class PeftModelForCausalLM(torch.nn.Module):
    """PEFT's wrapper as hf_specdec sees it: forward(*args, **kwargs), the model's attributes passed through, the
    model at get_base_model()."""

    __module__ = "peft.peft_model"

    def __init__(self, model):
        super().__init__()
        self.base_model = model

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.base_model, name)

    def get_base_model(self):
        return self.base_model

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)


def test_a_peft_draft_drafts_with_its_base_model():
    """Before: a PEFT-wrapped draft was refused as one that 'takes no key-value cache' (its forward takes
    *args, **kwargs), and early_exit_draft said to load it with AutoModelForCausalLM."""
    target = tiny_model("llama", vocab=64, seed=3)
    draft = PeftModelForCausalLM(perturbed(target, 0.02))
    plain = target.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert torch.equal(spec(target, assistant=draft), plain)
    assert torch.equal(spec(target, assistant=hf_specdec.early_exit_draft(PeftModelForCausalLM(target), 1)), plain)


# ---------------------------------------------------------------- models of one's own (as trust_remote_code loads them)


class LegacyMask(LlamaForCausalLM):
    """Reads a 4-D mask as 1 = attend, as transformers' legacy `_prepare_4d_causal_attention_mask` does (many
    hub models of their own call it); plain generate() only ever hands it a 2-D mask."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = torch.where(attention_mask == 0, torch.finfo(attention_mask.dtype).min, 0.0).to(attention_mask.dtype)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                               **kwargs)


class WithMethods(LlamaForCausalLM):
    def describe(self):
        return "a subclass that adds a method"


class NoMask(LlamaForCausalLM):
    """Takes no attention mask (and, strictly, nothing else it does not name)."""

    def forward(self, input_ids=None, position_ids=None, cache=None, use_cache=None, return_dict=None):
        return super().forward(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=use_cache)


class Viewing(LlamaForCausalLM):
    """Views its ids and positions flat, as Kosmos-2.5's sinusoidal positions do: plain generate() feeds contiguous
    tensors."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, **kwargs):
        input_ids.view(-1), position_ids.view(-1)  # raises on a strided slice
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                               **kwargs)


def own(cls, seed=3):
    base = tiny_model("llama", vocab=64, seed=seed)
    model = cls(base.config).eval()
    model.load_state_dict(base.state_dict())
    return model


def test_a_model_of_ones_own_gets_no_tree_mask_and_no_mask_it_cannot_read():
    """Before: a tree round handed LegacyMask a 4-D mask, which it inverted (greedy differed from plain with
    default settings); NoMask attended to a batch's padding and holes without a word, and a strict forward
    met position_ids=None (TypeError) on a single row."""
    prompt = torch.tensor([[1, 5, 9, 2, 7, 3, 1, 5, 9, 2, 7, 3]])
    for cls, trees in ((LegacyMask, False), (WithMethods, True)):  # a subclass that keeps transformers' forward keeps trees
        target = own(cls)
        records = []
        out = spec(target, prompt, assistant=perturbed(target, 0.02), max_new_tokens=40, acceptance_sink=records.append,
                   costs=hf_specdec.Costs(draft_step=0.2, verify=0.05))  # pinned: rounds that draft, trees among them
        assert torch.equal(out, target.generate(prompt, max_new_tokens=40, do_sample=False))
        assert any(r.parents is not None for r in records) == trees
    target = own(NoMask)
    draft = perturbed(tiny_model("llama", vocab=64, seed=3), 0.02)
    assert torch.equal(spec(target, prompt, assistant=draft), target.generate(prompt, max_new_tokens=12, do_sample=False))
    with pytest.raises(hf_specdec.UnsupportedCacheError, match="NoMask takes no attention mask"):
        spec(target, prompt.repeat(2, 1), assistant=draft, attention_mask=torch.ones(2, 12, dtype=torch.long))
    with pytest.raises(hf_specdec.UnsupportedCacheError, match="continuous batching: .*NoMask takes no attention mask"):
        hf_specdec.generate_continuous(target, [[1, 5, 9]], assistant=draft, max_new_tokens=4)


def test_forwards_get_contiguous_ids_and_positions():
    """From a sweep of every causal-LM class as the draft. Before: a left-padded batch's cached forwards got a
    strided slice of positions, and Kosmos-2.5 (which views them flat) failed raw where plain generate() ran."""
    target, draft = own(Viewing), own(Viewing, seed=4)
    prompt, mask = torch.tensor([[0, 0, 1, 5, 9, 2], [1, 5, 9, 2, 7, 3]]), torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    out = spec(target, prompt, assistant=draft, attention_mask=mask, pad_token_id=0, num_draft_tokens=4, adaptive=False)
    assert torch.equal(out, target.generate(prompt, attention_mask=mask, pad_token_id=0, max_new_tokens=12, do_sample=False))


def test_drafts_that_take_one_token_after_a_cache_are_named():
    """From the same sweep. Before: XLM and ProphetNet as drafts failed inside their forwards (a size error; an
    AssertionError once a round fed the draft several tokens); as targets they were already refused by name."""
    from transformers import ProphetNetConfig, ProphetNetForCausalLM, XLMConfig, XLMWithLMHeadModel

    target = tiny_model("llama", vocab=64, seed=3)
    for draft in (XLMWithLMHeadModel(XLMConfig(vocab_size=64, emb_dim=32, n_layers=1, n_heads=4, causal=True)),
                  ProphetNetForCausalLM(ProphetNetConfig(vocab_size=64, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                                         num_encoder_layers=1, num_decoder_layers=1, num_encoder_attention_heads=4,
                                                         num_decoder_attention_heads=4))):
        with pytest.raises(ValueError, match=f"the draft model .assistant. .{type(draft).__name__}.: .* hf_specdec feeds a "
                                             "forward several new tokens after a cache. Use another draft model"):
            spec(target, assistant=draft.eval())


def test_an_attention_implementation_without_a_mask_function_is_refused():
    """transformers builds no mask for an implementation missing from AttentionMaskInterface (one registered
    alone, or 'paged|eager'): plain's one-token steps need none. Before: verify forwards over several tokens
    attended past each token, and greedy differed from plain."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("hf_specdec_test_sdpa", sdpa_attention_forward)
    target = tiny_model("llama", vocab=64, seed=3)
    draft = perturbed(target, 0.02)
    target.config._attn_implementation = "hf_specdec_test_sdpa"
    with pytest.raises(hf_specdec.UnsupportedCacheError, match="'hf_specdec_test_sdpa' has no mask function registered"):
        spec(target, assistant=draft)
    AttentionMaskInterface.register("hf_specdec_test_sdpa", sdpa_mask)
    assert torch.equal(spec(target, assistant=draft), target.generate(PROMPT, max_new_tokens=12, do_sample=False))


def gemma3_and_draft():
    """A tiny Gemma 3 image-text model, a Llama draft of its vocabulary, and the text and vision settings."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, LlamaConfig

    torch.manual_seed(0)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=256)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    target = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision)).eval()
    draft = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, vocab_size=256)).eval()
    return target, draft, text, vision


def test_a_sub_config_attention_implementation_without_a_mask_function_is_refused():
    """A composite model's text model can take its own implementation (set_attn_implementation({"text_config": ...}))
    while the top-level config says 'sdpa'. Before: only the top level was checked, and greedy differed from plain."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("hf_specdec_test_text_only", sdpa_attention_forward)
    target, draft, _, _ = gemma3_and_draft()
    target.set_attn_implementation({"text_config": "hf_specdec_test_text_only", "vision_config": "sdpa", "": "sdpa"})
    assert target.config._attn_implementation == "sdpa"
    with pytest.raises(hf_specdec.UnsupportedCacheError, match="'hf_specdec_test_text_only' has no mask function"):
        spec(target, assistant=draft)
    AttentionInterface.register("hf_specdec_test_vision_only", sdpa_attention_forward)  # the vision tower never runs
    target.set_attn_implementation({"text_config": "sdpa", "vision_config": "hf_specdec_test_vision_only", "": "sdpa"})
    assert torch.equal(spec(target, assistant=draft), target.generate(PROMPT, max_new_tokens=12, do_sample=False))


def test_a_meta_default_device_and_models_without_accessors():
    """Before: under torch.set_default_device("meta") (plain generate() runs there) a tree's host tensors were made
    on meta (NotImplementedError); a model without get_input_embeddings met transformers' raw NotImplementedError,
    and one without get_output_embeddings was told to load with AutoModelForCausalLM."""
    target = tiny_model("llama", vocab=64, seed=3)
    draft = perturbed(target, 0.02)
    prompt = torch.tensor([[1, 5, 9, 2, 7, 3, 1, 5, 9, 2, 7, 3]])
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    torch.set_default_device("meta")
    try:
        out = spec(target, prompt, assistant=draft, max_new_tokens=24)
    finally:
        torch.set_default_device(None)
    assert torch.equal(out, plain)

    class NoAccessor(LlamaForCausalLM):  # a head, no input embedding: refused as a target, a draft reads its head only
        def get_input_embeddings(self):
            raise NotImplementedError("`get_input_embeddings` not auto-handled")

        def get_output_embeddings(self):
            return self.lm_head

    with pytest.raises(ValueError, match=r"\(NoAccessor\) has no get_input_embeddings\(\)"):
        spec(own(NoAccessor), assistant=draft)
    assert torch.equal(spec(target, assistant=own(NoAccessor)), target.generate(PROMPT, max_new_tokens=12, do_sample=False))


# ---------------------------------------------------------------- multimodal classes, used for text


def test_a_multimodal_target_runs_on_text_and_names_images():
    """transformers hands a multimodal model an empty mm_encoder_outputs when there is no image. Before: every such
    class (Gemma 3, Qwen2-VL, Llava, ... 20 in transformers 5.25) was refused on text alone, naming an argument the
    caller never passed; and GIT, whose cached forwards widen a 2-D mask by its image tokens, gave a batch that
    differed from plain without a word."""
    from transformers import GitConfig, GitForCausalLM, LlavaConfig, LlavaForConditionalGeneration

    target, draft, text, vision = gemma3_and_draft()
    ids, mask = torch.tensor([[15, 16, 17, 18, 19, 20, 21], [0, 0, 40, 41, 42, 43, 44]]), torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    for rows in (1, 2):
        kwargs = dict(attention_mask=mask[:rows], max_new_tokens=12, do_sample=False)
        assert torch.equal(spec(target, ids[:rows], assistant=draft, **kwargs), target.generate(ids[:rows], **kwargs))
    llava = LlavaForConditionalGeneration(LlavaConfig(text_config={**text, "model_type": "llama"}, vision_config=vision,
                                                      image_token_index=255)).eval()
    assert torch.equal(spec(llava, ids[:1], assistant=draft), llava.generate(ids[:1], max_new_tokens=12, do_sample=False))
    with pytest.raises(ValueError, match="images or other media"):
        spec(llava, torch.tensor([[255] * 4 + [15, 16]]), assistant=draft, pixel_values=torch.randn(1, 3, 224, 224))
    git = GitForCausalLM(GitConfig(vision_config=dict(vision, projection_dim=32), vocab_size=256, hidden_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)).eval()
    with pytest.raises(hf_specdec.UnsupportedCacheError, match="GIT's forward widens a 2-D attention mask"):
        spec(git, ids, assistant=draft, attention_mask=mask)
