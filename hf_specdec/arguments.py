"""Setup and validation of a speculative generate call: hf_specdec's own arguments checked by type and
range before any model work, the call's `SpeculativeConfig` resolved, and clear errors for what the
decode loop cannot do correctly (named, never silently wrong)."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import logging
import numbers
import os
import sys
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import (ExponentialDecayLengthPenalty, ForcedEOSTokenLogitsProcessor,
                                                    MinNewTokensLengthLogitsProcessor, SuppressTokensAtBeginLogitsProcessor)
from transformers.generation.stopping_criteria import MaxLengthCriteria
from transformers.generation.streamers import BaseStreamer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from .cache import UnsupportedCacheError, check_cache, column_bound, forward_takes, local_window
from .config import SETTINGS, SpeculativeConfig
from .proposals import Drafter
from .proposals.draft_model import inner_drafter
from .retrieval import RetrievalCache
from .sampling import row_unsafe

logger = logging.getLogger(__name__)


def _resolve_config(base: SpeculativeConfig | None, **overrides: Any) -> SpeculativeConfig:
    """`base` (or the defaults) with every explicitly given argument replacing its field. None means
    "not given", except for `draft_window`, whose None (the whole prompt) differs from its default:
    there "not given" is the string "default"."""
    given = {k: v for k, v in overrides.items() if v is not None and not (k == "draft_window" and v == "default")}
    if overrides.get("draft_window", "default") is None:
        given["draft_window"] = None
    return dataclasses.replace(base or SpeculativeConfig(), **given)




# Processors built from the first prompt's length or max_length: wrong for every prompt that joins later.
PER_PROMPT_PROCESSORS = ((MinNewTokensLengthLogitsProcessor, "min_new_tokens"),
                         (SuppressTokensAtBeginLogitsProcessor, "begin_suppress_tokens"),
                         (ForcedEOSTokenLogitsProcessor, "forced_eos_token_id"),
                         (ExponentialDecayLengthPenalty, "exponential_decay_length_penalty"))


def continuous_settings(config, logits_processor, stopping_criteria, candidate_generator, input_ids, streamer,
                        max_batch_size: int = 1):
    """Continuous batching's checks and settings: (config, stopping criteria)."""
    if candidate_generator is not None and not isinstance(candidate_generator, Drafter):
        raise ValueError("continuous batching needs the draft model or an hf_specdec Drafter; a transformers "
                         "CandidateGenerator runs one row at a time")
    _validate_rows(candidate_generator, max_batch_size, f"continuous batching with max_batch_size={max_batch_size} runs more")
    if streamer is not None:
        raise ValueError("streamers take one row; continuous batching runs many")
    if input_ids.shape[0] != 1:
        raise ValueError("continuous batching starts from one prompt (the others join as it runs)")
    for kind, setting in PER_PROMPT_PROCESSORS:
        if any(isinstance(p, kind) for p in logits_processor or []):
            raise ValueError(f"{setting} counts from one prompt's length in transformers' processor; continuous "
                             "batching has many prompts (one generate call per prompt can use it)")
    unknown = row_unsafe(logits_processor)
    if unknown:  # transformers builds them from the call's input_ids: the first prompt (with any max_batch_size)
        raise ValueError(f"{', '.join(unknown)} is not known to work row by row, and transformers builds such a "
                         "processor from the call's first prompt; continuous batching has many prompts (one generate "
                         "call per prompt can use it)")
    # Rows join and leave: no tree (single rows only), no draft window; max_new_tokens counts per row.
    if isinstance(config.draft_window, int):
        logger.warning("draft_window=%d is for one row at a time; continuous batching encodes whole prompts in the "
                       "draft", config.draft_window)
    config = dataclasses.replace(config, tree=False, draft_window=None)
    stopping_criteria = StoppingCriteriaList([c for c in stopping_criteria if not isinstance(c, MaxLengthCriteria)])
    return config, stopping_criteria


def validate(
    model: PreTrainedModel,
    assistant: PreTrainedModel | None,
    candidate_generator: Drafter | CandidateGenerator | None,
    input_ids: torch.Tensor,
    generation_config: GenerationConfig,
    synced_gpus: bool,
    model_kwargs: dict[str, Any],
    streaming: bool = False,
    continuous: bool = False,
) -> None:
    """Clear errors for what this decode loop cannot do correctly."""
    _validate_strategy(generation_config, synced_gpus)
    _validate_call(input_ids, generation_config, assistant, candidate_generator, continuous)
    _validate_assisted(model, generation_config)
    n = generation_config.num_return_sequences or 1
    rows = f"got a batch of {input_ids.shape[0]} rows" + (f" (num_return_sequences={n} repeats each prompt)" if n > 1 else "")
    if input_ids.shape[0] > 1 and streaming:
        raise ValueError(f"streamers take one row in hf_specdec (rows that accept different numbers of tokens would "
                         f"reach a streamer out of step; transformers' TextStreamer takes one row too); {rows}")
    if assistant is None and candidate_generator is None:
        raise ValueError(
            "speculative_generate needs a draft model: pass `assistant=draft_model` to generate() with "
            "custom_generate=hf_specdec.speculative_generate (transformers consumes `assistant_model=` itself before "
            "a custom_generate callable sees it), or `assistant_model=draft_model` with the directory form "
            "(custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True)."
        )
    _validate_family(model, generation_config)
    _validate_drafter(model, candidate_generator, input_ids.shape[0], rows)
    _validate_model_inputs(model_kwargs)
    _validate_padding(model_kwargs.get("attention_mask"), input_ids, generation_config.pad_token_id)
    _validate_positions(model_kwargs.get("position_ids"), model_kwargs.get("attention_mask"), input_ids)
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: hf_specdec needs at least one input token (a BOS token will do).")
    _validate_ids(model, input_ids)
    check_cache(model_kwargs.get("cache"), "target")
    cached = model_kwargs["cache"].get_seq_length() if model_kwargs.get("cache") is not None else 0
    if cached >= input_ids.shape[1]:
        raise ValueError(f"the cache passed in holds {cached} tokens and the input {input_ids.shape[1]}: a cache "
                         "must hold a prefix of input_ids, with at least the last token left to encode.")
    _validate_window(_validate_holes(model, input_ids, continuous), input_ids, generation_config)
    _validate_same_function(model, input_ids.shape[0] > 1 or continuous)
    _validate_rope(model.config, tuple(input_ids.shape), generation_config.max_length, continuous)
    _warn_dropout(model, "target")
    if assistant is not None:
        _validate_assistant(model, assistant)
        _validate_layers(assistant, "draft model (assistant)")


_OWN_POSITIONS = ("kosmos-2", "kosmos-2.5", "kosmos_2_text_model", "kosmos_2_5_text_model", "csm", "csm_depth_decoder_model")
_ONE_TOKEN_STEPS = {  # model type: why its forward cannot take several new tokens after a cache
    "xlm": "XLM's language-model head takes the whole sequence beside its cache and cuts it itself, and attends both "
           "ways unless causal=True",
    "prophetnet": "ProphetNet's decoder takes one new token a forward once it has a cache"}


