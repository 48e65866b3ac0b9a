"""Whether a step's graph depends on the step: two captures of it at different lengths compared.

A step that is to run many times from one capture (the body of a device loop) must issue the
same work every time, with every per-step value read from device memory. A forward that sizes
a kernel by a length it keeps on the host captures a graph whose launch dimensions hold that
step's value, and replays it for ever. Captured at two lengths, such a step gives two graphs
whose kernels differ in function, launch dimensions or shared memory: :func:`step_dependence`
names them.

Argument bytes are not compared: PyTorch passes its elementwise kernels a structure whose
padding holds whatever the host's stack held (on the H200 two captures of one GPT-2 step
differed in bytes 24..509 of an indexing kernel's arguments), so a host-side scalar baked
into the arguments goes unnoticed here, as does a step that switches between persistent tensors
on the host.

Examples
--------
>>> from grape.ir import Kernel, KernelGraph
>>> def captured(length):
...     g = KernelGraph()
...     g.add("k", Kernel("f", "attention", (length, 1, 1), (32, 1, 1)))
...     return g
>>> step_dependence(captured(5), captured(5))
[]
>>> step_dependence(captured(5), captured(6))
["kernel 'attention' (node 'k'): grid differ between the captures"]
"""

from __future__ import annotations

from grape.errors import GraphError
from grape.ir import Kernel, KernelGraph, Memcpy, Memset
from grape.passes.families import match

__all__ = ["step_dependence"]

_LAUNCH = ("function", "grid", "block", "shared_mem", "attributes", "params")


def step_dependence(first: KernelGraph, second: KernelGraph) -> list[str]:
    """How two captures of one step differ in the work they launch (empty: they launch the
    same kernels, copies and memsets, at the same sizes). One line per differing node."""
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
        elif isinstance(a, Memcpy | Memset) and type(a) is type(b):
            fields = ("size",) if isinstance(a, Memcpy) else (
                "value", "element_size", "width", "height", "pitch")
            if any(getattr(a, f) != getattr(b, f) for f in fields):
                found.append(f"{a.kind} node {node!r}: its size or value differs between the "
                             f"captures")
    return found
