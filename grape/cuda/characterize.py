"""Measuring the constants the simulator needs, on the current GPU, through cuda.bindings.

Every constant is measured against the quantity it depends on (node count, iterations, bytes)
and fitted with a line, so the profile says both the points and the model. Host times are
``perf_counter`` around the driver call as grape's Python makes it; GPU times come from CUDA
events. Each point is the median of several repetitions after a warm-up.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from cuda.bindings import driver

from grape.cuda.build import Graph
from grape.cuda.check import call
from grape.cuda.conditional import condition_kernels
from grape.cuda.context import current_context, synchronize
from grape.cuda.memory import executable_memory
from grape.cuda.nvrtc import Module, kernel_op
from grape.errors import CudaError
from grape.ir import (
    Buffer,
    BufferRole,
    Conditional,
    ConditionalKind,
    HandleRef,
    KernelGraph,
    Memcpy,
    Memset,
    Pointer,
    Span,
)

__all__ = ["characterize"]

EMPTY = r"""
extern "C" __global__ void grape_empty() {}
extern "C" __global__ void grape_touch(float* y) { if (threadIdx.x == 0) y[0] += 1.0f; }
extern "C" __global__ void grape_spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
"""
NODES = (1, 10, 50, 100, 200, 500, 1000)
# The measurements, by the name ``grape characterize --only`` takes, and what each is.
STEPS = {"eager_launch": "eager launch", "graph_launch": "graph launch",
         "graph_gap": "gap between graph kernels", "instantiate": "instantiate and upload",
         "update": "executable update", "conditional": "conditional nodes",
         "copies": "device-to-device copies",
         "graph_copy_nodes": "copy and memset nodes in a graph", "memory": "executable memory"}


def _stats(samples: Sequence[float]) -> dict[str, float]:
    q = np.percentile(samples, [10, 50, 90])
    return {"median": float(q[1]), "p10": float(q[0]), "p90": float(q[2]),
            "samples": len(samples)}


def _fit(x: Sequence[float], y: Sequence[float], intercept: str, slope: str) -> dict[str, float]:
    b, a = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return {intercept: float(a), slope: float(b)}


def _host_us(fn: Callable[[], Any], reps: int, setup: Callable[[], Any] | None = None) -> float:
    samples = []
    for _ in range(reps):
        if setup:
            setup()
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    return statistics.median(samples)


class _Events:
    def __init__(self) -> None:
        self.start = call(driver.cuEventCreate, 0, doing="creating an event")
        self.end = call(driver.cuEventCreate, 0, doing="creating an event")

    def gpu_us(self, fn: Callable[[], Any], reps: int) -> float:
        samples = []
        for _ in range(reps):
            call(driver.cuEventRecord, self.start, 0, doing="recording an event")
            fn()
            call(driver.cuEventRecord, self.end, 0, doing="recording an event")
            call(driver.cuEventSynchronize, self.end, doing="waiting for an event")
            ms = call(driver.cuEventElapsedTime, self.start, self.end, doing="timing events")
            samples.append(ms * 1000)
        return statistics.median(samples)


def _chain(op, n: int) -> KernelGraph:
    g = KernelGraph()
    prev: list[str] = []
    for i in range(n):
        prev = [g.add(f"k{i}", op, after=prev)]
    return g


def _eager(module: Module, reps: int) -> dict[str, Any]:
    func = module.function("grape_empty")
    samples = []
    for _ in range(reps // 200):
        for _ in range(200):  # fewer than the ~1000 the launch queue holds: the host never stalls
            t = time.perf_counter()
            call(driver.cuLaunchKernel, func, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0, doing="launching")
            samples.append((time.perf_counter() - t) * 1e6)
        synchronize()
    return _stats(samples)


def _graph_launch(empty, events: _Events, reps: int) -> dict[str, Any]:
    host, gpu = [], []
    for n in NODES:
        with Graph.build(_chain(empty, n)) as g, g.instantiate() as exe:
            exe.launch()
            synchronize()
            host.append(_host_us(exe.launch, reps, setup=synchronize))
            gpu.append(events.gpu_us(exe.launch, reps))
    return {"nodes": list(NODES), "host_us": host, "gpu_us": gpu,
            "fit": {**_fit(NODES, host, "host_fixed_us", "host_per_node_us"),
                    **_fit(NODES, gpu, "gpu_fixed_us", "gpu_per_node_us")}}


def _gap(module: Module, events: _Events, reps: int, nodes: int = 200) -> dict[str, Any]:
    """The GPU front end's gap between consecutive kernels of a graph.

    Chains of kernels that spin for C and for 2C cycles take n(D + gap) and n(2D + gap):
    two equations give the kernel's duration D and the gap, whatever the kernel's own cost.
    """
    spin = module.function("grape_spin")
    per_node = {}
    for cycles in (2000, 4000):
        op = kernel_op(spin, (1, 1, 1), (32, 1, 1), [np.int64(cycles)])
        with Graph.build(_chain(op, nodes)) as g, g.instantiate() as exe:
            exe.launch()
            per_node[cycles] = events.gpu_us(exe.launch, reps) / nodes
    return {"nodes": nodes, "per_node_us": {str(c): v for c, v in per_node.items()},
            "kernel_us": per_node[4000] - per_node[2000],
            "gap_us": 2 * per_node[2000] - per_node[4000]}


def _instantiate(empty, reps: int) -> dict[str, Any]:
    inst, upload = [], []
    for n in NODES:
        with Graph.build(_chain(empty, n)) as g:
            times_i, times_u = [], []
            for _ in range(reps):
                synchronize()
                t = time.perf_counter()
                exe = call(driver.cuGraphInstantiate, g.handle, 0, doing="instantiating")
                t1 = time.perf_counter()
                call(driver.cuGraphUpload, exe, 0, doing="uploading")
                synchronize()
                t2 = time.perf_counter()
                call(driver.cuGraphExecDestroy, exe, doing="destroying an executable")
                times_i.append((t1 - t) * 1e6)
                times_u.append((t2 - t1) * 1e6)
            inst.append(statistics.median(times_i))
            upload.append(statistics.median(times_u))
    return {"instantiate": {"nodes": list(NODES), "us": inst,
                            "fit": _fit(NODES, inst, "fixed_us", "per_node_us")},
            "upload": {"nodes": list(NODES), "us": upload,
                       "fit": _fit(NODES, upload, "fixed_us", "per_node_us")}}


def _update(module: Module, reps: int) -> dict[str, Any]:
    """Whole-graph update and one node's set-params, between graphs that differ in pointers."""
    from grape.cuda.build import kernel_params

    touch = module.function("grape_touch")
    a = call(driver.cuMemAlloc, 64, doing="allocating")
    b = call(driver.cuMemAlloc, 64, doing="allocating")
    whole = []
    for n in NODES:
        with Graph.build(_chain(kernel_op(touch, (1, 1, 1), (32, 1, 1), [a]), n)) as ga, \
                Graph.build(_chain(kernel_op(touch, (1, 1, 1), (32, 1, 1), [b]), n)) as gb, \
                ga.instantiate() as exe:
            def update(exe=exe, gb=gb):
                status, _ = driver.cuGraphExecUpdate(exe.handle, gb.handle)
                if status != driver.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"cuGraphExecUpdate failed: {status.name}")
            whole.append(_host_us(update, reps))
    with Graph.build(_chain(kernel_op(touch, (1, 1, 1), (32, 1, 1), [a]), 1)) as g, \
            g.instantiate() as exe:
        node = call(driver.cuGraphGetNodes, g.handle, 1, doing="listing nodes")[0][0]
        params, keep = kernel_params(kernel_op(touch, (1, 1, 1), (32, 1, 1), [b]))
        samples = []
        for _ in range(reps * 20):
            t = time.perf_counter()
            call(driver.cuGraphExecKernelNodeSetParams, exe.handle, node, params,
                 doing="setting a node's parameters")
            samples.append((time.perf_counter() - t) * 1e6)
        del keep
    for ptr in (a, b):
        driver.cuMemFree(ptr)
    return {"exec_update": {"nodes": list(NODES), "us": whole,
                            "fit": _fit(NODES, whole, "fixed_us", "per_node_us")},
            "kernel_node_set_params_us": _stats(samples)}


