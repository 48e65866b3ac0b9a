"""How a family brings its executable from one shape to another (grape.torch.family), on the
CPU: synthetic graphs, a recording stand-in for the driver."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
driver = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")

from grape.ir import Buffer, BufferRole, Kernel, KernelGraph, Param  # noqa: E402
from grape.passes.variants import Variants  # noqa: E402
from grape.torch.family import (  # noqa: E402
    _ALIGN,
    Family,
    _arena_bytes,
    _Group,
    _placed,
    scratch_of,
)
from tests.standins import RecordingGraph  # noqa: E402


def _step(grids: tuple[int, int, int]) -> KernelGraph:
    g = KernelGraph()
    previous: list[str] = []
    for i, grid in enumerate(grids):
        g.add(f"k{i}", Kernel(f"f{i}@0x{i}", f"f{i}", (grid, 1, 1), (32, 1, 1),
                              args=i.to_bytes(8, "little"), params=(Param(0, 8),)),
              after=previous)
        previous = [f"k{i}"]
    return g


class _Executable:
    handle = "executable"

    def __init__(self, log: list) -> None:
        self.log = log

    def launch(self, stream) -> None:
        self.log.append("launch")


SHAPES = {"a": (1, 1, 1), "b": (1, 2, 1), "c": (1, 3, 4)}  # a is the template


@pytest.fixture
def family():
    log: list = []
    graphs = {s: _step(grids) for s, grids in SHAPES.items()}
    template = graphs["a"]
    graph = RecordingGraph(log)
    group = _Group("a", template, graph, _Executable(log), "a")
    variants = Variants(template)
    for s, g in graphs.items():
        variants.add_graph(s, g)
    fam = Family(lambda s: None, {"g": group}, dict.fromkeys(SHAPES, "g"), {"g": variants}, 0,
                 0.0)
    return fam, graphs, graph, log


def test_updates_are_prepared_once_up_front_and_a_switch_sets_what_differs(family):
    fam, graphs, graph, log = family
    # k1's versions: a's (the template's), b's and c's; k2's: a's and c's.
    assert fam.prepare_updates() == 5 and graph.prepared == 5
    for shape, expected in (("b", ["k1"]), ("c", ["k1", "k2"]), ("a", ["k1", "k2"]),
                            ("c", ["k1", "k2"]), ("b", ["k1", "k2"])):
        log.clear()
        fam.run(shape, stream=0)
        assert [node for node, _ in log[:-1]] == expected, shape
        assert all(op == graphs[shape].op(node) for node, op in log[:-1]), shape
        assert log[-1] == "launch"
    assert graph.prepared == 5  # nothing prepared while running
    assert fam.prepare_updates() == 0


def test_without_preparing_up_front_a_node_s_versions_are_prepared_on_its_first_update(family):
    fam, _, graph, _ = family
    fam.run("c", stream=0)  # k1 and k2 change: every version of both, 3 and 2
    assert graph.prepared == 5
    fam.run("b", stream=0)
    fam.run("c", stream=0)
    assert graph.prepared == 5 and fam.updated_nodes == 6


def test_a_shape_that_adds_a_version_after_preparing_has_it_prepared_on_use(family):
    fam, _, graph, log = family
    fam.prepare_updates()
    d = _step((1, 9, 1))
    fam.variants["g"].add_graph("d", d)
    fam.group_of["d"] = "g"
    log.clear()
    fam.run("d", stream=0)  # from a: k1 to d's new version
    assert [(node, op) for node, op in log[:-1]] == [("k1", d.op("k1"))]
    assert graph.prepared == 5 + 4  # k1's four versions prepared again


def test_scratch_is_internal_memory_inside_pool_segments_that_no_named_tensor_shares():
    g = KernelGraph()
    g.add_buffer(Buffer("alloc@0x1000", 0x1000, BufferRole.INTERNAL, address=0x1000))
    g.add_buffer(Buffer("alloc@0x4000", 0x1000, BufferRole.INTERNAL, address=0x4000))
    g.add_buffer(Buffer("output0", 0x10, BufferRole.OUTPUT, address=0x4800))
    g.add_buffer(Buffer("alloc@0x9000", 0x1000, BufferRole.INTERNAL, address=0x9000))
    g.add_buffer(Buffer("param:w", 0x10, BufferRole.PARAMETER, address=0x20000))
    pool = [(0x1000, 0x1000), (0x4000, 0x1000)]  # 0x9000 is memory outside the pool
    # The second segment holds an output the caller reads: its blocks are not the graphs' alone.
    assert scratch_of([g], pool) == {"alloc@0x1000"}
    assert scratch_of([g], []) == frozenset()


def test_saved_scratch_is_placed_disjoint_inside_the_arena_at_its_saved_alignment():
    saved = [Buffer("alloc@0x7f0000200000", 20 << 20, BufferRole.INTERNAL, address=0x7F0000200000),
             Buffer("alloc@0x7f0003a00200", 2 << 20, BufferRole.INTERNAL, address=0x7F0003A00200),
             Buffer("alloc@0x7f0001000000", 512, BufferRole.INTERNAL, address=0x7F0001000000)]
    for start in (0x7E0000000000, 0x7E0000000200, 0x7E00001FFE00):  # 512-byte aligned starts
        here = _placed(saved, start)
        end = start + _arena_bytes(saved)
        spans = sorted((here[b.id].address, here[b.id].address + b.size) for b in saved)
        assert all(start <= a and e <= end for a, e in spans)
        assert all(e <= a2 for (_, e), (a2, _) in itertools.pairwise(spans))  # disjoint
        for b in saved:
            assert here[b.id].address % _ALIGN == b.address % _ALIGN
            assert here[b.id].size == b.size and here[b.id].id == f"scratch@{here[b.id].address:#x}"


def test_shapes_that_share_a_node_s_version_switch_without_updating_it(family):
    fam, graphs, _, log = family
    # d takes b's k1 and c's k2, as graphs of their own: one version each, shared.
    fam.variants["g"].add_graph("d", _step((1, 2, 4)))
    fam.group_of["d"] = "g"
    assert {n: len(v) for n, v in fam.variants["g"].nodes.items()} == {"k1": 3, "k2": 2}
    fam.run("c", stream=0)
    log.clear()
    fam.run("d", stream=0)  # c to d: only k1 differs
    assert [node for node, _ in log[:-1]] == ["k1"]
    log.clear()
    fam.run("b", stream=0)  # d to b: only k2 differs (back to the template's)
    assert log[:-1] == [("k2", graphs["a"].op("k2"))]


class _Switch:
    """Stands in for grape.cuda.switch.DeviceSwitch: keeps what it was built with, logs its
    launches."""

    def __init__(self, graph, versions, table, log) -> None:
        self.graph, self.table, self.log = graph, table, log
        self.order = [nv.node for nv in versions]
        self.nodes = frozenset(self.order)

    def launch(self, shape, stream=0, holds=-1) -> None:
        self.log.append(("switch", shape, holds))

    def close(self) -> None:
        pass


@pytest.fixture
def device_family(family, monkeypatch):
    """``family`` with update="device": Graph.build and DeviceSwitch stand-ins, every graph it
    builds and every switch it makes kept."""
    import grape.torch.family as fam_module

    fam, graphs, graph, log = family
    built, switches = [], []

    class _Closable(_Executable):
        closed = False

        def close(self) -> None:
            self.closed = True

    class _Built(RecordingGraph):
        def instantiate(self):
            return _Closable(log)

        def close(self) -> None:
            pass

    def switch(g, versions, table):
        switches.append(_Switch(g, versions, table, log))
        return switches[-1]

    fam.groups["g"].executable = _Closable(log)
    graph.close = lambda: None
    monkeypatch.setattr(fam_module.Graph, "build",
                        staticmethod(lambda ir: built.append(ir) or _Built(log, ir)))
    monkeypatch.setattr(fam_module, "DeviceSwitch", switch)
    fam.update = "device"
    return fam, graphs, log, built, switches


def test_a_device_family_switches_its_kernels_with_one_launch_from_a_table(device_family):
    fam, graphs, log, built, switches = device_family
    old = fam.groups["g"].executable
    # k1 (3 versions) and k2 (2) keep one block shape: both on the device, nothing on the host
    assert fam.prepare_updates() == 5
    switch = fam._device["g"]
    assert switches == [switch] and built == [graphs["a"]]
    assert switch.graph is fam.groups["g"].graph
    assert old.closed and fam.groups["g"].executable is not old  # instantiated again
    rows = {s: fam._row[s] for s in SHAPES}
    want = {"a": {"k1": 0, "k2": 0}, "b": {"k1": 1, "k2": 0}, "c": {"k1": 2, "k2": 1}}
    for s, versions in want.items():
        assert [switch.table[rows[s]][switch.order.index(n)] for n in ("k1", "k2")] == [
            versions["k1"], versions["k2"]], s
    for shape, holds in (("b", "a"), ("c", "b"), ("c", "c"), ("a", "c")):
        log.clear()
        fam.run(shape, stream=0)
        if shape == holds:  # the executable holds it already: no switch at all
            assert log == ["launch"]
        else:
            assert log == [("switch", rows[shape], rows[holds]), "launch"], shape
    assert fam.updated_nodes == 1 + 2 + 2  # nodes whose versions changed, for reports


def test_a_shape_added_to_a_device_family_gets_a_new_switch_that_knows_it(device_family):
    fam, _, log, built, switches = device_family
    fam.prepare_updates()
    fam.run("c", stream=0)
    fam.variants["g"].add_graph("d", _step((1, 9, 1)))  # a fourth version of k1
    fam.group_of["d"] = "g"
    log.clear()
    fam.run("d", stream=0)
    assert len(switches) == 2 and len(built) == 2  # made again, with d's row
    new = fam._device["g"]
    assert new is switches[1] and new.table[fam._row["d"]][new.order.index("k1")] == 3
    # the new executable holds the template: the switch goes from a's row to d's
    assert log == [("switch", fam._row["d"], fam._row["a"]), "launch"]


def test_each_kind_of_capture_moves_to_the_places_of_the_first_of_its_kind():
    """Captures of two kernel paths (their allocator acts differ) each take the places of the
    first capture of their own path; the first of each stays as captured."""
    from grape.torch.family import _Places
    from tests.test_passes_places import decode

    places = _Places()
    first, other = decode(64), decode(64, layers=2)
    assert places(first.graph, first.history()) is first.graph
    assert places(other.graph, other.history()) is other.graph
    smaller = decode(40)
    moved = places(smaller.graph, smaller.history())
    assert moved.op("n1").args[8:16] == first.graph.op("n1").args[8:16]
    smaller2 = decode(40, layers=2)
    moved2 = places(smaller2.graph, smaller2.history())
    assert moved2.op("n1").args[8:16] == other.graph.op("n1").args[8:16]
    larger = decode(72)  # outgrows its reference: kept as captured, and why
    assert places(larger.graph, larger.history()) is larger.graph
    assert (places.moved, len(places.references)) == (2, 2)
    assert places.refused == ["expected no block larger than the reference's, found block 0 "
                              "of 72192 bytes against 64000"]
    assert places(first.graph, None) is first.graph  # no history: as captured, and why
    assert places.refused[-1] == "the process records the allocator's history itself"
    assert places.summary().startswith("temporaries moved to a reference capture's places in "
                                       "2 of 4 captures (2 references, ")


def test_a_family_s_progress_goes_to_the_grape_logger_by_default(caplog):
    import logging

    from grape.torch.family import _logged

    with caplog.at_level(logging.INFO, logger="grape"):
        _logged("capture_family")("placed 10/512 shapes, 1 executables")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("grape", logging.INFO, "capture_family: placed 10/512 shapes, 1 executables")]