def _bidirectional(config: Any) -> str | None:
    """A config (or its text model's) that attends both ways (PaliGemma sets use_bidirectional_attention on its
    Gemma text model), said as the setting. Gemma and Gemma 2 still build a causal mask, which eager attention
    applies (sdpa and flash attention take the flag as is_causal=False), so only there it runs."""
    for c in (config, text_config(config)):
        flag = getattr(c, "use_bidirectional_attention", None)
        if flag is True or flag == "all":  # Gemma 4: "all" or "vision" (images only)
            eager = c.model_type in ("gemma", "gemma2") and getattr(c, "_attn_implementation", None) == "eager"
            if not eager:
                extra = " outside eager attention" if c.model_type in ("gemma", "gemma2") else ""
                return f"{c.model_type}'s use_bidirectional_attention={flag!r}{extra}"
    return None


def text_config(config: Any) -> Any:
    """A composite config's text model's (`get_text_config`), the config itself where it has none or several."""
    try:
        return config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    except ValueError:  # "Multiple valid text configs were found"
        return config


def _validate_family(model: PreTrainedModel, generation_config: GenerationConfig) -> None:
    """Targets whose forward over several new tokens cannot equal plain decoding's one-token steps, by family."""
    config, kind = model.config, model.config.model_type
    if config.is_encoder_decoder:
        raise ValueError("hf_specdec supports decoder-only models; the target is an encoder-decoder model.")
    both_ways = (getattr(config, "is_decoder", None) is False and kind in _CAUSAL_ONLY_AS_DECODER and "is_decoder=False") \
        or _bidirectional(config)
    if both_ways:
        raise ValueError(
            f"the target ({type(model).__name__}) has {both_ways}, so it attends in both directions: in a forward over "
            "several new tokens each would see the ones after it, and the output would differ from plain decoding."
            + (" Load it with is_decoder=True (from_pretrained(..., is_decoder=True))." if "is_decoder" in both_ways else
               " Load it with attn_implementation='eager', whose mask stays causal." if "eager" in both_ways else ""))
    if kind in _OWN_POSITIONS:
        raise ValueError(f"{type(model).__name__} works out its positions from input_ids itself (its "
                         "prepare_inputs_for_generation drops position_ids), so the positions hf_specdec's forwards pass "
                         "would shift them. Use plain generate() for this model.")
    window = getattr(config, "sliding_window", None)
    if kind == "moshi" and isinstance(window, int) and generation_config.max_length >= window:
        raise UnsupportedCacheError(f"Moshi's cache keeps a sliding window of {window} tokens but its attention mask "
                                    "applies none, so a forward over several new tokens past the window sees more columns "
                                    f"than plain decoding's one-token steps; max_length is {generation_config.max_length}. "
                                    f"Keep prompt and new tokens under {window}, or use plain generate().")


def _validate_call(input_ids, generation_config: GenerationConfig, assistant, candidate_generator, continuous: bool) -> None:
    """What generate() would have refused before a direct call of speculative_generate, and two drafts at once."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point \
            or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        shape = f"a {input_ids.dim()}-D {input_ids.dtype} tensor" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a 2-D tensor of token ids, [rows, tokens], got {shape}")
    if input_ids.dtype not in (torch.int64, torch.int32):  # an embedding takes no other (plain generate() fails in it)
        raise ValueError(f"input_ids must hold int64 (torch.long) or int32 token ids, got {input_ids.dtype}: "
                         "convert them with .long()")
    if assistant is not None and candidate_generator is not None:  # the draft was never used
        raise ValueError("both assistant= and candidate_generator= were given: pass one draft source")


_NO_SYNCED_GPUS = "hf_specdec does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP generation)."


def _validate_strategy(generation_config: GenerationConfig, synced_gpus: bool) -> None:
    """What the generation config asks for that this loop does not do."""
    if generation_config.max_length is None:
        raise ValueError("the generation config has no max_length: speculative_generate takes the config that "
                         "model.generate() prepares; call model.generate(input_ids, custom_generate="
                         "hf_specdec.speculative_generate, assistant=draft, max_new_tokens=...)")
    if isinstance(generation_config.max_length, bool) or not isinstance(generation_config.max_length, numbers.Integral):
        raise ValueError(f"max_new_tokens and max_length must be integers, got max_new_tokens="
                         f"{generation_config.max_new_tokens!r}, max_length={generation_config.max_length!r}")
    if generation_config.num_beams not in (None, 1):
        raise ValueError(
            f"hf_specdec does not support beam search (num_beams={generation_config.num_beams}); "
            "it implements greedy and multinomial sampling only."
        )
    if synced_gpus:
        raise ValueError(_NO_SYNCED_GPUS)
    if getattr(generation_config, "constraints", None) or getattr(generation_config, "force_words_ids", None):
        raise ValueError("hf_specdec does not do constrained beam search (constraints / force_words_ids); "
                         "it implements greedy and multinomial sampling only.")
    alpha = getattr(generation_config, "penalty_alpha", None)  # contrastive search, as transformers selects it
    contrastive = bool(alpha) and alpha > 0 and (generation_config.top_k or 0) > 1 and not generation_config.do_sample
    for name, strategy, asked in (("dola_layers", "DoLa decoding", getattr(generation_config, "dola_layers", None) is not None),
                                  ("penalty_alpha", "contrastive search", contrastive)):
        if asked:  # plain generate() would not decode greedily or sample
            raise ValueError(f"hf_specdec does not do {strategy} ({name}={getattr(generation_config, name)!r}); "
                             "it implements greedy and multinomial sampling only.")
    for flag in ("output_attentions", "output_hidden_states"):
        if generation_config.return_dict_in_generate and getattr(generation_config, flag):
            raise ValueError(f"hf_specdec does not return attentions or hidden states ({flag}=True).")


def _origin(model: PreTrainedModel, generation_config: GenerationConfig, name: str) -> str:
    """Where a setting came from, when the model's generation_config holds it ("" otherwise)."""
    value = getattr(generation_config, name)
    if getattr(model.generation_config, name, None) == value:
        return f" ({name}={value!r} comes from the model's generation_config: pass {name}=None to generate())"
    return ""


def _warn_dropout(model: PreTrainedModel, who: str) -> None:
    """A model in training mode with dropout (built from a config, or after .train()): every forward
    is random, so outputs, plain generate()'s too, repeat no run and match no eval-mode run. Warned
    about once a process; the draft's dropout would only cost speed."""
    if not model.training or ("dropout", who) in _WARNED:
        return
    rates = [getattr(text_config(model.config), "attention_dropout", 0.0)]  # Llama's kind: F.dropout in attention
    rates += [getattr(m, "p", 0.0) for m in model.modules() if m.training and type(m).__name__.endswith("Dropout")]
    if any(isinstance(r, numbers.Real) and r > 0 for r in rates):
        _WARNED.add(("dropout", who))
        logger.warning("the %s is in training mode with dropout (model.train(), or built from a config): its forwards "
                       "are random, so the output differs from an eval-mode run (plain generate()'s would too). "
                       "Call .eval() on it first", who)


