"""A one-row product's input normalised by statistics of its own row, recomputed by each
output instead of written first by a kernel of one block.

A decoder normalises the row before nearly every product of its step: RMSNorm's
``x * rsqrt(mean(x**2) + eps) * w``, LayerNorm's mean and variance. Compiled, the statistic
is a reduction of the one row, a kernel of one block that every product after it waits for:
on the Llama shape of ``benchmarks/README.md`` 72 of the compiled step's 255 kernels ran one
block each, 45 of them a norm's statistic (``compiled_step_kernels.py``'s ``step_ops``, H100),
each held by its own latency.

Each output of a product reduces over the same row the statistic reduces over. So the
statistic can be reduced again, per output, from the row it reads, and the normalised row
made in the product's own loop: ``a[j, i] = f(x[i], s[j])`` with ``s[j] = reduce_i g(x[i])``
the same for every ``j``. :func:`inline_statistics` rewrites the row of a product that way,
where every operation between the statistics and the row is pointwise, or a view that keeps
the row one row, and gives the product's reduction over it. Inductor then fuses each
statistic with the product reading it (two reductions over one range, as a softmax's are),
so that the normalisation runs in the product's kernel: a product's blocks each read the row
(a few KB, from L2) once more for the statistic. The products' weights, the larger read by
far, are read once, as before.

The rounding is the compiled step's own: the statistic is summed in another order than the
kernel of one block summed it.

Measured, it loses (``benchmarks/README.md``, H100, ``compiled_step_kernels.py``): GPT-2 small's
compiled step held 106 nodes instead of 130, every statistic fused as planned, and took 0.586
ms a token against 0.390, its tokens those of the step without, 128 of 128. Each block of a
product now reduces the statistic (LayerNorm's mean and variance) across its threads before
its own dot products: the head's 25,129 blocks of two outputs each did so 25,129 times. So
``CompiledStep.row_statistics`` is off.

:func:`factor_statistics` is the form without that second pass: where the row is a sum of a
few rows scaled by numbers made of the statistics (RMSNorm's one, LayerNorm's three), the
product reduces those rows and the statistics in one loop and scales after (see below;
``CompiledStep.factored_statistics``, off: GPT-2 small's step took 0.456 against 0.420 ms a
token on an H100; the Llama shape's, whose bias-free products reach it on a GPU through the
one-row ``mm`` Inductor decomposes there (``thin_matmuls``), took 1.461 against 1.368 ms on
an H200, 236 nodes against 255).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Node

__all__ = ["TERMS", "factor_statistics", "inline_statistics"]

# How far back from a product's row its statistics are looked for, in operations: a norm's
# statistic lies about 10 back (RMSNorm's mean, LayerNorm's var_mean, with the casts between),
# and what lies further is read as it is. (Walking further would climb the residual stream
# back through every layer before: its adds are pointwise too.)
DEPTH = 16

# Views that, from one row to one row of as many elements, change nothing but the leading
# dimensions of size 1 (a slice or a selection then takes the whole row: a step's logits of its
# last position are its one position's)
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default,
          torch.ops.aten._unsafe_view.default, torch.ops.aten.unsqueeze.default,
          torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims,
          torch.ops.aten.squeeze.default, torch.ops.aten.slice.Tensor,
          torch.ops.aten.select.int, torch.ops.aten.alias.default}


def _value(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _row(val: torch.Tensor | None) -> bool:
    """One row: every dimension but the last of size 1 (a 0-d tensor is not a row here)."""
    return val is not None and val.dim() >= 1 and all(d == 1 for d in val.shape[:-1])


def _tagged(node: Node, tag: torch.Tag) -> bool:
    return tag in getattr(node.target, "tags", ())


def _names(node: Node) -> list[str]:
    schema = getattr(node.target, "_schema", None)
    return [a.name for a in schema.arguments] if schema is not None else []


def _statistic(node: Node) -> bool:
    """A reduction of a row to one number (whatever dimensions it names, a row has one), by
    an operator that takes the dimensions and keeps them on request."""
    if node.op != "call_function" or not {"self", "dim", "keepdim"} <= set(_names(node)):
        return False
    src = node.args[0] if node.args else None
    # (each result one number: var_mean's two, or the one of mean, sum, amax)
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, tuple) else (vals,)
    ok = all(isinstance(v, torch.Tensor) and v.numel() == 1 for v in vals)
    return (ok and _tagged(node, torch.Tag.reduction) and isinstance(src, Node)
            and _row(_value(src)))


def _passes(node: Node) -> bool:
    """An operation the rewritten row may run per output: pointwise, a view of one row as one
    row, or one of a statistic's results."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], Node) and _statistic(node.args[0])
    val = _value(node)
    if node.target in _VIEWS:
        src = _value(node.args[0])
        return (_row(val) or (val is not None and val.numel() == 1)) and src is not None and (
            _row(src) or src.numel() == 1) and src.numel() == val.numel()
    return _tagged(node, torch.Tag.pointwise) and val is not None and (
        _row(val) or val.numel() == 1)


