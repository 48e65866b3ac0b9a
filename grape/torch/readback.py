"""Read-backs a CUDA capture refuses, found on any device.

A captured step must not read a tensor's value on the host (``item``, ``bool``, ``int`` of a
device tensor): the capture breaks, and ``grape.generate`` falls back. On a GPU that is found
by capturing; :func:`as_captured` finds it anywhere, the CPU included, by running the step as a
capture would see it: transformers believes a capture is under way (its ``is_tracing`` says so
during a CUDA capture, and some of its code then asks nothing of the values), and a value read
on the host raises :class:`ReadBack`, naming the model's line that asked
(``grape.torch.capture.culprit``).

As grape's decoders do under a capture, ``torch.arange`` over the cache's length is made on the
device inside (``grape.torch.cache_length.ranged_arange``). ``tolist()``, ``cpu()`` and
``numpy()``, which on the CPU dispatch no read (the values are
there already), are refused by name. What it cannot see: a copy from pageable host memory into
the device (a host constant made with ``torch.tensor(..., device="cuda")``), which a capture
refuses too, and which on the CPU is no copy at all; a ``.to("cpu")``; and kernels that cannot
be captured for other reasons (a CUDA kernel that copies to the host inside, as ``histc`` of
integers does). grape's own capture-time handling of what would be read acts inside as under a
capture (:func:`probing`: a model's checks of device values, deferred to the device).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from grape.torch.cache_length import ranged_arange

__all__ = ["ReadBack", "as_captured", "probing"]

# Inside as_captured: grape's own capture-time behaviour that changes what is read (checks
# deferred to the device, grape.torch.deferred_checks) acts as under a capture.
_PROBING: ContextVar[bool] = ContextVar("grape_probing_as_captured", default=False)


def probing() -> bool:
    """Whether the work runs inside :func:`as_captured`."""
    return _PROBING.get()


class ReadBack(RuntimeError):
    """A tensor's value was read on the host where a capture would refuse it."""


class _Refusing(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:  # item, bool, int...
            raise ReadBack("a tensor's value read back to the host")
        return func(*args, **(kwargs or {}))


# Reads that on the CPU dispatch nothing (the values are there already): asked by name.
_TO_HOST = {torch.Tensor.tolist: "tolist()", torch.Tensor.cpu: "cpu()",
            torch.Tensor.numpy: "numpy()"}


class _RefusingByName(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func in _TO_HOST:
            raise ReadBack(f"a tensor's values taken to the host ({_TO_HOST[func]})")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def as_captured() -> Iterator[None]:
    """Inside, the work runs as under a CUDA capture in the two ways above (see the module):
    a read-back raises :class:`ReadBack`. transformers' answer is changed for the whole
    process while inside (its check is a module function): a probe, for one thread at a time
    (``arch_sweep.py --check-read-backs``, tests), not for a server's threads."""
    try:
        from transformers.utils import import_utils
    except ImportError:  # pragma: no cover - without transformers, nothing to persuade
        import_utils = None
    saved = getattr(import_utils, "is_cuda_stream_capturing", None)
    if saved is not None:
        import_utils.is_cuda_stream_capturing = lambda: True
    token = _PROBING.set(True)
    try:
        # (as grape's decoders do under a capture: positions over the cache's length made on
        # the device, grape.torch.cache_length)
        with _Refusing(), _RefusingByName(), ranged_arange():
            yield
    finally:
        _PROBING.reset(token)
        if saved is not None:
            import_utils.is_cuda_stream_capturing = saved
