"""Where a family's device bytes go (issue 15), GPT-2 small decode over KV lengths.

``families.py`` measures ``device_bytes_family`` as the drop in free device memory over
``capture_family``. On the H200 that drop held about 72 MB beyond the shared pool's growth
(37.7 MB), the executables (1.7 MB) and the device switch's tables, in both update modes
(runs 12 and 15). This finds where: every call of the family's phases (each shape's capture,
each graph built and instantiated, each device switch made, the updates prepared) is wrapped
and charged with the free memory it took outside PyTorch's allocator and the bytes PyTorch's
allocator reserved during it; and, before any of it, the same for the process's first CUDA
graph (one kernel: what the driver sets aside once a process uses graphs at all). Last, the
allocator segments made during the capture, by pool and stream (``new_segments``).

Found on the H200 (``results/families_warm_start_h200/family_memory_device_0a38ce3.json``): the
first graph took 72 MiB, the family's own phases the pool (36 MiB) and the switches' tables;
``families.py`` now takes that first graph before measuring anything. The segment listing
replaced a listing of private pools' blocks after that run, which found one 2 MiB block against
the pool's 36 MiB: not yet run.

Run on a GPU: ``python benchmarks/family_memory.py [--lengths 1:255] [--update device]
[--out F]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

import grape.torch.family as family_module
from grape.cuda.build import Graph
from grape.cuda.switch import DeviceSwitch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import MAX_LEN, _device_bytes, _log, _range, _steps, first_graph_bytes, gpt2_decode


class _Ledger:
    """Free device memory taken, outside and inside PyTorch's allocator, by each kind of call;
    a call inside another is charged to the inner kind alone."""

    def __init__(self) -> None:
        self.outside: dict[str, int] = defaultdict(int)
        self.reserved: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._inner: list[list[int]] = []  # per open call: what calls inside it took

    @contextlib.contextmanager
    def charge(self, kind: str):
        torch.cuda.synchronize()
        free, reserved = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        self._inner.append([0, 0])
        try:
            yield
        finally:
            torch.cuda.synchronize()
            grown = torch.cuda.memory_reserved() - reserved
            outside = (free - torch.cuda.mem_get_info()[0]) - grown
            inner_outside, inner_grown = self._inner.pop()
            self.outside[kind] += outside - inner_outside
            self.reserved[kind] += grown - inner_grown
            self.calls[kind] += 1
            if self._inner:
                self._inner[-1][0] += outside
                self._inner[-1][1] += grown

    def wrap(self, owner, name: str, kind: str) -> None:
        inner = getattr(owner, name)

        def charged(*args, **kwargs):
            with self.charge(kind):
                return inner(*args, **kwargs)
        setattr(owner, name, charged)


def _segments() -> dict[int, dict[str, object]]:
    """PyTorch's allocator segments by address: pool, stream, type, size, and bytes in use."""
    return {seg["address"]: {"pool": str(tuple(seg.get("segment_pool_id", (0, 0)))),
                             "stream": seg.get("stream", 0), "type": seg["segment_type"],
                             "bytes": seg["total_size"], "in_use": seg["allocated_size"],
                             "largest_block": max((b["size"] for b in seg["blocks"]),
                                                  default=0)}
            for seg in torch.cuda.memory_snapshot()}


