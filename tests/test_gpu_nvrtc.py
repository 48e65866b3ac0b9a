"""Capture, IR, rebuild and replay of raw NVRTC kernels, on a real GPU."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("cuda.bindings", reason="cuda-bindings is not installed")

from cuda.bindings import driver  # noqa: E402

from grape.errors import CaptureError  # noqa: E402
from grape.ir import BufferRole, Kernel, KernelGraph, Memcpy, Memset  # noqa: E402

SOURCE = r"""
struct Affine { float scale; float shift; const float* bias; };
extern "C" __global__ void affine(float* y, const float* x, Affine a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * a.scale + a.shift + a.bias[i % 4];
}
extern "C" __global__ void square(float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = y[i] * y[i];
}
"""
N = 4096
NBYTES = N * 4


def _make_kit():
    from grape.cuda.check import call
    from grape.cuda.context import current_context
    from grape.cuda.nvrtc import Module

    current_context()
    module = Module(SOURCE)
    mem = {name: call(driver.cuMemAlloc, NBYTES, doing=f"allocating {name}")
           for name in ("x", "bias", "tmp", "z", "y")}
    return module, mem


@pytest.fixture(scope="module")
def kit():
    module, mem = _make_kit()
    yield module, mem
    for ptr in mem.values():
        driver.cuMemFree(ptr)
    module.close()


def _put(ptr, array: np.ndarray) -> None:
    from grape.cuda.check import call

    call(driver.cuMemcpyHtoD, ptr, array.ctypes.data, array.nbytes, doing="uploading")


def _get(ptr) -> np.ndarray:
    from grape.cuda.check import call

    out = np.empty(N, dtype=np.float32)
    call(driver.cuMemcpyDtoH, out.ctypes.data, ptr, NBYTES, doing="downloading")
    return out


def _work(kit, grid=(N // 256, 1, 1)):
    from grape.cuda.check import call
    from grape.cuda.nvrtc import launch

    module, mem = kit
    affine, square = module.function("affine"), module.function("square")
    bias_ptr = int(mem["bias"])
    params = np.float32(1.5).tobytes() + np.float32(-0.25).tobytes() + bias_ptr.to_bytes(8,
                                                                                         "little")

    def issue(stream):
        launch(affine, grid, (256, 1, 1), [mem["tmp"], mem["x"], params, np.int32(N)], stream)
        call(driver.cuMemsetD32Async, mem["z"], 0, N, stream, doing="clearing z")
        launch(square, grid, (256, 1, 1), [mem["tmp"], np.int32(N)], stream)
        call(driver.cuMemcpyAsync, mem["y"], mem["tmp"], NBYTES, stream, doing="copying to y")

    return issue


def _buffers(kit):
    from grape.cuda.buffers import BufferMap

    _, mem = kit
    buffers = BufferMap()
    roles = {"x": BufferRole.INPUT, "bias": BufferRole.PARAMETER, "tmp": BufferRole.INTERNAL,
             "z": BufferRole.INTERNAL, "y": BufferRole.OUTPUT}
    for name, role in roles.items():
        buffers.name(name, int(mem[name]), NBYTES, role)
    return buffers


def test_capture_reads_kernels_copies_memsets_and_pointers_inside_structures(kit):
    from grape.cuda.capture import capture

    g = capture(_work(kit), _buffers(kit))
    ir = g.ir
    ir.validate()
    ops = [ir.op(n) for n in sorted(ir.dag, key=lambda n: int(n[1:]))]
    kinds = sorted(type(op).__name__ for op in ops)
    assert kinds == ["Kernel", "Kernel", "Memcpy", "Memset"]
    affine = next(op for op in ops if isinstance(op, Kernel) and op.name == "affine")
    assert affine.grid == (N // 256, 1, 1) and affine.block == (256, 1, 1)
    assert [(p.offset, p.size) for p in affine.params] == [(0, 8), (8, 8), (16, 16), (32, 4)]
    # y, x, and the bias pointer inside the Affine structure at offset 16 + 8.
    assert {(p.offset, p.target.buffer) for p in affine.pointers} == {(0, "tmp"), (8, "x"),
                                                                     (24, "bias")}
    copy = next(op for op in ops if isinstance(op, Memcpy))
    assert (copy.src.buffer, copy.dst.buffer, copy.size) == ("tmp", "y", NBYTES)
    memset = next(op for op in ops if isinstance(op, Memset))
    assert (memset.dst.buffer, memset.element_size, memset.width) == ("z", 4, N)
    assert ir.buffers["bias"].role == BufferRole.PARAMETER
    # The copy waits for both kernels: the capture was one stream.
    import networkx as nx

    assert nx.dag_longest_path_length(ir.dag) >= 2
    g.close()


def test_fingerprint_same_work_same_print_other_grid_other_print(kit):
    from grape.cuda.capture import capture

    a, b = capture(_work(kit), _buffers(kit)), capture(_work(kit), _buffers(kit))
    c = capture(_work(kit, grid=(N // 256 + 1, 1, 1)), _buffers(kit))
    assert a.ir.fingerprint() == b.ir.fingerprint() != c.ir.fingerprint()


def test_rebuilt_graph_computes_bit_for_bit_what_the_captured_one_does(kit):
    from grape.cuda.build import Graph
    from grape.cuda.capture import capture
    from grape.cuda.context import synchronize

    _, mem = kit
    original = capture(_work(kit), _buffers(kit))
    rebuilt = Graph.build(KernelGraph.from_json(json.loads(json.dumps(original.ir.to_json()))))
    rng = np.random.default_rng(0)
    with original.instantiate() as e1, rebuilt.instantiate() as e2:
        for _ in range(3):  # fresh inputs every time
            x = rng.standard_normal(N).astype(np.float32)
            bias = rng.standard_normal(N).astype(np.float32)
            _put(mem["x"], x)
            _put(mem["bias"], bias)
            _put(mem["y"], np.full(N, np.nan, dtype=np.float32))
            e1.launch()
            synchronize()
            want = _get(mem["y"])
            _put(mem["y"], np.full(N, np.nan, dtype=np.float32))
            e2.launch()
            synchronize()
            got = _get(mem["y"])
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
            ref = (x * np.float32(1.5) - np.float32(0.25) + bias[np.arange(N) % 4]) ** 2
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_executables_close_and_refuse_launch_after(kit):
    from grape.cuda.capture import capture
    from grape.errors import GrapeError

    g = capture(_work(kit), _buffers(kit))
    e = g.instantiate()
    e.close()
    e.close()  # idempotent
    assert e.closed
    with pytest.raises(GrapeError, match="found one already closed"):
        e.launch()


# The measurement in a process of its own: the driver keeps what closed executables held and
# hands it to later ones, so after the suite's other tests (hundreds of executables) fifty small
# ones can fit in what it kept and read as 0 bytes (H100, the whole GPU suite in one process).
_MEMORY_IN_A_FRESH_PROCESS = """
import json
from grape.cuda.capture import capture
from grape.cuda.memory import executable_memory
from tests.test_gpu_nvrtc import _buffers, _make_kit, _work
kit = _make_kit()
m = executable_memory(capture(_work(kit), _buffers(kit)), copies=50)
print(json.dumps({"total": m.total_bytes, "again": m.again_bytes}))
"""


def test_memory_accounting():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", _MEMORY_IN_A_FRESH_PROCESS], cwd=root,
                         capture_output=True, text=True, check=False, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["total"] > 0
    # Closed executables hand their memory back: a second round takes (almost) nothing new.
    assert m["again"] <= 0.1 * m["total"]


def test_a_host_sync_breaks_the_capture_and_says_so(kit):
    from grape.cuda.capture import capture
    from grape.cuda.check import call

    def issue(stream):
        call(driver.cuStreamSynchronize, stream, doing="waiting for the capturing stream")

    with pytest.raises(CaptureError, match="found the capture broken: CUDA_ERROR_STREAM_CAPTURE"
                                           ".*while waiting for the capturing stream"):
        capture(issue)


@pytest.mark.parametrize("kept_on", ["device", "host"])
def test_a_comparison_sees_one_byte_changed_anywhere_in_any_buffer(kept_on, monkeypatch):
    """grape.cuda.compare's kernel: buffers at odd addresses and of odd sizes (the bytes
    the 16-byte loads leave), large and tiny, each changed in one byte at its start, middle
    and end, seen; put back, unseen again. The same of the host's way, where the device has
    no room for the copy."""
    from grape.cuda import compare
    from grape.cuda.check import call
    from grape.cuda.compare import _Left
    from grape.cuda.context import current_context
    from grape.ir import Buffer

    if kept_on == "host":
        monkeypatch.setattr(compare._Copy, "of", classmethod(lambda cls, buffers: None))
    current_context()
    base = int(call(driver.cuMemAlloc, 1 << 22, doing="allocating the buffers"))
    try:
        call(driver.cuMemsetD8, base, 7, 1 << 22, doing="filling the buffers")
        spans = [(1, 37), (64, 4096), (8192, 16 * 1000 + 3), (65536 + 3, 1), (1 << 20, 3 << 20)]
        buffers = [Buffer(f"b{i}", size, BufferRole.INTERNAL, address=base + at)
                   for i, (at, size) in enumerate(spans)]
        left = _Left(buffers, 0)
        assert (left.table is not None) == (kept_on == "device")
        try:
            assert left.again()
            for b in buffers:
                for at in sorted({0, b.size // 2, b.size - 1}):
                    call(driver.cuMemsetD8, b.address + at, 8, 1, doing="changing a byte")
                    assert not left.again(), (b.id, at)
                    call(driver.cuMemsetD8, b.address + at, 7, 1, doing="putting it back")
                    assert left.again(), (b.id, at)
            # A byte just outside every buffer is not theirs
            call(driver.cuMemsetD8, base, 9, 1, doing="changing a byte outside")
            assert left.again()
        finally:
            left.free()
    finally:
        driver.cuMemFree(base)
