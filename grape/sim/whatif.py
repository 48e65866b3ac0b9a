"""What-if transformations of Programs, and the costs a device profile implies.

Each is a plain function ``f(program, ...) -> Program``; none changes its input.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import dataclass, field, replace

from grape.errors import GrapeError, ProfileError
from grape.profile import DeviceProfile
from grape.program import (
    GpuWork,
    GraphLaunch,
    HostWork,
    Launch,
    ProfilerOverhead,
    Program,
    Step,
    StreamWait,
    Sync,
    program_from_trace,
)
from grape.sim.engine import Costs
from grape.sim.sharing import branch_time
from grape.trace import SIMULATED, Trace

__all__ = [
    "BOUNDS",
    "calibrated",
    "copy_into_placeholders",
    "costs_from_profile",
    "graph_iterations",
    "overhead_from_profile",
    "profiled_graph_launches",
    "scale_host",
    "set_launch_cost",
    "unprofiled_program",
    "update_per_shape",
    "update_whole_graph",
]


def costs_from_profile(profile: DeviceProfile, **overrides: float) -> Costs:
    """Costs for PyTorch workloads: a graph launch costs what ``CUDAGraph.replay()`` does."""
    values = {"kernel_gap": profile.get("graph_kernel_gap"),
              "graph_node_overhead": profile.get("graph_node_overhead"),
              "graph_launch_fixed": profile.get("replay_fixed"),
              "graph_launch_per_node": profile.get("replay_per_node"),
              "while_per_iteration": profile.get("while_per_iteration"),
              "set_params": profile.get("set_params"),
              "exec_update_per_node": profile.get("exec_update_per_node"),
              "copy_call": profile.get("torch_launch"),
              "copy_latency": profile.get("copy_latency"),
              "copy_bandwidth": profile.get("copy_bandwidth")}
    # Measured since (grape characterize --only graph_copy_nodes): older profiles lack it.
    with contextlib.suppress(ProfileError):
        values.update({name: profile.get(name) for name in (
            "graph_copy_latency", "graph_copy_us_per_byte", "graph_memset_latency",
            "graph_memset_us_per_byte")})
    with contextlib.suppress(ProfileError):  # read from recordings since; older profiles lack it
        values["profiler_graph_gap"] = profile.get("profiler_graph_gap")
    return Costs(**{**values, **overrides})


# Which of a recording's calibrated figures (grape.torch.profiler_cost) a prediction takes:
# each figure's median over the rounds, or its lowest or highest.
BOUNDS = {"median": "", "low": "_low", "high": "_high"}


def calibrated(trace: Trace) -> bool:
    """Whether ``trace`` carries the profiler's cost and the host's pace as measured in its
    own recording's process (``grape record`` writes them since grape.torch.profiler_cost)."""
    return trace.grape is not None and "profiler_per_call_us" in trace.grape.counters


def _figure(trace: Trace, name: str, bound: str) -> float:
    if bound not in BOUNDS:
        raise GrapeError(f"expected a calibration bound among {sorted(BOUNDS)}, found {bound!r}")
    counters = trace.grape.counters if trace.grape is not None else {}
    return counters.get(name + BOUNDS[bound], counters.get(name, 0.0))


def overhead_from_profile(profile: DeviceProfile, trace: Trace,
                          bound: str = "median") -> ProfilerOverhead:
    """What the profiler added to ``trace``'s host side: as measured in the recording's own
    process where the trace carries that (``bound``: the rounds' median, lowest or highest),
    else the device profile's constants, per operator and API call where it recorded PyTorch
    operators, per API call alone where it recorded CUDA activity only; none where grape's
    simulator wrote it."""
    if trace.grape is not None and trace.grape.mode == SIMULATED:
        return ProfilerOverhead()
    if calibrated(trace):
        return ProfilerOverhead(_figure(trace, "profiler_per_op_us", bound),
                                _figure(trace, "profiler_per_call_us", bound),
                                _figure(trace, "profiler_per_step_us", bound))
    if trace.ops:
        per_event = profile.get("profiler_per_event")
        return ProfilerOverhead(per_event, per_event)
    return ProfilerOverhead(0.0, profile.get("profiler_per_call"))


