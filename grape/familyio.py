"""Graph families on disk: each executable's template graph, each shape's changes to it, and
the environment the family was captured in.

A document (version 2) is ``{"schema": "grape.family", "version": 2, "environment": {...},
"templates": {key: <grape.ir document>}, "shapes": [[shape, key], ...], "executables": {key:
{"nodes": [node, ...], "versions": ..., "rows": {node: {...}}, "ops": {node: <grape.ir
document>}}}, "scratch": [buffer id, ...]}``: each executable's shapes as versions of the
template's nodes (``grape.passes.variants``), alternates among them (``node~k``; an
executable with alternates also has ``"alternates": {node: <grape.ir document>}``, alternates
1.. as nodes ``"1"``, ``"2"``, ..., and ``"chosen": {"nodes": [node, ...], "alternates":
...}``, the alternate each shape runs of each, 0 the node itself, int32 base64).
``versions`` holds, for each of the executable's shapes in ``shapes`` order, the version it
takes of each of ``nodes`` (0: the template's own), as a little-endian int32 array in base64;
a node's versions are ``rows`` (kernel versions as arrays: ``count`` versions after the
template's, the argument byte ``columns`` where some version differs from the template and
their ``values``, the launch ``dims`` (grid, block, shared memory) and each pointer's offset
into its buffer, ``targets``; int32, uint8, int64 and int64, base64) or ``ops`` (versions 1..
as nodes ``"1"``, ``"2"``, ... of an IR document without buffers). Version 1 documents,
still read, held each member's changed operations in full:
``"members": [{"shape": ..., "template": key, "changes": <grape.ir document>}, ...]``.

A shape is an integer, a string or a list of them (a tuple in Python). The template's buffer
table holds every member's buffers (a family's executable resolves addresses through it).
``scratch`` (optional; none where absent) names the buffers only the family's graphs use (their
pool's memory, which held no tensor when the family was saved): a warm start moves each whole
to memory of its own rather than to where a capture here put its blocks
(``grape.passes.relocate``).

:meth:`SavedFamily.check` refuses, naming the first difference, a family whose environment
(driver, GPU, library versions, the model's parameter layout) differs from the one asked about:
a family's graphs point at that process's kernels and memory. ``grape simulate`` runs a saved
family over a sequence of shapes; ``grape.torch.family.load_family`` loads one into a new
process without capturing every shape (the warm start).
"""

from __future__ import annotations

import base64
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from grape.errors import GrapeError, UnsupportedError
from grape.ir import Buffer, BufferRole, Kernel, KernelGraph, Memory, Op
from grape.irjson import decoded, graph_from_json, graph_to_json
from grape.jsonio import check_schema, dump_json, load_json
from grape.passes.delta import ShapeDelta, apply
from grape.passes.variants import DIMS, NodeVersions, Variants

__all__ = ["SCHEMA", "SavedFamily", "family_from_json", "graph_with", "load_family", "save_family"]

SCHEMA = "grape.family"
VERSION = 2


