"""What a traced launch's conditional nodes did, read from the streams their bodies ran on.

A graph's IF and SWITCH nodes choose on the device, so :func:`grape.sim.graph.run_graph` needs
the choices given (:class:`~grape.sim.graph.Choices`). A trace of the launch holds them: the GPU
runs each conditional body it enters as a graph of its own, on a stream of its own, and CUPTI
reports those streams (an H100's trace of a device loop: its prompt's twelve attention IF
nodes taken, each body's two operations on a stream of their own, stream 298 to 320, and the
WHILE body's 21,924 kernels on one more). So a body ran where a stream beside the launch's
holds exactly its kernels (by demangled name, grid and block, as durations are matched).

The outer graph's IF, IF/ELSE and SWITCH nodes are read, in the order they were captured,
against those streams in the order they began: each node takes the next such stream where it
holds one of its bodies' kernels, and is skipped (an IF) or runs no branch (a SWITCH)
otherwise. Streams that fit the nodes in more than one way (two IF nodes of the same body and
one stream of it) are refused: placed from the last node backwards they would tell otherwise,
and which node ran is what the caller asked. Not read: WHILE counts
(CUPTI drops records of long loops: 3,470 of a GPT-2 loop's 107,730 kernels on the H200),
conditionals inside bodies, and nodes that may have run a body without kernels (no stream
shows it; an IF/ELSE whose other body left none ran this one). A stream a body's kernels fill
that no node takes in order is an error, not a guess.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

from grape.errors import SimulationError
from grape.ir import Conditional, ConditionalKind, Kernel, KernelGraph
from grape.records import GpuRecord, LaunchRecord
from grape.sim.graph import Choices, KernelKey, kernel_key

__all__ = ["choices_in_launch", "choices_in_trace"]

Signature = tuple[KernelKey, ...]  # a body's kernels, sorted: the order its stream ran them
_CHOOSING = (ConditionalKind.IF, ConditionalKind.IF_ELSE, ConditionalKind.SWITCH)


def _signature(body: KernelGraph) -> Signature:
    return tuple(sorted(kernel_key(op) for _, op in body.ops() if isinstance(op, Kernel)))


def _streams(ops: Sequence[GpuRecord], kernels: set[KernelKey]) -> list[Signature]:
    """The kernels of each stream but the launch's own (the one its first operation ran on),
    in the order the streams began; only ``kernels``, the graph's own: a memset node runs as
    a kernel CUPTI names (``memset32`` on an H100) where the IR holds a memset."""
    if not ops:
        return []
    first = min(ops, key=lambda op: op.ts)
    by_stream: dict[int, list[tuple[float, KernelKey]]] = defaultdict(list)
    for op in ops:
        if op.stream != first.stream and op.kind == "kernel" and op.grid and op.block:
            key = (op.name, tuple(op.grid), tuple(op.block))
            if key in kernels:
                by_stream[op.stream].append((op.ts, key))
    begun = sorted(by_stream.values(), key=min)
    return [tuple(sorted(key for _, key in run)) for run in begun]


def _placed(nodes: Sequence[tuple[str, Conditional]], bodies: dict[str, list[Signature]],
            streams: Sequence[Signature]) -> tuple[dict[str, int | None], int]:
    """Each node's body that ran (or None), each taking the next stream where it holds one
    of its bodies; and how many streams were left."""
    ran: dict[str, int | None] = {}
    at = 0
    for name, _ in nodes:
        fits = at < len(streams) and streams[at] in bodies[name]
        ran[name] = bodies[name].index(streams[at]) if fits else None
        at += fits
    return ran, len(streams) - at


def choices_in_launch(graph: KernelGraph, ops: Sequence[GpuRecord], source: str) -> Choices:
    """The IF and SWITCH choices of ``graph``'s outer conditional nodes in one traced launch
    of it (``ops``: the launch's GPU work, every stream's), read as the module says.

    Raises
    ------
    SimulationError
        A body's stream that the nodes, taken in order, leave over; streams that fit the
        nodes in more than one way (placed from the first node and from the last, they differ).
    """
    return _read(graph, ops, source)[0]


def _read(graph: KernelGraph, ops: Sequence[GpuRecord], source: str) -> tuple[Choices, int]:
    """:func:`choices_in_launch`, and how many bodies' streams the launch showed."""
    nodes = [(name, op) for name, op in graph.ops()
             if isinstance(op, Conditional) and op.type in _CHOOSING]
    bodies = {name: [_signature(body) for body in op.bodies] for name, op in nodes}
    known = {s for signatures in bodies.values() for s in signatures if s}
    kernels = {key for s in known for key in s}
    streams = [s for s in _streams(ops, kernels) if s in known]
    ran, left = _placed(nodes, bodies, streams)
    if left:
        sizes = Counter(len(s) for s in streams[len(streams) - left:])
        raise SimulationError(
            f"{source}: expected the streams of conditional bodies to follow the graph's "
            f"conditional nodes in order, found {left} left over (of "
            f"{', '.join(f'{n} x {k} kernels' for k, n in sorted(sizes.items()))}): give "
            f"--if and --switch")
    backwards, _ = _placed(nodes[::-1], bodies, streams[::-1])
    if either := [name for name, _ in nodes if ran[name] != backwards[name]]:
        raise SimulationError(f"{source}: expected the streams to tell which conditional "
                              f"nodes ran, found them fitting nodes {either[0]!r} to "
                              f"{either[-1]!r} in more than one way: give --if and --switch")
    taken: dict[str, bool] = {}
    branch: dict[str, int] = {}
    for name, op in nodes:
        # A body without kernels leaves no stream: where it may have run, the node stays
        # undecided (the simulator then asks for it), but an IF/ELSE runs one of its two.
        empty = [i for i, s in enumerate(bodies[name]) if not s]
        body = ran[name]
        if body is None and op.type is ConditionalKind.IF_ELSE:
            if len(empty) != 1:
                if not empty:
                    raise SimulationError(f"{source}: expected one of IF/ELSE node {name!r}'s "
                                          f"bodies on a stream of its own, found neither where "
                                          f"its turn came")
                continue
            body = empty[0]
        elif body is None and empty:
            continue
        if op.type is ConditionalKind.SWITCH:
            branch[name] = len(op.bodies) if body is None else body  # none: no branch ran
        else:
            taken[name] = body == 0
    return Choices(taken=taken, branch=branch), len(streams)


def choices_in_trace(graph: KernelGraph, launches: Sequence[LaunchRecord],
                     source: str) -> Choices:
    """The choices of :func:`choices_in_launch`, read from every graph launch of a trace that
    enters one of ``graph``'s bodies, and the same in each.

    Raises
    ------
    SimulationError
        No such launch, or two that chose differently.
    """
    # A launch that showed a body's stream is one of this graph's.
    found = [c for c, shown in (_read(graph, launch.ops, source)
                                for launch in launches if launch.is_graph) if shown]
    if not found:
        raise SimulationError(f"{source}: expected a graph launch that ran a body of one of "
                              f"the graph's conditional nodes, found none: give --if and "
                              f"--switch")
    first = {**found[0].taken, **found[0].branch}
    for i, other in enumerate(found[1:], 2):
        if other != found[0]:
            theirs = {**other.taken, **other.branch}
            differ = sorted(name for name in first if first[name] != theirs.get(name))
            raise SimulationError(f"{source}: expected every launch to choose as the first, "
                                  f"found launch {i} choosing otherwise at {differ[:3]}: give "
                                  f"--if and --switch")
    return found[0]
