"""Products of one row by weights of different sizes, read as one product by them stacked.

A Llama layer multiplies its normalised row by the query's, key's and value's weights: three
``Linear`` products over one row. Inductor fuses reductions of one size over the same row into
one kernel, with what follows them (the key and value products and their writes into the
cache; the gate and up products and ``silu(gate) * up``), but not reductions of different
sizes: the query's product (2048 outputs on the Llama shape) stays a kernel apart from the
key's and value's (256 each). On an H200 the compiled Llama step launched each layer's key
and value product (2 MB of weights) as a kernel of its own, of 8 to 128 blocks.

:func:`stack` rewrites a step's graph (Dynamo's, before Inductor lowers it) so that the
``Linear`` products that share their input, whose weights are parameters of one layout and
whose output sizes differ, read one weight, where the smallest of them is small enough that
its product is held by its latency (:data:`SMALLEST`): a copy of theirs stacked along the
outputs (and their biases stacked the same), made once as the step compiles. Each product's
result is then a slice of the stacked one's, along its last dimension: the values each
output's dot product gives are those of the same row and weight row, in a kernel sized to all
of them. Products of one size are left to Inductor: stacked, their neighbours no longer fuse
into their kernel (the Llama shape's step scheduled 316 kernels against 298 with the gate and
up products stacked too, 294 without them: ``benchmarks/triton_schedule.py``, CPU).
Inductor's own batch fusion (``batch_linear_lhs``) makes the same product but concatenates
the weights inside the graph, each call: a decode step would copy them every token.

On an H100, the Llama shape's compiled step (hidden 2048, 22 layers, 32 query and 4 key
heads, fp16, batch 1) took 1.394 ms a token stacked against 1.517 unstacked, side by side in
one process (``benchmarks/compiled_step_kernels.py``; 254 nodes against 255: the value's write
into the cache, fused into the key and value product before, is a kernel of its own), with
the same 128 tokens. In another process the unstacked step's autotuning chose kernels that
took 2.227 ms against the stacked one's 1.361.

The copies cost the stacked weights' bytes again (a Llama layer's query, key and value
weights), once for every graph of a compiled step, for as long as it lives. As
:mod:`grape.torch.weight_rows`' copies, each is refreshed where one of its weights changed
in place (:meth:`StackedWeight.refresh`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SMALLEST", "StackedWeight", "read_copy", "stack"]

# The largest weight a group's smallest product may read for the group to be stacked. A
# one-row product by a small weight is held by its own latency, not by reading it: on an H200,
# in a graph, the Llama shape's key product (1 MB) took 1.84 us, a seventh of the rate its
# up product (23 MB, 5.53 us) read at (benchmarks/README.md, one_row_products.py). Where
# every weight of a group is larger, stacking saves a launch a layer at most and copies tens
# of megabytes a layer (a 70B Llama's query, key and value: 168 MB a layer), so it is not
# done.
SMALLEST = 4 << 20

# ``nn.Linear``'s call in a Dynamo graph (``F.linear`` is the same builtin), and an autocast
# region's start there.
_LINEAR = torch._C._nn.linear
_AUTOCAST = torch.amp.autocast_mode._enter_autocast


@dataclass
class StackedWeight:
    """Parameters ``sources`` (weights, or biases) stacked along their first dimension in
    ``copy``, which compiled graphs read in their place."""

    sources: tuple[torch.Tensor, ...]
    copy: torch.Tensor
    versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.versions:
            self.versions = [s._version for s in self.sources]

    @classmethod
    def of(cls, sources: Sequence[torch.Tensor]) -> StackedWeight:
        with torch.no_grad():
            return cls(tuple(sources), torch.cat([s.detach() for s in sources], dim=0))

    def refresh(self) -> bool:
        """Copy again each source that changed in place since; whether any had."""
        changed = False
        start = 0
        for i, source in enumerate(self.sources):
            rows = source.shape[0]
            if source._version != self.versions[i]:
                with torch.no_grad():
                    self.copy[start:start + rows].copy_(source)
                self.versions[i] = source._version
                changed = True
            start += rows
        return changed


def _key(sources: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    # (by storage, not identity: a parameter given another tensor is another weight)
    return tuple((s.data_ptr(), tuple(s.shape), s.dtype) for s in sources)


def _linear(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, Any] | None:
    """A ``linear`` call's (input, weight, bias) where its weight is a graph input."""
    if node.op != "call_function" or node.target is not _LINEAR:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x, weight = node.kwargs.get("input", args[0]), node.kwargs.get("weight", args[1])
    bias = node.kwargs.get("bias", args[2])
    if not isinstance(x, torch.fx.Node) or not isinstance(weight, torch.fx.Node):
        return None
    return x, weight, bias


