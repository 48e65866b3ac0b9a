"""grape.torch.triton_gemv: the one-row product operator (its schema and fake tensor checked by
torch.library, its arithmetic float32's rounded once), the pre-grad pass that rewrites one-row
``linear`` and ``addmm`` calls into it and leaves every other product alone, and, on a GPU,
the Triton kernels against float32's product, inside a capture too."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from grape.torch.triton_gemv import (  # noqa: E402
    configs,
    one_row_product,
    product,
    rewrite,
    untimed_config,
)


def _operands(k, n, transposed, dtype=torch.float32, device="cpu", bias=True, seed=0):
    """A row (1, K), a weight seen as (K, N) (an (N, K) storage transposed: ``transposed``),
    and a bias (N,) or None."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(1, k, generator=g).to(device, dtype)
    w = torch.randn(n, k, generator=g) if transposed else torch.randn(k, n, generator=g)
    w = w.to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    return a, (w.t() if transposed else w), b


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_the_operator_is_floats_product_rounded_once(transposed, bias):
    a, w, b = _operands(48, 20, transposed, dtype=torch.float16, bias=bias)
    torch.library.opcheck(one_row_product, (a, w, b))
    exact = a.float() @ w.float() + (0 if b is None else b.float())
    assert torch.equal(one_row_product(a, w, b), exact.to(torch.float16))


def test_the_operator_refuses_more_than_one_row():
    a, w, _ = _operands(8, 4, False)
    with pytest.raises(ValueError, match=r"expected a \(1, K\) row and a \(K, N\) weight, "
                                         r"found \(2, 8\) and \(8, 4\)"):
        one_row_product(torch.cat([a, a]), w)


def _rewritten(fn, *args):
    """(how many products :func:`rewrite` rewrote in Dynamo's graph of ``fn``, the graph's
    result on ``args``, ``fn``'s own)."""
    counts = []

    def backend(gm, example_inputs):
        counts.append(rewrite(gm.graph))
        gm.recompile()
        return gm

    torch._dynamo.reset()
    got = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    return sum(counts), got, fn(*args)


def test_the_pass_rewrites_one_row_linear_and_addmm_calls():
    torch.manual_seed(0)
    x, w, b = torch.randn(1, 1, 32), torch.randn(24, 32), torch.randn(24)
    count, got, want = _rewritten(lambda x, w, b: torch.nn.functional.linear(x, w, b), x, w, b)
    assert count == 1 and got.shape == (1, 1, 24)
    torch.testing.assert_close(got, want)
    count, got, want = _rewritten(lambda x, w: torch.nn.functional.linear(x, w), x, w)
    assert count == 1
    torch.testing.assert_close(got, want)
    # GPT-2's Conv1D: addmm over a weight stored (in, out)
    row, weight = torch.randn(1, 32), torch.randn(32, 24)
    count, got, want = _rewritten(lambda b, x, w: torch.addmm(b, x, w), b, row, weight)
    assert count == 1
    torch.testing.assert_close(got, want)


def test_the_pass_leaves_every_other_product():
    torch.manual_seed(0)
    w, b = torch.randn(24, 32), torch.randn(24)
    cases = [
        # more than one row (a prefill, a batch, beams)
        (lambda x, w, b: torch.nn.functional.linear(x, w, b), torch.randn(1, 3, 32), w, b),
        (lambda x, w, b: torch.nn.functional.linear(x, w, b), torch.randn(2, 1, 32), w, b),
        # addmm scaled (beta, alpha), and a bias broadcast from more than one dimension
        (lambda b, x, w: torch.addmm(b, x, w, beta=0.5), b, torch.randn(1, 32), w.t()),
        (lambda b, x, w: torch.addmm(b, x, w), b[None], torch.randn(1, 32), w.t()),
        # integers, and products other than linear and addmm
        (lambda x, w: torch.nn.functional.linear(x, w), torch.ones(1, 32, dtype=torch.long),
         torch.ones(24, 32, dtype=torch.long)),
        (lambda x, w: x @ w, torch.randn(1, 32), w.t()),
    ]
    for fn, *args in cases:
        count, got, want = _rewritten(fn, *args)
        assert count == 0
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("contiguous_k", [False, True])
def test_the_configurations_tile_along_the_contiguous_dimension(contiguous_k):
    # Every configuration tried, and the untimed one, reads the weight in tiles long along
    # its contiguous dimension (coalesced loads) and splits no further than the reduction's
    # tiles allow.
    for k, n in [(768, 2304), (3072, 768), (2048, 256), (5632, 2048), (2048, 32000)]:
        found = configs(k, n, contiguous_k, 132) + [untimed_config(k, n, contiguous_k, 132)]
        assert found
        for bk, bn, split, warps in found:
            assert (bk >= 128) if contiguous_k else (bn >= 64)
            assert 1 <= split <= max(1, k // bk) and warps in (4, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_the_triton_kernels_give_floats_product_rounded_once_on_a_gpu(transposed):
    pytest.importorskip("triton", reason="Triton is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for k, n in [(768, 2304), (3072, 768), (2048, 256), (100, 37)]:
        a, w, b = _operands(k, n, transposed, dtype=torch.float16, device="cuda", seed=k)
        exact = a.float() @ w.float() + b.float()
        bound = exact.abs().max().item() * 2 ** -10  # (one fp16 rounding at the result's size)
        for config in configs(k, n, transposed, 132):
            err = (product(a, w, b, config).float() - exact).abs().max().item()
            assert err <= bound, (k, n, config, err, bound)
        # the operator, timed once outside a capture, then replayed from a graph
        got = one_row_product(a, w, b)
        assert (got.float() - exact).abs().max().item() <= bound
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = one_row_product(a, w, b)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, got)
    # a shape first met inside a capture: the untimed configuration, nothing timed there
    a, w, b = _operands(320, 96, transposed, dtype=torch.float16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = one_row_product(a, w, b)
    graph.replay()
    torch.cuda.synchronize()
    exact = a.float() @ w.float() + b.float()
    assert (captured.float() - exact).abs().max().item() <= exact.abs().max().item() * 2 ** -10


def test_the_passes_uuids_name_their_sources_and_what_runs_before_them():
    # Inductor keys its caches on these: a graph compiled with one pass, or with none before
    # it, must never serve a compilation that asks for another.
    from grape.torch.thin_matmuls import ThinMatmuls
    from grape.torch.triton_gemv import OneRowKernels

    class Anonymous:  # a pass that cannot say what it is
        def __call__(self, graph):
            pass

    rows, thin = OneRowKernels(), ThinMatmuls()
    assert rows.uuid() == OneRowKernels().uuid() and thin.uuid() == ThinMatmuls().uuid()
    assert len({rows.uuid(), thin.uuid(), OneRowKernels(thin).uuid()}) == 3
    assert OneRowKernels(Anonymous()).uuid() is None
