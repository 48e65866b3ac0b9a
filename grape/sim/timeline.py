"""Simulated timelines as Chrome traces, so Perfetto shows them beside recorded ones."""

from __future__ import annotations

from pathlib import Path

from grape.jsonio import dump_json
from grape.sim.engine import SimResult
from grape.sim.graph import GraphRun

__all__ = ["write_graph_timeline", "write_timeline"]


def write_timeline(path: str | Path, result: SimResult, name: str) -> Path:
    """Host steps on one track, each stream on its own, in microseconds from zero."""
    tracks = sorted({i.track for i in result.intervals}, key=lambda t: (t != "host", t))
    tid = {track: n for n, track in enumerate(tracks)}
    events = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0,
               "args": {"name": f"grape simulation: {name}"}}]
    events += [{"ph": "M", "name": "thread_name", "pid": 0, "tid": n, "args": {"name": track}}
               for track, n in tid.items()]
    events += [{"ph": "X", "name": i.name, "cat": "simulated", "pid": 0, "tid": tid[i.track],
                "ts": i.start, "dur": i.end - i.start} for i in result.intervals]
    return dump_json(path, {"displayTimeUnit": "ms", "traceEvents": events,
                            "grape": {"simulated": name,
                                      "iteration_us": result.iteration_times}})


def write_graph_timeline(path: str | Path, run: GraphRun, name: str) -> Path:
    """One simulated graph launch, every node run on the GPU track (nested bodies named
    ``<conditional>/<body>/<node>``), in microseconds from the launch's start."""
    events = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0,
               "args": {"name": f"grape simulation: {name}"}},
              {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0,
               "args": {"name": "GPU (graph)"}}]
    events += [{"ph": "X", "name": label, "cat": "simulated", "pid": 0, "tid": 0, "ts": start,
                "dur": end - start} for start, end, label in run.intervals]
    return dump_json(path, {"displayTimeUnit": "ms", "traceEvents": events,
                            "grape": {"simulated": name, "graph_gpu_us": run.gpu_time}})
