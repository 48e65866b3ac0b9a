"""A write through a boolean mask captured into a CUDA graph (grape.torch.masked_writes), on a
real GPU: PyTorch's own write reads the mask's count back and breaks the capture; rewritten, it
captures, and each replay reads the mask as it is then."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="torch is not installed")


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return torch.device("cuda")


def _write(base, ids, row, out):
    out.copy_(base)
    out[ids == 2] = row  # one row into every place the mask selects (T5Gemma 2's pattern)


def test_a_masked_write_captures_and_follows_the_mask_at_each_replay(cuda):
    from grape.torch.control import graph
    from grape.torch.masked_writes import masked_writes

    g = torch.Generator(device=cuda).manual_seed(0)
    base = torch.randn(2, 7, 16, device=cuda, generator=g)
    row = torch.randn(16, device=cuda, generator=g)
    ids = torch.randint(0, 4, (2, 7), device=cuda, generator=g)
    out, expected = torch.empty_like(base), torch.empty_like(base)
    _write(base, ids, row, out)  # warm up outside the capture
    torch.cuda.synchronize()

    # PyTorch's own write: a sync, refused
    with pytest.raises(Exception, match="captur"), graph(torch.cuda.CUDAGraph()):
        _write(base, ids, row, out)
    captured = torch.cuda.CUDAGraph()
    with graph(captured), masked_writes():
        _write(base, ids, row, out)
    for seed in range(3):
        ids.copy_(torch.randint(0, 4, (2, 7), device=cuda,
                                generator=torch.Generator(device=cuda).manual_seed(seed)))
        captured.replay()
        _write(base, ids, row, expected)
        assert torch.equal(out, expected)
        assert bool((ids == 2).any())  # the mask selected something to write


def test_a_graphed_callable_writing_through_a_mask_is_graphed_and_matches_eager(cuda):
    # grape.graphed captures the callable with the rewrite: no fallback, no count read back,
    # and each call's mask is the caller's tensor where it lies.
    import grape

    def fill(base, ids, row):
        out = base.clone()
        out[ids == 2] = row
        return out

    g = torch.Generator(device=cuda).manual_seed(1)
    base = torch.randn(2, 7, 16, device=cuda, generator=g)
    row = torch.randn(16, device=cuda, generator=g)
    graphed = grape.graphed(fill)
    for seed in range(3):
        ids = torch.randint(0, 4, (2, 7), device=cuda,
                            generator=torch.Generator(device=cuda).manual_seed(seed))
        assert torch.equal(graphed(base, ids, row), fill(base, ids, row))
    assert graphed.stats.captures == 1


def test_a_fill_by_a_value_on_the_device_captures_and_reads_it_at_each_replay(cuda):
    # masked_fill's CUDA kernel takes a tensor value as a host scalar (value.item()); rewritten,
    # the value stays on the device and each replay reads it as it is then.
    from grape.torch.control import graph
    from grape.torch.masked_writes import masked_writes

    g = torch.Generator(device=cuda).manual_seed(2)
    base = torch.randn(4, 9, device=cuda, generator=g)
    ids = torch.randint(0, 4, (4, 9), device=cuda, generator=g)
    value = torch.tensor(0.5, device=cuda)
    out = torch.empty_like(base)
    out.copy_(base).masked_fill_(ids == 2, value)  # warm up outside the capture
    torch.cuda.synchronize()
    captured = torch.cuda.CUDAGraph()
    with graph(captured), masked_writes():
        out.copy_(base).masked_fill_(ids == 2, value)
    for seed in range(3):
        value.fill_(float(seed) - 1.5)
        ids.random_(0, 4, generator=torch.Generator(device=cuda).manual_seed(seed))
        captured.replay()
        assert torch.equal(out, base.masked_fill(ids == 2, value))


def test_a_number_written_through_a_mask_captures_under_grape_s_staging(cuda):
    # PyTorch runs x[mask] = 0 as masked_fill_ with the number as a kernel's argument; grape's
    # staging of host constants had put it on the device, where the write reads the mask's
    # count back (Gemma 3's and Granite Speech's captures broke at such lines).
    from grape.torch.control import graph
    from grape.torch.masked_writes import masked_writes
    from grape.torch.staging import HostConstants, PinnedArena

    def write(ids, out):
        out.copy_(ids)
        out[ids == 2] = 0

    ids = torch.randint(0, 4, (2, 7), device=cuda,
                        generator=torch.Generator(device=cuda).manual_seed(0))
    out, expected = torch.empty_like(ids), torch.empty_like(ids)
    write(ids, out)
    torch.cuda.synchronize()
    stage = HostConstants(PinnedArena(), cuda)
    captured = torch.cuda.CUDAGraph()
    with graph(captured), stage, masked_writes():  # as grape.generate captures a step
        write(ids, out)
    assert stage.values == []  # nothing staged: the number stayed an argument
    for seed in range(1, 4):
        ids.copy_(torch.randint(0, 4, (2, 7), device=cuda,
                                generator=torch.Generator(device=cuda).manual_seed(seed)))
        captured.replay()
        write(ids, expected)
        assert torch.equal(out, expected)
        assert bool((ids == 2).any())