def _plan(row: Node) -> tuple[list[Node], list[Node]] | None:
    """The nodes to run again per output (in the graph's order) and the nodes they read
    (leaves), for the product's row ``row``; None where it holds no statistic or is made
    otherwise than :func:`_passes` allows."""
    walked: set[Node] = set()
    todo = [(row, 0)]
    while todo:  # (breadth first: each node at its shortest distance from the row)
        node, depth = todo.pop(0)
        if node in walked or depth > DEPTH or not (_statistic(node) or _passes(node)):
            continue  # (a leaf, read as it is)
        walked.add(node)
        todo.extend((a, depth + 1) for a in node.all_input_nodes)
    if row not in walked:
        return None
    # Per output: the statistics and what depends on them; the rest is read as it is.
    order = [n for n in row.graph.nodes if n in walked]
    again: list[Node] = []
    for node in order:
        if _statistic(node) or any(a in again for a in node.all_input_nodes):
            again.append(node)
    if row not in again:
        return None
    members = set(again)
    leaves = list(dict.fromkeys(a for n in again for a in n.all_input_nodes
                                if a not in members))
    for leaf in leaves:
        val = _value(leaf)
        if val is None or not (val.dim() == 0 or _row(val) or val.numel() == 1):
            return None
    return again, leaves


def _per_output(node: Node, env: dict[Node, Any], outputs: int) -> Any:
    """``node`` (of a plan's ``again``) run on what ``env`` holds for its inputs: a statistic
    reduced per output, kept as (outputs, 1); one of its results; a view (one row stays one
    row); any other operation as it is."""
    def arg(a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda n: env[n])

    if node.target is operator.getitem:
        return env[node.args[0]][node.args[1]]
    if node.target in _VIEWS:
        return env[node.args[0]]
    if not _statistic(node):
        return node.target(*arg(node.args), **arg(node.kwargs))
    # (every argument by name, the row per output and reduced along its one dimension)
    src = env[node.args[0]]
    given = arg(node.args)
    kwargs = dict(zip(_names(node)[:len(given)], given, strict=True), **arg(node.kwargs))
    kwargs.update(self=src.expand(outputs, src.shape[-1]), dim=[-1], keepdim=True)
    return node.target(**kwargs)


def _flat(t: Any) -> Any:
    # Every row as (1, len) and every single number as (1, 1), so that what is per output,
    # (outputs, 1) or (outputs, len), broadcasts against it.
    if isinstance(t, torch.Tensor) and t.dim() >= 1:
        return t.reshape(1, -1)
    return t


def inline_statistics(row: Node, outputs: int
                      ) -> tuple[Callable[..., torch.Tensor], list[Node]] | None:
    """For the one-row input ``row`` of a product with ``outputs`` outputs: a function of the
    returned leaves giving the row as each output would make it, ``(outputs, len)``, its
    statistics reduced per output; None where ``row`` holds no statistic of its own row, or
    is made otherwise than pointwise and by views of one row."""
    plan = _plan(row)
    if plan is None:
        return None
    again, leaves = plan

    def rebuilt(*values: torch.Tensor) -> torch.Tensor:
        env: dict[Node, Any] = {leaf: _flat(v) for leaf, v in zip(leaves, values, strict=True)}
        for node in again:
            env[node] = _per_output(node, env, outputs)
        out = env[row]
        return out.expand(outputs, out.shape[-1])

    return rebuilt, leaves


# ----------------------------------------------------------------------------------------
# Factored: the statistics as scales of the product's outputs, reduced in its one loop.
#
# Measured above, the row remade per output costs each block of a product a reduction of the
# statistic before its dot products can start: two passes, a barrier between. But a product
# is linear in its row. Where the row is a sum of a few terms, each a scale made of the
# statistics (one number per row) times a row made without them, the product is that sum of
# scales times the dot products of those rows:
#
#   RMSNorm    w * (x * r)               -> r * dot(x * w, W[j])
#   LayerNorm  (x - m) * r * g + b       -> r * dot(x * g, W[j]) - m * r * dot(g, W[j])
#                                            + dot(b, W[j])
#
# Every dot product and every statistic (reduced per output, as above) then reduces over the
# same range independently of the others: one loop of several accumulators, the scales
# applied after it.