def _validate_assisted(model: PreTrainedModel, generation_config: GenerationConfig) -> None:
    """A cache other than DynamicCache refused, and transformers' own speculation settings: those that pick another
    method or law refused, the draft-length knobs that differ from the defaults transformers fills into every call
    warned about (once), each named with where it came from when the model's generation_config holds it."""
    def origin(name: str) -> str:
        return _origin(model, generation_config, name)

    if generation_config.cache_implementation not in (None, "dynamic"):
        raise UnsupportedCacheError(f"hf_specdec supports DynamicCache only, got cache_implementation="
                                    f"{generation_config.cache_implementation!r}{origin('cache_implementation')}.")
    for name, why in _ASSISTED_METHODS.items():  # as transformers reads them: set (use_mtp: true)
        value = getattr(generation_config, name, None)
        if (bool(value) if name == "use_mtp" else value is not None):
            raise ValueError(f"{name}={value!r} asks for transformers' own assisted decoding, which hf_specdec "
                             f"replaces: {why}{origin(name)}.")
    for name, (default, why) in _ASSISTED_KNOBS.items():
        value = getattr(generation_config, name, None)
        if value not in (None, default) and (name, repr(value)) not in _WARNED:
            _WARNED.add((name, repr(value)))
            logger.warning("%s=%r is a setting of transformers' assisted decoding, which hf_specdec does not read: "
                           "%s%s", name, value, why, origin(name))


_ASSISTED_METHODS = {
    "assistant_ensemble_weight": "it relaxes the target's law, and hf_specdec verifies exactly (drop it)",
    "prompt_lookup_num_tokens": "hf_specdec looks up continuations in the prompt and the output itself (ngram=True, "
                                "the default; candidate_generator=hf_specdec.NgramDrafter() for lookups alone)",
    "assistant_early_exit": "pass assistant=hf_specdec.early_exit_draft(model, num_layers) for an early-exit draft",
    "use_mtp": "multi-token prediction is another method; drop use_mtp to speculate with the draft given",
    "speculation_type": "it picks one of transformers' methods; drop it to speculate with the draft given",
}
_PLANNED = "hf_specdec plans each round's draft length itself (num_draft_tokens= is the most; adaptive=False: always)"
_OTHER_TOKENIZER = "it is for drafts with another tokenizer; hf_specdec needs the target's vocabulary"
_ASSISTED_KNOBS = {  # name: (the value transformers fills in when unset, why it is not read)
    "num_assistant_tokens": (20, _PLANNED),
    "num_assistant_tokens_schedule": ("constant", _PLANNED),
    "assistant_confidence_threshold": (0.4, _PLANNED),
    "max_matching_ngram_size": (None, "hf_specdec sizes its lookups itself (ngram=True, the default)"),
    "assistant_lookbehind": (10, _OTHER_TOKENIZER),
    "target_lookbehind": (10, _OTHER_TOKENIZER),
}
_WARNED: set[tuple[str, str]] = set()  # (name, value) warned about in this process


def validate_retrieval_cache(model: PreTrainedModel, cache: RetrievalCache | None) -> None:
    """A cache holding ids the target cannot embed (text tokenized for another model, a saved cache
    loaded beside another model) is named before the first forward, not met as an index error in it."""
    vocab = model.get_output_embeddings().weight.shape[0]
    if cache is not None and cache.max_token_id >= vocab:
        raise ValueError(f"the retrieval_cache holds token id {cache.max_token_id}, outside the target's vocabulary of "
                         f"{vocab} tokens: was it filled with another model's tokenizer?")


# Encoder families whose language-model heads attend causally only with `config.is_decoder=True`.
_CAUSAL_ONLY_AS_DECODER = frozenset({
    "bert", "bert-generation", "big_bird", "camembert", "convbert", "data2vec-text", "electra", "ernie", "megatron-bert",
    "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod"})
_LAYER_KINDS = {"DummyLayer": "layers without keys and values of their own: shared with another layer's, as in Gemma 3n, "
                              "or no attention",
                "DynamicIndexedLayer": "a sparse-attention indexer's keys beside the attention's, as in DeepSeek-V3.2: a "
                                       "forward over several tokens keeps other keys than plain's one-token steps"}


def _layer_kind(layer) -> str:
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        return "linear attention or another recurrent state"
    return _LAYER_KINDS.get(type(layer).__name__, "a layer of its own kind, keeping more than keys and values by column")


def _validate_layers(model: PreTrainedModel, who: str) -> list[int]:
    """The windows of `model`'s attention (sliding-window cache layers, local attention); a named error for layers the loop cannot roll
    back (linear attention keeps a recurrent state, not columns: transformers 5.25 fails inside the
    forward that follows a rollback)."""
    instead = "Use plain generate() for this model." if who == "target" else "Use another draft model."
    if model.config.model_type in _ONE_TOKEN_STEPS:
        raise ValueError(f"the {who} ({type(model).__name__}): {_ONE_TOKEN_STEPS[model.config.model_type]}, and "
                         f"hf_specdec feeds a forward several new tokens after a cache. {instead}")
    if not (forward_takes(model, "cache") or forward_takes(model, "past_key_values")):
        raise UnsupportedCacheError(
            f"the {who} ({type(model).__name__}) takes no key-value cache (its forward has no past_key_values or cache "
            f"argument): hf_specdec rolls rejected tokens back by cutting cache columns. {instead}")
    own = getattr(type(model), "_supports_default_dynamic_cache", None)  # read, never patched
    if callable(own) and not own():  # MiniMax's linear-attention family: a cache class of its own, which cannot crop
        raise UnsupportedCacheError(
            f"the {who} ({type(model).__name__}) decodes with a cache class of its own, not a DynamicCache (transformers' "
            f"generate() makes it one): hf_specdec rolls rejected tokens back by cutting DynamicCache columns. {instead}")
    layers = DynamicCache(config=model.config).layers
    other = sorted({f"{type(layer).__name__} ({_layer_kind(layer)})" for layer in layers
                    if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)})  # subclasses keep more than columns
    if other:
        raise UnsupportedCacheError(
            f"the {who} has cache layers of type {', '.join(other)}: hf_specdec rolls rejected tokens back by "
            "cutting cache columns, which needs attention layers that keep their own keys and values (full or "
            f"sliding-window). {instead}")
    local = local_window(model.config)  # local attention in full-attention cache layers counts columns too
    return [layer.sliding_window for layer in layers if isinstance(layer, DynamicSlidingWindowLayer)] + (
        [] if local is None else [local])


