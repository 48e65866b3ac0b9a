"""Reading a CUDA graph into the IR, node by node, through cuda.bindings.

Kernel arguments are read through ``kernelParams`` (one host pointer per parameter, sized by
``cuFuncGetParamInfo``) or through the ``extra`` packed buffer, whichever the node holds, and
packed at the offsets the device-side layout gives. Pointers anywhere in those bytes are mapped to
buffers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from cuda.bindings import driver

from grape.cuda import conditional
from grape.cuda.buffers import BufferMap
from grape.cuda.check import call
from grape.cuda.functions import function_id, param_layout
from grape.errors import GrapeError, UnsupportedError
from grape.ir import (
    Conditional,
    ConditionalKind,
    Empty,
    EventRecord,
    EventWait,
    HandleRef,
    Kernel,
    KernelGraph,
    Memcpy,
    Memset,
    Op,
    Param,
)

__all__ = ["ATTRIBUTES", "EDGE_PORTS", "CreatedConditional", "created_params", "event_id",
           "kernel_functions", "read_graph", "remember_conditional", "resolve_event"]

T = driver.CUgraphNodeType
A = driver.CUkernelNodeAttrID

# Launch attributes that change how a kernel runs, with the value field that holds each and its
# default (only values other than the default are recorded).
ATTRIBUTES: dict[str, tuple[driver.CUkernelNodeAttrID, str]] = {
    "cluster_dim": (A.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, "clusterDim"),
    "priority": (A.CU_LAUNCH_ATTRIBUTE_PRIORITY, "priority"),
    "cooperative": (A.CU_LAUNCH_ATTRIBUTE_COOPERATIVE, "cooperative"),
    "mem_sync_domain": (A.CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN, "memSyncDomain"),
    "cluster_scheduling_policy": (A.CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE,
                                  "clusterSchedulingPolicyPreference"),
}

_events: dict[str, driver.CUevent] = {}


@dataclass
class _Walk:
    buffers: BufferMap
    handles: dict[int, str]  # conditional handle value -> its name in the IR


def _host_bytes(address: int, size: int) -> bytes:
    """Copy ``size`` bytes of this process's memory (argument values the driver owns)."""
    return ctypes.string_at(address, size)


def event_id(event: driver.CUevent) -> str:
    ident = f"event@{int(event):#x}"
    _events.setdefault(ident, driver.CUevent(int(event)))  # our own handle, not a struct view
    return ident


def resolve_event(ident: str) -> driver.CUevent:
    """The event behind an IR event identity seen in this process."""
    event = _events.get(ident)
    if event is None:
        raise GrapeError(f"expected an event seen in this process, found {ident!r}")
    return event


def _attribute_value(value: driver.CUkernelNodeAttrValue, field: str) -> int | tuple[int, ...]:
    v = getattr(value, field)
    if field == "clusterDim":
        return (int(v.x), int(v.y), int(v.z))
    return int(v)


def _attributes(node: driver.CUgraphNode) -> tuple:
    found = []
    for name, (attr, field) in ATTRIBUTES.items():
        status, value = driver.cuGraphKernelNodeGetAttribute(node, attr)
        if status != driver.CUresult.CUDA_SUCCESS:
            continue  # not applicable to this node
        v = _attribute_value(value, field)
        if v not in (0, (0, 0, 0), (1, 1, 1)):
            found.append((name, v))
    return tuple(sorted(found))


def _args(p: driver.CUDA_KERNEL_NODE_PARAMS, layout) -> bytes:
    size = max((q.offset + q.size for q in layout), default=0)
    if int(p.kernelParams):
        slots = np.frombuffer(_host_bytes(int(p.kernelParams), 8 * len(layout)), dtype="<u8")
        out = bytearray(size)
        for q, address in zip(layout, slots, strict=True):
            out[q.offset:q.offset + q.size] = _host_bytes(int(address), q.size)
        return bytes(out)
    if int(p.extra):
        return _extra_args(int(p.extra), size)
    if size:
        raise UnsupportedError(f"expected kernel arguments through kernelParams or a packed "
                               f"extra buffer, found neither for a kernel taking {size} bytes")
    return b""