def _conditional(module: Module, events: _Events, reps: int) -> dict[str, Any]:
    """GPU time of a WHILE loop against iterations, beside the same kernels unrolled, and of an
    IF node taken and skipped."""
    conditions = condition_kernels()
    touch = module.function("grape_touch")
    y = call(driver.cuMemAlloc, 64, doing="allocating")
    count = call(driver.cuMemAlloc, 64, doing="allocating")
    table = {"y": Buffer("y", 64, BufferRole.INTERNAL, address=int(y)),
             "count": Buffer("count", 64, BufferRole.INTERNAL, address=int(count))}
    bump = replace(kernel_op(touch, (1, 1, 1), (32, 1, 1), [y]),
                   pointers=(Pointer(0, Span("y")),))
    step = replace(kernel_op(conditions.function("grape_count_down"), (1, 1, 1), (1, 1, 1),
                             [0, count]),
                   pointers=(Pointer(8, Span("count")),), handles=(HandleRef(0, "loop"),))
    iterations = (1, 10, 100, 1000)
    loop_us, unrolled_us = [], []
    for n in iterations:
        body = KernelGraph()
        body.add("bump", bump)
        body.add("step", step, after=["bump"])
        g = KernelGraph()
        for b in table.values():
            g.add_buffer(b)
        g.add("loop", Conditional(ConditionalKind.WHILE, "loop", (body,), default=1))
        plain = _chain(bump, 2 * n)
        for b in table.values():
            plain.add_buffer(b)

        def reset(n=n):
            call(driver.cuMemsetD32Async, count, n, 1, 0, doing="setting the loop count")

        with Graph.build(g) as gw, gw.instantiate() as loop, \
                Graph.build(plain) as gp, gp.instantiate() as flat:
            loop_us.append(events.gpu_us(lambda loop=loop, reset=reset: (reset(), loop.launch()),
                                         reps))
            unrolled_us.append(events.gpu_us(flat.launch, reps))
    # IF: a setter kernel, then the node with one kernel in its body; taken and not taken,
    # beside two plain kernels (the same work with no condition).
    setter = replace(kernel_op(conditions.function("grape_set_from_int"), (1, 1, 1), (1, 1, 1),
                               [0, count]),
                     pointers=(Pointer(8, Span("count")),), handles=(HandleRef(0, "if"),))
    body = KernelGraph()
    body.add("bump", bump)
    g = KernelGraph()
    for b in table.values():
        g.add_buffer(b)
    g.add("set", setter)
    g.add("if", Conditional(ConditionalKind.IF, "if", (body,), default=0), after=["set"])
    if_us = {}
    with Graph.build(g) as gi, gi.instantiate() as exe:
        for label, flag in (("taken", 1), ("skipped", 0)):
            call(driver.cuMemsetD32, count, flag, 1, doing="setting the IF flag")
            if_us[label] = events.gpu_us(exe.launch, reps)
    for ptr in (y, count):
        driver.cuMemFree(ptr)
    fit_loop = _fit(iterations, loop_us, "fixed_us", "per_iteration_us")
    fit_flat = _fit([2 * n for n in iterations], unrolled_us, "fixed_us", "per_node_us")
    return {"while": {"iterations": list(iterations), "body_kernels": 2, "gpu_us": loop_us,
                      "fit": fit_loop},
            "unrolled": {"nodes": [2 * n for n in iterations], "gpu_us": unrolled_us,
                         "fit": fit_flat},
            "while_overhead_per_iteration_us": fit_loop["per_iteration_us"]
            - 2 * fit_flat["per_node_us"],
            "if": {"taken_gpu_us": if_us["taken"], "skipped_gpu_us": if_us["skipped"],
                   "two_plain_kernels_gpu_us": unrolled_us[0],
                   "overhead_us": if_us["taken"] - unrolled_us[0]}}


