"""One-row products by a Triton GEMV of grape's own, for compiled decode steps: an experiment.

At batch 1 a compiled decode step is mostly products of one row by a weight, and Inductor's
kernels for them read the weights well below the card's bandwidth: on an H100, the Llama
shape's reductions at 1.3 to 2.0 TB/s of 3.35 (77% of its step), GPT-2 small's GEMM templates
16 rows high at about 0.55 TB/s (``benchmarks/README.md``). Such a product needs no tiling for
rows: each program reads a tile of the weight, long along whichever dimension lies contiguous,
multiplies it by the row's slice and keeps float32 sums; where the outputs are too few to
occupy the SMs, the reduction is split and a second kernel adds the splits' partial sums in a
fixed order (no atomics: the same bits every run).

- :func:`one_row_product` (``torch.ops.grape.one_row_product``) is the product as a custom
  operator: ``a`` (1, K) times ``b`` (K, N) at any strides, plus an optional bias, summed in
  float32 and rounded once to ``a``'s type, as a GEMM's epilogue rounds. On a GPU with Triton
  it runs the kernels; elsewhere, float32's product (the same arithmetic, to the sums' order).
- Each (K, N, layout, type, device) takes the fastest of :func:`configs` the first time it
  runs outside a capture, timed by Triton's ``do_bench`` (which clears L2 between runs, so
  the weights come from HBM as in a step); inside a capture, where nothing may be timed, an
  untimed choice (:func:`untimed_config`) serves it and is not kept.
- :class:`OneRowKernels` is an Inductor pre-grad pass that rewrites a step's one-row
  ``linear`` and ``addmm`` calls, either weight layout, into the operator, before Inductor
  decomposes them (it makes a plain one-row ``mm`` a reduction of its own when it decomposes,
  where coordinate-descent tuning is on, so a later pass would find none).
  ``CompiledStep.row_kernels`` turns it on; off by default: on an H100 the fastest
  configuration trailed Inductor's kernel on every product of GPT-2 small and the Llama shape
  (``benchmarks/one_row_kernels.py``), and the steps ran 1.16x and 1.99x slower with it
  (``benchmarks/compiled_step_kernels.py``; ``benchmarks/README.md``).

What it gives up: Inductor fuses its reductions with their neighbours (a layer norm before, a
residual add after); the operator is a call of its own, so those run as kernels apart.
"""

# (no ``from __future__ import annotations``: torch.library reads the operator's annotations
# to make its schema)

import functools
import logging
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import statically_known_true

from grape.torch.inductor_passes import ChainedPass

__all__ = ["OneRowKernels", "configs", "one_row_product", "product", "rewrite",
           "untimed_config"]

_LOG = logging.getLogger("grape")

# (block_k, block_n, split, warps): a tile of block_k x block_n of the weight per program,
# the reduction in ``split`` interleaved parts, ``warps`` warps a program.
Config = tuple[int, int, int, int]


