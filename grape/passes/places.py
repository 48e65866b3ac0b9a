"""A capture's temporaries moved to the places a reference capture gave them.

A decode step captured at KV length ``n`` allocates its temporaries in the graphs' pool at
places the caching allocator picks by best fit, and the sizes grow with ``n``, so a block's
place moves with the length: the pointers into the pool are no affine function of the length,
and a family's derivation (``grape.passes.derive``) derived nothing from one length in 32
(benchmarks/README.md, runs 18 to 21). Measured on the H200 (``benchmarks/pool_layout.py``,
GPT-2 small decode, 128 KV lengths 1..1017, all 1 modulo 8): every length makes the largest
length's 340 allocations and frees in the same order, 257 of them at other places (lengths 7
modulo 8 take another attention path and allocate otherwise: a family takes a reference for
each way of allocating). With marks (below), every capture of 147 lengths over every residue
moved to the places of its way's reference, none refused (``pool_layout_72ad2ff.json``).

So grape moves them. Given the allocator's history of a capture (:class:`History`: each block
it made in the pool, when it was made and freed) and that of a *reference* capture of the same
step (in a family, the first capture that allocated alike: the largest shape of its kind),
:func:`to_reference` rewrites every pointer into
a block of the capture to the same offset in the reference's block of the same rank in the
sequence. That is memory-safe under two conditions, both checked: the two captures make the
same allocations and frees in the same order (so the same blocks are alive together), and no
block is larger than the reference's (so blocks alive together, disjoint in the reference's
layout, stay disjoint). Lengths derived between two moved samples keep the second condition
where a block's size is monotone in the length between them (rounding to the allocator's 512
bytes keeps an affine size monotone).

Which block a pointer means is not in the graph: the allocator reuses a place many times in
one capture. It is found from time. The nodes are in the order the capture made them, the
history in the order the allocator acted, and both follow the host's program order, so each
node was launched at some point ``t`` of the history, never earlier than the node before it;
a pointer of the node means the block that contains it and is alive at ``t``. The blocks'
lives alone bound a node's ``t`` weakly (a kernel that reads one place the step reuses layer
after layer could have run in any layer), so the capture also marks where each operation
started (:class:`Mark`: the graph's node count then, and a marker the allocator's history
records), and a node made between two marks ran between them. Each node's ``t`` is bounded
from both sides (the earliest consistent with the nodes before it, the latest with those
after), and a pointer is moved only where every block it could mean over that range moves it
to one place; otherwise the capture is refused. A word no block alive at ``t`` holds is left
as it is: a pointer into memory the capture did not allocate, or what PyTorch leaves in
argument slots it never fills (``grape.passes.relocate`` says why those look like pointers),
which no kernel reads.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from grape.errors import GrapeError, UnsupportedError
from grape.ir import (
    Buffer,
    Conditional,
    Kernel,
    KernelGraph,
    Memcpy,
    Memory,
    Memset,
    Op,
    Pointer,
    Span,
)

__all__ = ["History", "Mark", "Moved", "to_reference"]


@dataclass(frozen=True)
class History:
    """The blocks one capture allocated in its pool, in the order it made them: ``address``,
    ``size``, and when each was made and freed, as positions in the sequence of the
    allocator's acts (``made[i]`` < ``freed[i]``; a block the capture never freed is freed at
    ``len(acts)``). ``acts`` is that sequence, ("alloc" | "free", block number): two
    captures that lay out the same program have equal ``acts``."""

    address: tuple[int, ...]
    size: tuple[int, ...]
    made: tuple[int, ...]
    freed: tuple[int, ...]
    acts: tuple[tuple[str, int], ...]
    marks: tuple[int, ...] = ()  # per marker found: the acts before it
    # the pool's segments, (address, size): those the capture made, in the order made, then
    # the others it was given
    segments: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of_trace(cls, trace: Sequence[Mapping], segments: Sequence[tuple[int, int]] = (),
                 markers: Sequence[int] = ()) -> History:
        """From the allocator's trace (``torch.cuda.memory._snapshot()["device_traces"]``
        entries, recorded over the capture), keeping the blocks within the pool: ``segments``
        (its segments, as (address, size)), or where none are given, the segments the trace
        shows made. An allocation is ``alloc``, and its block is free to reuse at
        ``free_completed``. ``markers``: the addresses of the capture's markers
        (:class:`Mark`), in order, which are no blocks of its own: where each lies among the
        acts is kept instead. A marker is an allocation at the next marker's address, of its
        size, freed by the very next act: the trace records the block's size, 512 bytes,
        which any small tensor has, and the place a marker takes is often one an operation
        had just freed, so that an operation's tensor allocated there earlier (a layer norm's
        statistics, on an H100) is not taken for the marker, which would put the moment too
        early and give that operation's temporaries to the one before."""
        made_here = [(e["addr"], e["size"]) for e in trace if e["action"] == "segment_alloc"
                     and (not segments or (e["addr"], e["size"]) in segments)]
        pool = made_here + sorted(set(segments) - set(made_here))
        spans = sorted(pool)
        starts = [a for a, _ in spans]

        def in_pool(address: int) -> bool:
            # bisect on a list: numpy's search per event cost more than the rest of the loop
            i = bisect.bisect_right(starts, address) - 1
            return i >= 0 and address < spans[i][0] + spans[i][1]

        address, size, made, freed, acts, marks = [], [], [], [], [], []
        live: dict[int, int] = {}  # address -> block number
        marker: int | None = None  # the address of a marker allocated and not yet freed
        for k, e in enumerate(trace):
            action = e["action"]
            if (action == "alloc" and len(marks) < len(markers) and e["addr"] == markers[
                    len(marks)] and e["size"] in (MARKER_BYTES, _rounded(MARKER_BYTES))
                    and _freed_next(trace, k)):
                marks.append(len(acts))
                marker = e["addr"]
            elif action == "free_completed" and e["addr"] == marker:
                marker = None
            elif action == "alloc" and in_pool(e["addr"]):
                live[e["addr"]] = len(address)
                acts.append(("alloc", len(address)))
                made.append(len(acts) - 1)
                freed.append(-1)
                address.append(e["addr"])
                size.append(e["size"])
            elif action == "free_completed" and e["addr"] in live:
                i = live.pop(e["addr"])
                acts.append(("free", i))
                freed[i] = len(acts) - 1
        freed = [f if f >= 0 else len(acts) for f in freed]
        return cls(tuple(address), tuple(size), tuple(made), tuple(freed), tuple(acts),
                   tuple(marks), tuple(pool))

    @classmethod
    def of_json(cls, data: Mapping) -> History:
        """From ``dataclasses.asdict`` of a history once written as JSON (lists for tuples)."""
        try:
            return cls(tuple(data["address"]), tuple(data["size"]), tuple(data["made"]),
                       tuple(data["freed"]), tuple((a, i) for a, i in data["acts"]),
                       tuple(data.get("marks", ())),
                       tuple((a, n) for a, n in data.get("segments", ())))
        except (KeyError, TypeError, ValueError) as e:
            raise GrapeError(f"expected an allocator history (address, size, made, freed, "
                             f"acts), found {e!r} in {sorted(data)[:8]}") from None

    def requests(self) -> list[tuple[str, int, int]]:
        """The acts as ``grape.sim.memory.Pool.run`` takes them: ("malloc", block, size) and
        ("free", block, 0)."""
        return [("malloc", i, self.size[i]) if a == "alloc" else ("free", i, 0)
                for a, i in self.acts]

    def placed(self) -> list[tuple[int, int]]:
        """Where each block lay: (its segment, numbered as in ``segments``, its offset)."""
        starts = [a for a, _ in self.segments]
        order = sorted(range(len(starts)), key=starts.__getitem__)
        spans = [starts[j] for j in order]
        out = []
        for address in self.address:
            k = bisect.bisect_right(spans, address) - 1
            j = order[k] if k >= 0 else None
            if j is None or address >= starts[j] + self.segments[j][1]:
                raise GrapeError(f"expected every block inside one of the history's "
                                 f"{len(starts)} segments, found one at {address:#x}")
            out.append((j, address - starts[j]))
        return out

    def __len__(self) -> int:
        return len(self.address)


