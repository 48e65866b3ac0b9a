"""One query's grouped-query attention without copying the keys: a key head's query heads as rows.

Where a model has fewer key heads than query heads and passes a mask, transformers' SDPA entry
repeats each key and value head for the query heads it serves (``repeat_kv``: PyTorch's fused
kernels take no mask with grouped heads) before calling SDPA. The repeat is a copy of the
layer's whole cache, keys and values, every step. Compiled, Inductor cannot fuse it into the
attention kernel and makes it two kernels a layer (the Llama shape's compiled step held 44).

With one query a row the copy is not needed. The query heads a key head serves are then rows
that attend to the same keys under the same mask, the decoding position's. SDPA over the query
as (batch, key heads, heads per key head, head dim) against the keys and values as they lie
computes the same attention, with the mask broadcast over the rows.

:func:`grouped_queries` swaps transformers' ``sdpa`` entry for that form while a compiled
step is traced. Compiled kernels already round otherwise than eager ones: grape reports their
tokens' agreement with the eager step, it does not promise equality.

Not for grape's eager steps, whose tokens are ``generate``'s: with rows for heads cuDNN runs
another attention kernel (on an H100 the captured step gained a memset a layer), which adds
in another order. A probe that compared the two forms' fp16 outputs on one eager call found
them equal, yet a Llama-shaped model's sampled tokens parted from those of the step that
repeats the keys (transformers' form, ``generate``'s) at the 34th new token: equal rounded
outputs on one input do not show equal arithmetic (``benchmarks/README.md``, "Grouped
queries as rows").

Everything else passes through unchanged:

- eager calls (the entry acts while Dynamo traces, nowhere else);
- more than one query;
- a mask that is not 4D with one query row and one head (broadcast over all heads);
- no mask (transformers already asks SDPA for grouped heads then);
- a position bias;
- attention weights asked for.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["grouped_queries"]


def _applies(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
             attention_mask: Any, kwargs: dict[str, Any]) -> bool:
    groups = getattr(module, "num_key_value_groups", 1)
    return (isinstance(groups, int) and groups > 1 and query.ndim == 4 and key.ndim == 4
            and query.shape[2] == 1 and key.shape[1] * groups == query.shape[1]
            and isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 4
            and attention_mask.shape[1] == 1 and attention_mask.shape[2] == 1
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions"))


@functools.cache
def _grouped(sdpa: Callable[..., Any]) -> Callable[..., Any]:
    """``sdpa`` (transformers' entry) with one query's grouped heads read as rows. Cached, so
    that the entry is the same object at every compiled call: Dynamo guards on it."""
    @functools.wraps(sdpa)
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> Any:
        if not (torch.compiler.is_compiling()
                and _applies(module, query, key, attention_mask, kwargs)):
            return sdpa(module, query, key, value, attention_mask, dropout=dropout,
                        scaling=scaling, **kwargs)
        batch, heads = query.shape[:2]
        rows = query.reshape(batch, key.shape[1], heads // key.shape[1], query.shape[-1])
        out = torch.nn.functional.scaled_dot_product_attention(
            rows, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
        return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None
    attention.grape_original = sdpa  # type: ignore[attr-defined]
    return attention


@contextlib.contextmanager
def grouped_queries() -> Iterator[None]:
    """Inside the block, a compiled step's one-query grouped attention reads the keys where
    they lie (see the module). A no-op where transformers has no ``sdpa`` attention entry."""
    try:
        from transformers import AttentionInterface
    except ImportError:  # pragma: no cover - transformers without attention interfaces
        yield
        return
    entries = AttentionInterface._global_mapping
    saved = entries.get("sdpa")
    if saved is None or getattr(saved, "grape_original", None) is not None:
        yield  # (no entry, or one of grape's already in place: nested)
        return
    entries["sdpa"] = _grouped(saved)
    try:
        yield
    finally:
        entries["sdpa"] = saved
