"""A captured stream's chain of operations remade as the DAG of what depends on what.

A capture of one stream is a chain: every node waits for the one before, although most
operations of a small decode step touch memory no neighbour touches (a layer's query, key and
value projections read one input and write three outputs; the rotary embedding of the queries
and of the keys share nothing). At batch 1 such kernels fill a few of the GPU's SMs each and
last a few microseconds, so a chain runs them one after another on a mostly idle GPU. This
pass keeps only the orderings that memory demands, so that the graph runs independent
operations side by side.

What each operation touched comes from the capture (``grape.torch.capture(..., accesses=
True)``): the bytes its tensor arguments span (read, or written where its schema says it
mutates them), those of the tensors it returned (written, unless they are views), and the
blocks the caching allocator made for it during the operation (its temporaries, written).
Two operations are ordered where one writes memory the other reads or writes (``numpy`` finds
the overlaps), less the orderings that others already imply (a transitive reduction, made in
the capture's order).
The kernels of one operation keep the order they were captured in.

What a kernel may touch beyond those declarations is widened, never trusted:

* every pointer among a node's arguments that lies outside its operation's declared memory (a
  library's workspace, a stale word PyTorch left in an unused argument slot, a kernel launched
  outside PyTorch's dispatcher and so attributed to the operation before it) adds what it may
  mean, as written by the operation: every range some operation of the capture declared that
  holds it (a stale word names an earlier tensor); where none does, every block the allocator
  gave a tensor during the capture that holds it (a library's workspace); where none does but
  the allocator manages the memory, nothing (no tensor lived there while the graph was
  captured, so no kernel of it can use it: a stale word); elsewhere (memory a library
  allocated itself, or no :class:`Allocations` given), the whole buffer it points into;
* except where the node is a kernel of the operation's own (launched inside its dispatch,
  with the operation's temporaries known: ``OpAccess.end``, which the capture gives only
  where the allocator's history gives every operation the fresh results it returned, since a
  temporary given to the wrong operation would look stale here) and the word lies in another
  operation's tensor. There the dispatcher's contract holds: an operation's kernels touch the
  tensors its schema names, the temporaries it makes, and library state (workspaces, a generator's
  offsets), never another operation's tensors, so the word is stale (unused slots of PyTorch's
  fixed-size argument arrays keep what the host's stack held, which can be an earlier
  launch's pointers) and is left out: as a write it would order the operation after
  whatever that earlier launch touched. The declarations themselves are checked by running
  real decode steps in the order the DAG allows (``grape.torch.reordering``, on the CPU for
  every architecture: ``benchmarks/arch_sweep.py --host-loop --check-reordering``);
* a node that is neither a kernel, a copy nor a set (a conditional, an event, an empty join) and
  the nodes captured before the first operation order everything: they depend on all before
  them and all after them on them.

What it cannot see: memory a kernel reaches through a pointer held in device memory rather than
in its arguments, and ``__device__`` globals of a module that two launches share. PyTorch's own
kernels take their pointers as arguments (``TensorInfo``, the ``cat`` and ``foreach`` metadata
passed by value); a custom extension that does otherwise should not use this pass.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from grape.errors import UnsupportedError
from grape.ir import Kernel, KernelGraph, Memcpy, Memset, Op

__all__ = ["Allocations", "Concurrency", "OpAccess", "concurrent"]

Range = tuple[int, int]  # (address, size)
_EVERYTHING = (0, 1 << 62)  # device and host addresses lie below 2**48


@dataclass(frozen=True)
class OpAccess:
    """One operation of a capture: ``start``, the number of nodes the graph held when it began
    (its nodes are those up to the next operation's start), and the memory it read and wrote,
    as (address, size) ranges, its temporaries among the writes. ``end``: the node count
    when its dispatch returned, where its temporaries are known (None where not): the nodes
    before it are the operation's own kernels, the others were launched outside PyTorch's
    dispatcher before the next operation began."""

    start: int
    reads: tuple[Range, ...] = ()
    writes: tuple[Range, ...] = ()
    name: str = ""
    end: int | None = None


@dataclass(frozen=True)
class Allocations:
    """The caching allocator's view of a capture: ``segments``, the memory it manages, and
    ``held``, every block a tensor held at some point of the capture (alive at its start or
    end, or allocated or freed during it), as (address, size) ranges."""

    segments: tuple[Range, ...] = ()
    held: tuple[Range, ...] = ()


@dataclass(frozen=True)
class Concurrency:
    """The DAG and what it cost in precision: ``groups`` (operations that made nodes), the
    names of ``barriers`` (groups that order everything) and of ``widened`` groups (whose
    nodes pointed outside their declarations; each name followed by what the words were
    widened to: declared tensors, allocator blocks, whole buffers), ``depth`` (nodes on the
    longest path, against ``nodes`` in the chain); ``stale``, the names of groups whose own
    kernels held a word naming another operation's tensor, left out (the module says why)."""

    graph: KernelGraph
    nodes: int
    groups: int
    barriers: tuple[str, ...]
    widened: tuple[str, ...]
    depth: int
    edges: int
    stale: tuple[str, ...] = ()


@dataclass
class _Group:
    nodes: list[str]
    reads: list[Range]
    writes: list[Range]
    name: str
    barrier: bool = False
    widened: set[str] = field(default_factory=set)  # to what: "tensor", "block", "buffer"
    dispatched: int = 0  # its first nodes launched inside the operation's dispatch
    stale: bool = False  # a word of those named another operation's tensor


def _inside(address: int, ranges: Sequence[Range]) -> bool:
    return any(lo <= address < lo + size for lo, size in ranges)


def _targets(graph: KernelGraph, op: Op) -> list[tuple[int, Range]]:
    """Each address ``op`` points at, with the buffer that holds it."""
    found = []
    for span in op.spans():
        buffer = graph.buffers[span.buffer]
        if buffer.address is None:
            raise UnsupportedError(f"expected buffers that keep their capture addresses, found "
                                   f"{buffer.id!r} without one (a graph loaded from a file)")
        found.append((buffer.address + span.offset, (buffer.address, buffer.size)))
    return found


class _Index:
    """Ranges, and which of them hold an address."""

    def __init__(self, ranges: Sequence[Range]) -> None:
        self.ranges = list(ranges)
        self.lo = np.array([a for a, _ in self.ranges], dtype=np.int64)
        self.hi = self.lo + np.array([n for _, n in self.ranges], dtype=np.int64)

    def holding(self, address: int) -> list[Range]:
        return [self.ranges[k] for k in np.flatnonzero((self.lo <= address)
                                                       & (address < self.hi))]


def _groups(graph: KernelGraph, ops: Sequence[OpAccess],
            allocations: Allocations | None) -> list[_Group]:
    nodes = list(graph.dag)  # in the order the capture made them
    starts = [op.start for op in ops]
    if any(b < a for a, b in itertools.pairwise(starts)) or (
            starts and not 0 <= starts[0] <= starts[-1] <= len(nodes)):
        raise UnsupportedError(f"expected operations starting in order within the graph's "
                               f"{len(nodes)} nodes, found starts from {starts[:1]} to "
                               f"{starts[-1:]}")
    groups = [_Group(nodes[:starts[0] if ops else len(nodes)], [], [_EVERYTHING],
                     "before the first operation", barrier=True)]
    for i, op in enumerate(ops):
        end = starts[i + 1] if i + 1 < len(ops) else len(nodes)
        inside = 0 if op.end is None else min(max(op.end, op.start), end) - op.start
        groups.append(_Group(nodes[op.start:end], list(op.reads), list(op.writes), op.name,
                             dispatched=inside))
    # What an undeclared word may mean (the module's list): a stale slot of PyTorch's offset
    # calculators names an earlier tensor, or memory no tensor held during the capture.
    declared_anywhere = _Index([r for g in groups[1:] for r in g.reads + g.writes])
    held = _Index(allocations.held if allocations else ())
    managed = _Index(allocations.segments if allocations else ())
    for g in groups:
        declared = g.reads + g.writes
        extra: set[Range] = set()
        for k, node in enumerate(g.nodes):
            op = graph.op(node)
            if not isinstance(op, (Kernel, Memcpy, Memset)):
                g.barrier = True
                continue
            for address, buffer in _targets(graph, op):
                if _inside(address, declared):
                    continue
                if tensors := declared_anywhere.holding(address):
                    if k < g.dispatched and isinstance(op, Kernel):
                        g.stale = True  # a word of the operation's own kernel (a copy's
                        continue  # or a set's ends are exact, never stale)
                    extra.update(tensors)
                    g.widened.add("tensor")
                elif blocks := held.holding(address):
                    extra.update(blocks)
                    g.widened.add("block")
                elif not managed.holding(address):
                    extra.add(buffer)
                    g.widened.add("buffer")
        g.writes += sorted(extra)
        if g.barrier:
            g.writes = [_EVERYTHING]
    return [g for g in groups if g.nodes]


def _dependencies(groups: Sequence[_Group]) -> nx.DiGraph:
    """Group j after group i where one writes what the other reads or writes, without the
    orderings others already imply (the transitive reduction)."""
    total = sum(len(g.reads) + len(g.writes) for g in groups)
    lo, hi = np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64)
    owner, wrote = np.empty(total, dtype=np.int64), np.empty(total, dtype=bool)
    reduction = _Reduction(len(groups))
    n = 0  # the accesses of the groups before j, in lo[:n] and the others
    for j, g in enumerate(groups):
        accesses = [(r, False) for r in g.reads] + [(r, True) for r in g.writes]
        clash = np.zeros(n, dtype=bool)
        for (start, size), writing in accesses:
            overlaps = (lo[:n] < start + size) & (start < hi[:n])
            clash |= overlaps if writing else overlaps & wrote[:n]
        reduction.add(j, np.unique(owner[:n][clash]))
        for k, ((start, size), writing) in enumerate(accesses, n):
            lo[k], hi[k], owner[k], wrote[k] = start, start + size, j, writing
        n += len(accesses)
    return reduction.graph


