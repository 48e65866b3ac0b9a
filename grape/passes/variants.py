"""A family's shapes as versions of its template's nodes, each distinct version kept once.

Every shape an executable of a family runs changes some of its template's nodes: GPT-2
small's decode step changes about a hundred of its 316 nodes from one KV length to the next.
Kept as one operation (or coded delta) per shape and node, a family of a thousand lengths is a
hundred thousand small objects, and each step that touches them pays per object: reading a
saved family, moving it to another process, preparing the driver's calls. A warm start of
GPT-2's 1,023 lengths took 36 s on the H200 that way (run 7, ``benchmarks/README.md``).

:class:`Variants` keeps, for each template node that some shape changes, every distinct
version of it once (:class:`NodeVersions`), and each shape as the version it takes of each node
it changes (version 0 is the template's own). Versions of a kernel that keep the template's
function, launch attributes, parameter layout, pointer places and buffers, handles and
argument length are rows of three arrays: the argument bytes, the launch dimensions, and each
pointer's offset into its buffer (467 of the 468 changed kernel nodes of the three H200 GPT-2
families committed under ``traces/h200_families`` keep rows; the other one's second version
holds two fewer pointers, in words PyTorch leaves unfilled). Moving a family to another
process then shifts a pointer column of every version at once
(``grape.passes.relocate.relocate_variants``), and the driver's calls for every version of a
node share one argument array
(``grape.cuda.build.version_updates``). Other versions (copies, memsets, kernels of another
layout) are kept as operations.

Bringing an executable from one shape to another updates the nodes whose versions differ
(:meth:`Variants.switch`); shapes that share a version of a node need nothing there.

**Alternates.** No update can change a kernel node's launch attributes (its cluster shape): the
H200's GEMM and convolution kernels pick theirs by size, so Wav2Vec2's 101 audio lengths
needed 45 executables for 7 topologies (``benchmarks/README.md``). A :class:`Variants` made with
``alternates=True`` takes such a shape all the same: where a kernel's attributes differ from
the template's, the executable gets an *alternate* of that node (``node~k``), chained after
it, holding the kernel with those attributes, and each shape runs one of a node's alternates
with the others disabled (``cuGraphNodeSetEnabled``: a disabled node runs as an empty one).
:meth:`Variants.toggles` says which nodes a switch enables and disables;
:meth:`Variants.executable_graph` is the template with its alternates, what is instantiated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import struct
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from grape.errors import GraphError, UnsupportedError
from grape.ir import Kernel, KernelGraph, Op, Pointer, Span
from grape.passes.delta import (
    check_buffers,
    merge_buffers,
)
from grape.passes.families import match

__all__ = ["DIMS", "NodeVersions", "Variants", "alternate", "check_in_place",
           "device_switchable"]

# A kernel version's launch dimensions, one row each: grid x, y, z, block x, y, z, shared bytes.
DIMS = 7

# A kernel version as one bytes object: its argument bytes, then its DIMS launch numbers and
# each pointer's offset as little-endian int64 (one hash and one comparison a version).
Row = bytes


def _layout(k: Kernel) -> tuple:
    """What every row of a kernel node shares with its template (all but the numbers)."""
    return (k.function, k.name, k.attributes, k.params,
            tuple((p.offset, p.target.buffer) for p in k.pointers), k.handles, len(k.args))


def _row(k: Kernel) -> Row:
    numbers = (*k.grid, *k.block, k.shared_mem, *(p.target.offset for p in k.pointers))
    return k.args + struct.pack(f"<{len(numbers)}q", *numbers)


def _blobs(args: np.ndarray, dims: np.ndarray, targets: np.ndarray) -> list[Row]:
    """Rows of arrays as :data:`Row` objects."""
    matrix = np.concatenate([args, dims.astype("<i8").view(np.uint8),
                             targets.astype("<i8").view(np.uint8)], axis=1)
    width, data = matrix.shape[1], matrix.tobytes()
    return [data[i:i + width] for i in range(0, len(data), width)] if width else \
        [b""] * len(matrix)


class NodeVersions:
    """Every version of one template node that a family's shapes use; version 0 is the
    template's operation. Equal operations are one version."""

    __slots__ = ("_arrays", "_index", "_layout", "_ops", "_rows", "node", "template")

    def __init__(self, node: str, template: Op) -> None:
        self.node = node
        self.template = template
        kernel = isinstance(template, Kernel)
        self._layout = _layout(template) if kernel else None
        self._rows: list[Row] | None = [_row(template)] if kernel else None
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._ops: list[Op] | None = None if kernel else [template]
        self._index: dict[Any, int] | None = None  # version by row or operation, made on use

    @classmethod
    def of_rows(cls, node: str, template: Kernel, args: np.ndarray, dims: np.ndarray,
                targets: np.ndarray) -> NodeVersions:
        """Kernel versions as arrays (row 0 the template's): ``args`` (versions, argument
        bytes) uint8, ``dims`` (versions, DIMS) and ``targets`` (versions, pointers) int64."""
        nv = cls.__new__(cls)
        nv.node, nv.template, nv._layout = node, template, _layout(template)
        nv._rows, nv._ops, nv._index = None, None, None
        nv._arrays = (args, dims, targets)
        return nv

    @classmethod
    def of_ops(cls, node: str, ops: list[Op]) -> NodeVersions:
        """Versions as operations, ``ops[0]`` the template's."""
        nv = cls(node, ops[0])
        nv._rows, nv._ops = None, [ops[0]]  # operations even where they could be rows
        for op in ops[1:]:
            nv._push(op)
        return nv

    @property
    def rows(self) -> bool:
        """Whether the versions are rows of arrays (:meth:`arrays`), not operations."""
        return self._ops is None

    def __len__(self) -> int:
        if self._ops is not None:
            return len(self._ops)
        return len(self._rows) if self._rows is not None else len(self._arrays[0])

    def add(self, op: Op) -> int:
        """The version number of ``op``, made a new version where no version equals it."""
        if self._ops is None:
            if isinstance(op, Kernel) and _layout(op) == self._layout:
                row = _row(op)
                index = self._indexed()
                found = index.get(row)
                if found is None:
                    found = index[row] = len(self)
                    self._rows_list().append(row)
                    self._arrays = None
                return found
            # A version of another layout: every version becomes an operation.
            self._ops = [self.op(v) for v in range(len(self))]
            self._rows = self._arrays = None
            self._index = None
        return self._append_op(op)

    def takes_rows(self, op: Op) -> bool:
        """Whether versions of ``op``'s layout are kept as rows here (:meth:`add_rows`)."""
        return self._ops is None and isinstance(op, Kernel) and _layout(op) == self._layout

    def add_rows(self, args: np.ndarray, dims: np.ndarray, targets: np.ndarray) -> list[int]:
        """Many kernel versions at once, as rows of :meth:`arrays`' layout (which
        :meth:`takes_rows` must allow): each row's version number, made a new version where no
        version equals it."""
        if self._ops is not None:
            raise GraphError(f"expected node {self.node!r} to keep its versions as rows, found "
                             f"them kept as operations")
        index, rows = self._indexed(), self._rows_list()
        out = []
        for row in _blobs(args, dims, targets):
            found = index.get(row)
            if found is None:
                found = index[row] = len(rows)
                rows.append(row)
            out.append(found)
        self._arrays = None
        return out

    def _append_op(self, op: Op) -> int:
        index = self._indexed()
        try:
            found = index.get(op)
        except TypeError:  # a field holding a list cannot be hashed: compared whole
            found = next((v for v, mine in enumerate(self._ops) if mine == op), None)
            return self._push(op) if found is None else found
        if found is None:
            found = index[op] = self._push(op)
        return found

    def _push(self, op: Op) -> int:
        self._ops.append(op)
        return len(self._ops) - 1

    def _indexed(self) -> dict[Any, int]:
        if self._index is None:
            if self._ops is not None:
                self._index = {}
                for v, op in enumerate(self._ops):
                    with contextlib.suppress(TypeError):  # unhashable: found by comparing
                        self._index.setdefault(op, v)
            else:
                self._index = {}
                for v, row in enumerate(self._rows_list()):
                    self._index.setdefault(row, v)
        return self._index

    def settle(self) -> None:
        """Keep the versions as arrays alone: the rows and their index, which only adding
        versions needs, are made again if one is added."""
        if self._ops is None:
            self.arrays()
            self._rows = self._index = None

    def _rows_list(self) -> list[Row]:
        if self._rows is None:
            self._rows = _blobs(*self._arrays)
        return self._rows

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Kernel versions' argument bytes (versions, length) uint8, launch dimensions
        (versions, DIMS) and pointers' offsets into their buffers (versions, pointers) int64,
        row 0 the template's."""
        if self._ops is not None:
            raise GraphError(f"expected kernel versions as rows of node {self.node!r}, found "
                             f"operations of another layout")
        if self._arrays is None:
            rows, width = self._rows, len(self.template.args)
            numbers = 8 * (DIMS + len(self.template.pointers))
            matrix = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(
                len(rows), width + numbers)
            # copies: contiguous, writable, and not the joined bytes' view
            args = matrix[:, :width].copy()
            tail = np.ascontiguousarray(matrix[:, width:]).view("<i8")
            self._arrays = (args, tail[:, :DIMS].astype(np.int64),
                            tail[:, DIMS:].astype(np.int64))
        return self._arrays

    def op(self, version: int) -> Op:
        """Version ``version``'s operation (0: the template's own)."""
        if version == 0:
            return self.template
        if self._ops is not None:
            return self._ops[version]
        t = self.template
        if self._rows is not None:
            row, width = self._rows[version], len(t.args)
            args = row[:width]
            numbers = struct.unpack(f"<{(len(row) - width) // 8}q", row[width:])
            dims, targets = numbers[:DIMS], numbers[DIMS:]
        else:
            a, d, p = self.arrays()
            dims, args, targets = d[version].tolist(), a[version].tobytes(), p[version].tolist()
        return dataclasses.replace(
            t, grid=tuple(dims[:3]), block=tuple(dims[3:6]), shared_mem=dims[6], args=args,
            pointers=tuple(Pointer(p.offset, Span(p.target.buffer, offset))
                           for p, offset in zip(t.pointers, targets, strict=True)))

    @property
    def host_bytes(self) -> int:
        """Host bytes the versions keep beyond the template: array rows, or an estimate of 64
        bytes an operation (its fields are shared with the template's where equal)."""
        if self._ops is not None:
            return 64 * (len(self._ops) - 1) + sum(
                len(op.args) for op in self._ops[1:] if isinstance(op, Kernel))
        args, dims, targets = self.arrays()
        return (args.nbytes + dims.nbytes + targets.nbytes) * (len(self) - 1) // len(self)


