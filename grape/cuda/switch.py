"""Kernel nodes switched between their versions by a kernel on the GPU.

A family brings its executable to a shape by giving the nodes the shape changes their
versions (``grape.passes.variants``). From the host that is one ``cuGraphExecKernelNodeSetParams``
a node: about 85 a step for GPT-2 small decode, about 130 us of host time on the H200's host.
CUDA 12.4 added *device-updatable* kernel nodes, whose arguments and grid a kernel sets with
``cudaGraphKernelNodeUpdatesApply``; :class:`DeviceSwitch` keeps every version of such nodes
on the device (the argument bytes its versions differ in, and the grid: a row each) with a
table of which row each shape takes, and switches all of them in one launch of
``grape_switch_versions``: one thread a node. What the tables hold, and their layout, is
decided without a GPU (``grape.passes.switch_plan``), so the simulator counts the same bytes.
The shape comes as an argument (``launch``, from a host loop); the kernel also reads it from
device memory where given one, for a device loop whose position the GPU keeps (updates made
by a kernel node take effect for the nodes after it in the same launch, WHILE bodies included,
as the probe showed; no device loop uses a switch yet).

What ``benchmarks/device_updates.py`` found on the H200 (driver 580): updates apply only to an
executable already uploaded (``Executable`` uploads at instantiation; without that, a switch
launched before the executable and one at its head both failed with an invalid value), and
block dimensions and shared memory cannot change on the device, so nodes whose versions change
those stay with host updates (``grape.passes.variants.device_switchable``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np
from cuda.bindings import driver

from grape.cuda.build import Graph
from grape.cuda.check import call, check_status
from grape.cuda.context import read_device
from grape.cuda.functions import param_layout
from grape.cuda.nvrtc import Module, pack_args
from grape.cuda.resource import Resource
from grape.errors import CudaError, GrapeError
from grape.passes.switch_plan import tables

if TYPE_CHECKING:  # for annotations; the rule it checks is imported where it is used
    from grape.passes.variants import NodeVersions

__all__ = ["DeviceSwitch"]

SOURCE = r"""
// cudaGraphKernelNodeUpdate of cuda_runtime_api.h: 40 bytes; field 1 the grid, 2 argument bytes.
struct __align__(8) NodeUpdate {
    unsigned long long node; unsigned field; unsigned pad;
    union { struct { unsigned x, y, z; } grid;
            struct { const void* value; unsigned long long offset, size; } param; } data;
};
extern "C" __device__ __cudart_builtin__ int cudaGraphKernelNodeUpdatesApply(
    const NodeUpdate* updates, unsigned long long count);