def unprofiled_program(trace: Trace, profile: DeviceProfile,
                       costs: Costs | None = None, bound: str = "median") -> Program:
    """``trace`` as the simulator should run it: the program without the profiler's costs,
    its graph launches priced with ``costs`` (the profile's by default). Where the recording
    measured how much slower its host ran once profiling had run in the process, the host's
    costs are taken back to the pace of its timed steps (``bound`` as for
    :func:`overhead_from_profile`)."""
    program = program_from_trace(trace, overhead_from_profile(profile, trace, bound))
    pace = _figure(trace, "host_pace_after_profiling", bound) if calibrated(trace) else 0.0
    if pace > 0:
        program = scale_host(program, 1 / pace)
    return profiled_graph_launches(program, costs or costs_from_profile(profile))


def profiled_graph_launches(program: Program, costs: Costs) -> Program:
    """Graph launches at their unprofiled host cost and GPU time.

    Under torch.profiler a ``cudaGraphLaunch`` lasts as long as CUPTI takes to instrument every
    node (hundreds of microseconds for GPT-2); without it, what ``CUDAGraph.replay()`` costs
    by the profile applies. The replay's other host work in the trace (its
    ``cudaStreamIsCapturing`` check and Python) is then part of that cost, so it goes too.
    On the GPU, the kernels keep their traced time and the gaps between them cost the profile's
    per-node overhead, not the gaps the trace shows: those describe the machine when it was
    profiled, and ``grape record`` times every mode before it profiles any. In the first H200
    suite (``traces/h200``) 13 of 19 graphed traces show 0.1 us between a graph's kernels (no
    per-node cost) while their timed steps, earlier in the same processes, ran at the profile's
    0.30 us a node: priced at their traced gaps, their replays came out 4 to 12% fast. A gap
    separates a node from the one it waits for, and where the capture forked branches onto
    other streams, another branch's work runs through many of those gaps: the traced union of
    the kernels (``busy``) already holds that time, and the launch pays the gaps only of the
    kernels that started with no other stream's work running (``GraphLaunch.exposed``; on
    one stream, every kernel). A model forked onto two streams was predicted 12.7% slow with
    every node's gap added, 9.9% with its longest stream's 17 of 33, 8.2% with the 7 exposed.
    """
    def unprofiled(launch: GraphLaunch) -> GraphLaunch:
        gapped = launch.exposed if launch.exposed is not None else _nodes_in_sequence(launch)
        gpu = (launch.gpu_time if launch.busy is None else
               launch.busy + costs.graph_node_overhead * gapped)
        return replace(launch, gpu_time=gpu, cost=costs.graph_launch_fixed
                       + costs.graph_launch_per_node * launch.nodes)

    def fix(steps: tuple[Step, ...]) -> tuple[Step, ...]:
        if not any(isinstance(s, GraphLaunch) for s in steps):
            return steps
        return tuple(unprofiled(s) if isinstance(s, GraphLaunch) else s
                     for s in steps if not isinstance(s, HostWork))
    return program.with_iterations([fix(it) for it in program.iterations])


def _nodes_in_sequence(launch: GraphLaunch) -> int:
    """The most kernels of ``launch`` that ran on one stream (all of them without ``work``):
    the gaps a launch pays where the trace did not say which were exposed."""
    per_stream = Counter(w.stream for w in launch.work if w.kind == "kernel")
    return max(per_stream.values(), default=launch.nodes)


def scale_host(program: Program, factor: float) -> Program:
    """Every host cost (framework work and API calls) times ``factor``."""
    if not 0 <= factor < math.inf:
        raise GrapeError(f"expected a finite, non-negative host scale, found {factor}")

    def scale(step: Step) -> Step:
        if isinstance(step, HostWork):
            return HostWork(step.dur * factor)
        if isinstance(step, (Launch, GraphLaunch, Sync)):
            return replace(step, cost=step.cost * factor)
        return step
    return program.with_iterations([tuple(scale(s) for s in it) for it in program.iterations])