def _stackable(weight: Any, bias: Any, x: Any) -> bool:
    """Whether a product of rows ``x`` by parameter ``weight`` (out, in) with ``bias`` (a
    parameter or None) may read a stacked copy: contiguous, in ``x``'s dtype and device."""
    return (isinstance(weight, torch.nn.Parameter) and weight.dim() == 2
            and weight.is_contiguous() and isinstance(x, torch.Tensor)
            and weight.dtype == x.dtype and weight.device == x.device
            and (bias is None or (isinstance(bias, torch.nn.Parameter) and bias.dim() == 1
                                  and bias.dtype == weight.dtype
                                  and bias.is_contiguous())))


def read_copy(gm: torch.fx.GraphModule, before: torch.fx.Node, name: str,
              tensor: torch.Tensor, fake_mode: Any) -> torch.fx.Node:
    """``tensor`` (a copy grape made, of weights) registered on ``gm`` as buffer ``name``,
    read by a node before ``before`` (with a fake value in ``fake_mode``, where given)."""
    gm.register_buffer(name, tensor)
    if hasattr(gm, "_param_name_to_source"):
        # (AOTAutograd lifts a Dynamo graph's buffers as inputs and looks up where each came
        # from; this one comes from no user code)
        from torch._dynamo.source import ConstantSource

        gm._param_name_to_source[name] = ConstantSource(name)
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(name)
    if fake_mode is not None:
        node.meta["example_value"] = fake_mode.from_tensor(tensor)
    return node


def stack(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
          known: dict[tuple[Any, ...], StackedWeight] | None = None,
          smallest: int = SMALLEST) -> list[StackedWeight]:
    """Rewrite ``gm``'s ``linear`` products that share their input, whose weights are
    parameters of one dtype and layout (and biases all parameters, or all none), whose
    output sizes differ and whose smallest weight holds at most ``smallest`` bytes, into one
    product by their weights stacked, each result a slice of its. ``example_inputs`` are the
    real tensors of ``gm``'s placeholders, in order, as a ``torch.compile`` backend is given
    them; ``known``: copies made for earlier graphs, by the weights they stack, reused and
    extended. Returns the copies this graph reads that ``known`` did not hold."""
    known = {} if known is None else known
    if any(n.op == "call_function" and n.target is _AUTOCAST for n in gm.graph.nodes):
        return []  # (a product moved into or out of an autocast region would change dtype)
    inputs = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs,
                      strict=False))
    groups: dict[tuple[torch.fx.Node, bool], list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        found = _linear(node)
        if found is None:
            continue
        x, weight, bias = found
        real_bias = inputs.get(bias) if isinstance(bias, torch.fx.Node) else bias
        if bias is not None and real_bias is None:
            continue  # (a bias computed in the graph)
        if _stackable(inputs.get(weight), real_bias, x.meta.get("example_value")):
            groups.setdefault((x, bias is None), []).append(node)
    made: list[StackedWeight] = []
    for (_, unbiased), products in groups.items():
        if len(products) < 2:
            continue
        weights = [inputs[_linear(p)[1]] for p in products]
        if len({w.shape[0] for w in weights}) == 1:
            continue  # (one size: Inductor fuses them, and what follows, by itself)
        if min(w.nbytes for w in weights) > smallest:
            continue  # (every product reads enough to fill the GPU: copies for little)
        fake = next((v.meta["example_value"].fake_mode for v in products
                     if hasattr(v.meta.get("example_value"), "fake_mode")), None)
        stacked = []
        for part, sources in (("weight", weights),
                              ("bias", None if unbiased
                               else [inputs[_linear(p)[2]] for p in products])):
            if sources is None:
                stacked.append(None)
                continue
            key = _key(sources)
            if key not in known:
                known[key] = StackedWeight.of(sources)
                made.append(known[key])
            name = f"_grape_stacked_{part}_{len(known)}_{products[0].name}"
            stacked.append(read_copy(gm, products[0], name, known[key].copy, fake))
        x = _linear(products[0])[0]
        with gm.graph.inserting_before(products[0]):
            whole = gm.graph.call_function(_LINEAR, (x, *stacked))
        if fake is not None:
            with fake:
                whole.meta["example_value"] = torch.nn.functional.linear(
                    x.meta["example_value"], *(s.meta["example_value"] if s else None
                                               for s in stacked))
        start = 0
        for product, weight in zip(products, weights, strict=True):
            with gm.graph.inserting_after(whole):
                part = gm.graph.call_function(torch.narrow,
                                              (whole, -1, start, weight.shape[0]))
            # (where it came from, for kernel names and error messages; not what it was: a
            # pass matching linear calls by their source would take the slice for one)
            part.meta.update({k: product.meta[k] for k in ("stack_trace", "nn_module_stack")
                              if k in product.meta})
            if "example_value" in whole.meta:
                part.meta["example_value"] = whole.meta["example_value"].narrow(
                    -1, start, weight.shape[0])
            product.replace_all_uses_with(part)
            gm.graph.erase_node(product)
            start += weight.shape[0]
    if any(len(p) > 1 for p in groups.values()):
        gm.graph.lint()
        gm.recompile()
    return made
