"""Whether two kernel graphs do the same thing: both run from one state, what they leave
compared bit for bit.

Derivation (``grape.passes.derive``) asks this of a captured graph and the same graph with some
argument words changed, to learn whether the kernels read those words: PyTorch leaves words of
its argument structs unfilled, and what the host left in them changes with its history, not
with the shape, where no second capture can show it (``derive_lengths``' ``verify``).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from cuda.bindings import driver

from grape.cuda.build import Graph
from grape.cuda.check import call
from grape.cuda.context import read_device, synchronize
from grape.errors import GrapeError
from grape.ir import Buffer, BufferRole, KernelGraph, Memory

__all__ = ["runs_alike", "watched"]


def watched(graph: KernelGraph) -> list[Buffer]:
    """The device buffers a run of ``graph`` may leave changed: all but its parameters (which
    a graph never writes), temporaries included, since a difference in them is one too."""
    out = [b for b in graph.buffers.values()
           if b.memory is Memory.DEVICE and b.role is not BufferRole.PARAMETER]
    if missing := [b.id for b in out if b.address is None]:
        raise GrapeError(f"expected every buffer to compare to have an address, found "
                         f"{len(missing)} without (first: {missing[0]!r})")
    return out


def _write(buffers: Iterable[Buffer], contents: list[bytes]) -> None:
    for b, data in zip(buffers, contents, strict=True):
        host = np.frombuffer(data, dtype=np.uint8)
        call(driver.cuMemcpyHtoD, b.address, host.ctypes.data, len(data),
             doing=f"restoring buffer {b.id!r}")


def _run(graph: KernelGraph, stream: int) -> None:
    with Graph.build(graph) as built, built.instantiate(stream) as executable:
        executable.launch(stream)
        synchronize()


def runs_alike(first: KernelGraph, second: KernelGraph, stream: int = 0) -> bool:
    """Whether ``second`` leaves ``first``'s buffers (:func:`watched`) as ``first`` does,
    both run from the state they are in now, which is restored after: ``first`` runs twice,
    before and after ``second``, and a ``first`` whose two runs differ (atomics, a random
    stream, a counter it bumps) shows nothing, so the answer is then False.

    The two must be of one memory: ``second``'s buffers among ``first``'s (a derived graph and
    the capture of its length, moved to one reference's places). The device is synchronised
    around each run; each run builds, instantiates and frees an executable.

    Raises
    ------
    GrapeError
        ``second`` names a buffer ``first`` does not have, or one lies elsewhere.
    """
    buffers = watched(first)
    for b in second.buffers.values():
        if b.role is not BufferRole.PARAMETER and first.buffers.get(b.id) != b:
            raise GrapeError(f"expected the graphs to compare to share their buffers, found "
                             f"{b.id!r} only in the second or laid out otherwise")
    synchronize()
    before = [read_device(b.address, b.size) for b in buffers]
    left = []
    try:
        for graph in (first, second, first):
            _write(buffers, before)
            _run(graph, stream)
            left.append([read_device(b.address, b.size) for b in buffers])
    finally:
        _write(buffers, before)
    return left[0] == left[2] and left[0] == left[1]
