"""Predictions of recorded runs, against what the GPU measured.

Two questions per recorded workload: (a) replay fidelity: a trace's own wall time per
iteration, predicted from that trace alone (the profiler's cost taken out with the device
profile's constants); (b) the what-if users ask: the graphed wall time, predicted from the eager
trace and the device profile alone (``eager -> graph``). Where capture changes which kernels run
(a model taking another path under capture), (b) prices the eager kernels and says so; the same
what-if with the graphed recording's GPU time (``eager -> graph, borrowed GPU time``) is
reported apart, as a check of its host side only.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from grape.errors import GrapeError
from grape.profile import DeviceProfile, other_device, profile_for
from grape.program import Launch, StreamWait
from grape.sim.engine import simulate
from grape.sim.memory import executable_bytes
from grape.sim.whatif import (
    Costs,
    calibrated,
    costs_from_profile,
    graph_iterations,
    loop_on_device,
    unprofiled_program,
    update_per_shape,
    update_whole_graph,
)
from grape.trace import Trace, read_trace

__all__ = ["FAMILY_SUFFIX", "IR_SUFFIX", "RAW_SUFFIX", "Prediction", "predictions", "validate"]

# GPU activity alone, as torch.profiler exported it (grape reads no trace without the host calls
# that launched the work): work cuda-python launched (a device loop, a family's executable),
# which the profiler cannot see being launched, kept to be opened in Perfetto.
RAW_SUFFIX = ".gpu_only.json.gz"
# Kernel graphs in grape's IR, kept beside the traces (grape info reads them; they hold no run).
IR_SUFFIX = ".ir.json.gz"
FAMILY_SUFFIX = ".family.json.gz"  # a saved graph family (grape.familyio)


@dataclass(frozen=True)
class Prediction:
    workload: str
    question: str  # "replay eager", "replay graph", "eager -> graph", "... memory"
    measured: float
    predicted: float
    note: str = ""
    unit: str = "ms"  # of measured and predicted: "ms" per iteration, or "MB" of device memory
    # An interval the prediction claims, where it states one (eager replays; see _interval).
    low: float | None = None
    high: float | None = None

    @property
    def inside(self) -> bool | None:
        """Whether the measured value lies in the stated interval (None: none stated)."""
        if self.low is None or self.high is None:
            return None
        return self.low <= self.measured <= self.high

    def __post_init__(self) -> None:
        # A gate on a NaN always passes (every comparison with NaN is false): refuse it here.
        if not (0 < self.measured < math.inf and 0 <= self.predicted < math.inf):
            raise GrapeError(f"{self.workload}: expected a positive, finite measurement and a "
                             f"finite prediction for {self.question!r}, found {self.measured} "
                             f"and {self.predicted}")

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


def validate(paths: Iterable[Path], profile: DeviceProfile | None,
             progress: Callable[[str], None] = lambda line: None,
             failed: Callable[[Path, GrapeError], None] | None = None) -> list[Prediction]:
    """Predictions for every grape trace in ``paths`` that carries a measured wall time, each
    priced with ``profile``, or where that is None with the profile shipped for its GPU.

    A trace that cannot be read or predicted raises its ``GrapeError``, or, where ``failed`` is
    given, is passed to it with the error and the rest go on.
    """
    def attempt(path: Path, work: Callable[[], Any]) -> Any:
        try:
            return work()
        except GrapeError as e:
            if failed is None:
                raise
            failed(path, e)
            return None

    # By folder too: recordings of one workload from two machines stay two.
    traces: dict[tuple[Path, str, str], Trace] = {}
    for path in sorted(Path(p) for p in paths):
        if path.name.endswith(RAW_SUFFIX):
            progress(f"skipped {path}: a raw torch.profiler export, kept to be viewed")
            continue
        if path.name.endswith(IR_SUFFIX):
            progress(f"skipped {path}: a kernel graph, not a recorded run")
            continue
        if path.name.endswith(FAMILY_SUFFIX):
            progress(f"skipped {path}: a saved graph family, not a recorded run")
            continue
        trace = attempt(path, lambda path=path: read_trace(path))
        if trace is None:
            continue
        if trace.grape is None or not trace.grape.wall_time_us:
            progress(f"skipped {path}: no wall time measured without the profiler")
            continue
        traces[(path.parent, trace.workload, trace.mode)] = trace
    out = []
    # Each GPU's traces priced with the profile given, else with the one shipped for it.
    priced: dict[str | None, tuple[DeviceProfile, Costs]] = {}
    for gpu in dict.fromkeys(t.gpu for t in traces.values()):
        chosen = profile if profile is not None else profile_for(gpu)
        priced[gpu] = chosen, costs_from_profile(chosen)
        where = [t.source for t in traces.values() if t.gpu == gpu]
        what = where[0] if len(where) == 1 else f"{len(where)} traces ({where[0]}, ...)"
        if note := other_device(chosen, gpu, what):
            progress(f"grape: warning: {note}")
    folders = Counter(workload for _, workload in {(f, w) for f, w, _ in traces})
    for (folder, workload, _), trace in traces.items():
        found = attempt(Path(trace.source), lambda trace=trace, folder=folder: predictions(
            trace, priced[trace.gpu][0], traces.get((folder, trace.workload, "graph")),
            priced[trace.gpu][1]))
        if found is None:
            continue
        if folders[workload] > 1:  # recorded in several folders: say which one this is
            found = [replace(p, workload=f"{folder.name}/{workload}") for p in found]
        out.extend(found)
    return out


def predictions(trace: Trace, profile: DeviceProfile, graph: Trace | None = None,
                costs: Costs | None = None) -> list[Prediction]:
    """Every prediction of one recorded trace that carries a measured wall time (``graph``:
    the graphed recording of the same workload, for an eager one)."""
    if trace.grape is None or not trace.grape.wall_time_us:
        raise GrapeError(f"{trace.source}: expected a grape trace with wall times measured "
                         f"without the profiler, found none")
    costs = costs or costs_from_profile(profile)
    workload, mode = trace.workload, trace.mode
    measured = trace.grape.wall_time_median_us
    program = unprofiled_program(trace, profile)
    replay = simulate(program, costs)
    low = high = None
    if mode == "eager":
        # With the recording's own calibration, the interval also spans its rounds: the most
        # profiler cost and host slowdown taken out gives the fastest prediction, the least
        # the slowest.
        fast = slow = replay.iteration_times
        if calibrated(trace):
            fast = simulate(unprofiled_program(trace, profile, bound="high"), costs)
            slow = simulate(unprofiled_program(trace, profile, bound="low"), costs)
            fast, slow = fast.iteration_times, slow.iteration_times
        low, high = _interval(trace, fast, slow)
    found = [Prediction(workload, f"replay {mode}", measured / 1000,
                        replay.per_iteration / 1000,
                        _host_bound(trace) if mode == "eager" else "", low=low, high=high)]
    found.extend(_family_memory(trace, profile))
    found.extend(_device_loop(trace, program, costs))
    found.extend(_family_step(trace, program, costs))
    if mode == "eager" and graph is not None:
        found.extend(_eager_to_graph(trace, program, graph, profile, costs))
    return found


def _eager_to_graph(trace: Trace, program, graph: Trace, profile: DeviceProfile,
                    costs: Costs) -> list[Prediction]:
    """The what-if, against the graphed recording of the same workload: from the eager trace
    and the device profile alone (``eager -> graph``); and, apart, with the GPU time borrowed
    from the graphed recording (``eager -> graph, borrowed GPU time``), which checks only the
    host side of the what-if, since its GPU time is the answer's own."""
    measured = graph.grape.wall_time_median_us / 1000
    eager_kernels = len(trace.iterations[0].kernels)
    graph_kernels = len(graph.iterations[0].kernels)
    note = ("" if eager_kernels == graph_kernels else
            f"capture runs {graph_kernels} kernels against {eager_kernels} eagerly: the "
            f"what-if prices the eager ones")
    graphed = graph_iterations(program, costs)
    if any("holds no stream waits" in a for a in graphed.approximations):
        note = "; ".join(filter(None, [note, "streams priced as they shared the GPU when "
                                             "recorded: the trace holds no stream waits"]))
    if graphed.blockers:
        note = "; ".join(filter(None, [note, f"capture would refuse: {graphed.blockers[0]}"
                                       + (f" (and {len(graphed.blockers) - 1} more)"
                                          if len(graphed.blockers) > 1 else "")]))
    alone = simulate(graphed, costs).per_iteration
    low = high = None
    if _overlapping_branches(program):
        # Branches the waits let overlap are priced as they share the GPU's SMs; how much
        # more or less they slow each other down (memory bandwidth, blocks sharing an SM) the
        # trace cannot say: state the range, from overlapped at their alone speed to one after
        # the other.
        low, high = (simulate(graph_iterations(program, costs, branches=way), costs)
                     .per_iteration / 1000 for way in ("overlapped", "serial"))
        low, high = min(low, alone / 1000), max(high, alone / 1000)
        note = "; ".join(filter(None, [note, "branches on several streams: the interval runs "
                                             "from overlapped to one after the other"]))
    borrowed = simulate(graph_iterations(program, costs,
                                         captured=unprofiled_program(graph, profile)),
                        costs).per_iteration
    return [Prediction(trace.workload, "eager -> graph", measured, alone / 1000, note,
                       low=low, high=high),
            Prediction(trace.workload, "eager -> graph, borrowed GPU time", measured,
                       borrowed / 1000, "GPU time from the graphed recording's kernels")]


