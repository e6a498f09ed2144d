"""Directory form of hf_specdec for `model.generate(custom_generate=<path>, trust_remote_code=True)`.

transformers loads this file from `hf_specdec.CUSTOM_GENERATE_DIR` and calls `generate(model=..., **all
generate() arguments)`, so the standard names work here: `assistant_model=draft`, `streamer=...`.
It re-enters `model.generate` with the callable form, which does all of generate()'s preparation.
"""

import hf_specdec


def generate(model, assistant_model=None, streamer=None, **kwargs):
    kwargs.pop("custom_generate", None)
    kwargs.pop("trust_remote_code", None)
    if assistant_model is not None:
        kwargs.setdefault("assistant", assistant_model)
    if streamer is not None:
        kwargs.setdefault("spec_streamer", streamer)
    if kwargs.get("stop_strings") is not None:  # transformers drops `tokenizer` on the way to a callable
        from transformers import StoppingCriteriaList, StopStringCriteria

        if kwargs.get("tokenizer") is None:
            raise ValueError("stop_strings needs the tokenizer: pass tokenizer=... to generate()")
        stop = StopStringCriteria(kwargs.pop("tokenizer"), kwargs.pop("stop_strings"))
        kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), stop])
    return model.generate(custom_generate=hf_specdec.speculative_generate, **kwargs)