@dataclass
class SavedFamily:
    variants: dict[str, Variants]  # by executable key: its template and its shapes' versions
    shapes: dict[Hashable, str]  # every shape, in order, to its executable's key
    environment: dict[str, str] = field(default_factory=dict)
    scratch: frozenset[str] = frozenset()  # buffers only the graphs use (module docstring)

    @classmethod
    def from_members(cls, templates: Mapping[str, KernelGraph],
                     members: Mapping[Hashable, tuple[str, Mapping[str, Op]]],
                     environment: Mapping[str, str] | None = None,
                     scratch: Iterable[str] = ()) -> SavedFamily:
        """A family from its templates and each shape's (executable key, changed operations
        by template node).

        Raises
        ------
        GrapeError
            A shape of an executable that is not among the templates, or changes to nodes
            the template lacks (or that no executable could take in place).
        """
        variants = {key: Variants(t) for key, t in templates.items()}
        shapes = {}
        for shape, (key, changes) in members.items():
            if key not in variants:
                raise GrapeError(f"expected shape {shape!r}'s executable {key!r} among the "
                                 f"templates, found none")
            try:
                variants[key].add_changes(shape, changes)
            except UnsupportedError as e:
                raise GrapeError(f"shape {shape!r} of template {key!r}: {e}") from None
            shapes[shape] = key
        return cls(variants, shapes, dict(environment or {}), frozenset(scratch))

    @classmethod
    def of(cls, templates: Mapping[str, KernelGraph],
           placed: Mapping[Hashable, tuple[str, ShapeDelta]],
           environment: Mapping[str, str] | None = None,
           scratch: Iterable[str] = ()) -> SavedFamily:
        """A family from its templates and each shape's (executable key, delta)."""
        members = {}
        for shape, (key, d) in placed.items():
            ops = apply(templates[key], d)
            members[shape] = (key, {nd.node: ops[nd.node] for nd in d.nodes})
        return cls.from_members(templates, members, environment, scratch)

    @property
    def templates(self) -> dict[str, KernelGraph]:
        return {key: v.template for key, v in self.variants.items()}

    @property
    def members(self) -> Mapping[Hashable, tuple[str, dict[str, Op]]]:
        """Each shape's (executable key, changed operations by template node), made when
        asked for (a family of a thousand shapes holds a hundred thousand)."""
        return _Members(self)

    def changed(self, shape: Hashable) -> int:
        """How many template nodes ``shape`` changes."""
        return len(self.variants[self.shapes[shape]].shapes[shape])

    def scratch_buffers(self) -> dict[str, Buffer]:
        """The scratch buffers, as the templates' tables have them."""
        found = {}
        for v in self.variants.values():
            found.update((b.id, b) for b in v.template.buffers.values() if b.id in self.scratch)
        return found

    def graph(self, shape: Hashable) -> KernelGraph:
        """``shape``'s own graph: its template with the shape's changes, under the template's
        node ids."""
        if shape not in self.shapes:
            raise GrapeError(f"expected a shape of the family, found {shape!r} (it has "
                             f"{len(self.shapes)})")
        v = self.variants[self.shapes[shape]]
        return graph_with(v.template, v.ops(shape))

    def check(self, here: Mapping[str, str], source: str = "the saved family") -> None:
        """Refuse a family captured elsewhere: the first entry of the environment that differs
        from ``here`` (or that either lacks) is named."""
        for name in sorted(self.environment.keys() | here.keys()):
            saved, now = self.environment.get(name), here.get(name)
            if saved != now:
                raise GrapeError(f"{source}: expected {name} {saved!r} as it was captured with, "
                                 f"found {now!r} here: capture the family again")


class _Members(Mapping):
    def __init__(self, family: SavedFamily) -> None:
        self._family = family

    def __getitem__(self, shape: Hashable) -> tuple[str, dict[str, Op]]:
        key = self._family.shapes[shape]
        return key, self._family.variants[key].ops(shape)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._family.shapes)

    def __len__(self) -> int:
        return len(self._family.shapes)


def graph_with(template: KernelGraph, ops: Mapping[str, Op],
               buffers: Iterable[Buffer] = ()) -> KernelGraph:
    """``template`` with some nodes' operations replaced: same ids, edges and buffers (and
    ``buffers`` added, for the replacements to point into): ``KernelGraph.with_ops``."""
    return template.with_ops(ops, buffers)


def _shape_to_json(shape: Hashable) -> Any:
    if isinstance(shape, bool) or not isinstance(shape, int | str | tuple):
        raise GrapeError(f"expected shapes that are integers, strings or tuples of them to "
                         f"save, found {shape!r}")
    if isinstance(shape, tuple):
        return [_shape_to_json(s) for s in shape]
    return shape


def _shape_from_json(raw: Any, where: str) -> Hashable:
    if isinstance(raw, list):
        return tuple(_shape_from_json(r, where) for r in raw)
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise GrapeError(f"{where}: expected a shape (an integer, a string or a list), found "
                         f"{raw!r}")
    return raw


