"""The host cost of an eager launch through PyTorch, for the device profile."""

from __future__ import annotations

import time

import numpy as np
import torch

__all__ = ["profiler_overhead_us", "replay_us", "torch_launch_us"]


def torch_launch_us(reps: int = 2000) -> dict[str, float]:
    """Host microseconds of one tiny in-place op (one kernel launch) through PyTorch."""
    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps // 200):
        for _ in range(200):  # the launch queue never fills, so this is the host's own cost
            t = time.perf_counter()
            x.add_(1)
            samples.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
    q = np.percentile(samples, [10, 50, 90])
    return {"median": float(q[1]), "p10": float(q[0]), "p90": float(q[2]),
            "samples": len(samples)}


def profiler_overhead_us(steps: int = 10) -> dict[str, float]:
    """Host microseconds torch.profiler adds per event it records (operator or CUDA API call).

    Measured on a small BERT built from a config (4 layers, random weights, fp16), a model the
    simulator is not validated on: its step time with and without the profiler, over the
    events the profiler recorded per step. Tiny loops of one operator under-state the cost on
    real models about fourfold.
    """
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=256, num_hidden_layers=4,
                                     num_attention_heads=4, intermediate_size=1024)
    model = transformers.BertModel(config).cuda().half().eval()
    ids = torch.randint(0, config.vocab_size, (1, 64), device="cuda")

    def step() -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model(ids)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e6

    for _ in range(10):
        step()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    # Every plain step first: once the profiler has run, the process stays slower (this is
    # part of what a profiled trace shows, so it belongs in the cost measured here).
    plain = [step() for _ in range(3 * steps)]
    with torch.profiler.profile(activities=activities) as prof:
        profiled = [step() for _ in range(3 * steps)]
    # Host-side events only (operators and API calls): GPU activity costs the host nothing.
    events = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU)
    per_step = events / (3 * steps)
    added = float(np.median(profiled) - np.median(plain))
    return {"per_event": added / per_step, "events_per_step": per_step,
            "plain_step_us": float(np.median(plain)),
            "profiled_step_us": float(np.median(profiled)), "model": "bert 4x256"}


def replay_us(nodes: tuple[int, ...] = (100, 300, 600), reps: int = 50) -> dict[str, object]:
    """Host microseconds of ``CUDAGraph.replay()`` against node count (chains of ``add_``)."""
    x = torch.zeros(1, device="cuda")
    host = []
    for n in nodes:
        g = torch.cuda.CUDAGraph()
        x.add_(1.0)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for _ in range(n):
                x.add_(1.0)
        g.replay()
        samples = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            g.replay()
            samples.append((time.perf_counter() - t) * 1e6)
        host.append(float(np.median(samples)))
    slope, intercept = np.polyfit(nodes, host, 1)
    return {"nodes": list(nodes), "host_us": host,
            "fit": {"fixed_us": float(intercept), "per_node_us": float(slope)}}
