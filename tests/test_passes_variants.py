"""A family's shapes as versions of its template's nodes (grape.passes.variants), and moving
them to another process all at once (grape.passes.relocate.relocate_variants): against the
per-shape deltas and per-operation relocation they replace, on GPT-2 small decode families
captured on the H200."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from grape.errors import UnsupportedError
from grape.familyio import graph_with, load_family
from grape.ir import Buffer, BufferRole, Kernel, KernelGraph, Param, Pointer, Span
from grape.passes.delta import join, transition
from grape.passes.relocate import relocate_all, relocate_variants, relocation
from grape.passes.variants import NodeVersions, Variants

FAMILIES = Path(__file__).parent.parent / "traces" / "h200_families"
CAPTURE = "gpt2_small_decode_b1_kv240_255.capture_{}.family.json.gz"


@pytest.fixture(scope="module")
def captures():
    return [load_family(FAMILIES / CAPTURE.format(x)) for x in "ab"]


def _variants(saved, key: str) -> Variants:
    """One executable's shapes, added graph by graph as a capture adds them."""
    shapes = [s for s, k in saved.shapes.items() if k == key]
    first = next(s for s in shapes if not saved.changed(s))
    v = Variants(saved.graph(first))
    v.shapes[first] = {}
    for s in shapes:
        if s != first:
            v.add_graph(s, saved.graph(s))
    return v


def test_a_switch_updates_what_the_shapes_deltas_say_differs(captures):
    saved = captures[0]
    for key in saved.variants:
        v = _variants(saved, key)
        template = saved.graph(next(iter(v.shapes)))
        deltas = {s: join(template, saved.graph(s)) for s in v.shapes}
        for a, b in itertools.permutations(v.shapes, 2):
            expected = transition(template, deltas[a], deltas[b])
            switch = dict(v.switch(a, b))
            assert switch.keys() == expected.keys(), (a, b)
            assert all(v.nodes[n].op(switch[n]) == op for n, op in expected.items())
        for s in v.shapes:
            assert graph_with(v.template, v.ops(s)) == saved.graph(s)


def test_kernel_versions_are_rows_and_equal_operations_share_one(captures):
    v = _variants(captures[0], max(captures[0].variants, key=lambda k: len(
        captures[0].variants[k].shapes)))
    kernels = [nv for nv in v.nodes.values() if nv.template.kind == "kernel"]
    assert kernels and all(nv.rows for nv in kernels)
    nv = kernels[0]
    args, dims, targets = nv.arrays()
    assert args.shape == (len(nv), len(nv.template.args)) and dims.shape == (len(nv), 7)
    for version in range(len(nv)):
        op = nv.op(version)
        assert args[version].tobytes() == op.args
        assert tuple(dims[version]) == (*op.grid, *op.block, op.shared_mem)
        assert targets[version].tolist() == [p.target.offset for p in op.pointers]
        assert nv.add(op) == version  # the same operation again: the same version
    assert nv.add(nv.op(len(nv) - 1)) == len(nv) - 1 and nv.op(0) is nv.template
    # Settled (arrays alone), it still finds and adds versions: the rows come back on use.
    before = [nv.op(version) for version in range(len(nv))]
    v.settle()
    assert [nv.op(version) for version in range(len(nv))] == before
    assert nv.add(before[1]) == 1
    other = dataclasses.replace(before[1], grid=(999, 1, 1))
    assert nv.add(other) == len(before) and nv.op(len(before)) == other


def _kernel(grid: int, args: bytes, pointers=()) -> Kernel:
    return Kernel("f@0x1", "f", (grid, 1, 1), (32, 1, 1), args=args,
                  params=(Param(0, len(args)),), pointers=tuple(pointers))


def test_a_version_of_another_layout_turns_a_node_s_versions_into_operations():
    buffer = Pointer(0, Span("x", 0))
    nv = NodeVersions("k", _kernel(1, bytes(16), [buffer]))
    first = _kernel(2, bytes(16), [buffer])
    assert nv.add(first) == 1 and nv.rows
    fewer = _kernel(3, bytes(16))  # the pointer's word left unfilled: no pointer there
    assert nv.add(fewer) == 2 and not nv.rows
    assert [nv.op(v) for v in range(3)] == [nv.template, first, fewer]
    assert nv.add(first) == 1 and len(nv) == 3


