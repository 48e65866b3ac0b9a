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
