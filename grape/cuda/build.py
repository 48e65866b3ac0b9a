"""Building CUDA graphs from the IR, and the executables instantiated from them.

A :class:`Graph` is the state machine's first stage (built, not yet instantiated); an
:class:`Executable` is instantiated and uploaded, launches on a stream, and frees its device
memory on :meth:`Executable.close`, on leaving a ``with`` block, or when collected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import networkx as nx
import numpy as np
from cuda.bindings import driver

from grape.cuda.capability import require
from grape.cuda.check import call, check_status, observing, rebound
from grape.cuda.context import current_context, memory_info, synchronize
from grape.cuda.functions import resolve
from grape.cuda.resource import Resource
from grape.cuda.walk import ATTRIBUTES, EDGE_PORTS, read_graph, resolve_event
from grape.errors import GrapeError, UnsupportedError
from grape.ir import (
    Conditional,
    ConditionalKind,
    Empty,
    EventRecord,
    EventWait,
    Kernel,
    KernelGraph,
    Memcpy,
    Memory,
    Memset,
    Span,
)

if TYPE_CHECKING:  # the backend builds what the passes describe; it never runs them
    from grape.cuda.buffers import BufferMap
    from grape.passes.variants import NodeVersions

__all__ = ["Executable", "Graph", "Update", "can_disable", "kernel_params", "version_updates"]


_SUCCESS = driver.CUresult.CUDA_SUCCESS


def kernel_params(k: Kernel, handles: dict[str, int] | None = None
                  ) -> tuple[driver.CUDA_KERNEL_NODE_PARAMS, tuple[np.ndarray, ...]]:
    """Driver parameters for kernel ``k``, and the host arrays they point into.

    ``handles`` gives the value of each conditional handle the kernel takes as an argument;
    without it the arguments keep the values captured (right for the graph they were read
    from, where the handles are the captured ones). The arrays must outlive the call that takes
    the parameters (the driver copies the argument values then).
    """
    p = driver.CUDA_KERNEL_NODE_PARAMS()
    p.func = resolve(k.function)
    p.gridDimX, p.gridDimY, p.gridDimZ = k.grid
    p.blockDimX, p.blockDimY, p.blockDimZ = k.block
    p.sharedMemBytes = k.shared_mem
    args = bytearray(k.args) or bytearray(1)
    for ref in k.handles if handles is not None else ():
        args[ref.offset:ref.offset + 8] = handles[ref.handle].to_bytes(8, "little")
    values = np.frombuffer(args, dtype=np.uint8)
    base = values.ctypes.data  # read once: each .ctypes access builds a helper object
    slots = np.array([base + q.offset for q in k.params], dtype=np.uint64)
    p.kernelParams = int(slots.ctypes.data) if k.params else 0
    return p, (values, slots)


def version_updates(node: str, handle: Any, versions: NodeVersions) -> list[Update]:
    """Driver calls that give node ``node`` (``handle``, in an executable) each of its kernel
    versions, which are rows of arrays (``NodeVersions.rows``): one argument array and one
    parameter-pointer array for all of them, where :func:`kernel_params` builds two arrays a
    call (about 10 of its 19 us a kernel on this repository's CPU).

    The arrays are kept by every update (the driver reads them when an update is applied)."""
    t = versions.template
    args, dims, _ = versions.arrays()
    count, width = args.shape
    if width and args.flags.c_contiguous:  # the versions' own array: kept alive by the updates
        values = args
    else:
        values = np.zeros((count, max(width, 1)), dtype=np.uint8)
        values[:, :width] = args
    offsets = np.array([q.offset for q in t.params], dtype=np.uint64)
    rows = np.arange(count, dtype=np.uint64)[:, None] * np.uint64(values.shape[1])
    slots = np.ascontiguousarray(np.uint64(values.ctypes.data) + rows + offsets[None, :])
    first, step = int(slots.ctypes.data), 8 * len(t.params)
    func = resolve(t.function)
    keep = (values, slots)
    updates = []
    for i, (gx, gy, gz, bx, by, bz, shared) in enumerate(dims.tolist()):
        p = driver.CUDA_KERNEL_NODE_PARAMS()
        p.func = func
        p.gridDimX, p.gridDimY, p.gridDimZ = gx, gy, gz
        p.blockDimX, p.blockDimY, p.blockDimZ = bx, by, bz
        p.sharedMemBytes = shared
        p.kernelParams = first + i * step if step else 0
        updates.append(Update(node, driver.cuGraphExecKernelNodeSetParams, (handle, p), keep))
    return updates


class Graph(Resource):
    """A CUDA graph and the IR that describes it."""

    def __init__(self, ir: KernelGraph, handle: driver.CUgraph, owned: bool = True) -> None:
        """Wrap ``handle``, the graph ``ir`` describes; use :meth:`build` to make one from IR.

        A graph someone else owns (``owned=False``: PyTorch's) is never destroyed here.
        """
        self.ir = ir
        self.handle = handle
        self.nodes: dict[str, driver.CUgraphNode] = {}  # IR node -> its node, for graphs built here
        # Conditional handle name -> the value this graph created, for graphs built here:
        # updates to a kernel that takes a handle must write this graph's value, not the one
        # its IR was captured with. None: the IR's values are this graph's own.
        self.handles: dict[str, int] | None = None
        self._ctx = current_context()
        self._own(handle, driver.cuGraphDestroy if owned else None)

    @classmethod
    def borrowed(cls, handle: int, buffers: BufferMap | None = None) -> Graph:
        """A graph someone else made and owns (PyTorch's ``raw_cuda_graph()``, an integer
        ``cudaGraph_t``), read into the IR (``grape.cuda.walk.read_graph``) and never destroyed
        here."""
        raw = driver.CUgraph(handle)
        return cls(read_graph(raw, buffers), raw, owned=False)

    @classmethod
    def build(cls, ir: KernelGraph) -> Graph:
        """A new CUDA graph with one node per IR node, added in dependency order.

        Conditional nodes get new handles; kernels that take a handle as an argument
        (``Kernel.handles``) are given the new value.
        """
        ir.validate()
        graph = cls(ir, call(driver.cuGraphCreate, 0, doing="creating a graph"))
        graph.handles = {}
        graph.nodes = graph._fill(graph.handle, ir, graph.handles)
        return graph

    def _fill(self, target: driver.CUgraph, ir: KernelGraph,
              handles: dict[str, int]) -> dict[str, driver.CUgraphNode]:
        flag = driver.CU_GRAPH_COND_ASSIGN_DEFAULT
        for _, op in ir.ops():  # a setter kernel can precede its conditional node
            if isinstance(op, Conditional):
                handle = call(driver.cuGraphConditionalHandleCreate, target, self._ctx,
                              op.default or 0, flag if op.default is not None else 0,
                              doing=f"creating conditional handle {op.handle!r}")
                handles[op.handle] = int(handle)
        nodes: dict[str, driver.CUgraphNode] = {}
        for node in nx.topological_sort(ir.dag):
            weaker = ir.kinds_into(node)
            deps = [nodes[d] for d in ir.dag.predecessors(node) if d not in weaker]
            nodes[node] = self._add(target, node, ir.op(node), deps, handles)
            for d, kind in weaker.items():  # programmatic (PDL) edges, as captured
                data = driver.CUgraphEdgeData()
                data.type = driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
                data.from_port = EDGE_PORTS[kind]
                call(driver.cuGraphAddDependencies, target, [nodes[d]], [nodes[node]], [data], 1,
                     doing=f"adding the {kind} dependency {d!r} -> {node!r}")
        return nodes

    def _address(self, span: Span) -> int:
        buffer = self.ir.buffers[span.buffer]
        if buffer.address is None:
            raise GrapeError(f"expected buffer {buffer.id!r} to have an address to rebuild "
                             f"against, found none")
        return buffer.address + span.offset

    def _add(self, target: driver.CUgraph, node: str, op, deps: list,
             handles: dict[str, int]) -> driver.CUgraphNode:
        doing = f"adding node {node!r} ({op.kind}) to a graph"
        if isinstance(op, Kernel):
            params, keep = kernel_params(op, handles)
            handle = call(driver.cuGraphAddKernelNode, target, deps, len(deps), params,
                          doing=doing)
            del keep
            _set_attributes(handle, op, node)
            return handle
        if isinstance(op, Memcpy):
            return call(driver.cuGraphAddMemcpyNode, target, deps, len(deps),
                        self._copy(op), self._ctx, doing=doing)
        if isinstance(op, Memset):
            return call(driver.cuGraphAddMemsetNode, target, deps, len(deps), self._memset(op),
                        self._ctx, doing=doing)
        if isinstance(op, Empty):
            return call(driver.cuGraphAddEmptyNode, target, deps, len(deps), doing=doing)
        if isinstance(op, EventRecord):
            return call(driver.cuGraphAddEventRecordNode, target, deps, len(deps),
                        resolve_event(op.event), doing=doing)
        if isinstance(op, EventWait):
            return call(driver.cuGraphAddEventWaitNode, target, deps, len(deps),
                        resolve_event(op.event), doing=doing)
        if isinstance(op, Conditional):
            return self._add_conditional(target, node, op, deps, handles)
        raise UnsupportedError(f"node {node!r}: expected a buildable operation, found {op!r:.60}")

    def _add_conditional(self, target: driver.CUgraph, node: str, op: Conditional, deps: list,
                         handles: dict[str, int]) -> driver.CUgraphNode:
        require(op.type)
        types = driver.CUgraphConditionalNodeType
        p = driver.CUgraphNodeParams()
        p.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        p.conditional.handle = handles[op.handle]
        p.conditional.type = {ConditionalKind.WHILE: types.CU_GRAPH_COND_TYPE_WHILE,
                              ConditionalKind.SWITCH: types.CU_GRAPH_COND_TYPE_SWITCH}.get(
                                  op.type, types.CU_GRAPH_COND_TYPE_IF)
        p.conditional.size = len(op.bodies)
        p.conditional.ctx = self._ctx
        handle = call(driver.cuGraphAddNode, target, deps, None, len(deps), p,
                      doing=f"adding conditional node {node!r} ({op.type.value})")
        for i, body in enumerate(op.bodies):
            self._fill(p.conditional.phGraph_out[i], body, handles)
        return handle

    def _memset(self, op: Memset) -> driver.CUDA_MEMSET_NODE_PARAMS:
        p = driver.CUDA_MEMSET_NODE_PARAMS()
        p.dst = self._address(op.dst)
        p.value, p.elementSize, p.width = op.value, op.element_size, op.width
        p.height, p.pitch = op.height, op.pitch
        return p

    def _copy(self, op: Memcpy) -> driver.CUDA_MEMCPY3D:
        p = driver.CUDA_MEMCPY3D()
        for side, span in (("src", op.src), ("dst", op.dst)):
            host = self.ir.buffers[span.buffer].memory == Memory.HOST
            setattr(p, f"{side}MemoryType", driver.CUmemorytype.CU_MEMORYTYPE_HOST if host
                    else driver.CUmemorytype.CU_MEMORYTYPE_DEVICE)
            setattr(p, f"{side}Host" if host else f"{side}Device", self._address(span))
        p.WidthInBytes, p.Height, p.Depth = op.size, 1, 1
        return p

    def instantiate(self, stream: Any = 0) -> Executable:
        return Executable(self.handle, stream, nodes=len(self.ir))

    def prepare(self, ops: dict[str, Kernel | Memcpy | Memset]) -> list[Update]:
        """Driver calls that give an executable of this graph new parameters for some nodes.

        Preparing is the slow part (argument arrays, parameter structs); :meth:`apply` then
        only calls the driver, so callers keep prepared updates for shapes they revisit. Only
        kernels, copies and memsets change in place; a kernel's attributes (cluster shape,
        priority) cannot, and are refused.
        """
        updates = []
        for node, op in ops.items():
            handle = self.nodes.get(node)
            if handle is None:
                raise GrapeError(f"expected node {node!r} of a graph built from IR, found no "
                                 f"such node")
            if isinstance(op, Kernel):
                if op.attributes != self.ir.op(node).attributes:
                    raise UnsupportedError(f"node {node!r}: kernel attributes cannot change "
                                           f"in an executable, found {op.attributes}")
                params, keep = kernel_params(op, self.handles)
                updates.append(Update(node, driver.cuGraphExecKernelNodeSetParams,
                                      (handle, params), keep))
            elif isinstance(op, Memset):
                updates.append(Update(node, driver.cuGraphExecMemsetNodeSetParams,
                                      (handle, self._memset(op), self._ctx)))
            elif isinstance(op, Memcpy):
                updates.append(Update(node, driver.cuGraphExecMemcpyNodeSetParams,
                                      (handle, self._copy(op), self._ctx)))
            else:
                raise UnsupportedError(f"node {node!r}: expected a kernel, copy or memset to "
                                       f"update, found {op.kind}")
        return updates

    def prepare_versions(self, versions: NodeVersions) -> list[Update]:
        """:meth:`prepare` for every version of one node (``grape.passes.variants``), in
        version order: kernel versions kept as rows share their arrays
        (:func:`version_updates`); others are prepared one by one."""
        node = versions.node
        handle = self.nodes.get(node)
        if handle is None:
            raise GrapeError(f"expected node {node!r} of a graph built from IR, found no such "
                             f"node")
        t = versions.template
        if not versions.rows or t.handles:  # handles: prepare() writes this graph's values
            return [self.prepare({node: versions.op(v)})[0] for v in range(len(versions))]
        if t.attributes != self.ir.op(node).attributes:
            raise UnsupportedError(f"node {node!r}: kernel attributes cannot change in an "
                                   f"executable, found {t.attributes}")
        return version_updates(node, handle, versions)

    def prepare_enabled(self, node: str, enabled: bool) -> Update:
        """A driver call that enables or disables node ``node`` of an executable of this graph
        (``cuGraphNodeSetEnabled``: a disabled kernel runs as an empty node): how a family
        picks which alternate of a kernel runs (``grape.passes.variants``)."""
        handle = self.nodes.get(node)
        if handle is None:
            raise GrapeError(f"expected node {node!r} of a graph built from IR, found no such "
                             f"node")
        return Update(node, driver.cuGraphNodeSetEnabled, (handle, int(enabled)))

    @staticmethod
    def apply(executable: Executable, updates: list[Update]) -> None:
        """Run prepared updates on ``executable``. Launches in flight keep the parameters they
        started with; the next launch uses the new ones.

        A family runs this before every launch: the calls are made here and only a failure
        goes through the checker (through :func:`call`, with its message built per call, an
        update cost 1.99 us in Python alone on a 2-core CPU; made here, 0.39; the stubbed
        calls bare in a loop, 0.45: ``benchmarks/apply_overhead.py``). With an observer set,
        each goes through :func:`call`, which marks it."""
        if observing():
            for u in updates:
                call(u.fn, executable.handle, *u.args, doing=f"updating node {u.node!r}")
            return
        handle = executable.handle
        for u in updates:
            status = u.fn(handle, *u.args)[0]
            if status is not _SUCCESS:  # enum members are singletons; anything else is checked
                if status is driver.CUresult.CUDA_ERROR_INVALID_CONTEXT and rebound():
                    status = u.fn(handle, *u.args)[0]  # a thread without a context, given one
                check_status(status, f"updating node {u.node!r}")


def _set_attributes(handle: driver.CUgraphNode, op: Kernel, node: str) -> None:
    for name, value in op.attributes:
        attr, field = ATTRIBUTES[name]
        v = driver.CUkernelNodeAttrValue()
        if field == "clusterDim":
            v.clusterDim.x, v.clusterDim.y, v.clusterDim.z = value
        else:
            setattr(v, field, value)
        call(driver.cuGraphKernelNodeSetAttribute, handle, attr, v,
             doing=f"setting {name} on node {node!r}")


_disables: dict[tuple, bool] = {}


def can_disable(op: Kernel) -> bool:
    """Whether the driver lets an executable disable and enable again a node of kernel ``op``
    (``cuGraphNodeSetEnabled``), tried on a graph of that one node, never launched; cached by
    function, block, shared memory and attributes. On the H200 (driver 580) it refused a
    cuDNN convolution launched in clusters of 4 x 4 blocks (a non-portable size, which
    launches) with CUDA_ERROR_INVALID_CLUSTER_SIZE, and took GEMMs in clusters of up to 8."""
    key = (op.function, op.block, op.shared_mem, op.attributes)
    found = _disables.get(key)
    if found is not None:
        return found
    graph = call(driver.cuGraphCreate, 0, doing="creating a graph to try disabling a node")
    try:
        params, keep = kernel_params(op, dict.fromkeys((h.handle for h in op.handles), 0))
        node = call(driver.cuGraphAddKernelNode, graph, None, 0, params,
                    doing="adding a kernel to try disabling it")
        del keep
        _set_attributes(node, op, "tried")
        executable = call(driver.cuGraphInstantiate, graph, 0,
                          doing="instantiating a graph to try disabling a node")
        try:
            found = all(driver.cuGraphNodeSetEnabled(executable, node, on)[0] is _SUCCESS
                        for on in (0, 1))
        finally:
            call(driver.cuGraphExecDestroy, executable, doing="destroying a tried executable")
    finally:
        call(driver.cuGraphDestroy, graph, doing="destroying a tried graph")
    _disables[key] = found
    return found


class Update(NamedTuple):
    """One prepared driver call that changes one node of an executable. A tuple, not a frozen
    dataclass: a family prepares one per version of every node it changes (about 200,000 for
    GPT-2 small's 1,023 lengths), and a frozen dataclass took 1.8 us to make on this
    repository's CPU, of 5.9 a version."""

    node: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    keep: tuple[Any, ...] = ()  # host arrays the parameters point into


class Executable(Resource):
    """An instantiated, uploaded graph; ``device_bytes`` is what instantiating it took.

    The figure is the drop in free device memory across instantiate and upload, so it is
    exact only to the driver's allocation granularity: measure many executables together for
    per-node figures (``grape.cuda.memory``).
    """

    def __init__(self, graph: driver.CUgraph, stream: Any = 0, nodes: int = 0) -> None:
        synchronize()
        free_before, _ = memory_info()
        self.handle = call(driver.cuGraphInstantiate, graph, 0, doing="instantiating a graph")
        self._own(self.handle, driver.cuGraphExecDestroy)
        call(driver.cuGraphUpload, self.handle, stream, doing="uploading an executable graph")
        synchronize()
        self.device_bytes = free_before - memory_info()[0]
        self.nodes = nodes

    def update(self, graph: Graph) -> None:
        """Give every node of this executable the parameters of ``graph``'s (one driver call,
        ``cuGraphExecUpdate``): a graph of the same topology, built the same way as the one
        instantiated. Launches in flight keep what they started with.

        Raises
        ------
        UnsupportedError
            The driver refused the update (its reason is named); the executable is unchanged.
        """
        status, info = driver.cuGraphExecUpdate(self.handle, graph.handle)
        if status != driver.CUresult.CUDA_SUCCESS:
            raise UnsupportedError(f"expected an executable update the driver takes, found "
                                   f"{info.result.name} ({status.name})")

    def launch(self, stream: Any = 0) -> None:
        if self.closed:
            raise GrapeError("expected an open executable to launch, found one already closed")
        call(driver.cuGraphLaunch, self.handle, stream, doing="launching an executable graph")