aten, prims = torch.ops.aten, torch.ops.prims

# Operations through which a row made from statistics stays a sum of scaled rows (each
# checked further in _terms); a cast is taken as no rounding at all: the rows are summed in
# float32
_LINEAR = {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default,
           aten.div.Tensor, prims.convert_element_type.default}

# The most terms (scaled rows, each one more dot product in the product's loop) a factored row
# may have: LayerNorm's three
TERMS = 4

# A term: (scale, rest), the scale (outputs, 1) or (1, 1) or a number, the rest (1, len) in
# float32; None for either is one (a rest of one: the weight row's own sum)
Term = tuple[Any, torch.Tensor | None]


def _is_row(node: Any) -> bool:
    """A row of more than one element (not a single number)."""
    val = _value(node)
    return _row(val) and val.numel() > 1


def _terms(again: list[Node]) -> dict[Node, int] | None:
    """How many terms each row of ``again`` (those made from statistics) is the sum of; None
    where one of them is not linear in those rows, or where a statistic or a single number
    is made from one of them."""
    terms: dict[Node, int] = {}
    for node in again:
        formed = [a for a in node.all_input_nodes if a in terms]
        if not _is_row(node):
            if formed:  # (a single number, or a statistic, of a row made from statistics)
                return None
            continue
        if node.target in _VIEWS or node.target is prims.convert_element_type.default:
            terms[node] = terms[node.args[0]]
            continue
        if node.target not in _LINEAR or node.kwargs:  # (add's and sub's alpha among them)
            return None
        counts = [terms.get(a, 1) if isinstance(a, Node) else 1 for a in node.args]
        if node.target is aten.mul.Tensor:
            terms[node] = counts[0] * counts[1]
        elif node.target is aten.div.Tensor:
            if isinstance(node.args[1], Node) and node.args[1] in terms:
                return None  # (divided by a row made from statistics: not linear)
            terms[node] = counts[0]
        else:
            terms[node] = sum(counts)
        if terms[node] > TERMS:
            return None
    return terms


def _times(p: Any, q: Any) -> Any:
    return q if p is None else p if q is None else p * q


def factor_statistics(row: Node, outputs: int
                      ) -> tuple[Callable[..., list[Term]], list[Node]] | None:
    """For the one-row input ``row`` of a product with ``outputs`` outputs: a function of the
    returned leaves giving the row as a sum of at most :data:`TERMS` terms ``(scale, rest)``,
    each scale made of the row's statistics reduced per output, ``(outputs, 1)``, each rest a
    row made without them (see above); None where ``row`` holds no statistic of its own row,
    or is not such a sum."""
    plan = _plan(row)
    if plan is None:
        return None
    again, leaves = plan
    counted = _terms(again)
    if counted is None or row not in counted:
        return None

    def factored(*values: torch.Tensor) -> list[Term]:
        env: dict[Node, Any] = {leaf: _flat(v) for leaf, v in zip(leaves, values, strict=True)}

        def form(a: Any) -> list[Term]:
            if isinstance(a, Node) and a in counted:
                return env[a]
            value = env[a] if isinstance(a, Node) else a
            return [(None, value.float())] if _is_row(a) else [(value, None)]

        for node in again:
            if node not in counted:  # (a statistic, or a single number made from them)
                env[node] = _per_output(node, env, outputs)
            elif node.target in _VIEWS or node.target is prims.convert_element_type.default:
                env[node] = env[node.args[0]]
            elif node.target is aten.neg.default:
                env[node] = [(_times(s, -1.0), r) for s, r in form(node.args[0])]
            elif node.target is aten.add.Tensor:
                env[node] = form(node.args[0]) + form(node.args[1])
            elif node.target is aten.sub.Tensor:
                env[node] = form(node.args[0]) + [(_times(s, -1.0), r)
                                                  for s, r in form(node.args[1])]
            elif node.target is aten.mul.Tensor:
                env[node] = [(_times(s, t), _times(r, q)) for s, r in form(node.args[0])
                             for t, q in form(node.args[1])]
            else:  # div: by a row or a number made without statistics (_terms checked)
                [(t, q)] = form(node.args[1])
                env[node] = [(s if t is None else _times(s, 1.0 / t),
                              r if q is None else (torch.ones_like(q) if r is None else r) / q)
                             for s, r in form(node.args[0])]
        return env[row]

    return factored, leaves
