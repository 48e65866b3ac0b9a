"""One row times a weight matrix on the GPU: cuBLAS, Inductor's GEMM choices, Inductor's reduction.

For the weight shapes of GPT-2 small (``Conv1D``: weights stored (in, out)) and the Llama shape
(``nn.Linear``: weights stored (out, in)), fp16, one row: the time per product of

- ``cublas``: ``x @ w`` eagerly (cuBLAS's GEMV/GEMM choice);
- ``inductor_autotune``: ``torch.compile(mode="max-autotune-no-cudagraphs")`` of ``x @ w``
  (Inductor picks among cuBLAS and its Triton templates by measuring);
- ``inductor_reduction``: ``torch.compile`` of ``x @ w`` rewritten as ``(x[:, :, None] *
  w[None]).sum(1)`` (``OneRowProducts`` below, an Inductor post-grad pass: a reduction Inductor
  generates, tiles for bandwidth and fuses with its neighbours), coordinate-descent tuned.

Each is captured 100 times into one CUDA graph and the graph replayed (median of 20 replays),
so the figures are kernel time plus the graph's per-node cost, not launch overhead. Also the
bandwidth it reaches (weight bytes over time), and whether its result is within 1e-2 of
cuBLAS's. Prints a table; writes ``$OUT/one_row_products.json`` (``/tmp`` without ``OUT``).

Measured on the H200 (``results/one_row_products_h200.json``): no form wins everywhere.
cuBLAS is fastest for GPT-2's (in, out) weights, the reduction for three of the four Llama
shapes, Inductor's autotuned choice for GPT-2's output layer and Llama's down projection;
summed over a Llama layer the reduction and the autotuned GEMMs are within 3%, and on GPT-2's
weights the reduction is slower than cuBLAS. A whole compiled GPT-2 small token with the
pass (``compile_modes.py``'s ``gemv`` mode at commit de3d553, ``results/compile_modes_h200.jsonl``)
ran 0.647 ms against 0.591 under ``max-autotune-no-cudagraphs``, same session. The pass was
``grape.torch.gemv`` then, unused by ``grape.generate``; it lives here with the measurement
that retired it. ``grape.torch.thin_matmuls`` (3f833ed) rewrites only the case these shapes
lack, one row by a biased ``Linear`` (``addmm``), which Inductor leaves to GEMMs where it
already makes a plain one-row ``mm`` a reduction (``benchmarks/README.md``).

Run on a GPU: python benchmarks/one_row_products.py
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

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