def _overlapping_branches(program) -> bool:
    """Whether an iteration issues work on several streams with waits between them (which
    the what-if runs as branches that may overlap)."""
    for steps in program.iterations:
        launches = [s for s in steps if isinstance(s, Launch)]
        if (len({w.stream for s in launches for w in s.work}) > 1
                and any(isinstance(s, StreamWait) for s in steps)):
            return True
    return False


def _interval(trace: Trace, fast: list[float], slow: list[float]
              ) -> tuple[float | None, float | None]:
    """An eager replay's interval (ms): from the fastest to the slowest of the profiled
    iterations each predicted on their own (their host pace differs; ``fast`` and ``slow``
    differ where the recording's calibration spans a range), widened by the recording's own
    spread of unprofiled wall times (10th and 90th percentiles against the median). It claims
    no more than the recording shows of its own noise."""
    wall = sorted(trace.grape.wall_time_us) if trace.grape else []
    if not fast or not slow or len(wall) < 2:
        return None, None
    median = wall[len(wall) // 2]
    p10, p90 = wall[len(wall) // 10], wall[(len(wall) * 9) // 10]
    return min(fast) * p10 / median / 1000, max(slow) * p90 / median / 1000


def _host_bound(trace: Trace) -> str:
    """A note for an eager recording whose GPU sat idle most of each profiled step: the host's
    pace set its time, and that pace moved between and within processes on the H200."""
    busy = sorted(it.gpu_busy_time / it.host_time for it in trace.iterations if it.host_time)
    if not busy or busy[len(busy) // 2] >= 0.5:
        return ""
    return (f"host-bound: GPU busy {busy[len(busy) // 2]:.0%} of the profiled step, so the "
            f"recording host's pace sets it")


_FAMILY_COUNTERS = ("shapes", "topologies", "nodes", "naive_graph_bytes", "family_graph_bytes")


def _family_memory(trace: Trace, profile: DeviceProfile) -> list[Prediction]:
    """Executable memory of per-shape graphs and of a graph family, where the trace was
    recorded beside both (its ``counters``): one executable per shape against one per
    topology, at the profile's bytes per node (the largest topology's node count for all)."""
    counters = trace.grape.counters if trace.grape else {}
    if not all(name in counters for name in _FAMILY_COUNTERS):
        return []
    per_node = profile.get("executable_bytes_per_node")
    nodes = counters["nodes"]
    note = (f"{counters['shapes']:.0f} shapes, {counters['topologies']:.0f} topologies, "
            f"{nodes:.0f} nodes, {per_node:.0f} B per node")
    per_shape = executable_bytes([round(nodes)] * round(counters["shapes"]), per_node)
    family = executable_bytes([round(nodes)] * round(counters["topologies"]), per_node)
    return [Prediction(trace.workload, "per-shape memory", counters["naive_graph_bytes"] / 1e6,
                       per_shape / 1e6, note, "MB"),
            Prediction(trace.workload, "family memory", counters["family_graph_bytes"] / 1e6,
                       family / 1e6, note, "MB")]


def _device_loop(trace: Trace, program, costs: Costs) -> list[Prediction]:
    """The device loop's time per token, predicted from a trace of the host loop it replaces
    (one graph launch and one read-back per token), where the trace was recorded beside a
    measured device loop (its ``counters``): every launch and sync become one WHILE node."""
    counters = trace.grape.counters if trace.grape else {}
    if "device_loop_decode_ms_per_token" not in counters:
        return []
    looped = simulate(loop_on_device(program, costs), costs).per_iteration
    return [Prediction(trace.workload, "host loop -> device loop",
                       counters["device_loop_decode_ms_per_token"],
                       looped / len(program.iterations) / 1000,
                       f"{len(program.iterations)} tokens of the host loop's trace, "
                       f"{costs.while_per_iteration:.2f} us per WHILE iteration")]


def _family_step(trace: Trace, program, costs: Costs) -> list[Prediction]:
    """A family's synchronised step, predicted from the trace of the per-shape graphs it
    replaces, where the family ran over the same shapes beside it (its ``counters``): each
    launch preceded by the nodes it changed, one update call each, or by one whole-graph
    update."""
    counters = trace.grape.counters if trace.grape else {}
    if "family_step_synced_us" not in counters:
        return []
    if counters.get("whole_graph_update"):
        what_if, how = update_whole_graph(program, costs), "one cuGraphExecUpdate per step"
    else:
        changed = counters["window_changed_nodes_per_step"]
        what_if = update_per_shape(program, costs, changed)
        how = f"{changed:.1f} nodes updated per step"
    predicted = simulate(what_if, costs).per_iteration
    return [Prediction(trace.workload, "per-shape -> family",
                       counters["family_step_synced_us"] / 1000, predicted / 1000,
                       f"{how}; measured update {counters['family_update_us_per_step']:.0f} us")]
