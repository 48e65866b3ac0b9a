"""Reading torch.profiler traces and writing grape's own, in the Chrome Trace Event format.

A grape trace is a Kineto-shaped Chrome trace (so Perfetto and ``grape info`` open both alike)
with a ``"grape"`` block that says what ran where and what the run measured without the
profiler, and with ``ProfilerStep#N`` annotations that mark its iterations exactly.

Examples
--------
>>> t = read_trace("traces/gpt2_small_decode_b1_past64.eager.kineto.json.gz")
>>> len(t.iterations), len(t.iterations[0].kernels)
(3, 247)
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from grape.errors import SchemaVersionError, TraceFormatError
from grape.iterations import split_iterations
from grape.jsonio import dump_json, load_json
from grape.kineto import MAX_US, decode, encode
from grape.records import GpuRecord, HostCall, Iteration, LaunchRecord, WaitRecord

__all__ = [
    "GRAPE_SCHEMA_VERSION",
    "GpuRecord",
    "GrapeMeta",
    "HostCall",
    "Iteration",
    "LaunchRecord",
    "Trace",
    "read_trace",
    "trace_from_json",
    "write_trace",
]

GRAPE_SCHEMA_VERSION = 1
KINETO_SCHEMA_VERSIONS = (1,)


SIMULATED = "simulated"  # the mode of a trace grape's simulator wrote (grape.sim.tracing)


@dataclass(frozen=True)
class GrapeMeta:
    """The ``grape`` block of a trace grape wrote."""

    workload: str
    mode: str  # "eager", "graph", "grape", "simulated", ...
    device: str
    driver: str
    libraries: dict[str, str] = field(default_factory=dict)
    wall_time_us: tuple[float, ...] = ()  # per iteration, measured without the profiler
    notes: str = ""
    schema_version: int = GRAPE_SCHEMA_VERSION
    # Profiled iterations in the trace, for traces without ProfilerStep marks (recorded with
    # CUDA activity only); None where the marks or the launch sequence's period split it.
    iterations: int | None = None
    # Figures measured beside the trace that predictions of it need (for a graph family: its
    # shapes, nodes updated per step, executable bytes), by name.
    counters: dict[str, float] = field(default_factory=dict)

    @property
    def wall_time_median_us(self) -> float | None:
        return statistics.median(self.wall_time_us) if self.wall_time_us else None

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["wall_time_us"] = list(self.wall_time_us)
        return doc

    @classmethod
    def from_json(cls, doc: Any, source: str) -> GrapeMeta:
        """The block as a trace holds it, every field's type and range checked."""
        if not isinstance(doc, dict):
            raise TraceFormatError(f"{source}: expected the 'grape' block to be an object, "
                                   f"found {type(doc).__name__}")
        version = doc.get("schema_version")
        if version != GRAPE_SCHEMA_VERSION or type(version) is not int:
            raise SchemaVersionError(f"{source}: expected grape trace schema version "
                                     f"{GRAPE_SCHEMA_VERSION}, found {version!r:.40}")
        names = {f.name for f in fields(cls)}
        if unknown := sorted(set(doc) - names, key=str):
            raise TraceFormatError(f"{source}: expected grape block fields among "
                                   f"{sorted(names)}, found {unknown}")

        def bad(name: str, expected: str) -> TraceFormatError:
            return TraceFormatError(f"{source}: expected the grape block's {name!r} to be "
                                    f"{expected}, found {doc.get(name, 'nothing')!r:.60}")

        values: dict[str, Any] = {}
        for name in ("workload", "mode", "device", "driver", "notes"):
            if name in doc or name != "notes":
                if not isinstance(doc.get(name), str):
                    raise bad(name, "a string")
                values[name] = doc[name]
        if "libraries" in doc:
            libraries = doc["libraries"]
            if not (isinstance(libraries, dict)
                    and all(isinstance(v, str) for v in libraries.values())):
                raise bad("libraries", "an object of version strings")
            values["libraries"] = dict(libraries)
        wall = doc.get("wall_time_us")
        if not (isinstance(wall, list) and all(_positive_us(t) for t in wall)):
            raise bad("wall_time_us", "a list of positive, finite microseconds")
        values["wall_time_us"] = tuple(float(t) for t in wall)
        iterations = doc.get("iterations")
        if iterations is not None and (type(iterations) is not int or iterations < 1):
            raise bad("iterations", "a positive integer or null")
        values["iterations"] = iterations
        if "counters" in doc:
            counters = doc["counters"]
            if not (isinstance(counters, dict)
                    and all(_finite(v) for v in counters.values())):
                raise bad("counters", "an object of finite numbers")
            values["counters"] = {k: float(v) for k, v in counters.items()}
        return cls(**values)


def _finite(value: Any) -> bool:
    """A real number (not a boolean, not a numeric string) that is neither NaN nor infinite."""
    return type(value) in (int, float) and math.isfinite(value)


def _positive_us(value: Any) -> bool:
    return _finite(value) and 0 < value <= MAX_US


