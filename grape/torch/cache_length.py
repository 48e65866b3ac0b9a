"""The cache's length as a forward sees it: a device count whose host-side questions are
answered from the range it can take.

A captured step cannot read the cache's length back to the host: the graph must serve every
length. Most models use the length (``get_seq_length()``, a 0-dim device tensor for a static
cache) only in tensor arithmetic, which a graph holds. Some ask the host a question about it:
``torch.arange(past, past + n)`` for their positions (RoFormer, TrOCR, MVP), or
``if past + n + offset > self.weights.size(0)`` to grow a sinusoidal table (XGLM, M2M-100,
NLLB-MoE, SeamlessM4T). Each such question is a read-back, which breaks a capture.

:class:`CacheLength` is the same count, as a tensor (every kernel reads it where it lies), that
also knows on the host that its value lies in ``[low, high]`` (the static cache's size bounds
it) and which host integer has been added to it. Arithmetic with integers keeps both; then

* ``torch.arange(a, b)`` of two such values over the same count has ``b - a`` known on the
  host: it is made as ``a + arange(b - a)``, on the device, whatever the count (inside
  ``ranged_arange``: ``torch.arange`` reads a tensor given as a number before any
  tensor subclass is asked, so only a mode, :func:`ranged_arange`, sees the call);
* a comparison with an integer that the range decides (``past + 66 > 1026`` for every ``past``
  up to 512) answers on the host without reading anything;
* anything else is the plain tensor operation, read-backs included: a question the range does
  not decide reads the value as before (eagerly, it is answered; under a capture, the capture
  breaks and grape falls back, naming the line, as it did).

Every result other than those is a plain tensor: the count's bounds go no further than the
integer arithmetic and comparisons above.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CacheLength", "ranged_arange"]

_SHIFTS: dict[Any, Callable[[int, int], int]] = {
    torch.Tensor.__add__: operator.add, torch.Tensor.__radd__: operator.add,
    torch.add: operator.add, torch.Tensor.add: operator.add,
    torch.Tensor.__sub__: operator.sub, torch.sub: operator.sub, torch.Tensor.sub: operator.sub,
}
_COMPARISONS: dict[Any, Callable[[int, int], bool]] = {
    torch.Tensor.__gt__: operator.gt, torch.gt: operator.gt, torch.Tensor.gt: operator.gt,
    torch.Tensor.__ge__: operator.ge, torch.ge: operator.ge, torch.Tensor.ge: operator.ge,
    torch.Tensor.__lt__: operator.lt, torch.lt: operator.lt, torch.Tensor.lt: operator.lt,
    torch.Tensor.__le__: operator.le, torch.le: operator.le, torch.Tensor.le: operator.le,
}
# What a host question asks of a tensor: its truth, or its value as a number.
_QUESTIONS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.__int__,
              torch.Tensor.__index__}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CacheLength(torch.Tensor):
    """A 0-dim long device tensor (sharing the count's memory) equal to ``count + offset``,
    whose value lies in ``[low, high]``; see the module."""

    _count: torch.Tensor
    _offset: int
    _low: int
    _high: int

    @staticmethod
    def of(count: torch.Tensor, low: int, high: int) -> CacheLength:
        """``count`` (a 0-dim long tensor), known to lie in ``[low, high]``."""
        return CacheLength._made(count, count, 0, low, high)

    @staticmethod
    def _made(value: torch.Tensor, count: torch.Tensor, offset: int, low: int,
              high: int) -> CacheLength:
        made = torch.Tensor._make_subclass(CacheLength, value)
        made._count, made._offset, made._low, made._high = count, offset, low, high
        return made

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if len(args) == 2 and not kwargs:
            a, b = args
            if func in _SHIFTS and isinstance(a, CacheLength) and _is_int(b):
                k = _SHIFTS[func](0, b)  # (b added, or taken away)
                return CacheLength._made(out, a._count, a._offset + k, a._low + k, a._high + k)
            if func in _COMPARISONS and isinstance(a, CacheLength) and _is_int(b):
                at_low, at_high = (_COMPARISONS[func](x, b) for x in (a._low, a._high))
                # Monotone in the value: decided where both ends of the range agree.
                if at_low == at_high:
                    return _Decided._made(out, at_low)
        return out


class _Decided(torch.Tensor):
    """A comparison's result (a 0-dim bool tensor, as computed) whose truth the range decided
    on the host: asked for it, it answers without reading the device."""

    _answer: bool

    @staticmethod
    def _made(value: torch.Tensor, answer: bool) -> _Decided:
        made = torch.Tensor._make_subclass(_Decided, value)
        made._answer = answer
        return made

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func in _QUESTIONS and isinstance(args[0], _Decided):
            return args[0]._answer if func is torch.Tensor.__bool__ else int(args[0]._answer)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _arange(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """``torch.arange(start, end)`` of two lengths over one count, made on the device; None
    for any other call."""
    positional, named = list(args), dict(kwargs)
    start = positional.pop(0) if positional else named.pop("start", None)
    end = positional.pop(0) if positional else named.pop("end", None)
    step = positional.pop(0) if positional else named.pop("step", 1)
    if positional or named.get("out") is not None or not (_is_int(step) and step == 1):
        return None
    if not (isinstance(start, CacheLength) and isinstance(end, CacheLength)
            and start._count is end._count):
        return None
    dtype = named.pop("dtype", None) or torch.long
    device = named.pop("device", None) or start.device
    with torch._C.DisableTorchFunctionSubclass():
        steps = torch.arange(max(end._offset - start._offset, 0), device=device, dtype=dtype,
                             **named)
        return steps + start.to(device=device, dtype=dtype)


def ranged_arange() -> TorchFunctionMode:
    """A context: while inside, ``torch.arange(a, b)`` of two :class:`CacheLength` values over
    one count is made on the device (see the module); every other call runs as it would."""
    return _RangedArange()


class _RangedArange(TorchFunctionMode):

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.arange:
            made = _arange(*args, **kwargs)
            if made is not None:
                return made
        return func(*args, **kwargs)
