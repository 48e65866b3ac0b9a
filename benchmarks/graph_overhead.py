"""Where a graph replay's time goes beyond its kernels, and what torch.profiler costs (GPU).

For graphs of GPT-2 small and medium decode steps and for chains of kernels with large
arguments: the host time of ``replay()`` alone, the GPU time between events around it, and the
wall time of replay plus synchronisation, without the profiler. For a small BERT (a model the
simulator is not validated on): eager step time with and without torch.profiler, per recorded
operator and API call. Prints a table; with --out FILE, writes them as JSON.

Run on a GPU: python benchmarks/graph_overhead.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def _measure(replay, reps: int = 50) -> dict[str, float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    host, gpu, wall = [], [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        replay()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6)
        wall.append((t2 - t0) * 1e6)
        gpu.append(start.elapsed_time(end) * 1000)
    return {"host_us": statistics.median(host), "gpu_us": statistics.median(gpu),
            "wall_us": statistics.median(wall)}


def _gpt2(name: str) -> dict[str, float]:
    from grape.torch.capture import capture
    from grape.torch.workloads import parse_spec

    w = parse_spec(f"{name}:b1:kv128")
    cap = capture(w.step, *w.inputs, params=w.params)
    out = _measure(cap.replay)
    out["nodes"] = sum(1 for _ in cap.ir.kernels())
    return out


def _chain(nodes: int, kind: str) -> dict[str, float]:
    """A torch graph of ``nodes`` tiny kernels: ``add_`` (a few hundred bytes of arguments) or
    ``_foreach_add_`` over 32 tensors (a multi-tensor kernel, kilobytes of arguments)."""
    xs = [torch.zeros(1, device="cuda") for _ in range(32)]
    op = (lambda: xs[0].add_(1.0)) if kind == "add" else (lambda: torch._foreach_add_(xs, 1.0))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        op()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(nodes):
            op()
    out = _measure(g.replay)
    out["nodes"] = nodes
    out["kind"] = kind
    return out


def _profiler_cost() -> dict[str, float]:
    import transformers

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024)).cuda().half().eval()
    ids = torch.randint(0, 1000, (1, 64), device="cuda")

    def step():
        with torch.no_grad():
            model(ids)
        torch.cuda.synchronize()

    for _ in range(10):
        step()
    plain = []
    for _ in range(30):
        t = time.perf_counter()
        step()
        plain.append((time.perf_counter() - t) * 1e6)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    profiled = []
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            t = time.perf_counter()
            step()
            profiled.append((time.perf_counter() - t) * 1e6)
    events = prof.events()
    ops = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CPU
              and not e.name.startswith("cuda"))
    calls = sum(1 for e in events if e.name.startswith(("cuda", "cu")))
    added = statistics.median(profiled) - statistics.median(plain)
    per_step_events = (ops + calls) / 10
    return {"plain_us": statistics.median(plain), "profiled_us": statistics.median(profiled),
            "events_per_step": per_step_events, "added_per_event_us": added / per_step_events}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the results as JSON here (nothing is written without it)")
    args = parser.parse_args()
    results = {"gpt2": {n: _gpt2(n) for n in ("gpt2-small", "gpt2-medium")},
               "chains": [_chain(n, k) for n in (100, 300, 600) for k in ("add", "foreach")],
               "profiler": _profiler_cost()}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    print(f"{'graph':<22} {'nodes':>5} {'host us':>8} {'gpu us':>9} "
          f"{'wall us':>9} {'wall-gpu':>8}")
    rows = [*results["gpt2"].items()] + [(f"chain of {c['kind']}", c) for c in results["chains"]]
    for name, r in rows:
        print(f"{name:<22} {r['nodes']:>5} {r['host_us']:8.1f} "
              f"{r['gpu_us']:9.1f} {r['wall_us']:9.1f} {r['wall_us'] - r['gpu_us']:8.1f}")
    p = results["profiler"]
    print(f"profiler on a 4-layer BERT: {p['plain_us']:.0f} -> {p['profiled_us']:.0f} us per "
          f"step, {p['events_per_step']:.0f} events, {p['added_per_event_us']:.2f} us each")


if __name__ == "__main__":
    main()