def _extra_args(extra: int, size: int) -> bytes:
    """The packed argument buffer of an ``extra`` array: (key, value) words until END, as
    ``size`` bytes (the parameters' extent)."""
    pointer_key = int(driver.CU_LAUNCH_PARAM_BUFFER_POINTER_AS_INT)
    size_key = int(driver.CU_LAUNCH_PARAM_BUFFER_SIZE_AS_INT)
    end_key = int(driver.CU_LAUNCH_PARAM_END_AS_INT)
    buffer, length, seen = None, size, []
    for i in range(8):  # a handful of pairs at most
        key, value = (int(w) for w in np.frombuffer(_host_bytes(extra + 16 * i, 16), dtype="<u8"))
        seen.append(hex(key))
        if key == end_key:
            break
        if key == pointer_key:
            buffer = value
        elif key == size_key:
            length = int(np.frombuffer(_host_bytes(value, 8), dtype="<u8")[0])
    if buffer is None:
        raise UnsupportedError(f"expected a CU_LAUNCH_PARAM_BUFFER_POINTER in a kernel's extra "
                               f"array, found keys {', '.join(seen)}")
    if length < size:
        # NCCL's kernels declare one 4 KB parameter and are launched with only the bytes they
        # use (144 for an all-reduce seen on the H200): the kernel reads no further, so the
        # rest is zero here, and a rebuilt node passes zeros where the launch passed nothing.
        return _host_bytes(buffer, length) + bytes(size - length)
    return _host_bytes(buffer, size)


# Kernels that set a conditional handle (``cudaGraphSetConditional``) take it as an 8-byte
# parameter of their own; they are known by name: grape's setters (``grape.cuda.conditional``)
# and PyTorch's (``at::cuda::set_conditional_handle_kernel``). A module that sets conditions
# from kernels of its own adds their names (a substring of the mangled name) here.
SETTERS: set[str] = {*conditional.SETTERS, "set_conditional_handle_kernel"}


def is_setter(name: str) -> bool:
    return any(s in name for s in SETTERS)


def _handle_refs(name: str, args: bytes, layout: tuple[Param, ...],
                 handles: dict[int, str]) -> tuple[HandleRef, ...]:
    """Where a setter kernel passes a conditional handle.

    Handle values are small per-graph counters (1, 2, 3 in creation order, on the H200 with
    driver 580), so sizes and strides in any other kernel's arguments equal them: a scan of
    every word took a copy kernel's shape for three handle arguments, which a rebuilt graph,
    whose handles number differently, would have overwritten. Only a setter's whole 8-byte
    parameters count.
    """
    if not handles or not is_setter(name):
        return ()
    return tuple(HandleRef(q.offset, handles[w]) for q in layout if q.size == 8
                 and (w := int.from_bytes(args[q.offset:q.offset + 8], "little")) in handles)


def _kernel(node: driver.CUgraphNode, walk: _Walk) -> Kernel:
    p = call(driver.cuGraphKernelNodeGetParams, node, doing="reading a kernel node")
    func = p.func
    if not int(func) and int(p.kern):  # library kernels come as CUkernel handles
        func = call(driver.cuKernelGetFunction, p.kern, doing="resolving a library kernel")
    ident, name = function_id(func)
    layout = param_layout(func)
    args = _args(p, layout)
    return Kernel(function=ident, name=name, grid=(p.gridDimX, p.gridDimY, p.gridDimZ),
                  block=(p.blockDimX, p.blockDimY, p.blockDimZ), shared_mem=p.sharedMemBytes,
                  attributes=_attributes(node), args=args, params=layout,
                  pointers=walk.buffers.pointers(args),
                  handles=_handle_refs(name, args, layout, walk.handles))


def _endpoint(buffers: BufferMap, kind, device, host, x: int, size: int):
    if kind == driver.CUmemorytype.CU_MEMORYTYPE_HOST:
        return buffers.host_span(int(host) + x, size)
    span = buffers.span(int(device) + x)
    if span is None:
        raise UnsupportedError(f"expected a copy between device allocations, found address "
                               f"{int(device) + x:#x} that the driver does not know")
    return span


def _memcpy(node: driver.CUgraphNode, walk: _Walk) -> Memcpy:
    buffers = walk.buffers
    p = call(driver.cuGraphMemcpyNodeGetParams, node, doing="reading a memcpy node")
    if p.Height > 1 or p.Depth > 1:
        raise UnsupportedError(f"expected one-dimensional copies, found a {p.WidthInBytes} x "
                               f"{p.Height} x {p.Depth} copy")
    size = p.WidthInBytes
    return Memcpy(src=_endpoint(buffers, p.srcMemoryType, p.srcDevice, p.srcHost,
                                p.srcXInBytes, size),
                  dst=_endpoint(buffers, p.dstMemoryType, p.dstDevice, p.dstHost,
                                p.dstXInBytes, size),
                  size=size)


