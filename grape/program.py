"""Programs: what a workload does over time, as the host issues it.

A :class:`Program` is a list of iterations; an iteration is a sequence of host steps: CPU work
between API calls (:class:`HostWork`), eager launches with the GPU work they cause
(:class:`Launch`), graph launches (:class:`GraphLaunch`) and synchronisations (:class:`Sync`).
Both backends take Programs; :func:`program_from_trace` makes one from a recorded trace.

Examples
--------
>>> from grape.trace import read_trace
>>> p = program_from_trace(read_trace("traces/h200/gpt2_small_decode_b1_kv32.graph.json.gz"))
>>> [type(s).__name__ for s in p.iterations[0] if not isinstance(s, HostWork)]
['GraphLaunch', 'Sync']
>>> [s.nodes for s in p.iterations[0] if isinstance(s, GraphLaunch)]
[290]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grape.records import GpuOp, Iteration, span, union_length
from grape.trace import Trace

__all__ = [
    "GpuWork",
    "GraphLaunch",
    "HostWork",
    "Launch",
    "ProfilerOverhead",
    "Program",
    "Step",
    "Sync",
    "program_from_trace",
]


@dataclass(frozen=True)
class GpuWork:
    """One kernel, copy or memset as the GPU runs it; ``dur`` in microseconds."""

    kind: str
    name: str
    dur: float
    stream: int


@dataclass(frozen=True)
class HostWork:
    """CPU time between API calls (framework code, Python)."""

    dur: float


@dataclass(frozen=True)
class Launch:
    """An eager launch: the host pays ``cost``, then ``work`` is queued on its stream."""

    api: str
    cost: float
    work: tuple[GpuWork, ...]


@dataclass(frozen=True)
class GraphLaunch:
    """A graph launch: ``nodes`` kernels that take ``gpu_time`` on the device as one unit.

    ``gpu_time`` is the graph's critical path on the GPU (kernels, gaps and whatever parallel
    branches overlap); ``work`` keeps the kernels for timelines. ``busy``, where a trace gave
    it, is the union of the kernels' intervals as CUPTI timed them: CUPTI stretches the gaps
    between a graph's kernels by an amount that varies between recordings, so the simulator
    prices the gaps with the device profile instead (``grape.sim.whatif``).
    """

    cost: float
    nodes: int
    gpu_time: float
    stream: int
    work: tuple[GpuWork, ...] = ()
    busy: float | None = None


@dataclass(frozen=True)
class Sync:
    """The host waits for the device (``stream`` None) or one stream to finish what it has."""

    api: str
    cost: float
    stream: int | None = None


Step = HostWork | Launch | GraphLaunch | Sync


@dataclass(frozen=True)
class ProfilerOverhead:
    """Host time torch.profiler adds per recorded operator and per CUDA API call (us)."""

    per_op: float = 0.0
    per_call: float = 0.0


@dataclass
class Program:
    name: str
    iterations: list[tuple[Step, ...]]
    approximations: list[str] = field(default_factory=list)  # what the model had to simplify

    def steps(self) -> list[Step]:
        return [s for it in self.iterations for s in it]

    def with_iterations(self, iterations: list[tuple[Step, ...]]) -> Program:
        """The same program (name, approximations so far) doing ``iterations`` instead."""
        return Program(self.name, iterations, list(self.approximations))


def _work(ops: tuple[GpuOp, ...]) -> tuple[GpuWork, ...]:
    return tuple(GpuWork(op.kind, op.name, op.dur, op.stream)
                 for op in sorted(ops, key=lambda o: o.ts))


def _iteration(it: Iteration, ops_ts: list[float], overhead: ProfilerOverhead,
               tid: int) -> tuple[Step, ...]:
    launches = {launch.call.correlation: launch for launch in it.launches}
    steps: list[Step] = []
    cursor = it.start
    for call in sorted((c for c in it.calls if c.tid == tid), key=lambda c: c.ts):
        if call.ts < cursor:  # nested inside a call already counted (driver under runtime)
            continue
        ops_in_gap = sum(1 for ts in ops_ts if cursor <= ts < call.ts)
        gap = call.ts - cursor - overhead.per_op * ops_in_gap
        if gap > 0:
            steps.append(HostWork(gap))
        cost = max(call.dur - overhead.per_call, 0.0)
        launch = launches.get(call.correlation)
        if launch is not None and launch.is_graph:
            kernels = tuple(op for op in launch.ops if op.kind == "kernel")
            streams = {op.stream for op in launch.ops}
            # Under the profiler a graph launch call lasts as long as CUPTI takes to instrument
            # its nodes; the unprofiled cost is the device profile's (set by the caller).
            steps.append(GraphLaunch(cost=cost, nodes=len(kernels), gpu_time=span(launch.ops),
                                     stream=min(streams), work=_work(launch.ops),
                                     busy=union_length([(op.ts, op.end) for op in launch.ops])))
        elif launch is not None:
            steps.append(Launch(call.name, cost, _work(launch.ops)))
        elif call.is_sync:
            steps.append(Sync(call.name, 0.0))
        else:
            steps.append(HostWork(cost))
        cursor = call.end
    tail = it.end - cursor - overhead.per_op * sum(1 for ts in ops_ts if cursor <= ts < it.end)
    if tail > 0:
        steps.append(HostWork(tail))
    return tuple(steps)


def program_from_trace(trace: Trace, overhead: ProfilerOverhead | None = None) -> Program:
    """The host's steps in each iteration of ``trace``.

    Host gaps and call costs are the trace's, less ``overhead`` per operator and API call the
    profiler recorded in them; a sync's own cost is taken as nothing (its duration in the trace
    is waiting, which the simulator reproduces). Work on threads other than the one that issued
    most launches is left out and listed in ``approximations``.
    """
    overhead = overhead or ProfilerOverhead()
    tids = [launch.call.tid for launch in trace.launches]
    tid = max(set(tids), key=tids.count)
    ops_ts = sorted(op.ts for op in trace.ops if op.tid == tid)
    program = Program(trace.workload, [_iteration(it, ops_ts, overhead, tid)
                                       for it in trace.iterations])
    for category, count in sorted(trace.unknown.items()):
        program.approximations.append(f"{count} trace events of category {category!r} are not "
                                      f"modelled: their time counts as host work")
    if trace.orphans:
        program.approximations.append(f"{len(trace.orphans)} GPU operations with no host call "
                                      f"in the trace are left out")
    others = {c.tid for it in trace.iterations for c in it.calls} - {tid}
    if others:
        program.approximations.append(f"API calls on threads {sorted(others)} left out; only "
                                      f"the issuing thread {tid} is simulated")
    return program
