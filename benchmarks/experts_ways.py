"""One experts layer's call, captured in a CUDA graph, by each way that reads nothing back (GPU)

``grape.torch.experts`` runs a mixture of experts' layer, while grape captures, by
transformers' ``batched_mm`` (each picked pair's expert weights gathered, then one batched
product) where a call picks at most a third as many (token, expert) pairs as there are
experts, and by ``dense_experts_forward`` (every token through every expert, weighted by its
routing) for larger calls of at most ``DENSE_TOKENS`` tokens. Here each way, and PyTorch's
grouped GEMM where it runs on the device alone (bf16), is captured once per token count and
replayed: microseconds a call, the median of ``--repeats`` timings of ``--replays`` replays
each (fewer for a slow call: about 20 ms of replays a timing). Rows mark the way
``grape.torch.experts.way`` picks for that call.

python benchmarks/experts_ways.py [--layers mixtral,many] [--tokens 1,2,4,...] [--dtypes
    float16,bfloat16] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

# (hidden, intermediate, experts, top_k): generate.py's bench Mixtral (8 experts of 2048),
# and a layer of many small experts as Qwen3-MoE's and DeepSeek's are
LAYERS = {"mixtral": (1024, 2048, 8, 2), "many": (1024, 256, 64, 8)}


def _layer(hidden: int, intermediate: int, experts: int, top_k: int, dtype: Any) -> Any:
    import torch
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = transformers.MixtralConfig(hidden_size=hidden, intermediate_size=intermediate,
                                        num_local_experts=experts, num_experts_per_tok=top_k)
    layer = MixtralExperts(config)
    torch.manual_seed(0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return layer.to("cuda", dtype)


def _time_us(fn: Any, replays: int, repeats: int) -> float:
    """Microseconds a call of ``fn`` captured in a graph takes, replayed up to ``replays``
    times a timing (fewer for a slow call: about 20 ms of replays, at least 5)."""
    import torch

    for _ in range(3):  # lazy initialisation, cuBLAS handles and workspaces, before capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = max(5, min(replays, int(20_000 / max(start.elapsed_time(end) * 1000, 1.0))))
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / replays)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default=",".join(LAYERS))
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the rows here as JSON (nothing is written without it)")
    args = parser.parse_args()
    import torch
    from transformers.integrations.moe import (
        batched_mm_experts_forward,
        grouped_mm_experts_forward,
    )

    from grape.torch.experts import dense_experts_forward, reads_back, way

    capability = torch.cuda.get_device_capability()
    ways = {"batched": batched_mm_experts_forward, "dense": dense_experts_forward,
            "grouped": grouped_mm_experts_forward}
    rows = []
    for name in args.layers.split(","):
        hidden, intermediate, experts, top_k = LAYERS[name]
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            layer = _layer(hidden, intermediate, experts, top_k, dtype)
            for tokens in (int(t) for t in args.tokens.split(",")):
                generator = torch.Generator("cuda").manual_seed(tokens)
                x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=generator)
                scores = torch.randn(tokens, experts, device="cuda", generator=generator)
                weights, index = scores.softmax(-1).topk(top_k, dim=-1)
                weights = weights.to(dtype)
                row = {"layer": name, "dtype": dtype_name, "tokens": tokens,
                       "pairs": tokens * top_k, "picked": way(tokens * top_k, tokens, experts)}
                with torch.no_grad():
                    for way_name, forward in ways.items():
                        if way_name == "grouped" and reads_back("grouped_mm", dtype, capability):
                            row[f"{way_name}_us"] = None  # (no graph holds its read-back)
                            continue
                        row[f"{way_name}_us"] = _time_us(
                            functools.partial(forward, layer, x, index, weights), args.replays,
                            args.repeats)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
            layer = None  # (freed before the next layer's weights)
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "torch": torch.__version__, "command": " ".join(sys.argv),
                                        "layers": {n: LAYERS[n] for n in args.layers.split(",")},
                                        "rows": rows}, indent=1) + "\n")
    print(f"{'layer':<8} {'dtype':<9} {'tokens':>6} {'picked':<8} {'batched us':>10} "
          f"{'dense us':>9} {'grouped us':>10}")
    for r in rows:
        cells = [f"{r[k]:.1f}" if r[k] is not None else "-" for k in
                 ("batched_us", "dense_us", "grouped_us")]
        print(f"{r['layer']:<8} {r['dtype']:<9} {r['tokens']:>6} {r['picked']:<8} "
              f"{cells[0]:>10} {cells[1]:>9} {cells[2]:>10}")


if __name__ == "__main__":
    main()
