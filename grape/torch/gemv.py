"""Inductor pass: matrix products of one row become reductions Inductor generates itself.

A token of batch-1 decoding multiplies one row by every weight matrix. Under
``max-autotune`` Inductor picks among cuBLAS and its Triton GEMM templates, all tiled for
many rows: on the H200 a compiled GPT-2 small token spent 515 of its 726 us in four GEMMs
and the attention per layer, each GEMM reading its 1.2 to 4.7 MB of weights at 5 to 10% of
the memory bandwidth (``benchmarks/step_profile.py``). Written as ``(a[:, :, None] *
b[None]).sum(1)`` the same product is a reduction, which Inductor tiles for bandwidth, tunes
(``coordinate_descent_tuning``) and fuses with its neighbours (the bias, an activation, a
residual add) into one kernel.

``OneRowProducts`` is an Inductor ``post_grad_custom_pre_pass``: it rewrites ``aten.mm`` and
``aten.addmm`` whose left operand has at most ``max_rows`` rows (known statically) and a
floating dtype. The sum accumulates in fp32 inside Inductor's kernel, as cuBLAS does, but in
another order: tokens from a rewritten model are compared with a tolerance, not for equality
(``grape.generate(compile=True)`` says so already).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = ["OneRowProducts"]

aten = torch.ops.aten
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _few_rows(a: Any, b: Any, max_rows: int) -> bool:
    va, vb = _val(a), _val(b)
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return False
    if va.dim() != 2 or vb.dim() != 2 or va.dtype not in _FLOATS or vb.dtype != va.dtype:
        return False
    rows = va.shape[0]
    # A symbolic row count would let one compiled kernel serve shapes it was not tuned for.
    return isinstance(rows, int) and rows <= max_rows


def _call(graph: torch.fx.Graph, target: Any, *args: Any) -> torch.fx.Node:
    """Insert ``target(*args)`` with its fake value, which Inductor's lowering reads."""
    node = graph.call_function(target, args)
    node.meta["val"] = target(*(_val(a) if isinstance(a, torch.fx.Node) else a for a in args))
    return node


class OneRowProducts(CustomGraphPass):
    def __init__(self, max_rows: int = 1) -> None:
        self.max_rows = max_rows
        self.rewritten = 0  # products rewritten over every graph this pass has seen

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is aten.mm.default:
                bias, (a, b) = None, node.args
            elif node.target is aten.addmm.default and not node.kwargs:
                # beta and alpha other than 1 (never in the models' linear layers) are left
                bias, a, b = node.args
            else:
                continue
            if not _few_rows(a, b, self.max_rows):
                continue
            with graph.inserting_before(node):
                product = _call(graph, aten.mul.Tensor, _call(graph, aten.unsqueeze.default, a, 2),
                                _call(graph, aten.unsqueeze.default, b, 0))
                out = _call(graph, aten.sum.dim_IntList, product, [1])
                if bias is not None:
                    out = _call(graph, aten.add.Tensor, out, bias)
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            self.rewritten += 1

    def uuid(self) -> Any:
        # Inductor's cache key: this file's text and the threshold.
        return (get_hash_for_files((__file__,)), self.max_rows)
