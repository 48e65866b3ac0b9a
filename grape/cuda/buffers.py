"""From device addresses to the IR's buffer table.

Named ranges (a frontend's input, output and parameter tensors) are matched first, then the
blocks a frontend's allocator says are live (each an internal buffer of its own); any other
address that the driver knows as device memory becomes an internal buffer spanning its whole
allocation (for PyTorch, a caching-allocator segment).
"""

from __future__ import annotations

from bisect import bisect_right, insort

from cuda.bindings import driver

from grape.ir import Buffer, BufferRole, KernelGraph, Memory, Pointer, Span

__all__ = ["BufferMap"]

# Canonical user-space addresses of x86-64 and AArch64; smaller words are sizes and flags.
_LOWEST, _HIGHEST = 1 << 16, 1 << 57


class _Ranges:
    """Disjoint address ranges, each to a buffer, found by bisection."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ranges: dict[int, tuple[int, Buffer]] = {}

    def add(self, start: int, size: int, buffer: Buffer) -> Buffer:
        if start in self._ranges:  # a second view of the same memory keeps the first name
            return self._ranges[start][1]
        insort(self._starts, start)
        self._ranges[start] = (start + size, buffer)
        return buffer

    def find(self, address: int) -> tuple[int, Buffer] | None:
        i = bisect_right(self._starts, address) - 1
        if i < 0:
            return None
        start = self._starts[i]
        end, buffer = self._ranges[start]
        return (start, buffer) if address < end else None


class BufferMap:
    """Names the memory a captured graph touches, and finds pointers in argument bytes."""

    def __init__(self) -> None:
        self._named = _Ranges()
        self._blocks = _Ranges()
        self._allocations = _Ranges()
        self._not_device: set[int] = set()
        # address -> its span: kernels pass the same pointers again and again (weights,
        # workspaces), and a training step's walk looked up a quarter of a million of them.
        # Spans are immutable, so one serves every pointer to the address.
        self._hits: dict[int, Span] = {}
        self.used: dict[str, Buffer] = {}

    def name(self, buffer_id: str, address: int, size: int, role: BufferRole,
             memory: Memory = Memory.DEVICE) -> Buffer:
        """Declare a range the caller knows (a tensor): ``address`` .. ``address + size``."""
        self._hits.clear()  # named ranges come first: an address found before may name anew
        return self._named.add(address, size, Buffer(buffer_id, size, role, memory, address))

    def block(self, address: int, size: int) -> None:
        """Declare a live block of an allocator that sub-allocates the driver's memory (one
        tensor's storage in PyTorch's caching allocator): an internal buffer of its own, so that
        a graph's pointers into it are told from those into its segment's other blocks, which
        another process lays out differently. Blocks are disjoint."""
        self._hits.clear()
        self._blocks.add(address, size, Buffer(f"block@{address:#x}", size, BufferRole.INTERNAL,
                                               address=address))

    def span(self, address: int) -> Span | None:
        """The buffer and offset ``address`` falls in, or None if it is not device memory."""
        span = self._hits.get(address)
        if span is not None:
            return span
        if address in self._not_device:  # argument words that only look like addresses
            return None
        hit = (self._named.find(address) or self._blocks.find(address)
               or self._allocations.find(address))
        if hit is None:
            status, base, size = driver.cuMemGetAddressRange(address)
            if status != driver.CUresult.CUDA_SUCCESS:
                self._not_device.add(address)
                return None
            base = int(base)
            buffer = Buffer(f"alloc@{base:#x}", size, BufferRole.INTERNAL, address=base)
            hit = (base, self._allocations.add(base, size, buffer))
        start, buffer = hit
        self.used[buffer.id] = buffer
        span = self._hits[address] = Span(buffer.id, address - start)
        return span

    def host_span(self, address: int, size: int) -> Span:
        """A span of host memory a copy reads or writes (named ranges first)."""
        hit = self._named.find(address)
        if hit is None:
            buffer = Buffer(f"host@{address:#x}", size, BufferRole.INTERNAL, Memory.HOST, address)
            hit = (address, self._named.add(address, size, buffer))
            self._hits.clear()
        start, buffer = hit
        self.used[buffer.id] = buffer
        return Span(buffer.id, address - start)

    def pointers(self, args: bytes) -> tuple[Pointer, ...]:
        """Every 8-byte aligned word of ``args`` that points into device memory."""
        # Plain integers, with the cached spans and the words known not to be device memory
        # looked up inline: a Llama capture's kernels hold about 78 words each, 24 of them in
        # the address range and 5 pointers, and the walk reads every kernel of every capture.
        # (Native order: CUDA hosts are little-endian, as the argument bytes are.)
        words = memoryview(args)[:len(args) // 8 * 8].cast("Q")
        hits, not_device, found = self._hits, self._not_device, []
        for i, word in enumerate(words):
            if word < _LOWEST or word >= _HIGHEST or word in not_device:
                continue
            span = hits.get(word)
            if span is None:
                span = self.span(word)
                if span is None:
                    continue
            found.append(Pointer(8 * i, span))
        return tuple(found)

    def install(self, graph: KernelGraph) -> None:
        """Put every buffer the walk used into ``graph``'s table."""
        for buffer in self.used.values():
            if buffer.id not in graph.buffers:
                graph.add_buffer(buffer)
