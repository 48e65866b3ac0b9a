"""Alias prediction's IR half: a graph re-pointed at inputs that lie elsewhere, instead of
copying them into its placeholders.

A captured graph reads its inputs where the capture found them. When a later call's inputs lie
at other addresses, :func:`repoint` gives the graph that reads them there: every kernel pointer
into a moved buffer shifted by the buffer's move, the buffer table's addresses moved likewise
(copies and memsets take their addresses from it), and the nodes that changed, which are all an
executable must update (``grape.cuda.build.Graph.prepare``). Where the inputs lie where they
did (PyTorch's caching allocator tends to hand the same call site the same block: the paper's
insight), nothing moves and nothing is updated.

Examples
--------
>>> from grape.ir import Buffer, BufferRole, Kernel, KernelGraph, Param, Pointer, Span
>>> g = KernelGraph()
>>> _ = g.add_buffer(Buffer("x", 64, BufferRole.INPUT, address=0x1000))
>>> _ = g.add("k", Kernel("f", "k", (1, 1, 1), (32, 1, 1), args=(0x1010).to_bytes(8, "little"),
...                       params=(Param(0, 8),), pointers=(Pointer(0, Span("x", 16)),)))
>>> moved, changed = repoint(g, {"x": 0x2000})
>>> hex(int.from_bytes(changed["k"].args, "little")), hex(moved.buffers["x"].address)
('0x2010', '0x2000')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from grape.errors import GraphError
from grape.ir import Conditional, Kernel, KernelGraph, Memcpy, Memset, Op

__all__ = ["repoint"]


def _shifted(k: Kernel, moves: Mapping[str, int]) -> Kernel | None:
    touched = [p for p in k.pointers if p.target.buffer in moves]
    if not touched:
        return None
    args = bytearray(k.args)
    for p in touched:
        value = int.from_bytes(args[p.offset:p.offset + 8], "little")
        args[p.offset:p.offset + 8] = (value + moves[p.target.buffer]).to_bytes(8, "little")
    return dataclasses.replace(k, args=bytes(args))


def repoint(graph: KernelGraph, addresses: Mapping[str, int]
            ) -> tuple[KernelGraph, dict[str, Op]]:
    """``graph`` reading each buffer of ``addresses`` at its new address, and the nodes that
    changed (kernels with pointers into a moved buffer; copies and memsets that touch one).

    Raises
    ------
    GraphError
        A buffer that is not in the table, has no address to move from, or a conditional
        body that points into a moved buffer (updating nodes inside a body is not modelled).
    """
    moves = {}
    for name, address in addresses.items():
        buffer = graph.buffers.get(name)
        if buffer is None or buffer.address is None:
            raise GraphError(f"expected buffer {name!r} with a captured address to move, found "
                             f"{'none' if buffer is None else 'no address'}")
        if address != buffer.address:
            moves[name] = address - buffer.address
    moved = KernelGraph()
    for b in graph.buffers.values():
        moved.add_buffer(dataclasses.replace(b, address=b.address + moves[b.id])
                         if b.id in moves else b)
    changed: dict[str, Op] = {}
    for node, op in graph.ops():
        new = op
        if isinstance(op, Kernel):
            new = _shifted(op, moves) or op
            if new is not op:
                changed[node] = new
        elif isinstance(op, Memcpy | Memset) and any(s.buffer in moves for s in op.spans()):
            changed[node] = op
        elif isinstance(op, Conditional) and moves and any(
                p.target.buffer in moves for body in op.bodies for _, k in body.kernels()
                for p in k.pointers):
            raise GraphError(f"expected no conditional body to read a moved input, found node "
                             f"{node!r}")
        moved.dag.add_node(node, op=new)
    moved.dag.add_edges_from(graph.dag.edges(data=True))
    return moved, changed
