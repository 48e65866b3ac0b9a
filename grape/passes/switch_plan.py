"""What a device switch holds for one executable of a family, without a GPU.

``grape.cuda.switch.DeviceSwitch`` gives a family's kernel nodes their versions from a kernel
on the GPU, reading tables copied there once. This module decides what goes in them: which
nodes the switch takes over (``device_switchable``), which version each shape gives each of
them, and the tables' bytes, laid out as the kernel reads them. The CUDA backend copies these
bytes; the simulator counts them (a family's device memory) from the same function.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from grape.passes.variants import NodeVersions, Variants, device_switchable

__all__ = ["SwitchPlan", "plan", "spans", "tables", "totals"]

# Two runs of differing words closer than this many bytes are written as one span: a span
# costs the kernel one more update of 40 bytes, a gap word 8 bytes of table a version.
_GAP = 16


@dataclass(frozen=True)
class SwitchPlan:
    """The nodes a switch takes over and the version each shape gives each of them."""

    versions: list[NodeVersions]
    shapes: list[Hashable]  # row i of ``table`` is shapes[i]'s
    table: np.ndarray  # (shapes, nodes) version numbers, 0 the template's

    def device_bytes(self) -> int:
        """The tables' bytes on the device (``DeviceSwitch.device_bytes``)."""
        return max(len(tables(self.versions, self.table, [0] * len(self.versions))[0]), 8)


def plan(v: Variants) -> SwitchPlan:
    """What a device switch over executable ``v`` holds: every node of ``v`` whose versions a
    kernel can switch, and each of ``v``'s shapes' versions of them, in ``v.shapes``' order.
    Nodes with alternates stay with host updates: the driver's enabling of a node from the
    host overwrites the device's updates of it at the next launch."""
    alternated = v.alternated
    chosen = [nv for nv in v.nodes.values()
              if device_switchable(nv) and nv.node not in alternated]
    shapes = list(v.shapes)
    table = np.zeros((len(shapes), len(chosen)), dtype=np.int64)
    for i, shape in enumerate(shapes):
        taken = v.shapes[shape]
        table[i] = [taken.get(nv.node, 0) for nv in chosen]
    return SwitchPlan(chosen, shapes, table)


def totals(variants: Iterable[Variants]) -> tuple[int, int, int]:
    """Over a family's executables: the nodes device switches take over, their versions, and
    the switches' tables in device bytes (what ``update="device"`` adds to a family)."""
    plans = [plan(v) for v in variants]
    return (sum(len(p.versions) for p in plans),
            sum(len(nv) for p in plans for nv in p.versions),
            sum(p.device_bytes() for p in plans))


def spans(versions: NodeVersions) -> tuple[list[tuple[int, int]], bool]:
    """The argument bytes ``versions`` differ in, as (first byte, count) spans of whole 8-byte
    words within the arguments (none where no byte differs), and whether the grid differs:
    what a switch writes. One span a node stored up to 1,480 bytes a version for GPT-2 small,
    where a pointer near a structure's start and a leftover word near its end both change:
    28 MB of tables for 1,023 lengths on the H200 (run 20), 6.7 MB as spans (run 21)."""
    args, dims, _ = versions.arrays()
    grid = bool((dims[:, :3] != dims[:1, :3]).any())
    words = np.unique(np.flatnonzero((args != args[:1]).any(axis=0)) // 8) * 8
    out: list[list[int]] = []
    for w in words.tolist():
        if out and w - out[-1][1] <= _GAP:
            out[-1][1] = w + 8
        else:
            out.append([w, w + 8])
    return [(lo, min(hi, args.shape[1]) - lo) for lo, hi in out], grid


def tables(versions: Sequence[NodeVersions], table: np.ndarray,
           handles: Sequence[int]) -> tuple[np.ndarray, dict[str, int]]:
    """Every table the switch kernel (``grape.cuda.switch.SOURCE``) reads, in one blob (each
    part 8-byte aligned), and each part's byte offset in it. ``handles``: each node's device
    handle. A node's rows keep only the bytes its versions differ in (``spans``), its spans
    side by side."""
    first_row = np.cumsum([0] + [len(nv) for nv in versions])  # each node's first global row
    offsets = np.zeros(int(first_row[-1]), dtype=np.int64)
    arg_parts, grids, grid_varies, cursor = [], [], [], 0
    first, start, size, at = [0], [], [], []
    for j, nv in enumerate(versions):
        args, dims, _ = nv.arrays()
        runs, grid = spans(nv)
        grid_varies.append(grid)
        width = 0
        for lo, count in runs:
            start.append(lo)
            size.append(count)
            at.append(width)
            width += -(-count // 8) * 8
        first.append(len(start))
        block = np.zeros((len(nv), width), dtype=np.uint8)
        for (lo, count), where in zip(runs, at[first[-2]:], strict=True):
            block[:, where:where + count] = args[:, lo:lo + count]
        offsets[first_row[j]:first_row[j + 1]] = (cursor
                                                  + np.arange(len(nv), dtype=np.int64) * width)
        cursor += block.size
        arg_parts.append(block.ravel())
        grids.append(dims[:, :3].astype(np.uint32))
    parts = {
        "nodes": np.array(handles, dtype=np.uint64),
        "first": np.array(first, dtype=np.uint32),
        "start": np.array(start, dtype=np.uint32),
        "size": np.array(size, dtype=np.uint32),
        "at": np.array(at, dtype=np.uint32),
        "grid_varies": np.array(grid_varies, dtype=np.uint32),
        "offsets": offsets,
        "grids": np.concatenate(grids) if grids else np.zeros((0, 3), np.uint32),
        "rows": (table + first_row[:-1][None, :]).astype(np.int32),
        "status": np.zeros(2, dtype=np.int32),
        "args": np.concatenate(arg_parts) if arg_parts else np.zeros(0, np.uint8),
    }
    where, chunks, cursor = {}, [], 0
    for name, part in parts.items():
        raw = np.ascontiguousarray(part).view(np.uint8).ravel()
        where[name] = cursor
        chunks.append(raw)
        pad = -len(raw) % 8
        if pad:
            chunks.append(np.zeros(pad, dtype=np.uint8))
        cursor += len(raw) + pad
    return np.concatenate(chunks) if chunks else np.zeros(8, np.uint8), where