def test_a_shape_that_cannot_be_taken_in_place_changes_nothing():
    g = KernelGraph()
    g.add_buffer(Buffer("x", 64, BufferRole.INTERNAL, address=0x1000))
    g.add("k", _kernel(1, bytes(8)))
    v = Variants(g)
    v.shapes["t"] = {}
    other = KernelGraph()
    other.add_buffer(Buffer("x", 64, BufferRole.INTERNAL, address=0x1000))
    other.add("k", dataclasses.replace(_kernel(2, bytes(8)), attributes=(("cluster", 2),)))
    with pytest.raises(UnsupportedError, match="attributes change"):
        v.add_graph("s", other)
    moved = KernelGraph()
    moved.add_buffer(Buffer("x", 64, BufferRole.INTERNAL, address=0x2000))
    moved.add("k", _kernel(2, bytes(8)))
    with pytest.raises(UnsupportedError, match="expected buffer 'x' at one address"):
        v.add_graph("s", moved)
    assert v.nodes == {} and list(v.shapes) == ["t"]


def test_versions_moved_at_once_equal_operations_moved_one_by_one(captures):
    # The second capture, in the same process, left other bytes in PyTorch's unfilled
    # argument words (loose): the move takes the capture's here, where a member left them.
    a, b = captures
    for key, template in a.templates.items():
        v = a.variants[key]
        first = next(s for s, versions in v.shapes.items() if not versions)
        r = relocation(template, b.graph(first))
        assert r.loose  # the case the rows must get right
        base = graph_with(b.graph(first), relocate_all(dict(template.ops()), r))
        moved, failed = relocate_variants(v, r, base)
        assert not failed and moved.shapes.keys() == v.shapes.keys()
        rows = [n for n, nv in moved.nodes.items() if nv.rows]
        assert len(rows) >= len(moved.nodes) - 12  # all kernels here; the copies one by one
        for shape in v.shapes:
            one_by_one = {n: op for n, op in relocate_all(v.ops(shape), r).items()
                          if op != base.op(n)}
            assert moved.ops(shape) == one_by_one, shape


def test_a_version_that_points_outside_its_buffer_here_keeps_only_its_shapes_back():
    g = KernelGraph()
    g.add_buffer(Buffer("x", 256, BufferRole.INTERNAL, address=0x10000))
    word = (0x10000).to_bytes(8, "little")
    g.add("k", _kernel(1, word, [Pointer(0, Span("x", 0))]))
    v = Variants(g)
    v.shapes[0] = {}
    for shape, offset in ((1, 64), (2, 200), (3, 64)):
        member = KernelGraph()
        member.add_buffer(Buffer("x", 256, BufferRole.INTERNAL, address=0x10000))
        member.add("k", _kernel(1 + offset, (0x10000 + offset).to_bytes(8, "little"),
                                [Pointer(0, Span("x", offset))]))
        v.add_graph(shape, member)
    here = KernelGraph()  # x is 128 bytes here, at another address
    here.add_buffer(Buffer("y", 128, BufferRole.INTERNAL, address=0x50000))
    here.add("k", _kernel(1, (0x50000).to_bytes(8, "little"), [Pointer(0, Span("y", 0))]))
    r = relocation(g, here)
    moved, failed = relocate_variants(v, r, here)
    assert set(failed) == {2} and "within the 128 bytes of buffer 'y' here, found offset 200" \
        in failed[2]
    assert set(moved.shapes) == {0, 1, 3} and moved.shapes[1] == moved.shapes[3]
    op = moved.ops(1)["k"]
    assert op.args == (0x50000 + 64).to_bytes(8, "little") and op.pointers == (
        Pointer(0, Span("y", 64)),)