def _memset(node: driver.CUgraphNode, walk: _Walk) -> Memset:
    p = call(driver.cuGraphMemsetNodeGetParams, node, doing="reading a memset node")
    dst = walk.buffers.span(int(p.dst))
    if dst is None:
        raise UnsupportedError(f"expected a memset of device memory, found {int(p.dst):#x}")
    return Memset(dst=dst, value=p.value, element_size=p.elementSize, width=p.width,
                  height=p.height, pitch=p.pitch if p.height > 1 else 0)


_COND_KINDS = {
    driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE: ConditionalKind.WHILE,
    driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_SWITCH: ConditionalKind.SWITCH,
}


@dataclass(frozen=True)
class CreatedConditional:
    """What ``cuGraphNodeGetParams`` would say of a conditional node grape added (fields named
    as the driver's structure's, so that the walker reads either)."""

    type: driver.CUgraphConditionalNodeType
    size: int
    handle: int
    phGraph_out: tuple[driver.CUgraph, ...]


# Conditional nodes grape added to captures (``grape.cuda.regions``), by node handle. Entries
# outlive their graphs only as stale keys: a node at a reused address overwrites its entry.
_CREATED: dict[int, CreatedConditional] = {}


def remember_conditional(node: driver.CUgraphNode, params: CreatedConditional) -> None:
    _CREATED[int(node)] = params


def created_params(node: driver.CUgraphNode) -> CreatedConditional | None:
    """The parameters of a conditional node grape added, or None."""
    return _CREATED.get(int(node))


def _conditional_params(node: driver.CUgraphNode):
    # Nodes grape added during a capture are known without the driver (which may lack
    # cuGraphNodeGetParams).
    made = created_params(node)
    if made is not None:
        return made
    return call(driver.cuGraphNodeGetParams, node, doing="reading a conditional node").conditional


def _conditional(node: driver.CUgraphNode, walk: _Walk) -> Conditional:
    p = _conditional_params(node)
    kind = _COND_KINDS.get(p.type, ConditionalKind.IF if p.size == 1 else ConditionalKind.IF_ELSE)
    bodies = tuple(_walk(p.phGraph_out[i], walk) for i in range(p.size))
    # The handle's default value cannot be read back from the driver.
    return Conditional(type=kind, handle=walk.handles[int(p.handle)], bodies=bodies,
                       default=None)


def _nodes(graph: driver.CUgraph) -> list[driver.CUgraphNode]:
    _, count = call(driver.cuGraphGetNodes, graph, 0, doing="counting graph nodes")
    nodes, _ = call(driver.cuGraphGetNodes, graph, count, doing="listing graph nodes")
    return nodes[:count]


def _function(node: driver.CUgraphNode) -> driver.CUfunction:
    p = call(driver.cuGraphKernelNodeGetParams, node, doing="reading a kernel node")
    if not int(p.func) and int(p.kern):  # library kernels come as CUkernel handles
        return call(driver.cuKernelGetFunction, p.kern, doing="resolving a library kernel")
    return p.func


def kernel_functions(graph: driver.CUgraph | int) -> dict[str, set[str]]:
    """The kernel functions ``graph`` (its conditional bodies too; an integer: a
    ``cudaGraph_t`` such as PyTorch's ``raw_cuda_graph()``) launches, by mangled name: each
    one's identity in the IR (``function_id``, so that it resolves later). Reads nothing else
    of a node (no arguments, no memory): a fraction of :func:`read_graph`'s cost, for a caller
    that only needs to know which functions run."""
    if isinstance(graph, int):
        graph = driver.CUgraph(graph)
    found: dict[str, set[str]] = {}
    for node in _nodes(graph):
        kind = call(driver.cuGraphNodeGetType, node, doing="reading a node's type")
        if kind == T.CU_GRAPH_NODE_TYPE_KERNEL:
            ident, name = function_id(_function(node))
            found.setdefault(name, set()).add(ident)
        elif kind == T.CU_GRAPH_NODE_TYPE_CONDITIONAL:
            p = _conditional_params(node)
            for i in range(p.size):
                for name, idents in kernel_functions(p.phGraph_out[i]).items():
                    found.setdefault(name, set()).update(idents)
    return found


