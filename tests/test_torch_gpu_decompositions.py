"""grape.torch.gpu_decompositions: a CPU's compilation decomposing one-row products as a
GPU's does, checked against Inductor's own decomposition traced over fake CUDA tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from grape.torch.gpu_decompositions import one_row_mm_as_on_a_gpu  # noqa: E402


def _targets(device, rows, dtype=torch.float16):
    """The operations ``x @ w.t()`` (``rows`` rows) traces to with Inductor's decompositions
    under coordinate-descent tuning, over fake tensors on ``device``."""
    from torch._inductor import config
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(rows, 16, device=device, dtype=dtype)
        w = torch.empty(8, 16, device=device, dtype=dtype)
    with config.patch(coordinate_descent_tuning=True):
        gm = make_fx(lambda x, w: x @ w.t(), decomposition_table=select_decomp_table(),
                     tracing_mode="fake")(x, w)
    return [(n.target, tuple(a for a in n.args if not isinstance(a, torch.fx.Node)))
            for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_cpus_one_row_product_decomposes_as_a_gpus(dtype):
    gpu = _targets("cuda", 1, dtype)
    assert torch.ops.aten.mm.default not in [t for t, _ in gpu]
    cpu = _targets("cpu", 1, dtype)
    assert torch.ops.aten.mm.default in [t for t, _ in cpu]
    with one_row_mm_as_on_a_gpu():
        assert _targets("cpu", 1, dtype) == gpu
        # (more rows: the product stays an mm, as on a GPU)
        assert _targets("cpu", 4, dtype) == _targets("cuda", 4, dtype)
        assert torch.ops.aten.mm.default in [t for t, _ in _targets("cpu", 4, dtype)]
    # and the table is as it was after
    assert _targets("cpu", 1, dtype) == cpu


def test_the_decomposed_product_computes_the_product():
    from torch._inductor.decomposition import select_decomp_table

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 16, generator=g), torch.randn(8, 16, generator=g)
    with one_row_mm_as_on_a_gpu():
        gm = make_fx(lambda x, w: x @ w.t(), decomposition_table=select_decomp_table())(x, w)
    assert torch.ops.aten.mm.default not in [n.target for n in gm.graph.nodes]
    torch.testing.assert_close(gm(x, w), x @ w.t(), rtol=1e-6, atol=1e-6)