def _new_segments(before: dict[int, dict[str, object]]) -> list[dict[str, object]]:
    """The segments made since ``before``, grouped by (pool, stream, type): how many, their
    bytes, the bytes in use, the largest block. The first run found one 2 MiB block in
    private pools against a 36 MiB growth of PyTorch's reserved memory: this says where the
    rest sits (the default pool on the warm-up stream, or the graphs' pools)."""
    groups: dict[tuple, dict[str, object]] = {}
    for address, seg in _segments().items():
        if address in before:
            continue
        key = (seg["pool"], seg["stream"], seg["type"])
        g = groups.setdefault(key, {"pool": key[0], "stream": key[1], "type": key[2],
                                    "segments": 0, "bytes": 0, "in_use": 0, "largest_block": 0})
        g["segments"] += 1
        g["bytes"] += seg["bytes"]
        g["in_use"] += seg["in_use"]
        g["largest_block"] = max(g["largest_block"], seg["largest_block"])
    return sorted(groups.values(), key=lambda g: -g["bytes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1:255", help="first:last[:stride] KV lengths")
    parser.add_argument("--update", default="device", choices=("nodes", "device"))
    parser.add_argument("--out", type=Path, default=None, metavar="FILE")
    args = parser.parse_args()
    lengths = _range(args.lengths, "KV lengths", 1, MAX_LEN - 1)
    order = sorted(lengths)
    w = gpt2_decode(1, lengths)
    _steps(w.step, order, sync_each=False)  # every length's eager work (and memory) once
    kept, destroyed = first_graph_bytes()
    first = {"first_graph_kept": kept, "first_graph_after_destroy": destroyed}
    ledger = _Ledger()
    ledger.wrap(family_module, "capture", "capture (each shape)")
    ledger.wrap(Graph, "build", "Graph.build")
    ledger.wrap(Graph, "instantiate", "Graph.instantiate")
    ledger.wrap(DeviceSwitch, "__init__", "DeviceSwitch")
    ledger.wrap(family_module.Family, "prepare_updates", "prepare_updates")
    free0, reserved0 = _device_bytes()
    segments0 = _segments()
    family = family_module.capture_family(
        w.step, sorted(lengths, reverse=True), params=w.params, update=args.update,
        progress=lambda line: _log(f"  {line}"))
    free1, reserved1 = _device_bytes()
    # what no wrapped call took: capture_family's own work between them
    ledger.outside["elsewhere"] = ((free0 - free1) - (reserved1 - reserved0)
                                   - sum(ledger.outside.values()))
    ledger.reserved["elsewhere"] = (reserved1 - reserved0) - sum(ledger.reserved.values())
    ledger.calls["elsewhere"] = 0
    family.run(order[0])
    doc = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "command": " ".join(sys.argv), "shapes": len(lengths), "update": args.update,
        **first,
        "device_bytes_family": free0 - free1,  # as families.py measures it
        "reserved_growth": reserved1 - reserved0, "family_pool_bytes": family.pool_bytes,
        "switch_bytes": family.switch_bytes,
        "outside_allocator": dict(ledger.outside), "reserved": dict(ledger.reserved),
        "calls": dict(ledger.calls), "new_segments": _new_segments(segments0),
    }
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    mb = 1 / 2**20
    print(f"first graph: {first['first_graph_kept'] * mb:.1f} MiB kept, "
          f"{first['first_graph_after_destroy'] * mb:.1f} after destroy")
    print(f"device_bytes_family {doc['device_bytes_family'] * mb:.1f} MiB, reserved growth "
          f"{doc['reserved_growth'] * mb:.1f}, pool {family.pool_bytes * mb:.1f}, switch "
          f"{family.switch_bytes * mb:.1f}")
    print(f"{'phase':<24} {'calls':>6} {'outside MiB':>12} {'reserved MiB':>13}")
    for kind in ledger.calls:
        print(f"{kind:<24} {ledger.calls[kind]:>6} {ledger.outside[kind] * mb:>12.2f} "
              f"{ledger.reserved[kind] * mb:>13.2f}")
    print("segments made during the capture: pool, stream, type, count, MiB, MiB in use, "
          "largest block MiB")
    for g in doc["new_segments"]:
        print(f"  {g['pool']} {g['stream']:#x} {g['type']} {g['segments']} "
              f"{g['bytes'] * mb:.1f} {g['in_use'] * mb:.1f} {g['largest_block'] * mb:.1f}")
    family.close()


if __name__ == "__main__":
    main()
