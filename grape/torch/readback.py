"""Read-backs a CUDA capture refuses, found on any device.

A captured step must not read a tensor's value on the host (``item``, ``bool``, ``int`` of a
device tensor): the capture breaks, and ``grape.generate`` falls back. On a GPU that is found
by capturing; :func:`as_captured` finds it anywhere, the CPU included, by running the step as a
capture would see it: transformers believes a capture is under way (its ``is_tracing`` says so
during a CUDA capture, and some of its code then asks nothing of the values), and a value read
on the host raises :class:`ReadBack`, naming the model's line that asked
(``grape.torch.capture.culprit``).

As grape's decoders do under a capture, ``torch.arange`` over the cache's length is made on the
device inside (``grape.torch.cache_length.ranged_arange``), and a write through a boolean mask
whose values broadcast over the places it selects runs as ``torch.where``
(``grape.torch.masked_writes``). ``tolist()``, ``cpu()``,
``numpy()`` and ``to("cpu")`` (the device named so), which on the CPU dispatch no read (the
values are there already), are refused by name, and so are operations whose output is sized
by the values they read (``nonzero``, ``torch.where(condition)``, a boolean mask's indexing,
``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` by counts without
``output_size``, a write through a boolean mask of one value per place it selects), which on a
GPU read their count back, and ``torch.equal`` and ``allclose``, whose answer a GPU reads
back; ``one_hot`` given its classes' count runs as on a GPU, where it reads nothing back (on
the CPU it checks its range on the host).
What it cannot see: a copy from pageable host memory into the device (a host constant made
with ``torch.tensor(..., device="cuda")``), which a capture refuses too, and which on the CPU is
no copy at all; and kernels that cannot be captured for other reasons (a CUDA kernel that
copies to the host inside, as ``histc`` of integers does). grape's own capture-time handling of
what would be read acts inside as under a capture (:func:`probing`: a model's checks of device
values, deferred to the device).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from grape.torch.cache_length import ranged_arange
from grape.torch.masked_writes import masked_writes

__all__ = ["ReadBack", "as_captured", "probing"]

# Inside as_captured: grape's own capture-time behaviour that changes what is read (checks
# deferred to the device, grape.torch.deferred_checks) acts as under a capture.
_PROBING: ContextVar[bool] = ContextVar("grape_probing_as_captured", default=False)


def probing() -> bool:
    """Whether the work runs inside :func:`as_captured`."""
    return _PROBING.get()


class ReadBack(RuntimeError):
    """A tensor's value was read on the host where a capture would refuse it."""


# Operations whose output's size depends on the values: on a GPU each copies a count to the
# host and waits for it (a capture refuses that); on the CPU they read nothing.
_SIZED_BY_VALUES = {
    torch.ops.aten.nonzero.default: "nonzero()",  # torch.where(condition) too
    torch.ops.aten.masked_select.default: "masked_select()",
    torch.ops.aten._unique.default: "unique()",
    torch.ops.aten._unique2.default: "unique()",
    torch.ops.aten.unique_dim.default: "unique()",
    torch.ops.aten.unique_consecutive.default: "unique_consecutive()",
    torch.ops.aten.bincount.default: "bincount()",
}


# Answers on the host: on a GPU each reads its result back (a comparison reduced, then item());
# on the CPU the operation itself returns the Python bool, with no read dispatched.
_ANSWERED_ON_THE_HOST = {torch.ops.aten.equal.default: "equal()",
                         torch.ops.aten.allclose.default: "allclose()"}

_INDEX_PUT = (torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default)


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _put_by_mask_reads_back(args: tuple, kwargs: dict) -> bool:
    """Whether ``x[mask] = values`` (``index_put``) reads the mask's count back on a GPU: it
    turns a boolean index into positions (``nonzero``) unless its value lies in host memory
    (PyTorch's ``masked_fill`` then), which on a CPU run cannot be told. Inside
    :func:`as_captured` what reaches here is what ``grape.torch.masked_writes`` leaves as it
    is: values with one entry per selected place, or a mask beside other indices."""
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    return any(_is_mask(i) for i in indices if i is not None)


