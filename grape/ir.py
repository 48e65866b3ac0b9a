"""The kernel-graph IR that the simulator and the CUDA backend share.

A :class:`KernelGraph` is a ``networkx.DiGraph`` (``graph.dag``) whose nodes carry one frozen
operation each (:class:`Kernel`, :class:`Memcpy`, :class:`Memset`, :class:`Conditional`,
:class:`Empty`, :class:`EventRecord`, :class:`EventWait`) under the node attribute ``"op"``, and
whose edges are dependencies, plus a table of the buffers that operations read and write.

This module imports neither backend. Both build, read and transform graphs only through it, and
passes (``grape.passes``) are plain functions over it.

Examples
--------
>>> g = KernelGraph()
>>> _ = g.add_buffer(Buffer("x", 4096, BufferRole.INPUT))
>>> k = Kernel(function="f0", name="scale", grid=(4, 1, 1), block=(256, 1, 1),
...            args=bytes(8), params=(Param(0, 8),), pointers=(Pointer(0, Span("x")),))
>>> g.add("a", k)
'a'
>>> g.add("b", Empty(), after=["a"])
'b'
>>> g.validate()
>>> KernelGraph.from_json(g.to_json()) == g
True
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

import networkx as nx

from grape.errors import (
    DanglingBufferError,
    GraphCycleError,
    GraphError,
    LaunchConfigError,
    SchemaVersionError,
    UnknownNodeKindError,
)
from grape.jsonio import dump_json, load_json

__all__ = [
    "EDGE_KINDS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "Buffer",
    "BufferRole",
    "Conditional",
    "ConditionalKind",
    "Empty",
    "EventRecord",
    "EventWait",
    "Kernel",
    "KernelGraph",
    "Memcpy",
    "Memory",
    "Memset",
    "Op",
    "Param",
    "Pointer",
    "Span",
    "fingerprint",
]

SCHEMA = "grape.ir"
SCHEMA_VERSION = 1

# Architectural limits of every CUDA device up to compute capability 10.x (CUDA C Programming
# Guide, "Technical Specifications"). A graph beyond them cannot launch anywhere.
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK = (1024, 1024, 64)
MAX_THREADS_PER_BLOCK = 1024
MAX_SHARED_MEM = 232448  # 227 KiB: the largest opt-in dynamic shared memory of any device


class BufferRole(StrEnum):
    INPUT = "input"  # a placeholder that each replay's inputs are copied (or aliased) into
    OUTPUT = "output"
    INTERNAL = "internal"  # activations and workspace, owned by the graph's memory pool
    PARAMETER = "parameter"  # weights: live across replays, never written by the graph


class Memory(StrEnum):
    DEVICE = "device"
    HOST = "host"


@dataclass(frozen=True)
class Buffer:
    """A region of memory that operations point into."""

    id: str
    size: int
    role: BufferRole
    memory: Memory = Memory.DEVICE
    address: int | None = None  # where it lay when captured; rebuilding in that process uses it


@dataclass(frozen=True)
class Span:
    """A byte offset into a buffer of the graph's table."""

    buffer: str
    offset: int = 0


@dataclass(frozen=True)
class Param:
    """Where one kernel parameter lies in the packed argument bytes."""

    offset: int
    size: int


@dataclass(frozen=True)
class Pointer:
    """A device address inside the packed argument bytes, and the buffer it points into.

    ``offset`` is a byte offset into ``Kernel.args``, not a parameter index: PyTorch passes most
    pointers inside structures (``TensorInfo``, ``Array<char*, N>``), not as parameters of their
    own.
    """

    offset: int
    target: Span


@dataclass(frozen=True)
class HandleRef:
    """A conditional handle passed in the argument bytes, by the name a Conditional gives it.

    Kernels that set a condition (``cudaGraphSetConditional``) take the handle as an argument;
    a rebuilt graph creates new handles, and these references say where to write them.
    """

    offset: int
    handle: str


LaunchAttribute = tuple[str, int | tuple[int, ...]]


@dataclass(frozen=True)
class Kernel:
    """A kernel launch.

    ``function`` is the identity of the device function (whatever the capturer can name
    uniquely: a handle, or a module hash plus the mangled name). ``name`` is for people: different
    functions can share a name, so nothing compares kernels by it.
    """

    kind: ClassVar[str] = "kernel"
    function: str
    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int = 0
    attributes: tuple[LaunchAttribute, ...] = ()
    args: bytes = b""
    params: tuple[Param, ...] = ()
    pointers: tuple[Pointer, ...] = ()
    handles: tuple[HandleRef, ...] = ()

    def spans(self) -> Iterator[Span]:
        return (p.target for p in self.pointers)


