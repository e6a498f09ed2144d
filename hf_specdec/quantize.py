"""Weight-only int8 / int4 quantization of a (draft) model's nn.Linear layers, for CPU decoding.

`quantize_weights(model, bits)` swaps every `torch.nn.Linear` (exact type, see below) for a
`WeightOnlyLinear` that stores integer weights and computes in the activation dtype with torch's
own CPU kernels (aten ops; nothing in transformers is patched):

* bits=8: symmetric per-output-channel int8, `scale[n] = max|w[n, :]| / 127`, through
  `torch._weight_int8pack_mm(x: [M, K], w: int8 [N, K], scales: [N]) -> [M, N]`.
* bits=4: asymmetric per-group int4 (group of `group_size` input features, min/max range), packed
  with `torch._convert_weight_to_int4pack_for_cpu(q: int32 [N, K] in 0..15, innerKTiles) -> uint8 [N, K/2]`
  and computed by `torch._weight_int4pack_mm_for_cpu(x: [M, K], packed, group_size,
  scale_and_zero: [K/group_size, N, 2]) -> [M, N]`, where the kernel dequantises
  `w = (q - 8) * scale + zero` (the gpt-fast / torchao convention).
* bits=16: the model is returned unchanged.

Kernel constraints found on torch 2.13 (CPU build), checked here before packing so that the error
names the layer instead of coming from inside aten:
* scales (int8) and scale_and_zero (int4) must have the same dtype as the input (bf16 input with fp32
  scales fails with "expected scalar type BFloat16 but found Float"). They are stored in the
  layer's original weight dtype and cast to the input's dtype in `forward` if the two ever differ.
  bf16, fp16 and fp32 inputs all work.
* int4: out_features must be a multiple of 16, in_features a multiple of `group_size`, and
  `group_size` one of 32, 64, 128, 256; the input must be contiguous (it is made so).
* The int4 packed layout is the CPU kernel's own (it may depend on the CPU's instruction set):
  do not save packed weights and load them on another machine; quantize after loading instead.

Scales (and int4 zeros) are rounded to their storage dtype *before* the integer weights are computed
from them, so the rounding of bf16 scales is not added on top of the integer rounding.

Output head. A tied head (`model.get_output_embeddings().weight` is the input embedding's weight,
as in the hub's Qwen2.5-0.5B; the copy `pair.load_model` builds from the GGUF is untied) is kept
as is by default: replacing it would either untie the pair or force the embedding lookup to go
through quantized weights. With `include_lm_head=True` the head is quantized
from an untied copy of that weight: the embedding keeps its bf16 weight, the head gets its own
integer copy (extra memory: vocab x hidden bytes for int8, half that for int4), and
`config.tie_word_embeddings` is set to False so that a later `model.tie_weights()` does not try to
re-tie them. An untied head is an ordinary Linear and is quantized like the others unless it is
named in `skip`.

Only modules whose type is exactly `torch.nn.Linear` are replaced: subclasses may use their weight
outside `forward` (e.g. nn.MultiheadAttention's out_proj), and GPT-2's Conv1D is not a Linear.
`WeightOnlyLinear.weight` is a shape-only meta tensor, so code that reads
`model.get_output_embeddings().weight.shape` (as this package does for the vocabulary size) keeps
working; use `dequantize()` for values.
"""

from __future__ import annotations

import functools
import logging
import numbers

import torch
from torch import nn

logger = logging.getLogger(__name__)

SUPPORTED_BITS = (4, 8, 16)
INT8_KERNEL_MAX_ROWS = 32  # above this many input rows, int8 layers dequantise and run the dense GEMM
INT4_GROUP_SIZES = (32, 64, 128, 256)

_INT8_OPS = ("_weight_int8pack_mm",)
_INT4_OPS = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")


def _has_op(name: str) -> bool:
    return hasattr(torch, name) and hasattr(torch.ops.aten, name)