def _validate_holes(model: PreTrainedModel, input_ids: torch.Tensor, continuous: bool) -> list[int]:
    """Rows that accept different numbers of tokens leave masked holes: refused where the target's attention
    sees them, in continuous batching (rows join and leave) and in a batch with no window it could be checked
    against (`_validate_window`). Returns the target's windows."""
    windows, holes = _validate_layers(model, "target"), column_bound(model)[0]
    if holes and (continuous or (not windows and input_ids.shape[0] > 1)):
        what = "continuous batching" if continuous else f"a batch of {input_ids.shape[0]} rows"
        raise UnsupportedCacheError(f"{what}: rows that accept different numbers of tokens leave masked holes, and "
                                    f"{holes}. Generate one row at a time.")
    for implementation in _attention_implementations(model.config):
        if implementation in ALL_MASK_ATTENTION_FUNCTIONS:
            continue
        raise UnsupportedCacheError(
            f"the target's attention implementation {implementation!r} has no mask function registered "
            "(transformers.masking_utils.AttentionMaskInterface), so transformers builds no attention mask for it: "
            "plain decoding's one-token steps need none, but a forward over several new tokens after a cache would "
            "attend past each token. Register a mask function for it, or use 'sdpa' or 'eager'.")
    return windows


def _attention_implementations(config: Any) -> list[str]:
    """The attention implementations of a config and of its text model's config (a composite model's text model
    can be given its own: `set_attn_implementation({"text_config": ...})`; a vision tower never runs here)."""
    text = text_config(config)
    found = [getattr(c, "_attn_implementation", None) for c in (config, text)]
    return list(dict.fromkeys(i for i in found if isinstance(i, str)))


def _validate_window(windows: list[int], input_ids: torch.Tensor, generation_config: GenerationConfig) -> None:
    """A batch leaves masked holes in the rows that accepted fewer tokens than another row. A full-
    attention layer skips them; a sliding-window layer counts them in its window (columns, not real
    tokens), so it would see fewer tokens than plain decoding and answer differently. A batch is taken
    only while its widest possible work sequence fits in the narrowest window: each round widens it by
    the tokens one row emitted, or, in the round that row finishes in, by at most the budget, so it is
    at most the prompt plus twice every row's budget."""
    rows = input_ids.shape[0]
    if rows == 1 or not windows:
        return
    budget = max(0, (generation_config.max_length or 0) - input_ids.shape[1])
    widest = input_ids.shape[1] + 2 * rows * budget
    if widest > min(windows):
        raise UnsupportedCacheError(
            f"a batch of {rows} rows on a model with sliding-window attention (a window of {min(windows)} tokens): "
            "rows that accept different numbers of tokens leave masked holes, which the window counts, so the "
            f"output would differ from plain decoding once the batch is wider than the window (it can reach "
            f"{widest} columns here). Generate one row at a time, or with fewer rows or new tokens.")


class StreamerNotForwardedError(ValueError):
    """`streamer=` was given to `model.generate` with the callable `custom_generate=`: transformers puts
    the prompt into it and does not hand it to the callable, so no token and no end would follow."""


def _generate_frame():
    """transformers' generate() frame that called this call as its `custom_generate` (through its decorators
    or a function of one's own), or None: a direct call, one nested in another call's criterion or processor
    included (that generate() has no callable custom_generate, or another one)."""
    from transformers.generation.utils import GenerationMixin

    code = inspect.unwrap(GenerationMixin.generate).__code__
    frame = sys._getframe(3)
    for _ in range(16):  # generate() -> its decorators -> speculative_generate -> refuse_dropped_streamer
        if frame is None or frame.f_code is code:
            break
        frame = frame.f_back
    return frame if frame is not None and callable(frame.f_locals.get("custom_generate")) else None


def kept_streamer() -> BaseStreamer | None:
    """The `streamer=` that transformers' generate() kept from a callable `custom_generate`, having put the
    prompt into it (None where there is none, or the call is direct)."""
    frame = _generate_frame()
    return None if frame is None else frame.f_locals.get("streamer")


def refuse_dropped_streamer(spec_streamer: BaseStreamer | None, assistant=None, num_return_sequences: int = 1,
                            model=None) -> None:
    """transformers' generate() takes `streamer=` itself, puts the prompt into it and calls a callable
    `custom_generate` without it; a consumer iterating a `TextIteratorStreamer` would then wait forever.
    No public route hands the object over, so it is found in generate()'s own frame (`kept_streamer`;
    the caller ends it, and the consumer wakes up) and refused with an error naming the two forms that
    stream. An `assistant_model` consumed the same way beside another `assistant` is refused too, as is
    `synced_gpus` (asked for, or detected under ZeRO-3 / FSDP), which generate() keeps from a callable;
    and a direct call (no generate() frame) asking for `num_return_sequences > 1`, which only generate()
    expands."""
    frame = _generate_frame()
    if frame is None:
        if (num_return_sequences or 1) > 1:
            raise ValueError(f"num_return_sequences={num_return_sequences}: model.generate() repeats each prompt that "
                             "many times before its decode loop, and a direct call of speculative_generate takes "
                             "input_ids as they are; repeat the rows (input_ids.repeat_interleave(n, dim=0), and the "
                             "mask) or call model.generate()")
        return
    model = frame.f_locals.get("assistant_model")  # consumed too: two drafts given, one silently unused
    if model is not None and model is not assistant:
        raise ValueError("assistant_model= does not reach a callable custom_generate (transformers consumes it); "
                         + ("pass the draft as assistant=draft" if assistant is None else
                            "a second draft was given as assistant=: pass one draft, as assistant=draft")
                         + " (or use the directory form, which takes assistant_model=)")
    synced = frame.f_locals.get("synced_gpus")
    if synced or (synced is None and model is not None and _sharded_across_processes(model)):
        raise ValueError(_NO_SYNCED_GPUS)
    dropped = frame.f_locals.get("streamer")
    if dropped is None or dropped is spec_streamer:
        return
    raise StreamerNotForwardedError(
        "streamer= does not reach a callable custom_generate (transformers consumes it and would stream only the "
        "prompt); pass spec_streamer=your_streamer instead, or use the directory form "
        "custom_generate=hf_specdec.CUSTOM_GENERATE_DIR, trust_remote_code=True, which takes streamer=. "
        "The streamer has been ended."
    )