def _chain(*ops: Kernel, address: int = 0x1000) -> KernelGraph:
    """Kernels a, b, c, ... one after another over one buffer."""
    g = KernelGraph()
    g.add_buffer(Buffer("x", 64, BufferRole.INTERNAL, address=address))
    previous: list[str] = []
    for name, op in zip("abcdef", ops, strict=False):
        previous = [g.add(name, op, previous)]
    return g


def _clustered(grid: int, cluster: int | None, function: str = "f@0x1") -> Kernel:
    attributes = (("cluster_dim", (cluster, 1, 1)),) if cluster else ()
    return dataclasses.replace(_kernel(grid, bytes(8)), function=function,
                               name=function.split("@")[0], attributes=attributes)


def test_a_kernel_whose_attributes_change_gets_an_alternate_each_shape_runs_one_of():
    """Alternates: a shape whose kernel picks another cluster shape runs a sibling node with
    those attributes, the others disabled; shapes with the same attributes share it."""
    plain = _kernel(1, bytes(8))
    v = Variants(_chain(plain, _clustered(1, None), plain), alternates=True)
    v.shapes["t"] = {}
    two = _clustered(4, 2, "g@0x2")
    v.add_graph("s2", _chain(plain, two, plain))
    v.add_graph("s2b", _chain(_kernel(3, bytes(8)), _clustered(8, 2, "g@0x2"), plain))
    v.add_graph("s4", _chain(plain, _clustered(9, 4, "h@0x3"), plain))
    v.add_graph("t2", _chain(plain, _clustered(5, None), plain))  # the template's attributes
    assert [k.attributes for k in v.alternates["b"]] == [two.attributes,
                                                          (("cluster_dim", (4, 1, 1)),)]
    assert v.alternates["b"][0] == two  # the first shape that had them is its template
    assert v.chosen == {"s2": {"b": 1}, "s2b": {"b": 1}, "s4": {"b": 2}}
    assert v.runs("b", "s4") == "b~2" and v.runs("b", "t2") == "b" and v.runs("a", "s2") == "a"
    # s2 runs alternate 1 as it was made; s2b a version of it, and a version of node a.
    assert v.shapes["s2"] == {} and set(v.shapes["s2b"]) == {"a", "b~1"}
    assert v.ops("s2b")["b"].grid == (8, 1, 1) and v.op("b~2").function == "h@0x3"
    assert v.ops("s2") == {"b": two} and v.of("b~2") == ("b", 2) and v.of("b~3") == ("b~3", 0)
    # each shape's own graph is the template with its operations
    assert graph_with(v.template, v.ops("s4")) == _chain(plain, _clustered(9, 4, "h@0x3"),
                                                         plain)
    assert v.alternated == {"b", "b~1", "b~2"}
    assert v.disabled("t") == ["b~1", "b~2"] and v.disabled("s4") == ["b", "b~1"]
    assert v.toggles("t", "s2") == [("b", False), ("b~1", True)]
    assert v.toggles("s2", "s2b") == [] and v.toggles("t", "t2") == []
    assert v.toggles("s4", "t2") == [("b~2", False), ("b", True)]
    # Switching updates the alternate's versions as any node's (disabled ones too).
    assert dict(v.switch("s2", "s2b")) == {"a": v.shapes["s2b"]["a"], "b~1": 1}
    built = v.executable_graph()
    assert set(built.dag) == {"a", "b", "b~1", "b~2", "c"}
    # a chain: the node, its alternates, then its successors
    assert set(built.dag.edges) == {("a", "b"), ("b", "b~1"), ("b~1", "b~2"), ("b~2", "c")}
    assert built.op("b~2") == v.op("b~2") and v.template.dag.number_of_nodes() == 3
    v.discard("s4")
    assert "s4" not in v.chosen and "s4" not in v.shapes


def test_without_alternates_a_shape_whose_attributes_change_is_refused():
    v = Variants(_chain(_clustered(1, None)))
    v.shapes["t"] = {}
    with pytest.raises(UnsupportedError, match="attributes change"):
        v.add_graph("s", _chain(_clustered(1, 2)))
    assert v.alternates == {} and v.executable_graph() is v.template


