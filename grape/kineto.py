"""torch.profiler's (Kineto's) Chrome-trace events, to and from grape's trace records.

Kineto writes complete events (``"ph": "X"``) with a category per kind of activity. CUDA API calls
on the host and the GPU work they caused share ``args.correlation``; a graph launch's one call
shares it with every kernel the graph ran. The encoder writes the same shapes back, with flow
arrows from each call to its GPU work, so that Perfetto and grape read grape's traces as they read
the profiler's.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from grape.errors import TraceFormatError
from grape.records import GpuRecord, HostCall, LaunchRecord, WaitRecord

__all__ = ["Decoded", "decode", "encode"]

HOST_CATEGORIES = {"cuda_runtime": "runtime", "cuda_driver": "driver",
                   "cpu_op": "op", "user_annotation": "op"}
GPU_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
# CUPTI's synchronization records: a stream waiting on an event orders streams, which grape
# models; the others (context, stream and event syncs) repeat host calls grape already has.
SYNC_CATEGORY, STREAM_WAIT = "cuda_sync", "Stream Wait Event"
HOST_SYNC_KINDS = {"Context Sync", "Stream Sync", "Event Sync"}
# Categories that carry nothing grape models: profiler bookkeeping and GPU-side copies of host
# annotations. Anything else is counted and reported, never dropped silently.
IGNORED_CATEGORIES = {"overhead", "Trace", "ac2g", "gpu_user_annotation", "python_function",
                      "cuda_profiler_range", None}
PROFILER_STEP = "ProfilerStep#"
# torch.profiler does not record the driver calls cuda-python makes (grape's own graph launches):
# their GPU work arrives with a correlation no host call has. grape's CUDA backend marks each such
# call with a user annotation "grape:<driver call>" (grape.cuda.check.observe), which the decoder
# turns back into the call it stands for. "grape launch N" is how benchmarks/ir_twin.py marked
# the launches of the recordings committed in traces/h200_ir, before that convention (its spans
# hold the Python call around the launch, so their host time is more than the driver call's).
GRAPE_CALL_PREFIX = "grape:"
_LEGACY_LAUNCH_MARK = "grape launch "
# CUPTI's GPU timestamps may lead the host's by about a microsecond.
_CLOCK_SLACK_US = 2.0
# Kineto puts GPU activity on pid = device index; host threads go on a pid no device can have.
HOST_PID = 1 << 20


@dataclass
class Decoded:
    calls: list[HostCall] = field(default_factory=list)  # CUDA runtime and driver calls
    ops: list[HostCall] = field(default_factory=list)  # framework operators, annotations
    steps: list[HostCall] = field(default_factory=list)  # ProfilerStep annotations
    gpu_ops: list[GpuRecord] = field(default_factory=list)
    launches: list[LaunchRecord] = field(default_factory=list)
    # GPU work with no host call in the trace
    orphans: list[GpuRecord] = field(default_factory=list)
    waits: list[WaitRecord] = field(default_factory=list)  # which stream waits, per wait call
    unknown: dict[str, int] = field(default_factory=dict)  # category -> events not modelled


class _Missing:
    def __repr__(self) -> str:
        return "nothing"


_MISSING: Any = _Missing()  # a field the event does not have (None is a field set to null)
# Timestamps and durations are microseconds in a double: beyond 2**53 a double no longer holds
# whole microseconds, and no real trace comes near (Kineto's clock reads about 5e12).
MAX_US = float(2**53)


class _Event:
    """One event's fields, each read with its type and range checked where it is read; a bad
    value raises one ``TraceFormatError`` naming the file, the event and what was expected."""

    def __init__(self, e: dict, index: int, source: str) -> None:
        self.e, self.index, self.source = e, index, source
        args = e.get("args")
        if args is not None and not isinstance(args, dict):
            self.fail("'args' an object", args)
        self.args: dict = args or {}

    def fail(self, expected: str, found: Any) -> NoReturn:
        name = self.e.get("name")
        what = f" {name!r:.60}" if isinstance(name, str) else ""
        raise TraceFormatError(f"{self.source}: event {self.index} ({self.e.get('cat')!r:.40}"
                               f"{what}): expected {expected}, found {found!r:.60}")

    def fail_field(self, key: str, in_args: bool, expected: str, found: Any) -> NoReturn:
        self.fail(f"{f'args.{key!r}' if in_args else repr(key)} {expected}", found)

    def text(self, key: str) -> str:
        value = self.e.get(key, _MISSING)
        if not isinstance(value, str):
            self.fail_field(key, False, "a string", value)
        return value

    def time(self, key: str, *, duration: bool = False) -> float:
        """Microseconds: finite, at most 2**53 in size, and not negative for a duration."""
        value = self.e.get(key, _MISSING)
        low = 0.0 if duration else -MAX_US
        if type(value) not in (int, float) or not low <= value <= MAX_US:  # NaN fails too
            kind = "a duration" if duration else "a timestamp"
            self.fail_field(key, False, f"{kind} in microseconds, a number from {low:g} to "
                                        f"2**53", value)
        return float(value)

    def integer(self, key: str, default: Any = _MISSING, *, in_args: bool = True,
                minimum: int | None = None) -> Any:
        """An integer field (``default`` where it is absent or null, if one is given)."""
        value = (self.args if in_args else self.e).get(key, _MISSING)
        if value is _MISSING or value is None:
            if default is _MISSING:
                self.fail_field(key, in_args, "an integer", value)
            return default
        if type(value) is not int or (minimum is not None and value < minimum):
            bound = "" if minimum is None else f" of at least {minimum}"
            self.fail_field(key, in_args, f"an integer{bound}", value)
        return value

    def dims(self, key: str) -> tuple[int, int, int] | None:
        value = self.args.get(key)
        if value is None:
            return None
        if not (isinstance(value, list) and len(value) == 3
                and all(type(v) is int and v >= 1 for v in value)):
            self.fail_field(key, True, "three positive integers", value)
        return tuple(value)


def _host(ev: _Event, category: str) -> HostCall:
    return HostCall(name=ev.text("name"), category=category, ts=ev.time("ts"),
                    dur=ev.time("dur", duration=True),
                    tid=ev.integer("tid", 0, in_args=False),
                    correlation=ev.integer("correlation", None))


def _gpu(ev: _Event, kind: str) -> GpuRecord:
    stream = ev.integer("stream", None)
    return GpuRecord(kind=kind, name=ev.text("name"), ts=ev.time("ts"),
                 dur=ev.time("dur", duration=True),
                 stream=ev.integer("tid", 0, in_args=False) if stream is None else stream,
                 correlation=ev.integer("correlation"),
                 device=ev.integer("device", 0, minimum=0),
                 grid=ev.dims("grid"), block=ev.dims("block"),
                 shared_mem=ev.integer("shared memory", None, minimum=0),
                 registers=ev.integer("registers per thread", None, minimum=0),
                 bytes=ev.integer("bytes", None, minimum=0))


def _wait(ev: _Event) -> WaitRecord:
    return WaitRecord(correlation=ev.integer("correlation"), stream=ev.integer("stream"),
                      ts=ev.time("ts"), dur=ev.time("dur", duration=True),
                      device=ev.integer("device", 0, minimum=0),
                      on_stream=ev.integer("wait_on_stream", -1))


def decode(events: Iterable[Any], source: str) -> Decoded:
    """Sort a Chrome trace's events into host calls, GPU operations and launches."""
    out = Decoded()
    unknown: dict[str, int] = defaultdict(int)
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise TraceFormatError(f"{source}: expected trace events to be objects, "
                                   f"found {type(e).__name__} at index {i}")
        if e.get("ph") != "X":
            continue
        ev = _Event(e, i, source)
        cat = e.get("cat")
        if cat is not None and not isinstance(cat, str):
            ev.fail("'cat' a string", cat)
        if cat in GPU_CATEGORIES:
            out.gpu_ops.append(_gpu(ev, GPU_CATEGORIES[cat]))
        elif cat in HOST_CATEGORIES:
            call = _host(ev, HOST_CATEGORIES[cat])
            if call.category == "op":
                is_step = call.name.startswith(PROFILER_STEP)
                (out.steps if is_step else out.ops).append(call)
            else:
                out.calls.append(call)
        elif cat == SYNC_CATEGORY:
            name = ev.text("name")
            if name == STREAM_WAIT:
                out.waits.append(_wait(ev))
            elif name not in HOST_SYNC_KINDS:
                unknown[cat] += 1
        elif cat not in IGNORED_CATEGORIES:
            unknown[cat] += 1
    out.unknown = dict(unknown)
    for seq in (out.calls, out.ops, out.steps, out.gpu_ops, out.waits):
        seq.sort(key=lambda r: (r.ts, -r.dur))
    by_corr: dict[int, list[GpuRecord]] = defaultdict(list)
    for op in out.gpu_ops:
        by_corr[op.correlation].append(op)
    for call in out.calls:
        ops = by_corr.pop(call.correlation, None) if call.correlation is not None else None
        if ops:
            out.launches.append(LaunchRecord(call, tuple(ops)))
    unnamed = by_corr.pop(0, [])  # (no call of the trace had it)
    _attribute_marked_calls(out, by_corr)
    by_corr[0] = _join_graph_launches(out, unnamed)
    out.orphans = sorted((op for ops in by_corr.values() for op in ops), key=lambda o: o.ts)
    return out


