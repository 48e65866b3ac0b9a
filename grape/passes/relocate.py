"""A graph saved in one process, moved to another: the warm start of a saved family.

A captured graph names this process's kernel functions (handles) and memory (addresses). To
reuse a saved family in a new process without capturing every shape, grape captures each
executable's template shape once here and compares the two graphs of that shape:
:func:`relocation` pairs their nodes, each saved kernel function with the one here of the same
mangled name, and each saved buffer with the buffer here that the same pointers point into, at
one address shift per buffer. It then checks itself: the saved template, relocated, must equal
the fresh capture (launch configuration, copies and memsets byte for byte), or the relocation
is refused with the first node that differs. :func:`relocate` moves a member shape's changed
operations the same way; one that uses a function or a buffer the template never did cannot be
moved (that shape is captured instead).

Kernel arguments are the exception to byte for byte, measured on the H200: PyTorch passes
structures with slots it never fills (a TensorIterator's offset calculator holds 25 dimensions
and fills as many as the tensor has), so a kernel's argument bytes carry whatever the host's
stack held, which differs between processes and sometimes looks like a device address (GPT-2
decode: 35 of 292 kernels of one template differed so). Such words are *loose*: a word that is
a pointer in one capture only, or a pointer in neither whose bytes differ. The template takes
the capture here for them (this process's truth). A member shape that left a loose word as its
saved template had it takes this process's bytes there too. One that wrote its own value there
(a TensorIterator fills more of its slots where a shape coalesces into more dimensions) keeps
it: the slot then holds a size or a stride, the same in every process, or a device pointer,
which the member's pointers name and which moves like any other. (Refusing them refused GPT-2
decode's members on the H200: a warm start captured every member again, for writing word 616
of the first kernel's arguments.) What cannot be told apart is a process-dependent value that
is not a device pointer (a host address); PyTorch's kernels were not found passing one.

Scratch memory is the exception to pairing by pointers. The blocks a capture's temporaries take
in the graph's private pool are laid out by the allocator's best fit, which the two processes'
histories steer apart: on the H200 a GPT-2 family's saved 20 MB pool segment held blocks at
two relative places here, and its template was refused. Nothing but the graphs reads that
memory, so it need not be where the capture here put it: the caller gives each saved scratch
buffer a buffer of its own size here (``scratch``), the saved layout moves there whole, at one
shift, and the self-check compares everything but the scratch pointers' values, which must
still point into the capture's scratch here (``scratch_here``) where the saved ones do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass

import numpy as np

from grape.errors import GraphError, UnsupportedError
from grape.ir import Buffer, Conditional, Kernel, KernelGraph, Memcpy, Memset, Op, Pointer, Span
from grape.passes.families import match
from grape.passes.variants import NodeVersions, Variants, alternate

__all__ = ["Loose", "Moved", "Relocation", "learn_functions", "learn_functions_by_name",
           "relocate", "relocate_all", "relocate_variants", "relocation"]


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
class Loose:
    """A template kernel's argument words that differ between the processes unexplained
    (module docstring): their offsets, the saved template's bytes and the capture's here."""

    offsets: tuple[int, ...]
    saved: bytes
    here: Kernel


@dataclass(frozen=True)
class Relocation:
    nodes: dict[str, str]  # saved node -> the node here
    functions: dict[str, str]  # saved function identity -> the one here
    buffers: dict[str, Moved]  # saved buffer -> where its memory is here
    loose: dict[str, Loose] = dataclasses.field(default_factory=dict)  # by saved node


def _pair(mapping: dict, key, value, what: str, node: str) -> None:
    if mapping.setdefault(key, value) != value:
        raise UnsupportedError(f"expected one {what} here for saved {key!r}, found "
                               f"{mapping[key]!r} and {value!r} (node {node!r})")


def _address(graph: KernelGraph, buffer: str) -> int:
    address = graph.buffers[buffer].address
    if address is None:
        raise UnsupportedError(f"expected buffer {buffer!r} to have an address, found none")
    return address


def _word(args: bytes, offset: int) -> bytes:
    return args[offset:offset + 8]


def _loose(old: Kernel, new: Kernel, shared: set[int]) -> tuple[int, ...]:
    """The 8-byte words of two captures' arguments of one kernel that differ unexplained: a
    pointer in one capture only, or a pointer in neither whose bytes differ."""
    one_side = {p.offset for p in old.pointers} ^ {p.offset for p in new.pointers}
    differ = {o for o in range(0, len(old.args), 8) if o not in shared
              and _word(old.args, o) != _word(new.args, o)}
    return tuple(sorted(one_side | differ))


def relocation(saved: KernelGraph, fresh: KernelGraph,
               scratch: Mapping[str, Buffer] | None = None,
               scratch_here: Collection[str] = ()) -> Relocation:
    """How ``saved`` (a graph from another process) maps onto ``fresh`` (the same shape
    captured here). ``scratch``: saved scratch buffers (module docstring), each to the buffer
    here that takes it whole; ``scratch_here``: ``fresh``'s scratch buffers.

    Raises
    ------
    UnsupportedError
        The two differ in structure, in a kernel's mangled name, in where a kernel's pointers
        lie in its arguments, or in anything but functions and addresses; a saved buffer maps
        to two places here; or a saved scratch pointer is not one here. The message names the
        node.
    """
    # A family's scratch is named for all its executables: only this graph's own applies.
    scratch = {sid: here for sid, here in (scratch or {}).items() if sid in saved.buffers}
    for sid, here in scratch.items():
        if here.address is None or here.size < saved.buffers[sid].size:
            raise UnsupportedError(f"expected scratch here for saved buffer {sid!r} of its "
                                   f"size, found {here}")
    try:
        nodes = match(saved, fresh)
    except GraphError as e:
        raise UnsupportedError(f"expected the saved template's structure here, found: {e}") \
            from None
    functions: dict[str, str] = {}
    buffers: dict[str, Moved] = {
        sid: Moved(here.id, here.address - _address(saved, sid), 0, saved.buffers[sid].size)
        for sid, here in scratch.items()}
    loose: dict[str, Loose] = {}

    def pair_span(a: Span, b: Span, node: str) -> None:
        if a.buffer in scratch:  # moved whole, wherever the capture here put its blocks
            if b.buffer not in scratch_here:
                raise UnsupportedError(f"expected saved scratch {a.buffer!r} to be scratch "
                                       f"here too (node {node!r}), found {b.buffer!r}")
            return
        shift = (_address(fresh, b.buffer) + b.offset) - (_address(saved, a.buffer) + a.offset)
        _pair(buffers, a.buffer, Moved(b.buffer, shift, b.offset - a.offset,
                                       fresh.buffers[b.buffer].size), "buffer", node)

    for old_node, new_node in nodes.items():
        old, new = saved.op(old_node), fresh.op(new_node)
        if isinstance(old, Kernel) and isinstance(new, Kernel):
            if old.name != new.name:
                raise UnsupportedError(f"expected kernel {old.name!r} at node {old_node!r} "
                                       f"here, found {new.name!r}")
            if len(old.args) != len(new.args):
                raise UnsupportedError(f"expected node {old_node!r}'s {len(old.args)} bytes "
                                       f"of arguments here, found {len(new.args)}")
            _pair(functions, old.function, new.function, "kernel function", old_node)
            here = {p.offset: p.target for p in new.pointers}
            shared = {p.offset for p in old.pointers if p.offset in here}
            for p in old.pointers:
                if p.offset in shared:
                    pair_span(p.target, here[p.offset], old_node)
            if offsets := _loose(old, new, shared):
                loose[old_node] = Loose(offsets, old.args, new)
        elif isinstance(old, Memcpy | Memset) and type(old) is type(new):
            for a, b in zip(old.spans(), new.spans(), strict=True):
                pair_span(a, b, old_node)
    found = Relocation(nodes, functions, buffers, loose)
    # Blanked alike on both sides: a saved non-scratch buffer paired with scratch here (a file
    # that names none) has its pointers checked by the pairing, one shift per buffer.
    blank = {here.id for here in scratch.values()} | set(scratch_here)
    for old_node, new_node in nodes.items():
        if isinstance(saved.op(old_node), Conditional):
            raise UnsupportedError(f"expected kernels, copies and memsets, found conditional "
                                   f"node {old_node!r} (its bodies are not moved between "
                                   f"processes yet)")
        moved = relocate(saved.op(old_node), found, old_node)
        if _blanked(moved, blank) != _blanked(fresh.op(new_node), blank):
            raise UnsupportedError(f"expected the saved template, moved here, to equal the "
                                   f"capture here, found node {old_node!r} different beyond "
                                   f"its functions, addresses and loose argument words")
    return found


def learn_functions(r: Relocation, saved: KernelGraph, here: KernelGraph) -> dict[str, str]:
    """Kernel functions of ``saved`` (a shape's graph from the saving process) the template
    never ran, paired with those of ``here`` (the same shape captured here) by node and
    mangled name, added to ``r``: a warm start that had to capture a shape for a function the
    template never ran (one cuBLAS picks by size; this process may not even have loaded it
    until the capture did) then moves the later shapes that run it. Nodes whose names differ,
    or graphs that do not match, teach nothing. Returns the pairs it added (saved function to
    the function here), which hold for every relocation into this process."""
    try:
        nodes = match(saved, here)
    except GraphError:
        return {}
    added: dict[str, str] = {}
    for old_node, new_node in nodes.items():
        old, new = saved.op(old_node), here.op(new_node)
        if (isinstance(old, Kernel) and isinstance(new, Kernel) and old.name == new.name
                and old.function not in r.functions):
            r.functions[old.function] = added[old.function] = new.function
    return added


def learn_functions_by_name(r: Relocation, saved: KernelGraph,
                            here: Mapping[str, Collection[str]]) -> dict[str, str]:
    """Kernel functions of ``saved`` (a shape's graph from the saving process) that ``r``
    cannot move, paired with functions of this process by mangled name: ``here`` is what the
    same shape launches here, by name (``grape.torch.capture.functions_run``, a capture never
    read into the IR). A name pairs only where it stands for one function on each side, in
    this shape: libraries that build several functions under one name (cuDNN) teach nothing
    this way, and their shapes are captured whole, as :func:`learn_functions` needs. Returns
    the pairs added to ``r`` (saved function to the function here)."""
    theirs: dict[str, set[str]] = {}
    for _, k in saved.kernels():
        theirs.setdefault(k.name, set()).add(k.function)
    added: dict[str, str] = {}
    for name, functions in theirs.items():
        mine = here.get(name, ())
        if len(functions) == 1 and len(mine) == 1:
            (function,) = functions
            if function not in r.functions:
                r.functions[function] = added[function] = next(iter(mine))
    return added


_SCRATCH = Span("<scratch>")


def _blanked(op: Op, scratch: Collection[str]) -> Op:
    """``op`` with its pointers into ``scratch`` blanked (the word zero, the span one
    placeholder): two processes put scratch blocks at different places by design."""
    if isinstance(op, Kernel):
        args = bytearray(op.args)
        pointers = []
        for p in op.pointers:
            if p.target.buffer in scratch:
                args[p.offset:p.offset + 8] = bytes(8)
                p = Pointer(p.offset, _SCRATCH)
            pointers.append(p)
        return dataclasses.replace(op, args=bytes(args), pointers=tuple(pointers))

    def blank(span: Span) -> Span:
        return _SCRATCH if span.buffer in scratch else span

    if isinstance(op, Memcpy):
        return dataclasses.replace(op, src=blank(op.src), dst=blank(op.dst))
    if isinstance(op, Memset):
        return dataclasses.replace(op, dst=blank(op.dst))
    return op


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


def relocate(op: Op, r: Relocation, node: str | None = None) -> Op:
    """``op`` from the saved process, as it must read here; ``node``: the saved node it
    stands for, whose loose argument words (module docstring) it then takes from here.

    Raises
    ------
    UnsupportedError
        It runs a function the template here never ran, or touches memory it never touched.
    """
    if isinstance(op, Kernel):
        if op.function not in r.functions:
            raise UnsupportedError(f"expected kernel functions the template runs, found "
                                   f"{op.name!r}, which it never runs here")
        loose = r.loose.get(node) if node is not None else None
        # Loose words this op left as the saved template had them: this process's bytes
        # (module docstring). A loose word the op wrote itself is moved or kept as any other.
        from_here = {o for o in loose.offsets
                     if _word(op.args, o) == _word(loose.saved, o)} if loose else set()
        args = bytearray(op.args)
        pointers = []
        for p in op.pointers:
            if p.offset in from_here:
                continue
            span, shift = _moved(p.target, r)
            value = int.from_bytes(args[p.offset:p.offset + 8], "little") + shift
            args[p.offset:p.offset + 8] = value.to_bytes(8, "little")
            pointers.append(Pointer(p.offset, span))
        if loose:
            for offset in from_here:
                args[offset:offset + 8] = _word(loose.here.args, offset)
            pointers += [p for p in loose.here.pointers if p.offset in from_here]
            pointers.sort(key=lambda p: p.offset)
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
    return {r.nodes[node]: relocate(op, r, node) for node, op in changes.items()}


def relocate_variants(variants: Variants, r: Relocation, here: KernelGraph
                      ) -> tuple[Variants, dict[Hashable, str]]:
    """A saved executable's shapes (``grape.passes.variants``), moved here: ``here`` is its
    template as moved (its nodes are ``r``'s nodes here). Returns the shapes that moved, on
    ``here``, and each shape that did not, with why (one of its versions uses a function or
    memory the template never did): capture those here.

    Versions kept as rows move all at once, a pointer column at a time; a node whose loose
    words (module docstring) cover one of its pointers, or whose versions are operations,
    moves version by version with :func:`relocate`."""
    out = Variants(here, variants.takes_alternates)
    # Alternates move as their template node's versions do; one that does not move holds
    # back the shapes that run it (its number maps to None).
    kept: dict[str, list[int | None]] = {}
    refused: dict[tuple[str, int], str] = {}
    for node, ops in variants.alternates.items():
        mine = out.alternates.setdefault(r.nodes[node], [])
        kept[node] = [0]
        for k, op in enumerate(ops, 1):
            try:
                mine.append(relocate(op, r, node))
                kept[node].append(len(mine))
            except UnsupportedError as e:
                kept[node].append(None)
                refused[node, k] = str(e)
        if not mine:  # none moved: the node has no alternates here
            del out.alternates[r.nodes[node]]
    moved: dict[str, tuple[str, list[int | None], dict[int, str]]] = {}
    for node, versions in variants.nodes.items():
        base, k = variants.of(node)
        if k and kept[base][k] is None:
            continue
        new_node = alternate(r.nodes[base], kept[base][k]) if k else r.nodes[node]
        found = _moved_rows(versions, r, new_node, out.op(new_node))
        if found is None:
            found = _moved_ops(versions, r, new_node, out.op(new_node))
        out.nodes[new_node], numbers, why = found
        moved[node] = (new_node, numbers, why)
    failed: dict[Hashable, str] = {}
    for shape, versions in variants.shapes.items():
        chosen = variants.chosen.get(shape, {})
        if bad := next(((n, k) for n, k in chosen.items() if kept[n][k] is None), None):
            failed[shape] = refused[bad]
            continue
        mapped = {}
        for node, v in versions.items():
            new_node, numbers, why = moved[node]
            if numbers[v] is None:
                failed[shape] = why[v]
                break
            if numbers[v]:
                mapped[new_node] = numbers[v]
        else:
            out.shapes[shape] = mapped
            if chosen:
                out.chosen[shape] = {r.nodes[n]: kept[n][k] for n, k in chosen.items()}
    return out, failed


Moving = tuple[NodeVersions, list[int | None], dict[int, str]]  # versions, renumbering, why not


def _moved_ops(versions: NodeVersions, r: Relocation, node: str, here: Op) -> Moving:
    out = NodeVersions(node, here)
    numbers: list[int | None] = [0]
    why: dict[int, str] = {}
    for v in range(1, len(versions)):
        try:
            numbers.append(out.add(relocate(versions.op(v), r, versions.node)))
        except UnsupportedError as e:
            numbers.append(None)
            why[v] = str(e)
    return out, numbers, why


def _moved_rows(versions: NodeVersions, r: Relocation, node: str, here: Op) -> Moving | None:
    """Every row of ``versions`` moved at once, or None where they cannot be (operations,
    loose words over a pointer, row 0 not moving to ``here``): move them one by one then."""
    if not versions.rows or not isinstance(here, Kernel):
        return None
    t = versions.template
    loose = r.loose.get(versions.node)
    if loose is not None:
        pointed = [p.offset for p in (*t.pointers, *loose.here.pointers)]
        if any(abs(o - p) < 8 for o in loose.offsets for p in pointed):
            return None
    args, dims, targets = (a.copy() for a in versions.arrays())
    count = len(args)
    bad = np.zeros(count, dtype=bool)
    why: dict[int, str] = {}

    def refuse(rows: np.ndarray, message: str) -> None:
        for v in np.flatnonzero(rows & ~bad).tolist():
            why[v] = message
        bad[:] |= rows

    for j, p in enumerate(t.pointers):
        m = r.buffers.get(p.target.buffer)
        if m is None:
            refuse(np.ones(count, dtype=bool), f"expected memory the template uses, found "
                   f"buffer {p.target.buffer!r}, which it never touches")
            continue
        targets[:, j] += m.offset
        outside = (targets[:, j] < 0) | (targets[:, j] >= m.size)
        for v in np.flatnonzero(outside & ~bad).tolist():
            why[v] = (f"expected memory within the {m.size} bytes of buffer {m.buffer!r} here, "
                      f"found offset {int(targets[v, j])}")
        bad |= outside
        words = np.ascontiguousarray(args[:, p.offset:p.offset + 8]).view("<i8")[:, 0] + m.shift
        refuse(words < 0, f"expected a device address after the move, found node "
               f"{versions.node!r}'s pointer at byte {p.offset} below zero")
        args[:, p.offset:p.offset + 8] = words.astype("<i8").view(np.uint8).reshape(count, 8)
    if loose is not None:  # words left as the saved template had them take this process's
        for o in loose.offsets:
            saved = np.frombuffer(loose.saved[o:o + 8], dtype=np.uint8)
            width = len(saved)
            same = (args[:, o:o + width] == saved).all(axis=1)
            args[same, o:o + width] = np.frombuffer(loose.here.args[o:o + 8], dtype=np.uint8)
    if bad[0] or args[0].tobytes() != here.args or tuple(dims[0]) != (
            *here.grid, *here.block, here.shared_mem) \
            or [(p.offset, p.target.buffer) for p in here.pointers] != [
                (p.offset, r.buffers[p.target.buffer].buffer) for p in t.pointers] \
            or targets[0].tolist() != [p.target.offset for p in here.pointers]:
        return None
    keep = ~bad
    numbers: list[int | None] = np.where(keep, np.cumsum(keep) - 1, -1).tolist()
    numbers = [None if n < 0 else n for n in numbers]
    return (NodeVersions.of_rows(node, here, args[keep], dims[keep],
                                 targets[keep]), numbers, why)
