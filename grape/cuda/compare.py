"""Whether two kernel graphs do the same thing: both run from one state, what they leave
compared bit for bit.

Derivation (``grape.passes.derive``) asks this of a captured graph and the same graph with some
argument words changed, to learn whether the kernels read those words: PyTorch leaves words of
its argument structs unfilled, and what the host left in them changes with its history, not
with the shape, where no second capture can show it (``derive_lengths``' ``verify``).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache

import numpy as np
from cuda.bindings import driver

from grape.cuda.build import Executable, Graph, Update
from grape.cuda.check import call, check_status
from grape.cuda.context import read_device, synchronize
from grape.cuda.nvrtc import Module, launch
from grape.errors import GrapeError, UnsupportedError
from grape.ir import Buffer, BufferRole, KernelGraph, Memory
from grape.passes.families import same_ids

__all__ = ["Comparison", "runs_alike", "watched"]


def watched(graph: KernelGraph) -> list[Buffer]:
    """The device buffers a run of ``graph`` may leave changed: all but its parameters (which
    a graph never writes), temporaries included, since a difference in them is one too."""
    out = [b for b in graph.buffers.values()
           if b.memory is Memory.DEVICE and b.role is not BufferRole.PARAMETER]
    if missing := [b.id for b in out if b.address is None]:
        raise GrapeError(f"expected every buffer to compare to have an address, found "
                         f"{len(missing)} without (first: {missing[0]!r})")
    return out


_ALIGN = 256  # each buffer's copy starts so aligned: the comparing kernel reads 16 bytes at once

SOURCE = r"""
// Row k of table: (a, b, n): n bytes at a and n at b; differ[k] becomes 1 where they are not
// equal. Blocks take rows by blockIdx.y and bytes by a grid-stride loop, 16 at a time where
// both sides are 16-byte aligned.
extern "C" __global__ void grape_differ(const unsigned long long* table, int rows,
                                        unsigned* differ) {
    for (int k = blockIdx.y; k < rows; k += gridDim.y) {
        const unsigned char* a = (const unsigned char*)table[3 * k];
        const unsigned char* b = (const unsigned char*)table[3 * k + 1];
        unsigned long long n = table[3 * k + 2];
        unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
        unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
        unsigned long long tail = 0;
        bool odd = false;
        if ((((unsigned long long)a | (unsigned long long)b) & 15) == 0) {
            const uint4* x = (const uint4*)a;
            const uint4* y = (const uint4*)b;
            for (unsigned long long w = i; w < n / 16; w += stride) {
                uint4 p = x[w], q = y[w];
                odd |= (p.x != q.x) | (p.y != q.y) | (p.z != q.z) | (p.w != q.w);
            }
            tail = n / 16 * 16;
        }
        for (unsigned long long j = tail + i; j < n; j += stride)
            odd |= a[j] != b[j];
        if (odd) differ[k] = 1;
    }
}
"""

_THREADS = 256


@cache
def _module() -> Module:
    return Module(SOURCE, name="grape_compare.cu")


class _Copy:
    """Copies of the watched buffers in one device allocation, each at a 256-byte aligned
    place: taken and put back at the device's bandwidth (copies between device buffers go on
    the legacy stream, which PyTorch's non-blocking streams do not wait for, so each waits for
    the device). :meth:`of` gives None where the device has no room."""

    def __init__(self, buffers: list[Buffer], address: int) -> None:
        self.buffers, self.address = buffers, address
        sizes = [-(-b.size // _ALIGN) * _ALIGN for b in buffers]
        self.places = [address + o for o in np.cumsum([0] + sizes[:-1]).tolist()]

    @classmethod
    def of(cls, buffers: list[Buffer]) -> _Copy | None:
        status, address = driver.cuMemAlloc(max(1, sum(-(-b.size // _ALIGN) * _ALIGN
                                                        for b in buffers)))
        if status == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            return None
        check_status(status, "allocating room for the buffers to compare")
        return cls(buffers, int(address))

    def take(self) -> None:
        for b, at in zip(self.buffers, self.places, strict=True):
            call(driver.cuMemcpyDtoD, at, b.address, b.size, doing=f"copying buffer {b.id!r}")
        synchronize()

    def put_back(self) -> None:
        for b, at in zip(self.buffers, self.places, strict=True):
            call(driver.cuMemcpyDtoD, b.address, at, b.size, doing=f"restoring buffer {b.id!r}")
        synchronize()

    def free(self) -> None:
        if self.address is not None:
            call(driver.cuMemFree, self.address, doing="freeing the buffers' copies")
            self.address = None


class _Kept:
    """The watched buffers' contents, kept on the device where it has room, else on the host:
    the state before the runs, put back after each (:meth:`restore`), and, as :class:`_Left`,
    what a run left."""

    def __init__(self, buffers: list[Buffer]) -> None:
        self.buffers = buffers
        self.copy = _Copy.of(buffers)
        self.host: list[np.ndarray] = []
        if self.copy is None:
            self.host = _read(buffers)
            return
        try:
            self.copy.take()
        except BaseException:
            self.free()
            raise

    def retake(self) -> None:
        """The buffers' contents now, in place of those kept."""
        if self.copy is not None:
            self.copy.take()
        else:
            self.host = _read(self.buffers)

    def restore(self) -> None:
        if self.copy is not None:
            self.copy.put_back()
            return
        for b, data in zip(self.buffers, self.host, strict=True):
            call(driver.cuMemcpyHtoD, b.address, data.ctypes.data, b.size,
                 doing=f"restoring buffer {b.id!r}")

    def free(self) -> None:
        if self.copy is not None:
            self.copy.free()
            self.copy = None