@functools.cache
def _kernel_problem(bits: int) -> str | None:
    """None if the kernels for `bits` exist and run on this build, else why not."""
    names = _INT8_OPS if bits == 8 else _INT4_OPS
    missing = [name for name in names if not _has_op(name)]
    if missing:
        return f"int{bits} weight-only needs torch.{' and torch.'.join(missing)}, not in this torch build ({torch.__version__})"
    try:  # present is not always usable (e.g. an op compiled only for another device): try a tiny one
        x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # not the user's RNG
        if bits == 8:
            torch._weight_int8pack_mm(x, torch.ones(16, 64, dtype=torch.int8), torch.ones(16, dtype=torch.bfloat16))
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(torch.full((16, 64), 8, dtype=torch.int32), 1)
            torch._weight_int4pack_mm_for_cpu(x, packed, 32, torch.zeros(2, 16, 2, dtype=torch.bfloat16))
    except (RuntimeError, NotImplementedError) as error:
        return f"int{bits} weight-only kernels of this torch build ({torch.__version__}) fail on CPU: {error}"
    return None


class WeightOnlyLinear(nn.Module):
    """A Linear with int8 (per-output-channel) or int4 (grouped) weights; computes in the input dtype.

    Build with `WeightOnlyLinear.from_linear(linear, bits, group_size)` or `from_weight(...)`.
    Buffers: int8 -> `qweight` int8 [out, in], `scales` [out]; int4 -> `qweight` uint8 [out, in/2]
    (the CPU kernel's packed layout), `scale_and_zero` [in/group_size, out, 2]; plus `bias` if any.
    """

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.compute_dtype = bits, group_size, dtype
        self.register_buffer("bias", None)

    @property
    def weight(self) -> torch.Tensor:
        """Shape and dtype of the original weight, no data (a meta tensor). See `dequantize()`."""
        return torch.empty(self.out_features, self.in_features, dtype=self.compute_dtype, device="meta")

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int = 128, name: str = "") -> WeightOnlyLinear:
        return cls.from_weight(linear.weight, linear.bias, bits, group_size, name)

    @classmethod
    @torch.no_grad()
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, bits: int, group_size: int = 128, name: str = ""
    ) -> WeightOnlyLinear:
        out_features, in_features = weight.shape
        dtype, device = weight.dtype, weight.device
        _check_shape(name or "layer", out_features, in_features, bits, group_size)
        layer = cls(in_features, out_features, bits, group_size, dtype)
        w = weight.detach().float()
        if bits == 8:
            scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).to(dtype)  # rounded to storage dtype first
            q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
            layer.register_buffer("qweight", q.to(device))
            layer.register_buffer("scales", scales.to(device))
        elif bits == 4:
            groups = w.reshape(out_features, in_features // group_size, group_size)
            low, high = groups.amin(dim=-1), groups.amax(dim=-1)
            scales = ((high - low) / 15).clamp_min(1e-6).to(dtype)
            zeros = (low + 8 * scales.float()).to(dtype)  # the kernel computes (q - 8) * scale + zero
            q = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None] + 8).clamp_(0, 15)
            q = q.to(torch.int32).reshape(out_features, in_features)
            # innerKTiles matters to the CUDA layout only; the CPU packing gives the same result for 1..8.
            layer.register_buffer("qweight", torch._convert_weight_to_int4pack_for_cpu(q.to(device), 1))
            scale_and_zero = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # [K/G, N, 2]
            layer.register_buffer("scale_and_zero", scale_and_zero.to(device))
        else:
            raise ValueError(f"WeightOnlyLinear supports bits=8 or bits=4, got bits={bits!r}")
        if bias is not None:
            layer.bias = bias.detach().clone()
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()  # [batch, seq, in] -> [batch*seq, in]
        if self.bits == 8:
            scales = self.scales if self.scales.dtype == x.dtype else self.scales.to(x.dtype)
            if x2.shape[0] > INT8_KERNEL_MAX_ROWS:
                # The int8 kernel is a decode (matrix-vector) kernel: a 1,000-token prefill through it
                # took 5.5 s for the 0.5B draft on 2 cores. Many rows: dequantise and use the GEMM.
                out = torch.nn.functional.linear(x2, self.qweight.to(x.dtype) * scales[:, None])
            else:
                out = torch._weight_int8pack_mm(x2, self.qweight, scales)
        else:
            sz = self.scale_and_zero if self.scale_and_zero.dtype == x.dtype else self.scale_and_zero.to(x.dtype)
            out = torch._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, sz)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    @torch.no_grad()
    def dequantize(self) -> torch.Tensor:
        """The weight the kernel effectively uses, [out, in], in the compute dtype (for tests and debugging)."""
        if self.bits == 8:
            return (self.qweight.float() * self.scales.float()[:, None]).to(self.compute_dtype)
        # The packed layout is the kernel's own: read the weight back by multiplying the identity.
        eye = torch.eye(self.in_features, dtype=self.compute_dtype, device=self.qweight.device)
        return torch._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, self.scale_and_zero).T.contiguous()

    def extra_repr(self) -> str:
        detail = "per-channel" if self.bits == 8 else f"group_size={self.group_size}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"int{self.bits} {detail}, compute_dtype={self.compute_dtype}"
        )


