"""One-row products by weights stored (in, out), read from copies laid (out, in).

GPT-2's ``Conv1D`` stores its weight (in, out) and multiplies by it as it lies
(``torch.addmm(bias, x, weight)``). At one row each output is then a dot product down a
column, strided through the weight: :mod:`grape.torch.thin_matmuls` leaves such products to
Inductor's GEMMs, tiled 16 rows high over few blocks (a 768 x 2304 product took 7.4 us on an
H100 where reading its 3.5 MB takes about 1), because rewritten as reductions down the
columns they ran slower still (GPT-2 small's greedy step, 0.899 against 0.547 ms a token).

:class:`WeightRows` is a ``torch.compile`` backend: before Inductor lowers a step's graph,
:func:`relay` gives every product of at most ``thin_matmuls.ROWS`` rows whose weight is a
graph input stored (in, out) a copy of that weight laid (out, in), read through its
transpose. The product sees the same values and shape, with a ``Linear`` weight's strides,
and ``thin_matmuls`` makes it the reduction along contiguous rows it makes of a ``Linear``'s
(on an OPT of width 1024, such reductions ran the step 0.514 against 0.789 ms a token).

The copies cost their weights' bytes again, once for all the graphs a compiled step compiles
(one per executable's shapes: each used to make copies of its own), for as long as the step
lives. They are not the weights: each :class:`RelaidWeight` is refreshed from its weight when
the weight has changed in place since (its version counter moved: ``load_state_dict``, an
optimizer's step) by :meth:`WeightRows.refresh`, which a compiled step calls before it runs
and ``grape.generate`` before each launch that holds it. A weight given another tensor
(``param.data = ...``) is not followed, as no captured graph follows it.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grape.torch.sibling_products import StackedWeight, read_copy, stack

__all__ = ["RelaidWeight", "WeightRows", "relay"]

_LOG = logging.getLogger("grape")

# The products whose weight may be relaid, with the weight's argument position (the rows
# are the argument before it).
_PRODUCTS: dict[Any, int] = {torch.addmm: 2, torch.mm: 1, torch.matmul: 1, operator.matmul: 1}


@dataclass
class RelaidWeight:
    """A weight stored (in, out) and its copy laid (out, in) that a compiled graph reads."""

    source: torch.Tensor
    copy: torch.Tensor
    version: int

    def refresh(self) -> bool:
        """Copy the weight again where it changed in place since; whether it had."""
        if self.source._version == self.version:
            return False
        with torch.no_grad():
            self.copy.copy_(self.source.t())
        self.version = self.source._version
        return True


def _rows(value: Any) -> int | None:
    """The rows a product's left operand holds (all but its last dimension), where known."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    rows = 1
    for size in value.shape[:-1]:
        if not isinstance(size, int):
            return None  # (a dynamic size: not known to be few)
        rows *= size
    return rows


def _stored_in_out(weight: Any, rows: Any) -> bool:
    """Whether ``weight`` is a 2D floating parameter stored (in, out) (contiguous, so that
    each output reads a strided column), of more than one output, in ``rows``' dtype. (Only
    parameters: a buffer may be written by the very graphs that would read its copy.)"""
    return (isinstance(weight, torch.nn.Parameter) and weight.dim() == 2
            and weight.is_floating_point() and weight.shape[0] > 1 and weight.shape[1] > 1
            and weight.stride() == (weight.shape[1], 1)
            and isinstance(rows, torch.Tensor) and rows.dtype == weight.dtype)


