"""One checker for every driver, runtime and NVRTC call grape makes.

cuda.bindings returns ``(status, *values)`` from each call instead of raising. :func:`call` runs a
call, turns a failure into ``CudaError("CUDA_ERROR_X: explanation, while <what grape was
doing>")`` and returns the values. A missing driver or library surfaces at the first call as one
such error, never at import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from cuda.bindings import driver, nvrtc, runtime

from grape.errors import CudaError, UnsupportedError

__all__ = ["OBSERVED", "call", "check_status", "device_status", "observe", "observing"]

# Driver calls whose host time and GPU work a trace of grape's own runs needs: the launches, and
# what brings an executable to a shape before one. torch.profiler does not record cuda-python's
# driver calls, so grape marks them itself while an observer is set (:func:`observe`).
OBSERVED = frozenset({"cuGraphLaunch", "cuGraphExecUpdate", "cuGraphExecKernelNodeSetParams",
                      "cuGraphExecMemsetNodeSetParams", "cuGraphExecMemcpyNodeSetParams",
                      "cuGraphExecNodeSetParams", "cuGraphInstantiate",
                      "cuGraphInstantiateWithParams"})
_OBSERVER: Callable[[str], Any] | None = None


@contextlib.contextmanager
def observe(span: Callable[[str], Any]) -> Iterator[None]:
    """Inside the block, every :data:`OBSERVED` driver call runs inside ``span(name)``, a
    context manager (``torch.profiler.record_function`` under ``f"grape:{name}"``, say), so that a
    profiler's trace holds the call, and the GPU work a launch caused can be given to it
    (``grape.kineto``)."""
    global _OBSERVER
    before, _OBSERVER = _OBSERVER, span
    try:
        yield
    finally:
        _OBSERVER = before

_OK = (driver.CUresult.CUDA_SUCCESS, runtime.cudaError_t.cudaSuccess,
       nvrtc.nvrtcResult.NVRTC_SUCCESS)


def _describe(status: Any) -> str:
    """``NAME: explanation`` for a failed status of any of the three APIs."""
    if isinstance(status, driver.CUresult):
        _, name = driver.cuGetErrorName(status)
        _, text = driver.cuGetErrorString(status)
    elif isinstance(status, runtime.cudaError_t):
        _, name = runtime.cudaGetErrorName(status)
        _, text = runtime.cudaGetErrorString(status)
    else:
        name, text = status.name.encode(), nvrtc.nvrtcGetErrorString(status)[1]
    return f"{name.decode()}: {text.decode()}"


def call(fn: Callable[..., tuple], *args: Any, doing: str) -> Any:
    """Run ``fn(*args)``; return its value (a tuple if several, None if none) or raise.

    Raises
    ------
    CudaError
        The call failed, or the driver or library it needs could not be loaded.
    UnsupportedError
        The driver has no such entry point (older than the bindings).
    """
    try:
        if _OBSERVER is None:  # the launch path: nothing more than the call
            status, *values = fn(*args)
        else:
            status, *values = _observed(fn, args)
    except RuntimeError as e:  # cuda.bindings loads libcuda/libnvrtc lazily, at the first call
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "not found" in first_line and "Function" in first_line:
            # The library loaded, but this driver predates the entry point.
            raise UnsupportedError(f"the installed driver lacks {getattr(fn, '__name__', fn)} "
                                   f"(a newer driver has it), while {doing}") from None
        raise CudaError(f"no usable CUDA library ({first_line}), while {doing}") from None
    check_status(status, doing)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def check_status(status: Any, doing: str) -> None:
    """Raise what :func:`call` raises for a failed ``status``; for loops that make the calls
    themselves (:meth:`grape.cuda.build.Graph.apply`)."""
    if status not in _OK:
        raise CudaError(f"{_describe(status)}, while {doing}")


def observing() -> bool:
    """Whether an observer is set (:func:`observe`): then every call goes through :func:`call`."""
    return _OBSERVER is not None


def _observed(fn: Callable[..., tuple], args: tuple) -> tuple:
    name = getattr(fn, "__name__", "")
    if name not in OBSERVED:
        return fn(*args)
    with _OBSERVER(name):
        return fn(*args)


def device_status() -> tuple[bool, str]:
    """Whether a CUDA device can be used here, and if not, why (for skips and messages)."""
    try:
        call(driver.cuInit, 0, doing="initialising the CUDA driver")
        count = call(driver.cuDeviceGetCount, doing="counting CUDA devices")
    except CudaError as e:
        return False, str(e)
    if count < 1:
        return False, "the CUDA driver reports no devices"
    device = call(driver.cuDeviceGet, 0, doing="opening device 0")
    name = call(driver.cuDeviceGetName, 64, device, doing="naming device 0")
    return True, name.split(b"\0")[0].decode()
