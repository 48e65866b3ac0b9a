"""Stream capture of work issued through the driver (raw kernels, copies, memsets)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cuda.bindings import driver

from grape.cuda.buffers import BufferMap
from grape.cuda.build import Graph
from grape.cuda.check import call
from grape.cuda.context import current_context
from grape.cuda.walk import read_graph
from grape.errors import CaptureError

__all__ = ["abandon_capture", "capture", "captured_nodes"]


def capture(issue: Callable[[Any], None], buffers: BufferMap | None = None,
            stream: Any = None) -> Graph:
    """Capture what ``issue(stream)`` enqueues on ``stream`` into a graph and its IR.

    Raises
    ------
    CaptureError
        ``issue`` raised, or the capture was invalidated (a synchronising call, a copy from
        pageable memory); the capture is ended either way.
    """
    current_context()
    own = stream is None
    if own:
        stream = call(driver.cuStreamCreate, driver.CUstream_flags.CU_STREAM_NON_BLOCKING,
                      doing="creating a capture stream")
    mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    call(driver.cuStreamBeginCapture, stream, mode, doing="beginning stream capture")
    failure: BaseException | None = None
    try:
        issue(stream)
    except Exception as e:  # whatever broke it, the capture must end before anything else
        failure = e
    status, graph = driver.cuStreamEndCapture(stream)
    if own:
        driver.cuStreamDestroy(stream)
    if failure is not None or status != driver.CUresult.CUDA_SUCCESS:
        if graph is not None and int(graph):
            driver.cuGraphDestroy(graph)
        why = failure if failure is not None else status.name
        raise CaptureError(f"expected the captured work to enqueue asynchronously, found the "
                           f"capture broken: {why}")
    return Graph(read_graph(graph, buffers), graph, owned=True)


_NONE = driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def abandon_capture(stream: int) -> bool:
    """End whatever capture ``stream`` is in (active, or invalidated by a forbidden call) and
    drop its graph, so that the stream and the process can go on; whether there was one."""
    current_context()
    status = call(driver.cuStreamIsCapturing, stream, doing="asking whether a stream captures")
    if status == _NONE:
        return False
    # An invalidated capture ends with an error and no graph: that is the expected outcome.
    _, graph = driver.cuStreamEndCapture(stream)
    if graph is not None and int(graph):
        call(driver.cuGraphDestroy, graph, doing="destroying an abandoned capture's graph")
    return True


_ACTIVE = driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE


def captured_nodes(stream: int) -> int:
    """How many nodes the graph ``stream`` is capturing into holds so far (its top level; 0
    where the stream is not capturing): marks a capture's operations by the nodes they made."""
    status, _, graph, *_ = call(driver.cuStreamGetCaptureInfo, stream,
                                doing="reading the stream's capture")
    if status != _ACTIVE:
        return 0
    return call(driver.cuGraphGetNodes, graph, 0, doing="counting graph nodes")[1]
