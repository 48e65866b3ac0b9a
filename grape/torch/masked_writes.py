"""Writes through a boolean mask, made capturable.

``x[mask] = values`` is an ``index_put_`` with a boolean index. Unless PyTorch makes it a
``masked_fill`` (one mask and one value in host memory), a GPU first turns the mask into
positions with ``nonzero``, which copies their count to the host and waits for it: a CUDA
capture refuses that, and the forward falls back. T5Gemma 2's embedding does it,
``input_embeddings[input_ids == eoi] = eoi_embedding``, in its encoder and its decoder's steps
(its capture broke there on an H100). A number written through a mask, ``x[mask] = 0``, is
PyTorch's ``masked_fill`` on a GPU; grape's staging of host constants leaves it so
(``grape.torch.staging``: staged onto the device, the number had made Gemma 3's and Granite
Speech's writes read the count back).

Where the values do not depend on how many places the mask selects (they broadcast over the
selected places: one row written into every selected place, as there), the write is the same
as ``torch.where(mask, values, x)`` copied back into ``x``, which reads no count: no sync, the
same bytes. While :func:`masked_writes` is active that is what runs; a write whose values
carry one entry per selected place (their count known only from the mask) runs as it would,
and a capture still refuses it (``grape.torch.readback`` says so on the CPU too).

``masked_fill`` given its value as a tensor reads that value back on a GPU (PyTorch's CUDA
kernel takes it as a host scalar, ``value.item()``); with the value on the tensor's device it
runs as ``torch.where`` too. A value on the host is PyTorch's as it is (no read back there).
On the CPU, where the probe (``grape.torch.readback``) runs, a number's value is on the
tensor's device and is rewritten too: the same bytes, and what a GPU's masked_fill reads.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["masked_writes", "where_form"]

_aten = torch.ops.aten
_PUTS = {_aten.index_put_.default: True, _aten.index_put.default: False}  # in place?
_FILLS = {_aten.masked_fill_.Tensor: True, _aten.masked_fill.Tensor: False}


def masked_writes() -> _MaskedWrites:
    """A context: while inside, a write through one boolean mask whose values broadcast over
    the selected places runs as ``torch.where`` (see the module); every other call as it would.
    Its ``rewritten`` counts the rewrites made, by the operation each replaced."""
    return _MaskedWrites()


def where_form(x: torch.Tensor, indices: Any, values: torch.Tensor,
               accumulate: bool = False) -> torch.Tensor | None:
    """``x.index_put(indices, values, accumulate)`` without reading the mask's count, or None
    where that cannot be: ``indices`` is not one boolean mask over ``x``'s leading dimensions
    on its device, or ``values`` has a dimension for the selected places (a count only the mask
    knows) that is not 1."""
    if len(indices) != 1 or not isinstance(mask := indices[0], torch.Tensor):
        return None
    if (mask.dtype not in (torch.bool, torch.uint8) or mask.device != x.device
            or mask.dim() > x.dim() or tuple(mask.shape) != tuple(x.shape[:mask.dim()])
            or values.device != x.device or values.dtype != x.dtype):
        return None  # (another dtype: index_put's own error, raised by the original call)
    rest = x.dim() - mask.dim()  # the dimensions each selected place holds
    if values.dim() > rest + 1 or any(
            v not in (1, s) for v, s in zip(reversed(values.shape), reversed(x.shape[-rest:])
                                            if rest else (), strict=False)):
        return None  # not broadcastable to (places, *rest): index_put's own error again
    if values.dim() == rest + 1:
        if values.shape[0] != 1:
            return None  # one entry per selected place: its count is the mask's
        values = values[0]
    chosen = mask.bool().reshape(tuple(mask.shape) + (1,) * rest)
    return torch.where(chosen, x + values if accumulate else values, x)


class _MaskedWrites(TorchDispatchMode):

    def __init__(self) -> None:
        super().__init__()
        # Each rewrite made, by the operation it replaced (what a sweep reports per model).
        self.rewritten: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        written = self._rewritten(func, args, kwargs)
        if written is not None:
            self.rewritten[func.__name__] += 1
            return written
        return func(*args, **kwargs)

    @staticmethod
    def _rewritten(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """What ``func`` returns, computed without reading a count or a value back, or None
        where it runs as it is."""
        if func in _PUTS:
            x, indices, values = (list(args) + [kwargs.get("indices"), kwargs.get("values")])[:3]
            accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
            # (a value in host memory, on a GPU run: PyTorch's masked_fill, left to it)
            if isinstance(values, torch.Tensor):
                written = where_form(x, indices, values, accumulate)
                if written is not None:
                    return x.copy_(written) if _PUTS[func] else written
            return None
        if func in _FILLS:
            x, mask, value = (list(args) + [kwargs.get("mask"), kwargs.get("value")])[:3]
            if (isinstance(value, torch.Tensor) and value.dim() == 0
                    and value.device == x.device == mask.device and mask.dtype == torch.bool):
                # (value.to: masked_fill converts its value to the tensor's dtype; out of
                # place it broadcasts the tensor and the mask together, as where does)
                written = torch.where(mask, value.to(x.dtype), x)
                if not _FILLS[func]:
                    return written
                if written.shape == x.shape:  # else masked_fill_'s own error, from the call
                    return x.copy_(written)
        return None