def _sharded_across_processes(model) -> bool:
    """What generate() turns `synced_gpus=None` into: ZeRO-3 or FSDP over more than one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from transformers.integrations import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    return bool(is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model))


OWN_ARGUMENTS = frozenset({*SETTINGS, "assistant", "acceptance_sink", "generator", "spec_streamer",
                            "speculative_config", "retrieval_cache", "candidate_generator"})


def call_defaults(model, input_ids, logits_processor, stopping_criteria, generation_config: GenerationConfig, streamer=None,
                  continuous: bool = False):
    """A direct call's arguments checked by type and None lists made empty; and the length plain generate()
    stops at: its shortest `MaxLengthCriteria` (a user's replaces the config's, transformers warns), where that
    is not max_length."""
    if not _is_model(model) or not isinstance(generation_config, GenerationConfig):
        raise ValueError(f"speculative_generate takes a transformers model and the GenerationConfig generate() prepares "
                         f"(call model.generate(..., custom_generate=hf_specdec.speculative_generate)), got "
                         f"{type(model).__name__} and {type(generation_config).__name__}")
    _check_unprepared(generation_config, logits_processor is None, stopping_criteria is None)
    logits_processor = LogitsProcessorList() if logits_processor is None else logits_processor
    stopping_criteria = StoppingCriteriaList() if stopping_criteria is None else stopping_criteria
    for name, value, kind in (("logits_processor", logits_processor, "LogitsProcessorList"),
                              ("stopping_criteria", stopping_criteria, "StoppingCriteriaList")):
        if not isinstance(value, (list, tuple)) or not all(callable(item) for item in value):
            raise ValueError(f"{name} must be a list of callables (a {kind}), got {type(value).__name__}")
    _validate_arguments(None, None, None, streamer, None, "streamer")
    length = generation_config.max_length  # as generate() prepared it: a shorter MaxLengthCriteria below is plain's too
    if not continuous and isinstance(input_ids, torch.Tensor) and isinstance(length, int) and input_ids.shape[-1] >= length:
        raise ValueError(f"the input has {input_ids.shape[-1]} tokens but max_length is {length}: nothing is left to "
                         "generate (generate() refuses it too); pass max_new_tokens")  # a token past max_length was emitted
    lengths = [c.max_length for c in stopping_criteria if isinstance(c, MaxLengthCriteria)]
    if lengths and min(lengths) != generation_config.max_length:
        generation_config = copy.copy(generation_config)
        generation_config.max_length = min(lengths)
    return logits_processor, stopping_criteria, generation_config


# Settings that generate() turns into logits processors or stopping criteria, with the value that makes none.
_PROCESSED = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
              "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None, "begin_suppress_tokens": None,
              "forced_bos_token_id": None, "forced_eos_token_id": None, "exponential_decay_length_penalty": None,
              "renormalize_logits": False, "remove_invalid_values": False, "watermarking_config": None,
              "guidance_scale": 1.0}
_WITH_EOS = {"min_length": 0, "min_new_tokens": 0}  # processors only where an eos is set
_WARPED = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
           "eta_cutoff": 0.0, "top_h": None}  # sampling only
_STOPPED = {"eos_token_id": None, "stop_strings": None, "max_time": None}


def stop_strings_as_criteria(model: PreTrainedModel, kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """`stop_strings` (given, or set in the GenerationConfig passed, else the model's) as a StopStringCriteria in
    `stopping_criteria`, built from `tokenizer=`: transformers drops `tokenizer` on its way to a callable
    custom_generate, so the callable would fail asking for the tokenizer it was given. `where`: the call to name."""
    from transformers import StopStringCriteria

    passed, default = kwargs.get("generation_config"), model.generation_config.stop_strings
    explicit = "stop_strings" in kwargs  # stop_strings=None turns the model's default off, as in plain generate()
    strings = kwargs.pop("stop_strings", None)
    if strings is None and not explicit:
        strings = getattr(passed, "stop_strings", None) or default
    if strings is not None:
        if kwargs.get("tokenizer") is None:
            raise ValueError(f"stop_strings needs the tokenizer: pass tokenizer=... to {where}")
        stop = StopStringCriteria(kwargs.pop("tokenizer"), strings)
        kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), stop])
        if getattr(passed, "stop_strings", None) is not None:
            kwargs["generation_config"] = passed = copy.deepcopy(passed)
            passed.stop_strings = None
    if explicit or (strings is not None and default is not None):  # else transformers fills a config's back in
        kwargs["stop_strings"] = None
    return kwargs


def _check_unprepared(generation_config: GenerationConfig, no_processors: bool, no_criteria: bool) -> None:
    """A direct call applies the processors and criteria it is passed, as transformers' decoding methods do:
    generate() builds them from the config. One passing none with a config that asks for some is refused (its
    temperature, top-k or EOS were ignored without a word)."""
    def asked(settings: dict) -> list[str]:
        return [name for name, neutral in settings.items()
                if getattr(generation_config, name, None) not in (None, neutral, [], (), {})]

    eos = generation_config.eos_token_id not in (None, [], ())
    unread = (asked(_PROCESSED) + asked(_WITH_EOS) * eos + asked(_WARPED) * bool(generation_config.do_sample)) * no_processors
    unread += asked(_STOPPED) * no_criteria
    if unread:
        raise ValueError(f"a direct call of speculative_generate applies the logits_processor and stopping_criteria "
                         f"it is passed, and none were passed, so {', '.join(unread)} of the GenerationConfig would "
                         "be ignored: call model.generate(..., custom_generate=hf_specdec.speculative_generate), "
                         "which builds them from the config, or pass them")


def check_arguments(kwargs: dict[str, Any]) -> SpeculativeConfig:
    """`speculative_generate`'s own arguments (by name in `kwargs`) checked by type and range, and the
    call's config: explicit settings over `speculative_config` (or the defaults). `generate_continuous`
    calls it too, before it reads its first prompt."""
    _validate_arguments(kwargs.get("assistant"), kwargs.get("acceptance_sink"), kwargs.get("generator"),
                        kwargs.get("spec_streamer"), kwargs.get("speculative_config"))
    generator = kwargs.get("candidate_generator")
    if generator is not None and not isinstance(generator, (Drafter, CandidateGenerator)):
        raise ValueError("candidate_generator must be a transformers CandidateGenerator or an hf_specdec Drafter, got "
                         f"{type(generator).__name__}" + (" (a model: pass it as assistant=)"
                                                          if isinstance(generator, torch.nn.Module) else ""))
    config = _resolve_config(kwargs.get("speculative_config"), **{k: kwargs[k] for k in SETTINGS if k in kwargs})
    cache = kwargs.get("retrieval_cache")
    if cache is not None:
        if not isinstance(cache, RetrievalCache):
            raise ValueError(f"retrieval_cache must be an hf_specdec.RetrievalCache, got {type(cache).__name__}")
        if not (config.ngram and config.adaptive):
            raise ValueError("retrieval_cache is a retrieval source, planned like in-row lookup: it needs ngram=True "
                             "and adaptive=True (the defaults)")
        if generator is not None and not isinstance(generator, Drafter):
            raise ValueError("retrieval_cache is planned beside hf_specdec's own sources; a transformers "
                             "CandidateGenerator proposes alone. Pass the draft as assistant= (or an hf_specdec Drafter) "
                             "to use the cache")
    return config


def draft_model(assistant):
    """The model a draft source runs: a PEFT model's base model, which carries its adapter layers (PEFT's
    wrapper takes no cache argument by name, and a draft's prompt-learning tokens, if any, change speed only)."""
    base = getattr(assistant, "get_base_model", None)
    return base() if type(assistant).__module__.startswith("peft.") and callable(base) else assistant


def _is_model(model) -> bool:
    """A transformers model, or a wrapper passing its attributes through (torch.compile's OptimizedModule)."""
    return isinstance(model, torch.nn.Module) and hasattr(model, "config") and hasattr(model, "generation_config")


def _takes_one(function) -> bool:
    """Whether `function` can be called with one positional argument (True where Python cannot tell)."""
    try:
        inspect.signature(function).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins)
        return True
    return True


