"""A graph saved in one process, moved to another: the warm start of a saved family.

A captured graph names this process's kernel functions (handles) and memory (addresses). To
reuse a saved family in a new process without capturing every shape, grape captures each
executable's template shape once here and compares the two graphs of that shape:
:func:`relocation` pairs their nodes, each saved kernel function with the one here of the same
mangled name, and each saved buffer with the buffer here that the same pointers point into, at
one address shift per buffer. It then checks itself: the saved template, relocated, must equal
the fresh capture byte for byte (pointers and functions aside, nothing may differ), or the
relocation is refused with the first node that differs. :func:`relocate` moves a member shape's
changed operations the same way; one that uses a function or a buffer the template never did
cannot be moved (that shape is captured instead).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from grape.errors import GraphError, UnsupportedError
from grape.ir import Conditional, Kernel, KernelGraph, Memcpy, Memset, Op, Pointer, Span
from grape.passes.families import match

__all__ = ["Moved", "Relocation", "relocate", "relocate_all", "relocation"]


@dataclass(frozen=True)
class Moved:
    """Where a saved buffer's memory is here: ``buffer``, with every pointer into it moved by
    ``shift`` bytes and every offset within it by ``offset`` (the capture here laid it out
    from another start, or, rarely, at another place within the block)."""

    buffer: str
    shift: int
    offset: int
    size: int  # the buffer's size here: nothing moved may point past it


@dataclass(frozen=True)
class Relocation:
    nodes: dict[str, str]  # saved node -> the node here
    functions: dict[str, str]  # saved function identity -> the one here
    buffers: dict[str, Moved]  # saved buffer -> where its memory is here


def _pair(mapping: dict, key, value, what: str, node: str) -> None:
    if mapping.setdefault(key, value) != value:
        raise UnsupportedError(f"expected one {what} here for saved {key!r}, found "
                               f"{mapping[key]!r} and {value!r} (node {node!r})")


def _address(graph: KernelGraph, buffer: str) -> int:
    address = graph.buffers[buffer].address
    if address is None:
        raise UnsupportedError(f"expected buffer {buffer!r} to have an address, found none")
    return address


def _spans(op: Op) -> list[Span]:
    if isinstance(op, Kernel):
        return [p.target for p in op.pointers]
    return list(op.spans())


def relocation(saved: KernelGraph, fresh: KernelGraph) -> Relocation:
    """How ``saved`` (a graph from another process) maps onto ``fresh`` (the same shape
    captured here).

    Raises
    ------
    UnsupportedError
        The two differ in structure, in a kernel's mangled name, in where a kernel's pointers
        lie in its arguments, or in anything but functions and addresses; or a saved buffer
        maps to two places here. The message names the node.
    """
    try:
        nodes = match(saved, fresh)
    except GraphError as e:
        raise UnsupportedError(f"expected the saved template's structure here, found: {e}") \
            from None
    functions: dict[str, str] = {}
    buffers: dict[str, Moved] = {}
    for old_node, new_node in nodes.items():
        old, new = saved.op(old_node), fresh.op(new_node)
        if isinstance(old, Kernel) and isinstance(new, Kernel):
            if old.name != new.name:
                raise UnsupportedError(f"expected kernel {old.name!r} at node {old_node!r} "
                                       f"here, found {new.name!r}")
            _pair(functions, old.function, new.function, "kernel function", old_node)
            if [p.offset for p in old.pointers] != [p.offset for p in new.pointers]:
                raise UnsupportedError(f"expected node {old_node!r}'s pointers at the same "
                                       f"argument offsets here, found others")
        elif not (isinstance(old, Memcpy | Memset) and type(old) is type(new)):
            continue
        for a, b in zip(_spans(old), _spans(new), strict=True):
            shift = (_address(fresh, b.buffer) + b.offset) - (_address(saved, a.buffer)
                                                                + a.offset)
            _pair(buffers, a.buffer, Moved(b.buffer, shift, b.offset - a.offset,
                                           fresh.buffers[b.buffer].size), "buffer", old_node)
    found = Relocation(nodes, functions, buffers)
    for old_node, new_node in nodes.items():
        if isinstance(saved.op(old_node), Conditional):
            raise UnsupportedError(f"expected kernels, copies and memsets, found conditional "
                                   f"node {old_node!r} (its bodies are not moved between "
                                   f"processes yet)")
        if relocate(saved.op(old_node), found) != fresh.op(new_node):
            raise UnsupportedError(f"expected the saved template, moved here, to equal the "
                                   f"capture here, found node {old_node!r} different beyond "
                                   f"its functions and addresses")
    return found


def _moved(span: Span, r: Relocation) -> tuple[Span, int]:
    m = r.buffers.get(span.buffer)
    if m is None:
        raise UnsupportedError(f"expected memory the template uses, found buffer "
                               f"{span.buffer!r}, which it never touches")
    offset = span.offset + m.offset
    if not 0 <= offset < m.size:
        raise UnsupportedError(f"expected memory within the {m.size} bytes of buffer "
                               f"{m.buffer!r} here, found offset {offset}")
    return Span(m.buffer, offset), m.shift


def relocate(op: Op, r: Relocation) -> Op:
    """``op`` from the saved process, as it must read here.

    Raises
    ------
    UnsupportedError
        It runs a function the template here never ran, or touches memory it never touched.
    """
    if isinstance(op, Kernel):
        if op.function not in r.functions:
            raise UnsupportedError(f"expected kernel functions the template runs, found "
                                   f"{op.name!r}, which it never runs here")
        args = bytearray(op.args)
        pointers = []
        for p in op.pointers:
            span, shift = _moved(p.target, r)
            value = int.from_bytes(args[p.offset:p.offset + 8], "little") + shift
            args[p.offset:p.offset + 8] = value.to_bytes(8, "little")
            pointers.append(Pointer(p.offset, span))
        return dataclasses.replace(op, function=r.functions[op.function], args=bytes(args),
                                   pointers=tuple(pointers))
    if isinstance(op, Memcpy):
        return dataclasses.replace(op, src=_moved(op.src, r)[0], dst=_moved(op.dst, r)[0])
    if isinstance(op, Memset):
        return dataclasses.replace(op, dst=_moved(op.dst, r)[0])
    if isinstance(op, Conditional):
        raise UnsupportedError("expected kernels, copies and memsets to move, found a "
                               "conditional node (its bodies are not moved between processes "
                               "yet)")
    return op


def relocate_all(changes: Mapping[str, Op], r: Relocation) -> dict[str, Op]:
    """A member shape's changed operations (by saved node), moved here (by the node here)."""
    return {r.nodes[node]: relocate(op, r) for node, op in changes.items()}
