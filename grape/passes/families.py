"""Families of graphs: one per input shape, grouped so that a group shares one executable.

Graphs whose structure (node kinds and edges) is the same can share one instantiated executable:
``cuGraphExecUpdate`` and per-node set-params change kernel functions, launch dimensions and
arguments but not structure. :func:`group` puts shapes with the same structure together,
:func:`match` pairs each node of one graph with its counterpart in another.

Examples
--------
>>> from grape.ir import Empty, Kernel, KernelGraph
>>> def step(grid):
...     g = KernelGraph()
...     g.add("a", Kernel("f", "k", (grid, 1, 1), (32, 1, 1)))
...     g.add("b", Empty(), after=["a"])
...     return g
>>> groups = group({1: step(1), 2: step(2)})
>>> list(groups.values())
[[1, 2]]
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import networkx as nx

from grape.errors import GraphError
from grape.ir import Conditional, KernelGraph, fingerprint, node_hashes
from grape.passes.memo import recall

__all__ = ["canonical_order", "group", "match", "same_ids", "structure"]


def group(graphs: Mapping[Hashable, KernelGraph]) -> dict[str, list[Hashable]]:
    """Shapes by structure fingerprint, each group's shapes in the order given."""
    groups: dict[str, list[Hashable]] = {}
    for shape, graph in graphs.items():
        groups.setdefault(fingerprint(graph, launch=False), []).append(shape)
    return groups


def canonical_order(graph: KernelGraph, hashes: Mapping[str, str] | None = None) -> list[str]:
    """Nodes in an order that corresponds between graphs of one structure.

    A topological order whose ties go to the node's structural hash, then to its id (captures
    number nodes in the order they were recorded, so identical places get matching ids).
    ``hashes``: the graph's ``node_hashes(graph, launch=False)``, where already made.
    """
    hashes = hashes if hashes is not None else node_hashes(graph, launch=False)
    return list(nx.lexicographical_topological_sort(graph.dag, key=lambda n: (hashes[n], n)))


Structure = tuple[frozenset, frozenset]  # (node id, kind) pairs and (from, to, kind) edges


def structure(graph: KernelGraph) -> Structure | None:
    """``graph``'s nodes as (id, kind) and its edges as (from, to, kind), as sets: two graphs
    with equal structures are one topology under their own ids (:func:`same_ids`). None where
    the graph has a conditional node, whose bodies would need comparing too. Remembered
    (``grape.passes.memo``): a family's derivation compares each capture with several."""
    return recall("structure", (graph,), (), lambda: _structure(graph))


def _structure(graph: KernelGraph) -> Structure | None:
    nodes = []
    for node, op in graph.dag.nodes(data="op"):
        if isinstance(op, Conditional):
            return None
        nodes.append((node, op.kind))
    return frozenset(nodes), frozenset(graph.dag.edges(data="kind"))


def same_ids(template: KernelGraph, other: KernelGraph) -> bool:
    """Whether two graphs are one structure under their own node ids: the same ids, each of
    the same kind, joined by the same edges (no conditional nodes, whose bodies would need
    comparing too). Captures of one step number their nodes in the order they were recorded,
    so captures of one topology usually are; their :func:`match` is then every node to
    itself, which is what the canonical orders would give (identical labelled graphs hash
    alike, node by node, and ties go to the id), found without hashing."""
    if len(template.dag) != len(other.dag):
        return False
    mine = structure(template)
    return mine is not None and mine == structure(other)


def match(template: KernelGraph, other: KernelGraph) -> dict[str, str]:
    """Each node of ``template`` and the node of ``other`` in its place (a new dict each call;
    remembered within ``grape.passes.memo.remembering``: on an H100's Llama-shaped family,
    296 structure checks of 1,086-node graphs took 1.9 s of a profile's 35 s).

    Raises
    ------
    GraphError
        The two graphs differ in structure (a node's kind, or an edge), so no executable of one
        can be brought to the other by updating parameters.
    """
    answer = recall("match", (template, other), (), lambda: _answer(template, other))
    if isinstance(answer, str):
        raise GraphError(answer)
    return dict(answer)


def _answer(template: KernelGraph, other: KernelGraph) -> dict[str, str] | str:
    """:func:`_match`'s pairs, or its error's message (remembered as well)."""
    try:
        return _match(template, other)
    except GraphError as e:
        return str(e)


def _match(template: KernelGraph, other: KernelGraph) -> dict[str, str]:
    if same_ids(template, other):
        return {node: node for node in template.dag}
    # Each graph's structural hashes once: the fingerprint and the order are both made of them
    # (computing them twice was half of a family shape's placement on the host).
    mine, theirs = node_hashes(template, launch=False), node_hashes(other, launch=False)
    if fingerprint(template, launch=False, hashes=mine) != fingerprint(other, launch=False,
                                                                       hashes=theirs):
        kinds = sorted((op.kind for _, op in template.ops()))
        other_kinds = sorted((op.kind for _, op in other.ops()))
        what = ("node kinds" if kinds != other_kinds else "dependencies")
        raise GraphError(f"expected graphs of one structure, found different {what} "
                         f"({len(template)} and {len(other)} nodes, "
                         f"{template.dag.number_of_edges()} and {other.dag.number_of_edges()} "
                         f"edges)")
    pairs = dict(zip(canonical_order(template, mine), canonical_order(other, theirs),
                     strict=True))
    # certain, not just likely: the mapping keeps every edge, and its kind
    for u, v, kind in template.dag.edges(data="kind"):
        if not other.dag.has_edge(pairs[u], pairs[v]):
            raise GraphError(f"expected node {u!r} -> {v!r} to map onto an edge, found "
                             f"{pairs[u]!r} -> {pairs[v]!r} unconnected")
        if other.dag.edges[pairs[u], pairs[v]].get("kind") != kind:
            raise GraphError(f"expected node {u!r} -> {v!r} to map onto an edge of kind "
                             f"{kind or 'full'}, found "
                             f"{other.dag.edges[pairs[u], pairs[v]].get('kind') or 'full'}")
    return pairs
