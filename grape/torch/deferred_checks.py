"""Model code's checks of device values, held on the device until a launch's result is read.

transformers checks a forward's inputs against what it computed from them with
``torch_compilable_check(cond, message)``: a vision-language model's prompt, that its image
tokens number the image features (LLaVA and every model built like it), with ``cond`` a device
tensor and ``message`` an f-string of device values. Eagerly each reads the device twice: the
f-string formats a 0-dim tensor (its value, read back), and the check reads ``cond``. A CUDA
capture refuses both, so on the H100 grape ran every such prompt eagerly before its launch.

While :meth:`DeferredChecks.deferring` is active in a capture, a tensor check folds its
condition into a device value, ``failed`` (the number of the first check that failed, 0 while
none has), captured with the forward; a device tensor formatted into a message keeps its
place (``<... on the device>``) instead of being read. The message is recorded with its
check at capture time. After a launch the owner reads ``failed`` with the result (the stream
has drained by then) and :meth:`~DeferredChecks.raise_failed` raises the failed check's error,
of the type eager code would have raised. Outside a capture, and in any other thread, both
behave as PyTorch's own: the wrappers act in the context that entered the block alone.

A failure that a later kernel itself asserts on the device comes first: LLaVA's prompt with
more image tokens than image features goes on to a ``masked_scatter`` with more places than
values, which CUDA's kernel checks with a device-side assert, ending the process's CUDA context
(as that forward does under ``torch.compile``'s CUDA graphs). Fewer tokens than features, and
checks no kernel repeats, are raised as described.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from grape.torch.control import capturing
from grape.torch.readback import probing

__all__ = ["DeferredChecks"]

# Inside DeferredChecks.deferring, during a capture: the checks taking the conditions.
_ACTIVE: ContextVar[DeferredChecks | None] = ContextVar("grape_deferred_checks", default=None)


def _active() -> DeferredChecks | None:
    checks = _ACTIVE.get()
    return checks if checks is not None and (capturing() or probing()) else None


class DeferredChecks:
    """A generation's deferred checks (see the module): ``failed`` on ``device``, and each
    check's error type and message by number."""

    def __init__(self, device: torch.device | str) -> None:
        self.failed = torch.zeros((), dtype=torch.long, device=device)
        self.recorded: list[tuple[type[BaseException], str]] = []

    def reset(self) -> None:
        """At the start of each generation (captured with its prompt, where it is)."""
        self.failed.zero_()

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Inside the block, during a capture (or ``grape.torch.readback``'s probe of one),
        tensor checks are deferred to the device and device tensors formatted into messages
        are not read (see the module). Anywhere else the block changes nothing: PyTorch's
        functions are not even wrapped, so an eager forward pays nothing for it."""
        if not (capturing() or probing()):
            yield
            return
        token = _ACTIVE.set(self)
        try:
            with _wrapped():
                yield
        finally:
            _ACTIVE.reset(token)

    def defer(self, error_type: type[BaseException], cond: torch.Tensor,
              message: Any) -> None:
        """Record a check of ``cond`` (a bool tensor, every element true), its failure folded
        into ``failed`` on the device if no earlier check failed."""
        text = message() if callable(message) else message
        self.recorded.append((error_type, str(text) if text is not None
                              else "Expected cond to be True"))
        number = len(self.recorded)
        broke = torch.logical_and(self.failed == 0, torch.logical_not(cond.all()))
        self.failed.copy_(torch.where(broke, number, self.failed))

    def raise_failed(self) -> None:
        """After a launch, its result read back: raise the first failed check's error."""
        if not self.recorded:
            return
        number = int(self.failed.item())
        if number:
            error_type, message = self.recorded[number - 1]
            raise error_type(message)


def _placeholder(t: torch.Tensor) -> str:
    return f"<{'x'.join(map(str, t.shape)) or 'scalar'} {t.dtype} on the device>"


def _check_tensor_all_with(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def check(error_type: Any, cond: Any, message: Any = None) -> None:
        checks = _active()
        if checks is None or not isinstance(cond, torch.Tensor) or (
                cond.device != checks.failed.device):
            return original(error_type, cond, message)
        if cond.dtype != torch.bool:
            return original(error_type, cond, message)  # (its own TypeError, eagerly)
        if message is None:
            error_type, message = _callers_check(error_type)
        checks.defer(error_type, cond, message)
    check.grape_original = original  # type: ignore[attr-defined]
    return check


def _callers_check(error_type: Any) -> tuple[Any, Any]:
    """The error type and message of the transformers check that called PyTorch's without
    them: while it thinks it is traced (a CUDA capture, to transformers), its
    ``torch_compilable_check`` gives PyTorch the condition alone, as a compiler's hint. Found
    in its frame, a few calls up; ``(error_type, None)`` where there is none."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            break
        if frame.f_code.co_name == "torch_compilable_check":
            found = frame.f_locals
            return found.get("error_type", error_type), found.get("msg")
        frame = frame.f_back
    return error_type, None


def _format(original: Callable[..., str]) -> Callable[..., str]:
    @functools.wraps(original)
    def format_(self: torch.Tensor, spec: str) -> str:
        checks = _active()
        if checks is not None and (self.device.type != "cpu"
                                   or self.device == checks.failed.device):
            return _placeholder(self)
        return original(self, spec)
    format_.grape_original = original  # type: ignore[attr-defined]
    return format_


# Blocks open, over every thread: PyTorch's functions stay wrapped while any is.
_OPEN = [0]
_LOCK = threading.Lock()


@contextlib.contextmanager
def _wrapped() -> Iterator[None]:
    """PyTorch's tensor check and ``Tensor.__format__`` wrapped while any block lasts (the
    wrappers act for the context that entered a block alone)."""
    with _LOCK:
        if _OPEN[0] == 0:
            torch._check_tensor_all_with = _check_tensor_all_with(torch._check_tensor_all_with)
            torch.Tensor.__format__ = _format(torch.Tensor.__format__)
        _OPEN[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _OPEN[0] -= 1
            if _OPEN[0] == 0:
                torch._check_tensor_all_with = torch._check_tensor_all_with.grape_original
                torch.Tensor.__format__ = torch.Tensor.__format__.grape_original