def test_lengths_derived_from_a_shape_that_runs_an_alternate_run_it_too():
    v = Variants(_chain(_clustered(1, None)), alternates=True)
    v.shapes["t"] = {}
    v.add_graph("s", _chain(_clustered(2, 2)))
    rows = NodeVersions("x", _clustered(3, 2))
    rows.add(_clustered(5, 2))
    numbers = v.node(v.runs("a", "s")).add_rows(*rows.arrays())  # as place_derived adds them
    v.add_like(["d3", "d5"], "s", {"a~1": numbers})
    assert v.chosen["d3"] == {"a": 1} and v.ops("d5")["a"].grid == (5, 1, 1)
    assert v.toggles("t", "d3") == [("a", False), ("a~1", True)]


def test_an_alternate_the_backend_cannot_disable_refuses_the_shape_and_changes_nothing():
    refused = _clustered(2, 16, "conv@0x9")
    v = Variants(_chain(_clustered(1, None), _clustered(1, None)),
                 alternates=lambda k: k.function != "conv@0x9")
    v.shapes["t"] = {}
    with pytest.raises(UnsupportedError, match="which the driver will not disable"):
        v.add_graph("s", _chain(_clustered(4, 2), refused))
    assert v.alternates == {} and v.chosen == {} and list(v.shapes) == ["t"]
    v.add_graph("s2", _chain(_clustered(4, 2), _clustered(1, None)))
    assert v.chosen == {"s2": {"a": 1}}


def test_the_edges_into_and_out_of_a_chain_of_alternates_are_full_dependencies():
    def programmatic(g: KernelGraph) -> KernelGraph:
        g.dag.edges["a", "b"]["kind"] = "programmatic"
        g.dag.edges["b", "c"]["kind"] = "programmatic"
        return g

    g = programmatic(_chain(_clustered(1, None), _clustered(1, None), _clustered(1, None)))
    v = Variants(g, alternates=True)
    v.shapes["t"] = {}
    v.add_graph("s", programmatic(_chain(_clustered(1, None), _clustered(3, 2),
                                         _clustered(1, None))))
    built = v.executable_graph()
    assert built.edges() == {("a", "b", None), ("b", "b~1", None), ("b~1", "c", None)}
    assert g.kinds_into("b") == {"a": "programmatic"}  # the template is left alone


def _alternated() -> Variants:
    """Shapes t (the template), s2 (an alternate of the template's function), s4 and s4b (an
    alternate of a function the template never runs, s4b a version of it)."""
    plain = _kernel(1, bytes(8))
    v = Variants(_chain(plain, _clustered(1, None), plain), alternates=True)
    v.shapes["t"] = {}
    v.add_graph("s2", _chain(plain, _clustered(4, 2), plain))
    v.add_graph("s4", _chain(_kernel(7, bytes(8)), _clustered(9, 4, "h@0x3"), plain))
    v.add_graph("s4b", _chain(plain, _clustered(5, 4, "h@0x3"), plain))
    return v


def test_a_family_with_alternates_is_saved_and_read_back_whole(tmp_path):
    from grape.familyio import SavedFamily, save_family

    v = _alternated()
    path = save_family(tmp_path / "f.family.json.gz", SavedFamily({"k": v}, dict.fromkeys(
        v.shapes, "k")))
    back = load_family(path).variants["k"]
    assert back.alternates == v.alternates and back.chosen == v.chosen
    assert back.shapes == v.shapes and back.takes_alternates
    for shape in v.shapes:
        assert back.ops(shape) == v.ops(shape)
    assert back.toggles("s2", "s4b") == v.toggles("s2", "s4b")


def test_alternates_move_to_another_process_where_the_template_runs_their_function():
    v = _alternated()
    here = _chain(_kernel(1, bytes(8)), _clustered(1, None), _kernel(1, bytes(8)),
                  address=0x9000)
    moved, failed = relocate_variants(v, relocation(v.template, here), here)
    # s2's alternate runs the template's function: it moves; h@0x3 never ran here
    assert set(failed) == {"s4", "s4b"} and "'h', which it never runs here" in failed["s4"]
    assert set(moved.shapes) == {"t", "s2"} and moved.chosen == {"s2": {"b": 1}}
    assert moved.alternates["b"] == [v.alternates["b"][0]]
    assert moved.ops("s2") == v.ops("s2")


