"""Summaries of traces and kernel graphs, as text for people and as data for scripts."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx

from grape.errors import ProfileError
from grape.familyio import SavedFamily
from grape.ir import KernelGraph
from grape.passes.switch_plan import totals
from grape.profile import CONSTANTS, DeviceProfile
from grape.trace import SIMULATED, Trace

__all__ = ["Summary", "graph_summary", "profile_summary", "trace_summary"]

ROWS_SHOWN = 10  # iterations listed one per row; longer traces also get a mean row


@dataclass(frozen=True)
class Summary:
    text: str
    data: dict[str, Any]


def _version(v: Any) -> str:
    """Kineto's CUDA versions are integers like 13000 for 13.0."""
    return f"{v // 1000}.{v % 1000 // 10}" if isinstance(v, int) else str(v)


def _origin(t: Trace) -> str:
    versions = ", ".join(f"{label} {_version(t.versions[key])}" for key, label in
                         (("cuda_driver_version", "CUDA driver"),
                          ("cuda_runtime_version", "runtime")) if key in t.versions)
    where = f"{t.device_name}" + (f" ({versions})" if versions else "")
    if t.grape:
        wall = t.grape.wall_time_median_us
        how = "simulated" if t.grape.mode == SIMULATED else "measured"
        measured = f"; {how} {wall / 1000:.3f} ms per iteration" if wall else ""
        return f"grape trace, {t.grape.mode} {t.grape.workload} on {where}{measured}"
    return f"torch.profiler trace on {where}"


def _iteration_row(it) -> dict[str, Any]:
    graphs = it.graph_launches
    return {
        "index": it.index,
        "launches": len(it.launches),
        "kernels": len(it.kernels),
        "memcpy": sum(op.kind == "memcpy" for op in it.gpu_ops),
        "memset": sum(op.kind == "memset" for op in it.gpu_ops),
        "graph_launches": len(graphs),
        "kernels_per_graph_launch": [sum(op.kind == "kernel" for op in g.ops) for g in graphs],
        "host_ms": it.host_time / 1000,
        "host_launch_ms": it.host_launch_time / 1000,
        "gpu_busy_ms": it.gpu_busy_time / 1000,
        "syncs": len(it.syncs),
    }


_COLUMNS = [("iter", "index", "d"), ("launches", "launches", "d"), ("kernels", "kernels", "d"),
            ("memcpy", "memcpy", "d"), ("memset", "memset", "d"),
            ("graphs", "graph_launches", "d"), ("host ms", "host_ms", ".3f"),
            ("launch ms", "host_launch_ms", ".3f"), ("GPU busy ms", "gpu_busy_ms", ".3f"),
            ("syncs", "syncs", "d")]


def _table(rows: list[dict[str, Any]]) -> list[str]:
    widths = [max(len(h), 9) for h, _, _ in _COLUMNS]
    lines = ["  " + " ".join(h.rjust(w) for (h, _, _), w in zip(_COLUMNS, widths, strict=True))]
    shown = rows if len(rows) <= ROWS_SHOWN else rows[:ROWS_SHOWN]
    for row in shown:
        lines.append("  " + " ".join(format(row[k], f).rjust(w) for (_, k, f), w
                                     in zip(_COLUMNS, widths, strict=True)))
    if len(rows) > ROWS_SHOWN:
        lines.append(f"  ... {len(rows) - ROWS_SHOWN} more iterations")
    if len(rows) > 1:
        mean = {k: statistics.fmean(r[k] for r in rows) for _, k, _ in _COLUMNS[1:]}
        lines.append("  " + "mean".rjust(widths[0]) + " " + " ".join(
            format(mean[k], ".1f" if f == "d" else f).rjust(w)
            for (_, k, f), w in zip(_COLUMNS[1:], widths[1:], strict=True)))
    return lines


def _graph_line(rows: list[dict[str, Any]]) -> str | None:
    counts = [n for r in rows for n in r["kernels_per_graph_launch"]]
    if not counts:
        return None
    sizes = Counter(counts)
    if len(sizes) == 1:
        return f"graph launches: {len(counts)}, each running {counts[0]} kernels"
    spread = ", ".join(f"{n} x {size}" for size, n in sorted(sizes.items()))
    return f"graph launches: {len(counts)}, running {spread} kernels"


def trace_summary(t: Trace) -> Summary:
    rows = [_iteration_row(it) for it in t.iterations]
    kernels_by_stream = Counter((op.device, op.stream) for op in t.gpu_ops if op.kind == "kernel")
    streams = ", ".join(f"stream {s}" + (f" on GPU {d}" if d else "") +
                        f" ({kernels_by_stream[(d, s)]} kernels)" for d, s in t.streams)
    lines = [str(t.source), f"  {_origin(t)}",
             f"  iterations: {len(t.iterations)} ({t.split_method})",
             f"  streams: {len(t.streams)}: {streams}"]
    if graph_line := _graph_line(rows):
        lines.append(f"  {graph_line}")
    lines += _table(rows)
    notes = []
    if t.outside:
        names = Counter(c.name for c in t.outside)
        syncs = sum(c.is_sync for c in t.outside)
        listed = ", ".join(f"{name} x{n}" for name, n in names.most_common(4))
        notes.append(f"outside every iteration: {len(t.outside)} API calls ({syncs} syncs): "
                     f"{listed}")
    if t.orphans:
        notes.append(f"{len(t.orphans)} GPU operations had no host call in the trace and belong "
                     f"to no iteration")
    if t.unknown:
        listed = ", ".join(f"{cat} x{n}" for cat, n in sorted(t.unknown.items()))
        notes.append(f"event categories grape does not model, counted but not used: {listed}")
    lines += [f"  note: {n}" for n in notes]
    data = {
        "file": str(t.source), "kind": "trace", "device": t.device_name,
        "versions": t.versions, "grape": t.grape.to_json() if t.grape else None,
        "split": t.split_method, "streams": [list(s) for s in t.streams],
        "iterations": rows, "outside_calls": len(t.outside), "orphans": len(t.orphans),
        "unknown_categories": t.unknown,
    }
    return Summary("\n".join(lines), data)


