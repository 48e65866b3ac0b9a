"""One row times a weight, read from HBM: how fast cuBLAS, Inductor and a plain Triton GEMV run it.

The compiled decode steps spend most of their time in one-row products: on an H100, 77% of the
Llama shape's step in Inductor's reductions at 1.3 to 2.0 TB/s of the card's 3.35, and 306 us of
GPT-2 small's 0.586 ms in GEMM templates 16 rows high (``benchmarks/README.md``, "Grouped
queries as rows"). ``one_row_products.py`` timed such products on one weight replayed from L2
(a graph of 100 products of the same weight, which L2 holds whole for every shape but the
heads), so it measured L2, not what a step pays: a step reads each weight once, from HBM.

This script cycles through enough copies of each weight that they overflow L2 (at least
:data:`SPILL` times its size), one product per copy in one CUDA graph, and reports the time per
product and the bandwidth it reached, for

- ``cublas``: the product as eager PyTorch runs it (cuBLAS's GEMV or GEMM);
- ``inductor``: ``torch.compile(mode="max-autotune-no-cudagraphs")`` of the product, as
  ``compile=True`` compiles a step (a reduction for a weight stored (out, in), autotuned GEMM
  templates or cuBLAS for one stored (in, out));
- ``triton``: ``grape.torch.triton_gemv``'s kernels, a plain Triton GEMV over the weight as
  it lies, either layout, split over the reduction where the outputs are too few to fill the
  SMs (partial sums in float32, added by a second kernel in a fixed order), with every
  configuration of its ``configs`` timed the same way and the fastest kept (``config``);
  ``untimed`` is its choice without timing (what a capture gets for a shape never timed).

Each result is compared with float32's product of the same operands (``max_err``). Prints a
table; writes ``$OUT/one_row_kernels.json`` (``/tmp`` without ``OUT``).

Run on a GPU: python benchmarks/one_row_kernels.py [--shapes gpt2small,llama2048x22]
Check the Triton kernel's arithmetic on the CPU (Triton's interpreter):
TRITON_INTERPRET=1 python benchmarks/one_row_kernels.py --check
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import statistics
import time
from typing import Any

import torch
import triton

from grape.torch.triton_gemv import configs, product, untimed_config

# The copies of a weight together hold at least this many times L2.
SPILL = 3
# Products per timed graph (whole passes over the copies, at least this many products).
PRODUCTS = 96
# The ways each product is timed, in the table's order ("untimed": the GEMV's configuration
# chosen without timing, what a capture gets for a shape never timed).
WAYS = ("cublas", "inductor", "triton", "untimed")

# (model, layer, in, out, layout): "linear" stores (out, in) and computes x @ w.t() (nn.Linear);
# "conv1d" stores (in, out) and computes x @ w (GPT-2's Conv1D).
SHAPES = [("gpt2small", "c_attn", 768, 2304, "conv1d"),
          ("gpt2small", "attn_c_proj", 768, 768, "conv1d"),
          ("gpt2small", "c_fc", 768, 3072, "conv1d"),
          ("gpt2small", "mlp_c_proj", 3072, 768, "conv1d"),
          ("gpt2small", "lm_head", 768, 50257, "linear"),
          ("llama2048x22", "q_proj", 2048, 2048, "linear"),
          ("llama2048x22", "k_proj", 2048, 256, "linear"),
          ("llama2048x22", "gate_proj", 2048, 5632, "linear"),
          ("llama2048x22", "down_proj", 5632, 2048, "linear"),
          ("llama2048x22", "lm_head", 2048, 32000, "linear")]


def _graph_us(fn: Any, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Microseconds per product: ``fn`` over every copy, PRODUCTS at least, in one graph."""
    passes = max(1, math.ceil(PRODUCTS / len(weights)))
    fn(x, weights[0])  # compile, warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(passes):
            for w in weights:
                fn(x, w)
    graph.replay()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (passes * len(weights)))
    return statistics.median(times)


def _operands(k: int, n: int, layout: str, copies: int, device: Any
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """x (1, K) and ``copies`` weights seen as (K, N): (out, in) storage transposed for
    "linear", (in, out) storage for "conv1d"."""
    torch.manual_seed(0)
    x = torch.randn(1, k, device=device, dtype=torch.float16)
    weights = []
    for _ in range(copies):
        w = torch.randn(n, k, device=device, dtype=torch.float16) / k ** 0.5
        weights.append(w.t() if layout == "linear" else w.t().contiguous())
    return x, weights


def _product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


def _triton(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int]
            ) -> torch.Tensor:
    return product(x, w, None, config)


