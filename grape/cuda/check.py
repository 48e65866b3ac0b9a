"""One checker for every driver, runtime and NVRTC call grape makes.

cuda.bindings returns ``(status, *values)`` from each call instead of raising. :func:`call` runs a
call, turns a failure into ``CudaError("CUDA_ERROR_X: explanation, while <what grape was
doing>")`` and returns the values. A missing driver or library surfaces at the first call as one
such error, never at import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cuda.bindings import driver, nvrtc, runtime

from grape.errors import CudaError, UnsupportedError

__all__ = ["call", "device_status"]

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
        status, *values = fn(*args)
    except RuntimeError as e:  # cuda.bindings loads libcuda/libnvrtc lazily, at the first call
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "not found" in first_line and "Function" in first_line:
            # The library loaded, but this driver predates the entry point.
            raise UnsupportedError(f"the installed driver lacks {getattr(fn, '__name__', fn)} "
                                   f"(a newer driver has it), while {doing}") from None
        raise CudaError(f"no usable CUDA library ({first_line}), while {doing}") from None
    if status not in _OK:
        raise CudaError(f"{_describe(status)}, while {doing}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


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
