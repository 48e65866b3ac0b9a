"""IF nodes added to a stream capture in progress, their bodies captured from a second stream.

What ``cuStreamBeginCaptureToGraph`` makes possible (CUDA 12.3+): while a stream captures a
graph, add a conditional node to that graph by hand, then capture the work of the branch on
another stream straight into the node's body graph. The condition is set on the GPU, by grape's
setter kernel captured just before the node, from a boolean the caller's earlier work computed.

This is the driver half; ``grape.torch.control`` points PyTorch's allocator at the capture's
memory pool while a body is captured. The walker (``grape.cuda.walk``) reads conditional nodes
with ``cuGraphNodeGetParams``, which some drivers lack (580 among them): nodes made here are
remembered (``grape.cuda.walk.remember_conditional``), so that graphs holding them read back
on those drivers too.
"""

from __future__ import annotations

from dataclasses import dataclass

from cuda.bindings import driver

from grape.cuda.capability import require
from grape.cuda.check import call
from grape.cuda.conditional import condition_kernels
from grape.cuda.context import current_context
from grape.cuda.nvrtc import launch
from grape.cuda.walk import CreatedConditional, remember_conditional
from grape.errors import GrapeError
from grape.ir import ConditionalKind

__all__ = ["Region", "begin_if", "end_region"]

_ACTIVE = driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE


@dataclass
class Region:
    """An IF node being filled: work issued on ``stream`` goes into its body."""

    node: driver.CUgraphNode
    body: driver.CUgraph
    stream: driver.CUstream  # capturing into ``body`` until end_region
    outer: int  # the stream that captures the graph holding the node


def _capture_info(stream: int) -> tuple[driver.CUgraph, list, list, int]:
    status, _, graph, deps, edges, count = call(
        driver.cuStreamGetCaptureInfo, stream, doing="reading the stream's capture")
    if status != _ACTIVE:
        raise GrapeError(f"expected a stream capturing a graph, found capture status "
                         f"{status.name}")
    return graph, list(deps[:count]), list(edges[:count]) if edges else None, count


def begin_if(stream: int, flag: int, body_stream: int) -> Region:
    """Add an IF node on the bool at device address ``flag`` to the graph ``stream`` is
    capturing, after everything captured so far, and start capturing the node's body on
    ``body_stream`` (another stream, idle: creating one here could break a capture in global
    mode). The caller issues the body's work there, then calls :func:`end_region`; ``stream``
    goes on after the node."""
    require(ConditionalKind.IF)
    if int(body_stream) == int(stream):
        raise GrapeError("expected the IF body to be captured on a stream of its own, found "
                         "the capturing stream itself")
    graph, _, _, _ = _capture_info(stream)
    ctx = current_context()
    handle = call(driver.cuGraphConditionalHandleCreate, graph, ctx, 0, 0,
                  doing="creating an IF node's handle")
    launch(condition_kernels().function("grape_set_from_bool"), (1, 1, 1), (1, 1, 1),
           [int(handle), flag], stream=stream)  # captured: the GPU sets the handle
    graph, deps, edges, count = _capture_info(stream)
    p = driver.CUgraphNodeParams()
    p.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    p.conditional.handle = handle
    p.conditional.type = driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF
    p.conditional.size = 1
    p.conditional.ctx = ctx
    node = call(driver.cuGraphAddNode, graph, deps, edges, count, p,
                doing="adding an IF node to the capture")
    body = p.conditional.phGraph_out[0]
    remember_conditional(node, CreatedConditional(p.conditional.type, 1, int(handle), (body,)))
    call(driver.cuStreamUpdateCaptureDependencies, stream, [node], None, 1,
         driver.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES,
         doing="making the capture go on after the IF node")
    # Relaxed: the caller's allocator may reach the driver (cudaMalloc into the pool) while
    # the body captures, which global mode would treat as an error for the whole capture.
    call(driver.cuStreamBeginCaptureToGraph, body_stream, body, None, None, 0,
         driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED,
         doing="starting the IF node's body capture")
    return Region(node, body, driver.CUstream(int(body_stream)), stream)


def end_region(region: Region) -> None:
    """End the body's capture; the IF node stays in the graph, ``region.stream`` is free."""
    call(driver.cuStreamEndCapture, region.stream, doing="ending the IF node's body capture")