def _validate_arguments(assistant, acceptance_sink, generator, spec_streamer, speculative_config,
                        streamer_name: str = "spec_streamer") -> None:
    """Type checks of hf_specdec's own call arguments, before any model work."""
    if assistant is not None and not (isinstance(assistant, torch.nn.Module) and hasattr(assistant, "config")
                                      and callable(getattr(assistant, "get_output_embeddings", None))):
        raise ValueError(f"assistant must be a transformers model (the draft, a PreTrainedModel with a language-model "
                         f"head), got {type(assistant).__name__}")
    if acceptance_sink is not None and not (callable(acceptance_sink) or isinstance(acceptance_sink, (str, os.PathLike))):
        raise ValueError(f"acceptance_sink must be a callable or a file path, got {type(acceptance_sink).__name__}")
    if callable(acceptance_sink) and not _takes_one(acceptance_sink):  # failed after the first round's forwards
        raise ValueError("acceptance_sink must be a callable taking one argument (a RoundRecord), as list.append does")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if spec_streamer is not None and not (callable(getattr(spec_streamer, "put", None)) and callable(getattr(spec_streamer, "end", None))):
        raise ValueError(f"{streamer_name} must be a streamer (with put() and end()), got {type(spec_streamer).__name__}")
    if speculative_config is not None and not isinstance(speculative_config, SpeculativeConfig):
        raise ValueError(f"speculative_config must be a SpeculativeConfig, got {type(speculative_config).__name__}")


def _validate_padding(mask: torch.Tensor | None, input_ids: torch.Tensor, pad_token_id: int | None = None) -> None:
    """A named error for masks this loop would misread: every row must be left-padded (zeros, then
    ones) with at least one real token; transformers only warns about right padding and returns rows
    that differ from each prompt's own."""
    if mask is None:
        return
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids {tuple(input_ids.shape)}")
    if bool(((mask != 0) & (mask != 1)).any()):  # generate() numbers positions by its running sum, this loop by its ones
        raise ValueError(f"attention_mask must hold 0 (padding) and 1 (a token) only, got values such as "
                         f"{mask[(mask != 0) & (mask != 1)][0].item()!r}")
    mask = mask.bool()
    padding_after_a_token = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1)  # a 1 followed by a 0
    empty = ~mask.any(dim=1)
    bad = (padding_after_a_token | empty).nonzero()[:, 0].tolist()
    if bad:
        row, inferred = bad[0], ""
        if bool(empty[row]):  # an empty prompt, not a padding side
            raise ValueError(f"attention_mask row {row} has no real token: an empty prompt (hf_specdec needs at least one "
                             "token a row; plain generate() would start it from nothing)")
        hole = bool(mask[row, int(mask[row].int().argmax()):].int().diff().eq(1).any())  # a 0 then a 1 again
        what = "has padding between its tokens" if hole else "has padding after its tokens (right padding)"
        alone = input_ids.shape[0] == 1  # one prompt pads nothing: a pad id at its end is more likely a real token
        if (hole or alone) and isinstance(pad_token_id, int) and torch.equal(mask[row], input_ids[row] != pad_token_id):
            inferred = (f" The mask marks every token {pad_token_id} (pad_token_id) as padding, as transformers infers "
                        "one when none is passed: if they are real tokens (a generated one), pass "
                        "attention_mask=torch.ones_like(input_ids).")
        raise ValueError(
            f"attention_mask row {row} {what}: hf_specdec needs left-padded batches (zeros, then the prompt), "
            "as transformers' decoder-only generation does; set tokenizer.padding_side = 'left'"
            + (f" ({len(bad)} rows affected)" if len(bad) > 1 else "") + ("." if inferred else "") + inferred
        )


def _validate_positions(positions: torch.Tensor | None, mask: torch.Tensor | None, input_ids: torch.Tensor) -> None:
    """generate() always passes position_ids, derived from the mask; the loop derives them the same way
    at every forward. Positions of the user's own (a model that reads them, GPT-2, would use them in
    plain decoding) would be dropped: refused."""
    if not isinstance(positions, torch.Tensor) or positions.shape != input_ids.shape:
        return
    real = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    derived = (real.long().cumsum(-1) - 1).clamp(min=0)
    if not torch.equal(positions.to(derived.device)[real], derived[real]):
        raise ValueError("position_ids other than those the attention mask gives (0, 1, 2, ... from each row's first "
                         "real token): hf_specdec derives positions from the mask at every forward, as generate() "
                         "does by default, and would drop these. Generate without position_ids.")


# What generate() puts in model_kwargs for a text prompt, all of which the loop handles itself:
# the mask, the cache, and settings it derives anew for every forward (positions from the mask).
_HANDLED_MODEL_INPUTS = frozenset({
    "attention_mask", "cache", "past_key_values", "use_cache", "logits_to_keep", "position_ids", "cache_position",
    "output_attentions", "output_hidden_states", "return_dict",
})


# Settings of earlier versions: named with what replaced them, not mistaken for model inputs.
REMOVED_SETTINGS = {
    **{name: "pin prices with costs=hf_specdec.Costs(draft_step=..., verify=..., draft_prefill=...)"
       for name in ("draft_cost", "verify_cost", "verify_knee_cost", "verify_curve", "draft_prefill_cost", "price_by_width")},
    **{name: "the planner has no such lever any more (docs/design.md)"
       for name in ("prefill_patience", "ngram_depths", "ngram_max_tokens", "ngram_match_cap", "tree_max_branches")},
    "ngram_max_size": "lookups match up to hf_specdec.config.NGRAM_MAX_SIZE (3) tokens; 2 instead changed nothing",
    "draft_vocab_size": "the reduced-vocabulary draft head was removed (1.01x, 1.02x and 0.98x of the full head at batch 1, 2 and 4: within noise)",
    "draft_temperature": "the draft is warped exactly like the target (a setting off by default, never measured to pay); "
                         "a differently warped draft can be passed as candidate_generator=hf_specdec.DraftModelDrafter(...)",
}