def set_launch_cost(program: Program, cost: float) -> Program:
    """Every eager launch's host cost set to ``cost`` microseconds."""
    if not 0 <= cost < math.inf:
        raise GrapeError(f"expected a finite, non-negative launch cost, found {cost}")
    return program.with_iterations([tuple(replace(s, cost=cost) if isinstance(s, Launch) else s
                                          for s in it) for it in program.iterations])


# How branches that the stream waits let overlap are priced (``_graph_gpu_time``).
BRANCHES = ("shared", "overlapped", "serial")


def _graph_gpu_time(steps: tuple[Step, ...] | list[Step], per_node: float,
                    branches: str = "shared") -> tuple[float, int, set[int]]:
    """GPU time of ``steps``' eager work captured as one graph, each operation plus the graph's
    per-node overhead. Where the trace's stream waits say what waited for what, the streams'
    work runs as branches that overlap as far as the waits allow (capture turns an event wait
    between streams into a dependency between branches), each operation at its alone time and
    ``branches``: ``"shared"``, slowed where overlapping work asks for more SMs than the GPU
    has (``grape.sim.sharing``); ``"overlapped"``, never slowed (the bound for branches that
    do not contend); ``"serial"``, one after the other (the bound for branches that contend as
    much as work can). Without waits, the work one after another, each operation costing the
    GPU what it did when recorded (``GpuWork.work``: work that ran beside other streams'
    shared the GPU with it). Returns (GPU time, nodes, streams).
    """
    if branches not in BRANCHES:
        raise GrapeError(f"expected branches priced one of {', '.join(BRANCHES)}, found "
                         f"{branches!r}")
    work = [w for s in steps if isinstance(s, Launch) for w in s.work]
    streams = {w.stream for w in work}
    if branches == "serial" or not any(isinstance(s, StreamWait) for s in steps):
        return sum(w.work for w in work) + per_node * len(work), len(work), streams
    return branch_time(steps, per_node, shared=branches == "shared"), len(work), streams


def capture_blockers(steps: tuple[Step, ...] | list[Step]) -> list[str]:
    """What in an iteration's eager steps a stream capture would refuse, as it stands: a host
    sync before its last launch (a value read back mid-iteration), a copy from pageable host
    memory, a copy to the host (whose value the host then reads)."""
    found = []
    launch_at = [i for i, s in enumerate(steps) if isinstance(s, Launch)]
    last = launch_at[-1] if launch_at else -1
    for i, step in enumerate(steps):
        if isinstance(step, Sync) and i < last:
            found.append(f"a host sync ({step.api}) before the iteration's last launch")
        if isinstance(step, Launch):
            for w in step.work:
                if w.kind == "memcpy" and "Pageable" in w.name and "HtoD" in w.name:
                    found.append(f"a copy from pageable host memory ({w.name}, {step.api})")
                elif w.kind == "memcpy" and "DtoH" in w.name:
                    found.append(f"a copy to the host ({w.name}, {step.api})")
    return found


