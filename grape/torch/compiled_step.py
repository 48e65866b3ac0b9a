"""``compile=True``'s step: transformers' input preparation and the forward, compiled as one.

A compiled forward alone leaves the step's input preparation eager: transformers builds the
step's attention mask there (``create_masks_for_generate``: ranges, comparisons, the padding
mask's gather), and the logits are cast to float32 after it. On an H100, a GPT-2 small step
compiled that way held 147 nodes, 28 of them PyTorch's eager kernels beside Inductor's 102
(``benchmarks/README.md``). :class:`CompiledStep` compiles the preparation, the forward and the
cast as one function, so that Inductor fuses them too. Dynamo traces the preparation as one
graph for GPT-2 and Llama with grape's static cache (no graph break); a model whose
preparation it cannot compile keeps the forward compiled alone (calling a
:class:`CompiledStep` runs that).

The same GPT-2 step then held 14 more of PyTorch's eager kernels after the forward, each
on one element or one row: the decoder's bookkeeping (the lengths moved on, the token written,
finished rows, whether the loop runs on). :meth:`CompiledStep.tail` compiles that too, as a
graph of its own (``Decoder._move_on``); the token's choice stays outside it, so the tokens
are those the step makes without it.

At batch 1 a decode step multiplies one row by each weight. Inductor writes a plain such
product as a reduction, but hands a biased one (``addmm``) to a GEMM tiled for many rows;
the step compiles with :mod:`grape.torch.thin_matmuls`'s pass, which makes those reductions
too, fused with their neighbours (:attr:`CompiledStep.thin_matmuls` turns it off, for
comparison). A product by a weight stored (in, out) (GPT-2's ``Conv1D``) reads a copy laid
(out, in), made as the step compiles, so that it becomes such a reduction as well
(:mod:`grape.torch.weight_rows`; :attr:`CompiledStep.weight_rows` turns it off).

Where a layer's products over one row differ in size (a query's, and the key's and value's
with fewer heads), Inductor fuses the equal ones but not the others; the step stacks them as
one product by a copy of their weights (:mod:`grape.torch.sibling_products`;
:attr:`CompiledStep.sibling_products` turns it off).

A model with fewer key heads than query heads has transformers copy each layer's keys and
values once per query head they serve, where a mask is given. While the step compiles, its
one-query attention reads them where they lie instead, the query heads a key head serves
taken as rows (:mod:`grape.torch.grouped_queries`; :attr:`CompiledStep.grouped_queries`
turns it off).

:attr:`CompiledStep.row_kernels` runs the step's one-row products by a Triton GEMV of
grape's own instead of Inductor's kernels (:mod:`grape.torch.triton_gemv`): an experiment,
off by default, measured slower than Inductor's kernels on an H100.

:attr:`CompiledStep.row_statistics` has each one-row product whose row a norm made reduce the
norm's statistic again per output, so that Inductor fuses it into the product's kernel and the
norm's kernel of one block goes (:mod:`grape.torch.row_statistics`). An experiment, off:
GPT-2 small's step held 106 nodes instead of 130 but took 0.586 ms a token against 0.390
(H100, side by side), the products paying for the statistic in every block.
:attr:`CompiledStep.factored_statistics` has each such product whose row is a sum of a few
rows scaled by the statistics (RMSNorm's one, LayerNorm's three) reduce those rows and the
statistics in one loop and scale after, with no pass over the row before its dot products
(:func:`grape.torch.row_statistics.factor_statistics`). An experiment, off.

Each executable grape builds (a batch, a prompt bucket, a length, a strategy) compiles the
step at shapes of its own, once. Dynamo keeps at most ``recompile_limit`` (8) compilations of
a function and runs it eagerly past that, saying so only in a log line: a server's ninth
shape would have been captured uncompiled and reported compiled. Calls of these functions
raise that limit to :data:`SHAPES` while they run.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from grape.torch.control import capturing
from grape.torch.grouped_queries import grouped_queries
from grape.torch.weight_rows import WeightRows

__all__ = ["SHAPES", "CompiledStep", "divides_as_eager"]

# Compilations of each of grape's compiled functions (executables' shapes) before Dynamo runs
# it eagerly; a tail or step compiled with fullgraph then raises, and falls back as said.
SHAPES = 1024


def _limits() -> dict[str, int]:
    """Dynamo's recompile limits, raised to :data:`SHAPES` (those this torch has)."""
    config = torch._dynamo.config
    wanted = {"recompile_limit": SHAPES, "accumulated_recompile_limit": 4 * SHAPES}
    return {k: max(v, getattr(config, k)) for k, v in wanted.items() if hasattr(config, k)}


# Inductor's switch for float32 division as eager rounds it (IEEE): without it Triton's
# division is approximate (``div.full``), which could part a tie that eager would break.
_DIVISION = "eager_numerics.division_rounding"


