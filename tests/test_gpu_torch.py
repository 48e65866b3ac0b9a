"""Capture of PyTorch work (a GPT-2 decode step) into the IR, rebuild, replay, on a real GPU."""

from __future__ import annotations

import copy
import json

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from grape.errors import CaptureError  # noqa: E402
from grape.ir import BufferRole, KernelGraph  # noqa: E402


@pytest.fixture(scope="module")
def gpt2():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).cuda().half().eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 64), device="cuda")
    with torch.no_grad():
        past = model(prompt, use_cache=True).past_key_values
    return model, past


def _decode_capture(model, past):
    from grape.torch.capture import capture

    ids = torch.zeros((1, 1), dtype=torch.long, device="cuda")
    cache = copy.deepcopy(past)  # each capture starts from the same KV length

    def step(ids):
        with torch.no_grad():
            return model(ids, past_key_values=cache, use_cache=False).logits

    return capture(step, ids, params=dict(model.named_parameters())), ids


def test_gpt2_decode_step_captures_into_a_valid_ir(gpt2):
    model, past = gpt2
    cap, _ = _decode_capture(model, past)
    ir = cap.ir
    ir.validate()
    kernels = sum(1 for _ in ir.kernels())
    print(f"GPT-2 decode step: {len(ir)} nodes, {kernels} kernels, "
          f"{ir.dag.number_of_edges()} edges, pool {cap.pool_bytes} bytes")
    assert kernels >= 247  # at least the eager step's kernels (the H200 sample: 290 captured)
    assert cap.pool_bytes > 0
    roles = {b.role for b in ir.buffers.values()}
    assert {BufferRole.PARAMETER, BufferRole.INPUT, BufferRole.OUTPUT} <= roles
    assert sum(len(k.args) for _, k in ir.kernels()) > 10_000
    assert any(p.target.buffer.startswith("param:") for _, k in ir.kernels() for p in k.pointers)


def test_rebuilt_gpt2_step_is_bitwise_equal_to_pytorch_replay(gpt2):
    from cuda.bindings import driver

    from grape.cuda.build import Graph

    model, past = gpt2
    cap, ids = _decode_capture(model, past)
    rebuilt = Graph.build(KernelGraph.from_json(json.loads(json.dumps(cap.ir.to_json()))))
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    logits = cap.outputs
    with rebuilt.instantiate(stream) as exe:
        for _ in range(3):  # fresh token ids every check
            ids.copy_(torch.randint(0, model.config.vocab_size, (1, 1), device="cuda"))
            cap.replay()
            torch.cuda.synchronize()
            want = logits.clone()
            logits.fill_(float("nan"))
            exe.launch(stream)
            torch.cuda.synchronize()
            assert not torch.isnan(logits).any()
            assert torch.equal(logits.view(torch.int16), want.view(torch.int16))


def test_two_captures_of_the_same_step_share_a_fingerprint(gpt2):
    model, past = gpt2
    a, _ = _decode_capture(model, past)
    b, _ = _decode_capture(model, past)
    assert a.ir.fingerprint() == b.ir.fingerprint()
    assert a.ir.fingerprint(launch=False) == b.ir.fingerprint(launch=False)


def test_memory_of_gpt2_executables(gpt2):
    from grape.cuda.memory import executable_memory

    model, past = gpt2
    cap, _ = _decode_capture(model, past)
    m = executable_memory(cap.graph, copies=20)
    print(f"GPT-2 decode executable: {m.per_executable:.0f} bytes, {m.per_node:.0f} per node")
    assert 100 < m.per_node < 100_000


def test_host_sync_during_capture_names_the_line():
    from grape.torch.capture import capture

    x = torch.ones(16, device="cuda")

    def step(x):
        y = x * 2
        if y.sum().item() > 0:  # a host sync: breaks capture
            y = y + 1
        return y

    with pytest.raises(CaptureError, match=r"synchronises with the host.*test_gpu_torch.py:\d+ "
                                           r"\(if y.sum\(\).item\(\) > 0:"):
        capture(step, x)