def _join_graph_launches(out: Decoded, unnamed: list[GpuRecord]) -> list[GpuRecord]:
    """Give work under correlation 0 to the last graph launch whose call began before it, and
    return what no launch takes. CUPTI gives correlation 0 to the kernels of a conditional
    node's bodies where it cannot name their launch (an H100, driver 580.159.04: a device
    loop's 21,948 body kernels under 0, its 459 others under the launch's own correlation; an
    H200's in ``traces/h200_predication``, 10,816); CUPTI numbers calls from 1."""
    graphs = [i for i, launch in enumerate(out.launches) if launch.is_graph]
    if not unnamed or not graphs:
        return unnamed
    starts = [out.launches[i].call.ts - _CLOCK_SLACK_US for i in graphs]
    joined: dict[int, list[GpuRecord]] = defaultdict(list)
    left = []
    for op in unnamed:
        k = bisect.bisect_right(starts, op.ts) - 1
        (joined[graphs[k]] if k >= 0 else left).append(op)
    for i, extra in joined.items():
        launch = out.launches[i]
        out.launches[i] = LaunchRecord(launch.call, tuple(
            sorted([*launch.ops, *extra], key=lambda r: (r.ts, -r.dur))))
    return left


def _marked_call(op: HostCall) -> str | None:
    """The driver call a grape annotation stands for, or None for any other operator."""
    if op.name.startswith(GRAPE_CALL_PREFIX):
        return op.name[len(GRAPE_CALL_PREFIX):]
    if op.name.startswith(_LEGACY_LAUNCH_MARK):
        return "cuGraphLaunch"
    return None