@functools.cache
def _kernels() -> Any:
    """The Triton kernels, made on first use (Triton is imported only where one runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gemv(x, w, bias, out, K, N, stride_x, stride_k, stride_n,
             BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
             HAS_BIAS: tl.constexpr):
        # out[split, n] = sum over this split's k of x[k] * w[k, n], in float32; with one
        # split, the bias added (HAS_BIAS: only then) and the sum rounded to out's type here
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        for step in range(0, tl.cdiv(K, BLOCK_K * SPLIT)):
            k = (step * SPLIT + split) * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(x + k * stride_x, mask=k < K, other=0.0).to(tl.float32)
            b = tl.load(w + k[:, None] * stride_k + n[None, :] * stride_n,
                        mask=(k[:, None] < K) & (n[None, :] < N), other=0.0).to(tl.float32)
            acc += a[:, None] * b
        total = tl.sum(acc, axis=0)
        if HAS_BIAS:
            total += tl.load(bias + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out + split * N + n, total.to(out.dtype.element_ty), mask=n < N)

    @triton.jit
    def splits(part, bias, out, N, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_BIAS: tl.constexpr):
        # out[n] = the SPLIT partial sums of n added in order (and the bias), rounded once
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for s in range(SPLIT):
            total += tl.load(part + s * N + n, mask=n < N, other=0.0)
        if HAS_BIAS:
            total += tl.load(bias + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out + n, total.to(out.dtype.element_ty), mask=n < N)

    return gemv, splits


@functools.cache
def _triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def configs(k: int, n: int, contiguous_k: bool, sms: int) -> list[Config]:
    """The configurations tried for a (K, N) weight: tiles of 4K or 8K elements (4 and 8
    warps), long along the contiguous dimension so that a warp's loads are coalesced, each
    unsplit and split over the reduction until the programs cover the ``sms`` about once."""
    out = []
    for size, warps in ((4096, 4), (8192, 8)):
        for bk in (16, 32, 64, 128, 256, 512, 1024, 2048):
            bn = size // bk
            if (bk < 128) if contiguous_k else (bn < 64):
                continue
            if bk > 2 * _next_power_of_2(k) or bn > 2 * _next_power_of_2(n):
                continue
            cover = min(max(1, k // bk), max(1, round(sms / -(-n // bn))))
            for split in sorted({1, cover}):
                out.append((bk, bn, split, warps))
    return out


def untimed_config(k: int, n: int, contiguous_k: bool, sms: int) -> Config:
    """A configuration chosen without timing: 4K-element tiles, as long along the contiguous
    dimension as it allows (up to 512 along the reduction, 256 across it), split until the
    programs cover the SMs once."""
    if contiguous_k:
        bk = min(512, _next_power_of_2(k))
        bn = max(1, 4096 // bk)
    else:
        bn = min(256, _next_power_of_2(n))
        bk = max(1, 4096 // bn)
    cover = min(max(1, k // bk), max(1, round(sms / -(-n // bn))))
    return bk, bn, cover, 4


def product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
            config: Config) -> torch.Tensor:
    """``a @ b (+ bias)`` on the GPU by the Triton kernels in ``config``: float32 sums,
    rounded once to ``a``'s type."""
    gemv, splits = _kernels()
    k, n = b.shape
    bk, bn, split, warps = config
    out = torch.empty((1, n), dtype=a.dtype, device=a.device)
    has_bias = bias is not None
    bias_arg = bias if has_bias else out  # (a pointer the kernels never read)
    if split == 1:
        gemv[(-(-n // bn), 1)](a, b, bias_arg, out, k, n, a.stride(1), b.stride(0),
                               b.stride(1), BLOCK_K=bk, BLOCK_N=bn, SPLIT=1,
                               HAS_BIAS=has_bias, num_warps=warps)
        return out
    part = torch.empty((split, n), dtype=torch.float32, device=a.device)
    gemv[(-(-n // bn), split)](a, b, bias_arg, part, k, n, a.stride(1), b.stride(0),
                               b.stride(1), BLOCK_K=bk, BLOCK_N=bn, SPLIT=split,
                               HAS_BIAS=False, num_warps=warps)
    splits[(-(-n // 1024),)](part, bias_arg, out, n, SPLIT=split, BLOCK_N=1024,
                             HAS_BIAS=has_bias)
    return out


# The configuration timed fastest per (K, N, contiguous_k, dtype, device index).
_CHOSEN: dict[tuple[Any, ...], Config] = {}


def _config(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> Config:
    k, n = b.shape
    contiguous_k = b.stride(0) == 1
    key = (k, n, contiguous_k, a.dtype, a.device.index)
    if key in _CHOSEN:
        return _CHOSEN[key]
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    if torch.cuda.is_current_stream_capturing():
        return untimed_config(k, n, contiguous_k, sms)
    from triton.testing import do_bench

    tried = configs(k, n, contiguous_k, sms) or [untimed_config(k, n, contiguous_k, sms)]
    timed = [(do_bench(lambda c=c: product(a, b, bias, c), warmup=5, rep=20), c)
             for c in tried]
    _CHOSEN[key] = min(timed)[1]
    _LOG.debug("grape.torch.triton_gemv: %s -> %s (%.2f us)", key, _CHOSEN[key],
               min(timed)[0] * 1e3)
    return _CHOSEN[key]


@torch.library.custom_op("grape::one_row_product", mutates_args=())
def one_row_product(a: torch.Tensor, b: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a`` (1, K) times ``b`` (K, N), any strides, plus ``bias`` (N,) where given, summed in
    float32 and rounded once to ``a``'s type (see the module)."""
    if a.shape[0] != 1 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"expected a (1, K) row and a (K, N) weight, found "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    if a.is_cuda and _triton():
        return product(a, b, bias, _config(a, b, bias))
    total = a.float() @ b.float()
    if bias is not None:
        total = total + bias.float()
    return total.to(a.dtype)


@one_row_product.register_fake
def _(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return a.new_empty((1, b.shape[1]))


# The calls rewritten: ``linear(x, w, bias)`` with w stored (out, in); ``addmm(bias, x, w)``.
_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)
_ADDMM = (torch.addmm,)


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _one_row(x: Any, w: Any, bias: Any) -> bool:
    """Whether ``x`` (its last dimension the reduction's) holds one row, known at compile
    time, of the floats ``w`` (2-D) holds, and ``bias`` is absent or one per output."""
    vx, vw, vb = _value(x), _value(w), _value(bias)
    if not isinstance(vx, torch.Tensor) or not isinstance(vw, torch.Tensor):
        return False
    if vx.dim() < 2 or vw.dim() != 2 or not vx.dtype.is_floating_point or vx.dtype != vw.dtype:
        return False
    if bias is not None and not (isinstance(vb, torch.Tensor) and vb.dim() == 1
                                 and vb.dtype == vx.dtype):
        return False
    return bool(statically_known_true(vx.numel() == vx.shape[-1]))


def _insert(graph: torch.fx.Graph, target: Any, *args: Any) -> torch.fx.Node:
    """``target(*args)`` with its example value (the pre-grad graph's nodes carry them)."""
    node = graph.call_function(target, args)
    node.meta["example_value"] = target(*(_value(x) if isinstance(x, torch.fx.Node) else x
                                          for x in args))
    return node


def rewrite(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph``'s (Dynamo's, before autograd) one-row ``linear`` and ``addmm``
    calls into :func:`one_row_product`; returns how many. Dynamo's
    ``counters["inductor"]["grape_row_kernels"]`` counts them too."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _LINEAR:
            args = list(node.args) + [None] * (3 - len(node.args))
            x, w, bias = args[0], args[1], node.kwargs.get("bias", args[2])
            transposed = True
        elif node.target in _ADDMM and not node.kwargs and len(node.args) == 3:
            bias, x, w = node.args
            transposed = False
        else:
            continue
        if not _one_row(x, w, bias):
            continue
        shape = tuple(_value(node).shape)
        with graph.inserting_before(node):
            row = _insert(graph, torch.reshape, x, (1, _value(x).shape[-1]))
            weight = _insert(graph, torch.t, w) if transposed else w
            out = _insert(graph, torch.ops.grape.one_row_product.default, row, weight, bias)
            out = _insert(graph, torch.reshape, out, shape)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        rewritten += 1
    counters["inductor"]["grape_row_kernels"] += rewritten
    return rewritten


class OneRowKernels(ChainedPass):
    """:func:`rewrite` as Inductor's ``pre_grad_custom_pass``, after ``before`` (a pass
    already configured, which keeps running; see :class:`ChainedPass` for its uuid)."""

    def apply(self, graph: torch.fx.Graph) -> None:
        rewrite(graph)
