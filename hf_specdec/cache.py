"""KV caches: feeding a model the tokens its cache has not seen, and every change made to a cache.

Both models keep a `DynamicCache` that always holds a prefix of the work sequence. A model is only
ever fed the tokens past that prefix (`extend`), so no prefix is re-encoded. The other changes
a speculative loop makes live here and nowhere else:
  * `rollback`: after verification, cut every cache back to the columns that survived;
  * `select_rows`: finished rows leave the batch (and the caches);
  * `gather_columns`: compaction, each row's real columns gathered to the right (see batch.py);
  * `keep_path`: after a tree forward, the accepted branch's columns moved behind the sequence's;
  * `hide_prefix`: a windowed draft's cache gets zero columns in front, which its mask hides;
  * `pad_front`, `add_row`, `clear`: continuous batching, a new row joins a running batch (see continuous.py).
"""

from __future__ import annotations

import functools
import inspect
from typing import Iterable

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

from .host import to_device


class UnsupportedCacheError(ValueError):
    """The cache type cannot be rolled back, or holds state we cannot account for."""


def check_cache(cache: object, who: str) -> None:
    """Only `DynamicCache` is supported: rollback must drop arbitrary trailing positions."""
    if cache is not None and not isinstance(cache, DynamicCache):
        raise UnsupportedCacheError(
            f"hf_specdec supports DynamicCache only, but the {who} got {type(cache).__name__}. "
            "Static, quantized and offloaded caches cannot be rolled back after a rejected draft token; "
            "drop `cache_implementation` / the `cache` argument to use the default DynamicCache."
        )


def new_cache(model: torch.nn.Module) -> DynamicCache:
    return make_rollbackable(DynamicCache(config=model.config))


def make_rollbackable(cache: Cache) -> Cache:
    """Sliding-window layers drop old states eagerly; past recording makes them keep what a later
    `rollback` needs (transformers' public `Cache.activate_past_recording`). Linear-attention layers
    are refused before this (`arguments._validate_layers`): a forward after their rollback fails."""
    cache.activate_past_recording()
    return cache


def stop_recording(cache: Cache) -> None:
    """Undo `make_rollbackable` as the call ends: each sliding-window layer cut to its window and past recording
    off, as plain decoding leaves it (a later plain call would otherwise keep every column it adds)."""
    for layer in cache.layers:
        if getattr(layer, "record_past", False) and getattr(layer, "is_sliding", False):
            if layer.get_seq_length() >= layer.sliding_window:
                layer.crop(0)  # with recording on: keeps the window's last columns
            layer.record_past = False


def rollback(caches: Iterable[Cache | None], length: int) -> None:
    """Cut every cache back to its first `length` positions (no-op for a cache already shorter).

    This is the only place where rejected draft tokens leave a cache.
    """
    for cache in caches:
        if cache is not None and (extra := cache.get_seq_length() - length) > 0:
            cache.crop(-extra)  # transformers >= 5.23: a negative count removes that many positions


def select_rows(caches: Iterable[Cache | None], keep: torch.Tensor) -> None:  # keep: [rows kept] indices
    """Keep only the batch rows at `keep`, in order (`Cache.batch_select_indices`)."""
    for cache in caches:
        if cache is not None:
            cache.batch_select_indices(keep)
            for layer in cache.layers:  # transformers skips a cache with no columns: its rows must go too
                if layer.keys is not None and layer.keys.dim() == 4 and layer.keys.shape[0] != keep.numel():
                    layer.keys, layer.values = layer.keys[keep], layer.values[keep]


def local_window(config) -> int | None:
    """The window of a local attention kept in full-attention cache layers (GPT-Neo's), or None."""
    if getattr(config, "model_type", "") == "gpt_neo" and "local" in (getattr(config, "attention_layers", None) or ()):
        return config.window_size
    return None