@dataclass(frozen=True)
class Memcpy:
    kind: ClassVar[str] = "memcpy"
    src: Span
    dst: Span
    size: int

    def spans(self) -> Iterator[Span]:
        return iter((self.src, self.dst))


@dataclass(frozen=True)
class Memset:
    kind: ClassVar[str] = "memset"
    dst: Span
    value: int
    element_size: int  # 1, 2 or 4 bytes, as cuMemsetD8/D16/D32
    width: int  # elements per row
    height: int = 1
    pitch: int = 0  # bytes between rows; unused when height is 1

    @property
    def extent(self) -> int:
        """Bytes from the first to the last one written."""
        return (self.height - 1) * self.pitch + self.width * self.element_size

    def spans(self) -> Iterator[Span]:
        return iter((self.dst,))


class ConditionalKind(StrEnum):
    IF = "if"
    IF_ELSE = "if_else"
    WHILE = "while"
    SWITCH = "switch"


# How many body graphs each kind of conditional node holds (SWITCH: one per case, at least one).
_BODY_COUNT = {
    ConditionalKind.IF: (1, 1),
    ConditionalKind.IF_ELSE: (2, 2),
    ConditionalKind.WHILE: (1, 1),
    ConditionalKind.SWITCH: (1, None),
}


@dataclass(frozen=True)
class Conditional:
    """A CUDA conditional node: body graphs run or repeat as a device-side value says.

    ``handle`` names the conditional handle that a kernel sets on the device; ``default`` is the
    value the handle takes at each launch of the graph (``None``: it keeps the last value).
    Bodies point into the buffer table of the graph that holds the node.
    """

    kind: ClassVar[str] = "conditional"
    type: ConditionalKind
    handle: str
    bodies: tuple[KernelGraph, ...]
    default: int | None = 0

    def spans(self) -> Iterator[Span]:
        return iter(())


@dataclass(frozen=True)
class Empty:
    """A node that only orders others (joins of parallel branches)."""

    kind: ClassVar[str] = "empty"

    def spans(self) -> Iterator[Span]:
        return iter(())


@dataclass(frozen=True)
class EventRecord:
    kind: ClassVar[str] = "event_record"
    event: str

    def spans(self) -> Iterator[Span]:
        return iter(())


@dataclass(frozen=True)
class EventWait:
    kind: ClassVar[str] = "event_wait"
    event: str

    def spans(self) -> Iterator[Span]:
        return iter(())


Op = Kernel | Memcpy | Memset | Conditional | Empty | EventRecord | EventWait
OP_TYPES: dict[str, type] = {
    t.kind: t for t in (Kernel, Memcpy, Memset, Conditional, Empty, EventRecord, EventWait)
}


# Dependencies weaker than "after the upstream node completes", kept on an edge as its
# ``"kind"`` attribute (none: a full dependency). Both join kernels; a kernel launched with
# programmatic dependent launch (PDL) is captured behind one. "programmatic": the downstream
# kernel may start once every block upstream has triggered (``griddepcontrol.launch_dependents``)
# or finished, and waits in its own code (``griddepcontrol.wait``) for the upstream's memory;
# "launch_order": it may start once the upstream has started. Read from the edge's data
# (``CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC`` with the kernel node's programmatic or
# launch-order port), and built the same way: made full they stay correct but lose the overlap.
EDGE_KINDS = ("programmatic", "launch_order")