class _Left(_Kept):
    """What a run left in the watched buffers, kept to tell whether a later run leaves the
    same (:meth:`again`). Kept on the device where it has room and compared there by one
    kernel, which reads both sides at the device's bandwidth and hands back a word a buffer;
    else read to the host and compared there. On an H100 the host's way took most of a
    Llama-shaped family's comparisons: 93 reads of every buffer (2.9 s) and numpy's compares
    (2.1 s) in 31 comparisons under cProfile (benchmarks/README.md, "Sampling coarse first")."""

    def __init__(self, buffers: list[Buffer], stream: int) -> None:
        self.stream, self.table = stream, None
        super().__init__(buffers)
        if self.copy is not None:
            try:
                self._table()
            except BaseException:
                self.free()
                raise

    def _table(self) -> None:
        rows = np.array([(b.address, at, b.size) for b, at in
                         zip(self.buffers, self.copy.places, strict=True)],
                        dtype=np.uint64).reshape(-1, 3)
        flags = 4 * max(1, len(self.buffers))
        status, address = driver.cuMemAlloc(rows.nbytes + flags)
        if status == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:  # the host's way, then
            self.host = _read(self.buffers)  # what the copy just took
            self.copy.free()
            self.copy = None
            return
        check_status(status, "allocating the comparison's table")
        self.table, self.flags = int(address), int(address) + rows.nbytes
        if rows.nbytes:
            call(driver.cuMemcpyHtoD, self.table, rows.ctypes.data, rows.nbytes,
                 doing="copying the comparison's table")
        self.func = _module().function("grape_differ")
        largest = max((b.size for b in self.buffers), default=1)
        self.grid = (max(1, min(512, -(-largest // (16 * _THREADS)))),
                     max(1, min(len(self.buffers), 65535)), 1)

    def again(self) -> bool:
        """Whether the watched buffers hold now, after a run queued on the stream, what they
        held when this was made."""
        if self.copy is None:
            synchronize()
            return _same(self.host, _read(self.buffers))
        if not self.buffers:
            return True
        call(driver.cuMemsetD32Async, self.flags, 0, len(self.buffers), self.stream,
             doing="clearing the comparison's flags")
        launch(self.func, self.grid, (_THREADS, 1, 1),
               [self.table, np.int32(len(self.buffers)), self.flags], self.stream)
        synchronize()
        flags = np.frombuffer(read_device(self.flags, 4 * len(self.buffers)), dtype=np.uint32)
        return not flags.any()

    def free(self) -> None:
        if self.table is not None:
            call(driver.cuMemFree, self.table, doing="freeing the comparison's table")
            self.table = None
        super().free()


def _read(buffers: list[Buffer]) -> list[np.ndarray]:
    out = []
    for b in buffers:
        host = np.empty(b.size, dtype=np.uint8)
        call(driver.cuMemcpyDtoH, host.ctypes.data, b.address, b.size,
             doing=f"reading buffer {b.id!r}")
        out.append(host)
    return out


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _launched(executable: Executable, stream: int) -> None:
    """``executable`` run on ``stream``, waited for."""
    executable.launch(stream)
    synchronize()


class Comparison:
    """``first`` built, instantiated and run once from the state the device is in now, kept
    for any number of graphs to be compared with it (:meth:`alike`), each from that same
    state, which is restored after each. Where the other graph is of ``first``'s structure
    (``pairs`` says which node is which, or their ids agree), its differing nodes are set in
    ``first``'s executable and set back after, in place of building and instantiating it:
    a swapped argument word or a derived length changes a few nodes of a thousand. What a
    run leaves is compared on the device (:class:`_Left`), where the host's reads and numpy
    took most of a comparison (218 to 243 ms each on an H100's Llama shape, most of them
    with a new ``Comparison``: benchmarks/README.md, "Sampling coarse first").

    The state must not change between comparisons but by their own runs: a capture or an
    eager step between two writes a cache's row, and ``first``'s result would be stale:
    :meth:`rebase` it then (on ``first`` or the next graph of its structure). Close it (or
    use it as a context) to free its executable, its graph, the saved state and what
    ``first`` left.
    """

    def __init__(self, first: KernelGraph, stream: int = 0) -> None:
        self.first, self.stream = first, stream
        self.closed = False
        self.buffers = watched(first)
        synchronize()
        self.saved = _Kept(self.buffers)
        self.built: Graph | None = None
        self.executable: Executable | None = None
        self.left: _Left | None = None
        try:
            self.built = Graph.build(first)
            self.executable = self.built.instantiate(stream)
            _launched(self.executable, stream)
            self.left = _Left(self.buffers, stream)
            self.saved.restore()
        except BaseException:
            self.close()
            raise
        self.updated = 0  # comparisons made by setting nodes, not building (for the tests)
        self.rebased = 0  # times another first was taken in (for the tests)

    def alike(self, second: KernelGraph, pairs: Mapping[str, str] | None = None) -> bool:
        """Whether ``second`` leaves ``first``'s buffers as ``first`` does, from the saved
        state (:func:`runs_alike`). ``pairs``: each node of ``first`` and ``second``'s in its
        place, where ``second`` is of its structure with other node ids.

        Raises
        ------
        GrapeError
            ``second`` names a buffer ``first`` does not have, or one lies elsewhere.
        """
        try:
            self._run(second, pairs)
            alike = self.left.again()
            self.saved.restore()
            if alike:  # first again: a graph that runs otherwise twice shows nothing
                _launched(self.executable, self.stream)
                alike = self.left.again()
        finally:
            self.saved.restore()
        return alike

    def rebase(self, first: KernelGraph) -> bool:
        """Compare with ``first`` from now on, from the state the device is in now (which a
        capture since may have changed): its differing nodes set in the executable, run, and
        what it leaves kept, in place of building, instantiating and saving anew (about
        0.1 s a comparison on an H100's Llama shape: a family compares each sample it shows
        words of unread with one). False, with nothing changed, where ``first`` is not of the
        executable's structure under its own node ids, has other buffers, or differs in what
        the executable cannot take in place: make a new ``Comparison`` then."""
        if {b.id: b for b in watched(first)} != {b.id: b for b in self.buffers}:
            return False
        set_to, _ = self._updates(first, None)
        if set_to is None:
            return False
        try:
            synchronize()
            self.saved.retake()
            Graph.apply(self.executable, set_to)
            self.first = first
            _launched(self.executable, self.stream)
            self.left.retake()
            self.saved.restore()
        except BaseException:
            self.close()
            raise
        self.rebased += 1
        return True

    def _run(self, second: KernelGraph, pairs: Mapping[str, str] | None) -> None:
        """``second`` run from the state now (the state not restored)."""
        first, stream = self.first, self.stream
        for b in second.buffers.values():
            if b.role is not BufferRole.PARAMETER and first.buffers.get(b.id) != b:
                raise GrapeError(f"expected the graphs to compare to share their buffers, found "
                                 f"{b.id!r} only in the second or laid out otherwise")
        set_to, back = self._updates(second, pairs)
        if set_to is None:
            with Graph.build(second) as other, other.instantiate(stream) as theirs:
                _launched(theirs, stream)
            return
        Graph.apply(self.executable, set_to)
        try:
            _launched(self.executable, stream)
        finally:
            Graph.apply(self.executable, back)
            self.updated += 1

    def _updates(self, second: KernelGraph, pairs: Mapping[str, str] | None
                 ) -> tuple[list[Update] | None, list[Update]]:
        """The node updates that make ``first``'s executable run ``second``, and those that
        set it back; (None, []) where ``second`` must be built whole (another structure, or
        a change the driver cannot make in place, such as a kernel's attributes)."""
        first = self.first
        if pairs is None:
            # Captures number their nodes alike whatever they hold: ids alone say nothing
            if not same_ids(first, second):
                return None, []
            pairs = {node: node for node in first.dag}
        changed = {node: second.op(pairs[node]) for node in first.dag
                   if second.op(pairs[node]) != first.op(node)}
        try:
            set_to = self.built.prepare(changed)
            back = self.built.prepare({node: first.op(node) for node in changed})
        except (GrapeError, UnsupportedError):
            return None, []
        return set_to, back

    def close(self) -> None:
        """Put the saved state back and free everything; once (a failed :meth:`rebase` closes
        it, and its owner may close it again)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.saved.restore()
        finally:
            self.saved.free()
            if self.left is not None:
                self.left.free()
            for r in (self.executable, self.built):
                if r is not None:
                    r.close()

    def __enter__(self) -> Comparison:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def runs_alike(first: KernelGraph, second: KernelGraph, stream: int = 0,
               pairs: Mapping[str, str] | None = None) -> bool:
    """Whether ``second`` leaves ``first``'s buffers (:func:`watched`) as ``first`` does,
    both run from the state they are in now, which is restored after: ``first`` runs twice,
    before and after ``second``, and a ``first`` whose two runs differ (atomics, a random
    stream, a counter it bumps) shows nothing, so the answer is then False; where ``second``
    already differs from ``first``'s first run, ``first`` does not run again.

    The two must be of one memory: ``second``'s buffers among ``first``'s (a derived graph and
    the capture of its length, moved to one reference's places). The device is synchronised
    around each run; ``first`` is built and instantiated once, and ``second`` runs as
    ``first``'s executable with its differing nodes set where it is of ``first``'s structure
    (``pairs``, or the same node ids), else built and instantiated too; what each leaves is
    compared on the device where it has room for a copy, else on the host; every executable
    is freed before returning. :class:`Comparison` keeps ``first`` for many comparisons.

    Raises
    ------
    GrapeError
        ``second`` names a buffer ``first`` does not have, or one lies elsewhere.
    """
    with Comparison(first, stream) as comparison:
        return comparison.alike(second, pairs)
