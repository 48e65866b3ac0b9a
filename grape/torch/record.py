"""Recording workloads on the GPU, eagerly and graphed, as grape traces.

Each recording is two measurements of the same step: wall time per iteration without the
profiler (warm-up first, then a synchronised timer around each step, many steps), and a
torch.profiler trace of a few steps. The trace is written with the measured times in its
``grape`` block, since the profiler slows the host side of what it watches, and keeps slowing it
after it stops: every workload is recorded in a fresh process, timed before the profiler first
runs.

What the profiler costs the host is measured in the same process (``grape.torch.profiler_cost``:
its cost per recorded event, and how much slower the host runs once it has run) and kept in the
trace's counters, so that the eager replay takes out this process's figures, not a constant.

By default the profiler records CUDA activity only (API calls, kernels, copies), which is all the
simulator uses: recording every PyTorch operator as well costs 1-5 us of host time per operator,
and how much varies between models by more than the simulator's error bound, so traces meant
for validation leave operators out (``cpu_ops=True`` keeps them, for people reading the trace).

Modes: ``eager``, ``graph`` (PyTorch's replay of the step's capture) and ``grape`` (the capture
read into the IR, rebuilt and launched by grape's CUDA backend: the backend's own run). The
profiler does not record cuda-python's driver calls, so in ``grape`` mode grape marks its own
(``grape.cuda.check.observe``) and the reader turns the marks back into the calls, each launch
with the GPU work it caused (``grape.kineto``); operators are recorded in that mode, since the
marks are host activity.
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import grape
from grape.errors import CaptureError
from grape.torch.capture import capture
from grape.torch.workloads import Workload
from grape.trace import GrapeMeta, Trace, read_trace, write_trace

__all__ = ["Recording", "machine_meta", "profile_steps", "record", "timed_calls"]


@dataclass(frozen=True)
class Recording:
    workload: str
    mode: str
    path: Path
    wall_ms: float  # median
    kernels: int  # per profiled iteration (the first one)
    graph_nodes: int | None  # kernel nodes in the captured graph, graphed mode only


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def _libraries() -> dict[str, str]:
    from importlib.metadata import version  # the distribution's: only grape.cuda imports it

    import transformers

    return {"grape": grape.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda-bindings": version("cuda-bindings"),
            "cuda": str(torch.version.cuda)}


def machine_meta(workload: str, mode: str, wall_time_us: Sequence[float], notes: str,
                 iterations: int, counters: dict[str, float] | None = None) -> GrapeMeta:
    """A trace's ``grape`` block for a recording made here: this GPU, its driver and the
    libraries' versions, with the caller's measurements."""
    return GrapeMeta(workload=workload, mode=mode, device=torch.cuda.get_device_name(),
                     driver=_driver(), libraries=_libraries(), wall_time_us=tuple(wall_time_us),
                     notes=notes, iterations=iterations, counters=dict(counters or {}))


def _runner(w: Workload, mode: str) -> tuple[Callable[[], object], int | None]:
    """``eager``: the step as PyTorch runs it; ``graph``: PyTorch's replay of its capture;
    ``grape``: the capture read into the IR, rebuilt and launched by grape's CUDA backend."""
    if mode == "eager":
        return (lambda: w.step(*w.inputs)), None
    instantiate = mode == "graph"
    cap = capture(w.step, *w.inputs, params=w.params, instantiate=instantiate)
    nodes = sum(1 for _ in cap.ir.kernels())
    if mode == "graph":
        return cap.replay, nodes
    from grape.cuda.build import Graph

    graph = Graph.build(cap.ir)
    executable = graph.instantiate()

    def launch() -> None:
        executable.launch(torch.cuda.current_stream().cuda_stream)

    launch.keep = (cap, graph, executable)  # type: ignore[attr-defined]  # the pool, the graph
    return launch, nodes


def _grape_calls_marked() -> Any:
    """grape's own driver calls as profiler annotations ("grape:cuGraphLaunch"), which the
    trace reader turns back into the calls, each with the GPU work it caused."""
    from grape.cuda.check import observe

    return observe(lambda name: torch.profiler.record_function(f"grape:{name}"))


def timed_calls(run: Callable[[], object], steps: int,
                before: Callable[[], object] | None = None) -> list[float]:
    """Microseconds of each of ``steps`` calls of ``run``, each between two device syncs, after
    ``before()`` (untimed) where given."""
    wall = []
    for _ in range(steps):
        if before is not None:
            before()
        torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t) * 1e6)
    return wall


