"""A bounded WHILE loop around a captured body, as IR (no GPU work).

The loop's condition lives on the device: a setter kernel before the conditional node reads the
body's "go on" flag into the node's handle, and one at the end of each iteration counts the
bound down and sets the handle again (``grape.cuda.conditional`` compiles both). The kernels
are given, already carrying a reference to the handle named ``handle``.
"""

from __future__ import annotations

import networkx as nx

from grape.errors import GrapeError
from grape.ir import Buffer, Conditional, ConditionalKind, Kernel, KernelGraph, Memset, Span

__all__ = ["check_bound", "while_loop_graph"]


def check_bound(max_iterations: object) -> int:
    """``max_iterations`` if it is a loop bound (an int of at least 1), else a GrapeError."""
    if not isinstance(max_iterations, int) or isinstance(max_iterations, bool) \
            or max_iterations < 1:
        raise GrapeError(f"expected a loop bound of at least 1 iteration (a loop without one "
                         f"is refused), found {max_iterations!r}")
    return max_iterations


def while_loop_graph(body: KernelGraph, remaining: Buffer, max_iterations: int, *,
                     handle: str, start: Kernel, step: Kernel,
                     extra: tuple[Buffer, ...] = (),
                     prologue: KernelGraph | None = None) -> KernelGraph:
    """``[prologue ->] memset(remaining = max_iterations) -> start -> WHILE handle { body;
    step }``.

    ``start`` sets the handle before the first iteration; ``step`` runs after every sink of
    ``body`` and sets it for the next. ``extra`` buffers (the flag the setters read) join the
    table beside the body's. A ``prologue`` (work that sets the loop's state up, such as a
    prompt's prefill) runs first, in the same graph; its nodes are named ``prologue:<node>``.
    """
    check_bound(max_iterations)
    for k in (start, step):
        if not any(ref.handle == handle for ref in k.handles):
            raise GrapeError(f"expected setter kernel {k.name!r} to take handle {handle!r}, "
                             f"found handles {[ref.handle for ref in k.handles]}")
    inner = KernelGraph()
    for node in nx.topological_sort(body.dag):
        inner.add(node, body.op(node), after=body.dag.predecessors(node),
                  kinds=body.kinds_into(node))
    sinks = [n for n in body.dag if body.dag.out_degree(n) == 0]
    inner.add("grape:step", step, after=sinks)
    outer = KernelGraph()
    tables = [body.buffers.values(), (remaining, *extra)]
    if prologue is not None:
        tables.append(prologue.buffers.values())
    for table in tables:
        for buffer in table:
            held = outer.buffers.get(buffer.id)
            if held is None:
                outer.add_buffer(buffer)
            elif held != buffer:
                raise GrapeError(f"expected buffer {buffer.id!r} to be one memory in the loop "
                                 f"and its prologue, found {held} and {buffer}")
    first: list[str] = []
    if prologue is not None:
        for node in nx.topological_sort(prologue.dag):
            outer.add(f"prologue:{node}", prologue.op(node),
                      after=[f"prologue:{d}" for d in prologue.dag.predecessors(node)],
                      kinds={f"prologue:{d}": k for d, k in prologue.kinds_into(node).items()})
        first = [f"prologue:{n}" for n in prologue.dag if prologue.dag.out_degree(n) == 0]
    outer.add("grape:remaining", Memset(Span(remaining.id), max_iterations, 4, 1), after=first)
    outer.add("grape:start", start, after=["grape:remaining"])
    outer.add("grape:while", Conditional(ConditionalKind.WHILE, handle, (inner,), default=0),
              after=["grape:start"])
    outer.validate()
    return outer