MARKER_BYTES = 509  # a size no tensor of these steps has, though the trace rounds it to 512


def _freed_next(trace: Sequence[Mapping], k: int) -> bool:
    """Whether the allocator's next act after ``trace[k]`` (an allocation) frees its block."""
    nxt = trace[k + 1] if k + 1 < len(trace) else None
    return (nxt is not None and nxt["action"] in ("free_requested", "free_completed")
            and nxt["addr"] == trace[k]["addr"])


def _rounded(size: int) -> int:
    return -(-size // 512) * 512  # the caching allocator's smallest block


@dataclass(frozen=True)
class Mark:
    """The start of one operation of a capture: how many nodes the graph held then, and the
    address of a marker, ``MARKER_BYTES`` allocated and freed at once, which puts the moment
    in the allocator's history."""

    nodes: int
    marker: int


def _bounds(history: History, marks: Sequence[Mark], nodes: int) -> tuple[list[int], list[int]]:
    """Each node's first and last possible launch point: a node made between two marks ran
    between them."""
    acts, at = len(history.acts), history.marks
    lower, upper = [0] * nodes, [acts] * nodes
    j = -1
    for i in range(nodes):
        while j + 1 < len(at) and marks[j + 1].nodes <= i:
            j += 1
        lower[i] = at[j] if j >= 0 else 0
        upper[i] = at[j + 1] if j + 1 < len(at) else acts
    return lower, upper


@dataclass(frozen=True)
class Moved:
    """A capture moved to its reference's places: the graph, and how many pointer words it
    left as they were (held by no block alive when their node ran)."""

    graph: KernelGraph
    moved: int
    left: int


def _parting(history: History, reference: History) -> str | None:
    """Why ``history``'s blocks cannot take ``reference``'s places, or None."""
    if history.acts != reference.acts:
        k = next((k for k, (a, b) in enumerate(zip(history.acts, reference.acts, strict=False))
                  if a != b), min(len(history.acts), len(reference.acts)))
        return (f"expected the reference capture's {len(reference.acts)} allocator acts in "
                f"its order, found {len(history.acts)} parting from them at act {k}")
    larger = next((i for i, (a, b) in enumerate(zip(history.size, reference.size, strict=True))
                   if a > b), None)
    if larger is not None:
        return (f"expected no block larger than the reference's, found block {larger} of "
                f"{history.size[larger]} bytes against {reference.size[larger]}")
    return None


def _addresses(graph: KernelGraph, op: Op) -> list[tuple[int, int]]:
    """``op``'s device addresses, as (which, address): a kernel's pointer words by their
    index in ``op.pointers``, a copy's source (-1) and destination (-2), a memset's (-2)."""
    if isinstance(op, Kernel):
        return [(j, int.from_bytes(op.args[p.offset:p.offset + 8], "little"))
                for j, p in enumerate(op.pointers)]
    spans = [(-1, op.src), (-2, op.dst)] if isinstance(op, Memcpy) else (
        [(-2, op.dst)] if isinstance(op, Memset) else [])
    out = []
    for which, span in spans:
        buffer = graph.buffers.get(span.buffer)
        if buffer is not None and buffer.memory is Memory.DEVICE and buffer.address is not None:
            out.append((which, buffer.address + span.offset))
    return out


@dataclass(frozen=True)
class _Held:
    """The blocks that hold one address at some point of a capture, in the order made: their
    lives (points ``first[j]`` to ``last[j]``) are disjoint, since live blocks never overlap."""

    blocks: list[int]
    first: list[int]
    last: list[int]

    def next(self, t: int) -> int | None:
        """The first point from ``t`` on at which a block holds the address."""
        j = bisect.bisect_left(self.last, t)
        return max(t, self.first[j]) if j < len(self.blocks) else None

    def during(self, lo: int, hi: int) -> list[int]:
        """The blocks alive at some point from ``lo`` to ``hi``."""
        return self.blocks[bisect.bisect_left(self.last, lo):bisect.bisect_right(self.first, hi)]

    def previous(self, t: int) -> int | None:
        """The last point up to ``t`` at which a block holds the address."""
        j = bisect.bisect_right(self.first, t) - 1
        return min(t, self.last[j]) if j >= 0 else None


def _holders(history: History, addresses: Iterable[int], rows: int = 1024
             ) -> dict[int, _Held | None]:
    """For each address, the blocks of ``history`` that hold it at some point (None: none),
    found ``rows`` addresses at a time against every block at once: one numpy test per
    address took 11.2 ms for 740 addresses against the 340 blocks of a committed GPT-2 capture
    (``traces/h200_pool``), this way 6.0 (best of 9, a CPU without a GPU)."""
    start = np.array(history.address, dtype=np.uint64)
    end = start + np.array(history.size, dtype=np.uint64)
    addresses = list(addresses)
    held: dict[int, list[int]] = {a: [] for a in addresses}
    for lo in range(0, len(addresses), rows):
        chunk = np.array(addresses[lo:lo + rows], dtype=np.uint64)[:, None]
        at, blocks = np.nonzero((start <= chunk) & (chunk < end))
        for i, block in zip(at.tolist(), blocks.tolist(), strict=True):
            held[addresses[lo + i]].append(block)  # ascending: the order the blocks were made
    return {a: _Held(blocks, [history.made[i] + 1 for i in blocks],
                     [history.freed[i] for i in blocks]) if blocks else None
            for a, blocks in held.items()}


def _most_held(held: list[_Held], lo: int, hi: int) -> list[int]:
    """The points from ``lo`` to ``hi`` at which most of a node's addresses are held by a
    live block (they agree on none: some are words PyTorch left unfilled)."""
    score = np.zeros(hi + 2, dtype=np.int32)
    for h in held:
        np.add.at(score, np.minimum(h.first, hi + 1), 1)
        np.add.at(score, np.minimum(np.array(h.last) + 1, hi + 1), -1)
    score = np.cumsum(score)[lo:hi + 1]
    return (lo + np.flatnonzero(score == score.max())).tolist()


def _settle(held: list[_Held], t: int, step: str) -> int | None:
    """The nearest point from ``t`` on (``step`` "next") or back (``"previous"``) at which
    every address of ``held`` is held; None where there is none."""
    if not held:  # a node that uses no block: any point
        return t
    while True:
        points = [getattr(h, step)(t) for h in held]
        if None in points:
            return None
        moved = max(points) if step == "next" else min(points)
        if moved == t:
            return t
        t = moved


def _launch_windows(held: list[list[_Held]], acts: int, lower: Sequence[int],
                    upper: Sequence[int]) -> tuple[list[int], list[int]]:
    """Each node's earliest and latest launch point ``t`` (0 .. ``acts``: acts done before
    it), nondecreasing over the nodes and within ``lower[k]`` .. ``upper[k]``: where all the
    addresses of ``held[k]`` (node ``k``'s) are held by live blocks, or, for a node where
    that is nowhere, most are (module)."""
    some: dict[int, list[int]] = {}  # the nodes whose addresses agree on no point
    lo, t = [], 0
    for k, h in enumerate(held):
        t = max(t, lower[k])
        found = _settle(h, t, "next")
        if found is None or found > upper[k]:
            if t > upper[k]:
                raise UnsupportedError("expected the capture's nodes to follow its allocator's "
                                       "history, found a node that no later point of it fits")
            some[k] = _most_held(h, t, upper[k])
            found = some[k][0]
        lo.append(t := found)
    hi, t = [0] * len(held), acts
    for k in range(len(held) - 1, -1, -1):
        t = min(t, upper[k])
        # never None: the node's earliest point is feasible and no later than t
        hi[k] = t = (max(p for p in some[k] if p <= t) if k in some
                     else _settle(held[k], t, "previous"))
    return lo, hi


def to_reference(graph: KernelGraph, history: History, reference: History,
                 buffers: Iterable[Buffer], marks: Sequence[Mark] | None = None) -> Moved:
    """``graph`` (captured with ``history``) with every pointer into one of its blocks moved
    to the same offset in the block of the same number in ``reference`` (see the module).
    ``buffers``: the IR's buffers for the reference's memory (its pool's segments, as the
    reference capture's graph names them), which moved pointers then point into. ``marks``:
    where the capture's operations started (:class:`Mark`, found in ``history`` by their
    markers), which bound when each node ran; without them only the blocks' lives do, and a
    place the capture reused refuses more.

    Raises
    ------
    UnsupportedError
        The two histories differ in their acts or a block outgrows the reference's, a pointer
        could mean blocks that move it to different places, a moved pointer lands in none of
        ``buffers``, the history lacks some of ``marks``' markers, or the graph has
        conditional nodes (their bodies are not moved).
    """
    if (why := _parting(history, reference)) is not None:
        raise UnsupportedError(why)
    if any(isinstance(op, Conditional) for _, op in graph.ops()):
        raise UnsupportedError("expected kernels, copies and memsets to move to the "
                               "reference's places, found a conditional node")
    nodes = list(graph.dag)  # in the order the capture made them (the walk's)
    words = [_addresses(graph, graph.op(node)) for node in nodes]
    holders = _holders(history, dict.fromkeys(a for ws in words for _, a in ws))
    found = [[(which, address, holders[address]) for which, address in ws] for ws in words]
    if marks and len(history.marks) != len(marks):
        raise UnsupportedError(f"expected the capture's {len(marks)} markers in its "
                               f"allocator's history, found {len(history.marks)}")
    lower, upper = (_bounds(history, marks, len(nodes)) if marks else
                    ([0] * len(nodes), [len(history.acts)] * len(nodes)))
    lo, hi = _launch_windows([[h for *_, h in words if h is not None] for words in found],
                             len(history.acts), lower, upper)
    targets = sorted(((b.address, b.address + b.size, b) for b in buffers
                      if b.address is not None and b.memory is Memory.DEVICE),
                     key=lambda t: t[0])
    starts = [s for s, _, _ in targets]

    def target(address: int) -> Buffer | None:
        """The buffer of ``buffers`` holding ``address`` (they do not overlap)."""
        j = bisect.bisect_right(starts, address) - 1
        return targets[j][2] if j >= 0 and address < targets[j][1] else None

    ops: dict[str, Op] = {}
    used: dict[str, Buffer] = {}
    moved = left = 0
    for k, node in enumerate(nodes):
        new: dict[int, Span] = {}
        for which, address, held in found[k]:
            # the blocks its launch could see: alive somewhere between its earliest and latest
            seen = [] if held is None else held.during(lo[k], hi[k])
            if not seen:
                left += held is not None
                continue
            there = {reference.address[i] + address - history.address[i] for i in seen}
            if len(there) != 1:
                raise UnsupportedError(
                    f"expected each pointer to mean one block, found node {node!r}'s pointer "
                    f"{address:#x} meaning blocks {seen} that lie apart in the reference")
            (to,) = there
            buffer = target(to)
            if buffer is None:
                raise UnsupportedError(f"expected the reference's memory to hold every moved "
                                       f"pointer, found {to:#x} (node {node!r}) in none of "
                                       f"its buffers")
            used[buffer.id] = buffer
            new[which] = Span(buffer.id, to - buffer.address)
            moved += 1
        if new:
            ops[node] = _with_spans(graph.op(node), new, used)
    # same ids, edges and node order (the capture's, which a later move reads)
    return Moved(graph.with_ops(ops, used.values()), moved, left)


def _with_spans(op: Op, new: Mapping[int, Span], buffers: Mapping[str, Buffer]) -> Op:
    if isinstance(op, Kernel):
        args, pointers = bytearray(op.args), list(op.pointers)
        for j, span in new.items():
            p = pointers[j]
            address = buffers[span.buffer].address + span.offset
            args[p.offset:p.offset + 8] = address.to_bytes(8, "little")
            pointers[j] = Pointer(p.offset, span)
        return dataclasses.replace(op, args=bytes(args), pointers=tuple(pointers))
    if isinstance(op, Memcpy):
        return dataclasses.replace(op, src=new.get(-1, op.src), dst=new.get(-2, op.dst))
    return dataclasses.replace(op, dst=new.get(-2, op.dst))


