"""Programs: what a workload does over time, as the host issues it.

A :class:`Program` is a list of iterations; an iteration is a sequence of host steps: CPU work
between API calls (:class:`HostWork`), eager launches with the GPU work they cause
(:class:`Launch`), graph launches (:class:`GraphLaunch`), synchronisations (:class:`Sync`) and
one stream's wait for another's work (:class:`StreamWait`).
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

from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field

from grape.ir import KernelGraph
from grape.records import (
    GpuRecord,
    Iteration,
    WaitRecord,
    alone_times,
    exposed_kernels,
    sm_share,
    span,
    union_length,
)
from grape.trace import Trace

__all__ = [
    "GpuWork",
    "GraphLaunch",
    "HostWork",
    "Launch",
    "ProfilerOverhead",
    "Program",
    "Step",
    "StreamWait",
    "Sync",
    "program_from_trace",
]


@dataclass(frozen=True)
class GpuWork:
    """One kernel, copy or memset as the GPU runs it; ``dur`` in microseconds.

    ``kind`` ``"collective"`` is a collective's kernel (an NCCL all-reduce): run with other
    ranks' programs (``grape.sim.engine.simulate_ranks``) it cannot finish before every rank's
    matching collective has started, and ``dur`` is its time once they all have.

    ``alone``: where the work ran beside other streams' work in the recording, the part of
    ``dur`` the GPU spent on it, its duration divided among what ran with it
    (``grape.records.alone_times``); None where it ran by itself (``alone`` is ``dur``).
    ``share``: the share of the GPU's SMs it holds while it runs (``grape.records.sm_share``),
    which prices work that overlaps other streams' (``grape.sim.sharing``).
    """

    kind: str
    name: str
    dur: float
    stream: int
    alone: float | None = None
    share: float = 1.0

    @property
    def work(self) -> float:
        """The GPU time this work takes when it shares the GPU as it did when recorded."""
        return self.dur if self.alone is None else self.alone


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
    branches overlap); ``work`` keeps the kernels for timelines. ``graph``, where the launch
    was built from the IR (``grape.sim.graph.program_from_graph``), is the kernel graph itself,
    and ``gpu_time`` comes from running its DAG. ``busy``, where a trace gave
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
    graph: KernelGraph | None = field(default=None, compare=False, repr=False)
    # where a trace gave ``busy``: the kernels that started with no other stream's work
    # running (grape.records.exposed_kernels), whose per-node gaps ``busy`` leaves out
    exposed: int | None = None


@dataclass(frozen=True)
class Sync:
    """The host waits for the device (``stream`` None) or one stream to finish what it has."""

    api: str
    cost: float
    stream: int | None = None


@dataclass(frozen=True)
class StreamWait:
    """``stream`` runs nothing more until the work queued on ``on`` so far has finished: a
    ``cudaStreamWaitEvent`` on an event recorded on ``on`` (the host pays nothing here; the
    call's own cost is the :class:`HostWork` before it)."""

    stream: int
    on: int


Step = HostWork | Launch | GraphLaunch | Sync | StreamWait


@dataclass(frozen=True)
class ProfilerOverhead:
    """Host time torch.profiler adds per recorded operator and per CUDA API call, and once per
    profiled step (us)."""

    per_op: float = 0.0
    per_call: float = 0.0
    per_step: float = 0.0


@dataclass
class Program:
    name: str
    iterations: list[tuple[Step, ...]]
    approximations: list[str] = field(default_factory=list)  # what the model had to simplify
    # What a what-if assumed away: operations a capture would refuse as they stand.
    blockers: list[str] = field(default_factory=list)

    def steps(self) -> list[Step]:
        return [s for it in self.iterations for s in it]

    def with_iterations(self, iterations: list[tuple[Step, ...]]) -> Program:
        """The same program (name, approximations and blockers so far) doing ``iterations``
        instead."""
        return Program(self.name, iterations, list(self.approximations), list(self.blockers))


def _work(ops: tuple[GpuRecord, ...], alone: dict[int, float], sms: int | None
          ) -> tuple[GpuWork, ...]:
    return tuple(GpuWork(op.kind, op.name, op.dur, op.stream, _shared(op, alone),
                         sm_share(op, sms))
                 for op in sorted(ops, key=lambda o: o.ts))


def _shared(op: GpuRecord, alone: dict[int, float]) -> float | None:
    """``op``'s alone time where it ran beside other work, else None."""
    time = alone.get(id(op))
    return None if time is None or time >= op.dur - 1e-9 else time


def _count(sorted_ts: list[float], lo: float, hi: float) -> int:
    """How many of ``sorted_ts`` lie in [lo, hi)."""
    return max(bisect_left(sorted_ts, hi) - bisect_left(sorted_ts, lo), 0)


def _iteration(it: Iteration, ops_ts: list[float], overhead: ProfilerOverhead,
               tids: set[int], waits: dict[int, StreamWait], alone: dict[int, float],
               sms: int | None) -> tuple[Step, ...]:
    launches = {launch.call.correlation: launch for launch in it.launches}
    steps: list[Step] = []
    cursor = it.start
    for call in sorted((c for c in it.calls if c.tid in tids), key=lambda c: c.ts):
        if call.ts < cursor:  # nested inside a call already counted (driver under runtime)
            continue
        gap = call.ts - cursor - overhead.per_op * _count(ops_ts, cursor, call.ts)
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
                                     stream=min(streams), work=_work(launch.ops, alone, sms),
                                     busy=union_length([(op.ts, op.end) for op in launch.ops]),
                                     exposed=exposed_kernels(launch.ops)))
        elif launch is not None:
            steps.append(Launch(call.name, cost, _work(launch.ops, alone, sms)))
        elif call.is_sync:
            steps.append(Sync(call.name, 0.0))
        else:
            steps.append(HostWork(cost))
            if call.correlation in waits:
                steps.append(waits[call.correlation])
        cursor = call.end
    tail = (it.end - cursor - overhead.per_op * _count(ops_ts, cursor, it.end)
            - overhead.per_step)
    if tail > 0:
        steps.append(HostWork(tail))
    return tuple(steps)


