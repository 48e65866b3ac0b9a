"""The discrete-event model: one host thread issuing a Program to a GPU's streams.

SimPy processes: the host walks the program's steps, paying their CPU cost; each stream is a
process that takes work from its queue in order and runs it. Launches wait in a
driver queue of bounded depth (the host stalls when it is full, as the driver does at about a
thousand pending launches); a kernel starts no sooner than the launch latency after its launch
and no sooner than the front end's gap after the stream's previous work; a stream told to wait
for another (an event between streams) runs nothing more until the other has finished the work
it had then; a sync waits for the device to drain.

Both kinds of process keep clocks of their own and run ahead of SimPy's where nothing else can
look, paying an event only where another process's next move depends on theirs: what makes a
million launches a couple of seconds (``benchmarks/sim_speed.py``).
"""

from __future__ import annotations

import math
import statistics
from array import array
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, NamedTuple

import simpy

from grape.errors import GrapeError
from grape.program import GpuWork, GraphLaunch, HostWork, Launch, Program, StreamWait, Sync
from grape.records import GpuRecord, HostCall, union_length

__all__ = ["Costs", "Interval", "SimResult", "simulate", "simulate_ranks"]


@dataclass(frozen=True)
class Costs:
    """Device constants, in microseconds (see ``grape.profile`` for where they come from)."""

    launch_latency: float = 5.0  # from a launch call's return to its kernel's earliest start
    kernel_gap: float = 0.54  # front end's gap between consecutive work on a stream
    graph_node_overhead: float = 0.35  # GPU time a graph adds per node beyond its kernels
    graph_launch_fixed: float = 4.0  # host cost of cuGraphLaunch
    graph_launch_per_node: float = 0.002
    while_per_iteration: float = 3.0  # GPU time a WHILE node adds per iteration
    set_params: float = 1.0  # host cost of updating one node of an executable
    exec_update_per_node: float = 0.05  # host cost of cuGraphExecUpdate, per node of the graph
    # A family's device switch (grape.cuda.switch): the host's launch of the switch kernel, and
    # its GPU time per node it updates. Not in device profiles yet: from one H200 run (GPT-2
    # small over KV 1..255, 83.6 nodes a step: the switch kernels alone 30.6 us a step by CUDA
    # events, back to back, the ways measured in turns; benchmarks/README.md, runs 16 and 17;
    # run 15's 92 us a step compared against per-shape graphs' first pass).
    switch_launch: float = 4.0
    switch_per_node: float = 0.366
    copy_call: float = 9.0  # host cost of issuing one device-to-device copy from PyTorch
    copy_latency: float = 6.7  # GPU time of a device-to-device copy of nothing
    copy_bandwidth: float = 4250.0  # GB/s of a device-to-device copy, bytes read plus written
    # A copy (memset) node inside a graph, its dispatch included: latency + bytes x per byte.
    # None where the profile has not measured it: a graph's copies then cost what the trace
    # timed them at (CUPTI's duration of the copy alone, its dispatch added by the schedule).
    graph_copy_latency: float | None = None
    graph_copy_us_per_byte: float = 0.0
    graph_memset_latency: float | None = None
    graph_memset_us_per_byte: float = 0.0
    queue_depth: int = 1024  # pending launches before the host stalls
    # The gap torch.profiler shows between a graph's consecutive kernels where the graph adds
    # nothing per node: a recording's median gap beyond it is what its machine added per node
    # (grape.records.graph_kernel_gap, node_gap). None: recordings' gaps are not read.
    profiler_graph_gap: float | None = None

    def node_gap(self, traced: float | None) -> float | None:
        """The GPU time a graph added per node beyond its kernels on the machine that recorded
        a median gap of ``traced`` (us) between them, or None where either is unknown."""
        if traced is None or self.profiler_graph_gap is None:
            return None
        return max(traced - self.profiler_graph_gap, 0.0)

    def __post_init__(self) -> None:
        # Written so that NaN fails too (every comparison with NaN is false).
        for name in ("launch_latency", "kernel_gap", "graph_node_overhead", "graph_launch_fixed",
                     "graph_launch_per_node", "while_per_iteration", "set_params",
                     "exec_update_per_node", "switch_launch", "switch_per_node", "copy_call",
                     "copy_latency",
                     "graph_copy_us_per_byte", "graph_memset_us_per_byte"):
            if not 0 <= getattr(self, name) < math.inf:
                raise GrapeError(f"expected a finite, non-negative {name}, found "
                                 f"{getattr(self, name)}")
        if not 0 < self.copy_bandwidth < math.inf:
            raise GrapeError(f"expected a finite, positive copy_bandwidth, found "
                             f"{self.copy_bandwidth}")
        for name in ("graph_copy_latency", "graph_memset_latency", "profiler_graph_gap"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:
                raise GrapeError(f"expected a finite, non-negative {name} or None, found "
                                 f"{value}")
        if self.queue_depth < 1:
            raise GrapeError(f"expected a queue depth of at least 1, found {self.queue_depth}")


@dataclass(frozen=True)
class Interval:
    """Something the simulated GPU or host did, for timelines."""

    track: str  # "host" or "stream N"
    name: str
    start: float
    end: float


@dataclass
class SimResult:
    iteration_times: list[float]  # host time of each iteration, us
    gpu_busy: float  # us during which some stream ran work
    end: float
    intervals: list[Interval] = field(default_factory=list)  # only when asked for
    host_stall: float = 0.0  # us the host waited for a full launch queue
    synchronised: bool = True  # every iteration waits for the GPU before the next begins
    # Only when asked to record: the run as a trace would hold it (grape.sim.tracing).
    calls: list[HostCall] = field(default_factory=list)  # API calls, with correlation ids
    gpu_ops: list[GpuRecord] = field(default_factory=list)  # a graph's kernels laid out inside it
    windows: list[tuple[float, float]] = field(default_factory=list)  # each iteration's

    @property
    def per_iteration(self) -> float:
        """Time per iteration: the median iteration where each ends in a sync; otherwise the
        host runs ahead of the GPU and the run's length over its iterations is what counts."""
        if not self.iteration_times:
            return 0.0
        if self.synchronised:
            return statistics.median(self.iteration_times)
        return self.end / len(self.iteration_times)

    @property
    def gpu_busy_fraction(self) -> float:
        return self.gpu_busy / self.end if self.end else 0.0


class _Stream:
    """A stream's queue of work: a deque, and an event only while the stream sits idle.

    A :class:`simpy.Store` would cost a put and a get event per kernel; like SimPy's own
    resources, this wakes the consumer only when it is waiting, and the consumer runs ahead of
    the simulation where no other process can look (``_Machine._run_stream``), so a busy stream
    costs an event per stretch between other processes' events, not one per kernel.
    """

    __slots__ = ("finished", "items", "spans", "submitted", "waiters", "wake")

    def __init__(self) -> None:
        self.items: deque[_Item] = deque()
        # When it ran work: start, end, start, end... in time order, never overlapping (a
        # stream runs one item at a time). Floats in an array, not a tuple per kernel: a
        # million tuples would keep the garbage collector scanning them.
        self.spans = array("d")
        self.wake: simpy.Event | None = None
        self.submitted = 0  # work items queued, ever
        self.finished = 0  # work items run to the end, ever
        self.waiters: list[tuple[int, simpy.Event]] = []  # other streams: (finished count, event)

    def wake_waiters(self) -> None:
        """Wake the streams waiting for no more items than have finished."""
        still = []
        for count, event in self.waiters:
            if self.finished >= count:
                event.succeed()
            else:
                still.append((count, event))
        self.waiters = still

    def put(self, item: _Item) -> None:
        self.items.append(item)
        if self.wake is not None:
            self.wake.succeed()
            self.wake = None


class _Item(NamedTuple):
    name: str
    dur: float
    ready: float  # earliest start: launch latency after the launch call returned
    # A wait instead of work: run nothing more until this stream has finished this many items.
    after: tuple[_Stream, int] | None = None
    # For recording only: the launch call it came from, and a graph's kernels.
    kind: str = "kernel"
    correlation: int = 0
    work: tuple[GpuWork, ...] = ()


# One item per launch is built on the hot path: tuple.__new__ with every field is a C call,
# where the NamedTuple's own constructor (keywords, defaults) runs Python, a third of a launch.
_new_item = tuple.__new__


class _Rendezvous:
    """Collectives across ranks: the n-th collective a rank's GPU starts meets the n-th of
    every other rank; all leave together once the last has arrived."""

    def __init__(self, env: simpy.Environment, ranks: int) -> None:
        self.env, self.ranks = env, ranks
        self.arrived: dict[int, list[int]] = {}  # collective index -> ranks arrived
        self.all_in: dict[int, simpy.Event] = {}
        self.names: dict[int, str] = {}

    def arrive(self, index: int, rank: int, name: str) -> simpy.Event:
        expected = self.names.setdefault(index, name)
        if expected != name:
            raise GrapeError(f"expected collective {index} to be {expected!r} on every rank, "
                             f"found {name!r} on rank {rank}")
        event = self.all_in.setdefault(index, self.env.event())
        arrived = self.arrived.setdefault(index, [])
        arrived.append(rank)
        if len(arrived) == self.ranks:
            event.succeed()
        return event


class _Machine:
    def __init__(self, env: simpy.Environment, costs: Costs, timeline: bool,
                 rank: int = 0, rendezvous: _Rendezvous | None = None) -> None:
        self.env = env
        self.costs = costs
        self.latency = costs.launch_latency
        self.streams: dict[int, _Stream] = {}
        self.pending = 0  # launches queued and not yet started
        self.slot: simpy.Event | None = None  # fires when a full queue frees a slot
        self.outstanding = 0  # work not yet finished, for syncs
        self.drained: simpy.Event | None = None
        self.timeline: list[Interval] | None = [] if timeline else None
        self.stall = 0.0
        self.ops: list[GpuRecord] | None = None  # set when recording
        self.correlation = 0
        self.rank, self.rendezvous = rank, rendezvous
        self.collectives = 0  # started on this rank's GPU so far
        self.unsynced = 0  # iterations the host ran without a sync (counted by _host)

    def stream(self, sid: int) -> _Stream:
        stream = self.streams.get(sid)
        if stream is None:
            stream = self.streams[sid] = _Stream()
            self.env.process(self._run_stream(sid, stream))
        return stream

    def _run_stream(self, sid: int, stream: _Stream) -> Generator[Any, Any, None]:
        """The hot loop of every simulation: one pass per kernel.

        The stream keeps its own clock, ``t``, and runs its queue ahead of the simulation's
        without an event per kernel while nothing else can look: every other process sleeps
        until the next scheduled event (``env.peek()``), and their state is what it was at
        ``env.now``, so work this stream takes and finishes before that moment is invisible
        until then, and finishing it now changes nothing another process sees. The stream
        catches the simulation up to its clock (one timeout) before anything another process
        can see at once: waking the host (a freed queue slot, a drained device), waking a
        stream waiting on this one, waiting itself, or a kernel that ends at or after the next
        event. A GPU-bound run then costs an event per stretch between other processes'
        events, not one per kernel; the times are the same as one event per kernel gives.
        """
        env, gap, free = self.env, self.costs.kernel_gap, float("-inf")
        items, timeout, peek = stream.items, env.timeout, env.peek
        spans, timeline, recording = stream.spans, self.timeline, self.ops is not None
        rendezvous = self.rendezvous
        t = env.now
        # The next event of another process. Only a running process schedules events, and
        # this one schedules none while it runs ahead, so it is read again after each yield.
        horizon = peek()
        while True:
            if not items:
                if t > env.now:
                    yield timeout(t - env.now)
                stream.wake = env.event()
                yield stream.wake
                t, horizon = env.now, peek()
            item = items.popleft()
            name, dur, ready, after, kind, _, _ = item  # one unpacking, not five lookups
            if after is not None:  # a wait for another stream, not a launch
                other, count = after
                if other.finished < count:
                    if t > env.now:
                        yield timeout(t - env.now)
                    event = env.event()
                    other.waiters.append((count, event))
                    yield event
                    t, horizon = env.now, peek()
                continue
            # The front end has taken the launch from the driver's queue: its slot is free.
            self.pending -= 1
            if self.slot is not None:  # the host waits for it
                if t > env.now:
                    yield timeout(t - env.now)
                self.slot.succeed()
                self.slot, horizon = None, env.now  # the host runs next, at this time
            start = ready
            if free + gap > start:
                start = free + gap
            if t > start:
                start = t
            if rendezvous is not None and kind == "collective":
                # A collective's kernel starts, then waits (spinning, busy) for every rank's.
                yield timeout(start - env.now)
                self.collectives += 1
                yield rendezvous.arrive(self.collectives, self.rank, name)
                yield timeout(dur)
                t, horizon = env.now, peek()
            else:
                t = start + dur
                if t >= horizon:  # another process wakes first: end the kernel as an event
                    yield timeout(t - env.now)
                    horizon = peek()
            free = t
            stream.finished += 1
            if stream.waiters:  # another stream waits for this one's work
                if t > env.now:
                    yield timeout(t - env.now)
                stream.wake_waiters()
                horizon = env.now  # a woken stream runs next, at this time
            spans.append(start)
            spans.append(free)
            if timeline is not None:
                timeline.append(Interval(f"stream {sid}", name, start, free))
            if recording:
                self.ops.extend(_recorded(item, sid, start, free))
            self.outstanding -= 1
            if self.outstanding == 0 and self.drained is not None:
                if t > env.now:
                    yield timeout(t - env.now)
                self.drained.succeed()
                self.drained, horizon = None, env.now  # the host runs next, at this time

    def busy(self) -> tuple[float, float]:
        """How long some stream ran work, and when the last work ended."""
        runs = [s.spans for s in self.streams.values() if s.spans]
        if not runs:
            return 0.0, 0.0
        end = max(spans[-1] for spans in runs)
        if len(runs) == 1:  # one stream's spans never overlap: add them up, in order
            spans = runs[0]
            return sum(e - s for s, e in zip(spans[0::2], spans[1::2], strict=True)), end
        return union_length(pair for r in runs
                            for pair in zip(r[0::2], r[1::2], strict=True)), end

    def wait_for_slot(self) -> Generator[Any, Any, None]:
        while self.pending >= self.costs.queue_depth:  # the driver's queue is full: stall
            if self.slot is None:
                self.slot = self.env.event()
            t = self.env.now
            yield self.slot
            self.stall += self.env.now - t

    def submit(self, sid: int, name: str, dur: float, at: float, kind: str = "kernel",
               work: tuple[GpuWork, ...] = ()) -> None:
        """Queue work issued at host time ``at`` (no earlier than now) on a stream (the caller
        has waited for a free slot)."""
        self.pending += 1
        self.outstanding += 1
        stream = self.streams.get(sid) or self.stream(sid)
        stream.submitted += 1
        stream.items.append(_new_item(_Item, (name, dur, at + self.latency, None, kind,
                                              self.correlation, work)))
        if stream.wake is not None:  # the stream sits idle: wake it
            stream.wake.succeed()
            stream.wake = None

    def submit_all(self, run: _Run, at: float) -> None:
        """Queue a straight run of kernel launches (``_straight``), issued from host time
        ``at`` on, all before any stream runs (the caller has checked that the queue holds
        them all): each stream's items made by one ``map`` over the run's columns."""
        base = at + self.latency
        for sid, (names, durs, offsets, kinds) in run.by_stream.items():
            stream = self.streams.get(sid) or self.stream(sid)
            stream.submitted += len(names)
            stream.items.extend(map(_new_item, repeat(_Item), zip(
                names, durs, [base + o for o in offsets], repeat(None), kinds,
                repeat(self.correlation), repeat(()))))
            if stream.wake is not None:  # the stream sits idle: wake it
                stream.wake.succeed()
                stream.wake = None
        self.pending += run.launches
        self.outstanding += run.launches

    def wait(self, sid: int, on: int) -> None:
        """Stream ``sid`` waits for the work queued on ``on`` so far (no driver slot: an event
        wait is not a launch)."""
        other = self.stream(on)
        self.stream(sid).put(_Item("wait", 0.0, 0.0, (other, other.submitted)))

    def drain(self) -> Generator[Any, Any, None]:
        if self.outstanding:
            if self.drained is None:
                self.drained = self.env.event()
            yield self.drained


def _recorded(item: _Item, sid: int, start: float, end: float) -> list[GpuRecord]:
    """What a trace would show of a finished item: itself, or a graph's kernels laid out in
    order over the graph's time, the time they leave spread evenly between them."""
    if not item.work:
        return [GpuRecord(item.kind, item.name, start, end - start, sid, item.correlation)]
    busy = sum(w.dur for w in item.work)
    scale = min(1.0, (end - start) / busy) if busy else 1.0
    gap = max(end - start - busy, 0.0) / len(item.work)
    ops, t = [], start
    for w in item.work:
        ops.append(GpuRecord(w.kind, w.name, t + gap, w.dur * scale, sid, item.correlation))
        t += gap + w.dur * scale
    return ops


class _Run(NamedTuple):
    """An iteration's opening run of host work and kernel launches (``_straight``)."""

    by_stream: dict[int, tuple[list[str], list[float], list[float], list[str]]]  # columns:
    # each launch's name, duration, host time issued (from the run's start), kind
    launches: int
    took: float  # host time the run takes
    steps: int  # steps of the iteration it spans


def _straight(steps: tuple) -> _Run:
    """The longest opening run of ``steps`` that is host work and kernel launches only. A
    program repeats one iteration's tuple many times, so this is worked out once per distinct
    tuple, and the host queues such a run in one go (``_Machine.submit_all``) wherever the
    launch queue cannot fill during it."""
    by_stream: dict[int, tuple[list[str], list[float], list[float], list[str]]] = {}
    t, count, launches = 0.0, 0, 0
    for step in steps:
        kind = type(step)
        if kind is HostWork:
            t += step.dur
        elif kind is Launch:
            t += step.cost
            for w in step.work:
                names, durs, offsets, kinds = by_stream.setdefault(w.stream, ([], [], [], []))
                names.append(w.name)
                durs.append(w.dur)
                offsets.append(t)
                kinds.append(w.kind)
                launches += 1
        else:
            break
        count += 1
    return _Run(by_stream, launches, t, count)


def _host(m: _Machine, program: Program, times: list[float],
          calls: list[HostCall] | None, windows: list[tuple[float, float]]
          ) -> Generator[Any, Any, None]:
    """The host thread. It keeps its own clock and runs ahead of the simulation's, waiting
    (an event) only where the GPU's state decides what it does next: a full launch queue, a
    sync, the program's end. Nothing it issues can start before the time it is issued (launch
    latency comes after), so a stream handed work early still runs it when it would have; and
    the launches pending at the simulation's time bound those pending at the host's from above
    (a stream only takes work off the queue), so a queue that looks short enough is. That
    makes a launch cost no event of its own, where a timeout each used to be a third of a
    host-bound run's events. Where the queue holds an iteration's whole opening run of host
    work and launches, that run is queued in one go (``_straight``): no stall can happen
    inside it, and building its items a column at a time made a host-bound run 1.7x faster."""
    env, timeline, depth = m.env, m.timeline, m.costs.queue_depth
    clock = env.now

    def call(name: str, start: float, end: float) -> None:  # only when recording
        m.correlation += 1  # ties the call to the work it queues, as CUPTI's ids do
        calls.append(HostCall(name, "runtime", start, end - start, 1, m.correlation))

    submit = m.submit
    # Straight runs, per distinct iteration tuple, keyed by id (hashing a long tuple costs a
    # pass over it) and holding the tuple, so that no id is another's while the run lasts;
    # only without a timeline or recording, which want every step's own interval and call.
    straight: dict[int, tuple[tuple, _Run]] | None = (
        {} if timeline is None and calls is None else None)
    for steps in program.iterations:
        began, synced, rest = clock, False, steps
        if straight is not None:
            held = straight.get(id(steps))
            if held is None:
                held = straight[id(steps)] = (steps, _straight(steps))
            run = held[1]
            if run.steps and m.pending + run.launches <= depth:  # the queue holds them all
                m.submit_all(run, clock)
                clock += run.took
                rest = steps[run.steps:]  # the rest step by step (a sync, most often)
        for step in rest:
            t = clock
            kind = type(step)  # exact types: Program's steps are final dataclasses
            if kind is HostWork:
                clock += step.dur
            elif kind is Launch or kind is GraphLaunch:
                graph = kind is GraphLaunch
                if calls is not None:
                    call("cudaGraphLaunch" if graph else step.api, clock, clock + step.cost)
                clock += step.cost
                for w in (step,) if graph else step.work:
                    if m.pending >= depth:  # perhaps full: look at the host's own time
                        if clock > env.now:
                            yield env.timeout(clock - env.now)
                        if m.pending >= depth:
                            yield from m.wait_for_slot()
                            clock = env.now
                    if graph:
                        submit(step.stream, f"graph ({step.nodes} nodes)", step.gpu_time,
                               clock, work=step.work if calls is not None else ())
                    else:
                        submit(w.stream, w.name, w.dur, clock, w.kind)
            elif kind is StreamWait:
                m.wait(step.stream, step.on)
            elif kind is Sync:
                synced = True
                if clock > env.now:
                    yield env.timeout(clock - env.now)
                at = env.now
                yield from m.drain()
                yield env.timeout(step.cost)
                clock = env.now
                if calls is not None:
                    calls.append(HostCall(step.api, "runtime", at, env.now - at, 1))
            else:
                raise GrapeError(f"expected a program step (HostWork, Launch, GraphLaunch, "
                                 f"StreamWait or Sync), found {kind.__name__}")
            if timeline is not None and clock > t:
                timeline.append(Interval("host", kind.__name__, t, clock))
        times.append(clock - began)
        windows.append((began, clock))
        m.unsynced += not synced
    if clock > env.now:  # the run ends no sooner than its host
        yield env.timeout(clock - env.now)


def simulate_ranks(programs: list[Program], costs: Costs | None = None,
                   timeline: bool = False) -> list[SimResult]:
    """Several ranks' programs run together, each rank a host and a GPU of its own, their
    collectives (``GpuWork`` of kind ``"collective"``) meeting in issue order: the n-th
    collective of every rank finishes ``dur`` after the last rank's has started.

    Raises
    ------
    GrapeError
        Ranks whose n-th collectives differ by name, or that run different numbers of them
        (a rank would wait forever).
    """
    if not programs:
        raise GrapeError("expected a program per rank, found none")
    env = simpy.Environment()
    rendezvous = _Rendezvous(env, len(programs))
    runs = []
    for rank, program in enumerate(programs):
        m = _Machine(env, costs or Costs(), timeline, rank, rendezvous)
        times: list[float] = []
        windows: list[tuple[float, float]] = []
        env.process(_host(m, program, times, None, windows))
        runs.append((m, times, program))
    env.run()
    if stuck := sorted(i for i, ranks in rendezvous.arrived.items()
                       if len(ranks) < len(programs)):
        raise GrapeError(f"expected every rank to reach each collective, found collective "
                         f"{stuck[0]} ({rendezvous.names[stuck[0]]!r}) reached by ranks "
                         f"{rendezvous.arrived[stuck[0]]} alone")
    results = []
    for m, times, _ in runs:
        synced = m.unsynced == 0
        busy, end = m.busy()
        results.append(SimResult(times, busy, max(end, sum(times)),
                                 m.timeline or [], m.stall, synced))
    return results


def simulate(program: Program, costs: Costs | None = None, timeline: bool = False,
             record: bool = False) -> SimResult:
    """Run ``program``; with ``timeline``, keep every host step and GPU interval; with
    ``record``, every API call and GPU operation as a trace holds them
    (``grape.sim.tracing.write_simulated_trace`` writes them out)."""
    env = simpy.Environment()
    m = _Machine(env, costs or Costs(), timeline)
    times: list[float] = []
    windows: list[tuple[float, float]] = []
    calls: list[HostCall] | None = [] if record else None
    if record:
        m.ops = []
    env.process(_host(m, program, times, calls, windows))
    env.run()
    synced = m.unsynced == 0
    return SimResult(times, m.busy()[0], env.now, m.timeline or [], m.stall, synced,
                     calls or [], m.ops or [], windows)