def _copies(events: _Events, reps: int) -> dict[str, Any]:
    sizes = [1 << k for k in (16, 20, 24, 26, 28, 30)]
    src = call(driver.cuMemAlloc, sizes[-1], doing="allocating a copy source")
    dst = call(driver.cuMemAlloc, sizes[-1], doing="allocating a copy destination")
    call(driver.cuMemsetD8, src, 7, sizes[-1], doing="filling the copy source")
    us = [events.gpu_us(lambda n=n: call(driver.cuMemcpyDtoDAsync, dst, src, n, 0,
                                         doing="copying"), reps) for n in sizes]
    for ptr in (src, dst):
        driver.cuMemFree(ptr)
    fit = _fit(sizes, us, "latency_us", "us_per_byte")
    return {"bytes": sizes, "gpu_us": us, "fit": {
        "latency_us": fit["latency_us"],
        # bytes read plus bytes written, per second
        "bandwidth_gb_s": 2 / fit["us_per_byte"] / 1e3}}


def _graph_copy_nodes(module: Module, events: _Events, reps: int,
                      nodes: int = 100) -> dict[str, Any]:
    """GPU time a copy or memset node takes inside a graph, its dispatch included, against its
    size: a chain of empty kernels, and the same chain with a device-to-device copy (a memset)
    after each kernel; the difference per node, what the node costs a graph beyond the kernels
    around it (on the H200: 0.9 us for 4 KiB, 2.1 us for 4 MiB)."""
    empty = kernel_op(module.function("grape_empty"), (1, 1, 1), (32, 1, 1), [])
    sizes = [1 << k for k in (12, 16, 20, 22)]
    src = call(driver.cuMemAlloc, sizes[-1], doing="allocating a copy source")
    dst = call(driver.cuMemAlloc, sizes[-1], doing="allocating a copy destination")
    table = [Buffer("src", sizes[-1], BufferRole.INTERNAL, address=int(src)),
             Buffer("dst", sizes[-1], BufferRole.INTERNAL, address=int(dst))]

    def per_launch(after_each: Memcpy | Memset | None) -> float:
        g = KernelGraph()
        for b in table:
            g.add_buffer(b)
        prev: list[str] = []
        for i in range(nodes):
            prev = [g.add(f"k{i}", empty, after=prev)]
            if after_each is not None:
                prev = [g.add(f"c{i}", after_each, after=prev)]
        with Graph.build(g) as built, built.instantiate() as exe:
            exe.launch()
            return events.gpu_us(exe.launch, reps)

    kernels_only = per_launch(None)
    copy_us = [(per_launch(Memcpy(Span("src"), Span("dst"), n)) - kernels_only) / nodes
               for n in sizes]
    memset_us = [(per_launch(Memset(Span("dst"), 0, 4, n // 4)) - kernels_only) / nodes
                 for n in sizes]
    for ptr in (src, dst):
        driver.cuMemFree(ptr)
    return {"nodes": nodes, "bytes": sizes, "kernel_chain_gpu_us": kernels_only,
            "copy_node_us": copy_us, "memset_node_us": memset_us,
            "copy_fit": _fit(sizes, copy_us, "latency_us", "us_per_byte"),
            "memset_fit": _fit(sizes, memset_us, "latency_us", "us_per_byte")}


def _memory_point(nodes: int, copies: int) -> float:
    """Bytes per executable of an ``nodes``-kernel chain, in this (fresh) process."""
    current_context()
    module = Module(EMPTY, name="grape_characterize.cu")
    empty = kernel_op(module.function("grape_empty"), (1, 1, 1), (32, 1, 1), [])
    with Graph.build(_chain(empty, nodes)) as g:
        return executable_memory(g, copies).per_executable


def _memory() -> dict[str, Any]:
    """Executable memory against node count, each point in a fresh process.

    The driver keeps what destroyed executables held and hands it to the next ones, so points
    measured one after another in one process under-count; trimming does not release it.
    """
    nodes = (10, 100, 200, 500, 1000)
    per_exec = []
    for n in nodes:
        copies = max(20, 40_000 // n)  # tens of megabytes per point, far above the granularity
        out = subprocess.run([sys.executable, "-m", "grape.cuda.characterize", "memory-point",
                              str(n), str(copies)], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise CudaError(f"measuring executable memory in a fresh process failed: "
                            f"{out.stderr.strip().splitlines()[-1:]}, while measuring {n} nodes")
        per_exec.append(float(out.stdout.strip().splitlines()[-1]))
    return {"nodes": list(nodes), "bytes_per_executable": per_exec,
            "fit": _fit(nodes, per_exec, "fixed_bytes", "per_node_bytes")}


def characterize(reps: int = 50, progress: Callable[[str], None] = print,
                 only: Sequence[str] = ()) -> dict[str, Any]:
    """Measure the device profile of the current GPU (a minute or two on an H200); ``only``:
    the steps to run, by name (:data:`STEPS`; default, all)."""
    if unknown := sorted(set(only) - set(STEPS)):
        raise CudaError(f"expected steps among {', '.join(STEPS)}, found {', '.join(unknown)}")
    current_context()
    dev = call(driver.cuCtxGetDevice, doing="reading the current device")
    name = call(driver.cuDeviceGetName, 64, dev, doing="naming the device")
    module = Module(EMPTY, name="grape_characterize.cu")
    empty = kernel_op(module.function("grape_empty"), (1, 1, 1), (32, 1, 1), [])
    events = _Events()
    profile: dict[str, Any] = {
        "schema": "grape.device", "version": 1,
        "device": name.split(b"\0")[0].decode(),
        "driver_version": call(driver.cuDriverGetVersion, doing="reading the driver version"),
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "repetitions": reps,
    }
    measure = {
        "eager_launch": lambda: {"eager_launch_us": {"cuLaunchKernel": _eager(
            module, reps * 40)}},
        "graph_launch": lambda: {"graph_launch": _graph_launch(empty, events, reps)},
        "graph_gap": lambda: {"graph_gap": _gap(module, events, reps)},
        "instantiate": lambda: _instantiate(empty, max(reps // 5, 3)),
        "update": lambda: _update(module, reps),
        "conditional": lambda: {"conditional": _conditional(module, events, reps)},
        "copies": lambda: {"copy_d2d": _copies(events, reps)},
        "graph_copy_nodes": lambda: {"graph_copy_nodes": _graph_copy_nodes(module, events,
                                                                           reps)},
        "memory": lambda: {"executable_memory": _memory()}}
    steps = [(STEPS[name], measure[name]) for name in STEPS if not only or name in only]
    for i, (label, step) in enumerate(steps, 1):
        progress(f"[{i}/{len(steps)}] {label}")
        t = time.perf_counter()
        profile.update(step())
        progress(f"      {time.perf_counter() - t:.1f} s")
    module.close()
    return profile


if __name__ == "__main__" and sys.argv[1:2] == ["memory-point"]:
    print(_memory_point(int(sys.argv[2]), int(sys.argv[3])))