class _Reduction:
    """The transitive reduction of a DAG built one node at a time, each node after all its
    predecessors (here, the capture's order). ``networkx.transitive_reduction`` searches from
    every node of a finished graph; on a decode step's conflicts (most operations clash with
    many before them) that took seconds for a thousand operations. Known as they arrive, the
    reduction needs only each node's ancestors: a predecessor is kept unless it is an ancestor
    of a later predecessor, and, taken latest first, of one kept already. Ancestor sets are
    rows of bits, 64 nodes a word."""

    def __init__(self, n: int) -> None:
        self.graph = nx.DiGraph()
        self.graph.add_nodes_from(range(n))
        self.ancestors = np.zeros((n, (n + 63) // 64), dtype=np.uint64)

    def add(self, j: int, before: np.ndarray) -> None:
        """Node ``j`` after each of ``before`` (earlier nodes, ascending)."""
        row = self.ancestors[j]
        while before.size:
            i = int(before[-1])
            self.graph.add_edge(i, j)
            row |= self.ancestors[i]
            row[i >> 6] |= np.uint64(1 << (i & 63))
            known = (row[before >> 6] >> (before & 63).astype(np.uint64)) & np.uint64(1)
            before = before[known == 0]


def concurrent(graph: KernelGraph, ops: Sequence[OpAccess],
               allocations: Allocations | None = None) -> Concurrency:
    """``graph`` (one stream's capture, nodes in capture order) with each operation's nodes
    ordered only after the operations whose memory theirs overlaps (see the module);
    ``allocations`` tells stale words from workspaces more finely than buffers do.

    Raises
    ------
    UnsupportedError
        ``ops`` do not fit the graph's nodes, or a buffer has no address to compare.
    """
    groups = _groups(graph, ops, allocations)
    order = _dependencies(groups)
    out = KernelGraph()
    for buffer in graph.buffers.values():
        out.add_buffer(buffer)
    for node in graph.dag:  # every node is in one group; the capture's order kept
        out.dag.add_node(node, op=graph.op(node))
    ends: list[tuple[list[str], list[str]]] = []  # each group's (first nodes, last nodes)
    for g in groups:
        inside = graph.dag.subgraph(g.nodes)
        for u, v, kind in inside.edges(data="kind"):
            out.add_edge(u, v, kind)
        ends.append(([n for n in g.nodes if inside.in_degree(n) == 0],
                     [n for n in g.nodes if inside.out_degree(n) == 0]))
    for i, j in order.edges:
        for u in ends[i][1]:
            for v in ends[j][0]:
                kind = graph.dag.edges[u, v].get("kind") if graph.dag.has_edge(u, v) else None
                out.add_edge(u, v, kind)
    out.validate()
    return Concurrency(out, len(out), len(groups),
                       tuple(g.name for g in groups if g.barrier),
                       tuple(f"{g.name} ({', '.join(sorted(g.widened))})" for g in groups
                             if g.widened and not g.barrier),
                       nx.dag_longest_path_length(out.dag) + 1 if len(out) else 0,
                       out.dag.number_of_edges(),
                       tuple(g.name for g in groups if g.stale and not g.barrier))
