"""Parameter deltas: what one shape's graph changes in its group's template.

A :class:`ShapeDelta` lists, for each template node whose parameters differ in the shape's
graph, the new kernel function, launch dimensions, attributes and arguments (the arguments as a
coded XOR against the template's), or a whole replacement for copy and memset nodes. Applying
a delta to the template gives back the shape's graph, node for node; comparing two shapes'
deltas gives the nodes an executable must update to go from one to the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from grape.errors import GraphError, UnsupportedError
from grape.ir import Kernel, KernelGraph, Op
from grape.passes.compress import best, decode, encode, xor
from grape.passes.families import canonical_order, match, same_ids

__all__ = ["KernelDelta", "NodeDelta", "ShapeDelta", "apply", "changed_nodes", "check_buffers",
           "delta", "identity", "join", "merge_buffers", "operation",
           "transition"]

# Kernel fields a delta carries whole when they differ (args get their own coding).
_WHOLE = ("function", "name", "grid", "block", "shared_mem", "attributes", "params", "pointers",
          "handles")


# Slotted: a family keeps about a hundred node deltas per shape, and the cycle collector walks
# each at every collection (one before each capture); without a __dict__ that walk is cheaper.
@dataclass(frozen=True, slots=True)
class KernelDelta:
    fields: tuple[tuple[str, object], ...]  # (name, new value) for fields that differ
    args_codec: str | None = None  # None: arguments unchanged
    args: bytes = b""  # coded XOR against the template's arguments (or raw, if lengths differ)
    args_length: int = 0

    @property
    def size(self) -> int:
        """Bytes the delta keeps for the arguments (the part that dominates)."""
        return len(self.args)


@dataclass(frozen=True, slots=True)
class NodeDelta:
    node: str  # the template's node
    kernel: KernelDelta | None = None
    replacement: Op | None = None  # a copy, memset or event node's new operation


@dataclass(frozen=True)
class ShapeDelta:
    nodes: tuple[NodeDelta, ...]
    mapping: tuple[tuple[str, str], ...]  # template node -> the shape's own node id

    @property
    def args_bytes(self) -> int:
        return sum(d.kernel.size for d in self.nodes if d.kernel)


def _kernel_delta(t: Kernel, o: Kernel, codec: str | None) -> KernelDelta | None:
    changed = tuple((name, getattr(o, name)) for name in _WHOLE
                    if getattr(o, name) != getattr(t, name))
    if o.args == t.args:
        return KernelDelta(changed) if changed else None
    if len(o.args) != len(t.args):  # another function's layout: keep its arguments whole
        return KernelDelta(changed, "raw", o.args, len(o.args))
    x = xor(t.args, o.args)
    name, blob = best(x) if codec is None else (codec, encode(x, codec))
    return KernelDelta(changed, name, blob, len(x))


def _node_delta(t_node: str, t_op: Op, o_op: Op, codec: str | None) -> NodeDelta | None:
    if type(t_op) is not type(o_op):
        raise GraphError(f"expected node {t_node!r} to keep its kind, found {t_op.kind} "
                         f"becoming {o_op.kind}")
    if isinstance(t_op, Kernel):
        d = _kernel_delta(t_op, o_op, codec)
        return None if d is None else NodeDelta(t_node, kernel=d)
    return NodeDelta(t_node, replacement=o_op) if o_op != t_op else None


def delta(template: KernelGraph, other: KernelGraph, codec: str | None = None,
          pairs: Mapping[str, str] | None = None) -> ShapeDelta:
    """What ``other`` changes in ``template`` (``codec`` None: the smallest coding per node).
    ``pairs``: ``match(template, other)``, where the caller knows it already (a graph derived
    from another keeps that one's nodes).

    Raises
    ------
    GraphError
        The graphs differ in structure, or a node would change kind.
    """
    pairs = pairs if pairs is not None else match(template, other)
    nodes = (_node_delta(t, template.op(t), other.op(o), codec) for t, o in pairs.items())
    return ShapeDelta(tuple(nd for nd in nodes if nd is not None), tuple(pairs.items()))


def identity(graph: KernelGraph) -> ShapeDelta:
    """``delta(graph, graph)`` without comparing the graph with itself: no node changes, each
    maps to itself (a new executable's own shape; on a Wav2Vec2 training step, thousands of
    nodes, the comparison cost a third of a second per shape). Its mapping is in the order
    ``match(graph, graph)`` gives it (node ids' order, without conditional nodes)."""
    if same_ids(graph, graph):
        return ShapeDelta((), tuple((n, n) for n in graph.dag))
    return ShapeDelta((), tuple((n, n) for n in canonical_order(graph)))


def _apply_kernel(t: Kernel, d: KernelDelta) -> Kernel:
    k = replace(t, **dict(d.fields))
    if d.args_codec == "raw" and d.args_length != len(t.args):
        return replace(k, args=d.args)
    if d.args_codec is not None:
        return replace(k, args=xor(t.args, decode(d.args, d.args_codec, d.args_length)))
    return k


def apply(template: KernelGraph, d: ShapeDelta) -> dict[str, Op]:
    """Every template node's operation as the shape has it."""
    ops = dict(template.ops())
    for nd in d.nodes:
        t = template.op(nd.node)
        ops[nd.node] = nd.replacement if nd.replacement is not None else _apply_kernel(t, nd.kernel)
    return ops


def changed_nodes(template: KernelGraph, current: ShapeDelta, target: ShapeDelta) -> list[str]:
    """Template nodes whose parameters differ between two shapes: what an executable holding
    ``current`` must update to run ``target``."""
    a, b = apply(template, current), apply(template, target)
    return [n for n in a if a[n] != b[n]]




def transition(template: KernelGraph, current: ShapeDelta, target: ShapeDelta) -> dict[str, Op]:
    """The template nodes whose operation differs between two shapes, as ``target`` has them:
    what an executable holding ``current`` must update to run ``target``.

    Only the nodes either delta mentions are looked at, and two equal node deltas mean equal
    operations (the coding is a function of the bytes), so a step between neighbouring shapes
    decodes only the few nodes that differ. Both deltas must be against ``template``.
    """
    before = {nd.node: nd for nd in current.nodes}
    after = {nd.node: nd for nd in target.nodes}
    ops = {}
    for node in before.keys() | after.keys():
        nd = after.get(node)
        if before.get(node) == nd:
            continue
        # None: back to the template's own parameters
        ops[node] = template.op(node) if nd is None else operation(template, nd)
    return ops


def operation(template: KernelGraph, nd: NodeDelta) -> Op:
    """One node's operation as the shape ``nd`` belongs to has it."""
    if nd.replacement is not None:
        return nd.replacement
    return _apply_kernel(template.op(nd.node), nd.kernel)


def _attributes_change(d: ShapeDelta) -> bool:
    return any(nd.kernel is not None and "attributes" in dict(nd.kernel.fields) for nd in d.nodes)


def join(template: KernelGraph, other: KernelGraph,
         pairs: Mapping[str, str] | None = None) -> ShapeDelta:
    """``other``'s delta against ``template``, where an executable of ``template`` can be
    brought to ``other`` by updating nodes in place; the template's buffer table then takes
    ``other``'s buffers (an executable's builder resolves copies' and memsets' addresses through
    it). Only kernels' functions, launch dimensions and arguments, and copies and memsets,
    change in place: a kernel's launch attributes cannot (the driver took such changes on the
    H200, and the kernels then stopped on an illegal instruction). ``pairs``: as for
    :func:`delta`.

    Raises
    ------
    UnsupportedError
        The two graphs differ in structure, in a kernel's launch attributes or in a node that
        cannot change in place, or name one buffer at two addresses; the template is unchanged.
    """
    try:
        d = delta(template, other, pairs=pairs)
    except GraphError as e:
        raise UnsupportedError(str(e)) from None
    _check_in_place(template, d)
    check_buffers(template, other)
    merge_buffers(template, other)
    return d


def check_buffers(template: KernelGraph, other: KernelGraph) -> None:
    """Refuse graphs that name one buffer at two addresses: an executable resolves copies' and
    memsets' addresses through one buffer table.

    Raises
    ------
    UnsupportedError
        The first buffer found at two addresses.
    """
    for b in other.buffers.values():
        mine = template.buffers.get(b.id)
        if mine is not None and mine.address != b.address:
            raise UnsupportedError(f"expected buffer {b.id!r} at one address in both graphs, "
                                   f"found it at {mine.address} and {b.address}")


def merge_buffers(template: KernelGraph, other: KernelGraph) -> None:
    """Give ``template``'s buffer table ``other``'s buffers (an executable's builder resolves
    copies' and memsets' addresses through it): those it lacks, and the larger size of one it
    has (a pool block reused at another size: one start, one address)."""
    for b in other.buffers.values():
        mine = template.buffers.get(b.id)
        if mine is None:
            template.add_buffer(b)
        elif b.size > mine.size:
            template.buffers[b.id] = b


def _check_in_place(template: KernelGraph, d: ShapeDelta) -> None:
    """Refuse a delta an executable of ``template`` cannot take by updating nodes in place."""
    if _attributes_change(d):
        raise UnsupportedError("expected kernels whose launch attributes stay, found one whose "
                               "attributes change, which an executable cannot take in place")
    for nd in d.nodes:
        op = template.op(nd.node)
        if nd.replacement is not None and op.kind not in ("memcpy", "memset"):
            raise UnsupportedError(f"expected only kernels, copies and memsets to change, found "
                                   f"node {nd.node!r} ({op.kind}) changing")
