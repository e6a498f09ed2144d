"""Float32 linears packed for oneDNN: a forward over several tokens for little more than one, on CPUs
without bf16 instructions.

Speculative decoding pays where the target's forward over k tokens costs little more than over one
(the weights are read from memory once either way). On an x86 CPU without AVX-512 BF16 or AMX, torch
computes a bf16 Linear over several tokens at nearly k times the one-token price, and a float32 Linear
through MKL not much better: measured on a 2-core AVX2 AMD EPYC, the 1.5B target's forward over 9 new
tokens costs 7.0 one-token steps in bf16 and 3.1 in float32, so no draft can pay there (the cost model
falls back to plain decoding). oneDNN's float32 GEMM on a weight reordered once into its blocked layout
costs 1.0 step over 3 tokens and 1.9 over 9, and its one-token step (265 ms) is close to bf16's (206 ms).

`pack_linears(model)` casts the model to float32 and swaps every `torch.nn.Linear` (exact type) for a
`PackedLinear` holding that reordered weight, computed with torch's own oneDNN CPU ops
(`torch.ops.mkldnn._reorder_linear_weight` once, `torch.ops.mkldnn._linear_pointwise` per call: what
torch.compile's CPU backend uses for frozen linears). Nothing in transformers is patched.

    target = hf_specdec.pack_linears(target)        # before generating, plain or speculative
    target.generate(**inputs, custom_generate=hf_specdec.speculative_generate, assistant=draft)

Exactness is untouched: the packed model *is* the target that decoding samples from, and plain and
speculative decoding on it agree (greedy token for token, up to float32 ties where a forward over several
tokens rounds differently from one over a single token). Its logits are the float32 model's to float32
rounding; against the bf16 model they differ as float32 differs from bf16 (a greedy text may part
where bf16 rounded a near tie). Compare methods on the same packed target. Pack the draft too: its
prompt encoding and its catch-ups after lookup rounds are forwards over many tokens (a 61-token
prompt: 2.41 s int8, 0.57 s packed). But its one-token step is dearer packed than int8 (0.5B draft,
same 2-core AVX2 CPU: 103 ms against 84 ms at 100 cached tokens, 135 against 111 at 800), and the
draft's one-token step is what a drafted token costs. `pack_linears(draft, decode_bits=8)` keeps both:
each layer also holds an int8 weight-only copy (`quantize.WeightOnlyLinear`, bf16 compute) and takes
it for inputs of at most `DECODE_ROWS` rows, the packed weight for more (at 4 rows int8 still wins,
111-120 ms against 125-167; at 9 it loses, 211-227 against 154-215). Exactness is untouched: the draft
is whatever it computes, and verification uses the q of the forward that drafted each token. The
CLI (`--pack`, with the default `--draft-bits 8`) and the eval scripts (`--pack`) pack both models,
the draft so. In an eval's cost table the draft's step fell from 0.35-0.45 of a target step to
0.25-0.32, and greedy hf_specdec ran 1.09x faster on the prompts that draft with the model
(`run int8-copies-ab, docs/evaluation.md#older-runs`).

Memory: float32 weights, twice bf16's (6.2 GB for the 1.5B target; an int8 decode copy adds a quarter
of that, 0.5 GB for the 0.5B draft). A tied output head gets its own
packed copy (the embedding keeps its float32 weight; `config.tie_word_embeddings` is set to False).
CPU only: the packed layout is this CPU's; pack after loading (a packed model refuses state_dict and so save_pretrained).
`PackedLinear.weight` is a shape-only meta tensor, so code that reads a head's `weight.shape` works.
"""

from __future__ import annotations

import functools
import logging
import numbers

import torch
from torch import nn

from .quantize import WeightOnlyLinear, _kernel_problem, _tied_head, _untie_config, foreign_weights

logger = logging.getLogger(__name__)

# With an int8 decode copy (`pack_linears(..., decode_bits=8)`), inputs of at most this many rows take
# it and wider ones the packed weight: measured on the 0.5B draft (see the module docstring), the int8
# kernel wins at 1 and 4 rows and loses at 9.
DECODE_ROWS = 4


