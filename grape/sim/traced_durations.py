"""Each node's duration in a traced launch, read by position rather than by name.

:class:`~grape.sim.graph.Durations` prices a kernel node by its function and launch
configuration as the trace names them. On the H200 that name is not always the node's: in a
process that had run other graphs with conditional nodes, CUPTI reported the kernels of a WHILE
body (correlation 0) under the names, grids and streams of other graphs' nodes: a Llama
sampling loop's trace held GPT-2's biased GEMMs, and a GPT-2 five-beam loop's eleven of every
twelve attention kernels at one beam's grid, while their durations and start times were those
of the kernels that ran (``benchmarks/README.md``, 2026-12-05, fifth session). Priced by name,
the beam loop came out 18% short of the trace's own kernel time.

Where the launch's GPU work is one chain (every operation depends on the one before, as the
captured step of a device loop is), the order the GPU ran it is the graph's own, so the n-th
operation the trace shows in time is the n-th node execution: the outer graph in order, an IF
body where taken, a WHILE body once per iteration. :func:`node_durations` pairs them, and only
where the counts agree exactly (CUPTI dropping records, as it does in long loops, leaves them
apart: refused, with both counts). What the names say is kept as a check
(:attr:`NodeDurations.renamed`), not used.

A graph whose work forks (the concurrent step) has no single order to pair by: refused; its
durations come from a trace of the chain it was made from, by node name (the concurrency pass
keeps names).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import networkx as nx

from grape.errors import SimulationError
from grape.ir import Conditional, ConditionalKind, Kernel, KernelGraph, Memcpy, Memset
from grape.records import GpuRecord
from grape.sim.graph import Choices, kernel_key

__all__ = ["NodeDurations", "chain_order", "node_durations"]

_WORK = (Kernel, Memcpy, Memset)


@dataclass(frozen=True)
class NodeDurations:
    """Mean duration (us) of each node over its executions, by the name
    :class:`~grape.sim.graph.Choices` uses (a body's as ``<node>/<body>/<inner node>``)."""

    table: dict[str, float]
    executions: int  # operations paired
    renamed: int  # kernel executions the trace named as another kernel (CUPTI's records)


def chain_order(graph: KernelGraph, source: str) -> list[str]:
    """``graph``'s GPU work and conditional nodes in the one order they can run, or an error
    where two of them may run side by side."""
    order = [n for n in nx.topological_sort(graph.dag)
             if isinstance(graph.op(n), _WORK + (Conditional,))]
    longest = nx.dag_longest_path(graph.dag)
    on_path = sum(isinstance(graph.op(n), _WORK + (Conditional,)) for n in longest)
    if on_path != len(order):
        raise SimulationError(f"{source}: expected a graph whose work runs in one order to "
                              f"pair with a trace by position, found {len(order) - on_path} of "
                              f"its {len(order)} operations off its longest path (it forks)")
    return order


def _executions(graph: KernelGraph, choices: Choices, prefix: str, source: str,
                orders: dict[int, list[str]]) -> Iterator[tuple[str, Kernel | Memcpy | Memset]]:
    # (``orders``: each graph's chain order by identity, worked out once for all of a loop's
    # iterations, not once an iteration)
    if id(graph) not in orders:
        orders[id(graph)] = chain_order(graph, source)
    for node in orders[id(graph)]:
        op, name = graph.op(node), f"{prefix}{node}"
        if not isinstance(op, Conditional):
            yield name, op
            continue
        if op.type is ConditionalKind.WHILE:
            if name not in choices.iterations:
                raise SimulationError(f"{source}: expected an iteration count for WHILE node "
                                      f"{name!r}, found none")
            for _ in range(choices.iterations[name]):
                yield from _executions(op.bodies[0], choices, f"{name}/0/", source, orders)
            continue
        if op.type is ConditionalKind.SWITCH:
            if name not in choices.branch:
                raise SimulationError(f"{source}: expected the branch SWITCH node {name!r} "
                                      f"takes, found none")
            body = choices.branch[name]
        else:
            if name not in choices.taken:
                raise SimulationError(f"{source}: expected whether IF node {name!r} is taken, "
                                      f"found none")
            body = 0 if choices.taken[name] else 1
        if 0 <= body < len(op.bodies):
            yield from _executions(op.bodies[body], choices, f"{name}/{body}/", source, orders)


def node_durations(graph: KernelGraph, ops: Sequence[GpuRecord], choices: Choices,
                   source: str) -> NodeDurations:
    """Each node's mean duration in one traced launch of ``graph`` (``ops``: the launch's GPU
    work, every stream's), paired by position as the module says.

    Raises
    ------
    SimulationError
        A graph whose work forks, a conditional without its choice, or a trace whose
        operations do not number the node executions the choices make.
    """
    expected = list(_executions(graph, choices, "", source, {}))
    ran = sorted(ops, key=lambda op: op.ts)
    if len(ran) != len(expected):
        raise SimulationError(f"{source}: expected {len(expected)} GPU operations in the "
                              f"launch (the graph's node executions at the choices given), "
                              f"found {len(ran)}: the trace dropped or added some, so "
                              f"position says nothing")
    seen: dict[str, list[float]] = defaultdict(list)
    renamed = 0
    for (name, node), record in zip(expected, ran, strict=True):
        seen[name].append(record.dur)
        if isinstance(node, Kernel) and record.kind == "kernel":
            renamed += kernel_key(node) != (record.name, record.grid, record.block)
    return NodeDurations({name: statistics.fmean(d) for name, d in seen.items()},
                         len(expected), renamed)
