"""Device-side kernel node updates (CUDA 12.4+, ``cudaGraphKernelNodeUpdatesApply``): what the
driver allows and what they cost, against host-side ``cuGraphExecKernelNodeSetParams``.

A family switches shapes by updating the kernel nodes a shape changes, from the host, one
driver call a node (about 85 nodes a step for GPT-2 small decode). Nodes made *device-
updatable* take their new arguments and grid from a kernel instead: one launch for all of them,
and, inside a graph, from a kernel node that reads the shape from device memory, which is what
a device loop over a growing length would need. This script answers, on the GPU at hand:

1. whether a kernel launched before an executable can update its nodes (``standalone``);
2. whether a kernel node inside the executable can update the nodes after it, for the same
   launch (``in_graph``);
3. whether that works inside a WHILE body, one shape per iteration (``in_while``);
4. the cost per step of each way against host updates, with ``nodes`` kernels of ``arg_bytes``
   of arguments each, every one updated every step (whole arguments and grid).

Run: ``python benchmarks/device_updates.py [--nodes 84] [--arg-bytes 656] [--out F]``. Each
check compares the executable's result with what the updates asked for, so a way the driver
takes but ignores reads as failed. Found on the H200 (``results/device_updates_h200/``): every
way works once the executable is uploaded (``cuGraphUpload``; without it, the standalone and
in-graph updates failed with an invalid value and the WHILE body's did not:
``probe1_before_upload.json``, run before the checks uploaded), and
costs 7 to 12 us of host time a step against 99 for host updates (``probe2.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from cuda.bindings import driver

from grape.cuda.build import kernel_params
from grape.cuda.check import call
from grape.cuda.conditional import SOURCE as CONDITIONS
from grape.cuda.context import current_context
from grape.cuda.nvrtc import Module, kernel_op

SOURCE = CONDITIONS + r"""
// cudaGraphKernelNodeUpdate of cuda_runtime_api.h (40 bytes; field 1: grid, 2: argument bytes).
struct __align__(8) NodeUpdate {
    void* node; unsigned field; unsigned pad;
    union { struct { unsigned x, y, z; } grid;
            struct { const void* value; unsigned long long offset, size; } param; } data;
};
extern "C" __device__ __cudart_builtin__ int cudaGraphKernelNodeUpdatesApply(
    const NodeUpdate* updates, unsigned long long count);

// The node under test: ARG_BYTES of arguments, of which it reads the first float and a pointer.
struct __align__(8) Args { float v; float* x; char rest[ARG_BYTES - 16]; };
extern "C" __global__ void grape_probe_add(Args a) {
    if (threadIdx.x == 0) atomicAdd(&a.x[blockIdx.x], a.v);
}

// One thread a node: node i takes row *shape of the table (whole arguments) and its grid.
extern "C" __global__ void grape_probe_update(void* const* nodes, const char* table,
                                             const unsigned* grids, int n, const int* shape,
                                             int* status) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long row = (long long)(*shape) * n + i;
    NodeUpdate u[2];
    u[0].node = nodes[i]; u[0].field = 2;
    u[0].data.param.value = table + row * ARG_BYTES;
    u[0].data.param.offset = 0; u[0].data.param.size = ARG_BYTES;
    u[1].node = nodes[i]; u[1].field = 1;
    u[1].data.grid.x = grids[row]; u[1].data.grid.y = 1; u[1].data.grid.z = 1;
    int s = cudaGraphKernelNodeUpdatesApply(u, 2);
    if (s) atomicExch(status, s);
}

