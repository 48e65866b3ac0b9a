"""The kernel-graph IR's JSON form: every field spelled out, argument bytes in hex.

A document is ``{"schema": "grape.ir", "version": 1, "buffers": [...], "nodes": [...],
"edges": [[u, v], ...]}`` (``[u, v, kind]`` for an edge weaker than a full dependency,
``grape.ir.EDGE_KINDS``); each node is its operation's fields plus ``id`` and ``kind``, and a
conditional node's bodies are nested ``{"nodes", "edges"}`` objects. Decoding checks the shape of
every field and says which node and field is wrong.
"""

from __future__ import annotations

import functools
from dataclasses import fields
from enum import Enum
from typing import Any

from grape.errors import GraphError, UnknownNodeKindError
from grape.ir import (
    EDGE_KINDS,
    OP_TYPES,
    SCHEMA,
    SCHEMA_VERSION,
    Buffer,
    BufferRole,
    Conditional,
    ConditionalKind,
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
from grape.jsonio import check_schema

__all__ = ["decoded", "graph_from_json", "graph_to_json"]


def graph_to_json(graph: KernelGraph) -> dict[str, Any]:
    doc = {"schema": SCHEMA, "version": SCHEMA_VERSION,
           "buffers": [_encode(b) for b in graph.buffers.values()]}
    doc.update(_encode_body(graph))
    return doc


# A node decoded before, as (its JSON, its operation): a field of a new node whose JSON equals
# the old node's is taken from the old operation instead of decoded again.
Decoded = dict[str, tuple[dict[str, Any], Any]]
_REUSED = (Kernel, Memcpy, Memset)  # operations whose fields are immutable all the way down
_ABSENT = object()


def decoded(doc: Any, graph: KernelGraph) -> Decoded:
    """``graph``'s kernels, copies and memsets with their JSON in ``doc`` (``graph`` decoded
    from it), for :func:`graph_from_json`'s ``like``."""
    return {raw["id"]: (raw, graph.op(raw["id"])) for raw in doc["nodes"]
            if type(graph.op(raw["id"])) in _REUSED}


def graph_from_json(doc: Any, like: Decoded | None = None) -> KernelGraph:
    """The graph ``doc`` holds. ``like`` (:func:`decoded`): nodes of another graph whose
    fields this one's nodes of the same id and kind share, which are then not decoded again
    (a family's members' changes against their template: 1.4-1.6 s instead of 2.4 to read
    255 GPT-2 lengths on a 2-core CPU, ``benchmarks/family_read_cost.py``); their JSON was
    checked when that graph was decoded."""
    check_schema(doc, SCHEMA, SCHEMA_VERSION, GraphError)
    graph = _decode_body(doc, "", like or {})
    for i, raw in enumerate(_field(doc, "buffers", list, "")):
        graph.add_buffer(_decode(Buffer, raw, f"buffer {i}"))
    return graph


_NESTED = ("src", "dst", "target")  # fields that hold a Span


def _encode(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, KernelGraph):
        return _encode_body(value)
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _encode(getattr(value, f.name)) for f in fields(value)}
    return value


def _encode_body(graph: KernelGraph) -> dict[str, Any]:
    nodes = [{"id": n, "kind": op.kind, **_encode(op)} if op is not None else {"id": n}
             for n, op in graph.ops()]
    return {"nodes": nodes, "edges": [[u, v] if k is None else [u, v, k]
                                      for u, v, k in graph.dag.edges(data="kind")]}


def _decode_body(doc: Any, where: str, like: Decoded | None = None) -> KernelGraph:
    if not isinstance(doc, dict):
        raise GraphError(f"{where}expected an object with nodes and edges, found {doc!r:.80}")
    graph = KernelGraph()
    for i, raw in enumerate(_field(doc, "nodes", list, where)):
        at = f"{where}node {i}"
        if not isinstance(raw, dict) or not isinstance(raw.get("id"), str):
            raise GraphError(f"{at}: expected an object with a string 'id', found {raw!r:.80}")
        at = f"{where}node {raw['id']!r}"
        kind = raw.get("kind")
        op_type = OP_TYPES.get(kind) if isinstance(kind, str) else None
        if op_type is None:
            raise UnknownNodeKindError(f"{at}: expected a kind among {', '.join(OP_TYPES)}, "
                                       f"found {raw.get('kind')!r}")
        body = {k: v for k, v in raw.items() if k not in ("id", "kind")}
        seen = like.get(raw["id"]) if like else None
        if seen is not None and type(seen[1]) is not op_type:
            seen = None
        graph.add(raw["id"], _decode(op_type, body, at, seen))
    for edge in _field(doc, "edges", list, where):
        if (not isinstance(edge, list) or len(edge) not in (2, 3)
                or any(n not in graph.dag for n in edge[:2])):
            raise GraphError(f"{where}expected edges between listed nodes, found {edge!r:.80}")
        if len(edge) == 3 and edge[2] not in EDGE_KINDS:
            raise GraphError(f"{where}edge {edge[0]!r} -> {edge[1]!r}: expected a kind among "
                             f"{', '.join(EDGE_KINDS)}, found {edge[2]!r:.40}")
        graph.add_edge(*edge)
    return graph


