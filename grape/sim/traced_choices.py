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

The streams can be another graph's: in a process that had run other graphs with conditional
nodes, CUPTI gave a loop's body kernels the names, grids and streams of those graphs' nodes
(``grape.sim.traced_durations``). The count does not depend on them
(:func:`choices_by_count`): a chain's own operations carry the launch's correlation and its
bodies' carry none, so the bodies' operations between two of the chain's own add up to what its
conditional nodes between them ran, read where one combination of choices makes that count;
WHILE counts too, where the trace holds every operation of the loop. A launch is read both
ways; where both read, they must agree.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Sequence

from grape.errors import SimulationError
from grape.ir import Conditional, ConditionalKind, Kernel, KernelGraph, Memcpy, Memset
from grape.records import GpuRecord, LaunchRecord
from grape.sim.graph import Choices, KernelKey, kernel_key

__all__ = ["choices_by_count", "choices_in_launch", "choices_in_trace"]

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


def _work_count(body: KernelGraph) -> int | None:
    """GPU operations one run of ``body`` makes, or None where a conditional inside it makes
    that depend on what it chooses."""
    ops = [op for _, op in body.ops()]
    if any(isinstance(op, Conditional) for op in ops):
        return None
    return sum(isinstance(op, Kernel | Memcpy | Memset) for op in ops)


