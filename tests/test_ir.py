from __future__ import annotations

import dataclasses
import json
import random

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from grape.errors import (
    DanglingBufferError,
    GraphCycleError,
    GraphError,
    LaunchConfigError,
    SchemaVersionError,
    UnknownNodeKindError,
)
from grape.ir import (
    Buffer,
    BufferRole,
    Conditional,
    ConditionalKind,
    Empty,
    HandleRef,
    Kernel,
    KernelGraph,
    Memcpy,
    Param,
    Pointer,
    Span,
    fingerprint,
)
from tests.strategies import graphs


def _kernel(function="f", name="k", grid=(1, 1, 1), block=(32, 1, 1), **kw) -> Kernel:
    return Kernel(function=function, name=name, grid=grid, block=block, **kw)


def _relabelled(g: KernelGraph, seed: int) -> KernelGraph:
    """The same graph with fresh node ids, inserted in another order."""
    rng = random.Random(seed)
    nodes = list(g.dag.nodes)
    fresh = dict(zip(nodes, rng.sample([f"N-{i}" for i in range(len(nodes) * 3)], len(nodes)),
                     strict=True))
    rng.shuffle(nodes)
    h = KernelGraph()
    for b in g.buffers.values():
        h.add_buffer(b)
    for n in nodes:
        h.dag.add_node(fresh[n], op=g.op(n))
    edges = list(g.dag.edges(data=True))
    rng.shuffle(edges)
    h.dag.add_edges_from((fresh[u], fresh[v], d) for u, v, d in edges)
    return h


# --- properties over generated graphs -----------------------------------------------------------


@given(graphs())
def test_generated_graphs_are_valid(g):
    g.validate()


@given(graphs())
def test_json_round_trip_is_lossless(g):
    text = json.dumps(g.to_json())
    back = KernelGraph.from_json(json.loads(text))
    assert back == g
    assert json.dumps(back.to_json()) == text
    assert back.fingerprint() == g.fingerprint()


@given(graphs(), graphs())
def test_decoding_like_another_graph_gives_what_decoding_alone_gives(g, h):
    # A family's members decode against their template: fields equal to its are taken.
    from grape.irjson import decoded, graph_from_json

    like = decoded(g.to_json(), g)
    doc = json.loads(json.dumps(h.to_json()))
    assert graph_from_json(doc, like) == graph_from_json(doc) == h
    mine = graph_from_json(json.loads(json.dumps(g.to_json())), like)
    assert mine == g
    for node, op in mine.ops():  # every field of an equal node is the template's own object
        if node in like:
            assert all(getattr(op, f.name) is getattr(like[node][1], f.name)
                       for f in dataclasses.fields(op))


def test_a_member_kernel_takes_the_pointers_its_template_has_and_decodes_the_others():
    from grape.irjson import decoded, graph_from_json

    g = KernelGraph()
    g.add_buffer(Buffer("a", 64, BufferRole.INTERNAL, address=0x1000))
    pointers = (Pointer(0, Span("a", 0)), Pointer(8, Span("a", 16)))
    g.add("k", Kernel("f@0x1", "f", (1, 1, 1), (32, 1, 1), args=bytes(16),
                      params=(Param(0, 8), Param(8, 8)), pointers=pointers))
    doc = g.to_json()
    member = json.loads(json.dumps(doc))
    member["nodes"][0]["pointers"][1]["target"]["offset"] = 32
    got = graph_from_json(member, decoded(doc, g)).op("k").pointers
    assert got == (pointers[0], Pointer(8, Span("a", 32)))
    assert got[0] is pointers[0] and got == graph_from_json(member).op("k").pointers


def test_a_field_decoded_like_another_graph_is_still_checked_where_it_differs():
    from grape.irjson import decoded, graph_from_json

    g = KernelGraph()
    g.add("k", Kernel("f@0x1", "f", (1, 1, 1), (32, 1, 1), args=bytes(8),
                      params=(Param(0, 8),)))
    doc = g.to_json()
    bad = json.loads(json.dumps(doc))
    bad["nodes"][0]["grid"] = [1, "two", 1]
    with pytest.raises(GraphError, match="grid"):
        graph_from_json(bad, decoded(doc, g))


@given(graphs(), st.integers(0, 2**32))
def test_fingerprint_ignores_node_ids_and_order(g, seed):
    h = _relabelled(g, seed)
    assert h != g or len(g) == 0
    assert h.fingerprint() == g.fingerprint()
    assert h.fingerprint(launch=False) == g.fingerprint(launch=False)


