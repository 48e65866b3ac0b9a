"""The host cost of an eager launch through PyTorch, for the device profile."""

from __future__ import annotations

import time

import numpy as np
import torch

__all__ = ["profiler_overhead_us", "torch_launch_us"]


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


def _loop_us(fn, n: int, profiled: bool) -> float:
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    if not profiled:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e6
    with torch.profiler.profile(activities=activities):
        torch.cuda.synchronize()
        t = time.perf_counter()  # inside the session: its start-up and export are not counted
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e6


def profiler_overhead_us(n: int = 2000, rounds: int = 5) -> dict[str, float]:
    """Host microseconds torch.profiler adds per operator it records and per CUDA API call.

    An operator that launches nothing (``view``) gives the first; one that launches one kernel
    (``add_``: an operator and a ``cudaLaunchKernel``) gives their sum. Medians over rounds,
    profiled and plain loops interleaved so that a change in the machine's speed hits both.
    """
    x = torch.zeros(1, device="cuda")
    per: dict[str, list[float]] = {"view": [], "add": []}
    for _ in range(rounds):
        for name, fn in (("view", lambda: x.view(-1)), ("add", lambda: x.add_(1))):
            plain = _loop_us(fn, n, profiled=False)
            profiled = _loop_us(fn, n, profiled=True)
            per[name].append((profiled - plain) / n)
    per_op = float(np.median(per["view"]))
    return {"per_op": per_op, "per_api_call": float(np.median(per["add"])) - per_op,
            "operations": n, "rounds": rounds}