@functools.cache
def packing_problem() -> str | None:
    """None if this torch build can pack and run float32 linears with oneDNN on this CPU, else why not."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or ops is None:
        return f"this torch build ({torch.__version__}) has no oneDNN (mkldnn) CPU backend"
    missing = [name for name in ("_reorder_linear_weight", "_linear_pointwise") if not hasattr(ops, name)]
    if missing:
        return f"packed linears need torch.ops.mkldnn.{' and '.join(missing)}, not in this torch build ({torch.__version__})"
    try:
        gen = torch.Generator().manual_seed(0)  # not the global generator: a user's seeded sampling is theirs
        weight, x = torch.randn(16, 32, generator=gen), torch.randn(3, 32, generator=gen)
        y = ops._linear_pointwise(x, ops._reorder_linear_weight(weight, None), None, "none", [], "")
        if not torch.allclose(y, x @ weight.T, atol=1e-4, rtol=1e-4):
            return "oneDNN's packed float32 linear disagrees with torch's on this CPU"
    except (RuntimeError, NotImplementedError) as error:
        return f"oneDNN's packed float32 linear fails on this CPU: {error}"
    return None


def _unsaveable(module: nn.Module, prefix: str, *args) -> None:
    """state_dict() of a packed model (save_pretrained reads it), or load_state_dict() into one: refused,
    since its weights could be neither saved nor loaded."""
    raise RuntimeError(f"{prefix.rstrip('.') or 'this PackedLinear'} is packed by hf_specdec.pack_linears: its weight is held in "
                       "this CPU's oneDNN layout, which a state_dict (save_pretrained, torch.save of the weights, "
                       "load_state_dict) cannot hold, so it would be saved without weights or keep its old ones. Save "
                       "or load the model before packing it, and pack after loading.")


def _unloadable(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    if prefix + "weight" in state_dict:  # a checkpoint's weight: load_state_dict(strict=False) skipped it silently
        _unsaveable(module, prefix)


class PackedLinear(nn.Module):
    """A float32 Linear whose weight is held in oneDNN's blocked layout (see the module docstring)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = getattr(linear, "weight", None) if isinstance(linear, nn.Linear) else None
        if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu":
            where = "" if not isinstance(weight, torch.Tensor) else f" with its weight on {weight.device.type}"
            raise ValueError(f"PackedLinear packs a torch.nn.Linear on the CPU, got {type(linear).__name__}{where}")
        self._pack(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        # An int8 weight-only copy for inputs of at most `decode_rows` rows (`pack_linears(decode_bits=8)`).
        self.decode: WeightOnlyLinear | None = None
        self.decode_rows = DECODE_ROWS

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        # Not a buffer: an opaque oneDNN tensor has no storage for state_dict, `.to()` or copying.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.float32).contiguous(), None)
        self.register_buffer("bias", None if bias is None else bias.to(torch.float32))
        self.weight = torch.empty(self.out_features, self.in_features, device="meta")  # shape only
        self.register_state_dict_pre_hook(_unsaveable)
        self.register_load_state_dict_pre_hook(_unloadable)

    def __getstate__(self):  # pickle, torch.save(model): torch's own message named an opaque tensor's storage
        _unsaveable(self, "")

    def __copy__(self) -> "PackedLinear":  # not through pickling's __getstate__
        return self.__deepcopy__({})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise RuntimeError(f"a PackedLinear computes on the CPU (its weight is oneDNN's CPU layout); got input on {x.device}")
        shape = x.shape
        flat = x.reshape(-1, self.in_features)
        if self.decode is not None and flat.shape[0] <= self.decode_rows:
            y = self.decode(flat.to(self.decode.compute_dtype)).to(torch.float32)
        else:
            bias = self.bias if self.bias is None or self.bias.dtype == torch.float32 else self.bias.float()  # a model cast after
            y = torch.ops.mkldnn._linear_pointwise(flat.to(torch.float32), self.packed, bias, "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)

    def __deepcopy__(self, memo: dict) -> "PackedLinear":
        """A copy that shares the packed weight (it is never written) and copies the rest."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        nn.Module.__init__(new)
        new.in_features, new.out_features = self.in_features, self.out_features
        new.packed, new.weight = self.packed, self.weight
        new.register_state_dict_pre_hook(_unsaveable)
        new.register_load_state_dict_pre_hook(_unloadable)
        new.register_buffer("bias", None if self.bias is None else self.bias.clone())
        new.decode, new.decode_rows = self.decode, self.decode_rows  # shared too: never written
        return new

    def extra_repr(self) -> str:
        decode = "" if self.decode is None else f", int8 copy for <= {self.decode_rows} rows"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"float32 oneDNN-packed{decode}")


@torch.no_grad()
def pack_linears(model: nn.Module, decode_bits: int | None = None) -> nn.Module:
    """Cast `model` to float32 and replace, in place, every `torch.nn.Linear` by a `PackedLinear`;
    return `model`. Raises ValueError where torch cannot pack here (no oneDNN, ops missing), for a model
    off the CPU, and for a model sharing its weights with another (`early_exit_draft`).

    decode_bits: 8 gives every layer an int8 weight-only copy (per-channel scales, bf16 compute, made
    from the weight as given) that inputs of at most `DECODE_ROWS` rows take: a draft's one-token steps
    at int8's price, its prompt encoding and catch-ups at the packed price (module docstring). None
    (the default): packed weights only. For drafts: a target's outputs would change with the copy.
"""
    if not isinstance(model, nn.Module):
        raise ValueError(f"pack_linears takes a torch model (an nn.Module), got {type(model).__name__}")
    problem = packing_problem()
    if problem:
        raise ValueError(problem)
    copies = {id(m.decode) for m in model.modules() if isinstance(m, PackedLinear)}  # a packed model's own int8 copies
    if any(isinstance(m, WeightOnlyLinear) and id(m) not in copies for m in model.modules()):
        raise ValueError("this model has weight-only quantized layers (quantize_weights): pack the model as loaded")
    if decode_bits is not None and (isinstance(decode_bits, bool) or not isinstance(decode_bits, numbers.Integral) or decode_bits != 8):
        raise ValueError(f"decode_bits must be None or 8 (an int8 copy for one-token steps), got {decode_bits!r}")
    if decode_bits and _kernel_problem(8):
        raise ValueError(f"decode_bits=8: {_kernel_problem(8)}")
    devices = {p.device.type for p in model.parameters()}
    if devices - {"cpu"}:
        raise ValueError(f"pack_linears is for models on the CPU; this one has weights on {sorted(devices)}")
    if getattr(model, "shares_weights_with", None) is not None:
        raise ValueError(
            "this model shares its weights with another (a self-speculative draft from "
            "hf_specdec.early_exit_draft): packing it in place would change that model's layers too"
        )
    if type(model) is nn.Linear:
        raise ValueError("pack_linears packs the Linear layers inside a model, in place: wrap a bare nn.Linear in a "
                         "module (e.g. nn.Sequential(linear)), or use hf_specdec.PackedLinear(linear)")
    names = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    foreign_weights([(name, model.get_submodule(name)) for name in names], "pack_linears")
    if decode_bits and not names and any(isinstance(m, PackedLinear) for m in model.modules()):
        raise ValueError("this model is packed already: decode_bits adds int8 copies only while packing, so pack "
                         "the model as loaded with pack_linears(model, decode_bits=8)")
    head_name, _ = _tied_head(model)
    # One layer at a time, holding no reference to the replaced ones: the peak is the model as given
    # plus the packed weights, not a float32 copy of every layer on top (12 GB for the 1.5B target).
    decode: dict[str, WeightOnlyLinear] = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if decode_bits:  # int8 of the weight as given, computing in bf16 (the int8 kernel's fast path)
            bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
            decode[name] = WeightOnlyLinear.from_weight(linear.weight.detach().to(torch.bfloat16), bias, 8, name=name)
        setattr(parent, child, PackedLinear(linear))
    model.to(torch.float32)  # what is left: embeddings, norms, biases of other layers
    for name, layer in decode.items():  # after the cast, which would turn their bf16 scales to float32
        model.get_submodule(name).decode = layer
    if head_name in names:
        _untie_config(model)  # the head has its own packed copy now; a later tie_weights() must not re-tie
    logger.info("packed %d Linear layers as float32 for oneDNN%s", len(names), " with int8 decode copies" if decode else "")
    return model


def without_decode_copies(model: nn.Module) -> nn.Module:
    """`model` itself if none of its packed layers has an int8 decode copy (`pack_linears(decode_bits=8)`),
    else a copy (packed weights and copies shared, never written) whose layers all take the packed weight."""
    if not any(isinstance(m, PackedLinear) and m.decode is not None for m in model.modules()):
        return model
    import copy

    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, PackedLinear):
            module.decode = None
    return twin


@torch.no_grad()
def multi_token_cost(model: nn.Module, width: int = 5, context: int = 8, repeats: int = 2) -> float:
    """What a forward over `width` new tokens costs, in one-token steps, after `context` cached tokens
    (median of `repeats` each): about 1 where forwards are bound by reading the weights (speculation
    pays), about `width` where the CPU computes every token at a step's price (it cannot)."""
    import time

    from .cache import new_cache, rollback

    vocab = model.get_output_embeddings().weight.shape[0]
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(0, vocab, (1, n), generator=gen).to(device)  # noqa: E731
    cache = new_cache(model)
    model(input_ids=tokens(context), cache=cache, use_cache=True, logits_to_keep=1)
    times: dict[int, list[float]] = {1: [], width: []}
    for _ in range(repeats):
        for n in (1, width):
            ids = tokens(n)
            start = time.perf_counter()
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=n)
            times[n].append(time.perf_counter() - start)
            rollback([cache], context)
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return median(times[width]) / max(median(times[1]), 1e-9)


# `should_pack`: a forward over 5 tokens at or above this many one-token steps means the CPU computes
# the tokens one by one (bf16 without bf16 instructions: 4.0 on the AVX2 EPYC; 1.2-1.5 where speculation pays).
SLOW_WIDTH_COST = 2.5


def should_pack(model: nn.Module) -> tuple[bool, str]:
    """(pack?, why) for a model about to be used as a target: pack a CPU model whose forward over 5
    tokens costs SLOW_WIDTH_COST steps or more, when packing works here. Times two small forwards."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        return False, "the target is not on the CPU"
    problem = packing_problem()
    if problem:
        return False, problem
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        return False, "the target is packed already"
    cost = multi_token_cost(model)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if cost < SLOW_WIDTH_COST:
        return False, f"a forward over 5 tokens costs {cost:.1f} one-token steps here in {dtype}: cheap enough to verify drafts"
    return True, (f"a forward over 5 tokens costs {cost:.1f} one-token steps here in {dtype}, so drafts cannot pay; "
                  "the target runs in float32 with oneDNN-packed linears instead")