def save_family(path: str | Path, family: SavedFamily) -> Path:
    """Write ``family`` as JSON (gzipped when ``path`` ends in .gz), in version 2 (module
    docstring)."""
    executables = {}
    for key, v in family.variants.items():
        shapes = [s for s, k in family.shapes.items() if k == key]
        nodes = list(v.nodes)
        column = {node: i for i, node in enumerate(nodes)}
        versions = np.zeros((len(shapes), len(nodes)), dtype=np.int32)
        for row, shape in enumerate(shapes):
            for node, version in v.shapes[shape].items():
                versions[row, column[node]] = version
        rows, ops = {}, {}
        for node, nv in v.nodes.items():
            if nv.rows:
                rows[node] = _rows_to_json(nv)
            else:
                ops[node] = _ops_to_json([nv.op(version) for version in range(1, len(nv))])
        executables[key] = {"nodes": nodes, "versions": _b64(versions), "rows": rows,
                            "ops": ops}
        if v.alternates:
            alternated = list(v.alternates)
            chosen = np.array([[v.chosen.get(shape, {}).get(node, 0) for node in alternated]
                               for shape in shapes], dtype=np.int32).reshape(
                                   len(shapes), len(alternated))
            executables[key]["alternates"] = {node: _ops_to_json(kept)
                                              for node, kept in v.alternates.items()}
            executables[key]["chosen"] = {"nodes": alternated, "alternates": _b64(chosen)}
    return dump_json(path, {"schema": SCHEMA, "version": VERSION,
                            "environment": dict(family.environment),
                            "templates": {k: graph_to_json(v.template)
                                          for k, v in family.variants.items()},
                            "shapes": [[_shape_to_json(s), k] for s, k in family.shapes.items()],
                            "executables": executables, "scratch": sorted(family.scratch)})


def _ops_to_json(ops: list[Op]) -> dict[str, Any]:
    """Operations as nodes ``"1"``, ``"2"``, ... of an IR document without buffers (the
    template's table holds them)."""
    sub = KernelGraph()
    for i, op in enumerate(ops, 1):
        sub.add(str(i), op)
    doc = graph_to_json(sub)
    del doc["buffers"]
    return doc


