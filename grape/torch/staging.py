"""Host constants a forward copies to the GPU, made capturable.

Model code often builds small tensors from Python values on the fly: ``torch.tensor(0.0,
device=...)`` in a mask, a list used as an index (``x[..., [-2], :]``). Eagerly each is a copy
from pageable host memory, which a CUDA graph capture refuses. While :class:`HostConstants` is
active (around a capture), every such copy is staged instead: the value is written into pinned
memory that the caller keeps alive, and the device tensor is filled from there by a copy the
capture records, so every replay reads the same value again.

Two layers see these copies. Most go through the dispatcher as ``_to_copy``/``copy_`` or as an
operation mixing host and device tensors, which a ``TorchDispatchMode`` sees. Two do not:
``torch.tensor(data, device=...)`` and a Python list used as an index build their device tensor
below the dispatcher (PyTorch's ``internal_new_from_data``). A ``TorchFunctionMode`` sees the
Python call and rewrites it into the first kind: the tensor is built on the host and moved with
``.to(device)``, the list index becomes a host index tensor.

That is right only for values that do not change from one step to the next. Each staging
keeps the bytes it staged (:attr:`HostConstants.values`), so that two captures of one step at
different lengths can be compared: a value that differs was computed from host-side state,
and a captured step would freeze it (``grape.torch.api`` refuses such a step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from grape.errors import UnsupportedError

__all__ = ["HostConstants", "PinnedArena"]

_aten = torch.ops.aten
# Copy(dst, src, nbytes, stream): the device copy a capture records.
Copy = Callable[[int, int, int, int], None]


class PinnedArena:
    """Pinned host memory handed out once per staged value, kept while its graphs live.

    ``pin=False`` hands out ordinary host memory: only for exercising staging off the GPU."""

    def __init__(self, nbytes: int = 1 << 16, *, pin: bool = True) -> None:
        self.memory = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        start = -(-self.used // 16) * 16  # 16-byte aligned, as any dtype needs
        if start + nbytes > self.memory.numel():
            raise UnsupportedError(f"expected host constants of at most "
                                   f"{self.memory.numel()} bytes per step, found more")
        self.used = start + nbytes
        return self.memory[start:start + nbytes]


def _host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu"


def _host_array(t: Any) -> bool:
    # 0-dim host tensors are scalars to device kernels (passed by value, never copied).
    return _host(t) and t.dim() > 0


def _cuda_copy(dst: int, src: int, nbytes: int, stream: int) -> None:
    from grape.cuda.context import copy_to_device_async

    copy_to_device_async(dst, src, nbytes, stream)


def _current_stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


class HostConstants:
    """Stage host-to-device copies of constants during a capture (see the module).

    A context manager; it may be entered again for a later capture, and keeps adding to
    :attr:`values`. ``copy`` is the device copy (the driver's asynchronous one by default)."""

    def __init__(self, arena: PinnedArena, device: torch.device | str,
                 copy: Copy = _cuda_copy) -> None:
        self.arena, self.device, self.copy = arena, torch.device(device), copy
        self.values: list[bytes] = []
        self._modes: contextlib.ExitStack | None = None

    def __enter__(self) -> HostConstants:
        with contextlib.ExitStack() as modes:
            # The function mode rewrites what the dispatch mode then stages: entered first.
            modes.enter_context(_Factories(self.device))
            modes.enter_context(_Copies(self))
            self._modes = modes.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        modes, self._modes = self._modes, None
        modes.__exit__(*exc)

    def on_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == self.device.type

    def stage(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (on the host) on the device, copied from pinned memory by a recorded copy."""
        host = t.contiguous()
        raw = host.reshape(-1).view(torch.uint8)
        pinned = self.arena.take(raw.numel())
        pinned.copy_(raw)
        self.values.append(bytes(raw.numpy()))
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        if raw.numel():
            self.copy(out.data_ptr(), pinned.data_ptr(), raw.numel(),
                      _current_stream(self.device))
        return out


class _Copies(TorchDispatchMode):
    """Host-to-device copies the dispatcher sees, staged."""

    def __init__(self, staging: HostConstants) -> None:
        super().__init__()
        self.staging = staging

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        staging = self.staging
        if func is _aten._to_copy.default and _host(args[0]) and torch.device(
                kwargs.get("device") or "cpu").type == staging.device.type:
            staged = staging.stage(args[0])
            rest = {k: v for k, v in kwargs.items() if k in ("dtype", "memory_format")}
            return staged.to(**rest) if rest else staged
        if func is _aten.copy_.default and staging.on_device(args[0]) and _host(args[1]):
            return args[0].copy_(staging.stage(args[1]))
        if func in _VALUE_COPIED and _filled_by_mask(args, kwargs):
            # PyTorch writes a host number through one boolean mask as masked_fill_, the
            # number a kernel's argument: nothing is copied. Staged onto the device, the write
            # would turn positions out of the mask and read their count back (Gemma 3's
            # ``llm_input_ids[special_image_mask] = 0`` broke its capture there on an H100).
            return func(*args, **kwargs)
        moved = False  # whether the call made below is no longer the one the model made
        if (func in _VALUE_COPIED and staging.on_device(args[0]) and len(args) > 2
                and _host(args[2]) and args[2].dim() == 0):
            # ``x[index] = 1`` on a CUDA tensor: PyTorch makes the value a host scalar tensor,
            # which index_put_ then copies to the device itself (Speech2Text's mask).
            args, moved = (args[0], args[1], staging.stage(args[2]), *args[3:]), True
        flat = [*args, *kwargs.values()]
        if (any(staging.on_device(a) for a in _leaves(flat))
                and any(_host_array(a) for a in _leaves(flat))):
            # An op mixing device tensors with host ones (an index tensor): the host ones go
            # to the device first, as the op would have copied them.
            args, kwargs = _replace(args, staging.stage), _replace(kwargs, staging.stage)
            moved = True
        try:
            return func(*args, **kwargs)
        except Exception as e:
            if moved:
                # The call that failed is not the one the model made: say so beside its line
                # (a capture's error names the model's; staging's own part in Gemma 3's
                # broken capture went unseen for a session).
                e.add_note(f"grape.torch.staging had put the host tensors given to "
                           f"{func.__name__} on the device")
            raise


# Operations that copy a host scalar tensor given as their value to the device, where most
# take it as a kernel's argument.
_VALUE_COPIED = {_aten.index_put_.default, _aten.index_put.default,
                 _aten._index_put_impl_.default}


def _filled_by_mask(args: tuple, kwargs: dict) -> bool:
    """Whether PyTorch runs this ``index_put_`` as ``masked_fill_`` with its host value (its
    own test, ``canDispatchToMaskedFill``): no accumulation, one element on the host, and one
    boolean mask on the tensor's device as the only index."""
    named = ("self", "indices", "values", "accumulate")
    # (_index_put_impl_ takes a fifth, unsafe, which does not matter here)
    given = dict(zip(named, args, strict=False)) | {k: v for k, v in kwargs.items()
                                                    if k in named}
    x, indices, value = given.get("self"), given.get("indices") or (), given.get("values")
    masks = [i for i in indices if i is not None]
    return (not given.get("accumulate", False) and isinstance(value, torch.Tensor)
            and _host(value) and value.numel() == 1 and isinstance(x, torch.Tensor)
            and len(masks) == 1 and isinstance(masks[0], torch.Tensor)
            and masks[0].dtype in (torch.bool, torch.uint8) and masks[0].device == x.device)


_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


class _Factories(TorchFunctionMode):
    """Python calls that would copy host data to the device below the dispatcher, rewritten
    into copies the dispatcher sees (see the module)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FROM_DATA:
            device = kwargs.get("device")  # keyword-only in all three
            if device is not None and torch.device(device).type == self.device.type:
                on_host = {k: v for k, v in kwargs.items() if k != "device"}
                return func(*args, **on_host).to(device)
        elif func in _INDEXING and len(args) > 1:
            args = (args[0], _index_lists(args[1]), *args[2:])
        return func(*args, **kwargs)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        _int_list(v) if isinstance(v, list) else isinstance(v, int) for v in value)


def _index_lists(index: Any) -> Any:
    # A list of Python integers (or booleans) as an index is an index tensor PyTorch builds
    # on the indexed tensor's device; build it on the host instead, for the dispatch mode.
    if _int_list(index) and index:
        return torch.tensor(index)
    if isinstance(index, tuple):
        return tuple(_index_lists(i) for i in index)
    return index


def _leaves(values: Any):
    for v in values:
        if isinstance(v, list | tuple):
            yield from _leaves(v)
        else:
            yield v


def _replace(value: Any, stage) -> Any:
    if _host_array(value):
        return stage(value)
    if isinstance(value, list | tuple):
        return type(value)(_replace(v, stage) for v in value)
    if isinstance(value, dict):
        return {k: _replace(v, stage) for k, v in value.items()}
    return value