@given(graphs(), st.data())
def test_one_grid_change_changes_the_fingerprint(g, data):
    kernels = [n for n, _ in g.kernels()]
    assume(kernels)
    node = data.draw(st.sampled_from(kernels))
    k = g.op(node)
    grid = (k.grid[0] + 1 if k.grid[0] < 2**31 - 1 else k.grid[0] - 1, *k.grid[1:])
    h = KernelGraph.from_json(g.to_json())
    h.dag.nodes[node]["op"] = dataclasses.replace(k, grid=grid)
    assert h.fingerprint() != g.fingerprint()
    # Kinds and edges alone (what cuGraphExecUpdate needs) do not see launch dimensions.
    assert h.fingerprint(launch=False) == g.fingerprint(launch=False)


@given(graphs(), st.data())
def test_argument_bytes_and_names_do_not_count(g, data):
    kernels = [n for n, _ in g.kernels()]
    assume(kernels)
    node = data.draw(st.sampled_from(kernels))
    k = g.op(node)
    h = KernelGraph.from_json(g.to_json())
    h.dag.nodes[node]["op"] = dataclasses.replace(
        k, name=k.name + "_renamed", args=bytes(b ^ 0xFF for b in k.args))
    assert h.fingerprint() == g.fingerprint()


@given(graphs(), st.data())
def test_another_function_changes_the_fingerprint(g, data):
    kernels = [n for n, _ in g.kernels()]
    assume(kernels)
    node = data.draw(st.sampled_from(kernels))
    h = KernelGraph.from_json(g.to_json())
    h.dag.nodes[node]["op"] = dataclasses.replace(g.op(node), function=g.op(node).function + "'")
    assert h.fingerprint() != g.fingerprint()


@given(graphs(), st.data())
def test_an_added_edge_changes_the_fingerprint(g, data):
    import networkx as nx

    pairs = [(u, v) for u in g.dag for v in g.dag
             if u != v and not g.dag.has_edge(u, v) and not nx.has_path(g.dag, v, u)]
    assume(pairs)
    u, v = data.draw(st.sampled_from(pairs))
    h = KernelGraph.from_json(g.to_json())
    h.dag.add_edge(u, v)
    assert h.fingerprint() != g.fingerprint()


@given(graphs(), st.data())
def test_an_edge_made_programmatic_changes_the_fingerprint_and_equality(g, data):
    full = [(u, v) for u, v, k in g.dag.edges(data="kind") if k is None]
    assume(full)
    u, v = data.draw(st.sampled_from(full))
    h = KernelGraph.from_json(g.to_json())
    h.dag.edges[u, v]["kind"] = "programmatic"
    assert h != g
    assert h.fingerprint() != g.fingerprint()
    assert h.fingerprint(launch=False) != g.fingerprint(launch=False)  # executables differ too


# --- examples ------------------------------------------------------------------------------------


def _pdl_pair(kind: str | None) -> KernelGraph:
    g = KernelGraph()
    g.add("a", _kernel(function="a"))
    g.add("b", _kernel(function="b"), after=["a"], kinds={"a": kind} if kind else None)
    return g


def test_edge_kinds_survive_json_and_the_ir_says_which_dependencies_are_weaker():
    g = _pdl_pair("programmatic")
    doc = g.to_json()
    assert doc["edges"] == [["a", "b", "programmatic"]]
    back = KernelGraph.from_json(doc)
    assert back == g and back.kinds_into("b") == {"a": "programmatic"}
    assert back != _pdl_pair(None) and back != _pdl_pair("launch_order")
    assert _pdl_pair(None).to_json()["edges"] == [["a", "b"]]  # files without kinds unchanged


def test_an_unknown_edge_kind_is_refused_in_the_ir_and_in_a_file():
    with pytest.raises(GraphError, match="edge 'a' -> 'b': expected a kind among programmatic, "
                                         "launch_order or none, found 'eventually'"):
        _pdl_pair("eventually")
    doc = _pdl_pair("programmatic").to_json()
    doc["edges"][0][2] = "eventually"
    with pytest.raises(GraphError, match="expected a kind among programmatic, launch_order, "
                                         "found 'eventually'"):
        KernelGraph.from_json(doc)


def test_a_family_match_refuses_graphs_whose_edges_differ_only_in_kind():
    from grape.passes.families import match, same_ids

    assert not same_ids(_pdl_pair("programmatic"), _pdl_pair(None))
    with pytest.raises(GraphError, match="different dependencies"):
        match(_pdl_pair("programmatic"), _pdl_pair(None))
    assert match(_pdl_pair("programmatic"), _pdl_pair("programmatic")) == {"a": "a", "b": "b"}


def test_kernels_that_share_a_name_are_told_apart_by_function():
    a, b = KernelGraph(), KernelGraph()
    a.add("n", _kernel(function="cubin1:attn", name="flash_fwd"))
    b.add("n", _kernel(function="cubin2:attn", name="flash_fwd"))
    assert a.fingerprint() != b.fingerprint()


