"""Directory form of hf_specdec for `model.generate(custom_generate=<path>, trust_remote_code=True)`.

transformers loads this file from `hf_specdec.CUSTOM_GENERATE_DIR` and calls `generate(model=..., **all
generate() arguments)`, so the standard names work here: `assistant_model=draft`, `streamer=...`.
It re-enters `model.generate` with the callable form, which does all of generate()'s preparation.
"""

import torch
from transformers.generation.streamers import BaseStreamer

import hf_specdec
from hf_specdec.arguments import stop_strings_as_criteria


def generate(model, assistant_model=None, streamer=None, **kwargs):
    once = None if streamer is None else _EndOnce(streamer)
    try:  # any failure, transformers' own checks before the callable runs included, ends the streamer (once)
        kwargs = _arguments(model, assistant_model, once, kwargs)
        return model.generate(custom_generate=hf_specdec.speculative_generate, **kwargs)
    except BaseException:
        if once is not None:
            try:
                once.end()
            except Exception:
                pass
        raise


class _EndOnce(BaseStreamer):
    """The user's streamer, ended at most once (the callable form ends it too when it fails)."""

    def __init__(self, streamer):
        self.streamer, self.ended = streamer, False

    def put(self, value):
        self.streamer.put(value)

    def end(self):
        if not self.ended:
            self.ended = True
            self.streamer.end()


def _arguments(model, assistant_model, streamer, kwargs):
    """The callable form's arguments: the draft and streamer under its names, stop strings and token healing
    done here with the tokenizer (transformers drops it on the way to a callable)."""
    kwargs.pop("custom_generate", None)
    kwargs.pop("trust_remote_code", None)
    for name, mine, theirs in (("assistant", "assistant_model", assistant_model), ("spec_streamer", "streamer", streamer)):
        if theirs is not None and kwargs.get(name) is not None and kwargs[name] is not getattr(theirs, "streamer", theirs):
            if name == "spec_streamer":  # refused before decoding: neither consumer may wait (generate ends the other)
                try:
                    kwargs[name].end()
                except Exception:
                    pass  # the refusal is the error to report
            raise ValueError(f"both {mine}= and {name}= were given: the directory form takes {mine}=; pass one")
        if theirs is not None:
            kwargs[name] = theirs
    if kwargs.get("assistant_tokenizer") is not None:  # the callable form never sees it: transformers drops it
        raise ValueError("assistant_tokenizer= asks for transformers' universal assisted decoding, for a draft with "
                         "another tokenizer; hf_specdec needs a draft that shares the target's vocabulary (drop it "
                         "if the draft does)")
    if kwargs.get("cache_implementation") == "paged":  # generate() would run its own continuous batching instead
        raise ValueError("cache_implementation='paged' is transformers' continuous batching, which would run instead of "
                         "hf_specdec (without the draft); hf_specdec supports DynamicCache only: for many prompts use "
                         "hf_specdec.generate_continuous")
    passed = kwargs.get("generation_config")
    if kwargs.get("token_healing", getattr(passed or model.generation_config, "token_healing", False)):
        _heal(model, kwargs)
    return stop_strings_as_criteria(model, kwargs, "generate()")


def _heal(model, kwargs):
    """Token healing as plain generate() does it (`model.heal_tokens`, before decoding): transformers drops
    `tokenizer` on the way to a callable, which would then fail asking for the tokenizer it was given."""
    if kwargs.get("tokenizer") is None:
        raise ValueError("token_healing needs the tokenizer: pass tokenizer=... to generate()")
    key = "inputs" if kwargs.get("inputs") is not None else "input_ids"
    ids = kwargs[key]
    mask = kwargs.get("attention_mask")
    mask = _inferred_mask(model, kwargs, ids) if mask is None else mask
    kwargs[key] = healed = model.heal_tokens(ids, kwargs["tokenizer"])
    kwargs["token_healing"] = False
    # plain generate() takes the mask from the ids before healing: a BOS healed into the pad id stays attended
    # (inferred from the healed ids, it would read as left padding); all ones, it is dropped, whatever the length
    kwargs["attention_mask"] = torch.ones_like(healed) if bool(mask.all()) else mask


def _inferred_mask(model, kwargs, ids):
    """The attention mask generate() infers from the ids: padding where the pad id (not an EOS id) occurs."""
    def setting(name):  # as generate() resolves it: keyword, else the config passed, else the model's
        if name in kwargs:
            return kwargs[name]
        passed = getattr(kwargs.get("generation_config"), name, None)
        return passed if passed is not None else getattr(model.generation_config, name, None)

    pad, eos = setting("pad_token_id"), setting("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else [int(e) for e in eos]
    if pad is None or pad in eos or not bool((ids == pad).any()):  # no pad id: generate() uses EOS's, so no inference
        return torch.ones_like(ids)
    return ids.ne(pad).long()