def graph_iterations(program: Program, costs: Costs, captured: Program | None = None,
                     branches: str = "shared") -> Program:
    """Each iteration captured as one graph and replayed: what graphs would buy.

    The host keeps only the graph launch (the profile's cost) and the iteration's syncs; the
    framework's host work and the eager launches disappear. The graph's GPU time is the
    captured graph's own where a graphed recording of the workload exists (``captured``, as
    :func:`unprofiled_program` gives it: capture can change which kernels run), else the eager
    work with the graph's per-node overhead, its streams concurrent as far as the trace's stream
    waits allow. What capture would refuse as the iteration stands (:func:`capture_blockers`)
    is listed in the program's ``blockers``, each once with the iterations it occurs in: the
    prediction then holds for the iteration once those are made capturable. ``branches`` says
    how branches that the waits let overlap are priced (:func:`_graph_gpu_time`): sharing the
    GPU's SMs, or either bound of what concurrent branches can cost.
    """
    captured_times = []
    if captured is not None:
        captured_times = [s.gpu_time for it in captured.iterations for s in it
                          if isinstance(s, GraphLaunch)]
        if not captured_times:
            raise GrapeError(f"expected graph launches in the captured program "
                             f"{captured.name!r}, found none")
    out = program.with_iterations([])
    seen: dict[str, list[int]] = {}
    slowed: dict[int, float] = {}  # iteration -> how much sharing the SMs slowed its branches
    for i, steps in enumerate(program.iterations):
        launches = [s for s in steps if isinstance(s, Launch)]
        graphed = any(isinstance(s, GraphLaunch) for s in steps)
        if graphed and launches:
            raise GrapeError(f"expected iteration {i} to be all eager or all graphed, found "
                             f"both (graph a region of its eager launches instead)")
        if not launches:  # already graphed, or nothing to launch: as it is
            out.iterations.append(steps)
            continue
        gpu, nodes, streams = _graph_gpu_time(steps, costs.graph_node_overhead, branches)
        if branches == "shared" and not captured_times and len(streams) > 1:
            apart, _, _ = _graph_gpu_time(steps, costs.graph_node_overhead, "overlapped")
            if gpu > apart * 1.001:
                slowed[i] = gpu / apart - 1
        if captured_times:
            gpu = captured_times[i % len(captured_times)]
        elif len(streams) > 1 and not any(isinstance(s, StreamWait) for s in steps):
            out.approximations.append(f"iteration {i}: work on {len(streams)} streams priced as "
                                      f"the GPU time it took together when recorded (the trace "
                                      f"holds no stream waits to say which work could overlap "
                                      f"more)")
        for blocker in capture_blockers(steps):
            seen.setdefault(blocker, []).append(i)
        stream = min(streams) if streams else 0
        syncs = tuple(s for s in steps if isinstance(s, Sync))
        launch = GraphLaunch(cost=costs.graph_launch_fixed + costs.graph_launch_per_node * nodes,
                             nodes=nodes, gpu_time=gpu, stream=stream)
        out.iterations.append((launch, *syncs))
    out.blockers.extend(f"{blocker}, in iteration{'s' if len(at) > 1 else ''} "
                        f"{_ranges(at)}" for blocker, at in seen.items())
    if slowed:
        low, high = (f"{100 * f(slowed.values()):.0f}" for f in (min, max))
        out.approximations.append(
            f"iteration{'s' if len(slowed) > 1 else ''} {_ranges(list(slowed))}: branches on "
            f"several streams priced as they share the GPU's SMs where they overlap, "
            f"{low if low == high else f'{low}-{high}'}% slower than "
            f"side by side at their alone speed (grape.sim.sharing; memory bandwidth and "
            f"blocks sharing an SM are not modelled)")
    return out


