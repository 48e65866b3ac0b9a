"""The driver calls for every version of a node (grape.cuda.build.version_updates), built from
one argument array on the CPU: each must set what ``kernel_params`` sets for that version's
operation, and point into the bytes of its own row."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")

import grape.cuda.build as build
from grape.ir import Kernel, Param, Pointer, Span
from grape.passes.variants import NodeVersions


def _kernel(grid: int, block: int, shared: int, args: bytes) -> Kernel:
    return Kernel("f@0x1", "f", (grid, 2, 1), (block, 1, 1), shared, args=args,
                  params=(Param(0, 8), Param(8, 4), Param(16, 16)),
                  pointers=(Pointer(0, Span("x", 0)),))


@pytest.fixture
def versions(monkeypatch):
    monkeypatch.setattr(build, "resolve", lambda function: 7)
    rng = np.random.default_rng(0)
    nv = NodeVersions("k", _kernel(1, 32, 0, rng.bytes(32)))
    for i in range(1, 6):
        assert nv.add(_kernel(i + 1, 32 * i, 16 * i, rng.bytes(32))) == i
    return nv


def test_each_version_s_call_sets_its_launch_and_points_into_its_own_row(versions):
    updates = build.version_updates("k", "handle", versions)
    assert len(updates) == len(versions)
    for version, u in enumerate(updates):
        op = versions.op(version)
        handle, p = u.args
        expected, _ = build.kernel_params(op)
        assert handle == "handle" and u.fn is build.driver.cuGraphExecKernelNodeSetParams
        for name in ("gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY",
                     "blockDimZ", "sharedMemBytes"):
            assert getattr(p, name) == getattr(expected, name), (version, name)
        values, slots = u.keep
        row = values.ctypes.data + version * values.shape[1]
        assert values[version, :len(op.args)].tobytes() == op.args
        assert slots[version].tolist() == [row + q.offset for q in op.params]
        assert int(p.kernelParams) == slots.ctypes.data + version * slots.strides[0]
    assert len({id(u.keep[0]) for u in updates}) == 1  # one array for every version


def test_a_kernel_without_parameters_passes_none(monkeypatch):
    monkeypatch.setattr(build, "resolve", lambda function: 7)
    bare = Kernel("g@0x2", "g", (1, 1, 1), (1, 1, 1))
    nv = NodeVersions("g", bare)
    nv.add(Kernel("g@0x2", "g", (4, 1, 1), (1, 1, 1)))
    updates = build.version_updates("g", "handle", nv)
    assert [int(u.args[1].kernelParams) for u in updates] == [0, 0]
    assert [u.args[1].gridDimX for u in updates] == [1, 4]


def _taking_handle() -> Kernel:
    from grape.ir import HandleRef
    args = (41).to_bytes(8, "little") + (3).to_bytes(8, "little")
    return Kernel("s@0x3", "s", (1, 1, 1), (1, 1, 1), args=args,
                  params=(Param(0, 8), Param(8, 8)), handles=(HandleRef(0, "loop"),))


def _args(p) -> bytes:
    slots = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint64 * 2).from_address(
        int(p.kernelParams)))
    return b"".join(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 8).from_address(
        int(s))).tobytes() for s in slots)


def test_a_kernel_taking_a_handle_keeps_the_captured_value_unless_given_another(monkeypatch):
    monkeypatch.setattr(build, "resolve", lambda function: 7)
    k = _taking_handle()
    kept, _keep = build.kernel_params(k)  # the arrays it points into stay alive
    assert _args(kept) == k.args  # read from a captured graph: its own handle's value
    given, _keep2 = build.kernel_params(k, {"loop": 99})
    assert _args(given) == (99).to_bytes(8, "little") + (3).to_bytes(8, "little")


def test_an_update_to_a_built_graph_writes_the_handle_that_graph_created(monkeypatch):
    """An executable built from IR has new conditional handles; re-pointing one of its kernels
    that takes a handle (a setter inside a loop that reads the caller's prompt) must pass the
    new value, not the captured one (the H200 run at 301199e failed here: no handles given)."""
    from grape.ir import KernelGraph
    monkeypatch.setattr(build, "resolve", lambda function: 7)
    k = _taking_handle()
    ir = KernelGraph()
    ir.add("s", k)
    graph = object.__new__(build.Graph)  # no driver: only what prepare() reads
    graph.ir, graph.nodes, graph.handles = ir, {"s": "node"}, {"loop": 1234}
    (update,) = graph.prepare({"s": k})
    assert update.args[0] == "node"
    assert _args(update.args[1])[:8] == (1234).to_bytes(8, "little")
