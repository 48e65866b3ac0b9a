"""A one-row product's input normalised by statistics of its own row, remade per output
(grape.torch.row_statistics), on graphs traced as Inductor's passes see them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from grape.torch.row_statistics import inline_statistics  # noqa: E402

H, OUTPUTS = 16, 5


def _traced(fn, *args):
    """``fn`` traced to aten operations with Inductor's decompositions (LayerNorm's become
    ``var_mean``), each node's value kept: (graph module, node -> value)."""
    from torch._inductor.decomposition import select_decomp_table

    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)
    values = {}

    class Keeping(torch.fx.Interpreter):
        def run_node(self, n):
            values[n] = out = super().run_node(n)
            return out

    Keeping(gm).run(*args)
    return gm, values


def _row(gm):
    [out] = [n for n in gm.graph.nodes if n.op == "output"]
    return out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]


def _rms(x, w):
    x32 = x.float()
    return (w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype),)


def _layer_norm(x, w, b):
    return (torch.nn.functional.layer_norm(x, (H,), w, b).reshape(1, H),)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_a_normalised_row_is_remade_per_output_with_its_statistics(norm):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, H, generator=g)
    w, b = torch.randn(H, generator=g), torch.randn(H, generator=g)
    gm, values = _traced(_rms, x, w) if norm == "rms" else _traced(_layer_norm, x, w, b)
    row = _row(gm)
    rows, leaves = inline_statistics(row, OUTPUTS)
    # (the statistics' results are not among what the remade row reads: it reduces them)
    assert not any("mean" in str(leaf.target) for leaf in leaves)
    made = rows(*(values[leaf] for leaf in leaves))
    assert made.shape == (OUTPUTS, H)
    expected = values[row].reshape(1, H).expand(OUTPUTS, H)
    torch.testing.assert_close(made, expected, rtol=1e-6, atol=1e-6)


def test_a_row_without_a_statistic_of_its_own_is_left_as_it_is():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, H, generator=g), torch.randn(H, generator=g)
    gm, _ = _traced(lambda x, w: (x * w + 1.0,), x, w)
    assert inline_statistics(_row(gm), OUTPUTS) is None
    # a statistic of more than the row (here, of four rows) is not the row's own: each output
    # could not reduce it from the row, so it is read as it is, and nothing is remade
    many = torch.randn(4, H, generator=g)
    gm, _ = _traced(lambda x, m: (x * torch.rsqrt(m.pow(2).mean([0, 1], keepdim=True) + 1e-6),),
                    x, many)
    assert inline_statistics(_row(gm), OUTPUTS) is None


def test_a_row_made_from_its_statistic_by_more_than_pointwise_work_is_left_as_it_is():
    # (a running sum along the row: each element reads others, which a product's output
    # cannot remake from its own element of the row)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(0))
    gm, _ = _traced(lambda x: (torch.cumsum(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)),
                                            -1),), x)
    assert inline_statistics(_row(gm), OUTPUTS) is None


def test_a_row_at_the_end_of_a_long_residual_stream_is_still_remade():
    # A decoder's residual stream is a chain of pointwise adds back through every layer; the
    # statistics are looked for near the row (grape.torch.row_statistics.DEPTH), and the
    # stream before them is read as it is (a 22-layer Llama's later layers were left as they
    # were while the walk climbed the whole stream).
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 1, H, generator=g), torch.randn(H, generator=g)
    layers = [torch.randn(1, 1, H, generator=g) for _ in range(80)]

    def streamed(x, w, *outputs):
        for out in outputs:
            x = x + out
        return _rms(x, w)

    gm, values = _traced(streamed, x, w, *layers)
    rows, leaves = inline_statistics(_row(gm), OUTPUTS)
    assert len(leaves) <= 4  # (the stream's last sum, the weight, the statistic's input)
    torch.testing.assert_close(rows(*(values[leaf] for leaf in leaves)),
                               values[_row(gm)].reshape(1, H).expand(OUTPUTS, H))
