"""A one-row product's input normalised by statistics of its own row, remade per output or
factored into scaled rows (grape.torch.row_statistics), on graphs traced as Inductor's passes
see them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from grape.torch.row_statistics import TERMS, factor_statistics, inline_statistics  # noqa: E402

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


def _product(terms, weight):
    """The products of the row that ``terms`` make with each row of ``weight`` (outputs, len),
    as thin_matmuls forms them: the scales times the dot products of the rows."""
    return sum((weight if rest is None else rest * weight).sum(1, keepdim=True)
               * (1.0 if scale is None else scale) for scale, rest in terms).reshape(1, -1)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_a_normalised_row_is_factored_into_rows_scaled_by_its_statistics(norm):
    # RMSNorm's row is one row (the input times the weight) scaled by the statistic; LayerNorm's
    # three: the input times the weight scaled by rstd, the weight by -mean * rstd, and the
    # bias. The product over them is the product over the normalised row. (The input is far
    # from zero mean: LayerNorm's two first terms then nearly cancel, in float32.)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, H, generator=g) * 2 + 5
    w, b = torch.randn(H, generator=g), torch.randn(H, generator=g)
    weight = torch.randn(OUTPUTS, H, generator=g)
    gm, values = _traced(_rms, x, w) if norm == "rms" else _traced(_layer_norm, x, w, b)
    row = _row(gm)
    factored, leaves = factor_statistics(row, OUTPUTS)
    terms = factored(*(values[leaf] for leaf in leaves))
    assert len(terms) == (1 if norm == "rms" else 3)
    # every scale is per output, made of statistics reduced by each output; no rest reads one
    scales = [s for s, _ in terms if s is not None]
    assert len(scales) == (1 if norm == "rms" else 2)
    assert all(s.shape == (OUTPUTS, 1) for s in scales)
    assert all(r.shape == (1, H) and r.dtype == torch.float32 for _, r in terms)
    assert not any("mean" in str(leaf.target) for leaf in leaves)
    expected = values[row].reshape(1, H) @ weight.t()
    torch.testing.assert_close(_product(terms, weight), expected, rtol=1e-5, atol=1e-5)


def test_a_half_precision_row_is_factored_in_float32():
    # A norm that scales in half precision (its statistic in float32, cast back to half
    # before it scales): factored, the rest (input times weight) is made in float32, so that
    # a large input times a large weight does not overflow half before the scale brings it
    # down.
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 1, H, generator=g) * 3000).half()
    w = (torch.randn(H, generator=g) * 40).half()

    def halved(x, w):
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).half()
        return (x * scale * w,)

    gm, values = _traced(halved, x, w)
    assert torch.isinf(x * w).any()  # (what the rest would be, made in half)
    factored, leaves = factor_statistics(_row(gm), OUTPUTS)
    [(scale, rest)] = factored(*(values[leaf] for leaf in leaves))
    assert rest.dtype == torch.float32 and torch.isfinite(rest).all()
    # (the product over the row made in float32 from the same half scale: half's own
    # roundings of the row are what the factored form leaves out)
    weight = torch.randn(OUTPUTS, H, generator=g)
    half_scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).half()
    assert scale.shape == (OUTPUTS, 1) and (scale == half_scale.reshape(1, 1)).all()
    expected = (x.float() * half_scale.float() * w.float()).reshape(1, H) @ weight.t()
    torch.testing.assert_close(_product([(scale.float(), rest)], weight), expected,
                               rtol=1e-5, atol=1e-5)


def test_a_row_not_linear_in_its_normalised_rows_is_not_factored():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, H, generator=g), torch.randn(H, generator=g)

    def squared(x, w):  # (the normalised row times itself: its square is no sum of scaled rows)
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (n * n * w,)

    def activated(x, w):  # (a nonlinear function of the normalised row)
        return (torch.tanh(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * w,)

    def divided(x, w):  # (a row divided by a row made from the statistic)
        return (w / (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)),)

    for fn in (activated, divided):
        gm, _ = _traced(fn, x, w)
        assert factor_statistics(_row(gm), OUTPUTS) is None
        # (remade per output, it still is: every operation on the way is pointwise)
        assert inline_statistics(_row(gm), OUTPUTS) is not None
    # the square is linear in each factor: one term times one term, still one term
    gm, values = _traced(squared, x, w)
    factored, leaves = factor_statistics(_row(gm), OUTPUTS)
    terms = factored(*(values[leaf] for leaf in leaves))
    weight = torch.randn(OUTPUTS, H, generator=g)
    torch.testing.assert_close(_product(terms, weight), values[_row(gm)] @ weight.t(),
                               rtol=1e-5, atol=1e-5)


def test_a_row_of_more_terms_than_a_loop_should_hold_is_not_factored():
    # Each term is one more dot product in the product's loop: past TERMS, the row is left.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, H, generator=g)
    ws = [torch.randn(H, generator=g) for _ in range(TERMS + 1)]

    def centred(x, *ws):  # ((x - mean) times (w0 + ... ), each w a term of its own)
        n = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True) + 1e-6)
        total = n * ws[0]
        for w in ws[1:]:
            total = total + n * w
        return (total,)

    gm, _ = _traced(centred, x, *ws)
    assert factor_statistics(_row(gm), OUTPUTS) is None
    gm, _ = _traced(centred, x, *ws[:1])
    assert factor_statistics(_row(gm), OUTPUTS) is not None


def test_a_row_divided_by_its_statistics_is_factored():
    # The other way norms are written: divided by the deviation rather than times its
    # reciprocal square root; the division by a number made of the statistics is a scale.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, H, generator=g) + 2
    w = torch.randn(H, generator=g)

    def divided(x, w):
        centred = x - x.mean(-1, keepdim=True)
        return (centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5) * w,)

    gm, values = _traced(divided, x, w)
    # (the second statistic reads the centred row, itself made from the first: not factored)
    assert factor_statistics(_row(gm), OUTPUTS) is None

    def deviation(x, w):
        return ((x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5)
                * w,)

    gm, values = _traced(deviation, x, w)
    factored, leaves = factor_statistics(_row(gm), OUTPUTS)
    terms = factored(*(values[leaf] for leaf in leaves))
    assert len(terms) == 2
    weight = torch.randn(OUTPUTS, H, generator=g)
    torch.testing.assert_close(_product(terms, weight), values[_row(gm)] @ weight.t(),
                               rtol=1e-5, atol=1e-5)


def _traced_as_for_a_gpu(fn, *shapes, dtype):
    """``fn`` over fake CUDA tensors of ``shapes`` traced with Inductor's decompositions under
    coordinate-descent tuning (compile=True's mode), as a GPU's post-grad passes receive it:
    a one-row ``mm`` decomposed into a multiply and a sum over float32 casts."""
    from torch._inductor import config
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        args = [torch.empty(*shape, device="cuda", dtype=dtype) for shape in shapes]
    with config.patch(coordinate_descent_tuning=True):
        return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def _normalised_product(norm):
    def product(x, w, g):
        if norm == "rms":
            x32 = x.float()
            row = g * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        else:
            row = torch.nn.functional.layer_norm(x, (H,), g, g * 0.5)
        return (row @ w.t(),)
    return product


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_a_product_inductor_decomposed_for_a_gpu_is_factored_too(norm, dtype):
    # On a GPU, Inductor's decomposition of a one-row mm runs while the graph is traced, so
    # grape's pass sees a multiply and a sum, not an mm (torch._inductor.decomposition.mm;
    # the CPU keeps its mm). The factored form is found there too, its result the float32
    # sum the cast after it rounds; without a switch the pass leaves Inductor's form alone.
    from torch._dynamo.utils import counters

    from grape.torch.thin_matmuls import as_reductions

    fn = _normalised_product(norm)
    gm = _traced_as_for_a_gpu(fn, (1, H), (OUTPUTS, H), (H,), dtype=dtype)
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten.mm.default not in targets
    assert torch.ops.aten.sum.dim_IntList in targets
    counters.clear()
    as_reductions(gm.graph)
    assert [n.target for n in gm.graph.nodes] == targets
    assert counters["inductor"]["grape_thin_matmuls"] == 0
    as_reductions(gm.graph, factored=True)
    assert counters["inductor"]["grape_factored_statistics"] == 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    # (run on the CPU's tensors: the graph names no device)
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(1, H, generator=g).to(dtype) + 3.0,
            torch.randn(OUTPUTS, H, generator=g).to(dtype), torch.randn(H, generator=g).to(dtype))
    [made], [expected] = gm(*args), fn(*args)
    assert made.dtype == expected.dtype == dtype
    tolerance = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(made.float(), expected.float(), rtol=tolerance, atol=tolerance)
