"""What a trace is made of: host calls, GPU operations, launches and iterations.

Times are microseconds on the trace's clock, as in the Chrome Trace Event format. These are
what a recording saw; a ``*Record`` never names what a program will do
(``grape.program``'s ``GpuWork``, ``Launch`` and ``StreamWait`` are those: one name per
concept on each side).
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

__all__ = ["GRAPH_LAUNCH_CALLS", "SYNC_CALLS", "GpuRecord", "HostCall", "Iteration",
           "LaunchRecord", "WaitRecord", "alone_times", "busy_time", "exposed_kernels",
           "graph_kernel_gap", "sm_share", "span", "top_level", "union_length"]

# Host calls that block until the GPU (or a stream, or an event) has caught up.
SYNC_CALLS = frozenset({
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
    "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize",
    "cudaMemcpy", "cuMemcpy", "cuMemcpyDtoH", "cuMemcpyHtoD", "cudaMemset",
})
GRAPH_LAUNCH_CALLS = frozenset({"cudaGraphLaunch", "cuGraphLaunch"})


@dataclass(frozen=True)
class HostCall:
    """A span on a host thread: a CUDA runtime or driver call, or a framework operator.

    ``category`` is ``"runtime"`` or ``"driver"`` for CUDA API calls and ``"op"`` for framework
    operators and user annotations. ``correlation`` ties an API call to the GPU work it caused.
    """

    name: str
    category: str
    ts: float
    dur: float
    tid: int
    correlation: int | None = None

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @property
    def is_sync(self) -> bool:
        return self.name in SYNC_CALLS


@dataclass(frozen=True)
class GpuRecord:
    """A kernel, copy or memset as the GPU ran it."""

    kind: str  # "kernel", "memcpy" or "memset"
    name: str
    ts: float
    dur: float
    stream: int
    correlation: int
    device: int = 0
    grid: tuple[int, int, int] | None = None
    block: tuple[int, int, int] | None = None
    shared_mem: int | None = None
    registers: int | None = None
    bytes: int | None = None

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass(frozen=True)
class WaitRecord:
    """CUPTI's record of one ``cudaStreamWaitEvent``: ``stream`` waits for an event.

    ``correlation`` is the host call's. ``on_stream`` is the stream the event was recorded on
    where the profiler matched the record (-1 where it did not: PyTorch 2.11 leaves it unknown).
    torch.profiler writes these only with ``enable_cuda_sync_events``.
    """

    correlation: int
    stream: int
    ts: float
    dur: float
    device: int = 0
    on_stream: int = -1


@dataclass(frozen=True)
class LaunchRecord:
    """One host call and the GPU operations it caused (many, for a graph launch)."""

    call: HostCall
    ops: tuple[GpuRecord, ...]

    @property
    def is_graph(self) -> bool:
        return self.call.name in GRAPH_LAUNCH_CALLS

    @property
    def signature(self) -> tuple:
        """What repeats when the same work is issued again: the call and the kernels it ran.

        Launch dimensions stay out: in a dynamic workload they change between iterations (the
        GPT-2 sample's KV-cache concatenation grows its grid from 66 to 67 blocks).
        """
        return (self.call.name, tuple((op.kind, op.name) for op in self.ops))


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Length covered by (start, end) intervals, overlaps counted once."""
    total, until = 0.0, float("-inf")
    for start, end in sorted(intervals):  # the simulator's hot path: no calls in the loop
        if end > until:
            total += end - (start if start > until else until)
            until = end
    return total


def graph_kernel_gap(ops: Iterable[GpuRecord], least: int = 16) -> float | None:
    """The median time between consecutive kernels of one graph launch as traced (us), or None
    where the trace holds fewer than ``least`` such gaps (no graph launches, say).

    A launch call makes one kernel, except a graph launch: GPU work sharing a correlation id
    came from one graph launch. Its gaps are those between consecutive work on one stream, the
    next starting after the one before ended. On H200s under torch.profiler they fall in two
    clusters, about 0.1 us and about 0.42 us a gap, by machine and by phase of one process
    (``grape.sim.graph``): what the machine added per node when it was recorded."""
    launches: dict[int, list[GpuRecord]] = defaultdict(list)
    for op in ops:
        launches[op.correlation].append(op)
    gaps = []
    for work in launches.values():
        if len(work) < 2:
            continue
        by_stream: dict[int, list[GpuRecord]] = defaultdict(list)
        for op in work:
            by_stream[op.stream].append(op)
        for ordered in by_stream.values():
            ordered.sort(key=lambda op: op.ts)
            gaps += [b.ts - a.end for a, b in itertools.pairwise(ordered) if b.ts >= a.end]
    return statistics.median(gaps) if len(gaps) >= least else None


def sm_share(op: GpuRecord, sms: int | None) -> float:
    """The share of the GPU's streaming multiprocessors ``op`` holds while it runs, taking a
    kernel of b blocks to spread them over min(b, SMs) of them (blocks dealt across SMs before
    any takes a second): one of 88 blocks on a 132-SM H200 holds two thirds of it. Work of
    unknown extent (a copy, a memset, a kernel without its launch configuration, or a GPU whose
    SM count the trace does not give) is taken to hold the whole GPU.

    Whether two kernels' blocks could share an SM (registers and shared memory left over) is
    not asked. On the H200, two towers of 88-block GEMMs and 256-block elementwise kernels,
    forked onto two streams under a graph, ran their GEMMs 1.22x and their elementwise kernels
    2.6x slower than alone (medians over 48 and 51 kernels, ``traces/h200_unseen/
    two_streams_*``): the elementwise kernels did not fit beside the GEMMs' blocks, whose
    shared memory and registers fill an SM."""
    if op.kind != "kernel" or op.grid is None or not sms:
        return 1.0
    grid = op.grid
    return min(1.0, grid[0] * grid[1] * grid[2] / sms)


def alone_times(ops: Sequence[GpuRecord]) -> list[float]:
    """Each op's duration divided among the streams whose work ran with it: over every stretch
    where n streams had work running, each op then running is charged the stretch's length / n.
    The charges add up to the busy time (``busy_time``): what the GPU spent on each op if
    concurrent work shares it, as kernels big enough to fill it do. An op that ran alone is
    charged its duration; ops of one stream that appear to overlap (clock slack, or a trace
    edited by hand) do not divide their time, since a stream runs one op at a time."""
    timed = [i for i, op in enumerate(ops) if op.end > op.ts]  # an instant shares nothing
    events = sorted([(ops[i].ts, 1, i) for i in timed]
                    + [(ops[i].end, 0, i) for i in timed])  # ends before starts
    alone = [0.0] * len(ops)
    active: dict[int, set[int]] = {}  # stream -> its ops running
    last = None
    for t, starts, i in events:
        if active and last is not None and t > last:
            share = (t - last) / len(active)
            for running in active.values():
                for j in running:
                    alone[j] += share
        last = t
        stream = ops[i].stream
        if starts:
            active.setdefault(stream, set()).add(i)
        else:
            active[stream].discard(i)
            if not active[stream]:
                del active[stream]
    return alone


def busy_time(ops: Iterable[GpuRecord]) -> float:
    """Microseconds during which at least one of ``ops`` ran (overlaps counted once)."""
    return union_length((op.ts, op.end) for op in ops)


def exposed_kernels(ops: Iterable[GpuRecord]) -> int:
    """How many of the per-node gaps before ``ops``' kernels show in their time: the kernels
    that started while no work on another stream ran, those starting at one instant counted
    once (they followed one idle stretch).

    A graph's kernels each follow a gap the GPU adds per node; where work on another stream
    runs through that gap, the GPU stays busy and the gap costs the graph nothing, and its
    time is already inside the kernels' union (``busy_time``). On one stream every kernel's
    gap shows; where a capture forked branches, those their overlap does not hide."""
    ordered = sorted(ops, key=lambda op: op.ts)
    ends: dict[int, float] = {}  # per stream, the latest end of its work started earlier
    exposed, i = 0, 0
    while i < len(ordered):
        j = i
        while j < len(ordered) and ordered[j].ts == ordered[i].ts:
            j += 1
        group = ordered[i:j]
        # Kernels that start at one instant with nothing running before them follow one
        # idle gap, not one each.
        if any(op.kind == "kernel" and not any(end > op.ts for stream, end in ends.items()
                                               if stream != op.stream) for op in group):
            exposed += 1
        for op in group:
            ends[op.stream] = max(ends.get(op.stream, op.end), op.end)
        i = j
    return exposed


def span(ops: Sequence[GpuRecord]) -> float:
    """From the first operation's start to the last one's end (0 for none)."""
    return max(op.end for op in ops) - min(op.ts for op in ops) if ops else 0.0


@dataclass(frozen=True)
class Iteration:
    """One repetition of the workload: its host window and everything issued in it."""

    index: int
    start: float
    end: float
    launches: tuple[LaunchRecord, ...]
    calls: tuple[HostCall, ...]  # every CUDA API call in the window, launches included

    @cached_property
    def gpu_ops(self) -> tuple[GpuRecord, ...]:
        return tuple(op for launch in self.launches for op in launch.ops)

    @cached_property
    def kernels(self) -> tuple[GpuRecord, ...]:
        return tuple(op for op in self.gpu_ops if op.kind == "kernel")

    @property
    def graph_launches(self) -> tuple[LaunchRecord, ...]:
        return tuple(launch for launch in self.launches if launch.is_graph)

    @property
    def syncs(self) -> tuple[HostCall, ...]:
        return tuple(call for call in self.calls if call.is_sync)

    @property
    def host_time(self) -> float:
        return self.end - self.start

    @property
    def host_launch_time(self) -> float:
        """Host microseconds spent inside the calls that issued GPU work."""
        return sum(launch.call.dur for launch in self.launches)

    @property
    def gpu_busy_time(self) -> float:
        return busy_time(self.gpu_ops)

    @property
    def gpu_span(self) -> float:
        """From the first GPU operation's start to the last one's end."""
        return span(self.gpu_ops)


def top_level(items: list[HostCall]) -> list[HostCall]:
    """Items not nested inside an earlier item (``items`` sorted by start, longest first)."""
    top: list[HostCall] = []
    for item in items:
        if not top or item.ts >= top[-1].end:
            top.append(item)
    return top
