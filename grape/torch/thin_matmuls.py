"""A decode step's one-row matrix products, biased ones included, as reductions Inductor fuses.

A decode step at batch 1 multiplies one row by each weight. Inductor already writes such a
product as a reduction where it is a plain ``mm`` and coordinate-descent tuning is on (as
``max-autotune`` modes set it): each output a dot product of the row with one weight row,
spread over every SM, fused with the pointwise work after it. A ``torch.nn.Linear`` with a
bias is an ``addmm``, which it leaves to GEMMs tiled for many rows (Triton templates 16
rows high, or cuBLAS): few blocks over the weight, and a kernel of its own. On an OPT of
width 1024 (12 layers, every Linear biased), the compiled step's 72 biased products were 60
Triton templates and 12 cuBLAS GEMMs (each with a split-K reduction), and the compiled step
ran slower than the eager one (H100, 0.789 against 0.700 ms a token; ``benchmarks/README.md``).

:func:`as_reductions` rewrites each product of one row (:data:`ROWS`, known at compile time)
by a weight stored (out, in), as ``Linear`` stores it, as ``(a[:, None, :] * w[None]).sum(2)``
over the weight ``w`` as it lies, accumulated in float32 with the bias added before the one
rounding, as a GEMM's epilogue adds it. The same OPT's step then ran 0.514 ms a token, its
tokens those of the GEMMs' step for 128 of 128.

What is not rewritten, and why:

- a weight stored (in, out) (GPT-2's ``Conv1D``): each output would reduce a column, an
  outer reduction, which Inductor splits in two kernels to find parallelism. Rewritten,
  GPT-2 small's greedy step ran 0.899 ms a token against 0.547 with its GEMMs (H100).
- more than one row (a batch, beams): each row's outputs would read the whole weight
  again, from memory where it is larger than L2 (GPT-2's 77 MB head). Not measured.

An earlier form that rewrote every one-row product, whatever its layout, was measured and
retired (``benchmarks/one_row_products.py``, which keeps it beside its figures).

On a GPU under coordinate-descent tuning, Inductor decomposes a one-row ``mm`` while it
traces the graph, before any post-grad pass (``torch._inductor.decomposition.mm``): a
bias-free product arrives as a multiply and a sum over float32 casts. It is a reduction
already, and is left so, unless a switch rewrites its row's statistics, which are found in
that form as in an ``mm``'s (:func:`_rewrite_decomposed_mm`).

:class:`ThinMatmuls` is the pass in the form Inductor's configuration takes
(``post_grad_custom_pre_pass``); ``CompiledStep`` patches it in while it compiles.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch._inductor.pattern_matcher import (
    Arg,
    CallFunction,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)
from torch.fx.experimental.symbolic_shapes import statically_known_true

from grape.torch import row_statistics
from grape.torch.inductor_passes import ChainedPass
from grape.torch.row_statistics import Term, factor_statistics, inline_statistics

__all__ = ["ROWS", "ThinMatmuls", "as_reductions"]

aten = torch.ops.aten

# The most rows a product may have to become a reduction (see the module's docstring).
ROWS = 1

_PATTERNS = PatternMatcherPass(pass_name="grape_thin_matmuls")
# Whether the pass now applying on this thread remakes its rows' statistics per output
# (``recomputed``) or factors them out as scales (``factored``): as_reductions sets them, the
# patterns' handlers being registered once, for every pass.
_INLINE = threading.local()


def _thin(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether ``a @ b`` has at most :data:`ROWS` rows (known at compile time) of floats, and
    ``b`` is a weight stored (out, in), as ``torch.nn.Linear`` stores it: transposed."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return False
    return (va.dim() == 2 and vb.dim() == 2 and va.dtype.is_floating_point
            and va.dtype == vb.dtype and vb.stride(0) == 1 and vb.shape[1] > 1
            and bool(statically_known_true(va.shape[0] <= ROWS)))


def _realized(a: torch.fx.Node) -> None:
    # The rows are written once and read by every output's program, rather than recomputed
    # there from what they are made of (a layer norm's input, weights and statistics). (Not
    # the weight: realizing a transposed view of it would copy it.)
    a.meta["inductor_realize_to_strides"] = True


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Reduced along the weight's rows, (out, in) as it lies (b is its transpose): the last,
    # contiguous dimension, so Inductor lays its threads along it.
    return (a[:, None, :].float() * b.t()[None, :, :].float()).sum(dim=2)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _product(a, b).to(a.dtype)


def _inlined(rows: Callable[..., torch.Tensor], bias: bool,
             dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """The product (``bias``: biased) over the row as ``rows`` makes it for each output,
    (outputs, in): each output's dot product with its weight row, in float32, the bias added
    before the one rounding to ``dtype``."""
    def product(*args: torch.Tensor) -> torch.Tensor:
        *leaves, b = args[1:] if bias else args
        a = rows(*leaves)
        out = (a.float() * b.t().float()).sum(dim=1)[None]
        return (out + args[0].float() if bias else out).to(dtype)
    return product


def _factored(terms: Callable[..., list[Term]], bias: bool,
              dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """The product (``bias``: biased) over the row as ``terms`` makes it, a sum of scaled
    rows: each output the sum of its scales times its dot products with the rows, in float32,
    the bias added before the one rounding to ``dtype`` (every dot product and statistic one
    reduction over the same range, which Inductor runs in one loop)."""
    def product(*args: torch.Tensor) -> torch.Tensor:
        *leaves, b = args[1:] if bias else args
        w = b.t().float()  # (outputs, in)
        out: Any = None
        for scale, rest in terms(*leaves):
            dot = (w if rest is None else rest * w).sum(dim=1, keepdim=True)
            part = dot if scale is None else dot * scale
            out = part if out is None else out + part
        out = out.reshape(1, -1)
        return (out + args[0].float() if bias else out).to(dtype)
    return product


# The rewrites of a product's normalised row, in the order tried: the switch in _INLINE, the
# row's form, the counter, the product over that form
_STATISTICS = (("factored", factor_statistics, "grape_factored_statistics", _factored),
               ("recomputed", inline_statistics, "grape_row_statistics", _inlined))


def _over_statistics(match: Match, a: torch.fx.Node, b: torch.fx.Node,
                     bias: torch.fx.Node | None, dtype: torch.dtype) -> bool:
    """Rewrite the matched product of row ``a`` by ``b`` (its result in ``dtype``) by the
    first of the switched-on forms in _STATISTICS that takes its row; whether one did."""
    for switch, form, counter, product in _STATISTICS:
        made = form(a, b.meta["val"].shape[1]) if getattr(_INLINE, switch, False) else None
        if made is not None:
            fn, leaves = made
            counters["inductor"][counter] += 1
            match.replace_by_example(product(fn, bias is not None, dtype),
                                     [*([bias] if bias is not None else []), *leaves, b])
            return True
    return False


def _replace(match: Match, a: torch.fx.Node, b: torch.fx.Node,
             bias: torch.fx.Node | None) -> None:
    counters["inductor"]["grape_thin_matmuls"] += 1
    if _over_statistics(match, a, b, bias, a.meta["val"].dtype):
        return
    if bias is None:
        match.replace_by_example(_mm, [a, b])
    else:
        match.replace_by_example(_addmm, [bias, a, b])
    _realized(a)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # (the bias added before the one rounding, as a GEMM's epilogue adds it)
    return (_product(a, b) + bias.float()).to(a.dtype)


@register_graph_pattern(CallFunction(aten.mm, Arg(), Arg()), pass_dict=_PATTERNS)
def _rewrite_mm(match: Match, a: torch.fx.Node, b: torch.fx.Node) -> None:
    # (Inductor's own decomposition does this where coordinate-descent tuning is on; done
    # here too, so that the step's kernels do not hang on that switch)
    if _thin(a, b):
        _replace(match, a, b, None)


@register_graph_pattern(CallFunction(aten.addmm, Arg(), Arg(), Arg()),
                        pass_dict=_PATTERNS)
def _rewrite_addmm(match: Match, bias: torch.fx.Node, a: torch.fx.Node,
                   b: torch.fx.Node) -> None:
    # (addmm with its default beta and alpha only: the pattern names no others)
    if _thin(a, b) and not match.nodes[-1].kwargs:
        _replace(match, a, b, bias)


def _unconverted(node: Any) -> Any:
    """``node``'s input where ``node`` only casts a floating tensor to float32 (as a
    decomposition computing in float32 casts its operands), else ``node``."""
    if (isinstance(node, torch.fx.Node)
            and node.target is torch.ops.prims.convert_element_type.default
            and node.args[1] == torch.float32 and isinstance(node.args[0], torch.fx.Node)):
        value = node.args[0].meta.get("val")
        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
            return node.args[0]
    return node


@register_graph_pattern(
    CallFunction(aten.sum.dim_IntList,
                 CallFunction(aten.mul.Tensor, CallFunction(aten.unsqueeze.default, Arg(), 2),
                              CallFunction(aten.unsqueeze.default, Arg(), 0)),
                 Arg()),
    pass_dict=_PATTERNS)
def _rewrite_decomposed_mm(match: Match, a: torch.fx.Node, b: torch.fx.Node,
                           dims: Any) -> None:
    # A one-row mm as Inductor's own decomposition already made it while the graph was
    # traced, before any post-grad pass: on GPUs under coordinate-descent tuning
    # (torch._inductor.decomposition.mm), ``(a.unsqueeze(2) * b.unsqueeze(0)).sum(dim=1)``
    # over both operands cast to float32, the sum rounded after. Such a product is already
    # a reduction; it is rewritten only where its row's statistics are (recomputed or
    # factored), its result still the float32 sum the cast after it rounds. (Without this,
    # a bias-free product never reached the statistics' forms on a GPU: the pattern above
    # matches only on devices where mm is not decomposed.)
    if dims != [1] or match.output_node().kwargs:
        return
    row, weight = _unconverted(a), _unconverted(b)
    if _thin(row, weight):
        _over_statistics(match, row, weight, None, match.output_node().meta["val"].dtype)


def as_reductions(graph: torch.fx.Graph, statistics: bool = False,
                  factored: bool = False) -> int:
    """Rewrite ``graph``'s products of at most :data:`ROWS` rows by weights stored (out, in)
    as reductions; returns how many patterns matched (every ``mm`` and ``addmm``, and every
    one-row ``mm`` Inductor decomposed, rewritten or not). Dynamo's
    ``counters["inductor"]["grape_thin_matmuls"]`` counts the ``mm`` and ``addmm`` rewritten;
    the decomposed ones are rewritten only where their row's statistics are.
    ``statistics``: a product of one row normalised by statistics of that row reduces them
    again per output, in its own kernel (:func:`grape.torch.row_statistics.inline_statistics`,
    counted in ``counters["inductor"]["grape_row_statistics"]``), rather than reading the row
    written first. ``factored``: where such a row is a sum of a few rows scaled by the
    statistics (:func:`grape.torch.row_statistics.factor_statistics`), the product reduces
    each of those rows and the statistics in one loop and scales after, in place of the
    above (counted in ``counters["inductor"]["grape_factored_statistics"]``)."""
    _INLINE.recomputed = statistics and ROWS == 1
    _INLINE.factored = factored and ROWS == 1
    try:
        return _PATTERNS.apply(graph)
    finally:
        _INLINE.recomputed = _INLINE.factored = False


class ThinMatmuls(ChainedPass):
    """:func:`as_reductions` as an Inductor post-grad pass, after ``before`` (a pass already
    configured, which keeps running; see :class:`ChainedPass` for its uuid)."""

    def __init__(self, before: Any = None, statistics: bool = False,
                 factored: bool = False) -> None:
        super().__init__(before)
        self.statistics, self.factored = statistics, factored

    def apply(self, graph: torch.fx.Graph) -> None:
        as_reductions(graph, self.statistics, self.factored)

    def salt(self) -> bytes:
        salt = f"{ROWS} {self.statistics} {self.factored}".encode()
        if self.statistics or self.factored:  # (what it rewrites with lies in a module of its own)
            with open(row_statistics.__file__, "rb") as f:
                salt += f.read()
        return salt