def test_grape_info_counts_a_saved_family_s_alternates(tmp_path):
    from grape.familyio import SavedFamily, save_family
    from grape.summary import family_summary

    v = _alternated()
    path = save_family(tmp_path / "f.family.json.gz", SavedFamily({"k": v}, dict.fromkeys(
        v.shapes, "k")))
    summary = family_summary(load_family(path), path)
    assert summary.data["executables"]["k"] == {"nodes": 3, "shapes": 4, "alternates": 2}
    assert "3 nodes and 2 alternates for 4 shapes" in summary.text


def test_a_function_learned_from_a_shape_captured_here_moves_the_shapes_that_run_it():
    from grape.familyio import graph_with
    from grape.passes.relocate import learn_functions, relocate

    v = _alternated()
    here = _chain(_kernel(1, bytes(8)), _clustered(1, None), _kernel(1, bytes(8)),
                  address=0x9000)
    r = relocation(v.template, here)
    saved_s4 = graph_with(v.template, v.ops("s4"))
    with pytest.raises(UnsupportedError, match="'h', which it never runs here"):
        relocate(saved_s4.op("b"), r, "b")
    # s4 captured here: its kernel h is another handle in this process
    captured = _chain(_kernel(7, bytes(8)), _clustered(9, 4, "h@0x77"), _kernel(1, bytes(8)),
                      address=0x9000)
    assert learn_functions(r, saved_s4, captured) == {"h@0x3": "h@0x77"}
    assert learn_functions(r, saved_s4, captured) == {}  # learned once
    s4b = relocate(graph_with(v.template, v.ops("s4b")).op("b"), r, "b")
    assert s4b.function == "h@0x77" and s4b.grid == (5, 1, 1)
    # a capture of another structure, or a kernel of another name, teaches nothing
    assert learn_functions(r, saved_s4, _chain(_kernel(1, bytes(8)))) == {}
    renamed = _chain(_kernel(7, bytes(8)), _clustered(9, 4, "g@0x5"), _kernel(1, bytes(8)))
    fresh = relocation(v.template, here)
    assert learn_functions(fresh, saved_s4, renamed) == {} and "h@0x3" not in fresh.functions


def test_a_function_learned_by_name_from_the_kernels_a_shape_runs_here_moves_it():
    from grape.familyio import graph_with
    from grape.passes.relocate import learn_functions_by_name, relocate

    v = _alternated()
    here = _chain(_kernel(1, bytes(8)), _clustered(1, None), _kernel(1, bytes(8)),
                  address=0x9000)
    saved_s4 = graph_with(v.template, v.ops("s4"))
    # What s4 launches here, by name (a capture never read into the IR): h is one function.
    r = relocation(v.template, here)
    assert learn_functions_by_name(r, saved_s4, {"f": {"f@0x1"}, "h": {"h@0x77"}}) == {
        "h@0x3": "h@0x77"}
    assert relocate(saved_s4.op("b"), r, "b").function == "h@0x77"
    assert learn_functions_by_name(r, saved_s4, {"h": {"h@0x77"}}) == {}  # learned once
    # Two functions under one name here (cuDNN builds such), or none: nothing is guessed.
    for ambiguous in ({"h": {"h@0x77", "h@0x78"}}, {"g": {"g@0x5"}}, {}):
        fresh = relocation(v.template, here)
        assert learn_functions_by_name(fresh, saved_s4, ambiguous) == {}
        assert "h@0x3" not in fresh.functions
    # Two saved functions under one name in the shape: neither is paired.
    twice = saved_s4.with_ops({"c": dataclasses.replace(saved_s4.op("b"), function="h@0x4")})
    fresh = relocation(v.template, here)
    assert learn_functions_by_name(fresh, twice, {"h": {"h@0x77"}}) == {}