def _options(op: Conditional, most: int) -> list[tuple[int, int | None]] | None:
    """What a conditional node may have run, as (operations, body index or None: none ran;
    for a WHILE, the iteration count), up to ``most`` operations; None where unknown."""
    sizes = [_work_count(body) for body in op.bodies]
    if any(size is None for size in sizes):
        return None
    if op.type is ConditionalKind.WHILE:
        size = sizes[0]
        return [(0, 0)] if size == 0 else [(size * n, n) for n in range(most // size + 1)]
    ran = [(size, i) for i, size in enumerate(sizes)]
    return ran if op.type is ConditionalKind.IF_ELSE else [(0, None), *ran]


def _split(nodes: list[tuple[str, Conditional]], count: int,
           source: str) -> dict[str, int | None]:
    """The one way ``nodes``' bodies make ``count`` operations between two of the graph's
    own: each node's choice (see _options); nodes whose choices all make the same count stay
    out (nothing tells them apart)."""
    options = {}
    for name, op in nodes:
        found = _options(op, count)
        if found is None:
            raise SimulationError(f"{source}: expected bodies of a fixed size to count, found "
                                  f"a conditional inside node {name!r}'s")
        options[name] = found
    # ways[n]: how many ways (at most 2) the nodes so far make n operations, and one of them.
    ways: dict[int, tuple[int, dict[str, int | None]]] = {0: (1, {})}
    for name, _ in nodes:
        grown: dict[int, tuple[int, dict[str, int | None]]] = {}
        for made, (n, chosen) in ways.items():
            for size, choice in options[name]:
                if made + size > count:
                    continue
                before = grown.get(made + size, (0, {}))
                grown[made + size] = (min(before[0] + n, 2), before[1] or {**chosen,
                                                                            name: choice})
        ways = grown
    n, chosen = ways.get(count, (0, {}))
    if n != 1:
        told = [name for name, _ in nodes if len({s for s, _ in options[name]}) > 1]
        raise SimulationError(f"{source}: expected the {count} operations between two of the "
                              f"graph's own to come from its conditional nodes "
                              f"{told[0] if told else nodes[0][0]!r} and on in one way, found "
                              f"{'none' if n == 0 else 'more than one'}")
    return {name: c for name, c in chosen.items() if len({s for s, _ in options[name]}) > 1}


def choices_by_count(graph: KernelGraph, ops: Sequence[GpuRecord], source: str,
                     order: Sequence[str] | None = None) -> Choices:
    """The choices of ``graph``'s outer conditional nodes in one traced launch, read without
    the names and streams CUPTI gave the bodies' kernels: a chain's own operations carry the
    launch's correlation and its bodies' none (0), as on the H100 and the H200, so the bodies'
    operations between two of the graph's own are the conditional nodes' between them, each
    count made by their bodies in one way only (an IF's two-kernel body and its pair's
    six-kernel one: 0, 2, 6 or 8). WHILE counts are read the same way (its body's operations
    over their number). For a process whose earlier graphs left CUPTI naming this launch's
    body kernels after theirs (``grape.sim.traced_durations``), where the streams mislead.
    ``order``: the graph's ``chain_order``, where the caller worked it out once for many
    launches.

    Raises
    ------
    SimulationError
        A graph whose work forks, a launch whose own operations are not the graph's, a count
        its bodies make in no way or in more than one.
    """
    from grape.sim.traced_durations import chain_order

    ran = sorted(ops, key=lambda op: op.ts)
    own = {op.correlation for op in ran if op.correlation}
    if len(own) != 1:
        raise SimulationError(f"{source}: expected the launch's own operations under one "
                              f"correlation, found {len(own)}")
    order = chain_order(graph, source) if order is None else order
    work = [n for n in order if not isinstance(graph.op(n), Conditional)]
    outer = [i for i, op in enumerate(ran) if op.correlation]
    if len(outer) != len(work):
        raise SimulationError(f"{source}: expected {len(work)} operations of the graph's own in "
                              f"the launch, found {len(outer)}")
    taken: dict[str, bool] = {}
    branch: dict[str, int] = {}
    iterations: dict[str, int] = {}
    pending: list[tuple[str, Conditional]] = []
    at = -1  # the last own operation met
    mine = iter(outer)
    for name in [*order, None]:  # None: the end of the launch
        op = graph.op(name) if name is not None else None
        if isinstance(op, Conditional):
            if op.type in _CHOOSING or op.type is ConditionalKind.WHILE:
                pending.append((name, op))
            continue
        nxt = next(mine, len(ran))
        if pending:
            for node, choice in _split(pending, nxt - at - 1, source).items():
                kind = graph.op(node).type
                if kind is ConditionalKind.WHILE:
                    iterations[node] = choice
                elif kind is ConditionalKind.SWITCH:
                    branch[node] = len(graph.op(node).bodies) if choice is None else choice
                else:
                    taken[node] = choice == 0
            pending = []
        elif nxt - at - 1:
            raise SimulationError(f"{source}: expected the launch's operations between two of "
                                  f"the graph's own only where conditional nodes lie, found "
                                  f"{nxt - at - 1} before node {name!r}")
        at = nxt
    return Choices(iterations=iterations, taken=taken, branch=branch)


def _launch_choices(graph: KernelGraph, ops: Sequence[GpuRecord], source: str,
                    reasons: list[str], order: Sequence[str] | None) -> Choices | None:
    """One launch's choices, by its bodies' streams (:func:`choices_in_launch`) and by its
    operations' count (:func:`choices_by_count`): where both read, they must agree, and the
    count's WHILE counts join; where one reads, its; None where the launch shows no body of
    the graph's (another graph's launch), why the count did not read added to ``reasons``."""
    try:
        streams, shown = _read(graph, ops, source)
        streams_error = None
    except SimulationError as e:
        streams, shown, streams_error = None, 1, e
    try:
        counted = choices_by_count(graph, ops, source, order)
    except SimulationError as e:
        why = str(e).removeprefix(source + ": ")
        if streams_error is not None:
            raise SimulationError(f"{streams_error}; counted: {why}") from None
        reasons.append(why)
        return streams if shown else None
    told = {**counted.taken, **counted.branch}
    if streams is not None and shown and any(
            name in told and told[name] != choice
            for name, choice in {**streams.taken, **streams.branch}.items()):
        raise SimulationError(f"{source}: expected the bodies' streams and the launch's "
                              f"operation count to tell the same choices, found them apart: "
                              f"give --if and --switch")
    return counted if counted.taken or counted.branch or counted.iterations else None


def choices_in_trace(graph: KernelGraph, launches: Sequence[LaunchRecord],
                     source: str) -> Choices:
    """The choices of ``graph``'s outer conditional nodes read from every graph launch of a
    trace that enters one of its bodies, by the bodies' streams (:func:`choices_in_launch`) or
    the launch's operation count (:func:`choices_by_count`), and the same in each launch.

    Raises
    ------
    SimulationError
        No such launch, or two that chose differently.
    """
    from grape.sim.traced_durations import chain_order

    try:  # once for every launch (a topological sort and a longest path)
        order = chain_order(graph, source)
    except SimulationError:
        order = None  # a graph that forks: each launch's count says so
    reasons: list[str] = []
    found = [c for c in (_launch_choices(graph, launch.ops, source, reasons, order)
                         for launch in launches if launch.is_graph) if c is not None]
    if not found:
        raise SimulationError(f"{source}: expected a graph launch that ran a body of one of "
                              f"the graph's conditional nodes, found none"
                              + (f" (counted: {reasons[-1]})" if reasons else "")
                              + ": give --if and --switch")
    first = {**found[0].taken, **found[0].branch}
    for i, other in enumerate(found[1:], 2):
        if (other.taken, other.branch) != (found[0].taken, found[0].branch):
            theirs = {**other.taken, **other.branch}
            differ = sorted(name for name in first if first[name] != theirs.get(name))
            raise SimulationError(f"{source}: expected every launch to choose as the first, "
                                  f"found launch {i} choosing otherwise at {differ[:3]}: give "
                                  f"--if and --switch")
    # A loop may run other counts in other launches (a generation that stopped early): the
    # counts are kept only where every launch ran the same.
    if any(other.iterations != found[0].iterations for other in found[1:]):
        return dataclasses.replace(found[0], iterations={})
    return found[0]
