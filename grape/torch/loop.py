"""Loops that run on the device: a captured PyTorch body inside a WHILE conditional node.

``DeviceLoop(body, running, max_iterations)`` captures ``body`` (work on CUDA tensors that
updates its own state in place, and writes whether to go on into ``running``, a CUDA boolean
scalar) into the IR, and builds one graph around it:

    memset(remaining = max_iterations) -> set(loop, running) -> WHILE loop { body; next }

where ``set`` and ``next`` are grape's NVRTC setter kernels (``grape.cuda.conditional``):
``next`` counts ``remaining`` down and continues while ``running`` holds and iterations are left.
One :meth:`DeviceLoop.launch` runs the whole loop; the host does not synchronise per
iteration, and it learns the outcome by reading the state back once, when it wants it. A
``prologue`` (work that sets the state up, such as a prompt's prefill and its first token) is
captured too and runs first in the same graph, so that a whole generation is one launch; it is
called with ``prologue_args``, tensors of the caller's that a later launch may find elsewhere
(``grape.torch.aliasing`` points the loop at them).

``concurrent=True`` rebuilds the body and the prologue as the DAG their memory demands
(``grape.passes.concurrency``): operations that touch no common memory run side by side
instead of one after another, which a small decode step's few-SM kernels leave room for.

The body is captured as it is called, so it must have run eagerly at least once before (lazy
initialisation, such as cuBLAS handles, cannot happen inside a capture), and its tensors must
keep their shapes and addresses: an in-place state, such as ``grape.torch.generate``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from grape.cuda.build import Executable, Graph
from grape.cuda.conditional import condition_kernels
from grape.cuda.nvrtc import kernel_op
from grape.errors import GrapeError
from grape.ir import Buffer, BufferRole, HandleRef, Kernel, KernelGraph
from grape.passes.concurrency import Concurrency
from grape.passes.concurrency import concurrent as concurrent_dag
from grape.passes.dependent_launch import dependent_edges
from grape.passes.loops import check_bound, while_loop_graph
from grape.torch.capture import TorchCapture, capture

__all__ = ["DeviceLoop"]

_HANDLE = "grape:loop"


def _setter(name: str, *pointers: int) -> Kernel:
    """One of grape's setter kernels, its first argument the loop's conditional handle (the
    builder writes the handle's value there)."""
    k = kernel_op(condition_kernels().function(name), (1, 1, 1), (1, 1, 1), [0, *pointers])
    return dataclasses.replace(k, handles=(HandleRef(0, _HANDLE),))


class DeviceLoop:
    """``while running and iterations remain: body()``, as one graph launch."""

    def __init__(self, body: Callable[[], Any], running: torch.Tensor, max_iterations: int,
                 params: Mapping[str, torch.Tensor] | None = None,
                 prologue: Callable[..., Any] | None = None,
                 prologue_args: Sequence[torch.Tensor] = (), staging: Any = None,
                 prologue_staging: Any = None, concurrent: bool = False) -> None:
        if not (isinstance(running, torch.Tensor) and running.is_cuda
                and running.dtype == torch.bool and running.numel() == 1):
            found = (f"{running.dtype} of shape {tuple(running.shape)} on {running.device}"
                     if isinstance(running, torch.Tensor) else type(running).__name__)
            raise GrapeError(f"expected the loop condition to be a CUDA boolean scalar, found "
                             f"{found}")
        check_bound(max_iterations)  # before the capture's cost
        self.running = running
        self.remaining = torch.zeros(1, dtype=torch.int32, device=running.device)
        # No warm-up: it would run the body once more on the caller's state.
        # staging: host constants the body copies to the device, through pinned memory
        # (grape.torch.staging), which the caller keeps alive as long as the loop.
        self.capture = capture(body, params=params, warmup=0, instantiate=False,
                               staging=staging, accesses=concurrent)
        # prologue_args: the caller's tensors the prologue reads, named input<i> in the IR so
        # that later launches can be pointed at other tensors (grape.torch.aliasing).
        self.prologue = None if prologue is None else capture(
            prologue, *prologue_args, params=params, warmup=0, instantiate=False,
            staging=staging if prologue_staging is None else prologue_staging,
            accesses=concurrent)
        # "body" and "prologue": their DAGs (concurrent=True), with what they cost in precision
        self.concurrency: dict[str, Concurrency] = {}
        # "body" and "prologue": the programmatic (PDL) edges each is built with
        self.programmatic_edges: dict[str, int] = {}
        body_ir = self._dag("body", self.capture)
        prologue_ir = None if self.prologue is None else self._dag("prologue", self.prologue)
        go = Buffer("grape:running", 1, BufferRole.INTERNAL, address=running.data_ptr())
        left = Buffer("grape:remaining", 4, BufferRole.INTERNAL,
                      address=self.remaining.data_ptr())
        self.ir = while_loop_graph(
            body_ir, left, max_iterations, handle=_HANDLE, extra=(go,),
            start=_setter("grape_set_from_bool", go.address),
            step=_setter("grape_while_bounded", go.address, left.address),
            prologue=prologue_ir)
        self.graph = Graph.build(self.ir)
        self.executable: Executable = self.graph.instantiate()

    def _dag(self, name: str, captured: TorchCapture) -> KernelGraph:
        if captured.accesses:
            dag = self.concurrency[name] = concurrent_dag(captured.ir, captured.accesses,
                                                          captured.allocations)
            graph = dag.graph
        else:
            graph = captured.ir
        # (programmatic edges out of kernels not written for them cost: dependent_edges)
        graph = dependent_edges(graph)
        self.programmatic_edges[name] = sum(
            kind == "programmatic" for *_, kind in graph.edges())
        return graph

    def launch(self, stream: int | None = None) -> None:
        self.executable.launch(torch.cuda.current_stream().cuda_stream
                               if stream is None else stream)

    def close(self) -> None:
        self.executable.close()
        self.graph.close()
