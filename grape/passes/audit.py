"""Whether a step's graph depends on the step: two captures of it at different lengths compared.

A step that is to run many times from one capture (the body of a device loop) must issue the
same work every time, with every per-step value read from device memory. A forward that keeps
a counter on the host, or reads a length back and passes it on as a kernel argument, captures
a graph whose argument bytes hold that step's value, and replays it for ever. Captured at two
lengths, such a step gives two graphs whose kernels differ in launch dimensions or in argument
bytes that are not pointers: :func:`step_dependence` names them. Pointers are left out (memory
the capture allocated may lie elsewhere the second time), so a step that switches between
persistent tensors on the host goes unnoticed here.

Examples
--------
>>> from grape.ir import Kernel, KernelGraph, Param
>>> def captured(length):
...     g = KernelGraph()
...     g.add("k", Kernel("f", "index_copy", (1, 1, 1), (32, 1, 1),
...                       args=length.to_bytes(8, "little"), params=(Param(0, 8),)))
...     return g
>>> step_dependence(captured(5), captured(5))
[]
>>> step_dependence(captured(5), captured(6))
["kernel 'index_copy' (node 'k'): argument bytes 0..0 differ between the captures"]
"""

from __future__ import annotations

from grape.errors import GraphError
from grape.ir import Kernel, KernelGraph, Memcpy, Memset
from grape.passes.families import match

__all__ = ["step_dependence"]

_LAUNCH = ("function", "grid", "block", "shared_mem", "attributes", "params")


def _without_pointers(k: Kernel) -> bytearray:
    args = bytearray(k.args)
    for p in k.pointers:
        args[p.offset:p.offset + 8] = bytes(8)
    for h in k.handles:  # conditional handles are the builder's to fill in
        args[h.offset:h.offset + 8] = bytes(8)
    return args


def _differing(a: bytes, b: bytes) -> str:
    first = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    last = max(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    return f"{first}..{last}"


def step_dependence(first: KernelGraph, second: KernelGraph) -> list[str]:
    """How two captures of one step differ, other than where their memory lies (empty: they
    issue the same work). One line per differing node."""
    try:
        pairs = match(first, second)
    except GraphError as e:
        return [f"the captures differ in structure: {e}"]
    found = []
    for node, other in pairs.items():
        a, b = first.op(node), second.op(other)
        if isinstance(a, Kernel) and isinstance(b, Kernel):
            launch = [f for f in _LAUNCH if getattr(a, f) != getattr(b, f)]
            where = f"kernel {a.name!r:.60} (node {node!r})"
            if launch:
                found.append(f"{where}: {', '.join(launch)} differ between the captures")
            elif {p.offset for p in a.pointers} != {p.offset for p in b.pointers}:
                found.append(f"{where}: its pointers lie at other argument offsets")
            elif (x := _without_pointers(a)) != (y := _without_pointers(b)):
                found.append(f"{where}: argument bytes {_differing(x, y)} differ between the "
                             f"captures")
        elif isinstance(a, Memcpy | Memset) and type(a) is type(b):
            fields = ("size",) if isinstance(a, Memcpy) else (
                "value", "element_size", "width", "height", "pitch")
            if any(getattr(a, f) != getattr(b, f) for f in fields):
                found.append(f"{a.kind} node {node!r}: its size or value differs between the "
                             f"captures")
    return found
