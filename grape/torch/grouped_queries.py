"""One query's grouped-query attention without copying the keys: a key head's query heads as rows.

Where a model has fewer key heads than query heads and passes a mask, transformers' SDPA entry
repeats each key and value head for the query heads it serves (``repeat_kv``: PyTorch's fused
kernels take no mask with grouped heads) before calling SDPA. The repeat is a copy of the
layer's whole cache, keys and values, every step: two kernels a layer, eager or compiled
(Inductor cannot fuse them into the attention kernel).

With one query a row the copy is not needed. The query heads a key head serves are then rows
that attend to the same keys under the same mask, the decoding position's. SDPA over the query
as (batch, key heads, heads per key head, head dim) against the keys and values as they lie
computes the same attention, with the mask broadcast over the rows.

:func:`grouped_queries` swaps transformers' ``sdpa`` entry for one that attends that way, in two
cases:

- while Dynamo traces a compiled step: compiled kernels already round otherwise than eager
  ones, and grape reports their tokens' agreement with the eager step, not equality;
- under a CUDA capture, given ``verdicts``: where a probe has found the two forms' bits equal.
  grape's eager tokens are ``generate``'s, so a captured step uses the rows only where they
  change no bit. The probe runs at the first eager call of each shape (the decoder's steps
  before it captures): both forms over that call's query, keys and values, under a mask of
  the decoding shape with keys masked out. Each attention kernel's arithmetic is the same
  whatever the data, so one probe per shape shows whether the two forms run the same sums.
  A shape first met under a capture, where nothing can be read back, keeps transformers'
  form. :func:`grape.torch.readback.as_captured`, which runs work as a capture would see it
  on any device, counts as a capture here.

Every other call passes through unchanged, and so does every eager call: more than one query,
a mask that is not 4D with one query row and one head (broadcast over all heads), no mask
(transformers already asks SDPA for grouped heads then), a position bias, attention weights
asked for.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from grape.torch.control import capturing
from grape.torch.readback import probing

__all__ = ["grouped_queries"]

# Inside grouped_queries(verdicts): the verdicts, (query, key and value shapes, dtype, device,
# dropout, scale) -> whether the two forms gave the same bits.
_VERDICTS: ContextVar[dict[tuple, bool] | None] = ContextVar("grape_grouped_verdicts",
                                                             default=None)


def _one_query(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               kwargs: dict[str, Any]) -> bool:
    """Whether the call attends with one query over grouped key heads (mask aside)."""
    groups = getattr(module, "num_key_value_groups", 1)
    return (isinstance(groups, int) and groups > 1 and query.ndim == 4 and key.ndim == 4
            and query.shape[2] == 1 and key.shape[1] * groups == query.shape[1]
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions"))


def _decoding_mask(mask: Any) -> bool:
    """Whether ``mask`` is one row per batch row, broadcast over the heads and the query."""
    return (isinstance(mask, torch.Tensor) and mask.ndim == 4 and mask.shape[1] == 1
            and mask.shape[2] == 1)


def _rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
          dropout: float, scaling: float | None) -> torch.Tensor:
    """The attention, the query heads a key head serves as rows, shaped as transformers'
    entry returns it: (batch, 1, heads, value dim)."""
    batch, heads = query.shape[:2]
    rows = query.reshape(batch, key.shape[1], heads // key.shape[1], query.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        rows, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous()


def _probe(sdpa: Callable[..., Any], module: torch.nn.Module, query: torch.Tensor,
           key: torch.Tensor, value: torch.Tensor, dropout: float, scaling: float | None,
           kwargs: dict[str, Any]) -> bool:
    """Whether the two forms give the same bits for this call's tensors, under an additive
    mask of the decoding shape (the form grape's steps pass it in) with a key masked out in
    every row. Reads the answer back: eager calls only."""
    mask = torch.zeros((query.shape[0], 1, 1, key.shape[2]), dtype=query.dtype,
                       device=query.device)
    mask[..., :max(1, key.shape[2] // 4)] = float("-inf")
    theirs, _ = sdpa(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                     **kwargs)
    return bool(torch.equal(_rows(query, key, value, mask, dropout, scaling), theirs))


@functools.cache
def _grouped(sdpa: Callable[..., Any]) -> Callable[..., Any]:
    """``sdpa`` (transformers' entry) with one query's grouped heads read as rows where the
    module says. Cached, so that the entry is the same object at every compiled call: Dynamo
    guards on it."""
    @functools.wraps(sdpa)
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> Any:
        applies = _one_query(module, query, key, kwargs)
        if torch.compiler.is_compiling():  # (Dynamo reads no ContextVar: decided here)
            rows = applies and _decoding_mask(attention_mask)
        elif (verdicts := _VERDICTS.get()) is None or not applies or dropout:
            rows = False
        else:
            shape = (tuple(query.shape), tuple(key.shape), tuple(value.shape), query.dtype,
                     query.device, scaling)
            # (a capture, or grape's stand-in for one, reads nothing back: no probe there)
            captured = capturing() or probing()
            if shape not in verdicts and not captured:
                verdicts[shape] = _probe(sdpa, module, query, key, value, dropout, scaling,
                                         kwargs)
            rows = verdicts.get(shape, False) and _decoding_mask(attention_mask) and captured
        if not rows:
            return sdpa(module, query, key, value, attention_mask, dropout=dropout,
                        scaling=scaling, **kwargs)
        return _rows(query, key, value, attention_mask, dropout, scaling), None
    attention.grape_original = sdpa  # type: ignore[attr-defined]
    return attention


@contextlib.contextmanager
def grouped_queries(verdicts: dict[tuple, bool] | None = None) -> Iterator[None]:
    """Inside the block, one query's grouped attention reads the keys where they lie: while
    Dynamo traces, and under a CUDA capture where ``verdicts`` (kept by the caller, one per
    decoder) hold a probe's equality for the call's shapes (see the module). A no-op where
    transformers has no ``sdpa`` attention entry; nested, the outer block's entry stays."""
    try:
        from transformers import AttentionInterface
    except ImportError:  # pragma: no cover - transformers without attention interfaces
        yield
        return
    entries = AttentionInterface._global_mapping
    saved = entries.get("sdpa")
    if saved is None or getattr(saved, "grape_original", None) is not None:
        yield  # (no entry, or one of grape's already in place)
        return
    entries["sdpa"] = _grouped(saved)
    token = _VERDICTS.set(verdicts)
    try:
        yield
    finally:
        _VERDICTS.reset(token)
        entries["sdpa"] = saved
