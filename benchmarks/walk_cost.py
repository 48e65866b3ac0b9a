"""Where reading one captured graph into the IR goes (GPU): GPT-2 small decode at KV length N,
captured once by PyTorch, then ``grape.cuda.walk.read_graph`` timed whole and each of its
steps timed apart over every node, best of ``--repeats``.

Written because a deriving family's capture spends about a third of its host time in the walk
(``family_capture_phases.py 1023 --derive-every 16`` on the H200: 29-38 ms a capture of about
300 kernel nodes, 100 us a node), and a cProfile run blamed the pointer lookups, which a fix
(15cc7d8) made cheaper without moving the wall time: the profiler's own cost had inflated
them. ``python benchmarks/walk_cost.py [N] [--repeats R]``.
"""

import argparse
import sys
import time

import torch
from cuda.bindings import driver

from grape.cuda.buffers import BufferMap
from grape.cuda.check import call
from grape.cuda.functions import function_id, param_layout
from grape.cuda.walk import _args, _attributes, _edge_kind, _find_handles, _nodes, read_graph
from grape.ir import BufferRole
from grape.torch.capture import _name

sys.path.insert(0, "benchmarks")
from families import gpt2_decode

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("n", type=int, nargs="?", default=512, help="the KV length captured")
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()

w = gpt2_decode(1, [args.n])
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    w.step(args.n)
torch.cuda.current_stream().wait_stream(side)
g = torch.cuda.CUDAGraph(keep_graph=True)
with torch.cuda.graph(g, stream=side):
    w.step(args.n)
graph = driver.CUgraph(g.raw_cuda_graph())
nodes = _nodes(graph)
kinds = [call(driver.cuGraphNodeGetType, n, doing="type") for n in nodes]
kernels = [n for n, k in zip(nodes, kinds, strict=True)
           if k == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL]
params = [call(driver.cuGraphKernelNodeGetParams, n, doing="params") for n in kernels]
funcs = [p.func if int(p.func) else call(driver.cuKernelGetFunction, p.kern, doing="function")
         for p in params]
layouts = [param_layout(f) for f in funcs]
arg_bytes = [_args(p, q) for p, q in zip(params, layouts, strict=True)]


def best(f) -> float:
    """Best of the repeats, in ms."""
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return 1000 * min(times)


def whole():
    buffers = BufferMap()  # the parameters named first, as grape.torch.capture does
    _name(buffers, "param:", w.params.items(), BufferRole.PARAMETER)
    read_graph(graph, buffers)


def lookups():
    buffers = BufferMap()
    for a in arg_bytes:
        buffers.pointers(a)


def edges():
    _, _, _, count = call(driver.cuGraphGetEdges, graph, 0, doing="edges")
    src, dst, data, _ = call(driver.cuGraphGetEdges, graph, count, doing="edges")
    for u, v, d in zip(src[:count], dst[:count], data[:count], strict=True):
        _edge_kind(d, str(int(u)), str(int(v)))


def launch_fields():
    for p in params:
        ((p.gridDimX, p.gridDimY, p.gridDimZ), (p.blockDimX, p.blockDimY, p.blockDimZ),
         p.sharedMemBytes, int(p.func), int(p.kern), int(p.kernelParams), int(p.extra))


rows = {
    "read_graph (whole)": best(whole),
    "list nodes": best(lambda: _nodes(graph)),
    "node types": best(lambda: [call(driver.cuGraphNodeGetType, n, doing="t") for n in nodes]),
    "kernel params": best(lambda: [call(driver.cuGraphKernelNodeGetParams, n, doing="p")
                                   for n in kernels]),
    "function ids": best(lambda: [function_id(f) for f in funcs]),
    "argument bytes": best(lambda: [_args(p, q) for p, q in zip(params, layouts,
                                                                  strict=True)]),
    "launch attributes": best(lambda: [_attributes(n) for n in kernels]),
    "pointer lookups (fresh map)": best(lookups),
    "launch fields read": best(launch_fields),
    "edges (listed, kinds read)": best(edges),
    "conditional handles found": best(lambda: _find_handles(graph, {})),
}
print(f"GPT-2 small decode at KV {args.n}: {len(nodes)} nodes, {len(kernels)} kernels, "
      f"best of {args.repeats}")
for name, ms in rows.items():
    print(f"  {name:30s} {ms:8.2f} ms  {1000 * ms / max(1, len(kernels)):7.1f} us a kernel")
