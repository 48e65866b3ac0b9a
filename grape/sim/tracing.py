"""The simulator's runs as grape traces, the format the recorded runs come in.

A simulation with ``record=True`` keeps every API call the simulated host made (with a
correlation id, as CUPTI gives one) and every operation the simulated GPU ran; this writes them
as a Chrome trace in Kineto's shapes with a ``grape`` block (mode ``simulated``), each iteration
a ``ProfilerStep#N`` annotation. ``grape info`` reads it like a recording, Perfetto opens it,
and ``grape validate`` predicts it again: a simulated trace replayed is the simulation it came
from, which checks the two halves of the twin against each other.
"""

from __future__ import annotations

from pathlib import Path

from grape.errors import GrapeError
from grape.jsonio import dump_json
from grape.kineto import encode
from grape.records import HostCall
from grape.sim.engine import SimResult
from grape.trace import SIMULATED, GrapeMeta

__all__ = ["SIMULATED", "write_simulated_trace"]


def write_simulated_trace(path: str | Path, result: SimResult, workload: str,
                          device: str, notes: str = "") -> Path:
    """Write ``result`` (from ``simulate(..., record=True)``) as a grape trace."""
    if not result.calls or not result.windows:
        raise GrapeError(f"expected a simulation recorded with record=True, found none for "
                         f"{workload!r}")
    steps = [HostCall(f"ProfilerStep#{i}", "op", start, end - start, 1)
             for i, (start, end) in enumerate(result.windows)]
    # The simulated iterations' wall times stand where a recording keeps its measured ones:
    # the simulation has no profiler to take out.
    meta = GrapeMeta(workload=workload, mode=SIMULATED, device=device, driver="none (simulated)",
                     wall_time_us=tuple(t for t in result.iteration_times if t > 0),
                     notes=notes or "written by grape's simulator")
    doc = {"schemaVersion": 1, "displayTimeUnit": "ms", "deviceProperties": [{"name": device}],
           "grape": meta.to_json(),
           "traceEvents": encode(result.calls, [], steps, result.gpu_ops)}
    return dump_json(path, doc)