def column_bound(model: torch.nn.Module) -> tuple[str | None, str | None]:
    """(why masked holes in a row change `model`'s attention, why a tree forward does): None where they do
    not. Attention that reads the mask and the position ids skips holes and places tree nodes at their
    depth; some models look at the columns themselves."""
    config = model.config
    kind = getattr(config, "model_type", "")
    if local_window(config) is not None:
        why = f"GPT-Neo's local attention spans {config.window_size} columns, holes included"
        return why, why
    if kind == "git":  # modeling_git.py: a cached forward widens a 2-D mask by image tokens, with or without an image
        why = "GIT's forward widens a 2-D attention mask by its image tokens once its cache holds any"
        return why, why
    if kind == "mpt":
        why = "MPT's ALiBi bias is computed from column positions, not from the mask or the position ids"
        return why, why
    if kind == "bloom" or getattr(config, "alibi", False) is True:
        return None, "its ALiBi bias is built from a 2-D mask, and a tree forward passes a 4-D one"
    if not forward_takes(model, "position_ids"):
        why = f"{type(model).__name__} takes no position ids: it numbers tokens by their cache columns"
        return why, why
    if not forward_takes(model, "attention_mask"):
        why = f"{type(model).__name__} takes no attention mask: it attends to padding and holes"
        return why, why
    own = type(getattr(model, "_orig_mod", model))  # the class whose forward runs: a subclass may only add methods
    if not next((c for c in own.__mro__ if "forward" in vars(c)), own).__module__.startswith("transformers."):
        return None, (f"{type(model).__name__} is not a model of transformers', which take a 4-D mask as given (a model "
                      "of one's own may read it as a 2-D one, as transformers' legacy mask helper does)")
    if getattr(config, "_attn_implementation", None) == "flex_attention":  # seen with torch 2.13 on a CPU
        return None, "a flex-attention forward with a tree's 4-D mask aborts the process (a torch bug)"
    return None, None


def can_gather(caches: Iterable[Cache | None]) -> bool:
    """Whether `gather_columns` can rearrange these caches: plain full-attention layers only
    (sliding-window layers keep a window, not the columns the gather indexes)."""
    return all(type(layer) is DynamicLayer for c in caches if c is not None for layer in c.layers)


def gather_problem(caches: dict[str, Cache | None]) -> str | None:
    """Why continuous batching cannot gather these caches (by model name), or None where it can."""
    who = [name for name, cache in caches.items() if not can_gather((cache,))]
    kinds = sorted({type(layer).__name__ for name in who for layer in caches[name].layers if type(layer) is not DynamicLayer})
    if not who:
        return None
    return (f"continuous batching needs full-attention cache layers, and the {' and the '.join(who)} "
            f"{'has' if len(who) == 1 else 'have'} {', '.join(kinds)} layers (rows join by gathering cache columns; a "
            "sliding window keeps a window, not columns). Use a left-padded batch (while it fits the window) or one prompt "
            "at a time"
            + (", or a draft with full attention" if who == ["draft"] else "") + ".")


def gather_columns(
    caches: Iterable[Cache | None],
    order: torch.Tensor,  # [rows, width]: for each row, the column indices (from `start`) to keep, in order
    cached: int,  # the end of the columns rearranged, which every cache given holds; later ones are kept as they are
    start: int = 0,  # columns before it are kept as they are
) -> None:
    """Replace columns `start`..`cached` of every layer by the columns `order` picks, per row.
    Requires `can_gather(caches)`."""
    for cache in caches:
        if cache is None:
            continue
        for layer in cache.layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            for name in ("keys", "values"):  # each its own head size (MLA: keys 16 wide, values 8)
                t = getattr(layer, name)
                index = order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1])
                setattr(layer, name, torch.cat([t[:, :, :start], t[:, :, start:cached].gather(2, index), t[:, :, cached:]], dim=2))


def hide_prefix(cache: Cache, columns: int) -> None:
    """Put `columns` zero columns in front of every layer, so that a cache built on the last tokens
    of a sequence has the whole sequence's length (rollback, row selection and the loop's column
    arithmetic stay as for any cache). The model must never attend to them: every later forward
    masks them out (`attention_mask` zero there). Requires `can_gather([cache])`."""
    if not can_gather([cache]):
        raise UnsupportedCacheError("a draft window needs full-attention cache layers (no sliding-window or linear-attention layers)")
    _zeros_in_front(cache, columns)


def _zeros_in_front(cache: Cache, columns: int) -> None:
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        pad = (*layer.keys.shape[:2], columns)
        layer.keys = torch.cat([layer.keys.new_zeros(*pad, layer.keys.shape[-1]), layer.keys], dim=2)
        layer.values = torch.cat([layer.values.new_zeros(*pad, layer.values.shape[-1]), layer.values], dim=2)


