"""Graph families on disk: each executable's template graph, each shape's changes to it, and
the environment the family was captured in.

A document is ``{"schema": "grape.family", "version": 1, "environment": {...}, "templates":
{key: <grape.ir document>}, "members": [{"shape": ..., "template": key, "changes": <grape.ir
document holding only the nodes that differ, under the template's ids>}, ...], "scratch": [buffer
id, ...]}``. A shape is an integer, a string or a list of them (a tuple in Python). The
template's buffer table holds every member's buffers (a family's executable resolves addresses
through it). ``scratch`` (optional; none where absent) names the buffers only the family's
graphs use (their pool's memory, which held no tensor when the family was saved): a warm start
moves each whole to memory of its own rather than to where a capture here put its blocks
(``grape.passes.relocate``).

:meth:`SavedFamily.check` refuses, naming the first difference, a family whose environment
(driver, GPU, library versions, the model's parameter layout) differs from the one asked about:
a family's graphs point at that process's kernels and memory. ``grape simulate`` runs a saved
family over a sequence of shapes; loading one into a new process without capturing is issue
15's warm start, which this format is the first half of.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx

from grape.errors import GrapeError
from grape.ir import Buffer, BufferRole, KernelGraph, Memory, Op
from grape.irjson import decoded, graph_from_json, graph_to_json
from grape.jsonio import check_schema, dump_json, load_json
from grape.passes.delta import ShapeDelta, apply

__all__ = ["SCHEMA", "SavedFamily", "family_from_json", "graph_with", "load_family", "save_family"]

SCHEMA = "grape.family"
VERSION = 1


@dataclass
class SavedFamily:
    templates: dict[str, KernelGraph]  # by executable key
    members: dict[Hashable, tuple[str, dict[str, Op]]]  # shape -> (key, changed template ops)
    environment: dict[str, str] = field(default_factory=dict)
    scratch: frozenset[str] = frozenset()  # buffers only the graphs use (module docstring)

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
        return cls(dict(templates), members, dict(environment or {}), frozenset(scratch))

    def scratch_buffers(self) -> dict[str, Buffer]:
        """The scratch buffers, as the templates' tables have them."""
        found = {}
        for template in self.templates.values():
            found.update((b.id, b) for b in template.buffers.values() if b.id in self.scratch)
        return found

    def graph(self, shape: Hashable) -> KernelGraph:
        """``shape``'s own graph: its template with the shape's changes, under the template's
        node ids."""
        if shape not in self.members:
            raise GrapeError(f"expected a shape of the family, found {shape!r} (it has "
                             f"{len(self.members)})")
        key, changes = self.members[shape]
        return graph_with(self.templates[key], changes)

    def check(self, here: Mapping[str, str], source: str = "the saved family") -> None:
        """Refuse a family captured elsewhere: the first entry of the environment that differs
        from ``here`` (or that either lacks) is named."""
        for name in sorted(self.environment.keys() | here.keys()):
            saved, now = self.environment.get(name), here.get(name)
            if saved != now:
                raise GrapeError(f"{source}: expected {name} {saved!r} as it was captured with, "
                                 f"found {now!r} here: capture the family again")


def graph_with(template: KernelGraph, ops: Mapping[str, Op],
               buffers: Iterable[Buffer] = ()) -> KernelGraph:
    """``template`` with some nodes' operations replaced: same ids, edges and buffers (and
    ``buffers`` added, for the replacements to point into)."""
    out = KernelGraph()
    for b in template.buffers.values():
        out.add_buffer(b)
    for b in buffers:
        if b.id not in out.buffers:
            out.add_buffer(b)
    for node in nx.topological_sort(template.dag):
        out.add(node, ops.get(node, template.op(node)),
                after=list(template.dag.predecessors(node)))
    return out


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
    """Write ``family`` as JSON (gzipped when ``path`` ends in .gz)."""
    members = []
    for shape, (key, changes) in family.members.items():
        if key not in family.templates:
            raise GrapeError(f"expected shape {shape!r}'s executable {key!r} among the "
                             f"templates, found none")
        sub = KernelGraph()
        for node, op in changes.items():
            sub.add(node, op)
        doc = graph_to_json(sub)
        del doc["buffers"]  # the template's table holds them
        members.append({"shape": _shape_to_json(shape), "template": key, "changes": doc})
    return dump_json(path, {"schema": SCHEMA, "version": VERSION,
                            "environment": dict(family.environment),
                            "templates": {k: graph_to_json(g)
                                          for k, g in family.templates.items()},
                            "members": members, "scratch": sorted(family.scratch)})


def load_family(path: str | Path) -> SavedFamily:
    """Read a family file; errors name the file and what in it is wrong."""
    return family_from_json(load_json(path), path)


def family_from_json(doc: Any, path: str | Path) -> SavedFamily:
    """The family document ``doc`` (read from ``path``, which errors name)."""
    doc = check_schema(doc, SCHEMA, VERSION, GrapeError, f"{path}: ")
    where = str(path)
    try:
        templates = {str(k): graph_from_json(g) for k, g in doc["templates"].items()}
        # Members' changed operations share most fields with their template's: taken from it.
        like = {k: decoded(doc["templates"][k], g) for k, g in templates.items()}
        members: dict[Hashable, tuple[str, dict[str, Op]]] = {}
        for i, raw in enumerate(doc["members"]):
            shape = _shape_from_json(raw["shape"], f"{where}, member {i}")
            key = raw["template"]
            if key not in templates:
                raise GrapeError(f"{where}, member {i}: expected a template {key!r}, found "
                                 f"none")
            changes = graph_from_json({**raw["changes"], "buffers": []}, like[key])
            unknown = [n for n in changes.dag if n not in templates[key].dag]
            if unknown:
                raise GrapeError(f"{where}, member {i}: expected changes to nodes of template "
                                 f"{key!r}, found node {unknown[0]!r}")
            members[shape] = (key, dict(changes.ops()))
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
    except (KeyError, TypeError, AttributeError) as e:
        raise GrapeError(f"{where}: expected a grape.family document, found one without "
                         f"{e}") from None
    except GrapeError as e:
        message = str(e)
        raise type(e)(message if message.startswith(where) else f"{where}: {message}") from None
    return SavedFamily(templates, members, environment, scratch)
