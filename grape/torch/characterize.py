"""The host cost of an eager launch through PyTorch, for the device profile."""

from __future__ import annotations

import time

import numpy as np
import torch

__all__ = ["torch_launch_us"]


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