def _check_group_size(group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES} (the CPU kernel's), got {group_size!r}")


def _check_shape(name: str, out_features: int, in_features: int, bits: int, group_size: int) -> None:
    if bits != 4:
        return
    _check_group_size(group_size)
    if in_features % group_size:
        raise ValueError(
            f"{name}: in_features={in_features} is not a multiple of group_size={group_size}; "
            f"choose another group_size or put {name!r} in skip"
        )
    if out_features % 16:
        raise ValueError(
            f"{name}: out_features={out_features} is not a multiple of 16, which the int4 CPU kernel needs; "
            f"put {name!r} in skip"
        )


def _tied_head(model: nn.Module) -> tuple[str | None, nn.Module | None]:
    """(qualified name, module) of the output head if it shares its weight with the input embedding."""
    get_out, get_in = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    if get_out is None or get_in is None:
        return None, None
    head, embedding = get_out(), get_in()
    if head is None or embedding is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        return None, None
    w, e = head.weight, embedding.weight
    if not (w is e or (w.device == e.device and w.data_ptr() == e.data_ptr() and w.shape == e.shape)):
        return None, None
    name = next((n for n, m in model.named_modules() if m is head), None)
    return name, head


def _untie_config(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if config is None:
        return
    from .arguments import text_config

    for c in (config, text_config(config)):
        if getattr(c, "tie_word_embeddings", False):
            c.tie_word_embeddings = False


@torch.no_grad()
def _check_arguments(model: nn.Module, bits: int) -> None:
    """quantize_weights' model and bits: a ValueError naming what is wrong (a model quantized or packed
    already would be left as it is)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"quantize_weights takes a torch model (an nn.Module), got {type(model).__name__}")
    if type(model) is nn.Linear:  # it cannot replace itself: it stayed float under a child named ''
        raise ValueError("quantize_weights replaces the Linear layers inside a model, in place: wrap a bare nn.Linear "
                         "in a module (e.g. nn.Sequential(linear)), or use WeightOnlyLinear.from_linear(linear, bits)")
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bits={bits!r}: quantize_weights supports {SUPPORTED_BITS} (16 = unchanged)")
    done = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ in ("WeightOnlyLinear", "PackedLinear")})
    if done and bits != 16:
        raise ValueError(f"this model already has {' and '.join(done)} layers (quantized or packed): quantize the "
                         "model as loaded")


def foreign_weights(layers: list[tuple[str, nn.Linear]], what: str) -> None:
    """A ValueError for Linear layers whose weights another library quantized already (torchao's tensor
    subclasses): their raw errors otherwise, from inside that library."""
    foreign = [(name, type(m.weight).__name__) for name, m in layers if type(m.weight) not in (nn.Parameter, torch.Tensor)]
    if foreign:
        raise ValueError(f"{what} needs float weights; {len(foreign)} Linear layers hold a tensor subclass (quantized by "
                         f"another library, e.g. torchao), e.g. {foreign[:3]}: give {what} the model as loaded (one quantizer, not two)")


def _check_layers(todo: list[tuple[str, nn.Linear]], bits: int, group_size: int) -> None:
    """Every layer quantize_weights will replace: a shape the kernel takes, and its weight in memory."""
    foreign_weights(todo, "quantize_weights")
    for name, module in todo:
        _check_shape(name, module.out_features, module.in_features, bits, group_size)
    meta = [name for name, module in todo if module.weight.device.type == "meta"]
    if meta:  # offloaded by accelerate, or never loaded: their int weights would be meta, never filled
        raise ValueError(f"quantize_weights needs the weights in memory; {len(meta)} layers have theirs on meta "
                         f"(offloaded by a device_map, or not loaded), e.g. {meta[:3]}: quantize the model before dispatching it")


def _skips(skip) -> tuple[str, ...]:
    """quantize_weights' skip as a tuple of names: None is none, a str one name (not its letters)."""
    if skip is None or isinstance(skip, str):
        return () if skip is None else (skip,)
    names = tuple(skip) if hasattr(skip, "__iter__") else None  # any iterable: a list, dict keys, a generator
    if names is None or not all(isinstance(n, str) for n in names):
        raise ValueError(f"skip must be module names (a str or an iterable of them, as in model.named_modules()), got {skip!r}")
    return names


def quantize_weights(
    model: nn.Module,
    bits: int,
    group_size: int = 128,
    skip: tuple[str, ...] = (),
    include_lm_head: bool = False,
) -> nn.Module:
    """Replace, in place, every `torch.nn.Linear` of `model` by a `WeightOnlyLinear`; return `model`.

    bits: 8 (per-output-channel symmetric int8), 4 (int4 in groups of `group_size` input features) or
    16 (no-op). skip: qualified module names (as in `model.named_modules()`) to leave as they are.
    A tied output head is left as is unless `include_lm_head=True`, which quantizes an untied copy of
    it (see the module docstring). Raises ValueError for other bits, for skip names that are not Linear
    layers of the model, for int4 shapes the kernel cannot take, and if this torch build lacks the kernels.
    """
    _check_arguments(model, bits)
    if not isinstance(include_lm_head, bool):
        raise ValueError(f"include_lm_head must be True or False, got {include_lm_head!r}")
    if bits == 16:
        return model
    skip, bits = _skips(skip), int(bits)  # bits: a numpy integer too (a sweep's value)
    if getattr(model, "shares_weights_with", None) is not None:
        raise ValueError(
            "this model shares its weights with another (a self-speculative draft from "
            "hf_specdec.early_exit_draft): quantizing it in place would quantize that model's layers too"
        )
    problem = _kernel_problem(bits)
    if problem:
        raise ValueError(problem)
    if bits == 4:
        _check_group_size(group_size)

    linears = {name: module for name, module in model.named_modules() if type(module) is nn.Linear}
    unknown = sorted(set(skip) - set(linears))
    if unknown:
        raise ValueError(f"skip names {unknown} are not nn.Linear modules of this model; e.g. {sorted(linears)[:5]}")
    head_name, _ = _tied_head(model)
    untie = head_name in linears and include_lm_head and head_name not in skip
    skipped = set(skip)
    if head_name in linears and not untie:
        skipped.add(head_name)

    # Check every shape before changing anything, so that an error leaves the model intact.
    todo = [(name, module) for name, module in linears.items() if name not in skipped]
    _check_layers(todo, bits, group_size)

    for name, module in todo:
        # For the untied head this quantizes the shared weight into the head's own buffers; the
        # embedding keeps the original tensor.
        new = WeightOnlyLinear.from_linear(module, bits, group_size, name)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    if untie:
        _untie_config(model)
    _report(model, len(todo), sorted(skipped), bits, group_size)
    return model


def _report(model: nn.Module, replaced: int, kept: list[str], bits: int, group_size: int) -> None:
    if not replaced:  # e.g. GPT-2, whose layers are transformers' Conv1D: asked for int weights, it stays float
        logger.warning("quantize_weights found no torch.nn.Linear layer to quantize in %s (kept: %s); the model is "
                       "unchanged", type(model).__name__, kept or "none")
    logger.info("quantized %d Linear layers to int%d%s; kept %s", replaced, bits,
                f" (group_size={group_size})" if bits == 4 else "", kept or "none")
