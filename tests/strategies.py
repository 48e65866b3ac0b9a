"""Hypothesis strategies for valid kernel graphs of every node kind."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from grape.ir import (
    EDGE_KINDS,
    MAX_BLOCK,
    MAX_THREADS_PER_BLOCK,
    Buffer,
    BufferRole,
    Conditional,
    ConditionalKind,
    Empty,
    EventRecord,
    EventWait,
    HandleRef,
    Kernel,
    KernelGraph,
    Memcpy,
    Memory,
    Memset,
    Param,
    Pointer,
    Span,
)

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=8)

buffers = st.builds(Buffer, id=names, size=st.integers(64, 1 << 20),
                    role=st.sampled_from(BufferRole), memory=st.sampled_from(Memory),
                    address=st.one_of(st.none(), st.integers(1 << 16, 1 << 48)))


@st.composite
def blocks(draw) -> tuple[int, int, int]:
    x = draw(st.integers(1, MAX_BLOCK[0]))
    y = draw(st.integers(1, MAX_THREADS_PER_BLOCK // x))
    z = draw(st.integers(1, min(MAX_BLOCK[2], MAX_THREADS_PER_BLOCK // (x * y))))
    return (x, y, z)


grids = st.tuples(st.integers(1, 2**31 - 1), st.integers(1, 65535), st.integers(1, 65535))
attributes = st.lists(st.tuples(st.sampled_from(["priority", "cluster_dim", "cooperative"]),
                                st.one_of(st.integers(0, 8),
                                          st.tuples(*[st.integers(1, 4)] * 3))),
                      unique_by=lambda a: a[0], max_size=2).map(lambda a: tuple(sorted(a)))


def spans(table: list[Buffer], extent: int = 1) -> st.SearchStrategy[Span]:
    return st.sampled_from(table).flatmap(
        lambda b: st.builds(Span, buffer=st.just(b.id), offset=st.integers(0, b.size - extent)))


@st.composite
def kernels(draw, table: list[Buffer]) -> Kernel:
    sizes = draw(st.lists(st.sampled_from([1, 2, 4, 8, 8, 16]), max_size=6))
    params, offset = [], 0
    for size in sizes:
        offset = -(-offset // min(size, 8)) * min(size, 8)  # natural alignment, as CUDA packs
        params.append(Param(offset, size))
        offset += size
    args = draw(st.binary(min_size=offset, max_size=offset))
    # Pointers sit at 8-byte aligned places, alone or inside structures.
    slots = list(range(0, offset - 7, 8)) if table else []
    chosen = draw(st.lists(st.sampled_from(slots), unique=True)) if slots else []
    pointers = tuple(Pointer(at, draw(spans(table))) for at in sorted(chosen))
    return Kernel(function=draw(names), name=draw(names), grid=draw(grids), block=draw(blocks()),
                  shared_mem=draw(st.integers(0, 232448)), attributes=draw(attributes),
                  args=args, params=tuple(params), pointers=pointers)


@st.composite
def memcpys(draw, table: list[Buffer]) -> Memcpy:
    size = draw(st.integers(1, 64))
    return Memcpy(src=draw(spans(table, size)), dst=draw(spans(table, size)), size=size)


@st.composite
def memsets(draw, table: list[Buffer]) -> Memset:
    element = draw(st.sampled_from([1, 2, 4]))
    width = draw(st.integers(1, 16))
    return Memset(dst=draw(spans(table, width * element)), value=draw(st.integers(0, 255)),
                  element_size=element, width=width)


@st.composite
def conditionals(draw, table: list[Buffer], depth: int) -> Conditional:
    kind = draw(st.sampled_from(ConditionalKind))
    count = {ConditionalKind.IF_ELSE: 2, ConditionalKind.SWITCH: draw(st.integers(1, 3))}.get(
        kind, 1)
    bodies = tuple(draw(graphs(table=table, depth=depth + 1, max_nodes=3)) for _ in range(count))
    return Conditional(type=kind, handle=draw(names), bodies=bodies,
                       default=draw(st.one_of(st.none(), st.integers(0, 3))))


def ops(table: list[Buffer], depth: int) -> st.SearchStrategy:
    choices = [kernels(table), st.just(Empty()), st.builds(EventRecord, names),
               st.builds(EventWait, names)]
    if table:
        choices += [memcpys(table), memsets(table)]
    if depth < 1:
        choices.append(conditionals(table, depth))
    return st.one_of(choices)


@st.composite
def graphs(draw, table: list[Buffer] | None = None, depth: int = 0,
           max_nodes: int = 10) -> KernelGraph:
    """A valid graph; bodies of conditionals share the enclosing graph's buffer table."""
    g = KernelGraph()
    if table is None:
        table = draw(st.lists(buffers, unique_by=lambda b: b.id, max_size=4))
        for b in table:
            g.add_buffer(b)
    ids = draw(st.lists(names, unique=True, max_size=max_nodes))
    for i, node in enumerate(ids):
        deps = draw(st.lists(st.sampled_from(ids[:i]), unique=True, max_size=3)) if i else []
        op = draw(ops(table, depth))
        # a kernel behind a kernel may depend on it programmatically (PDL), as captured
        kinds = {d: draw(st.sampled_from((None, *EDGE_KINDS))) for d in deps
                 if isinstance(op, Kernel) and isinstance(g.op(d), Kernel)}
        g.add(node, op, after=deps, kinds={d: k for d, k in kinds.items() if k})
    if depth == 0:
        _set_conditions(draw, g)
    return g


def _set_conditions(draw, g: KernelGraph) -> None:
    """Let some kernels take a conditional's handle as an argument, as condition setters do."""
    handles = sorted({op.handle for _, op in g.ops() if isinstance(op, Conditional)})
    if not handles:
        return
    for node, k in list(g.kernels()):
        if len(k.args) >= 8 and draw(st.booleans()):
            ref = HandleRef(draw(st.integers(0, len(k.args) - 8)), draw(st.sampled_from(handles)))
            g.dag.nodes[node]["op"] = dataclasses.replace(k, handles=(ref,))