def relay(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
          most_rows: int, known: dict[Any, RelaidWeight] | None = None
          ) -> list[RelaidWeight]:
    """Give ``gm``'s products of at most ``most_rows`` rows by an input weight stored
    (in, out) a copy of it laid (out, in), registered on ``gm`` as a buffer and read through
    its transpose (one copy per weight, whatever the products reading it). ``example_inputs``
    are the real tensors of ``gm``'s placeholders, in order, as a ``torch.compile`` backend
    is given them; ``known``: copies made for earlier graphs, by their weights' storage,
    reused and extended. Returns the copies made that ``known`` did not hold."""
    known = {} if known is None else known
    inputs = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs,
                      strict=False))
    relaid: dict[torch.fx.Node, torch.fx.Node] = {}
    made: list[RelaidWeight] = []
    for node in list(gm.graph.nodes):
        at = None
        if node.op == "call_function":  # (by identity: a call's target need not hash)
            at = next((i for f, i in _PRODUCTS.items() if node.target is f), None)
        if at is None or len(node.args) <= at or node.kwargs:
            continue
        weight, left = node.args[at], node.args[at - 1]
        if not isinstance(weight, torch.fx.Node) or not isinstance(left, torch.fx.Node):
            continue
        real, rows = inputs.get(weight), left.meta.get("example_value")
        count = _rows(rows)
        if count is None or count > most_rows or not _stored_in_out(real, rows):
            continue
        if weight not in relaid:
            name = f"_grape_weight_rows_{len(relaid)}"
            # (by storage, not identity: a parameter given another tensor is another weight)
            key = (real.data_ptr(), tuple(real.shape), real.dtype)
            if key not in known:
                with torch.no_grad():
                    copy = real.detach().t().contiguous()
                known[key] = RelaidWeight(real, copy, real._version)
                made.append(known[key])
            fake = weight.meta.get("example_value")
            fake_mode = getattr(fake, "fake_mode", None)
            laid = read_copy(gm, node, name, known[key].copy, fake_mode)  # (placeholders first)
            with gm.graph.inserting_before(node):
                viewed = gm.graph.call_function(torch.t, (laid,))
            if fake_mode is not None:
                viewed.meta["example_value"] = laid.meta["example_value"].t()
            relaid[weight] = viewed
        node.replace_input_with(weight, relaid[weight])
    if relaid:
        gm.graph.lint()
        gm.recompile()
    return made


class WeightRows:
    """A ``torch.compile`` backend: :func:`relay` over each graph (unless ``most_rows`` is
    None; where ``stacks``, :func:`grape.torch.sibling_products.stack` first), then
    ``compile`` (Inductor as ``torch.compile``'s ``mode`` and ``dynamic`` configure it). One
    copy serves every graph that reads it (each executable's shapes compile a graph of their
    own); :attr:`relaid` and :attr:`stacked` hold each copy made, for :meth:`refresh`."""

    def __init__(self, compile: Callable[[torch.fx.GraphModule, list[Any]], Any],
                 most_rows: int | None, stacks: bool = False) -> None:
        self.compile, self.most_rows, self.stacks = compile, most_rows, stacks
        self.relaid: list[RelaidWeight] = []
        self.stacked: list[StackedWeight] = []
        self._known: dict[Any, RelaidWeight] = {}
        self._known_stacks: dict[Any, StackedWeight] = {}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        # (copies made for this graph are kept once it compiled: a compilation that fails
        # drops them with it)
        known, known_stacks = dict(self._known), dict(self._known_stacks)
        stacked = stack(gm, example_inputs, known_stacks) if self.stacks else []
        made = ([] if self.most_rows is None
                else relay(gm, example_inputs, self.most_rows, known))
        compiled = self.compile(gm, example_inputs)
        self._known, self._known_stacks = known, known_stacks
        self.relaid.extend(made)
        self.stacked.extend(stacked)
        if made:
            _LOG.info("grape: %d one-row products' weights stored (in, out) are read from "
                      "copies laid (out, in): %.1f MB", len(made),
                      sum(r.copy.nbytes for r in made) / 1e6)
        if stacked:
            _LOG.info("grape: products that share their rows read %d stacked copies of their "
                      "weights: %.1f MB", len(stacked),
                      sum(r.copy.nbytes for r in stacked) / 1e6)
        return compiled

    def copies(self) -> list[RelaidWeight | StackedWeight]:
        """Every copy the compiled graphs read."""
        return [*self.relaid, *self.stacked]

    def refresh(self) -> int:
        """Refresh every copy whose weights changed in place; how many did."""
        return sum(r.refresh() for r in self.copies())
