"""A boolean attention mask turned into SDPA's additive form once per forward, not per layer.

transformers builds one boolean mask per forward and hands it to every layer's
``scaled_dot_product_attention``, which converts it to an additive one (0 where attended,
-inf elsewhere) in the query's dtype before its kernel runs: three kernels a layer on the
H200 (a bool mask made SDPA launch 4 kernels where the converted mask made it launch 1), 36
a token in a 12-layer decode step. Converted once and passed as a float mask, SDPA ran the
same attention kernel and gave the same bits, in fp16, bf16 and fp32, with and without grouped
queries, for one query and for nine (``.device`` probe on the H200, torch 2.11; the GPU tests
hold grape's tokens to ``generate``'s).

:func:`convert_once` wraps transformers' ``sdpa`` attention entry for the block: a boolean
mask is converted on first use and the conversion is reused by every later call with the same
mask in the same dtype. Only where transformers would pass the mask to SDPA unchanged: not
with a position bias (transformers merges a boolean mask with it otherwise than a float one),
and only on CUDA (transformers turns float masks back into boolean ones for Ascend NPUs). The
wrapper acts in the context that entered the block alone; elsewhere it passes through.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

__all__ = ["convert_once"]

# Inside convert_once: (mask's storage address, offset, shape, strides, version, dtype) ->
# (the mask, kept alive so that no other tensor takes its address in the block; its additive
# form).
# Where the conversion is known to leave SDPA's kernels and bits as they are (checked on the H200).
DEVICES = {"cuda"}

_CONVERTED: ContextVar[dict[tuple, tuple[torch.Tensor, torch.Tensor]] | None] = ContextVar(
    "grape_converted_masks", default=None)


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form SDPA makes of boolean ``mask``: 0 where True, -inf where False."""
    return torch.full_like(mask, float("-inf"), dtype=dtype).masked_fill_(mask, 0)


def _converting(sdpa: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(sdpa)
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None, *args: Any,
                  **kwargs: Any) -> Any:
        converted = _CONVERTED.get()
        if (converted is None or not isinstance(attention_mask, torch.Tensor)
                or attention_mask.dtype != torch.bool or query.device.type not in DEVICES
                or kwargs.get("position_bias") is not None):
            return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
        m = attention_mask
        key_ = (m.untyped_storage().data_ptr(), m.storage_offset(), tuple(m.shape), m.stride(),
                m._version, query.dtype)
        if key_ not in converted:
            converted[key_] = (m, additive(m, query.dtype))
        return sdpa(module, query, key, value, converted[key_][1], *args, **kwargs)
    attention.grape_original = sdpa  # type: ignore[attr-defined]
    return attention


@contextlib.contextmanager
def convert_once() -> Iterator[None]:
    """Inside the block, each boolean mask transformers' SDPA attention is given is converted
    to its additive form once (see the module). A no-op where transformers has no ``sdpa``
    attention entry (another version), and when nested."""
    try:
        from transformers import AttentionInterface
    except ImportError:  # pragma: no cover - transformers without attention interfaces
        yield
        return
    entries = AttentionInterface._global_mapping
    if "sdpa" not in entries or _CONVERTED.get() is not None:
        yield
        return
    saved = entries["sdpa"]
    entries["sdpa"] = _converting(saved)
    token = _CONVERTED.set({})
    try:
        yield
    finally:
        _CONVERTED.reset(token)
        entries["sdpa"] = saved
