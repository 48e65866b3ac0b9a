"""One checker for every driver, runtime and NVRTC call grape makes.

cuda.bindings returns ``(status, *values)`` from each call instead of raising. :func:`call` runs a
call, turns a failure into ``CudaError("CUDA_ERROR_X: explanation, while <what grape was
doing>")`` and returns the values. A missing driver or library surfaces at the first call as one
such error, never at import.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from cuda.bindings import driver, nvrtc, runtime

from grape.errors import CudaError, UnsupportedError

__all__ = ["OBSERVED", "call", "check_status", "device_status", "observe", "observing",
           "rebound"]

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
    if status is driver.CUresult.CUDA_ERROR_INVALID_CONTEXT and rebound():
        status, *values = fn(*args) if _OBSERVER is None else _observed(fn, args)
    check_status(status, doing)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


# Primary contexts this process has retained, by device ordinal: retained once, made current
# in each thread that needs one.
_PRIMARY: dict[int, Any] = {}
_LOCK = threading.Lock()


def _thread_has_context() -> bool:
    status, ctx = driver.cuCtxGetCurrent()
    return status is not driver.CUresult.CUDA_SUCCESS or int(ctx) != 0


def _make_primary_current() -> bool:
    """Make current, in this thread, the primary context of the runtime's device for it (the
    one PyTorch's work in this thread uses)."""
    status, ordinal = runtime.cudaGetDevice()
    if status is not runtime.cudaError_t.cudaSuccess:
        return False
    with _LOCK:
        ctx = _PRIMARY.get(ordinal)
        if ctx is None:
            status, device = driver.cuDeviceGet(ordinal)
            if status is not driver.CUresult.CUDA_SUCCESS:
                return False
            status, ctx = driver.cuDevicePrimaryCtxRetain(device)
            if status is not driver.CUresult.CUDA_SUCCESS:
                return False
            _PRIMARY[ordinal] = ctx
    return driver.cuCtxSetCurrent(ctx)[0] is driver.CUresult.CUDA_SUCCESS


def rebound() -> bool:
    """After a driver call failed with ``CUDA_ERROR_INVALID_CONTEXT``: whether this thread had
    no current context and now has the primary one, so that the call may be made again.

    The runtime API makes a device's primary context current in each thread that uses it, for
    its own calls; the driver API sees none in a thread that has made no driver call of its own
    (a second thread generating with a model whose executables the first built: an H100 ran
    into it). Checked only after such a failure, so the launch path pays nothing."""
    return not _thread_has_context() and _make_primary_current()


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