def _ranges(indices: list[int]) -> str:
    """0, 1, 2, 5 -> '0-2, 5'."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def loop_on_device(program: Program, costs: Costs) -> Program:
    """All iterations as one WHILE node: one launch, one sync, no host decision per iteration.

    What predication buys a loop whose every iteration ends in a host sync ("has every sequence
    emitted EOS?"): the iterations' graph launches and syncs become a single graph whose GPU
    time is theirs plus the WHILE node's cost per iteration.
    """
    graphs = [s for it in program.iterations for s in it if isinstance(s, GraphLaunch)]
    if len(graphs) != len(program.iterations):
        raise GrapeError(f"expected one graph launch per iteration (graph the program first), "
                         f"found {len(graphs)} in {len(program.iterations)} iterations")
    n = len(graphs)
    loop = GraphLaunch(cost=graphs[0].cost, nodes=graphs[0].nodes,
                       gpu_time=sum(g.gpu_time for g in graphs) + n * costs.while_per_iteration,
                       stream=graphs[0].stream)
    return Program(f"{program.name} (device loop)", [(loop, Sync("cudaStreamSynchronize", 0.0))],
                   list(program.approximations))


def update_per_shape(program: Program, costs: Costs, changed_nodes: float) -> Program:
    """One executable shared by every shape, brought to each step's shape before its launch.

    Each graph launch is preceded by ``changed_nodes`` per-node parameter updates on the host
    (``cuGraphExecKernelNodeSetParams``), the price of not keeping one executable per shape.
    """
    if not 0 <= changed_nodes < math.inf:
        raise GrapeError(f"expected a finite, non-negative number of changed nodes, found "
                         f"{changed_nodes}")
    update = HostWork(changed_nodes * costs.set_params)
    return program.with_iterations([tuple(x for s in it for x in (
        (update, s) if isinstance(s, GraphLaunch) else (s,))) for it in program.iterations])


def copy_into_placeholders(program: Program, costs: Costs, nbytes: float) -> Program:
    """Each graph launch preceded by copying ``nbytes`` of fresh inputs into the tensors the
    graph was captured on: what a plain capture's static inputs cost per launch (and a growing
    KV cache copied into a fixed one costs per token), which grape's capture in place avoids.

    One device-to-device copy per launch, on the graph's stream, issued from PyTorch (the
    profile's launch cost) and priced at the profile's copy latency and bandwidth (bytes read
    plus written: each byte copied counts twice). The bandwidth governs large copies; the
    latency was fitted on copies timed by CUDA events, which count the events' own cost, so
    small copies come out dear (6.7 us on the H200 where CUPTI timed a 64-byte copy at 0.86).
    """
    if not 0 <= nbytes < math.inf:
        raise GrapeError(f"expected a finite, non-negative number of bytes to copy, found "
                         f"{nbytes}")
    dur = costs.copy_latency + 2 * nbytes / (costs.copy_bandwidth * 1e3)  # GB/s = 1e3 B/us

    def copy(graph: GraphLaunch) -> Launch:
        return Launch("cudaMemcpyAsync", costs.copy_call,
                      (GpuWork("memcpy", f"placeholder copy ({nbytes:.0f} B)", dur,
                               graph.stream),))
    return program.with_iterations([tuple(x for s in it for x in (
        (copy(s), s) if isinstance(s, GraphLaunch) else (s,))) for it in program.iterations])


def update_whole_graph(program: Program, costs: Costs) -> Program:
    """One executable shared by every shape, brought to each step's shape by one
    ``cuGraphExecUpdate`` from the shape's graph before its launch (priced per node of the
    graph, changed or not)."""
    return program.with_iterations([tuple(x for s in it for x in (
        (HostWork(s.nodes * costs.exec_update_per_node), s) if isinstance(s, GraphLaunch)
        else (s,))) for it in program.iterations])


def graph_region(program: Program, costs: Costs, first: int, last: int) -> Program:
    """Launches ``first`` to ``last`` (inclusive, counted from 0 in each iteration) captured as
    one graph; the host work between them goes, the rest of the iteration stays eager."""
    out = program.with_iterations([])
    for i, steps in enumerate(program.iterations):
        index = [j for j, s in enumerate(steps) if isinstance(s, Launch)]
        if not index:
            raise GrapeError(f"expected eager launches to graph in iteration {i}, found none")
        if not 0 <= first <= last < len(index):
            raise GrapeError(f"expected a region of launches within 0..{len(index) - 1} in "
                             f"iteration {i}, found {first}..{last}")
        lo, hi = index[first], index[last]
        if any(isinstance(s, Sync) for s in steps[lo:hi + 1]):
            raise GrapeError(f"expected no sync inside the region to graph, found one in "
                             f"iteration {i} (a host sync cannot be captured)")
        gpu, nodes, streams = _graph_gpu_time(steps[lo:hi + 1], costs.graph_node_overhead)
        launch = GraphLaunch(cost=costs.graph_launch_fixed + costs.graph_launch_per_node * nodes,
                             nodes=nodes, gpu_time=gpu, stream=min(streams) if streams else 0)
        out.iterations.append((*steps[:lo], launch, *steps[hi + 1:]))
    return out


@dataclass(frozen=True)
class WhatIf:
    """A chain of what-ifs over a trace's program, as ``grape simulate``'s options name them;
    :func:`apply` runs it. Unset fields leave the program as recorded."""

    node_overhead: float | None = None  # us of GPU time per graph node, every graph re-priced
    host_scale: float | None = None  # every host cost times this
    launch_cost: float | None = None  # us of host time per eager launch
    graph_region: tuple[int, int] | None = None  # launches A..B of each iteration as a graph
    graph: bool = False  # each iteration captured as one graph
    placeholder_copies: float | None = None  # bytes copied into placeholders per graph launch
    update_nodes: float | None = None  # nodes updated before each graph launch (a family)
    update_whole: bool = False  # one cuGraphExecUpdate before each graph launch
    device_loop: bool = False  # every iteration inside one WHILE node


@dataclass
class Applied:
    program: Program
    costs: Costs  # the costs the what-if runs with (the node overhead may differ)
    labels: list[str] = field(default_factory=list)  # what was changed, for people
    looped: int = 1  # iterations one simulated iteration stands for (a device loop's)


def apply(trace: Trace, profile: DeviceProfile, what: WhatIf) -> Applied:
    """``trace``'s unprofiled program changed as ``what`` says, in a fixed order: re-priced
    graphs, host scale and launch cost, graphing (a region, or whole iterations), copies and
    updates in front of graph launches, and the device loop last.

    Raises
    ------
    GrapeError
        A what-if that does not apply (updates or copies without graph launches, both ways of
        updating, a region outside the iterations' launches).
    """
    costs = costs_from_profile(profile)
    program, labels = unprofiled_program(trace, profile), []
    if what.node_overhead is not None:  # every graph priced again, the trace's and new ones
        costs = costs_from_profile(profile, graph_node_overhead=what.node_overhead)
        program = unprofiled_program(trace, profile, costs)
        labels.append(f"{what.node_overhead:g} us per graph node")
    if what.host_scale is not None:
        program = scale_host(program, what.host_scale)
        labels.append(f"host x{what.host_scale:g}")
    if what.launch_cost is not None:
        program = set_launch_cost(program, what.launch_cost)
        labels.append(f"launch {what.launch_cost:g} us")
    if what.graph_region is not None:
        first, last = what.graph_region
        program = graph_region(program, costs, first, last)
        labels.append(f"launches {first} to {last} graphed")
    if what.graph:
        program = graph_iterations(program, costs)
        labels.append("graphed")
    if what.update_nodes is not None and what.update_whole:
        raise GrapeError("expected one way of updating per shape, found both --update-nodes "
                         "and --update-whole")
    has_graphs = any(isinstance(s, GraphLaunch) for s in program.steps())
    if (what.update_nodes is not None or what.update_whole) and not has_graphs:
        raise GrapeError("expected graph launches to update per shape (a graphed trace, or "
                         "--graph), found none")
    if what.placeholder_copies is not None:
        if not has_graphs:
            raise GrapeError("expected graph launches to copy inputs in front of (a graphed "
                             "trace, or --graph), found none")
        program = copy_into_placeholders(program, costs, what.placeholder_copies)
        labels.append(f"{_size(what.placeholder_copies)} copied in per launch")
    if what.update_nodes is not None:
        program = update_per_shape(program, costs, what.update_nodes)
        labels.append(f"{what.update_nodes:g} nodes updated per launch")
    if what.update_whole:
        program = update_whole_graph(program, costs)
        labels.append("one whole-graph update per launch")
    looped = 1
    if what.device_loop:
        looped = len(program.iterations)
        program = loop_on_device(program, costs)
        labels.append("one device loop")
    return Applied(program, costs, labels, looped)


def _size(nbytes: float) -> str:
    """Bytes in the largest decimal unit that keeps the figure at 1 or more."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"