def _ops_from_json(doc: Any, like: Op | None, what: str, where: str) -> list[Op]:
    """:func:`_ops_to_json`'s operations, each's unchanged fields taken from ``like``."""
    alike = {r["id"]: like for r in doc["nodes"]} if like is not None else None
    sub = graph_from_json({**doc, "buffers": []}, alike)
    count = len(sub.dag)
    if set(sub.dag) != {str(n) for n in range(1, count + 1)}:
        raise GrapeError(f"{where}: expected {what} numbered 1 to {count}, found "
                         f"{sorted(sub.dag)[:3]}")
    return [sub.op(str(n)) for n in range(1, count + 1)]


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def _array(raw: Any, dtype: str, shape: tuple[int, ...] | None, where: str) -> np.ndarray:
    """A :func:`_b64` array of ``shape`` (None: one dimension, as long as it is), its size
    checked."""
    try:
        data = base64.b64decode(raw, validate=True)
    except (TypeError, ValueError):
        raise GrapeError(f"{where}: expected base64 array bytes, found {str(raw)[:40]!r}") \
            from None
    size = np.dtype(dtype).itemsize
    shape = (len(data) // size,) if shape is None else shape
    want = int(np.prod(shape)) * size
    if len(data) != want:
        raise GrapeError(f"{where}: expected {want} bytes for a {dtype} array of shape "
                         f"{shape}, found {len(data)}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _rows_to_json(nv: NodeVersions) -> dict[str, Any]:
    """Kernel versions 1.. as arrays: the argument bytes only where some version differs from
    the template (most never do), the launch dimensions and pointer offsets whole."""
    args, dims, targets = nv.arrays()
    columns = np.flatnonzero((args[1:] != args[0]).any(axis=0)).astype(np.int32)
    return {"count": len(nv) - 1, "columns": _b64(columns), "values": _b64(args[1:, columns]),
            "dims": _b64(dims[1:]), "targets": _b64(targets[1:])}


def _rows_from_json(doc: Any, node: str, template: Op, where: str) -> NodeVersions:
    if not isinstance(template, Kernel):
        raise GrapeError(f"{where}: expected kernel versions of a kernel node, found node "
                         f"{node!r} a {template.kind}")
    count, width = doc["count"], len(template.args)
    if not isinstance(count, int) or count < 1:
        raise GrapeError(f"{where}: expected a positive version count, found {count!r}")
    columns = _array(doc["columns"], "<i4", None, where)
    if len(columns) and not (columns.min() >= 0 and columns.max() < width):
        raise GrapeError(f"{where}: expected argument columns below {width}, found "
                         f"{int(columns.max())}")
    args = np.repeat(np.frombuffer(template.args, dtype=np.uint8)[None], count + 1, axis=0)
    args[1:, columns] = _array(doc["values"], "u1", (count, len(columns)), where)
    dims = np.empty((count + 1, DIMS), dtype=np.int64)
    dims[0] = (*template.grid, *template.block, template.shared_mem)
    dims[1:] = _array(doc["dims"], "<i8", (count, DIMS), where)
    targets = np.empty((count + 1, len(template.pointers)), dtype=np.int64)
    targets[0] = [p.target.offset for p in template.pointers]
    targets[1:] = _array(doc["targets"], "<i8", (count, len(template.pointers)), where)
    return NodeVersions.of_rows(node, template, args, dims, targets)


def _alternates_v2(v: Variants, raw: dict, like: dict, shapes: list[Hashable],
                   at: str) -> None:
    """An executable's alternates (``grape.passes.variants``) and the one each shape runs:
    ``"alternates": {node: <operations 1..k>}`` and ``"chosen": {"nodes": [node, ...],
    "alternates": <int32 array, shapes x nodes, 0 the node itself>}``; absent, none."""
    if "alternates" not in raw:
        return
    for node, doc in raw["alternates"].items():
        if node not in v.template.dag:
            raise GrapeError(f"{at}: expected alternates of nodes of the template, found "
                             f"node {node!r}")
        v.alternates[node] = _ops_from_json(doc, like.get(node), f"node {node!r}'s alternates",
                                            at)
    nodes = raw["chosen"]["nodes"]
    chosen = _array(raw["chosen"]["alternates"], "<i4", (len(shapes), len(nodes)), at)
    counts = np.array([len(v.alternates.get(n, ())) for n in nodes], dtype=np.int64)
    if (chosen < 0).any() or (chosen > counts[None, :]).any():
        raise GrapeError(f"{at}: expected alternate numbers up to each node's count of "
                         f"alternates, found one outside")
    for shape, row in zip(shapes, chosen.tolist(), strict=True):
        if taken := {node: k for node, k in zip(nodes, row, strict=True) if k}:
            v.chosen[shape] = taken


def load_family(path: str | Path) -> SavedFamily:
    """Read a family file (version 1 or 2); errors name the file and what in it is wrong."""
    return family_from_json(load_json(path), path)


def family_from_json(doc: Any, path: str | Path) -> SavedFamily:
    """The family document ``doc`` (read from ``path``, which errors name)."""
    doc = check_schema(doc, SCHEMA, (1, VERSION), GrapeError, f"{path}: ")
    version = doc["version"]
    where = str(path)
    try:
        templates = {str(k): graph_from_json(g) for k, g in doc["templates"].items()}
        # Changed operations share most fields with their template's: taken from it.
        like = {k: decoded(doc["templates"][k], g) for k, g in templates.items()}
        read = _members_v1 if version == 1 else _executables_v2
        variants, shapes = read(doc, templates, like, where)
        environment = {str(k): str(v) for k, v in doc.get("environment", {}).items()}
        raw_scratch = doc.get("scratch", [])
        if not isinstance(raw_scratch, list) or not all(isinstance(x, str) for x in raw_scratch):
            raise GrapeError(f"{where}: expected scratch to be a list of buffer ids, found "
                             f"{str(raw_scratch)[:60]}")
        scratch = frozenset(raw_scratch)
        tables = {b.id: b for t in templates.values() for b in t.buffers.values()}
        for sid in sorted(scratch):
            b = tables.get(sid)
            if b is None or b.role != BufferRole.INTERNAL or b.memory != Memory.DEVICE:
                raise GrapeError(f"{where}: expected scratch to name internal device buffers "
                                 f"of the templates, found {sid!r}"
                                 f"{f' ({b.role}, {b.memory})' if b else ''}")
    except KeyError as e:
        raise GrapeError(f"{where}: expected a grape.family document, found one without "
                         f"{e}") from None
    except (TypeError, AttributeError, IndexError, ValueError) as e:
        raise GrapeError(f"{where}: expected a grape.family document, found a field of "
                         f"another form ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    except GrapeError as e:
        message = str(e)
        raise type(e)(message if message.startswith(where) else f"{where}: {message}") from None
    return SavedFamily(variants, shapes, environment, scratch)


def _members_v1(doc: dict, templates: dict[str, KernelGraph], like: dict, where: str
                ) -> tuple[dict[str, Variants], dict[Hashable, str]]:
    """Version 1: each member's changed operations in full."""
    variants = {key: Variants(t) for key, t in templates.items()}
    shapes: dict[Hashable, str] = {}
    for i, raw in enumerate(doc["members"]):
        shape = _shape_from_json(raw["shape"], f"{where}, member {i}")
        key = raw["template"]
        if key not in templates:
            raise GrapeError(f"{where}, member {i}: expected a template {key!r}, found none")
        changes = graph_from_json({**raw["changes"], "buffers": []}, like[key])
        unknown = [n for n in changes.dag if n not in templates[key].dag]
        if unknown:
            raise GrapeError(f"{where}, member {i}: expected changes to nodes of template "
                             f"{key!r}, found node {unknown[0]!r}")
        try:
            variants[key].add_changes(shape, dict(changes.ops()))
        except UnsupportedError as e:
            raise GrapeError(f"{where}, member {i}: {e}") from None
        shapes[shape] = key
    return variants, shapes


def _executables_v2(doc: dict, templates: dict[str, KernelGraph], like: dict, where: str
                    ) -> tuple[dict[str, Variants], dict[Hashable, str]]:
    """Version 2: each executable's node versions, and each shape's version numbers."""
    shapes: dict[Hashable, str] = {}
    for i, (raw, key) in enumerate(doc["shapes"]):
        if key not in templates:
            raise GrapeError(f"{where}, shape {i}: expected a template {key!r}, found none")
        shapes[_shape_from_json(raw, f"{where}, shape {i}")] = key
    variants = {}
    for key, template in templates.items():
        raw = doc["executables"].get(key, {"nodes": [], "versions": "", "rows": {}, "ops": {}})
        at = f"{where}, executable {key!r}"
        v = variants[key] = Variants(template, alternates="alternates" in raw)
        mine = [s for s, k in shapes.items() if k == key]
        _alternates_v2(v, raw, like[key], mine, at)
        nodes = raw["nodes"]
        if unknown := [n for n in nodes if n not in template.dag and not v.of(n)[1]]:
            raise GrapeError(f"{at}: expected changes to nodes of template {key!r}, found "
                             f"node {unknown[0]!r}")
        for node in nodes:
            if node in raw["rows"]:
                v.nodes[node] = _rows_from_json(raw["rows"][node], node, v.op(node),
                                                f"{at}, node {node!r}")
            elif node in raw["ops"]:
                # each version's unchanged fields taken from the template's node
                v.nodes[node] = NodeVersions.of_ops(node, [v.op(node), *_ops_from_json(
                    raw["ops"][node], like[key].get(v.of(node)[0]),
                    f"node {node!r}'s versions", at)])
            else:
                raise GrapeError(f"{at}: expected versions of node {node!r}, found none")
        versions = _array(raw["versions"], "<i4", (len(mine), len(nodes)), at)
        counts = np.array([len(v.nodes[n]) for n in nodes], dtype=np.int64)
        if (versions < 0).any() or (versions >= counts[None, :]).any():
            raise GrapeError(f"{at}: expected version numbers below each node's count of "
                             f"versions, found one outside")
        for shape, row in zip(mine, versions.tolist(), strict=True):
            v.shapes[shape] = {node: n for node, n in zip(nodes, row, strict=True) if n}
    return variants, shapes