def _attribute_marked_calls(out: Decoded, by_corr: dict[int, list[GpuRecord]]) -> None:
    """Make grape's annotated driver calls host calls, each launch with the GPU work it caused.

    A launch's work is one group of GPU operations sharing a correlation no call in the trace
    has (CUPTI gives every kernel of one graph launch the launch's correlation). Launches and
    groups are paired in order (the GPU runs one stream's launches in the order they were
    issued), and only where they pair up: as many groups as launches, each group starting after
    its launch began (within the clocks' slack). Otherwise the work stays orphaned, as before.
    """
    marked = [(op, _marked_call(op)) for op in out.ops]
    marked = [(op, name) for op, name in marked if name is not None]
    if not marked:
        return
    launches = [(op, name) for op, name in marked if name in ("cuGraphLaunch", "cudaGraphLaunch")]
    groups = sorted(by_corr.items(), key=lambda item: min(o.ts for o in item[1]))
    paired = len(launches) == len(groups) and all(
        min(o.ts for o in ops) >= op.ts - _CLOCK_SLACK_US
        for (op, _), (_, ops) in zip(launches, groups, strict=True))
    taken = {id(op) for op, _ in marked}
    out.ops = [op for op in out.ops if id(op) not in taken]
    pairs = dict(zip((id(op) for op, _ in launches), groups, strict=True)) if paired else {}
    for op, name in marked:
        correlation, ops = pairs.get(id(op), (None, None))
        call = HostCall(name=name, category="driver", ts=op.ts, dur=op.dur, tid=op.tid,
                        correlation=correlation)
        out.calls.append(call)
        if ops:
            out.launches.append(LaunchRecord(call, tuple(ops)))
            del by_corr[correlation]
    out.calls.sort(key=lambda r: (r.ts, -r.dur))
    out.launches.sort(key=lambda r: (r.call.ts, -r.call.dur))


