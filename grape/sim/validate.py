"""Predictions of recorded runs, against what the GPU measured.

Two questions per recorded workload: (a) replay fidelity: a trace's own wall time per
iteration, predicted from that trace alone (the profiler's cost taken out with the device
profile's constants); (b) the what-if users ask: the graphed wall time, predicted from the eager
trace and the device profile, with the captured kernel set's GPU time where capture changed
which kernels run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from grape.profile import DeviceProfile
from grape.sim.engine import simulate
from grape.sim.whatif import costs_from_profile, graph_iterations, unprofiled_program
from grape.trace import Trace, read_trace

__all__ = ["Prediction", "validate"]


@dataclass(frozen=True)
class Prediction:
    workload: str
    question: str  # "replay eager", "replay graph", "eager -> graph"
    measured_us: float
    predicted_us: float
    note: str = ""

    @property
    def error(self) -> float:
        return (self.predicted_us - self.measured_us) / self.measured_us


def validate(paths: Iterable[Path], profile: DeviceProfile,
             progress: Callable[[str], None] = lambda line: None) -> list[Prediction]:
    """Predictions for every grape trace in ``paths`` that carries a measured wall time."""
    traces: dict[tuple[str, str], Trace] = {}
    for path in sorted(paths):
        trace = read_trace(path)
        if trace.grape is None or not trace.grape.wall_time_us:
            progress(f"skipped {path}: no wall time measured without the profiler")
            continue
        traces[(trace.workload, trace.mode)] = trace
    out = []
    costs = costs_from_profile(profile)
    for (workload, mode), trace in traces.items():
        measured = trace.grape.wall_time_median_us
        program = unprofiled_program(trace, profile)
        out.append(Prediction(workload, f"replay {mode}", measured,
                              simulate(program, costs).per_iteration))
        graph = traces.get((workload, "graph"))
        if mode == "eager" and graph is not None:
            eager_kernels = len(trace.iterations[0].kernels)
            graph_kernels = len(graph.iterations[0].kernels)
            note = ("" if eager_kernels == graph_kernels else
                    f"capture runs {graph_kernels} kernels against {eager_kernels} eagerly: "
                    f"GPU time from the captured set")
            what_if = graph_iterations(program, costs,
                                       captured=unprofiled_program(graph, profile))
            predicted = simulate(what_if, costs).per_iteration
            out.append(Prediction(workload, "eager -> graph", graph.grape.wall_time_median_us,
                                  predicted, note))
    return out