def test_two_captures_of_the_same_chain_agree_and_an_order_swap_does_not():
    def chain(functions, prefix):
        g = KernelGraph()
        prev = []
        for i, f in enumerate(functions):
            prev = [g.add(f"{prefix}{i}", _kernel(function=f), after=prev)]
        return g

    assert chain("abcab", "n").fingerprint() == chain("abcab", "m").fingerprint()
    assert chain("abcab", "n").fingerprint() != chain("abacb", "n").fingerprint()


def test_fingerprint_of_conditional_covers_its_bodies():
    def with_body(grid):
        body = KernelGraph()
        body.add("k", _kernel(grid=grid))
        g = KernelGraph()
        g.add("c", Conditional(ConditionalKind.WHILE, "h", (body,)))
        return g

    assert with_body((1, 1, 1)).fingerprint() == with_body((1, 1, 1)).fingerprint()
    assert with_body((1, 1, 1)).fingerprint() != with_body((2, 1, 1)).fingerprint()


def test_cycle_is_rejected_with_the_cycle_named():
    g = KernelGraph()
    g.add("a", Empty())
    g.add("b", Empty(), after=["a"])
    g.dag.add_edge("b", "a")
    with pytest.raises(GraphCycleError, match=r"expected an acyclic graph, found the cycle "
                                              r"(a -> b -> a|b -> a -> b)"):
        g.validate()
    with pytest.raises(GraphCycleError):
        fingerprint(g)


def test_dangling_buffer_reference_is_rejected():
    g = KernelGraph()
    g.add("k", _kernel(args=bytes(8), params=(Param(0, 8),),
                       pointers=(Pointer(0, Span("weights")),)))
    with pytest.raises(DanglingBufferError,
                       match="node 'k': expected a buffer of the table, found a reference to "
                             "unknown buffer 'weights'"):
        g.validate()


def test_copy_past_the_end_of_a_buffer_is_rejected():
    g = KernelGraph()
    g.add_buffer(Buffer("a", 100, BufferRole.INPUT))
    g.add_buffer(Buffer("b", 100, BufferRole.OUTPUT))
    g.add("c", Memcpy(Span("a", 60), Span("b"), 50))
    with pytest.raises(DanglingBufferError, match=r"within buffer 'a' \(0..100\), found 60..110"):
        g.validate()


def test_dangling_reference_inside_a_conditional_body_names_the_body():
    body = KernelGraph()
    body.add("k", _kernel(args=bytes(8), params=(Param(0, 8),),
                          pointers=(Pointer(0, Span("gone")),)))
    g = KernelGraph()
    g.add("c", Conditional(ConditionalKind.IF, "h", (body,)))
    with pytest.raises(DanglingBufferError, match="node 'c' body 0: node 'k'"):
        g.validate()


@pytest.mark.parametrize("kernel, message", [
    (_kernel(grid=(0, 1, 1)), r"expected a grid of 3 dimensions within 1..\(2147483647, 65535, "
                              r"65535\), found \(0, 1, 1\)"),
    (_kernel(block=(1025, 1, 1)), r"expected a block of 3 dimensions"),
    (_kernel(block=(32, 32, 2)), r"expected at most 1024 threads per block, found 2048"),
    (_kernel(shared_mem=-1), r"expected dynamic shared memory within 0..232448 bytes, found -1"),
    (_kernel(args=bytes(4), params=(Param(0, 8),)), r"expected parameter 0 to follow"),
    (_kernel(args=bytes(12), params=(Param(0, 12),), pointers=(Pointer(8, Span("x")),)),
     r"expected pointers to lie inside the 12 argument bytes, found one at offset 8"),
])
def test_impossible_launches_are_rejected(kernel, message):
    g = KernelGraph()
    g.add_buffer(Buffer("x", 64, BufferRole.INTERNAL))
    g.add("k", kernel)
    with pytest.raises(LaunchConfigError, match=message):
        g.validate()


def test_node_without_a_known_operation_is_rejected():
    g = KernelGraph()
    g.dag.add_node("mystery", op="tensor core")
    with pytest.raises(UnknownNodeKindError, match="node 'mystery': expected one of kernel, "
                                                   "memcpy.*found str"):
        g.validate()


def test_handle_arguments_must_name_a_conditional():
    body = KernelGraph()
    body.add("k", _kernel())
    g = KernelGraph()
    g.add("set", _kernel(args=bytes(8), params=(Param(0, 8),),
                         handles=(HandleRef(0, "loop"),)))
    g.add("c", Conditional(ConditionalKind.WHILE, "loop", (body,)), after=["set"])
    g.validate()
    g.dag.nodes["set"]["op"] = _kernel(args=bytes(8), params=(Param(0, 8),),
                                       handles=(HandleRef(0, "other"),))
    with pytest.raises(GraphError, match="node 'set': expected handle arguments to name a "
                                         "conditional of the graph, found 'other'"):
        g.validate()