WAIT_CALLS = frozenset({"cudaStreamWaitEvent", "cuStreamWaitEvent"})
RECORD_CALLS = frozenset({"cudaEventRecord", "cuEventRecord", "cudaEventRecordWithFlags",
                          "cuEventRecordWithFlags"})
# CUPTI's clocks for two streams' work agree to about a microsecond: a wait's first kernel may
# appear to start that much before the work it waited for ends.
_CLOCK_SLACK_US = 2.0


def _stream_waits(it: Iteration, records: dict[int, WaitRecord]) -> tuple[dict[int, StreamWait],
                                                                           int]:
    """The stream each wait call in ``it`` waited on, by the call's correlation, and how many
    waits named no stream that way.

    CUPTI names the waiting stream; which stream the event was recorded on it names only where
    the profiler matched the record (PyTorch 2.11's does not), so otherwise it is read off the
    GPU timeline: the event is the last one recorded before the wait (a wait uses the event's
    latest record), and of the streams with work issued before that record, the one whose last
    such work ended latest, no later than the waiting stream's next work started, is the one the
    wait held back. A wait whose next work started before all of them held nothing back, and
    orders nothing.
    """
    issued: dict[int, list[tuple[float, float, float]]] = defaultdict(list)  # call ts, start, end
    for launch in it.launches:
        for op in launch.ops:
            issued[op.stream].append((launch.call.ts, op.ts, op.end))
    latest: dict[int, list[float]] = {}  # per stream: the latest end among work issued so far
    for stream, work in issued.items():
        work.sort()
        ends, until = [], float("-inf")
        for _, _, end in work:
            until = max(until, end)
            ends.append(until)
        latest[stream] = ends
    calls = sorted(it.calls, key=lambda c: c.ts)
    found: dict[int, StreamWait] = {}
    unmatched = 0
    last_record = None
    for call in calls:
        if call.name in RECORD_CALLS:
            last_record = call
        if call.name not in WAIT_CALLS or call.correlation not in records:
            continue
        record = records[call.correlation]
        if record.on_stream >= 0:
            found[call.correlation] = StreamWait(record.stream, record.on_stream)
            continue
        waiter = issued.get(record.stream, [])
        after = bisect_left(waiter, (call.ts,))
        if last_record is None or after == len(waiter):
            unmatched += 1
            continue
        next_start = waiter[after][1]
        best, best_end = None, float("-inf")
        for stream, work in issued.items():
            if stream == record.stream:
                continue
            before = bisect_left(work, (last_record.ts,))
            if before == 0:
                continue
            end = latest[stream][before - 1]
            if best_end < end <= next_start + _CLOCK_SLACK_US:
                best, best_end = stream, end
        if best is None:
            unmatched += 1
        else:
            found[call.correlation] = StreamWait(record.stream, best)
    return found, unmatched


