"""Programmatic edges kept only out of kernels that were themselves launched dependently.

A programmatic (PDL) edge lets a kernel launch before the kernel it depends on has finished:
once every block upstream has signalled (``griddepcontrol.launch_dependents``) or exited; the
kernel downstream waits (``griddepcontrol.wait``) before it reads what the upstream one wrote.
Stream capture makes such an edge wherever a kernel launched with programmatic stream
serialization follows another kernel, whatever that kernel is. Inductor launches each of its
Triton kernels so where PDL is on (``CompiledStep.dependent_launch``): one that follows
cuDNN's attention or one of PyTorch's own kernels gets a programmatic edge out of a kernel
that was never launched dependently, and so was not built to signal early.

Those edges were measured to cost, not to save. A Llama-shaped compiled step (hidden 2048,
22 layers; the same compiled kernels, three loops built from one capture, H100) ran 2.292 ms
a token with every edge as captured, 1.585 with every edge full, and 1.441 with programmatic
edges only out of Inductor's kernels (``benchmarks/README.md``). Which of the two kinds of
upstream kernel (22 attention kernels, 2 of PyTorch's) costs the most was not parted.

:func:`dependent_edges` keeps a programmatic edge only out of a kernel that has a
programmatic edge into it: one launched dependently, by a library that therefore wrote it for
PDL. That is what the capture says about a kernel; its name is not read. The first kernel
written for PDL after a node that is not a kernel (a memset, an event) has no such edge into
it, and its edges out become full too: a little overlap lost, never a wrong order, since a
full dependency is what the programmatic one weakens. Launch-order edges are left alone.
Run it once, on a graph as captured: it reads what the capture says of each kernel, which it
changes (a second run would weaken the edges out of kernels whose edge in the first made full).
"""

from __future__ import annotations

import dataclasses

from grape.ir import Conditional, Kernel, KernelGraph

__all__ = ["dependent_edges"]


def _launched_dependently(graph: KernelGraph, node: str) -> bool:
    return isinstance(graph.op(node), Kernel) and "programmatic" in graph.kinds_into(node).values()


def dependent_edges(graph: KernelGraph) -> KernelGraph:
    """``graph`` with each programmatic edge out of a node not launched dependently made a
    full dependency, in conditional nodes' bodies too (``graph`` is left alone; returned as
    it is where nothing changes)."""
    weakened = [(u, v) for u, v, kind in graph.dag.edges(data="kind")
                if kind == "programmatic" and not _launched_dependently(graph, u)]
    bodies = {node: op for node, op in graph.ops() if isinstance(op, Conditional)}
    ops = {}
    for node, op in bodies.items():
        inner = tuple(dependent_edges(body) for body in op.bodies)
        if any(a is not b for a, b in zip(inner, op.bodies, strict=True)):
            ops[node] = dataclasses.replace(op, bodies=inner)
    if not weakened and not ops:
        return graph
    out = graph.with_ops(ops)
    for u, v in weakened:
        del out.dag.edges[u, v]["kind"]
    return out
