"""A decode step's matrix products over few rows, as reductions Inductor writes and fuses.

A decode step multiplies a handful of rows (one a sequence: a batch, a beam) by each weight.
Inductor hands such a product to a GEMM: a Triton template tiled for many rows, or cuBLAS.
Neither suits one row. Tiles 16 rows high over a 768 x 2304 weight made 36 blocks on a
132-SM GPU, and took 7.4 us where reading the weight once takes about 1 us (H100, GPT-2
small, Inductor's own autotuning log in ``benchmarks/results/gpu_h100_35ba8bb``). A GEMM is
also a kernel of its own: the layer norm before it and the bias, activation or residual
after it cannot join it.

:func:`as_reductions` rewrites each product whose rows are statically at most :data:`ROWS`
as what it is for so few rows: ``(a[:, None, :] * w[None]).sum(2)`` over the weight ``w``
(``b`` transposed) in the layout it lies in, accumulated in float32 and rounded once.
Inductor then writes a reduction kernel, each output's program reading one weight row
contiguously, spread over every SM, and fuses the pointwise work after it into it.
Inductor has such a rewrite (``decompose_mem_bound_mm``), but for products with many rows
and few columns, the other shape. Products with more rows than :data:`ROWS` (a prefill, a
large batch) keep their GEMM: each row of a reduction reads the weight again.

Only a weight stored (out, in), as ``torch.nn.Linear`` stores it, is rewritten: each output
then reduces one contiguous row. A weight stored (in, out) (GPT-2's ``Conv1D``) would make
an outer reduction, whose outputs share each row of the weight: Inductor splits it in two
kernels to find enough parallelism, and GPT-2 small's greedy step ran 0.899 ms a token that
way against 0.547 with its GEMMs (H100, ``benchmarks/README.md``).

:class:`ThinMatmuls` is the pass in the form Inductor's configuration takes
(``post_grad_custom_pre_pass``); ``CompiledStep`` patches it in while it compiles.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import (
    Arg,
    CallFunction,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = ["ROWS", "ThinMatmuls", "as_reductions"]

aten = torch.ops.aten

# The most rows a product may have to become a reduction: a batch of 8 sequences, or a
# beam search's beams over a small batch.
ROWS = 8

_PATTERNS = PatternMatcherPass(pass_name="grape_thin_matmuls")


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


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # (the bias added before the one rounding, as a GEMM's epilogue adds it)
    return (_product(a, b) + bias.float()).to(a.dtype)


@register_graph_pattern(CallFunction(aten.mm, Arg(), Arg()), pass_dict=_PATTERNS)
def _rewrite_mm(match: Match, a: torch.fx.Node, b: torch.fx.Node) -> None:
    if _thin(a, b):
        counters["inductor"]["grape_thin_matmuls"] += 1
        match.replace_by_example(_mm, [a, b])
        _realized(a)


@register_graph_pattern(CallFunction(aten.addmm, Arg(), Arg(), Arg()),
                        pass_dict=_PATTERNS)
def _rewrite_addmm(match: Match, bias: torch.fx.Node, a: torch.fx.Node,
                   b: torch.fx.Node) -> None:
    # (addmm with its default beta and alpha only: the pattern names no others)
    if _thin(a, b) and not match.nodes[-1].kwargs:
        counters["inductor"]["grape_thin_matmuls"] += 1
        match.replace_by_example(_addmm, [bias, a, b])
        _realized(a)


def as_reductions(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph``'s products of at most :data:`ROWS` rows as reductions; returns how
    many patterns matched (a product with more rows matches and is left as it was). Dynamo's
    ``counters["inductor"]["grape_thin_matmuls"]`` counts those rewritten."""
    return _PATTERNS.apply(graph)


class ThinMatmuls(CustomGraphPass):
    """:func:`as_reductions` as an Inductor post-grad pass, after ``before`` (a pass already
    configured, which keeps running). Its uuid names this module's source and ``before``'s
    uuid, so that Inductor's caches never serve a graph compiled without it, or with an older
    version of it."""

    def __init__(self, before: Any = None) -> None:
        self.before = before

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.before is not None:
            self.before(graph)
        as_reductions(graph)

    def uuid(self) -> Any:
        with open(__file__, "rb") as f:
            digest = hashlib.sha256(f.read() + str(ROWS).encode())
        if self.before is not None:
            uuid = getattr(self.before, "uuid", lambda: None)()
            if uuid is None:  # (a pass that cannot say what it is: nothing cached)
                return None
            digest.update(str(uuid).encode())
        return digest.hexdigest()
