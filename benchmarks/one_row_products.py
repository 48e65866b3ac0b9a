"""One row times a weight matrix on the GPU: cuBLAS, Inductor's GEMM choices, Inductor's reduction.

For the weight shapes of GPT-2 small (``Conv1D``: weights stored (in, out)) and the Llama shape
(``nn.Linear``: weights stored (out, in)), fp16, one row: the time per product of

- ``cublas``: ``x @ w`` eagerly (cuBLAS's GEMV/GEMM choice);
- ``inductor_autotune``: ``torch.compile(mode="max-autotune-no-cudagraphs")`` of ``x @ w``
  (Inductor picks among cuBLAS and its Triton templates by measuring);
- ``inductor_reduction``: ``torch.compile`` of ``x @ w`` with ``grape.torch.gemv``'s rewrite
  (a mul and a sum Inductor generates as one reduction kernel), coordinate-descent tuned.

Each is captured 100 times into one CUDA graph and the graph replayed (median of 20 replays),
so the figures are kernel time plus the graph's per-node cost, not launch overhead. Also the
bandwidth it reaches (weight bytes over time), and whether its result is within 1e-2 of
cuBLAS's. Prints a table; writes ``$OUT/one_row_products.json`` (``/tmp`` without ``OUT``).

Run on a GPU: python benchmarks/one_row_products.py
"""

from __future__ import annotations

import json
import os
import statistics

import torch

from grape.torch.gemv import OneRowProducts

# (model, layer, in, out, layout): "linear" stores (out, in) and computes x @ w.t().
SHAPES = [("gpt2small", "c_attn", 768, 2304, "conv1d"),
          ("gpt2small", "c_fc", 768, 3072, "conv1d"),
          ("gpt2small", "c_proj_mlp", 3072, 768, "conv1d"),
          ("gpt2small", "lm_head", 768, 50257, "linear"),
          ("llama2048x22", "q_proj", 2048, 2048, "linear"),
          ("llama2048x22", "k_proj", 2048, 256, "linear"),
          ("llama2048x22", "up_proj", 2048, 5632, "linear"),
          ("llama2048x22", "down_proj", 5632, 2048, "linear")]
REPS = 100


def _us_per_call(fn, x, w) -> float:
    fn(x, w)  # compile, autotune, warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn(x, w)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPS)
    return statistics.median(times)


def main() -> None:
    rows = []
    for model, layer, k, n, layout in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) / k ** 0.5
        if layout == "linear":
            def product(x, w):
                return x @ w.t()
        else:
            w = w.t().contiguous()

            def product(x, w):
                return x @ w
        ways = {"cublas": product,
                "inductor_autotune": torch.compile(product, mode="max-autotune-no-cudagraphs",
                                                   dynamic=False),
                "inductor_reduction": torch.compile(product, dynamic=False, options={
                    "coordinate_descent_tuning": True,
                    "post_grad_custom_pre_pass": OneRowProducts()})}
        reference = product(x, w)
        for way, fn in ways.items():
            torch._dynamo.reset()
            us = _us_per_call(fn, x, w)
            close = bool(torch.allclose(fn(x, w), reference, atol=1e-2, rtol=1e-2))
            row = dict(model=model, layer=layer, k=k, n=n, layout=layout, way=way,
                       us=round(us, 2), gb_per_s=round(w.numel() * 2 / us / 1e3, 1),
                       close=close)
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(os.environ.get("OUT", "/tmp"), "one_row_products.json"),
                      "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "rows": rows}, f, indent=1)
    print(f"{'model':13} {'layer':10} {'layout':7} " + " ".join(f"{w:>20}" for w in ways))
    for model, layer, _, _, layout in SHAPES:
        cells = [r for r in rows if r["model"] == model and r["layer"] == layer]
        print(f"{model:13} {layer:10} {layout:7} "
              + " ".join(f"{c['us']:>9.2f} us {c['gb_per_s']:>5.0f} GB/s" for c in cells))


if __name__ == "__main__":
    main()
