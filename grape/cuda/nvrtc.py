"""Raw kernels: compiled with NVRTC for the current device, loaded, and launched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from cuda.bindings import driver, nvrtc

from grape.cuda.build import kernel_params
from grape.cuda.check import call
from grape.cuda.context import current_context
from grape.cuda.functions import forget, function_id, param_layout
from grape.cuda.resource import Resource
from grape.errors import CudaError, GrapeError
from grape.ir import Kernel

__all__ = ["Module", "kernel_op", "launch", "pack_args"]


def _arch() -> str:
    ctx = current_context()
    device = call(driver.cuCtxGetDevice, doing="reading the current device")
    del ctx
    attr = driver.CUdevice_attribute
    major = call(driver.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                 device, doing="reading the compute capability")
    minor = call(driver.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                 device, doing="reading the compute capability")
    return f"sm_{major}{minor}"


class Module(Resource):
    """CUDA C++ compiled to a cubin for this device's architecture and loaded."""

    def __init__(self, source: str, name: str = "grape_kernels.cu",
                 options: Sequence[str] = ()) -> None:
        opts = [f"--gpu-architecture={_arch()}".encode(), *(o.encode() for o in options)]
        prog = call(nvrtc.nvrtcCreateProgram, source.encode(), name.encode(), 0, [], [],
                    doing=f"creating the NVRTC program {name}")
        try:
            (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
            if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                size = call(nvrtc.nvrtcGetProgramLogSize, prog, doing="reading the NVRTC log")
                log = b" " * size
                call(nvrtc.nvrtcGetProgramLog, prog, log, doing="reading the NVRTC log")
                first = log.decode(errors="replace").strip().splitlines()[:1]
                raise CudaError(f"{status.name}: {first[0] if first else 'no log'}, while "
                                f"compiling {name}")
            size = call(nvrtc.nvrtcGetCUBINSize, prog, doing=f"sizing the cubin of {name}")
            cubin = b" " * size
            call(nvrtc.nvrtcGetCUBIN, prog, cubin, doing=f"reading the cubin of {name}")
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
        self.name = name
        self.handle = call(driver.cuModuleLoadData, cubin, doing=f"loading {name}")
        self._own(self.handle, driver.cuModuleUnload)

    def function(self, name: str) -> driver.CUfunction:
        """An ``extern "C"`` kernel of the module, known to the IR by its handle."""
        func = call(driver.cuModuleGetFunction, self.handle, name.encode(),
                    doing=f"finding kernel {name} in {self.name}")
        forget(func)  # the address may have been another module's kernel
        function_id(func)
        return func


def pack_args(func: driver.CUfunction, values: Sequence[Any]) -> bytes:
    """Arguments packed as the device expects: numpy scalars and ``bytes`` (structures) as
    they are, ints (pointers, sizes) as little-endian integers of the parameter's size."""
    layout = param_layout(func)
    if len(values) != len(layout):
        raise GrapeError(f"expected {len(layout)} kernel arguments, found {len(values)}")
    out = bytearray(max((p.offset + p.size for p in layout), default=0))
    for i, (p, v) in enumerate(zip(layout, values, strict=True)):
        if isinstance(v, np.generic):
            raw = v.tobytes()
        elif isinstance(v, (bytes, bytearray)):
            raw = bytes(v)
        else:
            raw = int(v).to_bytes(p.size, "little")
        if len(raw) != p.size:
            raise GrapeError(f"expected argument {i} to take {p.size} bytes, found {len(raw)}")
        out[p.offset:p.offset + p.size] = raw
    return bytes(out)


def kernel_op(func: driver.CUfunction, grid: tuple[int, int, int], block: tuple[int, int, int],
              values: Sequence[Any], shared_mem: int = 0) -> Kernel:
    """The IR operation for launching ``func`` with ``values`` (pointers not yet mapped)."""
    ident, name = function_id(func)
    return Kernel(function=ident, name=name, grid=grid, block=block, shared_mem=shared_mem,
                  args=pack_args(func, values), params=param_layout(func))


def launch(func: driver.CUfunction, grid: tuple[int, int, int], block: tuple[int, int, int],
           values: Sequence[Any], stream: Any = 0, shared_mem: int = 0) -> None:
    """``cuLaunchKernel`` with arguments packed by :func:`pack_args`."""
    k = kernel_op(func, grid, block, values, shared_mem)
    p, keep = kernel_params(k)
    call(driver.cuLaunchKernel, func, *grid, *block, shared_mem, stream, p.kernelParams, 0,
         doing=f"launching {k.name}")
    del keep