def _x(name: str, cat: str, ts: float, dur: float, pid: Any, tid: Any, **args: Any) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": {k.replace("_", " "): v for k, v in args.items() if v is not None}}


def _meta(kind: str, pid: Any, tid: Any, name: str) -> dict:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}


def encode(calls: Iterable[HostCall], ops: Iterable[HostCall], steps: Iterable[HostCall],
           gpu_ops: Iterable[GpuRecord], pid: int = HOST_PID,
           waits: Iterable[WaitRecord] = ()) -> list[dict]:
    """Chrome trace events in Kineto's shapes: host on process ``pid``, GPUs by device."""
    host_cat = {"runtime": "cuda_runtime", "driver": "cuda_driver"}
    gpu_cat = {v: k for k, v in GPU_CATEGORIES.items()}
    events: list[dict] = []
    tids: set[int] = set()
    for call in list(steps) + list(ops):
        tids.add(call.tid)
        events.append(_x(call.name, "user_annotation" if call.name.startswith(PROFILER_STEP)
                         else "cpu_op", call.ts, call.dur, pid, call.tid))
    starts: dict[int, HostCall] = {}
    for call in calls:
        tids.add(call.tid)
        events.append(_x(call.name, host_cat[call.category], call.ts, call.dur, pid, call.tid,
                         correlation=call.correlation))
        if call.correlation is not None:
            starts[call.correlation] = call
    streams: set[tuple[int, int]] = set()
    flowed: set[int] = set()
    for op in gpu_ops:
        streams.add((op.device, op.stream))
        events.append(_x(op.name, gpu_cat[op.kind], op.ts, op.dur, op.device, op.stream,
                         device=op.device, stream=op.stream, correlation=op.correlation,
                         grid=list(op.grid) if op.grid else None,
                         block=list(op.block) if op.block else None,
                         shared_memory=op.shared_mem, registers_per_thread=op.registers,
                         bytes=op.bytes))
        call = starts.get(op.correlation)
        if call is not None:
            # Perfetto draws these as arrows from the launching call to its GPU work.
            if op.correlation not in flowed:
                flowed.add(op.correlation)
                events.append({"ph": "s", "cat": "ac2g", "name": "ac2g", "id": op.correlation,
                               "pid": pid, "tid": call.tid, "ts": call.ts})
            events.append({"ph": "f", "bp": "e", "cat": "ac2g", "name": "ac2g",
                           "id": op.correlation, "pid": op.device, "tid": op.stream, "ts": op.ts})
    for w in waits:
        streams.add((w.device, w.stream))
        events.append({"ph": "X", "cat": SYNC_CATEGORY, "name": STREAM_WAIT, "pid": w.device,
                       "tid": w.stream, "ts": w.ts, "dur": w.dur,
                       "args": {"cuda_sync_kind": STREAM_WAIT, "stream": w.stream,
                                "correlation": w.correlation, "device": w.device,
                                "wait_on_stream": w.on_stream}})
    events.append(_meta("process_name", pid, 0, "host"))
    events += [_meta("thread_name", pid, tid, f"thread {tid}") for tid in sorted(tids)]
    for device in sorted({d for d, _ in streams}):
        events.append(_meta("process_name", device, 0, f"GPU {device}"))
    events += [_meta("thread_name", d, s, f"stream {s}") for d, s in sorted(streams)]
    return events
