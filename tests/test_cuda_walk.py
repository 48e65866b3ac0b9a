"""Reading kernel arguments the way the driver hands them over: CPU tests (no device needed,
the argument arrays are this process's memory)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cuda.bindings", reason="cuda-bindings is not installed")

from cuda.bindings import driver

from grape.cuda.walk import _extra_args
from grape.errors import UnsupportedError


def _extra(buffer: np.ndarray, length: int | None):
    """An ``extra`` array as a launch passes it: pointer, size, END, each (key, value)."""
    size = np.array([buffer.nbytes if length is None else length], dtype="<u8")
    words = [int(driver.CU_LAUNCH_PARAM_BUFFER_POINTER_AS_INT), buffer.ctypes.data,
             int(driver.CU_LAUNCH_PARAM_BUFFER_SIZE_AS_INT), size.ctypes.data,
             int(driver.CU_LAUNCH_PARAM_END_AS_INT), 0]
    array = np.array(words, dtype="<u8")
    return array, size  # keep both alive while read


def test_a_packed_buffer_is_read_to_the_parameters_extent():
    buffer = np.arange(32, dtype=np.uint8)
    array, _size = _extra(buffer, None)
    assert _extra_args(array.ctypes.data, 24) == bytes(range(24))


def test_a_launch_that_passes_fewer_bytes_than_declared_reads_zeros_beyond():
    # NCCL's kernels declare a 4 KB parameter and launch with the bytes they use (144).
    buffer = np.full(4096, 0xAB, dtype=np.uint8)
    buffer[:144] = np.arange(144, dtype=np.uint8)
    array, _size = _extra(buffer, 144)
    args = _extra_args(array.ctypes.data, 4096)
    assert args == bytes(range(144)) + bytes(4096 - 144)


def test_an_extra_array_without_a_buffer_pointer_is_refused():
    array = np.array([int(driver.CU_LAUNCH_PARAM_END_AS_INT), 0], dtype="<u8")
    with pytest.raises(UnsupportedError, match="expected a CU_LAUNCH_PARAM_BUFFER_POINTER"):
        _extra_args(array.ctypes.data, 8)


def test_pointers_into_a_live_block_name_the_block_and_named_tensors_come_first():
    from grape.cuda.buffers import BufferMap
    from grape.ir import BufferRole, Pointer, Span

    buffers = BufferMap()
    buffers.block(0x7F0000100000, 0x1000)  # the caller's cache, one block of a segment
    buffers.block(0x7F0000101000, 0x200)
    buffers.name("param:w", 0x7F0000101000, 0x100, BufferRole.PARAMETER)
    args = b"".join(a.to_bytes(8, "little") for a in (0x7F0000100010, 0x7F0000101180,
                                                      0x7F0000101004, 64))
    assert buffers.pointers(args) == (Pointer(0, Span("block@0x7f0000100000", 0x10)),
                                      Pointer(8, Span("block@0x7f0000101000", 0x180)),
                                      Pointer(16, Span("param:w", 4)))
    assert buffers.used["block@0x7f0000100000"].role == BufferRole.INTERNAL


def test_a_remembered_lookup_gives_way_to_a_range_named_after_it_and_non_device_words_stay_out(
        monkeypatch):
    from types import SimpleNamespace

    import grape.cuda.buffers as buffers_module
    from grape.ir import BufferRole, Pointer, Span

    asked = []

    def address_range(address):  # the driver's answer for memory it does not know
        asked.append(address)
        return driver.CUresult.CUDA_ERROR_NOT_FOUND, 0, 0

    monkeypatch.setattr(buffers_module, "driver", SimpleNamespace(
        cuMemGetAddressRange=address_range, CUresult=driver.CUresult))
    buffers = buffers_module.BufferMap()
    buffers.block(0x7F0000100000, 0x1000)
    # The second word is no device memory: the driver says so once, and the same word in
    # the next kernel's arguments is not asked about again.
    args = b"".join(a.to_bytes(8, "little") for a in (0x7F0000100010, 0x10000))
    assert buffers.pointers(args) == (Pointer(0, Span("block@0x7f0000100000", 0x10)),)
    assert buffers.pointers(args) == (Pointer(0, Span("block@0x7f0000100000", 0x10)),)
    buffers.name("input0", 0x7F0000100000, 0x100, BufferRole.INPUT)
    assert buffers.pointers(args) == (Pointer(0, Span("input0", 0x10)),)
    assert set(buffers.used) == {"block@0x7f0000100000", "input0"}
    assert asked == [0x10000]


def _edge(kind: int, from_port: int = 0, to_port: int = 0) -> driver.CUgraphEdgeData:
    data = driver.CUgraphEdgeData()
    data.type, data.from_port, data.to_port = kind, from_port, to_port
    return data


def test_edges_are_read_as_full_programmatic_or_launch_order_and_any_other_is_refused():
    from grape.cuda.walk import _edge_kind

    default = driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_DEFAULT
    pdl = driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    assert _edge_kind(_edge(default), "a", "b") is None
    # what PyTorch's captures on the H200 hold behind kernels launched with PDL: (1, 1, 0)
    assert _edge_kind(_edge(pdl, driver.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC), "a",
                      "b") == "programmatic"
    assert _edge_kind(_edge(pdl, driver.CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER), "a",
                      "b") == "launch_order"
    with pytest.raises(UnsupportedError, match="edge 'a' -> 'b': expected a full, programmatic "
                                               "or launch-order dependency, found type 1 from "
                                               "port 0 to port 0"):
        _edge_kind(_edge(pdl), "a", "b")


def test_a_build_adds_full_dependencies_with_the_node_and_programmatic_ones_with_their_port(
        monkeypatch):
    # The driver stood in for: each call logged, each node a number.
    import grape.cuda.build as build
    from grape.ir import Empty, KernelGraph

    calls = []

    def fake(fn, *args, doing):
        calls.append((fn.__name__, args))
        return len(calls)
    monkeypatch.setattr(build, "call", fake)
    monkeypatch.setattr(build, "current_context", lambda: 0)
    ir = KernelGraph()
    ir.add("a", Empty())
    ir.add("b", Empty())
    ir.add("c", Empty(), after=["a", "b"], kinds={"b": "programmatic"})
    graph = build.Graph.build(ir)
    assert [args[1] for name, args in calls if name == "cuGraphAddEmptyNode"] == [
        [], [], [graph.nodes["a"]]]  # c waits fully for a only
    (target, before, after, data, count), = [args for name, args in calls
                                            if name == "cuGraphAddDependencies"]
    assert (target, before, after, count) == (graph.handle, [graph.nodes["b"]],
                                              [graph.nodes["c"]], 1)
    assert int(data[0].type) == int(
        driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
    assert int(data[0].from_port) == int(driver.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC)


def _words(*values: int) -> bytes:
    return b"".join(v.to_bytes(8, "little") for v in values)


HANDLES = {1: "cond0", 2: "cond1"}  # as the driver numbers them: 1, 2, ... per graph


def test_a_kernel_whose_shape_words_equal_handle_values_takes_no_handle():
    """A copy kernel's sizes and strides are small integers, as handle values are: only a
    setter's parameters are read as handles (a scan of every word misread three of them)."""
    from grape.cuda.walk import _handle_refs
    from grape.ir import Param
    copy = "_ZN2at6native18elementwise_kernelILi128ELi2E"
    assert _handle_refs(copy, _words(2, 1, 2), (Param(0, 24),), HANDLES) == ()
    assert _handle_refs(copy, _words(1), (Param(0, 8),), HANDLES) == ()


def test_a_setter_passes_its_handle_as_a_whole_parameter():
    from grape.cuda.walk import _handle_refs
    from grape.ir import HandleRef, Param
    refs = _handle_refs("grape_while_bounded", _words(2, 0x7F00_0000_0000, 0x7F00_0000_0100),
                        (Param(0, 8), Param(8, 8), Param(16, 8)), HANDLES)
    assert refs == (HandleRef(0, "cond1"),)
    torch_setter = "_ZN2at4cuda12_GLOBAL__N_129set_conditional_handle_kernelEyPKb"
    assert _handle_refs(torch_setter, _words(1, 0x7F00_0000_0000), (Param(0, 8), Param(8, 8)),
                        HANDLES) == (HandleRef(0, "cond0"),)


def test_every_setter_kernel_grape_compiles_is_known_to_the_walk():
    import re

    from grape.cuda.conditional import SOURCE
    from grape.cuda.walk import is_setter
    setters = re.findall(r"__global__ void (\w+)\(cudaGraphConditionalHandle", SOURCE)
    assert setters and all(is_setter(name) for name in setters)