class KernelGraph:
    """A DAG of operations over a table of buffers.

    ``dag`` is a plain ``networkx.DiGraph``: use networkx's algorithms on it directly. Each node
    holds its operation under the attribute ``"op"``; an edge weaker than a full dependency
    holds its kind (:data:`EDGE_KINDS`) under ``"kind"``.
    """

    def __init__(self) -> None:
        self.dag = nx.DiGraph()
        self.buffers: dict[str, Buffer] = {}

    def add_buffer(self, buffer: Buffer) -> Buffer:
        if buffer.id in self.buffers:
            raise GraphError(f"expected a new buffer id, found {buffer.id!r} already in the table")
        self.buffers[buffer.id] = buffer
        return buffer

    def add(self, node: str, op: Op, after: Iterable[str] = (),
            kinds: Mapping[str, str] | None = None) -> str:
        """Add operation ``op`` as ``node``, depending on the nodes in ``after``; ``kinds``
        gives the dependencies that are weaker than full ones their kind (:data:`EDGE_KINDS`)."""
        if node in self.dag:
            raise GraphError(f"expected a new node id, found {node!r} already in the graph")
        self.dag.add_node(node, op=op)
        for dep in after:
            if dep not in self.dag:
                raise GraphError(f"node {node!r}: expected dependencies on existing nodes, "
                                 f"found {dep!r}")
            self.add_edge(dep, node, (kinds or {}).get(dep))
        return node

    def add_edge(self, before: str, after: str, kind: str | None = None) -> None:
        """``after`` depends on ``before``: fully, or as ``kind`` says (:data:`EDGE_KINDS`)."""
        if kind is not None and kind not in EDGE_KINDS:
            raise GraphError(f"edge {before!r} -> {after!r}: expected a kind among "
                             f"{', '.join(EDGE_KINDS)} or none, found {kind!r}")
        if kind is None:
            self.dag.add_edge(before, after)
        else:
            self.dag.add_edge(before, after, kind=kind)

    def with_ops(self, ops: Mapping[str, Op], buffers: Iterable[Buffer] = ()) -> KernelGraph:
        """This graph with some nodes' operations replaced by ``ops``: the same ids, node
        order, edges and buffers, with ``buffers`` added for the replacements to point into.
        The DAG is copied (its node attributes too: this graph's are left alone), not rebuilt
        node by node, which families and moves do once a shape."""
        if unknown := ops.keys() - self.dag.nodes:
            raise GraphError(f"expected operations for nodes of the graph, found "
                             f"{sorted(unknown)[:3]} not among its {len(self.dag)} nodes")
        out = KernelGraph()
        out.buffers = dict(self.buffers)
        for b in buffers:
            out.buffers.setdefault(b.id, b)
        out.dag = self.dag.copy()
        for node, op in ops.items():
            out.dag.nodes[node]["op"] = op
        return out

    def kinds_into(self, node: str) -> dict[str, str]:
        """The dependencies of ``node`` weaker than full ones, each to its kind."""
        return {u: k for u, _, k in self.dag.in_edges(node, data="kind") if k is not None}

    def edges(self) -> set[tuple[str, str, str | None]]:
        """Every edge with its kind (None: a full dependency)."""
        return set(self.dag.edges(data="kind"))

    def op(self, node: str) -> Op:
        return self.dag.nodes[node]["op"]

    def ops(self) -> Iterator[tuple[str, Op]]:
        """Nodes and their operations, in insertion order."""
        return iter(self.dag.nodes(data="op"))

    def kernels(self) -> Iterator[tuple[str, Kernel]]:
        return ((n, op) for n, op in self.ops() if isinstance(op, Kernel))

    def __len__(self) -> int:
        return len(self.dag)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KernelGraph):
            return NotImplemented
        return (
            self.buffers == other.buffers
            and dict(self.ops()) == dict(other.ops())
            and self.edges() == other.edges()
        )

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return (f"KernelGraph({len(self.dag)} nodes, {self.dag.number_of_edges()} edges, "
                f"{len(self.buffers)} buffers)")

    # --- checks ---------------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise a :class:`~grape.errors.GraphError` subclass unless the graph can run.

        Raises
        ------
        GraphCycleError
            Dependencies form a cycle.
        UnknownNodeKindError
            A node holds no operation, or one grape does not model.
        DanglingBufferError
            An operation points into a buffer the table lacks, or past its end.
        LaunchConfigError
            Grid, block, shared memory or argument layout beyond what CUDA can launch.
        """
        _validate(self, self.buffers, where="")
        _check_handles(self)

    def fingerprint(self, *, launch: bool = True) -> str:
        """See :func:`fingerprint`."""
        return fingerprint(self, launch=launch)

    # --- files ----------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        from grape.irjson import graph_to_json

        return graph_to_json(self)

    @classmethod
    def from_json(cls, doc: Any) -> KernelGraph:
        from grape.irjson import graph_from_json

        return graph_from_json(doc)

    def save(self, path: str | Path) -> Path:
        """Write the graph as JSON (gzipped when ``path`` ends in .gz)."""
        return dump_json(path, self.to_json(), indent=1)

    @classmethod
    def load(cls, path: str | Path) -> KernelGraph:
        """Read and validate a graph file; errors name the file."""
        doc = load_json(path, GraphError)
        try:
            graph = cls.from_json(doc)
            graph.validate()
        except GraphError as e:
            raise type(e)(f"{path}: {e}") from None
        except SchemaVersionError as e:
            raise SchemaVersionError(f"{path}: {e}") from None
        return graph


# --- validation ---------------------------------------------------------------------------------


def _validate(graph: KernelGraph, buffers: dict[str, Buffer], where: str) -> None:
    for node, op in graph.dag.nodes(data="op"):
        at = f"{where}node {node!r}"
        if type(op) not in OP_TYPES.values():
            found = "no operation" if op is None else type(op).__name__
            raise UnknownNodeKindError(f"{at}: expected one of {', '.join(OP_TYPES)}, "
                                       f"found {found}")
        _check_spans(op, buffers, at)
        if isinstance(op, Kernel):
            _check_kernel(op, at)
        elif isinstance(op, Memset) and op.element_size not in (1, 2, 4):
            raise LaunchConfigError(f"{at}: expected a memset element size of 1, 2 or 4 bytes, "
                                    f"found {op.element_size}")
        elif isinstance(op, Conditional):
            low, high = _BODY_COUNT[op.type]
            n = len(op.bodies)
            if n < low or (high is not None and n > high):
                want = f"{low}" if low == high else f"at least {low}"
                raise GraphError(f"{at}: expected {want} bodies for a {op.type.value} "
                                 f"conditional, found {n}")
            for i, body in enumerate(op.bodies):
                _validate(body, buffers, f"{at} body {i}: ")
    # find_cycle's edge walk grows faster than the edges on a DAG (1.5 s at 3,000 nodes and
    # 12,000 edges, against 8 ms for the topological check), and a concurrent step is such a
    # DAG: it took 0.94 s of a profiled concurrent Llama capture's 3.5 on an H100
    # (benchmarks/capture_cost.py). It names the cycle only where there is one.
    if nx.is_directed_acyclic_graph(graph.dag):
        return
    cycle = nx.find_cycle(graph.dag)
    path = " -> ".join(str(u) for u, _ in cycle) + f" -> {cycle[0][0]}"
    raise GraphCycleError(f"{where}expected an acyclic graph, found the cycle {path}")


def _conditionals(graph: KernelGraph) -> Iterator[Conditional]:
    for _, op in graph.ops():
        if isinstance(op, Conditional):
            yield op
            for body in op.bodies:
                yield from _conditionals(body)


def _kernels_deep(graph: KernelGraph, where: str = "") -> Iterator[tuple[str, Kernel]]:
    for node, op in graph.ops():
        if isinstance(op, Kernel):
            yield f"{where}node {node!r}", op
        elif isinstance(op, Conditional):
            for i, body in enumerate(op.bodies):
                yield from _kernels_deep(body, f"{where}node {node!r} body {i}: ")


def _check_handles(graph: KernelGraph) -> None:
    handles = {c.handle for c in _conditionals(graph)}
    for at, k in _kernels_deep(graph):
        for ref in k.handles:
            if ref.handle not in handles:
                raise GraphError(f"{at}: expected handle arguments to name a conditional of the "
                                 f"graph, found {ref.handle!r}")
            if not 0 <= ref.offset <= len(k.args) - 8:
                raise LaunchConfigError(f"{at}: expected handles to lie inside the "
                                        f"{len(k.args)} argument bytes, found one at offset "
                                        f"{ref.offset}")


def _extent(op: Op, span: Span) -> int:
    if isinstance(op, Memcpy):
        return op.size
    if isinstance(op, Memset):
        return op.extent
    return 1  # a kernel's pointer must land inside the buffer; its reach is the kernel's business


def _check_spans(op: Op, buffers: dict[str, Buffer], at: str) -> None:
    for span in op.spans():
        buf = buffers.get(span.buffer)
        if buf is None:
            raise DanglingBufferError(f"{at}: expected a buffer of the table, found a reference "
                                      f"to unknown buffer {span.buffer!r}")
        end = span.offset + _extent(op, span)
        if span.offset < 0 or end > buf.size:
            raise DanglingBufferError(f"{at}: expected bytes within buffer {buf.id!r} "
                                      f"(0..{buf.size}), found {span.offset}..{end}")


def _check_kernel(k: Kernel, at: str) -> None:
    for label, dims, limits in (("grid", k.grid, MAX_GRID), ("block", k.block, MAX_BLOCK)):
        if len(dims) != 3 or any(not 1 <= d <= m for d, m in zip(dims, limits, strict=True)):
            raise LaunchConfigError(f"{at}: expected a {label} of 3 dimensions within 1..{limits}, "
                                    f"found {dims}")
    threads = k.block[0] * k.block[1] * k.block[2]
    if threads > MAX_THREADS_PER_BLOCK:
        raise LaunchConfigError(f"{at}: expected at most {MAX_THREADS_PER_BLOCK} threads per "
                                f"block, found {threads} ({k.block})")
    if not 0 <= k.shared_mem <= MAX_SHARED_MEM:
        raise LaunchConfigError(f"{at}: expected dynamic shared memory within 0..{MAX_SHARED_MEM} "
                                f"bytes, found {k.shared_mem}")
    end = 0
    for i, p in enumerate(k.params):
        if p.size <= 0 or p.offset < end or p.offset + p.size > len(k.args):
            raise LaunchConfigError(f"{at}: expected parameter {i} to follow the previous one "
                                    f"inside the {len(k.args)} argument bytes, found "
                                    f"offset {p.offset} size {p.size}")
        end = p.offset + p.size
    for ptr in k.pointers:
        if not 0 <= ptr.offset <= len(k.args) - 8:
            raise LaunchConfigError(f"{at}: expected pointers to lie inside the {len(k.args)} "
                                    f"argument bytes, found one at offset {ptr.offset}")


# --- fingerprints -------------------------------------------------------------------------------


def _digest(*parts: object) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def _label(graph: KernelGraph, op: Op, launch: bool) -> tuple:
    if isinstance(op, Kernel):
        if not launch:
            return ("kernel",)
        return ("kernel", op.function, op.grid, op.block, op.shared_mem, op.attributes)
    if isinstance(op, Memcpy) and launch:
        memory = tuple(graph.buffers[s.buffer].memory.value
                       if s.buffer in graph.buffers else "?" for s in (op.src, op.dst))
        return ("memcpy", op.size, memory)
    if isinstance(op, Memset) and launch:
        return ("memset", op.element_size, op.width, op.height)
    if isinstance(op, Conditional):
        bodies = tuple(_fingerprint(b, graph, launch) for b in op.bodies)
        return ("conditional", op.type.value, op.default, bodies)
    return (op.kind,)


def _node_hashes(graph: KernelGraph, buffers_from: KernelGraph, launch: bool) -> dict[Any, str]:
    dag = graph.dag
    label = {n: _label(buffers_from, op, launch) for n, op in dag.nodes(data="op")}
    order = list(nx.topological_sort(dag))
    # Merkle hashes over ancestors and over descendants: a node's hash describes where it sits,
    # never what it is called, so relabelled or re-ordered captures of the same work agree.
    up: dict[Any, str] = {}
    for n in order:
        up[n] = _digest(label[n], sorted(up[p] for p in dag.predecessors(n)))
    down: dict[Any, str] = {}
    for n in reversed(order):
        down[n] = _digest(label[n], sorted(down[s] for s in dag.successors(n)))
    return {n: _digest(up[n], down[n]) for n in order}


def node_hashes(graph: KernelGraph, *, launch: bool = True) -> dict[Any, str]:
    """Each node's place in the graph as a hash (see :func:`fingerprint`): equal for nodes that
    correspond in two captures of the same work."""
    try:
        return _node_hashes(graph, graph, launch)
    except nx.NetworkXUnfeasible:
        raise GraphCycleError("expected an acyclic graph to hash, found a cycle") from None


def _fingerprint(graph: KernelGraph, buffers_from: KernelGraph, launch: bool,
                 node: Mapping[Any, str] | None = None) -> str:
    node = node if node is not None else _node_hashes(graph, buffers_from, launch)
    # An edge's kind counts where it has one (a graph of full dependencies hashes as before).
    edges = sorted((node[u], node[v]) if k is None else (node[u], node[v], k)
                   for u, v, k in graph.dag.edges(data="kind"))
    return _digest("grape-fingerprint-1", launch, sorted(node.values()), edges)


def fingerprint(graph: KernelGraph, *, launch: bool = True,
                hashes: Mapping[Any, str] | None = None) -> str:
    """Hash of a graph's topology, independent of node ids and insertion order.

    With ``launch=True`` it covers node kinds, kernel function identity, launch configuration
    (grid, block, shared memory), launch attributes, copy and memset shapes, conditional bodies
    and edges: graphs that can share one instantiated executable with no update at all except
    argument bytes. With ``launch=False`` only kinds and edges count: what
    ``cuGraphExecUpdate`` needs to hold. Argument bytes, buffer addresses and kernel names never
    count.

    Equal graphs always get equal fingerprints. Like any Weisfeiler-Lehman-style invariant it
    could in principle confuse two non-isomorphic graphs; callers that must be certain (binding
    one graph's nodes to another's) check the node mapping too.

    ``hashes``: the graph's :func:`node_hashes` with the same ``launch``, where the caller has
    them already (the fingerprint is made of them).

    Raises
    ------
    GraphCycleError
        The graph has a cycle, so it has no topology to hash.
    """
    try:
        return _fingerprint(graph, graph, launch, hashes)
    except nx.NetworkXUnfeasible:
        raise GraphCycleError("expected an acyclic graph to fingerprint, found a cycle") from None