def divides_as_eager() -> bool:
    """Whether this torch's Inductor can divide as eager does (:data:`_DIVISION`)."""
    numerics = getattr(torch._inductor.config, "eager_numerics", None)
    return hasattr(numerics, "division_rounding")


def _shaped(fn: Callable[..., Any], inductor: dict[str, Any] | None = None,
            grouped: bool = False, weights: WeightRows | None = None) -> Callable[..., Any]:
    """``fn`` (compiled) called with Dynamo's recompile limits raised (:data:`SHAPES`) and
    Inductor's configuration patched with ``inductor`` (read while it compiles); ``grouped``:
    inside :func:`grouped_queries` (a step's one-query grouped attention without copies);
    ``weights``: its backend's relaid weights, refreshed first (not inside a capture, which
    would hold the copy: the launch refreshes them before it runs)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if weights is not None and not capturing():
            weights.refresh()
        with torch._dynamo.config.patch(**_limits()), \
                torch._inductor.config.patch(inductor or {}), \
                (grouped_queries() if grouped else contextlib.nullcontext()):
            return fn(*args, **kwargs)
    return call


# Inductor's switch for programmatic dependent launch (PDL): each of its Triton kernels waits
# for the kernel before it only where it first reads what that kernel wrote, and lets the next
# one start once its own reads are done, so that on Hopper and later a kernel's launch and
# prologue overlap the tail of the one before (Inductor emits nothing below compute
# capability 9). Captured, the launches become programmatic edges, which grape's IR keeps.
_PDL = "triton.enable_pdl"


def launches_dependently() -> bool:
    """Whether this torch's Inductor can emit programmatic dependent launches (:data:`_PDL`)."""
    return hasattr(torch._inductor.config.triton, "enable_pdl")


def _inductor_passes(thin: bool, rows: bool, pdl: bool = False,
                     statistics: bool = False, factored: bool = False
                     ) -> dict[str, Any] | None:
    """Inductor's configuration for a step's forward: ``thin``, :class:`ThinMatmuls` after
    any post-grad pass already configured (``statistics``: with its rows' statistics reduced
    per output; ``factored``: factored out as scales); ``rows``, :class:`OneRowKernels`
    after any pre-grad pass (a user's own passes keep running); ``pdl``, programmatic
    dependent launches (:data:`_PDL`). None: nothing to patch."""
    # (imported here: Inductor's pattern matcher takes most of a second to import, and a
    # process that never compiles a step should not pay for it)
    patches: dict[str, Any] = {_PDL: True} if pdl else {}
    if thin:
        from grape.torch.thin_matmuls import ThinMatmuls

        theirs = torch._inductor.config.post_grad_custom_pre_pass
        patches["post_grad_custom_pre_pass"] = ThinMatmuls(theirs, statistics, factored)
    if rows:
        from grape.torch.triton_gemv import OneRowKernels

        patches["pre_grad_custom_pass"] = OneRowKernels(
            torch._inductor.config.pre_grad_custom_pass)
    return patches or None