def graph_summary(g: KernelGraph, path: str | Path) -> Summary:
    kinds = Counter(op.kind for _, op in g.ops())
    roles: dict[str, list[int]] = {}
    for b in g.buffers.values():
        roles.setdefault(b.role.value, []).append(b.size)
    generations = list(nx.topological_generations(g.dag))
    functions = {k.function for _, k in g.kernels()}
    edge_kinds = Counter(k for _, _, k in g.dag.edges(data="kind") if k is not None)
    data = {
        "file": str(path), "kind": "graph", "nodes": dict(kinds),
        "edges": g.dag.number_of_edges(), "edge_kinds": dict(edge_kinds),
        "depth": len(generations),
        "width": max((len(gen) for gen in generations), default=0),
        "distinct_functions": len(functions),
        "buffers": {role: {"count": len(sizes), "bytes": sum(sizes)}
                    for role, sizes in roles.items()},
        "fingerprint": g.fingerprint(),
    }
    nodes = ", ".join(f"{n} {kind}" for kind, n in kinds.most_common())
    buffers = ", ".join(f"{v['count']} {role} ({v['bytes']:,} bytes)"
                        for role, v in data["buffers"].items())
    text = "\n".join([
        str(path),
        f"  grape kernel graph: {len(g)} nodes ({nodes or 'none'}), {data['edges']} edges"
        + (" (" + ", ".join(f"{n} {kind.replace('_', '-')}" for kind, n in
                            edge_kinds.most_common()) + ")" if edge_kinds else ""),
        f"  depth {data['depth']}, widest generation {data['width']}, "
        f"{len(functions)} distinct kernel functions",
        f"  buffers: {buffers or 'none'}",
        f"  fingerprint: {data['fingerprint']}",
    ])
    return Summary(text, data)


def family_summary(f: SavedFamily, path: str | Path) -> Summary:
    """A saved graph family (``grape.familyio``): its shapes, executables, how much each shape
    changes of its executable's template, and where it was captured."""
    changed = sorted(f.changed(s) for s in f.shapes)
    executables = {key: {"nodes": len(v.template), "shapes": len(v.shapes),
                         "alternates": v.alternate_count}
                   for key, v in f.variants.items()}
    switched, versions, tables = totals(f.variants.values())
    buffers = {b.id: b for g in f.templates.values() for b in g.buffers.values()}
    scratch = sum(buffers[b].size for b in f.scratch if b in buffers)
    shapes = list(f.shapes)
    span = (f"{min(shapes)}..{max(shapes)}" if all(type(s) is int for s in shapes)
            else ", ".join(map(repr, shapes[:3])) + (", ..." if len(shapes) > 3 else ""))
    data = {
        "file": str(path), "kind": "family", "shapes": len(shapes), "shape_range": span,
        "executables": executables,
        "changed_nodes_per_shape": {"min": changed[0], "median": statistics.median(changed),
                                    "max": changed[-1]} if changed else None,
        "scratch_buffers": len(f.scratch), "scratch_bytes": scratch,
        "device_switch": {"nodes": switched, "versions": versions, "table_bytes": tables},
        "environment": dict(f.environment),
    }
    env = f.environment
    lines = [
        str(path),
        f"  grape graph family: {len(shapes)} shapes ({span}), {len(executables)} executables "
        "(" + ", ".join(f"{e['nodes']} nodes"
                        + (f" and {e['alternates']} alternates" if e["alternates"] else "")
                        + f" for {e['shapes']} shapes" for e in executables.values()) + ")",
        "  nodes each shape changes of its template: "
        + (f"{changed[0]} to {changed[-1]}, median {statistics.median(changed):g}"
           if changed else "none"),
        f"  scratch moved whole on a warm start: {len(f.scratch)} buffers, {scratch:,} bytes",
        f"  with update=\"device\": {switched} nodes switched on the GPU ({versions} versions), "
        f"tables of {tables:,} bytes",
        f"  captured on {env.get('gpu', '?')}, driver {env.get('driver', '?')}, torch "
        f"{env.get('torch', '?')}, grape {env.get('grape', '?')}",
    ]
    return Summary("\n".join(lines), data)


def profile_summary(p: DeviceProfile) -> Summary:
    values: dict[str, float | None] = {}
    for name in CONSTANTS:
        try:
            values[name] = p.get(name)
        except ProfileError:
            values[name] = None  # not measured (say, PyTorch was absent)
    lines = [p.path, f"  grape device profile: {p.device}, driver API "
             f"{p.doc.get('driver_version')}, measured {p.doc.get('measured', '?')}"]
    for name, (_, unit, meaning) in CONSTANTS.items():
        v = values[name]
        shown = "not measured" if v is None else f"{v:,.3f} {unit}"
        lines.append(f"  {meaning:<62} {shown}")
    return Summary("\n".join(lines), {"file": p.path, "kind": "device_profile",
                                      "device": p.device, "constants": values})
