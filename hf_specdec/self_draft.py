"""Self-speculation: a draft made from the target's own first layers (early exit), no second model.

`early_exit_draft(target, num_layers)` returns a causal LM of the target's class whose decoder runs
only the target's first `num_layers` layers, then the target's own final norm and output head. Every
module is the target's (no weight is copied: the draft costs no memory beyond its KV cache), so it
is passed like any draft: `target.generate(..., custom_generate=..., assistant=early_exit_draft(target, 14))`.

Exact like any draft: q is whatever the early exit computed, verified against the full target's p.
Only speed depends on how well the early exit imitates the full stack; without early-exit training
(LayerSkip) intermediate layers read through the final head are weak predictors, and a draft that
runs L of N layers costs about L / N of a target step. `evals/self_spec.py` measures both on the
real pair.

Its cache is its own: the kept layers' keys and values for accepted tokens equal the target's first
layers' (same weights, same inputs), but the target's cache is not shared with it, so the draft
encodes the prompt itself (`draft_window` bounds that) and holds L / N of the target's cache memory.
It shares weights with the target, so it must not be quantized in place (`quantize_weights` refuses
it: that would quantize the target's layers too).
"""

from __future__ import annotations

import copy

from torch import nn
from transformers import PreTrainedModel

from .arguments import draft_model
from .config import as_int


def decoder_layers(model: PreTrainedModel) -> tuple[nn.Module, str, nn.ModuleList]:
    """(base model, path, layers): the ModuleList of the model's decoder layers, found as the base
    model's shallowest ModuleList with `config.num_hidden_layers` entries, and its dotted path there
    (`layers` in Llama and Qwen2, `h` in GPT-2, `decoder.layers` in OPT, a level further down)."""
    base = model.base_model
    count = model.config.num_hidden_layers
    found = [(name, module) for name, module in base.named_modules()
             if name and isinstance(module, nn.ModuleList) and len(module) == count]
    depth = min((name.count(".") for name, _ in found), default=0)
    shallowest = [(name, module) for name, module in found if name.count(".") == depth]
    if len(shallowest) != 1:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__}: expected one ModuleList of "
            f"config.num_hidden_layers={count} modules in its base model, found {[name for name, _ in found]}"
        )
    return base, shallowest[0][0], shallowest[0][1]


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` holding the same child modules, parameters and buffers, with containers of
    its own: changing the copy's children, or registering a hook on either one, leaves the other alone
    (copy.copy alone would share the `_modules` and hook dictionaries)."""
    if "forward" in vars(module) or hasattr(module, "_hf_hook"):  # bound to `module`: the copy would run it whole
        how = ("accelerate's dispatch hooks (a device_map that offloads)" if hasattr(module, "_hf_hook")
               else "a forward set on the instance (e.g. model.forward = torch.compile(model.forward))")
        raise ValueError(f"early_exit_draft cannot share this model's {type(module).__name__}: it has {how}, which its "
                         "copy would keep, so the draft would run every layer. Make the draft from a model without "
                         "them (loaded on one device; compile the draft itself afterwards)")
    out = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, dict):
            out.__dict__[key] = copy.copy(value)
    return out


def early_exit_draft(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A draft that runs the first `num_layers` decoder layers of `model`, then its final norm and
    output head, sharing every weight with `model` (which is left unchanged). A PEFT model: its base model's."""
    model = draft_model(model)
    if not isinstance(model, PreTrainedModel) or model.get_output_embeddings() is None:
        raise ValueError(f"early_exit_draft takes a transformers causal LM (with its output head: load it with "
                         f"AutoModelForCausalLM), got {type(model).__name__}")
    base, name, layers = decoder_layers(model)
    num_layers = as_int(num_layers)  # a numpy or torch integer (a sweep's value)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be an integer from 1 to {len(layers)} (the target's layers), got {num_layers!r}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:num_layers])
    draft_base = _shallow_copy(base)
    draft_base.config = config
    parent, *inner, last = [draft_base, *name.split(".")]
    for part in inner:  # a module between the base and its layers (OPT's decoder): a copy of its own
        child = _shallow_copy(parent._modules[part])
        if getattr(child, "config", None) is model.config:  # it sizes the cache from its config's layer count
            child.config = config
        parent._modules[part], parent = child, child
    parent._modules[last] = nn.ModuleList(layers[:num_layers])
    if base is model:
        draft = draft_base
    else:
        draft = _shallow_copy(model)
        draft._modules[model.base_model_prefix] = draft_base
        draft.config = config
    draft.generation_config = copy.deepcopy(model.generation_config)
    # A plain attribute, not a submodule (nn.Module would register the target as the draft's child).
    object.__setattr__(draft, "shares_weights_with", model)
    return draft
