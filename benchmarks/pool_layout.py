"""Where a captured step's temporaries land in its pool, length by length (GPU): what deriving
a family from one length in many would need.

Derivation at one KV length in 32 derived nothing on the H200 (benchmarks/README.md, runs 18 to
21): pointers into the graphs' pool are affine in the length only between the lengths where
the allocator lays the step's temporaries out differently. Two ways out need facts this
records: a pool whose layout is the largest length's at every length (a planned pool), which
needs every length to make the same allocations in the same order; or the allocator's
placement predicted by replaying its rules (``grape.sim.memory.Pool``), which needs a replay
that puts each block where PyTorch did. GPT-2 small's decode step is captured at each length
into a private pool of its own (``torch.cuda.graph``, as plain per-shape graphs), with the
allocator's history recorded around the capture, and for the lengths together this reports:

- ``same_sequence``: whether every length makes the allocations and frees of the largest, in
  its order (and where the first that does not parts from it);
- ``not_affine``: allocations whose size is not affine in the length within a residue class
  modulo ``--period``;
- ``moved``: allocations whose place (segment, offset) differs from the largest length's, and
  at how many lengths;
- ``misplaced_by_replay``: per length, the allocations that ``grape.sim.memory.Pool``,
  replaying that length's mallocs and frees, puts elsewhere than PyTorch did.

On the H200 (``results/families_warm_start_h200/pool_layout_ac0ebfb.json``, lengths 1..1017
step 8): the same sequence of 340 allocations at every length, every size affine in its class,
257 allocations placed elsewhere than at the largest length, and none misplaced by the replay.
``python benchmarks/pool_layout.py [--lengths 1:1023:8] [--period 8] [--out F]``
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from grape.sim.memory import Pool

Event = tuple[str, int, int]  # ("alloc" | "free", block's place, size): see events()


def events(trace: Sequence[Mapping[str, Any]]) -> tuple[list[Event], list[tuple[int, int]]]:
    """One capture's allocator history as ("alloc", i, size) and ("free", i, 0), ``i``
    numbering allocations in order, and each allocation's place: (the segment it lies in,
    segments numbered as the capture made them, its offset there). A block is reusable once
    its free completes, so frees are taken at ``free_completed``."""
    segments: list[tuple[int, int]] = []  # (address, size) in order made
    out: list[Event] = []
    places: list[tuple[int, int]] = []
    live: dict[int, int] = {}  # address -> allocation number
    for e in trace:
        action = e["action"]
        if action == "segment_alloc":
            segments.append((e["addr"], e["size"]))
        elif action == "alloc":
            seg = next((i for i, (a, s) in enumerate(segments) if a <= e["addr"] < a + s), None)
            if seg is None:  # a block of a segment made before the capture: not the pool's
                continue
            live[e["addr"]] = len(places)
            out.append(("alloc", len(places), e["size"]))
            places.append((seg, e["addr"] - segments[seg][0]))
        elif action == "free_completed" and e["addr"] in live:
            out.append(("free", live.pop(e["addr"]), 0))
    return out, places


def _affine(points: list[tuple[int, int]]) -> bool:
    if len(points) < 3:
        return True  # two points make a line: nothing to say
    (x0, y0), (x1, y1) = points[0], points[1]
    slope = Fraction(y1 - y0, x1 - x0)
    return all(y0 + slope * (x - x0) == y for x, y in points[2:])


def replayed(sequence: list[Event]) -> list[tuple[int, int]]:
    """Where ``grape.sim.memory.Pool`` puts each allocation of ``sequence``."""
    pool, handles, places = Pool(), {}, []
    for action, i, size in sequence:
        if action == "alloc":
            handles[i] = pool.malloc(size)
            places.append(handles[i])
        else:
            pool.free(handles.pop(i))
    return places


def report(traces: Mapping[int, Sequence[Mapping[str, Any]]], period: int = 8) -> dict:
    """What the module says, from each length's allocator history."""
    got = {n: events(t) for n, t in traces.items()}
    largest = max(got)
    shape = [(a, i) for a, i, _ in got[largest][0]]
    parted = {n: next((k for k, (x, y) in enumerate(zip(shape, [(a, i) for a, i, _ in seq],
                                                          strict=False)) if x != y),
                      None if len(seq) == len(shape) else min(len(seq), len(shape)))
              for n, (seq, _) in got.items()}
    alike = sorted(n for n, k in parted.items() if k is None)
    sizes: dict[int, dict[int, list[tuple[int, int]]]] = {}  # allocation -> class -> points
    moved: dict[int, int] = {}
    for n in alike:
        seq, places = got[n]
        for action, i, size in seq:
            if action == "alloc":
                sizes.setdefault(i, {}).setdefault(n % period, []).append((n, size))
        for i, place in enumerate(places):
            if place != got[largest][1][i]:
                moved[i] = moved.get(i, 0) + 1
    not_affine = sorted(i for i, classes in sizes.items()
                        if not all(_affine(sorted(p)) for p in classes.values()))
    misplaced = {n: sum(a != b for a, b in zip(replayed(seq), places, strict=True))
                 for n, (seq, places) in got.items()}
    return {
        "lengths": sorted(got), "allocations_at_largest": len(got[largest][1]),
        "same_sequence": len(alike) == len(got),
        "parted": {str(n): k for n, k in sorted(parted.items()) if k is not None},
        "not_affine": not_affine,
        "moved": {str(i): c for i, c in sorted(moved.items())},
        "misplaced_by_replay": {str(n): c for n, c in sorted(misplaced.items())},
    }


def main() -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from families import MAX_LEN, _range, gpt2_decode

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1:1023:8", help="first:last[:stride] KV lengths")
    parser.add_argument("--period", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, metavar="FILE")
    args = parser.parse_args()
    lengths = _range(args.lengths, "KV lengths", 1, MAX_LEN - 1)
    w = gpt2_decode(1, lengths)
    side = torch.cuda.Stream()
    traces, graphs = {}, []
    for n in sorted(lengths, reverse=True):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            w.step(n)  # warm-up outside capture, on the capture's stream
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(context=None, stacks="python",
                                                 clear_history=True)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            w.step(n)
        traces[n] = [dict(e) for e in torch.cuda.memory._snapshot()["device_traces"][
            torch.cuda.current_device()]]
        torch.cuda.memory._record_memory_history(enabled=None)
        graphs.append(g)  # kept: a graph's pool lives as long as the graph
    got = report(traces, args.period)
    got.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
               command=" ".join(sys.argv))
    print(json.dumps({k: v for k, v in got.items() if k not in ("moved", "parted")}))
    print(f"{len(lengths)} lengths, {got['allocations_at_largest']} allocations at the "
          f"largest; same sequence at every length: {got['same_sequence']}; sizes not affine "
          f"in their class: {len(got['not_affine'])}; allocations placed elsewhere than at "
          f"the largest: {len(got['moved'])}; misplaced by the replay, most at one length: "
          f"{max(got['misplaced_by_replay'].values(), default=0)}")
    if args.out:
        args.out.write_text(json.dumps(got, indent=1) + "\n")


if __name__ == "__main__":
    main()