def device_switchable(versions: NodeVersions) -> bool:
    """Whether a kernel on the GPU can give a node each of ``versions`` (CUDA's device-updatable
    kernel nodes, ``grape.cuda.switch``): kernel versions kept as rows (one function and argument
    layout), no conditional handle among the arguments (an executable's handles are its own),
    and one block shape and shared memory size for all (the device sets only arguments and
    grid). The simulator prices a switch by the same rule."""
    if not versions.rows or versions.template.handles:
        return False
    dims = versions.arrays()[1]
    return bool((dims[:, 3:] == dims[0, 3:]).all())


def alternate(node: str, k: int) -> str:
    """The id of node ``node``'s ``k``-th alternate (``k`` from 1; 0 is the node itself)."""
    return f"{node}~{k}" if k else node


def check_in_place(template: KernelGraph, changes: Mapping[str, Op],
                   attributes: bool = False) -> None:
    """Refuse changes an executable of ``template`` cannot take by updating nodes in place (as
    ``grape.passes.delta.join`` refuses them): a node of another kind, a kernel whose launch
    attributes change (unless ``attributes``: an executable with alternates takes those), a
    node that is no kernel, copy or memset changing.

    Raises
    ------
    UnsupportedError
        The first change that cannot be made, named.
    """
    for node, op in changes.items():
        if node not in template.dag:
            raise UnsupportedError(f"expected changes to the template's nodes, found {node!r}")
        mine = template.op(node)
        if type(op) is not type(mine):
            raise UnsupportedError(f"expected node {node!r} to keep its kind, found {mine.kind} "
                                   f"becoming {op.kind}")
        if isinstance(mine, Kernel):
            if op.attributes != mine.attributes and not attributes:
                raise UnsupportedError("expected kernels whose launch attributes stay, found one "
                                       "whose attributes change, which an executable cannot "
                                       "take in place")
        elif mine.kind not in ("memcpy", "memset"):
            raise UnsupportedError(f"expected only kernels, copies and memsets to change, found "
                                   f"node {node!r} ({mine.kind}) changing")


