"""Device memory that instantiated graphs take.

The driver keeps freed graph memory for reuse, so every measurement trims it first, and
per-executable figures come from many executables instantiated together (one executable's delta
is only as fine as the driver's allocation granularity).
"""

from __future__ import annotations

from dataclasses import dataclass

from cuda.bindings import driver

from grape.cuda.build import Graph
from grape.cuda.check import call
from grape.cuda.context import current_context, memory_info, synchronize

__all__ = ["ExecutableMemory", "executable_memory", "trim"]


def trim() -> None:
    """Give the graph memory the driver caches back to the device."""
    current_context()
    synchronize()
    device = call(driver.cuCtxGetDevice, doing="reading the current device")
    call(driver.cuDeviceGraphMemTrim, device, doing="trimming graph memory")
    synchronize()


@dataclass(frozen=True)
class ExecutableMemory:
    copies: int
    nodes: int
    total_bytes: int  # taken by all copies together
    again_bytes: int  # taken by as many new copies after the first were destroyed

    @property
    def per_executable(self) -> float:
        return self.total_bytes / self.copies

    @property
    def per_node(self) -> float:
        return self.per_executable / max(self.nodes, 1)


def _instantiate_many(graph: Graph, copies: int) -> int:
    """Free device bytes that ``copies`` executables of ``graph`` took; destroys them after."""
    before = memory_info()[0]
    executables = [graph.instantiate() for _ in range(copies)]
    synchronize()
    taken = before - memory_info()[0]
    for e in executables:
        e.close()
    return taken


def executable_memory(graph: Graph, copies: int = 20) -> ExecutableMemory:
    """Device bytes that instantiating and uploading ``graph`` takes, from ``copies`` at once.

    The driver keeps what destroyed executables held for later ones rather than freeing it,
    so a second round (``again_bytes``) shows whether closing gave the memory back for reuse.
    """
    trim()
    total = _instantiate_many(graph, copies)
    again = _instantiate_many(graph, copies)
    return ExecutableMemory(copies, len(graph.ir), total, again)
