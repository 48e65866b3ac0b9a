"""Kernel functions: their identity in the IR, their parameter layout, and back to handles.

The IR names a function ``<mangled name>@<handle>``. The handle is what tells functions apart
(cuDNN builds different functions with the same name); it is only meaningful in the process
that captured it, so a graph can be rebuilt only where its functions were seen.
"""

from __future__ import annotations

from cuda.bindings import driver

from grape.cuda.check import call
from grape.errors import CudaError, GrapeError
from grape.ir import Param

__all__ = ["function_id", "param_layout", "resolve"]

_seen: dict[str, driver.CUfunction] = {}
_layouts: dict[int, tuple[Param, ...]] = {}
_names: dict[int, str] = {}


def _name(func: driver.CUfunction) -> str:
    key = int(func)
    if key not in _names:
        raw = call(driver.cuFuncGetName, func, doing="naming a kernel function")
        _names[key] = raw.decode() if isinstance(raw, bytes) else str(raw)
    return _names[key]


def function_id(func: driver.CUfunction) -> tuple[str, str]:
    """(identity for the IR, mangled name) of ``func``; remembers it for :func:`resolve`."""
    name = _name(func)
    ident = f"{name}@{int(func):#x}"
    # A handle read from a struct field is a view into that struct's memory, dangling once the
    # struct is collected: keep a handle of our own.
    _seen.setdefault(ident, driver.CUfunction(int(func)))
    return ident, name


def forget(func: driver.CUfunction) -> None:
    """Drop what is remembered about the function at ``func``'s address: a module loaded
    where an unloaded one was can hand out another kernel at the same address (seen on the
    H200: a one-parameter kernel's layout served for a two-parameter one)."""
    address = int(func)
    _layouts.pop(address, None)
    _names.pop(address, None)
    for ident in [i for i, f in _seen.items() if int(f) == address]:
        del _seen[ident]


def param_layout(func: driver.CUfunction) -> tuple[Param, ...]:
    """Offsets and sizes of ``func``'s parameters in the packed argument bytes.

    ``cuFuncGetParamCount`` is missing from some drivers (580 among them), so parameters are
    read one by one until the driver says there is none at that index.
    """
    key = int(func)
    if key not in _layouts:
        params = []
        while True:
            status, offset, size = driver.cuFuncGetParamInfo(func, len(params))
            if status != driver.CUresult.CUDA_SUCCESS:
                break
            params.append(Param(offset, size))
        _layouts[key] = tuple(params)
    return _layouts[key]


def resolve(ident: str) -> driver.CUfunction:
    """The handle behind an IR function identity seen in this process."""
    func = _seen.get(ident)
    if func is None:
        raise GrapeError(f"expected a kernel function captured in this process, found {ident!r} "
                         f"(graphs from another process can be inspected and simulated, not "
                         f"rebuilt)")
    return func


def register(func: driver.CUfunction) -> str:
    """Make a function grape loaded itself (NVRTC) resolvable; returns its identity."""
    try:
        return function_id(func)[0]
    except CudaError as e:
        raise CudaError(f"{e} (is the module still loaded?)") from None