def program_from_trace(trace: Trace, overhead: ProfilerOverhead | None = None) -> Program:
    """The host's steps in each iteration of ``trace``.

    Host gaps and call costs are the trace's, less ``overhead`` per operator and API call the
    profiler recorded in them; a sync's own cost is taken as nothing (its duration in the trace
    is waiting, which the simulator reproduces). The host is the thread that issued most
    launches and every other launching thread that hands off with it (:func:`_host_threads`);
    work on threads that ran beside it is left out and listed in ``approximations``.
    """
    overhead = overhead or ProfilerOverhead()
    tids, beside = _host_threads(trace)
    ops_ts = sorted(op.ts for op in trace.ops if op.tid in tids)
    records = {w.correlation: w for w in trace.waits}
    sms = trace.device.get("numSms")  # the first GPU's: a trace's GPUs are taken to be alike
    alone = {}
    for device in {op.device for op in trace.gpu_ops}:  # each GPU shared by its own work
        ops = [op for op in trace.gpu_ops if op.device == device]
        alone.update((id(op), t) for op, t in zip(ops, alone_times(ops), strict=True))
    iterations, inferred, unmatched = [], 0, 0
    for it in trace.iterations:
        waits, missed = _stream_waits(it, records)
        iterations.append(_iteration(it, ops_ts, overhead, tids, waits, alone, sms))
        inferred += sum(1 for c in waits if records[c].on_stream < 0)
        unmatched += missed
    program = Program(trace.workload, iterations)
    wait_calls = sum(1 for it in trace.iterations for c in it.calls if c.name in WAIT_CALLS)
    streams = {op.stream for op in trace.gpu_ops}
    if wait_calls and not records and len(streams) > 1:
        program.approximations.append(
            f"{wait_calls} stream waits without the profiler's records of them: streams run "
            f"unordered (record with torch.profiler's enable_cuda_sync_events, as grape record "
            f"does)")
    if inferred:
        program.approximations.append(
            f"{inferred} stream waits ordered by the stream whose work their next kernel "
            f"followed on the GPU (the trace does not say where their events were recorded)")
    if unmatched:
        program.approximations.append(f"{unmatched} stream waits held nothing back and order "
                                      f"nothing")
    for category, count in sorted(trace.unknown.items()):
        program.approximations.append(f"{count} trace events of category {category!r} are not "
                                      f"modelled: their time counts as host work")
    if trace.orphans:
        program.approximations.append(f"{len(trace.orphans)} GPU operations with no host call "
                                      f"in the trace are left out")
    others = {c.tid for it in trace.iterations for c in it.calls} - tids
    if others:
        program.approximations.append(f"API calls on threads {sorted(others)} left out; only "
                                      f"the issuing thread{'s' if len(tids) > 1 else ''} "
                                      f"{', '.join(map(str, sorted(tids)))} simulated"
                                      + (f" ({sorted(beside)} issued launches while the host "
                                         f"did)" if beside else ""))
    return program


# A thread that hands off with the host may overlap it by a call's edge (clock slack): up to
# this share of its call time.
_HANDOFF_OVERLAP = 0.01


def _host_threads(trace: Trace) -> tuple[set[int], set[int]]:
    """The threads simulated as one host, and the launching threads left out.

    The host is the thread that issued most launches, and with it every other launching thread
    whose API calls never run while the host's do: PyTorch's autograd engine launches the
    backward pass from its own thread while the caller waits in ``backward()``, so together
    they are one sequence of calls, merged by time. A thread whose calls overlap the host's
    (a data loader, a second stream's worker) runs beside it and is left out."""
    counts: dict[int, int] = {}
    for launch in trace.launches:
        counts[launch.call.tid] = counts.get(launch.call.tid, 0) + 1
    host = max(counts, key=counts.get)
    calls: dict[int, list[tuple[float, float]]] = {}
    for it in trace.iterations:
        for c in it.calls:
            calls.setdefault(c.tid, []).append((c.ts, c.end))
    tids, beside = {host}, set()
    for tid in sorted(counts, key=counts.get, reverse=True)[1:]:
        mine = calls.get(tid, [])
        theirs = [span for t in tids for span in calls.get(t, [])]
        overlap = (union_length(mine) + union_length(theirs)
                   - union_length(mine + theirs))
        if overlap <= _HANDOFF_OVERLAP * union_length(mine):
            tids.add(tid)
        else:
            beside.add(tid)
    return tids, beside