@dataclass
class Trace:
    """A decoded trace: its records, its iterations, and what is known of where it ran."""

    source: str
    calls: list[HostCall]
    ops: list[HostCall]
    gpu_ops: list[GpuRecord]
    launches: list[LaunchRecord]
    iterations: tuple[Iteration, ...]
    split_method: str
    outside: tuple[HostCall, ...]  # API calls outside every iteration
    orphans: list[GpuRecord]  # GPU work no host call in the trace accounts for
    unknown: dict[str, int]  # event categories grape does not model, with counts
    device: dict[str, Any] = field(default_factory=dict)
    # CUPTI's stream-wait records, where the trace has them (profiled with cuda sync events)
    waits: list[WaitRecord] = field(default_factory=list)
    versions: dict[str, Any] = field(default_factory=dict)
    grape: GrapeMeta | None = None
    split_warning: str | None = None  # a split to look at (one iteration that repeats)

    @property
    def device_name(self) -> str:
        return self.gpu or "unknown device"

    @property
    def gpu(self) -> str | None:
        """The GPU the trace ran on, by name, where it says: its device properties' name,
        else the grape block's device."""
        return self.device.get("name") or (self.grape.device if self.grape else None) or None

    @property
    def streams(self) -> list[tuple[int, int]]:
        """(device, stream) pairs that ran work, in order."""
        return sorted({(op.device, op.stream) for op in self.gpu_ops})

    @property
    def workload(self) -> str:
        """The workload's name: from the grape block, else the file name before the mode."""
        if self.grape:
            return self.grape.workload
        return Path(self.source).name.split(".")[0]

    @property
    def mode(self) -> str:
        if self.grape:
            return self.grape.mode
        return "graph" if any(launch.is_graph for launch in self.launches) else "eager"


def read_trace(path: str | Path, iterations: int | None = None) -> Trace:
    """Read a torch.profiler or grape trace (JSON, gzipped or not) and split its iterations.

    Parameters
    ----------
    path
        A Chrome trace file as ``torch.profiler`` exports it, or as grape writes it.
    iterations
        How many iterations the trace holds, where annotations and periodicity should not decide.

    Raises
    ------
    TraceFormatError
        Unreadable, not gzip where named so, not JSON, or not a Chrome trace.
    SchemaVersionError
        A Kineto or grape schema version this grape does not read.
    EmptyTraceError
        No GPU work launched from the host.
    IterationError
        ``iterations`` does not divide the launches evenly.
    """
    return trace_from_json(load_json(path, TraceFormatError), path, iterations)


def trace_from_json(doc: Any, path: str | Path, iterations: int | None = None) -> Trace:
    """Like :func:`read_trace`, for a document already parsed; ``path`` names it in errors."""
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        found = sorted(doc)[:5] if isinstance(doc, dict) else type(doc).__name__
        raise TraceFormatError(f"{path}: expected a Chrome trace (an object with 'traceEvents' "
                               f"or a list of events), found {found}")
    meta = doc if isinstance(doc, dict) else {}
    version = meta.get("schemaVersion", 1)
    if type(version) is not int or version not in KINETO_SCHEMA_VERSIONS:
        raise SchemaVersionError(f"{path}: expected Kineto schemaVersion "
                                 f"{' or '.join(map(str, KINETO_SCHEMA_VERSIONS))}, "
                                 f"found {version!r}")
    grape = GrapeMeta.from_json(meta["grape"], str(path)) if "grape" in meta else None
    decoded = decode(events, str(path))
    if iterations is None and grape is not None and not decoded.steps:
        iterations = grape.iterations
    split = split_iterations(decoded, iterations, str(path))
    device = _device(meta.get("deviceProperties"), path)
    versions = {k: meta[k] for k in ("cuda_driver_version", "cuda_runtime_version",
                                      "cupti_version") if k in meta}
    for key, value in versions.items():
        if type(value) is not int and not isinstance(value, str):
            raise TraceFormatError(f"{path}: expected {key!r} an integer or a string, found "
                                   f"{value!r:.60}")
    return Trace(source=str(path), calls=decoded.calls, ops=decoded.ops,
                 gpu_ops=decoded.gpu_ops, launches=decoded.launches,
                 iterations=split.iterations, split_method=split.method, outside=split.outside,
                 orphans=decoded.orphans, unknown=decoded.unknown, device=device,
                 versions=versions, grape=grape, waits=decoded.waits,
                 split_warning=split.warning)


def _device(properties: Any, path: str | Path) -> dict[str, Any]:
    """The first device's properties (the GPU the trace ran on), checked where read."""
    if properties is None or properties == []:
        return {}
    if not (isinstance(properties, list) and all(isinstance(p, dict) for p in properties)):
        raise TraceFormatError(f"{path}: expected 'deviceProperties' a list of objects, found "
                               f"{properties!r:.60}")
    name = properties[0].get("name", "unknown device")
    if not isinstance(name, str):
        raise TraceFormatError(f"{path}: expected the device's 'name' a string, found "
                               f"{name!r:.60}")
    sms = properties[0].get("numSms")  # prices work that overlaps other streams' (sm_share)
    if sms is not None and not (isinstance(sms, int) and not isinstance(sms, bool) and sms > 0):
        raise TraceFormatError(f"{path}: expected the device's 'numSms' a positive integer, "
                               f"found {sms!r:.60}")
    return properties[0]


def write_trace(path: str | Path, trace: Trace, meta: GrapeMeta) -> Path:
    """Write ``trace`` as a grape trace (gzipped when ``path`` ends in ``.gz``).

    Iterations become ``ProfilerStep#N`` annotations, so reading the file back finds exactly
    the same iterations, whatever their content.
    """
    steps = [HostCall(f"ProfilerStep#{it.index}", "op", it.start, it.host_time,
                      _issuing_tid(it)) for it in trace.iterations]
    doc = {
        "schemaVersion": 1,
        "displayTimeUnit": "ms",
        "deviceProperties": [trace.device] if trace.device else [],
        **trace.versions,
        "grape": meta.to_json(),
        "traceEvents": encode(trace.calls, trace.ops, steps, trace.gpu_ops, waits=trace.waits),
    }
    return dump_json(path, doc)


def _issuing_tid(it: Iteration) -> int:
    return it.launches[0].call.tid if it.launches else 0