def _find_handles(graph: driver.CUgraph, found: dict[int, str]) -> dict[int, str]:
    """Every conditional handle in ``graph`` and its bodies, named in discovery order."""
    for node in _nodes(graph):
        kind = call(driver.cuGraphNodeGetType, node, doing="reading a node's type")
        if kind == T.CU_GRAPH_NODE_TYPE_CONDITIONAL:
            p = _conditional_params(node)
            found.setdefault(int(p.handle), f"cond{len(found)}")
            for i in range(p.size):
                _find_handles(p.phGraph_out[i], found)
    return found


_READERS: dict[driver.CUgraphNodeType, Callable[[driver.CUgraphNode, _Walk], Op]] = {
    T.CU_GRAPH_NODE_TYPE_KERNEL: _kernel,
    T.CU_GRAPH_NODE_TYPE_MEMCPY: _memcpy,
    T.CU_GRAPH_NODE_TYPE_MEMSET: _memset,
    T.CU_GRAPH_NODE_TYPE_EMPTY: lambda node, walk: Empty(),
    T.CU_GRAPH_NODE_TYPE_EVENT_RECORD: lambda node, walk: EventRecord(event_id(call(
        driver.cuGraphEventRecordNodeGetEvent, node, doing="reading an event record node"))),
    T.CU_GRAPH_NODE_TYPE_WAIT_EVENT: lambda node, walk: EventWait(event_id(call(
        driver.cuGraphEventWaitNodeGetEvent, node, doing="reading an event wait node"))),
    T.CU_GRAPH_NODE_TYPE_CONDITIONAL: _conditional,
}


def _walk(graph: driver.CUgraph, walk: _Walk) -> KernelGraph:
    ir = KernelGraph()
    names = {}
    for i, node in enumerate(_nodes(graph)):
        kind = call(driver.cuGraphNodeGetType, node, doing="reading a node's type")
        reader = _READERS.get(kind)
        if reader is None:
            raise UnsupportedError(f"node {i}: expected a kernel, memcpy, memset, empty, event "
                                   f"or conditional node, found {kind.name}")
        names[int(node)] = ir.add(f"n{i}", reader(node, walk))
    _, _, _, edges = call(driver.cuGraphGetEdges, graph, 0, doing="counting graph edges")
    if edges:
        src, dst, data, _ = call(driver.cuGraphGetEdges, graph, edges,
                                 doing="listing graph edges")
        for u, v, d in zip(src[:edges], dst[:edges], data[:edges], strict=True):
            ir.add_edge(names[int(u)], names[int(v)], _edge_kind(d, names[int(u)],
                                                                  names[int(v)]))
    return ir


# An IR edge's kind (grape.ir.EDGE_KINDS) and the upstream kernel node's port it leaves from.
EDGE_PORTS = {"programmatic": driver.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC,
              "launch_order": driver.CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER}
_KINDS = {int(port): kind for kind, port in EDGE_PORTS.items()}


def _edge_kind(data: driver.CUgraphEdgeData, before: str, after: str) -> str | None:
    """An edge's kind in the IR (``grape.ir.EDGE_KINDS``; None: a full dependency). One the IR
    cannot say is refused: made full it would run, but not as captured."""
    kind, port = int(data.type), int(data.from_port)
    if kind == int(driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_DEFAULT) and port == 0:
        return None
    if (kind == int(driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
            and port in _KINDS and int(data.to_port) == 0):
        return _KINDS[port]
    raise UnsupportedError(f"edge {before!r} -> {after!r}: expected a full, programmatic or "
                           f"launch-order dependency, found type {kind} from port {port} to "
                           f"port {int(data.to_port)}")


def read_graph(graph: driver.CUgraph, buffers: BufferMap | None = None) -> KernelGraph:
    """The IR of a CUDA graph, with a buffer table of every buffer its nodes touch.

    Raises
    ------
    UnsupportedError
        A node type or copy shape grape does not model (host, child-graph, allocation nodes;
        2D or 3D copies).
    CudaError
        A driver call failed.
    """
    buffers = buffers or BufferMap()
    ir = _walk(graph, _Walk(buffers, _find_handles(graph, {})))
    buffers.install(ir)
    return ir
