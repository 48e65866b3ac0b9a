"""Families, deltas and their coding: passes over the IR, with no GPU."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grape.errors import GrapeError, GraphError, UnsupportedError
from grape.ir import Buffer, BufferRole, Empty, Kernel, KernelGraph, Memcpy, Span
from grape.passes.compress import CODECS, best, decode, encode, xor
from grape.passes.delta import (
    apply,
    changed_nodes,
    delta,
    identity,
    join,
    transition,
)
from grape.passes.families import canonical_order, group, match, same_ids
from tests.strategies import graphs

sparse = st.lists(st.one_of(st.just(0), st.just(0), st.just(0), st.integers(0, 255)),
                  max_size=600).map(bytes)


@given(sparse, st.sampled_from(sorted(CODECS)))
def test_codecs_round_trip(data, codec):
    assert decode(encode(data, codec), codec, len(data)) == data


@given(sparse)
def test_best_is_the_smallest_and_zero_coding_size_is_exact(data):
    name, blob = best(data)
    assert len(blob) == min(len(encode(data, c)) for c in CODECS)
    assert decode(blob, name, len(data)) == data
    assert len(encode(data, "zero")) == (len(data) + 7) // 8 + sum(1 for b in data if b)


def _rle_reference(data: bytes) -> bytes:
    """The run-length coding, byte by byte: what the fast one must produce exactly."""
    def varint(n):
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n >> 7 else 0))
            n >>= 7
            if not n:
                return bytes(out)
    out, i, n = bytearray(), 0, len(data)
    while i < n:
        j = i
        while j < n and data[j] == 0:
            j += 1
        k = j
        while k < n and data[k] != 0:
            k += 1
        out += varint(j - i) + varint(k - j) + data[j:k]
        i = k
    return bytes(out)


@given(sparse | st.binary(max_size=40_000))
def test_run_length_coding_is_the_reference_coding(data):
    assert encode(data, "rle") == _rle_reference(data)


@given(st.binary(max_size=64), st.data())
def test_xor_is_bytewise(a, data):
    b = data.draw(st.binary(min_size=len(a), max_size=len(a)))
    assert xor(a, b) == bytes(x ^ y for x, y in zip(a, b, strict=True))


def test_bad_codings_are_refused():
    with pytest.raises(GrapeError, match="expected a codec among"):
        encode(b"x", "lz77")
    with pytest.raises(GrapeError, match="expected 3 bytes from a run-length coded delta"):
        decode(encode(b"\x00\x01", "rle"), "rle", 3)
    with pytest.raises(GrapeError, match="expected argument blocks of one length"):
        xor(b"ab", b"a")


def _mutated(g: KernelGraph, data) -> KernelGraph:
    """``g`` with some kernels' grids, functions and argument bytes changed, same ids."""
    h = KernelGraph.from_json(g.to_json())
    for node, k in list(h.kernels()):
        change = data.draw(st.sampled_from(["none", "grid", "args", "function"]))
        if change == "grid":
            k = dataclasses.replace(k, grid=(k.grid[0] % 1000 + 1, *k.grid[1:]))
        elif change == "args" and k.args:
            i = data.draw(st.integers(0, len(k.args) - 1))
            k = dataclasses.replace(k, args=k.args[:i] + bytes([k.args[i] ^ 0x5A]) +
                                    k.args[i + 1:])
        elif change == "function":
            k = dataclasses.replace(k, function=k.function + "'", name=k.name + "'")
        h.dag.nodes[node]["op"] = k
    return h


@given(graphs(), st.data())
def test_applying_a_delta_gives_back_the_shape(g, data):
    h = _mutated(g, data)
    assert group({"g": g, "h": h}) == {next(iter(group({"g": g}))): ["g", "h"]}
    d = delta(g, h)
    pairs = dict(d.mapping)
    ops = apply(g, d)
    assert all(ops[n] == h.op(pairs[n]) for n in g.dag)
    changed = {n for n in g.dag if g.op(n) != h.op(pairs[n])}
    assert {nd.node for nd in d.nodes} == changed
    assert changed_nodes(g, delta(g, g), d) == [n for n in ops if n in changed]
    assert identity(g) == delta(g, g)  # the shortcut for a new executable's own shape


@given(graphs())
def test_matching_survives_relabelling(g):
    h = KernelGraph()
    for b in g.buffers.values():
        h.add_buffer(b)
    for n in g.dag:
        h.dag.add_node(f"N-{n}", op=g.op(n))
    h.dag.add_edges_from((f"N-{u}", f"N-{v}", d) for u, v, d in g.dag.edges(data=True))
    pairs = match(g, h)
    assert sorted(pairs) == sorted(g.dag) and sorted(pairs.values()) == sorted(h.dag)
    # The prefix keeps the ids' order, so even nodes tied by position pair with their copies.
    assert all(h.op(pairs[n]) == g.op(n) for n in g.dag)
    assert len(canonical_order(g)) == len(g)


@given(graphs(), st.data())
def test_graphs_of_one_structure_under_the_same_ids_match_node_to_node_as_hashing_would(g, data):
    h = _mutated(g, data)
    assert same_ids(g, h) == (not any(op.kind == "conditional" for _, op in g.ops()))
    # what the canonical orders give, without the shortcut: each node to itself
    assert dict(zip(canonical_order(g), canonical_order(h), strict=True)) == {n: n for n in g.dag}
    assert match(g, h) == {n: n for n in g.dag}
    if g.dag.number_of_edges():  # an edge of another kind, or one less: no longer one
        u, v, kind = next(iter(g.dag.edges(data="kind")))  # structure under these ids
        h.dag.edges[u, v]["kind"] = "launch_order" if kind == "programmatic" else "programmatic"
        assert not same_ids(g, h)
        h.dag.remove_edge(u, v)
        assert not same_ids(g, h)
    renamed = KernelGraph()
    for n in g.dag:
        renamed.dag.add_node(f"N-{n}", op=g.op(n))
    assert len(g) == 0 or not same_ids(g, renamed)


