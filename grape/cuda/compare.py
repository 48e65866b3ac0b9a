"""Whether two kernel graphs do the same thing: both run from one state, what they leave
compared bit for bit.

Derivation (``grape.passes.derive``) asks this of a captured graph and the same graph with some
argument words changed, to learn whether the kernels read those words: PyTorch leaves words of
its argument structs unfilled, and what the host left in them changes with its history, not
with the shape, where no second capture can show it (``derive_lengths``' ``verify``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from cuda.bindings import driver

from grape.cuda.build import Executable, Graph, Update
from grape.cuda.check import call, check_status
from grape.cuda.context import synchronize
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


class _Saved:
    """The watched buffers' contents before the runs, put back after each: kept on the device
    where it has room (copied there and back at the device's bandwidth), else on the host.
    On the H200 the host's copies and their comparison took about half of a Llama-shaped
    family's 0.7 s comparisons (a profile of 27)."""

    def __init__(self, buffers: list[Buffer]) -> None:
        self.buffers = buffers
        self.device: int | None = None
        self.places: list[int] = []  # each buffer's copy on the device
        self.host: list[np.ndarray] = []
        status, address = driver.cuMemAlloc(max(1, sum(b.size for b in buffers)))
        if status == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            self.host = _read(buffers)
            return
        check_status(status, "allocating room for the buffers to compare")
        self.device = int(address)
        offsets = np.cumsum([0] + [b.size for b in buffers[:-1]], dtype=np.int64).tolist()
        self.places = [self.device + o for o in offsets]
        try:
            for b, at in zip(buffers, self.places, strict=True):
                call(driver.cuMemcpyDtoD, at, b.address, b.size,
                     doing=f"saving buffer {b.id!r}")
            # Copies between device buffers go on the legacy stream, which PyTorch's streams
            # (non-blocking) do not wait for: done before any run.
            synchronize()
        except BaseException:
            self.free()
            raise

    def restore(self) -> None:
        if self.device is None:
            for b, data in zip(self.buffers, self.host, strict=True):
                call(driver.cuMemcpyHtoD, b.address, data.ctypes.data, b.size,
                     doing=f"restoring buffer {b.id!r}")
            return
        for b, at in zip(self.buffers, self.places, strict=True):
            call(driver.cuMemcpyDtoD, b.address, at, b.size, doing=f"restoring buffer {b.id!r}")
        synchronize()

    def free(self) -> None:
        if self.device is not None:
            call(driver.cuMemFree, self.device, doing="freeing the saved buffers")
            self.device = None


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


def _left_by(executable: Executable, buffers: list[Buffer], stream: int) -> list[np.ndarray]:
    executable.launch(stream)
    synchronize()
    return _read(buffers)


class Comparison:
    """``first`` built, instantiated and run once from the state the device is in now, kept
    for any number of graphs to be compared with it (:meth:`alike`), each from that same
    state, which is restored after each. Where the other graph is of ``first``'s structure
    (``pairs`` says which node is which, or their ids agree), its differing nodes are set in
    ``first``'s executable and set back after, in place of building and instantiating it:
    a swapped argument word or a derived length changes a few nodes of a thousand. Derivation
    compares one sample again and again while it halves the words it tries
    (``grape.passes.lengths._unread``), each comparison having built and instantiated both
    graphs, and run ``first`` twice (0.23 to 0.25 s a comparison on the H200's Llama shape).
    Measured on an H100 it saved no time there: 218 to 243 ms a comparison, since most of
    them take another sample (a new ``Comparison``) and most of each goes to reading every
    buffer to the host and comparing it (benchmarks/README.md, "Sampling coarse first").

    The state must not change between comparisons but by their own runs: a capture or an
    eager step between two writes a cache's row, and ``first``'s result would be stale; make
    another ``Comparison`` then. Close it (or use it as a context) to free its executable,
    its graph and the saved state.
    """

    def __init__(self, first: KernelGraph, stream: int = 0) -> None:
        self.first, self.stream = first, stream
        self.buffers = watched(first)
        synchronize()
        self.saved = _Saved(self.buffers)
        self.built: Graph | None = None
        self.executable: Executable | None = None
        try:
            self.built = Graph.build(first)
            self.executable = self.built.instantiate(stream)
            self.left = _left_by(self.executable, self.buffers, stream)
            self.saved.restore()
        except BaseException:
            self.close()
            raise
        self.updated = 0  # comparisons made by setting nodes, not building (for the tests)

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
            alike = _same(self.left, self._run(second, pairs))
            self.saved.restore()
            if alike:  # first again: a graph that runs otherwise twice shows nothing
                alike = _same(self.left,
                              _left_by(self.executable, self.buffers, self.stream))
        finally:
            self.saved.restore()
        return alike

    def _run(self, second: KernelGraph, pairs: Mapping[str, str] | None) -> list[np.ndarray]:
        """``second`` run from the state now, its buffers read (the state not restored)."""
        first, buffers, stream = self.first, self.buffers, self.stream
        for b in second.buffers.values():
            if b.role is not BufferRole.PARAMETER and first.buffers.get(b.id) != b:
                raise GrapeError(f"expected the graphs to compare to share their buffers, found "
                                 f"{b.id!r} only in the second or laid out otherwise")
        set_to, back = self._updates(second, pairs)
        if set_to is None:
            with Graph.build(second) as other, other.instantiate(stream) as theirs:
                return _left_by(theirs, buffers, stream)
        Graph.apply(self.executable, set_to)
        try:
            return _left_by(self.executable, buffers, stream)
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
        try:
            self.saved.restore()
        finally:
            self.saved.free()
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
    (``pairs``, or the same node ids), else built and instantiated too; every executable is
    freed before returning. :class:`Comparison` keeps ``first`` for many comparisons.

    Raises
    ------
    GrapeError
        ``second`` names a buffer ``first`` does not have, or one lies elsewhere.
    """
    with Comparison(first, stream) as comparison:
        return comparison.alike(second, pairs)
