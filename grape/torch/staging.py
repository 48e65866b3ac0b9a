"""Host constants a forward copies to the GPU, made capturable.

Model code often builds small tensors from Python values on the fly: ``torch.tensor(0.0,
device=...)`` in a mask, a list used as an index (``x[..., [-2], :]``). Eagerly each is a copy
from pageable host memory, which a CUDA graph capture refuses. While :class:`HostConstants` is
active (a ``TorchDispatchMode``, around a capture), every such copy is staged instead: the
value is written into pinned memory that the caller keeps alive, and the device tensor is
filled from there by a copy the capture records, so every replay reads the same value again.

That is right only for values that do not change from one step to the next. Each staging
keeps the bytes it staged (:attr:`HostConstants.values`), so that two captures of one step at
different lengths can be compared: a value that differs was computed from host-side state,
and a captured step would freeze it (``grape.torch.api`` refuses such a step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grape.errors import UnsupportedError

__all__ = ["HostConstants", "PinnedArena"]

_aten = torch.ops.aten


class PinnedArena:
    """Pinned host memory handed out once per staged value, kept while its graphs live."""

    def __init__(self, nbytes: int = 1 << 16) -> None:
        self.memory = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        start = -(-self.used // 16) * 16  # 16-byte aligned, as any dtype needs
        if start + nbytes > self.memory.numel():
            raise UnsupportedError(f"expected host constants of at most "
                                   f"{self.memory.numel()} bytes per step, found more")
        self.used = start + nbytes
        return self.memory[start:start + nbytes]


def _cpu(t: Any) -> bool:
    # 0-dim CPU tensors are scalars to CUDA kernels (passed by value, never copied).
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0


class HostConstants(TorchDispatchMode):
    """Stage host-to-device copies of constants during a capture (see the module)."""

    def __init__(self, arena: PinnedArena, device: torch.device) -> None:
        super().__init__()
        self.arena, self.device = arena, device
        self.values: list[bytes] = []

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        from grape.cuda.context import copy_to_device_async

        host = t.contiguous()
        raw = host.reshape(-1).view(torch.uint8)
        pinned = self.arena.take(raw.numel())
        pinned.copy_(raw)
        self.values.append(bytes(raw.numpy()))
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        copy_to_device_async(out.data_ptr(), pinned.data_ptr(), raw.numel(),
                             torch.cuda.current_stream(self.device).cuda_stream)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._to_copy.default and _cpu(args[0]) and torch.device(
                kwargs.get("device") or "cpu").type == "cuda":
            staged = self._stage(args[0])
            rest = {k: v for k, v in kwargs.items() if k in ("dtype", "memory_format")}
            return staged.to(**rest) if rest else staged
        if func is _aten.copy_.default and args[0].is_cuda and _cpu(args[1]):
            return args[0].copy_(self._stage(args[1]))
        flat = [*args, *kwargs.values()]
        on_device = any(isinstance(a, torch.Tensor) and a.is_cuda for a in _leaves(flat))
        if on_device and any(_cpu(a) for a in _leaves(flat)):
            # An op mixing device tensors with host ones (an index built from a list): the
            # host ones go to the device first, as the op would have copied them.
            args, kwargs = _replace(args, self._stage), _replace(kwargs, self._stage)
        return func(*args, **kwargs)


def _leaves(values: Any):
    for v in values:
        if isinstance(v, list | tuple):
            yield from _leaves(v)
        else:
            yield v


def _replace(value: Any, stage) -> Any:
    if _cpu(value):
        return stage(value)
    if isinstance(value, list | tuple):
        return type(value)(_replace(v, stage) for v in value)
    if isinstance(value, dict):
        return {k: _replace(v, stage) for k, v in value.items()}
    return value