def test_if_else_needs_two_bodies():
    g = KernelGraph()
    g.add("c", Conditional(ConditionalKind.IF_ELSE, "h", (KernelGraph(),)))
    with pytest.raises(GraphError, match="expected 2 bodies for a if_else conditional, found 1"):
        g.validate()


def test_duplicate_ids_are_refused():
    g = KernelGraph()
    g.add("a", Empty())
    with pytest.raises(GraphError, match="found 'a' already in the graph"):
        g.add("a", Empty())
    with pytest.raises(GraphError, match="dependencies on existing nodes, found 'z'"):
        g.add("b", Empty(), after=["z"])


# --- files ---------------------------------------------------------------------------------------


def _doc() -> dict:
    g = KernelGraph()
    g.add_buffer(Buffer("x", 64, BufferRole.INPUT))
    g.add("k", _kernel(args=bytes(8), params=(Param(0, 8),), pointers=(Pointer(0, Span("x")),)))
    return g.to_json()


def test_save_and_load_round_trip(tmp_path):
    g = KernelGraph.from_json(_doc())
    for name in ("g.json", "g.json.gz"):
        g.save(tmp_path / name)
        assert KernelGraph.load(tmp_path / name) == g


@pytest.mark.parametrize("edit, error, message", [
    (lambda d: d.update(version=7), SchemaVersionError,
     "expected grape.ir schema version 1, found 7"),
    (lambda d: d.update(schema="other"), GraphError, "expected a grape.ir document, found 'other'"),
    (lambda d: d["nodes"][0].update(kind="tensorcore"), UnknownNodeKindError,
     "node 'k': expected a kind among kernel, .*found 'tensorcore'"),
    (lambda d: d["nodes"][0].update(grid="big"), GraphError,
     "node 'k': expected a valid 'grid', found 'big'"),
    (lambda d: d["nodes"][0].update(warp_size=32), GraphError,
     r"node 'k': expected fields among .*found \['warp_size'\]"),
    (lambda d: d["nodes"][0]["pointers"][0]["target"].update(buffer="y"), DanglingBufferError,
     "unknown buffer 'y'"),
    (lambda d: d["edges"].append(["k", "nowhere"]), GraphError,
     "expected edges between listed nodes"),
    (lambda d: d["buffers"][0].update(role="scratch"), GraphError,
     "buffer 0: expected a valid 'role', found 'scratch'"),
    # Pointers, params and spans have a fast path; what it does not take, the checks still see.
    (lambda d: d["nodes"][0]["pointers"][0]["target"].update(offset="8"), GraphError,
     "node 'k': expected a valid 'offset', found '8'"),
    (lambda d: d["nodes"][0]["pointers"][0].update(offset=True), GraphError,
     "node 'k': expected a valid 'offset', found True"),
    (lambda d: d["nodes"][0]["params"][0].update(align=8), GraphError,
     r"node 'k': expected fields among \['offset', 'size'\], found \['align'\]"),
    (lambda d: d["nodes"][0]["pointers"][0].pop("target"), GraphError,
     "node 'k': expected all fields of Pointer"),
])
def test_bad_graph_files_give_one_line_naming_the_file(tmp_path, edit, error, message):
    doc = _doc()
    edit(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(error, match=message) as info:
        KernelGraph.load(path)
    assert str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)


def test_truncated_graph_file(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(_doc())[:40])
    with pytest.raises(GraphError, match=r"cut.json: expected JSON, found 'unterminated string.*' "
                                         r"at line 1 column 38; the file looks truncated"):
        KernelGraph.load(path)


def test_with_ops_replaces_some_nodes_and_keeps_the_rest_of_the_graph():
    g = KernelGraph()
    g.add_buffer(Buffer("a", 256, BufferRole.INTERNAL))
    g.add("n0", _kernel(name="first"))
    g.add("n1", _kernel(name="second"), after=["n0"], kinds={"n0": "programmatic"})
    g.add("n2", _kernel(name="third"), after=["n0", "n1"])
    extra = Buffer("b", 512, BufferRole.INTERNAL)
    out = g.with_ops({"n1": _kernel(name="replaced")}, [extra, g.buffers["a"]])
    assert out.op("n1").name == "replaced" and g.op("n1").name == "second"  # g untouched
    assert [n for n, _ in out.ops()] == ["n0", "n1", "n2"]  # the node order kept
    assert out.edges() == g.edges() and out.kinds_into("n1") == {"n0": "programmatic"}
    assert out.buffers == {"a": g.buffers["a"], "b": extra} and set(g.buffers) == {"a"}
    assert g.with_ops({"n1": out.op("n1")}).with_ops({"n1": g.op("n1")}) == g
    with pytest.raises(GraphError, match=r"found \['n9'\] not among its 3 nodes"):
        g.with_ops({"n9": _kernel()})
