"""torch.profiler's (Kineto's) Chrome-trace events, to and from grape's trace records.

Kineto writes complete events (``"ph": "X"``) with a category per kind of activity. CUDA API calls
on the host and the GPU work they caused share ``args.correlation``; a graph launch's one call
shares it with every kernel the graph ran. The encoder writes the same shapes back, with flow
arrows from each call to its GPU work, so that Perfetto and grape read grape's traces as they read
the profiler's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from grape.errors import TraceFormatError
from grape.records import GpuOp, HostCall, Launch, StreamWait

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
# Kineto puts GPU activity on pid = device index; host threads go on a pid no device can have.
HOST_PID = 1 << 20


@dataclass
class Decoded:
    calls: list[HostCall] = field(default_factory=list)  # CUDA runtime and driver calls
    ops: list[HostCall] = field(default_factory=list)  # framework operators, annotations
    steps: list[HostCall] = field(default_factory=list)  # ProfilerStep annotations
    gpu_ops: list[GpuOp] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    orphans: list[GpuOp] = field(default_factory=list)  # GPU work with no host call in the trace
    waits: list[StreamWait] = field(default_factory=list)  # which stream waits, per wait call
    unknown: dict[str, int] = field(default_factory=dict)  # category -> events not modelled


def _dims(value: Any) -> tuple[int, int, int] | None:
    if isinstance(value, list) and len(value) == 3 and all(isinstance(v, int) for v in value):
        return tuple(value)
    return None


def _host(e: dict, category: str) -> HostCall:
    args = e.get("args") or {}
    return HostCall(name=e["name"], category=category, ts=float(e["ts"]), dur=float(e["dur"]),
                    tid=_int_or(e.get("tid"), 0), correlation=args.get("correlation"))


def _int_or(value: Any, default: int) -> int:
    return value if isinstance(value, int) else default


def _gpu(e: dict, kind: str) -> GpuOp:
    args = e.get("args") or {}
    return GpuOp(kind=kind, name=e["name"], ts=float(e["ts"]), dur=float(e["dur"]),
                 stream=_int_or(args.get("stream"), _int_or(e.get("tid"), 0)),
                 correlation=args["correlation"], device=_int_or(args.get("device"), 0),
                 grid=_dims(args.get("grid")), block=_dims(args.get("block")),
                 shared_mem=args.get("shared memory"), registers=args.get("registers per thread"),
                 bytes=args.get("bytes"))


def _wait(e: dict) -> StreamWait:
    args = e.get("args") or {}
    return StreamWait(correlation=args["correlation"], stream=args["stream"], ts=float(e["ts"]),
                      dur=float(e["dur"]), device=_int_or(args.get("device"), 0),
                      on_stream=_int_or(args.get("wait_on_stream"), -1))


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
        cat = e.get("cat")
        try:
            if cat in GPU_CATEGORIES:
                out.gpu_ops.append(_gpu(e, GPU_CATEGORIES[cat]))
            elif cat in HOST_CATEGORIES:
                call = _host(e, HOST_CATEGORIES[cat])
                if call.category == "op":
                    is_step = call.name.startswith(PROFILER_STEP)
                    (out.steps if is_step else out.ops).append(call)
                else:
                    out.calls.append(call)
            elif cat == SYNC_CATEGORY and e.get("name") == STREAM_WAIT:
                out.waits.append(_wait(e))
            elif cat == SYNC_CATEGORY and e.get("name") in HOST_SYNC_KINDS:
                continue
            elif cat not in IGNORED_CATEGORIES:
                unknown[str(cat)] += 1
        except (KeyError, TypeError, ValueError) as err:
            raise TraceFormatError(f"{source}: expected event {i} ({cat}) to have a name, ts, dur "
                                   f"and correlation, found {type(err).__name__}: {err}") from None
    out.unknown = dict(unknown)
    for seq in (out.calls, out.ops, out.steps, out.gpu_ops, out.waits):
        seq.sort(key=lambda r: (r.ts, -r.dur))
    by_corr: dict[int, list[GpuOp]] = defaultdict(list)
    for op in out.gpu_ops:
        by_corr[op.correlation].append(op)
    for call in out.calls:
        ops = by_corr.pop(call.correlation, None) if call.correlation is not None else None
        if ops:
            out.launches.append(Launch(call, tuple(ops)))
    out.orphans = sorted((op for ops in by_corr.values() for op in ops), key=lambda o: o.ts)
    return out


def _x(name: str, cat: str, ts: float, dur: float, pid: Any, tid: Any, **args: Any) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": {k.replace("_", " "): v for k, v in args.items() if v is not None}}


def _meta(kind: str, pid: Any, tid: Any, name: str) -> dict:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}


def encode(calls: Iterable[HostCall], ops: Iterable[HostCall], steps: Iterable[HostCall],
           gpu_ops: Iterable[GpuOp], pid: int = HOST_PID,
           waits: Iterable[StreamWait] = ()) -> list[dict]:
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