def test_cpu_to_gpu_copy_during_capture_names_the_line():
    from grape.torch.capture import capture

    x = torch.ones(16, device="cuda")

    def step(x):
        return x + torch.tensor([1.0] * 16).cuda()  # a copy from pageable CPU memory

    with pytest.raises(CaptureError, match=r"test_gpu_torch.py:\d+ \(return x \+ "
                                           r"torch.tensor"):
        capture(step, x)


def _broken_step(x):
    noise = torch.rand_like(x)  # random numbers, from the generator the capture put in capture
    y = x * 2 + noise  # mode, and memory from the capture's pool
    if y.sum().item() > 0:  # a host sync: breaks the capture half way
        y = y + 1
    return y


def test_a_failed_capture_leaves_the_process_as_it_was():
    from grape.torch.capture import capture

    x = torch.ones(1 << 20, device="cuda")
    stream = torch.cuda.current_stream()
    _broken_step(x)  # lazy initialisation outside the measurement
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    rng = torch.cuda.get_rng_state()
    for _ in range(20):
        with pytest.raises(CaptureError, match="synchronises with the host"):
            capture(_broken_step, x, warmup=0)
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream() == stream
    assert torch.equal(torch.cuda.get_rng_state(), rng)  # the random stream did not move
    after = torch.randint(0, 1 << 30, (64,), device="cuda")  # failed here before the fix
    torch.cuda.set_rng_state(rng)
    assert torch.equal(after, torch.randint(0, 1 << 30, (64,), device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == reserved  # every failed capture's pool given back
    # And capture works again, random numbers included.
    good = capture(lambda x: x * 2 + torch.rand_like(x), x)
    good.replay()
    first = good.outputs.clone()
    good.replay()
    assert not torch.equal(first, good.outputs)  # each replay draws fresh numbers
    # 1 * 2 + [0, 1): in float32, 2 + u rounds to 3.0 for u within 1.2e-7 of 1 (a million
    # draws meet one on the H200), so 3 is in range.
    assert ((good.outputs >= 2) & (good.outputs <= 3)).all()


def test_a_captured_gemm_keeps_its_workspace_when_cublas_workspaces_are_cleared():
    # torch.compile's CUDA graphs (and so Hugging Face's generate with a static cache) clear
    # cuBLAS's workspaces; a graph still pointing at a freed workspace wrote into other
    # tensors' memory or, once it was unmapped, stopped with an illegal memory access (T5's
    # graphed generation on the H200, 2026-12-05). grape seats the workspace in a pool of
    # its own before each capture (grape.torch.workspace).
    from cuda.bindings import driver

    from grape.torch.capture import capture
    from grape.torch.workspace import workspace_pool

    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    torch.manual_seed(0)
    # A short, deep fp32 product, for which cuBLAS takes its workspace (seen on the H200).
    x = torch.randn(4, 16384, device="cuda")
    w = torch.randn(16384, 256, device="cuda")
    out = torch.empty(4, 256, device="cuda")
    want = x @ w

    def segments():
        return [(s["address"], s["address"] + s["total_size"])
                for s in workspace_pool(torch.cuda.current_device()).snapshot()]

    for round_ in range(2):  # the second capture after someone cleared: seated again
        cap = capture(lambda: torch.mm(x, w, out=out), warmup=1)
        used = [b for b in cap.ir.buffers.values() if b.address is not None
                and any(lo <= b.address < hi for lo, hi in segments())]
        assert used, f"capture {round_}: no kernel reads grape's workspace pool"
        exe = cap.graph.instantiate()
        stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()  # what was freed outside a live pool is unmapped
        # Freed memory taken by a tensor another library would own, filled with a sentinel.
        other = torch.full((64 << 20,), 7.0, device="cuda")
        torch.mm(x, w)  # an eager GEMM on the default stream makes its workspace again
        out.zero_()
        exe.launch(stream)
        torch.cuda.synchronize()
        assert torch.allclose(out, want, rtol=1e-4, atol=1e-3)
        assert bool((other == 7.0).all())
        exe.close()
        del other
