"""Device memory: PyTorch's caching allocator, graph memory pools, and executables.

:class:`Pool` follows the CUDA caching allocator's rules closely enough to predict what graph
capture costs: request sizes round up to 512 bytes; requests up to 1 MiB come from 2 MiB
segments, larger ones under 10 MiB from 20 MiB segments, and anything bigger from a segment of
its own rounded up to 2 MiB; a free block is reused best-fit and split (a large one only where
more than 1 MiB is left, as ``should_split`` in PyTorch's ``CUDACachingAllocator.cpp``), and
freed neighbours coalesce. A graph captured into a private pool keeps that pool's segments for
as long as the graph lives, which is why per-shape graphs multiply memory and one shared pool,
captured largest first, does not.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from grape.errors import GrapeError

__all__ = ["FamilyMemory", "Pool", "executable_bytes", "family_memory", "round_size",
           "saved_family_memory", "segment_size"]

KB, MB = 1 << 10, 1 << 20
MIN_BLOCK = 512
SMALL_REQUEST = 1 * MB
SMALL_SEGMENT = 2 * MB
LARGE_SEGMENT = 20 * MB
MIN_LARGE_ALLOC = 10 * MB
ROUND_LARGE = 2 * MB


def round_size(size: int) -> int:
    if size < 0:
        raise GrapeError(f"expected a non-negative allocation size, found {size}")
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """Bytes the allocator asks cudaMalloc for when no cached block fits ``size``."""
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True


@dataclass
class Pool:
    """One memory pool: segments from the device, blocks handed out from them."""

    segments: list[int] = field(default_factory=list)  # sizes
    _free: list[tuple[int, int, int]] = field(default_factory=list)  # (size, segment, offset)
    _blocks: dict[tuple[int, int], _Block] = field(default_factory=dict)
    allocated: int = 0
    peak_allocated: int = 0

    @property
    def reserved(self) -> int:
        return sum(self.segments)

    @property
    def free_blocks(self) -> list[tuple[int, int, int]]:
        """(segment, offset, size) of every cached free block."""
        return sorted((seg, off, size) for size, seg, off in self._free)

    def malloc(self, size: int) -> tuple[int, int]:
        """A block of at least ``size`` bytes: (segment, offset)."""
        size = round_size(size)
        small = size <= SMALL_REQUEST
        i = bisect.bisect_left(self._free, (size, -1, -1))
        # Small and large requests never share a segment, as in the allocator's two pools.
        while i < len(self._free):
            fsize, seg, off = self._free[i]
            if (self.segments[seg] == SMALL_SEGMENT) == small:
                break
            i += 1
        else:
            seg = len(self.segments)
            self.segments.append(segment_size(size))
            fsize, off = self.segments[seg], 0
            self._blocks[(seg, 0)] = _Block(seg, 0, fsize)
            i = bisect.bisect_left(self._free, (fsize, seg, 0))
            self._free.insert(i, (fsize, seg, 0))
        self._free.pop(i)
        block = self._blocks[(seg, off)]
        # Split where the allocator does (should_split): a small block when at least a
        # minimum block is left, a large one only when more than 1 MiB is; otherwise the
        # request takes the whole block.
        if (fsize - size >= MIN_BLOCK) if small else (fsize - size > SMALL_REQUEST):
            rest = _Block(seg, off + size, fsize - size)
            self._blocks[(seg, rest.offset)] = rest
            bisect.insort(self._free, (rest.size, seg, rest.offset))
            block.size = size
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return seg, off

    def free(self, handle: tuple[int, int]) -> None:
        block = self._blocks.get(handle)
        if block is None or block.free:
            raise GrapeError(f"expected an allocated block, found {handle}")
        block.free = True
        self.allocated -= block.size
        after = self._blocks.get((block.segment, block.offset + block.size))
        if after is not None and after.free:  # coalesce with the next block
            self._free.remove((after.size, after.segment, after.offset))
            del self._blocks[(after.segment, after.offset)]
            block.size += after.size
        before = next((b for b in self._blocks.values() if b.segment == block.segment
                       and b.offset + b.size == block.offset and b.free), None)
        if before is not None:  # and with the previous one
            self._free.remove((before.size, before.segment, before.offset))
            del self._blocks[(block.segment, block.offset)]
            before.size += block.size
            block = before
        bisect.insort(self._free, (block.size, block.segment, block.offset))

    def run(self, events: Iterable[tuple[str, int, int]]) -> Pool:
        """Replay ("malloc", id, size) and ("free", id, 0) events; returns self."""
        self.placements(events)
        return self

    def placements(self, events: Iterable[tuple[str, int, int]]) -> list[tuple[int, int]]:
        """Replay ("malloc", id, size) and ("free", id, 0) events: where each malloc was
        placed, (segment, offset), in the order they came."""
        live: dict[int, tuple[int, int]] = {}
        placed = []
        for op, ident, size in events:
            if op == "malloc":
                live[ident] = self.malloc(size)
                placed.append(live[ident])
            elif op == "free":
                if ident not in live:
                    raise GrapeError(f"expected a free of a live allocation, found one of "
                                     f"{ident!r}, never allocated or freed already")
                self.free(live.pop(ident))
            else:
                raise GrapeError(f"expected malloc or free events, found {op!r}")
        return placed


def executable_bytes(nodes: Sequence[int], bytes_per_node: float) -> int:
    """Device memory of instantiated executables of ``nodes`` nodes each: the device profile's
    bytes per node (the driver keeps each node's parameters and launch state on the device)."""
    if any(n < 0 for n in nodes) or not 0 <= bytes_per_node < float("inf"):
        raise GrapeError(f"expected node counts and bytes per node that are not negative, "
                         f"found {list(nodes)[:4]} and {bytes_per_node}")
    return round(sum(nodes) * bytes_per_node)


@dataclass(frozen=True)
class FamilyMemory:
    pool_bytes: int  # reserved by the graphs' memory pools
    graph_bytes: int  # taken by the instantiated executables
    executables: int
    table_bytes: int = 0  # device switches' tables (a family with update="device")

    @property
    def total(self) -> int:
        return self.pool_bytes + self.graph_bytes + self.table_bytes


def family_memory(shapes: Sequence[Sequence[tuple[str, int, int]]], nodes: Sequence[int],
                  bytes_per_node: float, *, shared_pool: bool, shared_executable: bool,
                  largest_first: bool = True) -> FamilyMemory:
    """Memory of graphs captured for several shapes, each given by its allocation events.

    Private pools keep every shape's segments; one shared pool, captured largest first, lets
    every smaller shape live in the largest one's segments (the capture frees what each graph
    allocated before the next capture starts, as PyTorch does for graphs sharing a pool). One
    shared executable instead of one per shape keeps a single graph's worth of device memory.
    """
    if len(shapes) != len(nodes):
        raise GrapeError(f"expected a node count per shape ({len(shapes)}), found {len(nodes)}")
    order = sorted(range(len(shapes)), key=lambda i: -sum(s for op, _, s in shapes[i]
                                                         if op == "malloc"))
    if not largest_first:
        order = list(range(len(shapes)))
    if shared_pool:
        pool = Pool()
        for i in order:
            pool.run(shapes[i])
        pool_bytes = pool.reserved
    else:
        pool_bytes = sum(Pool().run(events).reserved for events in shapes)
    kept = [max(nodes)] if shared_executable else list(nodes)
    return FamilyMemory(pool_bytes, executable_bytes(kept, bytes_per_node), len(kept))


def saved_family_memory(templates: Sequence[tuple[int, int]], scratch: int, tables: int,
                        bytes_per_node: float, alternates: Sequence[int] = ()
                        ) -> tuple[FamilyMemory, FamilyMemory]:
    """A saved family's device memory, priced from the file alone, and that of per-shape
    graphs of its shapes sharing one pool (what serving engines keep). ``templates``: (nodes,
    shapes) for each executable of the family; ``scratch``: its graphs' pool, the scratch
    buffers the file names (``SavedFamily.scratch_buffers``), which per-shape graphs captured
    largest first into one pool hold as well (the largest shape's temporaries); ``tables``:
    the device switches' tables where update="device" (``grape.passes.switch_plan.totals``);
    ``alternates``: each executable's alternates (``grape.passes.variants``), nodes of its
    executable that no per-shape graph has.

    On the H200 (benchmarks/README.md, runs 54 and 55) executables took 2.8 KB a node where
    the device profile's fit, made on small graphs, says 2.5; the pool's segments round its
    blocks up (2 MiB at least), which the scratch's bytes do not."""
    if any(n < 0 or k < 0 for n, k in templates) or scratch < 0 or tables < 0:
        raise GrapeError(f"expected node and shape counts and byte sizes that are not "
                         f"negative, found {list(templates)[:4]}, {scratch} and {tables}")
    extra = list(alternates) or [0] * len(templates)
    if len(extra) != len(templates) or any(a < 0 for a in extra):
        raise GrapeError(f"expected a count of alternates that is not negative for each of "
                         f"the {len(templates)} executables, found {list(alternates)[:4]}")
    family = FamilyMemory(scratch, executable_bytes(
        [n + a for (n, _), a in zip(templates, extra, strict=True)], bytes_per_node),
        len(templates), tables)
    per_shape = FamilyMemory(scratch, executable_bytes([n * k for n, k in templates],
                                                       bytes_per_node),
                             sum(k for _, k in templates))
    return family, per_shape