def _validate_model_inputs(model_kwargs: dict[str, Any]) -> None:
    """Clear errors for forward inputs the loop would otherwise drop (plain generate() passes them to
    every forward, so dropping them would silently change the output)."""
    for name in model_kwargs:
        if name in REMOVED_SETTINGS:
            raise ValueError(f"{name} is no longer an hf_specdec setting: {REMOVED_SETTINGS[name]}")
    if model_kwargs.get("past_key_values") is not None:  # a direct call's name for it (generate() says `cache`)
        if model_kwargs.get("cache") is not None:
            raise ValueError("got both cache= and past_key_values=: pass the key-value cache once")
        model_kwargs["cache"] = model_kwargs.pop("past_key_values")  # the one the loop fills, as generate() would
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("hf_specdec starts from input_ids (both models read the same token ids); "
                         "inputs_embeds is not supported: pass the prompt as input_ids.")
    # None, or nothing in it: transformers passes multimodal models an empty mm_encoder_outputs for text alone
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and not (isinstance(v, (dict, list, tuple)) and not v)
                   and k not in _HANDLED_MODEL_INPUTS)
    extra = [f"{k} (images or other media, which transformers encoded before the call)" if k == "mm_encoder_outputs"
             else f"{k} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, OWN_ARGUMENTS, 1, 0.85))
             else k for k in extra]  # a direct call's typo reaches here (generate() names it first)
    if extra:
        raise ValueError(
            f"hf_specdec feeds both models token ids and an attention mask only; got {', '.join(extra)}, which plain "
            "generate() would pass to every forward and hf_specdec would drop. Generate without them, or with "
            "plain generate()."
        )


def _validate_drafter(model: PreTrainedModel, candidate_generator, rows: int, what: str) -> None:
    """A candidate_generator's rows, and the draft model inside one of ours, checked as `assistant=` is."""
    _validate_rows(candidate_generator, rows, what)
    inner = inner_drafter(candidate_generator)  # ours, wrapped or not; else a Drafter of one's own with a model
    draft = inner.model if inner is not None else getattr(candidate_generator, "model", None)
    if (inner is not None or isinstance(candidate_generator, Drafter)) and isinstance(draft, PreTrainedModel):
        _validate_assistant(model, draft)
        _validate_layers(draft, "draft model (in the candidate_generator)")


def _validate_rows(candidate_generator, rows: int, what: str) -> None:
    """A candidate_generator asked for more rows than it proposes for (a transformers one: 1)."""
    most = candidate_generator.max_rows if isinstance(candidate_generator, Drafter) else 1
    if most is not None and (isinstance(most, bool) or not isinstance(most, numbers.Integral) or most < 1):
        raise ValueError(f"the candidate_generator ({type(candidate_generator).__name__}).max_rows must be a positive "
                         f"integer or None (any batch), got {most!r}")
    if candidate_generator is not None and most is not None and rows > most:
        raise ValueError(f"the candidate_generator ({type(candidate_generator).__name__}) proposes for {most} row at a "
                         f"time; {what}")


def check_embeddings(model: PreTrainedModel, who: str = "target") -> None:
    """The accessors hf_specdec reads the vocabulary through (plain generate() needs neither): a target's
    input embedding and head, a draft's head."""
    try:
        head = model.get_output_embeddings()
        embeddings = model.get_input_embeddings() if who == "target" else head
    except NotImplementedError as error:  # transformers' default for a model of one's own
        raise ValueError(f"the {who} ({type(model).__name__}) has no get_input_embeddings() ({error}): hf_specdec reads "
                         "the vocabulary through get_input_embeddings() and get_output_embeddings(); define both, as "
                         "transformers' causal LMs do") from None
    if getattr(head, "weight", None) is None or getattr(embeddings, "weight", None) is None:
        raise ValueError(f"the {who} ({type(model).__name__}) has no language-model head that get_output_embeddings() "
                         "returns (or no input embedding): hf_specdec reads the vocabulary from its rows. Load it with "
                         "AutoModelForCausalLM, not AutoModel; a model of one's own defines both accessors")


def _validate_ids(model: PreTrainedModel, input_ids: torch.Tensor) -> None:
    """Ids the target cannot embed, named before anything (a retrieval cache included) keeps them: plain
    generate() fails inside the embedding, and a cache holding the prompt would refuse every later call."""
    check_embeddings(model)
    rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if isinstance(rows, int) and input_ids.numel():
        low, high = torch.stack([input_ids.min(), input_ids.max()]).tolist()  # one read, once a call
        if low < 0 or high >= rows:
            raise ValueError(f"input_ids hold token id {low if low < 0 else high}, outside the target's {rows} "
                             "embeddings: was the prompt tokenized for another model?")


def _validate_rope(config, shape: tuple[int, int], max_length: int, continuous: bool) -> None:
    """Rotary frequencies that transformers picks by the longest position a forward covers: "dynamic" NTK
    grows them at every new length past the original context, "longrope" switches to its long factors
    once a forward passes it. A verify forward covers positions ahead of plain decoding's one-token step
    (a stream's forward, other prompts' too), so past that point the frequencies change earlier."""
    config = text_config(config)
    params = getattr(config, "rope_parameters", None) or {}
    nested = isinstance(params, dict) and params and all(isinstance(v, dict) or v is None for v in params.values())
    for group in [g for g in (params.values() if nested else [params]) if isinstance(g, dict)]:
        kind = str(group.get("rope_type", group.get("type", "")))
        if "dynamic" not in kind and kind != "longrope":
            continue
        limits = [group.get("original_max_position_embeddings"), getattr(config, "max_position_embeddings", None),
                  getattr(config, "original_max_position_embeddings", None)]
        limit = min([int(v) for v in limits if isinstance(v, numbers.Real) and not isinstance(v, bool)], default=0)
        # longrope is one set of factors throughout once a lone row's prompt is past the original context (in a
        # batch, rows that finish leave, and the others' positions may fall back under it)
        # the last token is never fed: forwards cover positions up to max_length - 2, as plain's do
        if continuous or (max_length - 1 > limit and (kind != "longrope" or shape[1] <= limit or shape[0] > 1)):
            reach = "a stream mixes prompts at other positions in each forward" if continuous else (
                f"this call may reach {max_length} (max_length)")
            raise ValueError(
                f"the target's rotary embedding is {kind!r}: transformers chooses its frequencies by the longest "
                f"position each forward covers, and they change past {limit} positions. Verifying several tokens "
                f"reaches a position before plain decoding does, so past {limit} the output would differ from "
                f"plain decoding; {reach}. Generate up to {limit + 1} tokens in all (prompt included) one call at a "
                "time, or use plain generate().")


