"""The CUDA context grape works in: the device's primary context, shared with PyTorch."""

from __future__ import annotations

from cuda.bindings import driver

from grape.cuda.check import call
from grape.errors import GrapeError

__all__ = ["copy_to_device_async", "current_context", "fill_u64_async", "memory_info",
           "read_device", "synchronize"]


def current_context(device: int = 0) -> driver.CUcontext:
    """The current context, making the device's primary one current if none is.

    PyTorch and the runtime API use the primary context, so graphs grape builds and graphs
    PyTorch captured live in the same one.
    """
    call(driver.cuInit, 0, doing="initialising the CUDA driver")
    ctx = call(driver.cuCtxGetCurrent, doing="reading the current context")
    if int(ctx) == 0:
        dev = call(driver.cuDeviceGet, device, doing=f"opening device {device}")
        ctx = call(driver.cuDevicePrimaryCtxRetain, dev,
                   doing=f"retaining device {device}'s primary context")
        call(driver.cuCtxSetCurrent, ctx, doing="making the primary context current")
    return ctx


def memory_info() -> tuple[int, int]:
    """(free, total) device bytes, as the driver sees them."""
    return call(driver.cuMemGetInfo, doing="reading free device memory")


def synchronize() -> None:
    call(driver.cuCtxSynchronize, doing="waiting for the device")


def copy_to_device_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``nbytes`` from host address ``src`` (pinned memory) to device address ``dst``, queued on
    ``stream``: under a capture, a memcpy node that reads ``src`` at every launch."""
    call(driver.cuMemcpyHtoDAsync, dst, src, nbytes, stream,
         doing="copying host memory to the device")


def fill_u64_async(dst: int, value: int, stream: int) -> None:
    """Write the 64-bit ``value`` at device address ``dst`` (8-byte aligned), queued on
    ``stream``: two 32-bit memsets, so that no host memory has to outlive the call."""
    if not 0 <= value < 1 << 64 or dst % 8:
        raise GrapeError(f"expected a 64-bit unsigned value and an 8-byte aligned address, "
                         f"found {value} at {dst:#x}")
    for half, word in ((0, value & 0xFFFFFFFF), (4, value >> 32)):
        call(driver.cuMemsetD32Async, dst + half, word, 1, stream,
             doing="writing a 64-bit value on the device")


def read_device(src: int, nbytes: int) -> bytes:
    """``nbytes`` at device address ``src``, copied to the host (synchronous)."""
    import numpy as np

    out = np.zeros(nbytes, dtype=np.uint8)
    call(driver.cuMemcpyDtoH, out.ctypes.data, src, nbytes, doing="reading device memory")
    return out.tobytes()