def measure(model: str, layer: str, k: int, n: int, layout: str) -> list[dict[str, Any]]:
    props = torch.cuda.get_device_properties(0)
    weight_bytes = k * n * 2
    copies = max(1, math.ceil(SPILL * props.L2_cache_size / weight_bytes))
    x, weights = _operands(k, n, layout, copies, "cuda")
    exact = (x.float() @ weights[0].float())
    rows = []

    def row(way: str, us: float, result: torch.Tensor, **extra: Any) -> None:
        err = (result.float() - exact).abs().max().item()
        rows.append(dict(model=model, layer=layer, k=k, n=n, layout=layout, copies=copies,
                         way=way, us=round(us, 3),
                         tb_per_s=round(weight_bytes / us / 1e6, 3), max_err=err, **extra))
        print(json.dumps(rows[-1]), flush=True)

    row("cublas", _graph_us(_product, x, weights), _product(x, weights[0]))
    torch._dynamo.reset()
    compiled = torch.compile(_product, mode="max-autotune-no-cudagraphs", dynamic=False)
    started = time.perf_counter()
    compiled(x, weights[0])
    compile_s = time.perf_counter() - started
    row("inductor", _graph_us(compiled, x, weights), compiled(x, weights[0]),
        compile_s=round(compile_s, 1))

    contiguous_k = weights[0].stride(0) == 1
    sms = props.multi_processor_count
    tried = []
    for config in configs(k, n, contiguous_k, sms):
        gemv = functools.partial(_triton, config=config)
        tried.append((_graph_us(gemv, x, weights), config))
    tried.sort()
    us, best = tried[0]
    names = ("block_k", "block_n", "split", "warps")
    row("triton", us, _triton(x, weights[0], best), config=dict(zip(names, best, strict=True)),
        configs=len(tried),
        runners_up=[dict(us=round(u, 3), **dict(zip(names, c, strict=True)))
                    for u, c in tried[1:4]])
    untimed = untimed_config(k, n, contiguous_k, sms)
    row("untimed", _graph_us(functools.partial(_triton, config=untimed), x, weights),
        _triton(x, weights[0], untimed), config=dict(zip(names, untimed, strict=True)))
    return rows


def check() -> None:
    """The Triton kernels against float32's product, small shapes, both layouts, split and
    not (on the CPU under ``TRITON_INTERPRET=1``, or on a GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for (k, n), layout, (bk, bn, split, biased) in itertools.product(
            [(64, 48), (100, 37), (256, 300)], ("linear", "conv1d"),
            [(16, 16, 1, False), (16, 16, 1, True), (32, 8, 3, False), (64, 64, 2, True)]):
        x, (w,) = _operands(k, n, layout, 1, device)
        bias = torch.randn(n, device=device, dtype=torch.float16) if biased else None
        got = product(x, w, bias, (bk, bn, split, 4)).float()
        exact = x.float() @ w.float() + (0 if bias is None else bias.float())
        err = (got - exact).abs().max().item()
        # (one rounding to fp16 of a float32 sum: within fp16's half step at the result's size)
        bound = exact.abs().max().item() * 2 ** -10 + 1e-6
        status = "ok" if err <= bound else "WRONG"
        print(f"{status} k={k} n={n} {layout} block_k={bk} block_n={bn} split={split} "
              f"bias={bias is not None} "
              f"err={err:.2e} bound={bound:.2e}")
        if status != "ok":
            raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="gpt2small,llama2048x22",
                        help="models whose products to time (comma-separated)")
    parser.add_argument("--check", action="store_true",
                        help="check the Triton kernels' results and time nothing")
    args = parser.parse_args()
    if args.check:
        check()
        return
    if not torch.cuda.is_available():
        raise SystemExit("one_row_kernels.py times products on a GPU; found none "
                         "(--check runs the kernels' check under TRITON_INTERPRET=1)")
    wanted = set(args.shapes.split(","))
    unknown = wanted - {s[0] for s in SHAPES}
    if unknown:
        raise SystemExit(f"expected --shapes among {sorted({s[0] for s in SHAPES})}, "
                         f"found {sorted(unknown)}")
    rows: list[dict[str, Any]] = []
    path = os.path.join(os.environ.get("OUT", "/tmp"), "one_row_kernels.json")
    for shape in SHAPES:
        if shape[0] not in wanted:
            continue
        rows += measure(*shape)
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "spill": SPILL, "rows": rows}, f, indent=1)
    print(f"\n{'model':13} {'layer':12} {'layout':7} {'MB':>6} "
          + " ".join(f"{w:>19}" for w in WAYS))
    for model, layer, k, n, layout in SHAPES:
        cells = {r["way"]: r for r in rows if r["model"] == model and r["layer"] == layer}
        if cells:
            print(f"{model:13} {layer:12} {layout:7} {k * n * 2 / 1e6:6.1f} " + " ".join(
                f"{cells[w]['us']:>8.2f} us {cells[w]['tb_per_s']:>4.2f} TB/s"
                for w in WAYS))
    for model in sorted(wanted):
        sums = {w: sum(r["us"] for r in rows if r["model"] == model and r["way"] == w)
                for w in WAYS}
        print(f"{model}: one of each product, us: " + ", ".join(
            f"{w} {us:.1f}" for w, us in sums.items()))


if __name__ == "__main__":
    main()