def profile_steps(run: Callable[[], object], profiled: int, cpu_ops: bool = False) -> Trace:
    """A trace of ``profiled`` synchronised calls of ``run`` (after one warm-up call the
    profiler drops), each marked by a ``ProfilerStep`` annotation, read back by grape."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if cpu_ops:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=profiled)
    # CUPTI's synchronization records ("cuda_sync"): which stream waits on an event, the order
    # between streams that Wav2Vec2's multi-stream convolutions need.
    sync_events = torch._C._profiler._ExperimentalConfig(enable_cuda_sync_events=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        # The profiler drops its events when the schedule's cycle ends: export as it does.
        with torch.profiler.profile(activities=activities, schedule=schedule,
                                    experimental_config=sync_events,
                                    on_trace_ready=lambda p: p.export_chrome_trace(str(raw))
                                    ) as prof:
            for _ in range(1 + profiled):
                run()
                torch.cuda.synchronize()  # each profiled step is what each timed step was
                prof.step()
        trace = read_trace(raw)  # ProfilerStep marks split it, with or without CPU activity
        if len(trace.iterations) != profiled:
            # The marks can come back wrong: one ProfilerStep over all 32 steps of Wav2Vec2
            # graphs (H200, CUDA activity only). The count is known here, so split by it.
            trace = read_trace(raw, iterations=profiled)
        return trace


def record(w: Workload, modes: Sequence[str], out_dir: Path, timed: int = 30,
           profiled: int = 3, warmup: int = 5, cpu_ops: bool = False,
           calibration_rounds: int = 5) -> list[Recording | str]:
    """Measure and profile one workload in each mode; write ``<name>.<mode>.json.gz``.

    Every mode is timed before the profiler runs at all: once torch.profiler has run in a
    process, host-bound steps stay slower there (seen on the H200: 6.5 ms per GPT-2 step before
    a profiling session, 11.8 ms after it). Call this in a fresh process (``grape record`` does).
    A mode that cannot run (a graph whose capture breaks) gives a line saying why instead.

    ``calibration_rounds``: rounds of ``grape.torch.profiler_cost``'s loops, timed before any
    profiling and measured again after it, whose figures (the profiler's cost per event, the
    host's pace after profiling) go into each trace's counters; 0 leaves them out.
    """
    from grape.torch import profiler_cost

    runs: dict[str, tuple[Callable[[], object], int | None]] = {}
    results: list[Recording | str] = []
    for mode in modes:
        try:
            runs[mode] = _runner(w, mode)
        except CaptureError as e:
            results.append(f"{w.spec} {mode}: not recorded: {e}")
    walls = {}
    for mode, (run, _) in runs.items():
        for _ in range(warmup):
            w.refresh()
            run()
        walls[mode] = timed_calls(run, timed, before=w.refresh)  # fresh inputs, untimed
    clean = (profiler_cost.clean_times(timed_calls, calibration_rounds)
             if calibration_rounds else {})  # still before any profiling
    traces: dict[str, tuple[Trace, bool]] = {}
    for mode, (run, _) in runs.items():
        # grape's call marks are host activity: the profiler records them with operators
        ops = cpu_ops or mode == "grape"
        if mode == "grape":
            with _grape_calls_marked():
                traces[mode] = profile_steps(run, profiled, cpu_ops=True), ops
        else:
            traces[mode] = profile_steps(run, profiled, cpu_ops), ops
    calibrated: dict[bool, dict[str, float]] = {}
    if calibration_rounds:
        for ops in sorted({ops for _, ops in traces.values()}):
            calibrated[ops] = profiler_cost.calibrate(
                timed_calls, lambda run, n, ops=ops: profile_steps(run, n, cpu_ops=ops),
                clean, calibration_rounds, operators=ops)
    for mode, (trace, ops) in traces.items():
        meta = machine_meta(w.name, mode, walls[mode],
                            f"{w.spec}; fp16, random weights; wall time: {timed} "
                            f"synchronised steps after {warmup} warm-ups, in a process "
                            f"where the profiler had not yet run; profiled: "
                            f"{'operators and ' if ops else ''}CUDA activity"
                            + (f"; profiler cost and host pace calibrated in this process "
                               f"({calibration_rounds} rounds, grape.torch.profiler_cost)"
                               if calibration_rounds else ""),
                            len(trace.iterations), counters=calibrated.get(ops))
        path = write_trace(out_dir / f"{w.name}.{mode}.json.gz", trace, meta)
        kernels = len(trace.iterations[0].kernels) if trace.iterations else 0
        results.append(Recording(w.name, mode, path, statistics.median(walls[mode]) / 1000,
                                 kernels, runs[mode][1]))
    return results


def main(argv: Sequence[str] | None = None) -> None:
    """One workload, every mode, in this (fresh) process; one JSON line per result."""
    import argparse
    import json

    from grape.torch.workloads import parse_spec

    parser = argparse.ArgumentParser(prog="python -m grape.torch.record")
    parser.add_argument("spec")
    parser.add_argument("--modes", default="eager,graph", help="among eager, graph, grape")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timed", type=int, default=30)
    parser.add_argument("--profiled", type=int, default=3)
    parser.add_argument("--cpu-ops", action="store_true")
    parser.add_argument("--calibration-rounds", type=int, default=5,
                        help="rounds measuring the profiler's cost in this process (0: none)")
    args = parser.parse_args(argv)
    if args.calibration_rounds < 0:
        parser.error(f"expected --calibration-rounds of at least 0, found "
                     f"{args.calibration_rounds}")
    args.out.mkdir(parents=True, exist_ok=True)
    for r in record(parse_spec(args.spec), args.modes.split(","), args.out, args.timed,
                    args.profiled, cpu_ops=args.cpu_ops,
                    calibration_rounds=args.calibration_rounds):
        line = ({"failed": r} if isinstance(r, str) else
                {"workload": r.workload, "mode": r.mode, "path": str(r.path),
                 "wall_ms": r.wall_ms, "kernels": r.kernels, "graph_nodes": r.graph_nodes})
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
