"""Where a grape.generate token's time goes: kernels per token, their time, the gaps between.

For GPT-2 small and the Llama shape (``benchmarks/generate.py``'s sizes), greedy, batch 1, a
32-token prompt, 128 new tokens, with and without ``compile=True``: the median wall time per
token of three calls, then one call profiled (CUDA activity): kernels per token, the span and
the busy time of the GPU per token, the median gap between consecutive kernels, and the 25
kernels that took the most time (name, calls per token, us per token). Prints a line per way
and writes them all to ``$OUT/step_profile.json`` (``/tmp`` without ``OUT``) after each.

Run on a GPU: python benchmarks/step_profile.py
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from generate import SIZES, build

import grape
from grape.torch.api import clear_cache

NEW = 128


def measure(model, size: str, compiled: bool) -> dict:
    ids = torch.randint(0, 1000, (1, 32), device="cuda")

    def call():
        return grape.generate(model, ids, max_new_tokens=NEW, compile=compiled,
                              do_sample=False)
    began = time.perf_counter()
    call()
    capture_s = time.perf_counter() - began
    for _ in range(2):
        call()
    walls = []
    for _ in range(3):
        torch.cuda.synchronize()
        began = time.perf_counter()
        call()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - began) * 1e3 / NEW)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                    key=lambda e: e.time_range.start)
    span = (events[-1].time_range.end - events[0].time_range.start) / 1e3
    busy = sum(e.time_range.end - e.time_range.start for e in events) / 1e3
    by_name: dict[str, list[float]] = {}
    for e in events:
        entry = by_name.setdefault(e.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += (e.time_range.end - e.time_range.start) / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    gaps = [b.time_range.start - a.time_range.end for a, b in itertools.pairwise(events)]
    return dict(model=size, compiled=compiled, capture_s=round(capture_s, 1),
                ms_per_token=round(statistics.median(walls), 4),
                kernels_per_token=round(len(events) / NEW, 1),
                gpu_span_ms_per_token=round(span / NEW, 4),
                kernel_busy_ms_per_token=round(busy / NEW, 4),
                median_gap_us=statistics.median(gaps) if gaps else None,
                top=[(name, calls / NEW, round(ms / NEW * 1e3, 2))
                     for name, (calls, ms) in top])


def main() -> None:
    out = os.environ.get("OUT", "/tmp")
    rows = []
    for size, arch in (("gpt2small", "gpt2"), ("llama2048x22", "llama")):
        model = build(arch, SIZES[size])
        for compiled in (False, True):
            row = measure(model, size, compiled)
            rows.append(row)
            with open(f"{out}/step_profile.json", "w") as f:
                json.dump(rows, f, indent=1)
            print(json.dumps({k: v for k, v in row.items() if k != "top"}), flush=True)
            for name, calls, us in row["top"][:14]:
                print(f"   {us:8.2f} us/token  {calls:6.1f}x  {name}", flush=True)
        clear_cache(model)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