def pad_front(caches: Iterable[Cache | None], columns: int) -> None:
    """The work sequence got `columns` masked columns in front (a longer prompt joins the batch):
    every cache that holds columns gets as many zero columns in front, which the mask hides. An
    empty cache holds the empty prefix of any sequence and stays as it is. Requires `can_gather`."""
    for cache in caches:
        if cache is not None and cache.get_seq_length() > 0:
            _zeros_in_front(cache, columns)


def clear(caches: Iterable[Cache | None]) -> None:
    """Drop every row and column of caches whose batch has no row left (continuous batching: new rows
    will join empty caches)."""
    for cache in caches:
        if cache is None:
            continue
        for layer in cache.layers:
            if layer.keys is not None and layer.keys.dim() == 4:  # no row and no column: joining rows start it
                layer.keys, layer.values = layer.keys[:0, :, :0], layer.values[:0, :, :0]


def add_row(
    model: torch.nn.Module,
    cache: Cache,
    ids: torch.Tensor,  # [1, width]: the new row of the work sequence (left-padded prompt)
    mask: torch.Tensor,  # [1, width]: 0 on its padding, 1 on its prompt
) -> None:
    """Append one row to a batch's cache: it must hold the row's first `cache.get_seq_length()`
    columns like every other row. Its prompt tokens among them are encoded in a forward of their own
    (positions from 0, as the mask's running count numbers them in the batch), its padding columns
    are zeros the mask hides; the rest of the prompt is fed with the batch's next forward, like any
    pending token. Requires `can_gather([cache])` (full-attention layers)."""
    held = cache.get_seq_length()
    real = ids[0, :held][mask[0, :held].bool()]  # the row's left padding comes first: real tokens are a suffix
    encoded = None
    if real.numel():
        encoded = new_cache(model)
        extend(model, encoded, real[None], None, num_logits=1)
    for i, layer in enumerate(cache.layers):
        if layer.keys is None or layer.keys.dim() < 4:  # never written: no row has anything here yet
            continue
        keys = layer.keys.new_zeros((1, layer.keys.shape[1], held, layer.keys.shape[-1]))
        values = layer.values.new_zeros((1, layer.values.shape[1], held, layer.values.shape[-1]))  # MLA: its own size
        if encoded is not None:
            keys[:, :, held - real.numel() :] = encoded.layers[i].keys
            values[:, :, held - real.numel() :] = encoded.layers[i].values
        layer.keys = torch.cat([layer.keys, keys], dim=0)
        layer.values = torch.cat([layer.values, values], dim=0)


def forward_takes(model: torch.nn.Module, argument: str) -> bool:
    """Whether `model`'s forward has a parameter named `argument`: a `torch.compile`d module's, its
    original's (the wrapper's forward takes `*args, **kwargs`)."""
    return _takes(type(getattr(model, "_orig_mod", model)), argument)


@functools.lru_cache(maxsize=None)
def _takes(model_type: type, argument: str) -> bool:  # read once per class
    return argument in inspect.signature(model_type.forward).parameters


def extend(
    model: torch.nn.Module,
    cache: Cache,
    input_ids: torch.Tensor,  # [batch, seq]: the whole sequence so far; the cache holds a prefix of it
    attention_mask: torch.Tensor | None,  # [batch, seq] (1 = real token), or None when nothing is padded
    num_logits: int,  # how many trailing positions need logits
) -> torch.Tensor:  # [batch, num_logits, vocab]: raw logits of the last num_logits positions
    """Run `model` over the tokens of `input_ids` that `cache` has not seen, growing the cache."""
    past = cache.get_seq_length()
    new_ids = input_ids[:, past:].contiguous()  # [batch, seq - past]; generate() feeds contiguous tensors
    if new_ids.shape[1] < num_logits:
        raise RuntimeError(f"asked for {num_logits} logits but only {new_ids.shape[1]} tokens are new")
    position_ids = None  # a model that takes none numbers the new tokens by their cache columns
    if attention_mask is not None:
        # Left padding: a token's position counts only the real tokens before it (as generate() does).
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, past:].contiguous()  # Kosmos-2.5 views it
    elif forward_takes(model, "position_ids"):  # given as generate() gives them: some models (RoBERTa's
        # family) number from their padding id when given none
        position_ids = torch.arange(past, past + new_ids.shape[1], device=new_ids.device)[None].expand_as(new_ids).contiguous()
    kwargs = {"logits_to_keep": num_logits} if forward_takes(model, "logits_to_keep") else {}
    if attention_mask is not None:  # (passed only when there is one: a forward of one's own may take neither)
        kwargs.update(attention_mask=attention_mask)
    if position_ids is not None:
        kwargs.update(position_ids=position_ids)
    out = model(input_ids=new_ids, cache=cache, use_cache=True, return_dict=True, **kwargs)
    if cache.get_seq_length() != past + new_ids.shape[1]:  # shapes only: no device read
        raise UnsupportedCacheError(
            f"{type(model).__name__} holds {cache.get_seq_length()} cached positions after a forward over "
            f"{new_ids.shape[1]} new tokens on {past}: hf_specdec needs a cache that grows by the tokens given "
            "(it cuts rejected ones off by position). Use plain generate() for this model.")
    return out.logits[:, -num_logits:]


