"""How fast the simulator runs: a program of 1,000,000 eager kernel launches.

Run: python benchmarks/sim_speed.py [--launches N] [--repeats R] [--out FILE]. Prints launches and
SimPy events per second over wall time, the process's CPU time beside it (building the program
is not timed), for the median of R runs (each listed: a shared machine's runs of the same work
spread by a third); with --out, writes them with the machine it ran on (the committed figures:
benchmarks/results/sim_speed.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import simpy

from grape.program import GpuWork, HostWork, Launch, Program, Sync
from grape.sim.engine import Costs, simulate


def program(launches: int, per_iteration: int = 1000) -> Program:
    kernel = (GpuWork("kernel", "k", 3.0, 7),)
    step = (HostWork(4.0), Launch("cudaLaunchKernel", 5.0, kernel))
    iteration = step * per_iteration + (Sync("cudaDeviceSynchronize", 0.0),)
    return Program("benchmark", [iteration] * (launches // per_iteration))


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _count_events(p: Program) -> int:
    events = 0
    original = simpy.Environment.step

    def counting_step(env):
        nonlocal events
        events += 1
        original(env)

    simpy.Environment.step = counting_step
    try:
        simulate(p, Costs())
    finally:
        simpy.Environment.step = original
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the results as JSON here (nothing is written without it)")
    args = parser.parse_args()
    # Events per launch from a small instrumented run (counting slows SimPy down), then the
    # full run uninstrumented, which is what the speed figure is.
    events_small = _count_events(program(10_000))
    p = program(args.launches)
    runs = []
    for _ in range(max(1, args.repeats)):
        t, cpu = time.perf_counter(), time.process_time()
        result = simulate(p, Costs())
        runs.append((time.perf_counter() - t, time.process_time() - cpu))
    seconds, cpu_seconds = sorted(runs)[len(runs) // 2]  # the median run
    events = round(events_small * args.launches / 10_000)
    out = {"launches": args.launches, "seconds": seconds, "cpu_seconds": cpu_seconds,
           "seconds_each_run": [r[0] for r in runs], "events": events,
           "events_per_second": events / seconds, "launches_per_second": args.launches / seconds,
           "simulated_us": result.end, "machine": _cpu(),
           "python": platform.python_version(), "simpy": simpy.__version__}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"runs: {', '.join(f'{r[0]:.2f}' for r in runs)} s")
    print(f"{args.launches:,} launches in {seconds:.2f} s ({cpu_seconds:.2f} s of CPU): "
          f"{out['launches_per_second']:,.0f} "
          f"launches/s, {out['events_per_second']:,.0f} SimPy events/s (about {events:,} "
          f"events)")


if __name__ == "__main__":
    main()