def _sized_by_values(func: Any, args: tuple, kwargs: dict) -> str | None:
    """What makes ``func`` size its output by the values it reads, where it does."""
    if func in _SIZED_BY_VALUES:
        return _SIZED_BY_VALUES[func]
    if func is torch.ops.aten.index.Tensor and any(
            _is_mask(i) for i in (args[1] if len(args) > 1 else kwargs.get("indices", ()))):
        return "indexing by a boolean mask"
    if func in _INDEX_PUT and _put_by_mask_reads_back(args, kwargs):
        return "a write through a boolean mask"
    if (func in (torch.ops.aten.repeat_interleave.Tensor,
                 torch.ops.aten.repeat_interleave.self_Tensor)
            and kwargs.get("output_size") is None):
        return "repeat_interleave() by a tensor of counts without output_size"
    return None


class _Refusing(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:  # item, bool, int...
            raise ReadBack("a tensor's value read back to the host")
        if func in _ANSWERED_ON_THE_HOST:
            raise ReadBack(f"a comparison answered on the host ({_ANSWERED_ON_THE_HOST[func]}): "
                           f"its result read back")
        if (sized := _sized_by_values(func, args, kwargs)) is not None:
            raise ReadBack(f"an output sized by the values it reads ({sized}): its count "
                           f"read back to the host")
        return func(*args, **kwargs)


# Reads that on the CPU dispatch nothing (the values are there already): asked by name.
_TO_HOST = {torch.Tensor.tolist: "tolist()", torch.Tensor.cpu: "cpu()",
            torch.Tensor.numpy: "numpy()"}


def _one_hot_as_on_a_gpu(input: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    """``one_hot`` (its parameters named as the builtin's) as it reads on a GPU: given the
    classes' count, nothing back to the host (the GPU checks the indices' range by a device
    assert, which this leaves out: an index out of range gives a row of zeros; PyTorch's
    ``one_hot`` reads their minimum and maximum back on the CPU alone); without one, the
    maximum read back there too."""
    if num_classes == -1:
        return torch.nn.functional.one_hot(input, num_classes)
    classes = torch.arange(num_classes, device=input.device)
    return (input.unsqueeze(-1) == classes).to(torch.long)


def _to_the_host(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to``'s arguments name the CPU as the device by name (``"cpu"``). A
    ``torch.device`` says nothing on a CPU run: the model's own device (``x.device``) is the
    CPU there, and on a GPU it is no copy to the host."""
    device = kwargs.get("device", args[0] if args else None)
    return isinstance(device, str) and device.split(":")[0].strip() == "cpu"


class _RefusingByName(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func in _TO_HOST:
            raise ReadBack(f"a tensor's values taken to the host ({_TO_HOST[func]})")
        if func is torch.Tensor.to and _to_the_host(args[1:], kwargs or {}):
            raise ReadBack("a tensor's values taken to the host (to(\"cpu\"))")
        if func is torch.nn.functional.one_hot:
            return _one_hot_as_on_a_gpu(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def as_captured() -> Iterator[Counter[str]]:
    """Inside, the work runs as under a CUDA capture in the two ways above (see the module):
    a read-back raises :class:`ReadBack`. It gives the count of mask writes rewritten so as not
    to read back (``grape.torch.masked_writes``), by the operation each replaced.
    transformers' answer is changed for the whole process while inside (its check is a module
    function): a probe, for one thread at a time (``arch_sweep.py --check-read-backs``,
    tests), not for a server's threads."""
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
        # the device, grape.torch.cache_length; writes through a mask without its count,
        # grape.torch.masked_writes, innermost so that what it cannot rewrite is refused)
        with _Refusing(), _RefusingByName(), ranged_arange(), masked_writes() as rewrites:
            yield rewrites.rewritten
    finally:
        _PROBING.reset(token)
        if saved is not None:
            import_utils.is_cuda_stream_capturing = saved