def _decode_step(kv: int) -> KernelGraph:
    """A toy decode step: the attention kernel's grid and a length argument follow kv."""
    g = KernelGraph()
    g.add("embed", Kernel("f_embed", "embed", (1, 1, 1), (128, 1, 1), args=bytes(8)))
    g.add("attn", Kernel("f_attn", "attn", (kv // 64 + 1, 1, 1), (128, 1, 1),
                         args=kv.to_bytes(8, "little") + bytes(24)), after=["embed"])
    g.add("mlp", Kernel("f_mlp", "mlp", (12, 1, 1), (256, 1, 1), args=bytes(16)),
          after=["attn"])
    return g


def test_consecutive_lengths_touch_few_nodes_and_code_small():
    template = _decode_step(100)
    deltas = {kv: delta(template, _decode_step(kv)) for kv in (100, 101, 130)}
    assert deltas[100].nodes == ()
    assert changed_nodes(template, deltas[100], deltas[101]) == ["attn"]
    (nd,) = deltas[101].nodes
    assert nd.kernel.fields == () and nd.kernel.args_length == 32
    assert len(nd.kernel.args) <= 5  # one changed byte of 32, coded
    grid_change = dict(deltas[130].nodes[0].kernel.fields)
    assert grid_change == {"grid": (3, 1, 1)}


def test_a_shape_known_by_its_changes_takes_the_versions_its_whole_graph_does():
    # A saved family's member: its changed operations, under the template's node ids.
    from grape.passes.variants import Variants

    template, other = _decode_step(100), _decode_step(130)
    whole, known = Variants(_decode_step(100)), Variants(template)
    whole.add_graph(130, other)
    known.add_changes(130, {"attn": other.op("attn"), "mlp": other.op("mlp")})
    assert known.ops(130) == whole.ops(130) == {"attn": other.op("attn")}  # mlp: unchanged
    with pytest.raises(UnsupportedError, match="found 'nowhere'"):
        known.add_changes(131, {"nowhere": other.op("attn")})
    wider = dataclasses.replace(other.op("attn"), attributes=(("cluster", (2, 1, 1)),))
    with pytest.raises(UnsupportedError, match="attributes change"):
        known.add_changes(131, {"attn": wider})
    assert 131 not in known.shapes


def test_a_change_of_structure_or_kind_is_refused():
    a = _decode_step(100)
    b = _decode_step(100)
    b.dag.remove_edge("attn", "mlp")
    with pytest.raises(GraphError, match="expected graphs of one structure, found different "
                                         "dependencies"):
        delta(a, b)
    c = KernelGraph()
    c.add("x", Empty())
    d = KernelGraph()
    d.add_buffer(Buffer("b", 64, BufferRole.INTERNAL))
    d.add("x", Memcpy(Span("b"), Span("b"), 8))
    with pytest.raises(GraphError, match="found different node kinds"):
        delta(c, d)


@settings(max_examples=40)
@given(st.lists(st.integers(1, 400), min_size=2, max_size=6))
def test_transition_agrees_with_applying_every_node(lengths):
    template = _decode_step(max(lengths))
    deltas = [delta(template, _decode_step(kv)) for kv in lengths]
    for a, b in itertools.pairwise(deltas):
        ops = transition(template, a, b)
        assert sorted(ops) == sorted(changed_nodes(template, a, b))
        assert all(ops[n] == apply(template, b)[n] for n in ops)


def _with_copy(kv: int, buffers: dict[str, tuple[int, int]]) -> KernelGraph:
    """A decode step whose output is copied out of buffer "kv" into "out"."""
    g = _decode_step(kv)
    for name, (size, address) in buffers.items():
        g.add_buffer(Buffer(name, size, BufferRole.INTERNAL, address=address))
    g.add("copy", Memcpy(Span("out"), Span("kv", 8 * kv), 8), after=["mlp"])
    return g


def test_joining_takes_the_members_buffers_and_refuses_what_cannot_change_in_place():
    template = _with_copy(100, {"kv": (1024, 0x1000), "out": (64, 0x9000)})
    member = _with_copy(101, {"kv": (4096, 0x1000), "out": (64, 0x9000),
                              "s1/input0": (8, 0x7000)})
    d = join(template, member)
    assert sorted(nd.node for nd in d.nodes) == ["attn", "copy"]
    # The table takes the member's new buffer, and the larger extent of a shared block.
    assert template.buffers["s1/input0"].address == 0x7000
    assert template.buffers["kv"].size == 4096

    moved = _with_copy(101, {"kv": (1024, 0x2000), "out": (64, 0x9000)})
    before = dict(template.buffers)
    with pytest.raises(UnsupportedError, match="expected buffer 'kv' at one address in both "
                                               "graphs, found it at 4096 and 8192"):
        join(template, moved)
    assert template.buffers == before  # a refusal leaves the template as it was

    attributed = _with_copy(100, {"kv": (1024, 0x1000), "out": (64, 0x9000)})
    attn = attributed.op("attn")
    attributed.dag.nodes["attn"]["op"] = dataclasses.replace(
        attn, attributes=(("cluster_dim", (2, 1, 1)),))
    with pytest.raises(UnsupportedError, match="attributes change"):
        join(template, attributed)
    other = _with_copy(100, {"kv": (1024, 0x1000), "out": (64, 0x9000)})
    other.dag.remove_edge("mlp", "copy")
    with pytest.raises(UnsupportedError, match="expected graphs of one structure"):
        join(template, other)