class CompiledStep:
    """``model``'s decode step under ``torch.compile(**options)``: :meth:`prepared` takes the
    step's token ids and the keyword arguments ``prepare_inputs_for_generation`` takes, and
    returns the last position's logits in float32; calling it runs the forward alone,
    compiled on first use (the form a compiled step falls back to)."""

    # Whether steps made from now on compile their one-row products as reductions
    # (grape.torch.thin_matmuls); off, they keep Inductor's GEMMs (benchmarks compare both).
    thin_matmuls = True
    # Whether they attend with one query's grouped heads as rows, reading keys and values
    # where they lie (grape.torch.grouped_queries); off, transformers repeats them per head.
    grouped_queries = True
    # Whether their one-row products run grape's Triton GEMV (grape.torch.triton_gemv)
    # rather than Inductor's kernels: an experiment, off (measured slower on an H100).
    row_kernels = False
    # Whether their one-row products by weights stored (in, out) read copies laid (out, in)
    # (grape.torch.weight_rows), so that thin_matmuls makes them reductions too.
    weight_rows = True
    # Whether their Triton kernels launch dependently (programmatic dependent launch, where
    # this torch's Inductor has it: launches_dependently; Hopper and later). Against the same
    # kernels with every edge full, the loops took 4% (Llama shape) and 20% (GPT-2) less time
    # with the edges grape.passes.dependent_launch keeps (H100, benchmarks/README.md).
    dependent_launch = True
    # Whether a one-row product whose row is normalised by statistics of that row (RMSNorm,
    # LayerNorm) reduces them again per output in its own kernel, rather than reading the
    # row a kernel of one block wrote first (grape.torch.row_statistics): an experiment, off
    # (fewer kernels, but GPT-2 small's step took 50% more time on an H100).
    row_statistics = False
    # Whether such a product, where its row is a sum of a few rows scaled by the statistics
    # (RMSNorm's one, LayerNorm's three), reduces those rows and the statistics in one loop
    # and scales after (grape.torch.row_statistics.factor_statistics): an experiment, off
    # (GPT-2 small's step 0.456 against 0.420 ms a token on an H100, 108 nodes against 130;
    # the Llama shape's 1.461 against 1.368 on an H200, 236 nodes against 255).
    factored_statistics = False
    # Whether their products that share their rows with outputs of different sizes (a
    # layer's query, key and value where keys have fewer heads) read one copy of their
    # weights stacked, as one product (grape.torch.sibling_products). On: the Llama shape's
    # step took 1.394 against 1.517 ms a token side by side on an H100 (another process,
    # whose default step autotuned poorly, 1.361 against 2.227). The copies cost those
    # weights' bytes again (230.7 MB there).
    sibling_products = True

    def __init__(self, model: torch.nn.Module, **options: Any) -> None:
        self.model, self.options = model, options
        self.thin, self.grouped = self.thin_matmuls, self.grouped_queries
        self.rows = self.row_kernels
        self.pdl = self.dependent_launch and launches_dependently()
        self.statistics = self.row_statistics and self.thin
        self.factored = self.factored_statistics and self.thin
        # (only in front of Inductor: another backend keeps the graph it is given)
        inductor = options.get("backend", "inductor") == "inductor"
        self.relays = self.weight_rows and self.thin and not self.rows and inductor
        self.stacks = self.sibling_products and not self.rows and inductor
        forward = _inductor_passes(self.thin, self.rows, self.pdl, self.statistics,
                                   self.factored)
        self.weights = self._backend() if self.relays or self.stacks else None
        self.prepared = _shaped(self._compile(self._prepared), forward, self.grouped,
                                self.weights)
        self._forward: Any = None
        self._forward_passes = forward

    def _backend(self) -> WeightRows:
        """Inductor as ``torch.compile`` configures it from these options, behind
        :func:`grape.torch.weight_rows.relay` (where the step relays weights) and
        :func:`grape.torch.sibling_products.stack` (where it stacks them)."""
        from grape.torch.thin_matmuls import ROWS

        inductor = torch._TorchCompileInductorWrapper(self.options.get("mode"),
                                                      self.options.get("options"),
                                                      self.options.get("dynamic"))
        return WeightRows(inductor, ROWS if self.relays else None, self.stacks)

    def _compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` under ``torch.compile`` with the step's options, through :attr:`weights`
        where it relays or stacks weights."""
        if self.weights is None:
            return torch.compile(fn, **self.options)
        rest = {k: v for k, v in self.options.items()
                if k not in ("mode", "options", "backend")}
        return torch.compile(fn, backend=self.weights, **rest)

    def refresh(self) -> int:
        """Copy the relaid weights again where their weights changed in place (before a
        launch that holds the step); how many did."""
        return 0 if self.weights is None else self.weights.refresh()

    def copied_bytes(self) -> int:
        """The device bytes of the relaid and stacked weights' copies."""
        return 0 if self.weights is None else sum(r.copy.nbytes for r in self.weights.copies())

    def _prepared(self, ids: torch.Tensor, kwargs: dict[str, Any],
                  decoder_positions: torch.Tensor | None) -> torch.Tensor:
        # (read so that Dynamo guards on them: its cache is per function, and two steps of one
        # model, one with a rewrite and one without, must not share a compilation)
        if self.thin:
            pass
        if self.grouped:
            pass
        if self.rows:
            pass
        if self.relays:
            pass
        if self.pdl:
            pass
        if self.statistics:
            pass
        if self.factored:
            pass
        if self.stacks:
            pass
        inputs = self.model.prepare_inputs_for_generation(ids, **kwargs)
        # (an encoder-decoder's decoder positions, where its preparation makes them from the
        # running mask: the decoder's own, as Decoder._decoder_positions gives them)
        if decoder_positions is not None and "decoder_position_ids" in inputs:
            inputs["decoder_position_ids"] = decoder_positions
        return self.model(**inputs, return_dict=True).logits[:, -1, :].to(torch.float32)

    def tail(self, fn: Callable[..., Any], divides: bool = False
             ) -> Callable[..., Any] | None:
        """``fn`` (a decoder's work after the forward) compiled with the step's options, as
        one graph: a graph break raises (caught by the decoder, which then runs ``fn``
        eagerly) rather than splitting it into pieces with eager work between. Where ``fn``
        ``divides`` floats, its divisions round as eager's (None, nothing compiled, where
        this torch's Inductor cannot: :func:`divides_as_eager`)."""
        if divides and not divides_as_eager():
            return None
        patches = {**({_DIVISION: True} if divides else {}), **({_PDL: True} if self.pdl else {})}
        return _shaped(torch.compile(fn, fullgraph=True, **self.options), patches or None)

    def __call__(self, **inputs: Any) -> Any:
        if self._forward is None:
            self._forward = _shaped(self._compile(self.model), self._forward_passes,
                                    self.grouped, self.weights)
        return self._forward(**inputs)
