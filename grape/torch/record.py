"""Recording workloads on the GPU, eagerly and graphed, as grape traces.

Each recording is two measurements of the same step: wall time per iteration without the
profiler (warm-up first, then a synchronised timer around each step, many steps), and a
torch.profiler trace of a few steps (``ProfilerStep`` marks each one). The trace is written with
the measured times in its ``grape`` block, since the profiler slows the host side of what it
watches.
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import grape
from grape.torch.capture import capture
from grape.torch.workloads import Workload
from grape.trace import GrapeMeta, read_trace, write_trace

__all__ = ["Recording", "record"]


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
    import cuda.bindings
    import transformers

    return {"grape": grape.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda-bindings": cuda.bindings.__version__,
            "cuda": str(torch.version.cuda)}


def _runner(w: Workload, mode: str) -> tuple[Callable[[], object], int | None]:
    if mode == "eager":
        return (lambda: w.step(*w.inputs)), None
    cap = capture(w.step, *w.inputs, params=w.params)
    return cap.replay, sum(1 for _ in cap.ir.kernels())


def _timed(w: Workload, run: Callable[[], object], steps: int) -> list[float]:
    wall = []
    for _ in range(steps):
        w.refresh()  # fresh inputs, outside the timed region
        torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t) * 1e6)
    return wall


def record(w: Workload, mode: str, out_dir: Path, timed: int = 30, profiled: int = 3,
           warmup: int = 5) -> Recording:
    """Measure and profile one workload in one mode; write ``<name>.<mode>.json.gz``.

    Raises
    ------
    CaptureError
        Graphed mode, and the step cannot be captured.
    """
    run, nodes = _runner(w, mode)
    for _ in range(warmup):
        w.refresh()
        run()
    # Half the timed steps run just before the profiled ones and half just after, so that the
    # trace and the measurement see the machine in the same state (a host-bound step's speed
    # drifts on a shared machine).
    wall = _timed(w, run, timed // 2)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=profiled)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        # The profiler drops its events when the schedule's cycle ends: export as it does.
        with torch.profiler.profile(activities=activities, schedule=schedule,
                                    on_trace_ready=lambda p: p.export_chrome_trace(str(raw))
                                    ) as prof:
            for _ in range(1 + profiled):
                run()
                torch.cuda.synchronize()  # each profiled step is what each timed step was
                prof.step()
        trace = read_trace(raw)
    wall += _timed(w, run, timed - timed // 2)
    meta = GrapeMeta(workload=w.name, mode=mode, device=torch.cuda.get_device_name(),
                     driver=_driver(), libraries=_libraries(), wall_time_us=tuple(wall),
                     notes=f"{w.spec}; fp16, random weights; wall time: {timed} synchronised "
                           f"steps without the profiler after {warmup} warm-ups, half just "
                           f"before and half just after the profiled ones")
    path = write_trace(out_dir / f"{w.name}.{mode}.json.gz", trace, meta)
    kernels = len(trace.iterations[0].kernels) if trace.iterations else 0
    return Recording(w.name, mode, path, statistics.median(wall) / 1000, kernels, nodes)
