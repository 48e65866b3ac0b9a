"""Where a grape.generate token's time goes: kernels per token, their time, the gaps between.

By default GPT-2 small and the Llama shape (``benchmarks/generate.py``'s sizes), greedy, batch
1, a 32-token prompt, 128 new tokens, with and without ``compile=True``; ``--cases`` names others
as ``SIZE:ARCH:STRATEGY[:compiled]`` (strategy ``greedy``, ``sample`` or ``beam5``). For each: the
median wall time per
token of three calls, then one call profiled (CUDA activity): kernels per token, the span and
the busy time of the GPU per token, the median gap between consecutive kernels, and the 25
kernels that took the most time (name, calls per token, us per token). Prints a line per way
and writes them all to ``$OUT/step_profile.json`` (``/tmp`` without ``OUT``) after each.

Run on a GPU: python benchmarks/step_profile.py [--cases bench:gpt2:beam5,bench:gpt2:greedy]
"""

from __future__ import annotations

import argparse
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


STRATEGIES = {"greedy": {"do_sample": False}, "sample": {"do_sample": True, "top_k": 50},
              "beam5": {"do_sample": False, "num_beams": 5}}
DEFAULT_CASES = ("gpt2small:gpt2:greedy,gpt2small:gpt2:greedy:compiled,"
                 "llama2048x22:llama:greedy,llama2048x22:llama:greedy:compiled")


def measure(model, size: str, strategy: str, compiled: bool) -> dict:
    ids = torch.randint(0, 1000, (1, 32), device="cuda")

    def call():
        return grape.generate(model, ids, max_new_tokens=NEW, compile=compiled,
                              **STRATEGIES[strategy])
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
    return dict(model=size, strategy=strategy, compiled=compiled, capture_s=round(capture_s, 1),
                ms_per_token=round(statistics.median(walls), 4),
                kernels_per_token=round(len(events) / NEW, 1),
                gpu_span_ms_per_token=round(span / NEW, 4),
                kernel_busy_ms_per_token=round(busy / NEW, 4),
                median_gap_us=statistics.median(gaps) if gaps else None,
                top=[(name, calls / NEW, round(ms / NEW * 1e3, 2))
                     for name, (calls, ms) in top])


def cases(text: str) -> list[tuple[str, str, str, bool]]:
    """``SIZE:ARCH:STRATEGY[:compiled]`` entries, comma-separated; exits on a malformed one."""
    parsed = []
    for entry in text.split(","):
        fields = entry.split(":")
        if not (3 <= len(fields) <= 4 and fields[0] in SIZES and fields[2] in STRATEGIES
                and fields[3:] in ([], ["compiled"])):
            sys.exit(f"step_profile: expected SIZE:ARCH:STRATEGY[:compiled] with SIZE in "
                     f"{sorted(SIZES)} and STRATEGY in {sorted(STRATEGIES)}, found {entry!r}")
        parsed.append((fields[0], fields[1], fields[2], len(fields) == 4))
    return parsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=DEFAULT_CASES,
                        help="SIZE:ARCH:STRATEGY[:compiled], comma-separated")
    args = parser.parse_args()
    out = os.environ.get("OUT", "/tmp")
    # CUPTI starts with the first profile; the kernels of graphs instantiated before then are
    # not reported (a first case profiled showed 6 kernels a token), so it starts here, first.
    with profile(activities=[ProfilerActivity.CUDA]):
        torch.zeros(1, device="cuda")
    rows = []
    for (size, arch), group in itertools.groupby(cases(args.cases), key=lambda c: c[:2]):
        model = build(arch, SIZES[size])
        for _, _, strategy, compiled in group:
            row = measure(model, size, strategy, compiled)
            rows.append(row)
            with open(f"{out}/step_profile.json", "w") as f:
                json.dump(rows, f, indent=1)
            print(json.dumps({k: v for k, v in row.items() if k != "top"}), flush=True)
            for name, calls, us in row["top"][:20]:
                print(f"   {us:8.2f} us/token  {calls:6.1f}x  {name}", flush=True)
        clear_cache(model)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
