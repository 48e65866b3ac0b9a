"""How a host-bound eager step's time moves within one process, and what moves with it (GPU).

`grape validate` predicts an eager trace's wall time from its profiled steps, but the H200's
eager GPT-2 steps took 5 ms in one process and 10 ms in the next, and drifted from 10 to 5.7 ms
within one process's 30 timed steps. This times many eager steps of one workload in this (fresh)
process, each after a pure-Python probe (fixed work, no CUDA calls: it moves with the CPU's speed
and nothing else), then the profiled steps `grape record` takes (probes between them too), then
steps after the profiler. Whether the probe tracks the step says whether the drift is the CPU's
speed (which a trace could carry and the simulator scale) or something else.

Run on a GPU, one process per call: python benchmarks/host_drift.py gpt2-small:b1:kv32
[--steps 120] [--pin CPU] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from statistics import median

import torch

from grape.torch.record import profile_steps
from grape.torch.workloads import parse_spec


def probe() -> float:
    """Microseconds for a fixed amount of pure-Python work."""
    t = time.perf_counter()
    total = 0
    for i in range(20000):
        total += i * i
    return (time.perf_counter() - t) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--after", type=int, default=30, help="steps after the profiler")
    parser.add_argument("--pin", type=int, default=None, help="run on this CPU alone")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    w = parse_spec(args.spec)

    def timedian(n: int) -> list[tuple[float, float]]:
        rows = []
        for _ in range(n):
            w.refresh()
            torch.cuda.synchronize()
            p = probe()
            t = time.perf_counter()
            w.step(*w.inputs)
            torch.cuda.synchronize()
            rows.append((p, (time.perf_counter() - t) * 1e6))
        return rows

    for _ in range(5):
        w.refresh()
        w.step(*w.inputs)
    before = timedian(args.steps)
    probes_during: list[float] = []

    def profiled_step() -> None:
        probes_during.append(probe())
        w.step(*w.inputs)

    trace = profile_steps(profiled_step, 3)
    during = [it.host_time for it in trace.iterations]
    after = timedian(args.after)
    doc = {"spec": args.spec, "pin": args.pin, "cpus": sorted(os.sched_getaffinity(0)),
           "before": before, "profiled_host_us": during, "probes_profiled": probes_during,
           "after": after}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc) + "\n")

    blocks = [before[i:i + 20] for i in range(0, len(before), 20)]
    print(f"{args.spec} pin={args.pin}: per 20 steps (probe us / step ms): " + "  ".join(
        f"{median([p for p, _ in b]):.0f}/{median([s for _, s in b]) / 1000:.2f}" for b in blocks))
    print(f"  profiled host ms {[round(d / 1000, 2) for d in during]} probes "
          f"{[round(p) for p in probes_during]}; after: probe {median([p for p, _ in after]):.0f} "
          f"step {median([s for _, s in after]) / 1000:.2f} ms")


if __name__ == "__main__":
    main()