def extend_tree(
    model: torch.nn.Module,
    cache: Cache,
    input_ids: torch.Tensor,  # [1, seq]: the row's sequence; the cache holds a prefix of it
    tree_tokens: torch.Tensor,  # [1, n]: the tree's node tokens
    seen: torch.Tensor,  # [n, n] bool: node j attends to node i (itself and its ancestors)
    depth: list[int],  # [n]: each node's depth (children of the root: 0)
) -> torch.Tensor:  # [1, n + 1, vocab]: raw logits after the sequence's last token, then after each node
    """One forward over the tokens the cache lacks followed by a whole tree: a custom 4D attention
    mask lets each node see the sequence and its own ancestors only, and position ids count depth,
    so every node's logits are those of its own branch (transformers models take a 4D mask as given).
    The cache then holds every node's keys and values; `keep_path` keeps the accepted branch's."""
    past, n = cache.get_seq_length(), tree_tokens.shape[1]
    new_ids = input_ids[:, past:]  # [1, pending]
    pending = new_ids.shape[1]
    if pending < 1:
        raise RuntimeError("a tree is verified after the sequence's last token, which the cache must not hold yet")
    queries, keys = pending + n, past + pending + n
    allowed = torch.zeros((queries, keys), dtype=torch.bool, device=input_ids.device)
    allowed[:, :past] = True
    allowed[:pending, past : past + pending] = torch.ones(pending, pending, dtype=torch.bool, device=input_ids.device).tril()
    allowed[pending:, past : past + pending] = True
    allowed[pending:, past + pending :] = to_device(seen, input_ids.device, torch.bool)
    dtype = next(model.parameters()).dtype
    mask = torch.zeros((1, 1, queries, keys), dtype=dtype, device=input_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    positions = torch.cat([
        torch.arange(past, past + pending, device=input_ids.device),
        past + pending + to_device(depth, input_ids.device),
    ])[None]
    kwargs = {"logits_to_keep": n + 1} if forward_takes(model, "logits_to_keep") else {}
    out = model(
        input_ids=torch.cat([new_ids, tree_tokens], dim=1), attention_mask=mask, position_ids=positions,
        cache=cache, use_cache=True, return_dict=True, **kwargs,
    )
    return out.logits[:, -(n + 1) :]


def keep_path(cache: Cache, length: int, path: list[int], nodes: int) -> None:
    """After a tree forward (the cache holds `length` sequence columns, then `nodes` tree columns),
    keep the sequence and the accepted nodes `path` (root first), in that order. Only the tree's
    columns move: the accepted ones are copied to the front of the tree's columns (nothing is copied
    when they are there already, a path down the first children) and the rest is cut off, so a round
    costs O(path) copies, not a copy of the whole cache. Requires `can_gather([cache])`."""
    if cache.get_seq_length() != length + nodes:
        raise RuntimeError(f"keep_path expects {length} + {nodes} cached columns, the cache holds {cache.get_seq_length()}")
    kept = length + len(path)
    if path != list(range(len(path))):
        columns = [length + node for node in path]
        on: dict[torch.device, torch.Tensor] = {}  # the indices on each layer's device (a model split over devices)
        for layer in cache.layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            source = on.get(layer.keys.device)
            if source is None:  # uploaded once per device, not once per layer
                source = on[layer.keys.device] = to_device(columns, layer.keys.device)
            # index_select copies the accepted columns out before they are written over (a path's
            # j-th node sits at or after column length + j, so source and destination may overlap)
            layer.keys[:, :, length:kept] = layer.keys.index_select(2, source)
            layer.values[:, :, length:kept] = layer.values.index_select(2, source)
    rollback([cache], kept)