// A WHILE body's last node: the next shape, and go on while shapes are left.
extern "C" __global__ void grape_probe_next(cudaGraphConditionalHandle h, int* shape, int last) {
    *shape += 1;
    cudaGraphSetConditional(h, *shape <= last ? 1u : 0u);
}
"""


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class Probe:
    def __init__(self, nodes: int, arg_bytes: int, shapes: int) -> None:
        self.n, self.arg_bytes, self.shapes = nodes, arg_bytes, shapes
        self.module = Module(SOURCE, name="grape_device_updates.cu",
                             options=[f"-DARG_BYTES={arg_bytes}"])
        self.add = self.module.function("grape_probe_add")
        self.update = self.module.function("grape_probe_update")
        self.next = self.module.function("grape_probe_next")
        self.ctx = current_context()
        dev = torch.device("cuda")
        self.x = torch.zeros(64, device=dev)
        # Shape s gives node i the value (s + 1) * (i + 1) and a grid of 1 + (s + i) % 4
        # blocks: a result that says which shape's arguments and grids every node ran with.
        table = np.zeros((shapes, nodes, arg_bytes), dtype=np.uint8)
        grids = np.zeros((shapes, nodes), dtype=np.uint32)
        for s in range(shapes):
            for i in range(nodes):
                table[s, i] = np.frombuffer(self._args((s + 1) * (i + 1)), dtype=np.uint8)
                grids[s, i] = 1 + (s + i) % 4
        self.table_host, self.grids_host = table, grids
        self.table = torch.from_numpy(table).to(dev)
        self.grids = torch.from_numpy(grids.view(np.int32)).to(dev)
        self.shape = torch.zeros(1, dtype=torch.int32, device=dev)
        self.status = torch.zeros(1, dtype=torch.int32, device=dev)
        self.dev_nodes = torch.zeros(nodes, dtype=torch.int64, device=dev)

    def _args(self, v: float) -> bytes:
        return (np.float32(v).tobytes() + b"\0" * 4 + _ptr(self.x).to_bytes(8, "little")
                + b"\0" * (self.arg_bytes - 16))

    def expected(self, shapes: list[int]) -> np.ndarray:
        out = np.zeros(64, dtype=np.float64)
        for s in shapes:
            for i in range(self.n):
                out[: self.grids_host[s, i]] += (s + 1) * (i + 1)
        return out

    def _kernel(self, graph, deps, args: bytes, grid: int = 1, func=None):
        op = kernel_op(func or self.add, (grid, 1, 1), (32, 1, 1), [args])
        params, keep = kernel_params(op)
        node = call(driver.cuGraphAddKernelNode, graph, deps, len(deps), params,
                    doing="adding a probe kernel")
        del keep
        return node

    def _updatable(self, node) -> int:
        v = driver.CUkernelNodeAttrValue()
        v.deviceUpdatableKernelNode.deviceUpdatable = 1
        attr = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_DEVICE_UPDATABLE_KERNEL_NODE
        call(driver.cuGraphKernelNodeSetAttribute, node, attr, v,
             doing="making a node device-updatable")
        got = call(driver.cuGraphKernelNodeGetAttribute, node, attr,
                   doing="reading a device node handle")
        return int(got.deviceUpdatableKernelNode.devNode)

    def _chain(self, graph, first_deps, updatable: bool) -> tuple[list, list[int]]:
        """``n`` add kernels one after the other, each with shape 0's arguments."""
        nodes, handles, deps = [], [], list(first_deps)
        for i in range(self.n):
            node = self._kernel(graph, deps, self.table_host[0, i].tobytes(),
                                int(self.grids_host[0, i]))
            nodes.append(node)
            if updatable:
                handles.append(self._updatable(node))
            deps = [node]
        return nodes, handles

    def _updater_args(self) -> bytes:
        from grape.cuda.nvrtc import pack_args
        return pack_args(self.update, [_ptr(self.dev_nodes), _ptr(self.table), _ptr(self.grids),
                                       np.int32(self.n), _ptr(self.shape), _ptr(self.status)])

    def build(self, way: str):
        """An executable for ``way`` (host, standalone, in_graph, in_while) and its nodes."""
        graph = call(driver.cuGraphCreate, 0, doing="creating a graph")
        target, deps = graph, []
        if way == "in_graph":
            deps = [self._kernel_raw(target, [], self.update, self._updater_args(),
                                     (self.n + 127) // 128, 128)]
        nodes, handles = self._chain(target, deps, updatable=way != "host")
        if handles:
            self.dev_nodes.copy_(torch.tensor(handles, dtype=torch.int64))
        exe = call(driver.cuGraphInstantiate, graph, 0, doing=f"instantiating ({way})")
        return graph, exe, nodes

    def _kernel_raw(self, graph, deps, func, args: bytes, grid: int, block: int):
        from grape.cuda.functions import function_id, param_layout
        from grape.ir import Kernel
        ident, name = function_id(func)
        op = Kernel(function=ident, name=name, grid=(grid, 1, 1), block=(block, 1, 1),
                    shared_mem=0, args=args, params=param_layout(func))
        params, keep = kernel_params(op)
        node = call(driver.cuGraphAddKernelNode, graph, deps, len(deps), params,
                    doing=f"adding {name}")
        del keep
        return node


def host_updates(probe: Probe, exe, nodes) -> list[list]:
    """Per shape, the prepared host updates (what a family prepares)."""
    out = []
    for s in range(probe.shapes):
        per = []
        for i, node in enumerate(nodes):
            op = kernel_op(probe.add, (int(probe.grids_host[s, i]), 1, 1), (32, 1, 1),
                           [probe.table_host[s, i].tobytes()])
            params, keep = kernel_params(op)
            per.append((node, params, keep))
        out.append(per)
    return out


def run_check(probe: Probe, way: str) -> dict:
    stream = torch.cuda.current_stream()
    s_handle = stream.cuda_stream
    if way == "in_while":  # one launch walks every shape, one an iteration
        return _while_check(probe, probe.shapes - 1)
    try:
        _graph, exe, nodes = probe.build(way)
    except Exception as e:  # the driver's refusal is the finding
        return {"way": way, "ok": False, "error": f"{type(e).__name__}: {e}"}
    shapes = [1, 2, 0, 2] if probe.shapes > 2 else [1, 0]
    probe.x.zero_()
    probe.status.zero_()
    prepared = host_updates(probe, exe, nodes) if way == "host" else None
    call(driver.cuGraphUpload, exe, s_handle, doing="uploading")
    per_launch = []
    ok = True
    for _k, s in enumerate(shapes):
        probe.x.zero_()
        probe.status.zero_()
        if way == "host":
            for node, params, _ in prepared[s]:
                call(driver.cuGraphExecKernelNodeSetParams, exe, node, params, doing="update")
        else:
            probe.shape.fill_(s)
            if way == "standalone":
                _launch_updater(probe, s_handle)
        call(driver.cuGraphLaunch, exe, s_handle, doing="launching")
        torch.cuda.synchronize()
        got = probe.x.double().cpu().numpy()
        want = probe.expected([s])
        # which shape's values each node ran with: the one its result matches
        ran = [t for t in range(probe.shapes) if np.array_equal(got, probe.expected([t]))]
        status = int(probe.status.item())
        per_launch.append({"shape": s, "status": status, "equal": bool(np.array_equal(got, want)),
                           "matches_shape": ran, "x0": float(got[0]), "want_x0": float(want[0])})
        ok = ok and per_launch[-1]["equal"] and status == 0
    return {"way": way, "ok": ok, "launches": per_launch}


def _while_check(probe: Probe, last: int) -> dict:
    from grape.cuda.nvrtc import pack_args
    stream = torch.cuda.current_stream().cuda_stream
    # rebuild with the right bound in the setter's arguments
    probe_last = last
    graph = call(driver.cuGraphCreate, 0, doing="creating a graph")
    handle = call(driver.cuGraphConditionalHandleCreate, graph, probe.ctx, 1,
                  driver.CU_GRAPH_COND_ASSIGN_DEFAULT, doing="creating a WHILE handle")
    p = driver.CUgraphNodeParams()
    p.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    p.conditional.handle = handle
    p.conditional.type = driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
    p.conditional.size = 1
    p.conditional.ctx = probe.ctx
    try:
        call(driver.cuGraphAddNode, graph, [], None, 0, p, doing="adding a WHILE node")
        body = p.conditional.phGraph_out[0]
        first = probe._kernel_raw(body, [], probe.update, probe._updater_args(),
                                  (probe.n + 127) // 128, 128)
        nodes, handles = probe._chain(body, [first], updatable=True)
        probe._kernel_raw(body, [nodes[-1]], probe.next,
                          pack_args(probe.next, [int(handle), _ptr(probe.shape),
                                                 np.int32(probe_last)]), 1, 1)
        probe.dev_nodes.copy_(torch.tensor(handles, dtype=torch.int64))
        exe = call(driver.cuGraphInstantiate, graph, 0, doing="instantiating (in_while)")
    except Exception as e:
        return {"way": "in_while", "ok": False, "error": f"{type(e).__name__}: {e}"}
    probe.x.zero_()
    probe.shape.zero_()
    probe.status.zero_()
    call(driver.cuGraphLaunch, exe, stream, doing="launching")
    torch.cuda.synchronize()
    got = probe.x.double().cpu().numpy()
    want = probe.expected(list(range(last + 1)))
    status = int(probe.status.item())
    return {"way": "in_while", "ok": bool(np.array_equal(got, want)) and status == 0,
            "status": status, "max_error": float(np.abs(got - want).max()),
            "iterations": last + 1}


def _launch_updater(probe: Probe, stream) -> None:
    from grape.cuda.nvrtc import launch
    launch(probe.update, ((probe.n + 127) // 128, 1, 1), (128, 1, 1),
           [_ptr(probe.dev_nodes), _ptr(probe.table), _ptr(probe.grids), np.int32(probe.n),
            _ptr(probe.shape), _ptr(probe.status)], stream=stream)


def timing(probe: Probe, way: str, steps: int, synced: bool) -> dict:
    """Host seconds spent issuing a step (updates and launch) and wall time a step. (The
    executable is not uploaded first: a standalone switch's first update fails until the first
    launch uploads it, one of the 10 steps left out of the figures; the status is not read.)"""
    stream = torch.cuda.current_stream()
    s_handle = stream.cuda_stream
    _graph, exe, nodes = probe.build(way)
    prepared = host_updates(probe, exe, nodes) if way == "host" else None
    upd_args = None
    if way == "standalone":
        op = kernel_op(probe.update, ((probe.n + 127) // 128, 1, 1), (128, 1, 1),
                       [_ptr(probe.dev_nodes), _ptr(probe.table), _ptr(probe.grids),
                        np.int32(probe.n), _ptr(probe.shape), _ptr(probe.status)])
        upd_args = kernel_params(op)
    issue, walls = [], []
    fn = driver.cuGraphExecKernelNodeSetParams
    for k in range(steps + 10):
        s = k % probe.shapes
        t0 = time.perf_counter()
        if way == "host":
            for node, params, _ in prepared[s]:
                fn(exe, node, params)
        else:
            # the shape number a device loop would keep on the device; here the host writes it
            # (4 bytes) before the step, as a family's host loop would
            probe.shape.fill_(s)
            if way == "standalone":
                p = upd_args[0]
                driver.cuLaunchKernel(probe.update, p.gridDimX, 1, 1, p.blockDimX, 1, 1, 0,
                                      s_handle, p.kernelParams, 0)
        t1 = time.perf_counter()
        driver.cuGraphLaunch(exe, s_handle)
        if synced:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if k >= 10:
            issue.append(t1 - t0)
            walls.append(t2 - t0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for k in range(steps):
        probe.shape.fill_(k % probe.shapes) if way != "host" else None
        if way == "host":
            for node, params, _ in prepared[k % probe.shapes]:
                fn(exe, node, params)
        elif way == "standalone":
            p = upd_args[0]
            driver.cuLaunchKernel(probe.update, p.gridDimX, 1, 1, p.blockDimX, 1, 1, 0,
                                  s_handle, p.kernelParams, 0)
        driver.cuGraphLaunch(exe, s_handle)
    torch.cuda.synchronize()
    pipelined = (time.perf_counter() - t) / steps
    return {"way": way, "synced": synced, "issue_us": statistics.median(issue) * 1e6,
            "step_us_synced" if synced else "step_us": statistics.median(walls) * 1e6,
            "pipelined_step_us": pipelined * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=84)
    ap.add_argument("--arg-bytes", type=int, default=656)
    ap.add_argument("--shapes", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.cuda.init()
    probe = Probe(args.nodes, args.arg_bytes, args.shapes)
    checks = [run_check(probe, way) for way in ("host", "standalone", "in_graph", "in_while")]
    for c in checks:
        print(json.dumps(c), flush=True)
    times = []
    for way in ("host", "standalone", "in_graph"):
        if not next(c for c in checks if c["way"] == way)["ok"]:
            continue
        for synced in (True, False):
            times.append(timing(probe, way, args.steps, synced))
            print(json.dumps(times[-1]), flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": " ".join(["benchmarks/device_updates.py", *(argv or sys.argv[1:])]),
              "nodes": args.nodes, "arg_bytes": args.arg_bytes, "checks": checks,
              "timings": times}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(f"{'way':<11} {'ok':<5} {'issue us (synced)':>18} {'synced step us':>15} "
          f"{'pipelined step us':>18}")
    for c in checks:
        t = [x for x in times if x["way"] == c["way"]]
        synced = next((x for x in t if x["synced"]), {})
        print(f"{c['way']:<11} {c['ok']!s:<5} {synced.get('issue_us', float('nan')):>18.1f} "
              f"{synced.get('step_us_synced', float('nan')):>15.1f} "
              f"{next((x['pipelined_step_us'] for x in t if not x['synced']), float('nan')):>18.1f}"
              + (f"  {c.get('error', '')[:90]}" if not c["ok"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