class Variants:
    """One executable's shapes: each as the versions it takes of the template's nodes it
    changes, and with ``alternates``, which alternate of a node it runs (see the module)."""

    def __init__(self, template: KernelGraph,
                 alternates: bool | Callable[[Kernel], bool] = False) -> None:
        """``alternates``: whether shapes whose kernels' launch attributes differ are taken
        (by alternates), or a test of the kernels an executable can disable (the CUDA
        backend's ``can_disable``: a node whose template or alternate fails it is refused, as
        without alternates)."""
        self.template = template
        self.nodes: dict[str, NodeVersions] = {}
        # shape -> {template node or alternate: version} for the nodes it changes (none: the
        # template's)
        self.shapes: dict[Hashable, dict[str, int]] = {}
        self.takes_alternates = alternates
        # template node -> its alternates' kernels (alternate k is alternates[node][k - 1])
        self.alternates: dict[str, list[Kernel]] = {}
        # shape -> {template node: k} for the nodes it runs an alternate of (none: the node)
        self.chosen: dict[Hashable, dict[str, int]] = {}

    def op(self, node: str) -> Op:
        """The template's operation of ``node``, an alternate's (``node~k``) included."""
        base, k = self.of(node)
        return self.alternates[base][k - 1] if k else self.template.op(node)

    def of(self, node: str) -> tuple[str, int]:
        """(template node, k) for alternate ``node`` (``node~k``); (``node``, 0) for any other."""
        base, _, k = node.rpartition("~")
        if base and k.isdigit() and 0 < int(k) <= len(self.alternates.get(base, ())):
            return base, int(k)
        return node, 0

    def add_graph(self, shape: Hashable, graph: KernelGraph,
                  pairs: Mapping[str, str] | None = None) -> None:
        """Add ``shape`` by its whole graph (a capture), where an executable of the template
        can be brought to it by updating nodes in place (with ``alternates``, and enabling
        alternates of the kernels whose launch attributes differ); the template's buffer table
        then takes its buffers (``grape.passes.delta.join`` explains). ``pairs``: the
        template's nodes to ``graph``'s, where known without matching. Nothing changes where
        it raises.

        Raises
        ------
        UnsupportedError
            The graphs differ in structure, in a kernel's launch attributes (without
            ``alternates``) or in a node that cannot change in place, or name one buffer at
            two addresses.
        """
        try:
            pairs = pairs if pairs is not None else match(self.template, graph)
        except GraphError as e:
            raise UnsupportedError(str(e)) from None
        template = self.template
        changes = {}
        for mine, theirs in pairs.items():
            op, before = graph.op(theirs), template.op(mine)
            if op is not before and op != before:
                changes[mine] = op
        check_in_place(template, changes, self.takes_alternates)
        check_buffers(template, graph)
        self._commit(shape, self._choose(shape, changes))
        merge_buffers(template, graph)

    def _choose(self, shape: Hashable, changes: Mapping[str, Op]) -> dict[str, Op]:
        """``changes`` with each kernel whose attributes differ from the template's moved to
        the alternate of the node that has them (made where none has): what ``shape`` runs.
        New alternates are tested (``alternates`` given as a test) before any is kept.

        Raises
        ------
        UnsupportedError
            A new alternate, or the template's kernel it sits beside, fails the test."""
        out, chosen, new = {}, {}, {}
        for node, op in changes.items():
            mine = self.template.op(node)
            if not isinstance(mine, Kernel) or op.attributes == mine.attributes:
                out[node] = op
                continue
            kept = [*self.alternates.get(node, ()), *new.get(node, ())]
            k = next((i for i, alt in enumerate(kept, 1) if alt.attributes == op.attributes),
                     None)
            if k is None:
                new.setdefault(node, []).append(op)
                k = len(kept) + 1
            chosen[node] = k
            out[alternate(node, k)] = op
        test = self.takes_alternates
        if callable(test):
            for node, ops in new.items():
                tried = ops if node in self.alternates else [self.template.op(node), *ops]
                if bad := next((k for k in tried if not test(k)), None):
                    raise UnsupportedError(f"expected kernels an executable can disable, to "
                                           f"run one of node {node!r}'s launch attributes at "
                                           f"a time, found {bad.name[:60]} with "
                                           f"{dict(bad.attributes)}, which the driver will "
                                           f"not disable")
        for node, ops in new.items():
            self.alternates.setdefault(node, []).extend(ops)
        if chosen:
            self.chosen[shape] = chosen
        return out

    def add_changes(self, shape: Hashable, changes: Mapping[str, Op]) -> None:
        """Add ``shape`` by the template nodes it changes (a saved member: its operations point
        into the template's buffers). Nothing changes where it raises.

        Raises
        ------
        UnsupportedError
            A node that is not the template's, or a change that cannot be made in place.
        """
        check_in_place(self.template, changes, self.takes_alternates)
        self._commit(shape, self._choose(shape, {n: op for n, op in changes.items()
                                                 if op != self.template.op(n)}))

    def _commit(self, shape: Hashable, changes: Mapping[str, Op]) -> None:
        versions = {}
        for node, op in changes.items():
            if node not in self.nodes and op == self.op(node):
                continue  # a new alternate's own operation: no versions to keep yet
            if v := self.node(node).add(op):
                versions[node] = v
        self.shapes[shape] = versions

    def node(self, node: str) -> NodeVersions:
        """Node ``node``'s versions (none but the template's where no shape changes it yet);
        an alternate's too (``node~k``)."""
        found = self.nodes.get(node)
        if found is None:
            found = self.nodes[node] = NodeVersions(node, self.op(node))
        return found

    def runs(self, node: str, shape: Hashable) -> str:
        """Which of template node ``node``'s alternates ``shape`` runs (``node`` itself where
        it runs the template's)."""
        return alternate(node, self.chosen.get(shape, {}).get(node, 0))

    def add_like(self, shapes: Sequence[Hashable], like: Hashable,
                 versions: Mapping[str, Sequence[int]]) -> None:
        """Add ``shapes``, each taking the versions ``like`` takes but for the nodes of
        ``versions``, of which the i-th shape takes ``versions[node][i]`` (made by
        :meth:`NodeVersions.add_rows` or ``add``; 0: the template's), and the alternates
        ``like`` runs. For lengths derived from a captured one, whose other nodes are that
        one's."""
        base = self.shapes[like]
        chosen = self.chosen.get(like)
        for i, shape in enumerate(shapes):
            mine = dict(base)
            for node, numbers in versions.items():
                if numbers[i]:
                    mine[node] = numbers[i]
                else:
                    mine.pop(node, None)
            self.shapes[shape] = mine
            if chosen:
                self.chosen[shape] = chosen

    def settle(self) -> None:
        """Every node's versions as arrays alone (:meth:`NodeVersions.settle`): a family
        settles once its shapes are placed, halving what its kernel versions hold."""
        for versions in self.nodes.values():
            versions.settle()

    def discard(self, shape: Hashable) -> None:
        """Forget ``shape`` (its versions stay, unused)."""
        self.shapes.pop(shape, None)
        self.chosen.pop(shape, None)

    def switch(self, holds: Hashable, shape: Hashable) -> list[tuple[str, int]]:
        """(node, version) for each node whose version differs between an executable holding
        ``holds`` and ``shape``: what to update to run ``shape``. Disabled alternates are
        updated too: what an executable's node holds is then always its shape's version."""
        before, after = self.shapes[holds], self.shapes[shape]
        out = [(node, v) for node, v in after.items() if before.get(node) != v]
        out += [(node, 0) for node in before if node not in after]
        return out

    def toggles(self, holds: Hashable, shape: Hashable) -> list[tuple[str, bool]]:
        """(node, enabled) for each alternate (the template's node among them) that an
        executable holding ``holds`` disables or enables to run ``shape``: disabling first."""
        before, after = self.chosen.get(holds, {}), self.chosen.get(shape, {})
        if not before and not after:
            return []
        off, on = [], []
        for node in before.keys() | after.keys():
            was, now = before.get(node, 0), after.get(node, 0)
            if was != now:
                off.append((alternate(node, was), False))
                on.append((alternate(node, now), True))
        return off + on

    @property
    def alternate_count(self) -> int:
        """How many alternates the executable holds beyond its template's nodes."""
        return sum(map(len, self.alternates.values()))

    @property
    def alternated(self) -> frozenset[str]:
        """Every node with alternates, and its alternates: the nodes a switch may toggle."""
        return frozenset(alternate(node, k) for node, kept in self.alternates.items()
                         for k in range(len(kept) + 1))

    def disabled(self, shape: Hashable) -> list[str]:
        """The alternates (the template's nodes among them) an executable running ``shape``
        keeps disabled."""
        chosen = self.chosen.get(shape, {})
        return [alternate(node, k) for node, kept in self.alternates.items()
                for k in range(len(kept) + 1) if k != chosen.get(node, 0)]

    def executable_graph(self) -> KernelGraph:
        """The template with each node's alternates chained after it (``node``, ``node~1``,
        ... ``node~k``, each waiting for the one before), the node's successors waiting for
        the last: the graph an executable of these shapes is built from (the template itself
        where there are none). A chain, not siblings: on the H200 Wav2Vec2's executables
        with 287 alternates took 64.1 MB as siblings, 39.5 MB chained, 38.3 MB without
        (``benchmarks/README.md``). Disabled nodes run as empty ones, so the chain runs the one
        enabled; the edges into and out of a chain are full dependencies, not programmatic
        ones, since a programmatic wait through a disabled node is not one the captured
        kernels were written for."""
        if not self.alternates:
            return self.template
        out = self.template.with_ops({})
        dag = out.dag
        for node, kept in self.alternates.items():
            for u in list(dag.predecessors(node)):
                dag.edges[u, node].pop("kind", None)
            after = list(dag.successors(node))
            dag.remove_edges_from([(node, w) for w in after])
            last = node
            for k, op in enumerate(kept, 1):
                dag.add_node(alternate(node, k), op=op)
                dag.add_edge(last, alternate(node, k))
                last = alternate(node, k)
            dag.add_edges_from((last, w) for w in after)
        return out

    def ops(self, shape: Hashable) -> dict[str, Op]:
        """The operations ``shape`` changes, by template node: where it runs an alternate,
        that alternate's version (the shape's own graph is the template with these)."""
        out: dict[str, Op] = {node: self.alternates[node][k - 1]
                              for node, k in self.chosen.get(shape, {}).items()}
        for node, v in self.shapes[shape].items():
            out[self.of(node)[0]] = self.nodes[node].op(v)
        return out

    @property
    def host_bytes(self) -> int:
        """Host bytes the shapes' versions keep beyond the template (8 a shape and node for the
        version numbers)."""
        return sum(nv.host_bytes for nv in self.nodes.values()) + 8 * sum(
            map(len, self.shapes.values()))

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.shapes)
