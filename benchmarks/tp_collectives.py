"""Collectives inside grape's graphs, on two GPUs: a chain of GEMVs and all-reduces per rank.

Each rank (one process per GPU, ``torchrun --nproc-per-node 2``) runs ``--layers`` x (a
4096-wide GEMV and an all-reduce of its 8 KB result over NCCL), the shape of a tensor-parallel
decode step's layers, three ways side by side: eagerly, as PyTorch's own captured graph, and as
grape's executable rebuilt from the IR read out of that capture (NCCL's kernel nodes included).
Writes, per rank, ``tp_collectives_rank<r>.json``: what the IR read (node kinds, NCCL kernels
and their argument bytes), whether each way's result equals eager's bitwise, and GPU time per
chain (CUDA events, median of ``--repeats``).

Run on 2 GPUs: NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/tp_collectives.py
--out DIR (NVLink multicast stays off)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(1000 * start.elapsed_time(end))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if os.environ.get("NCCL_NVLS_ENABLE") != "0":
        raise SystemExit("expected NCCL_NVLS_ENABLE=0 (NVLink multicast off), found it unset")
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    weights = [torch.randn(4096, 4096, device="cuda", dtype=torch.float16) / 64
               for _ in range(args.layers)]
    x = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    out = torch.empty_like(x)

    @torch.no_grad()
    def chain() -> None:
        y = x
        for w in weights:
            y = y @ w
            dist.all_reduce(y)
            y = y / 2  # keep the values in range: the sum of two ranks' halves
        out.copy_(y)

    for _ in range(3):
        chain()
    torch.cuda.synchronize()
    eager = out.clone()
    doc: dict = {"rank": rank, "world": dist.get_world_size(), "layers": args.layers,
                 "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    doc["eager_us"] = statistics.median(_time(chain, args.repeats))
    from grape.torch.capture import capture

    try:
        captured = capture(chain, warmup=1, instantiate=True)
    except Exception as e:  # what grape says, kept for the record
        doc["capture_failed"] = f"{type(e).__name__}: {e}"[:500]
        captured = None
    if captured is not None:
        ir = captured.ir
        kinds = Counter(type(op).__name__ for _, op in ir.ops())
        nccl = [k for _, k in ir.kernels() if "nccl" in k.name.lower()]
        doc["ir"] = {"nodes": dict(kinds), "nccl_kernels": len(nccl),
                     "nccl_names": sorted({k.name[:120] for k in nccl}),
                     "nccl_arg_bytes": sorted({len(k.args) for k in nccl}),
                     "edges": ir.dag.number_of_edges()}
        out.zero_()
        captured.torch_graph.replay()
        torch.cuda.synchronize()
        doc["torch_graph_equal"] = bool(torch.equal(out, eager))
        doc["torch_graph_us"] = statistics.median(_time(captured.torch_graph.replay,
                                                        args.repeats))
        try:
            from grape.cuda.build import Graph

            graph = Graph.build(ir)
            executable = graph.instantiate()
            stream = torch.cuda.current_stream().cuda_stream
            out.zero_()
            executable.launch(stream)
            torch.cuda.synchronize()
            doc["grape_equal"] = bool(torch.equal(out, eager))
            doc["grape_us"] = statistics.median(_time(lambda: executable.launch(stream),
                                                      args.repeats))
            out.zero_()
            executable.launch(stream)
            torch.cuda.synchronize()
            doc["grape_equal_after_timing"] = bool(torch.equal(out, eager))
            executable.close()
            graph.close()
        except Exception as e:
            doc["grape_failed"] = f"{type(e).__name__}: {e}"[:500]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"tp_collectives_rank{rank}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "ir"}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
