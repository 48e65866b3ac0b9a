"""Collectives inside grape's graphs, on two GPUs: a chain of GEMVs and all-reduces per rank.

Each rank (one process per GPU, ``torchrun --nproc-per-node 2``) runs ``--layers`` x (a
4096-wide GEMV and an all-reduce of its 8 KB result over NCCL), the shape of a tensor-parallel
decode step's layers, three ways side by side: eagerly, as PyTorch's own captured graph, and as
grape's executable rebuilt from the IR read out of that capture (NCCL's kernel nodes included).
Writes, per rank, ``tp_collectives_rank<r>.json``: what the IR read (node kinds, NCCL kernels
and their argument bytes), whether each way's result equals eager's bitwise, and GPU time per
chain (CUDA events, median of ``--repeats``); with ``--profile``, also a torch.profiler trace per
rank of a few eager chains and PyTorch graph replays (``tp_collectives_rank<r>.kineto.json.gz``:
each kernel's duration, the all-reduce's among them, for the simulator's collective costs).

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


def _profile(chain, captured, path: Path) -> None:
    """Three eager chains and three replays of PyTorch's graph under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from grape.jsonio import dump_json, load_json

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for name, fn in (("eager", chain),
                         ("graph", captured.torch_graph.replay if captured else None)):
            for i in range(3 if fn is not None else 0):
                dist.barrier()
                torch.cuda.synchronize()
                with record_function(f"{name} chain {i}"):
                    fn()
                torch.cuda.synchronize()
    raw = path.with_suffix("")
    prof.export_chrome_trace(str(raw))
    dump_json(path, load_json(raw))
    raw.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", action="store_true",
                        help="also record a torch.profiler trace per rank")
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
    if args.profile:
        _profile(chain, captured, args.out / f"tp_collectives_rank{rank}.kineto.json.gz")
    (args.out / f"tp_collectives_rank{rank}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "ir"}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
