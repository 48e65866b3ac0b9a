"""The CUDA context grape works in: the device's primary context, shared with PyTorch."""

from __future__ import annotations

from cuda.bindings import driver

from grape.cuda.check import call

__all__ = ["copy_to_device_async", "current_context", "memory_info", "synchronize"]


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