// Node j of n takes row r = rows[shape * n + j]: the argument bytes its versions differ in,
// as spans first[j] .. first[j + 1] (span s: size[s] bytes from byte start[s] of the
// arguments, held at args + offsets[r] + at[s]), and, where its grid varies (grid_varies[j]),
// the grid at grids[3 * r]. The shape is *shape_at where given (a device loop's position),
// else shape; a node whose row is the one it holds (shape holds, where holds >= 0) is left
// alone. The first failure's error code is kept in *status.
#define GRAPE_UPDATES 8
extern "C" __global__ void grape_switch_versions(
        const unsigned long long* nodes, const unsigned* first, const unsigned* start,
        const unsigned* size, const unsigned* at, const unsigned* grid_varies,
        const long long* offsets, const unsigned* grids, const int* rows,
        const unsigned char* args, int n, int shape, int holds, const int* shape_at,
        int* status) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    long long s = shape_at ? *shape_at : shape;
    long long r = rows[s * n + j];
    if (holds >= 0 && rows[(long long)holds * n + j] == r) return;
    NodeUpdate u[GRAPE_UPDATES];
    int k = 0;
    if (grid_varies[j]) {
        u[k].node = nodes[j]; u[k].field = 1;
        u[k].data.grid.x = grids[3 * r]; u[k].data.grid.y = grids[3 * r + 1];
        u[k].data.grid.z = grids[3 * r + 2];
        k++;
    }
    for (unsigned i = first[j]; i < first[j + 1]; i++) {
        u[k].node = nodes[j]; u[k].field = 2;
        u[k].data.param.value = args + offsets[r] + at[i];
        u[k].data.param.offset = start[i]; u[k].data.param.size = size[i];
        if (++k == GRAPE_UPDATES || i + 1 == first[j + 1]) {
            int e = cudaGraphKernelNodeUpdatesApply(u, k);
            if (e) atomicCAS(status, 0, e);
            k = 0;
        }
    }
    if (k) {
        int e = cudaGraphKernelNodeUpdatesApply(u, k);
        if (e) atomicCAS(status, 0, e);
    }
}
"""

_BLOCK = 128
_ATTR = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_DEVICE_UPDATABLE_KERNEL_NODE


@cache
def _module() -> Module:
    return Module(SOURCE, name="grape_switch.cu")


class DeviceSwitch(Resource):
    """Nodes of one graph made device-updatable, every version of theirs on the device, and the
    kernel that gives them a shape's versions.

    Build it before instantiating ``graph`` (the attribute is part of the node then); the
    executable must be uploaded before :meth:`launch` is first queued.
    """

    def __init__(self, graph: Graph, versions: Sequence[NodeVersions], table: np.ndarray) -> None:
        """``versions``: the nodes to switch; ``table``: (shapes, len(versions)) the version
        each shape gives each of them (0: the template's).

        Raises
        ------
        GrapeError
            A node is not in ``graph`` or not switchable on the device
            (``grape.passes.variants.device_switchable``), ``table`` does not fit
            ``versions``, or a version number is out of range.
        CudaError
            The driver refused to make a node device-updatable.
        """
        from grape.passes.variants import device_switchable

        if odd := next((nv.node for nv in versions if not device_switchable(nv)), None):
            raise GrapeError(f"expected nodes whose versions keep one function, argument layout "
                             f"and block shape, found node {odd!r} changing more")
        table = np.asarray(table, dtype=np.int64)
        if table.ndim != 2 or table.shape[1] != len(versions):
            raise GrapeError(f"expected a table of (shapes, {len(versions)}) version numbers, "
                             f"found shape {table.shape}")
        counts = np.array([len(nv) for nv in versions], dtype=np.int64)
        if len(table) and ((table < 0) | (table >= counts[None, :])).any():
            raise GrapeError("expected version numbers below each node's count of versions, "
                             "found one out of range")
        self.nodes = frozenset(nv.node for nv in versions)  # the nodes it switches
        self.shapes = len(table)
        handles = [self._updatable(graph, nv.node) for nv in versions]
        blob, self._at = tables(versions, table, handles)
        self._size = max(len(blob), 8)
        self.device_bytes = self._size  # the tables, all the device memory a switch holds
        self.address = int(call(driver.cuMemAlloc, self._size,
                                doing="allocating a device switch's tables"))
        self._own(self.address, driver.cuMemFree)
        call(driver.cuMemcpyHtoD, self.address, blob.ctypes.data, len(blob),
             doing="copying a device switch's tables")
        self._func = _module().function("grape_switch_versions")
        self._blocks = max(1, -(-len(versions) // _BLOCK))
        self._args, self._slots, self._shape = self._launch_args()
        self._params = int(self._slots.ctypes.data)  # read once: .ctypes builds an object

    @staticmethod
    def _updatable(graph: Graph, node: str) -> int:
        handle = graph.nodes.get(node)
        if handle is None:
            raise GrapeError(f"expected node {node!r} of a graph built from IR, found no such "
                             f"node")
        v = driver.CUkernelNodeAttrValue()
        v.deviceUpdatableKernelNode.deviceUpdatable = 1
        call(driver.cuGraphKernelNodeSetAttribute, handle, _ATTR, v,
             doing=f"making node {node!r} device-updatable")
        got = call(driver.cuGraphKernelNodeGetAttribute, handle, _ATTR,
                   doing=f"reading node {node!r}'s device handle")
        return int(got.deviceUpdatableKernelNode.devNode)

    def _launch_args(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The kernel's argument bytes (no ``shape_at``: the shape is an argument), the
        parameter pointers into them, and a view of the ``shape`` and ``holds`` arguments,
        written before each launch (the driver copies arguments when a launch is queued)."""
        a = self.address
        values = [a + self._at[k] for k in ("nodes", "first", "start", "size", "at",
                                             "grid_varies", "offsets", "grids", "rows", "args")]
        packed = pack_args(self._func, [*values, np.int32(len(self.nodes)), np.int32(0),
                                        np.int32(-1), 0, a + self._at["status"]])
        buf = np.frombuffer(bytearray(packed), dtype=np.uint8)
        layout = param_layout(self._func)
        slots = np.array([buf.ctypes.data + p.offset for p in layout], dtype=np.uint64)
        # the shape and the shape held: two int32 side by side, written before each launch
        shape = buf[layout[11].offset:layout[12].offset + 4].view(np.int32)
        return buf, slots, shape

    def launch(self, shape: int, stream: Any = 0, holds: int = -1) -> None:
        """Queue the switch to shape number ``shape`` (a row of the table) on ``stream``;
        ``holds``: the shape number the executable holds, whose nodes need no update (-1:
        unknown, every node is written)."""
        if not 0 <= shape < self.shapes or not -1 <= holds < self.shapes:
            raise GrapeError(f"expected shape numbers below {self.shapes}, found {shape} "
                             f"(holding {holds})")
        self._shape[0], self._shape[1] = shape, holds
        status = driver.cuLaunchKernel(self._func, self._blocks, 1, 1, _BLOCK, 1, 1, 0, stream,
                                       self._params, 0)[0]
        if status is not driver.CUresult.CUDA_SUCCESS:
            check_status(status, "launching a device switch")

    def check(self) -> None:
        """Raise if some queued switch failed on the device (reads its status: synchronous)."""
        code = int(np.frombuffer(read_device(self.address + self._at["status"], 4),
                                 dtype=np.int32)[0])
        if code:
            raise CudaError(f"expected the GPU to switch {len(self.nodes)} nodes' versions, "
                            f"found cudaGraphKernelNodeUpdatesApply failing with error {code}")