def _field(doc: dict, name: str, kind: type, where: str) -> Any:
    value = doc.get(name)
    if not isinstance(value, kind):
        raise GraphError(f"{where}expected a {kind.__name__} field {name!r}, found {value!r:.80}")
    return value


def _decode(cls: type, raw: Any, at: str, seen: tuple[dict[str, Any], Any] | None = None
            ) -> Any:
    """Build dataclass ``cls`` from its JSON form, checking every field's shape; ``seen``: an
    operation of the same class decoded before, with its JSON, whose equal fields are taken."""
    if not isinstance(raw, dict):
        raise GraphError(f"{at}: expected an object, found {raw!r:.80}")
    names = _names(cls)
    if unknown := set(raw) - names:
        raise GraphError(f"{at}: expected fields among {sorted(names)}, found {sorted(unknown)}")
    values = {}
    for name, value in raw.items():
        if seen is not None:
            old = seen[0].get(name, _ABSENT)
            if old == value:
                values[name] = getattr(seen[1], name)
                continue
            if name == "pointers" and type(old) is list and type(value) is list:
                # Most pointers of a member's kernel are its template's: take those.
                mine = getattr(seen[1], name)
                values[name] = tuple(
                    mine[i] if i < len(old) and old[i] == p else _pointer(p, at)
                    for i, p in enumerate(value))
                continue
        try:
            values[name] = _decode_field(cls, name, value, at)
        except (TypeError, ValueError, KeyError) as e:
            raise GraphError(f"{at}: expected a valid {name!r}, found {value!r:.80} "
                             f"({e})") from None
    try:
        return cls(**values)
    except TypeError as e:
        raise GraphError(f"{at}: expected all fields of {cls.__name__}, found {e}") from None


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise TypeError("a list of integers")
    return tuple(value)


def _int(value: Any) -> int:
    if type(value) is not int:
        raise TypeError("an integer")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("a string")
    return value


# The forms nearly every Param, Pointer and Span takes, checked and built directly: a saved
# family holds hundreds of thousands of them. Anything else goes through _decode, whose errors
# say what is wrong.
def _span(raw: Any, at: str) -> Span:
    if (type(raw) is dict and len(raw) == 2 and type(raw.get("buffer")) is str
            and type(raw.get("offset")) is int):
        return Span(raw["buffer"], raw["offset"])
    return _decode(Span, raw, at)


def _param(raw: Any, at: str) -> Param:
    if (type(raw) is dict and len(raw) == 2 and type(raw.get("offset")) is int
            and type(raw.get("size")) is int):
        return Param(raw["offset"], raw["size"])
    return _decode(Param, raw, at)


def _pointer(raw: Any, at: str) -> Pointer:
    if type(raw) is dict and len(raw) == 2 and type(raw.get("offset")) is int \
            and "target" in raw:
        return Pointer(raw["offset"], _span(raw["target"], at))
    return _decode(Pointer, raw, at)


def _decode_field(cls: type, name: str, value: Any, at: str) -> Any:
    if name in _NESTED:
        return _span(value, at)
    if cls is Kernel:
        if name in ("grid", "block"):
            return _ints(value)
        if name == "args":
            return bytes.fromhex(_str(value))
        if name == "params":
            return tuple(_param(p, at) for p in value)
        if name == "pointers":
            return tuple(_pointer(p, at) for p in value)
        if name == "handles":
            return tuple(_decode(HandleRef, h, at) for h in value)
        if name == "attributes":
            return tuple((_str(k), _int(v) if not isinstance(v, list) else _ints(v))
                         for k, v in value)
    if cls is Buffer and name in ("role", "memory"):
        return BufferRole(value) if name == "role" else Memory(value)
    if cls is Conditional:
        if name == "type":
            return ConditionalKind(value)
        if name == "bodies":
            return tuple(_decode_body(b, f"{at} body {i}: ") for i, b in enumerate(value))
        if name == "default":
            return None if value is None else _int(value)
    if name == "address":
        return None if value is None else _int(value)
    return _str(value) if _annotations(cls)[name] == "str" else _int(value)


# Looked up once per class: a saved family's file decodes hundreds of thousands of fields.
@functools.cache
def _names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


@functools.cache
def _annotations(cls: type) -> dict[str, Any]:
    return {f.name: f.type for f in fields(cls)}

