"""The tables a device switch (grape.cuda.switch) copies to the GPU, built on the CPU
(grape.passes.switch_plan): each shape's row of each node must hold the bytes its version
differs in and its grid, and a node whose versions change their block shape stays with host
updates."""

from __future__ import annotations

import numpy as np
import pytest

from grape.ir import Kernel, Param
from grape.passes.switch_plan import plan, spans
from grape.passes.switch_plan import tables as _tables
from grape.passes.variants import NodeVersions, device_switchable


def _kernel(grid: int, args: bytes, block: int = 32) -> Kernel:
    return Kernel("f@0x1", "f", (grid, 1, 1), (block, 1, 1), 0, args=args,
                  params=(Param(0, len(args)),))


def _versions(node: str, width: int, changes: list[dict[int, int]], grids: list[int]
              ) -> NodeVersions:
    """Version 0 zeros with grid ``grids[0]``; version i the bytes ``changes[i - 1]`` set."""
    nv = NodeVersions(node, _kernel(grids[0], bytes(width)))
    for i, (change, grid) in enumerate(zip(changes, grids[1:], strict=True), start=1):
        args = bytearray(width)
        for at, value in change.items():
            args[at] = value
        assert nv.add(_kernel(grid, bytes(args))) == i
    return nv


def _read(blob: np.ndarray, at: dict[str, int], name: str, dtype: str, count: int
          ) -> np.ndarray:
    start = at[name]
    return blob[start:start + count * np.dtype(dtype).itemsize].view(dtype)


def test_spans_cover_the_bytes_that_differ_in_whole_words():
    nv = _versions("a", 40, [{13: 1}, {21: 2}], [1, 1, 1])
    assert spans(nv) == ([(8, 16)], False)  # bytes 13..21 -> words 8..24
    still = _versions("b", 12, [], [3])
    assert spans(still) == ([], False)
    grid_only = _versions("c", 12, [{}], [3, 4])
    assert spans(grid_only) == ([], True)
    tail = _versions("d", 12, [{11: 9}], [1, 1])
    assert spans(tail) == ([(8, 4)], False)  # widened to the word, never past the arguments


def test_words_far_apart_are_spans_of_their_own_and_near_ones_one_span():
    # A pointer near a structure's start and a word near its end: two spans, not the bytes
    # between (GPT-2 small's tables shrank 7.4x); words a gap word apart stay one span.
    far = _versions("far", 64, [{0: 1, 60: 2}], [1, 1])
    assert spans(far) == ([(0, 8), (56, 8)], False)
    near = _versions("near", 64, [{0: 1, 20: 2}], [1, 1])
    assert spans(near) == ([(0, 24)], False)


def test_each_shape_s_row_holds_its_version_s_bytes_and_grid():
    a = _versions("a", 40, [{13: 1}, {21: 2}], [1, 2, 3])
    b = _versions("b", 64, [{0: 7, 63: 8}, {60: 9}], [5, 5, 5])
    table = np.array([[0, 0], [1, 0], [2, 1], [1, 2]])
    blob, at = _tables([a, b], table, [0xA, 0xB])
    assert all(v % 8 == 0 for v in at.values())
    n, shapes = 2, len(table)
    assert _read(blob, at, "nodes", "<u8", n).tolist() == [0xA, 0xB]
    first = _read(blob, at, "first", "<u4", n + 1).tolist()
    assert first == [0, 1, 3]  # a: one span; b: its first word and its last
    spans_ = first[-1]
    start = _read(blob, at, "start", "<u4", spans_).tolist()
    size = _read(blob, at, "size", "<u4", spans_).tolist()
    held = _read(blob, at, "at", "<u4", spans_).tolist()
    assert list(zip(start, size, strict=True)) == [(8, 16), (0, 8), (56, 8)]
    assert _read(blob, at, "grid_varies", "<u4", n).tolist() == [1, 0]
    rows = _read(blob, at, "rows", "<i4", shapes * n).reshape(shapes, n)
    offsets = _read(blob, at, "offsets", "<i8", len(a) + len(b))
    grids = _read(blob, at, "grids", "<u4", 3 * (len(a) + len(b))).reshape(-1, 3)
    for s in range(shapes):
        for j, nv in enumerate([a, b]):
            version = table[s, j]
            r = rows[s, j]
            op = nv.op(version)
            for i in range(first[j], first[j + 1]):
                lo = at["args"] + offsets[r] + held[i]
                got = blob[lo:lo + size[i]].tobytes()
                assert got == op.args[start[i]:start[i] + size[i]], (s, j, i)
            assert tuple(grids[r]) == op.grid, (s, j)
    # only the words that differ are held: b's rows are 16 bytes, not 64
    assert len(blob[at["args"]:]) <= (len(a) * 16 + len(b) * 16) + 8


def test_a_node_whose_block_shape_changes_stays_on_the_host():
    nv = NodeVersions("k", _kernel(1, bytes(8)))
    nv.add(_kernel(2, bytes(8)))
    assert device_switchable(nv)
    nv.add(_kernel(2, bytes(8), block=64))
    assert not device_switchable(nv)  # the device sets arguments and grid only


def test_a_switch_refuses_a_node_whose_block_shape_changes_before_touching_the_driver():
    pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
    from grape.cuda.switch import DeviceSwitch
    from grape.errors import GrapeError

    nv = NodeVersions("k", _kernel(1, bytes(8)))
    nv.add(_kernel(1, bytes(8), block=64))
    with pytest.raises(GrapeError, match="node 'k' changing more"):
        DeviceSwitch(None, [nv], np.zeros((1, 1), dtype=np.int64))


def test_the_plan_of_a_captured_family_gives_each_shape_its_own_versions():
    # GPT-2 small decode over KV 240..255, captured on the H200: the executable's switchable
    # nodes, and for every shape the version of each that the shape's own graph has.
    from grape.passes.variants import Variants
    from tests.h200_captures import captures

    got = captures()
    v = Variants(got.graphs[got.lengths[0]])
    v.shapes[got.lengths[0]] = {}
    for n in got.lengths[1:]:
        v.add_graph(n, got.graphs[n])
    made = plan(v)
    assert made.shapes == list(v.shapes) and len(made.versions) > 40
    assert all(device_switchable(nv) for nv in made.versions)
    for i, shape in enumerate(made.shapes):
        ops = v.ops(shape)
        for j, nv in enumerate(made.versions):
            assert nv.op(int(made.table[i, j])) == ops.get(nv.node, v.template.op(nv.node))
    # the bytes a DeviceSwitch would copy, and far fewer than a span a node from the first
    # differing byte to the last (what the tables held before run 21)
    blob, _ = _tables(made.versions, made.table, [0] * len(made.versions))
    assert made.device_bytes() == len(blob)
    whole = 0
    for nv in made.versions:
        args = nv.arrays()[0]
        differ = np.flatnonzero((args != args[:1]).any(axis=0))
        if len(differ):
            whole += len(nv) * (int(differ[-1]) // 8 - int(differ[0]) // 8 + 1) * 8
    assert len(blob) < whole / 3