def _validate_same_function(model: PreTrainedModel, rows_change: bool) -> None:
    """A target whose forwards here compute another function than plain decoding's: one-token steps and wider
    forwards that differ (int8 copies for small inputs, `pack_linears(decode_bits=8)`), inputs injected where
    plain generate() prepares them, adapters bound to the batch's first rows (`_validate_peft`)."""
    from .cpu import PackedLinear

    own = vars(model).get("prepare_inputs_for_generation")  # PEFT prompt learning sets one; its restore, the class's
    if own is not None and getattr(own, "__func__", None) is not getattr(type(model), "prepare_inputs_for_generation", None):
        raise ValueError(f"the target's prepare_inputs_for_generation is replaced on the model ({getattr(own, '__qualname__', own)}"
                         "; PEFT prompt tuning, p-tuning and prefix tuning add their virtual tokens there): hf_specdec "
                         "calls the model's forward with token ids, so that would be skipped and the output would differ "
                         "from plain generate(). Merge the adapter into the model, or use plain generate()")
    _validate_peft(model, rows_change)
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        cast = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32})
        if cast:  # .half() after pack_linears: the packed layers compute in float32, the rest in another dtype
            raise ValueError(f"the target is packed (pack_linears, which computes in float32) but has weights in "
                             f"{', '.join(cast)}: it was cast after packing. Cast it before packing, or not at all")
    if any(isinstance(m, PackedLinear) and m.decode is not None for m in model.modules()):
        raise ValueError("the target's packed layers carry int8 copies for one-token steps (pack_linears(decode_bits=8)), "
                         "so its one-token steps and its forwards over several tokens compute different functions and "
                         "verification would not reproduce plain decoding: pack the target without decode_bits "
                         "(decode copies are for drafts), or pass hf_specdec.cpu.without_decode_copies(target)")


def _validate_cast_together(owner: PreTrainedModel, draft: PreTrainedModel) -> None:
    """An early-exit draft cast on its own (.half()) cast the layers it shares with its model: the model's
    weights it shares and those it does not then have no dtype in common (a raw dtype error in a forward)."""
    shared = {id(p) for p in draft.parameters()}
    dtypes = {True: set(), False: set()}  # shared with the draft or not -> floating dtypes
    for p in owner.parameters():
        if p.is_floating_point():
            dtypes[id(p) in shared].add(p.dtype)
    if dtypes[True] and dtypes[False] and not dtypes[True] & dtypes[False]:
        found = " and ".join(sorted(str(d) for d in dtypes[True] | dtypes[False]))
        raise ValueError(f"the early-exit draft's model now has weights in {found}: an early-exit draft shares its "
                         "layers with its model, so casting the draft (.half(), .to(dtype)) cast that part of the "
                         "target too. Cast the target, then make the draft (hf_specdec.early_exit_draft)")


# PEFT's forward pre-hooks, by function name (peft 0.21: tuners/lora, glora, road, shadow): per call, an adapter per
# row and aLoRA's offsets (LoRA's context manager leaves them on the model when the call inside it raises); for good,
# ShadowPEFT's, which threads a cache of its own (ShadowCache) through past_key_values
_PER_CALL = ("_adapter_names_pre_forward_hook", "_alora_offsets_pre_forward_hook")
_ALWAYS = {"_alora_offsets_pre_forward_hook": "an aLoRA adapter, which applies to the last positions of each forward "
                                              "(alora_offsets): a verify forward over several tokens would leave some without it",
           "_seed_shadow_pre_hook": "a ShadowPEFT adapter, which keeps a cache of its own beside the model's (ShadowCache) "
                                    "that hf_specdec cannot roll back"}


def _validate_peft(model: PreTrainedModel, rows_change: bool) -> None:
    """PEFT adapters that bind to a call's rows or positions, or keep a cache of their own, found by their hooks."""
    hooks = [(m, key, getattr(getattr(hook, "func", hook), "__name__", ""), getattr(getattr(hook, "func", hook), "__module__", ""))
             for m in model.modules() for key, hook in m._forward_pre_hooks.items()]
    always = next((_ALWAYS[name] for _, _, name, _ in hooks if name in _ALWAYS), None)
    per_row = next((module for _, _, name, module in hooks if rows_change and (  # Poly's task_ids hook: a name of no kind
        name in _PER_CALL or (module.startswith("peft.") and name not in _ALWAYS))), None)
    if always is None and per_row is None:
        return
    for m, key, name, _ in hooks:  # removed as PEFT removes them when its call returns (not a refused call's)
        if name in _PER_CALL:
            for where in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_pre_hooks_always_called"):
                getattr(m, where, {}).pop(key, None)  # (the last made only once a hook asks for it)
    if always is not None:
        raise ValueError(f"the target runs {always}. Use plain generate()")
    raise ValueError(f"the target runs PEFT adapters per row or per call (hooks of {per_row}: adapter_names=, Poly's "
                     "task_ids=, X-LoRA): PEFT fixes them to the batch's rows when the call starts, and hf_specdec's "
                     "batches lose rows as they finish (and gain them when continuous). Generate each adapter's rows in "
                     "a call of their own, without adapter_names, or one row at a time")


def padding_rows(target_vocab: int, draft_vocab: int) -> bool:
    """Whether two vocabulary sizes differ by embedding padding only, as one tokenizer's models do in some
    families (Qwen2.5-0.5B and 7B: 151,936 and 152,064 rows; the Pythia sizes: 50,304 to 50,688): by at most
    1% of the larger. Tokenizers that grew (Mistral's 32,000 to 32,768) differ by more. Exactness never
    depends on it; the rule only catches a draft loaded by mistake."""
    return abs(target_vocab - draft_vocab) <= max(target_vocab, draft_vocab) // 100


def _validate_assistant(model: PreTrainedModel, assistant: PreTrainedModel) -> None:
    if assistant.config.is_encoder_decoder:
        raise ValueError("the draft model (assistant) must be decoder-only.")
    check_embeddings(assistant, "draft model (assistant)")
    owner = getattr(assistant, "shares_weights_with", None)  # an early-exit draft: are its layers still its model's?
    if owner is not None and not {id(m) for m in assistant.modules() if next(m.children(), None) is None} <= {
            id(m) for m in owner.modules()}:
        raise ValueError("the early-exit draft holds layers its model no longer has: it was made before that model's "
                         "layers were replaced (pack_linears, quantize_weights); call hf_specdec.early_exit_draft after")
    if owner is not None:
        _validate_cast_together(owner, assistant)
    target_vocab = model.get_output_embeddings().weight.shape[0]
    draft_vocab = assistant.get_output_embeddings().weight.shape[0]
    if target_vocab != draft_vocab and not padding_rows(target_vocab, draft_vocab):
        raise ValueError(
            f"vocabulary mismatch: the target scores {target_vocab} tokens but the draft scores {draft_vocab}. "
            "Speculative decoding needs a draft that shares the target's tokenizer and vocabulary (sizes that differ "
            "by at most 1%, as embedding padding does in some model families, are taken as the same vocabulary)."
        )
    if assistant.device.type == "meta" and not any(hasattr(m, "_hf_hook") for m in assistant.modules()):
        raise ValueError("the draft's weights are on meta and nothing will load them (no accelerate offloading hooks): "
                         "it was made under init_empty_weights or moved with .to('meta'); load its weights")
    # an accelerate-offloaded model reports meta (its weights wait elsewhere) and computes where its hooks say
    if assistant.device != model.device and "meta" not in (assistant.device.type, model.device.type):
        raise ValueError(f"the draft is on {assistant.device} but the target is on {model.device}; move them together.")
