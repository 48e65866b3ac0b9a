"""Where a captured step's temporaries land in its pool, length by length (GPU): what deriving
a family from one length in many would need.

Derivation at one KV length in 32 derived nothing on the H200 (benchmarks/README.md, runs 18 to
21): pointers into the graphs' pool are affine in the length only between the lengths where
the allocator lays the step's temporaries out differently. Two ways out need facts this
records: a pool whose layout is the largest length's at every length (a planned pool), which
needs every length to make the same allocations in the same order; or the allocator's
placement predicted by replaying its rules (``grape.sim.memory.Pool``), which needs a replay
that puts each block where PyTorch did. GPT-2 small's decode step is captured at each length
into a private pool of its own (as plain per-shape graphs; through ``grape.torch.capture``
since the run below, to mark its operations), with the allocator's history recorded around the
capture, and for the lengths together this reports:

- ``same_sequence``: whether every length makes the allocations and frees of the largest, in
  its order (and where the first that does not parts from it);
- ``not_affine``: allocations whose size is not affine in the length within a residue class
  modulo ``--period``;
- ``moved``: allocations whose place (segment, offset) differs from the largest length's, and
  at how many lengths;
- ``misplaced_by_replay``: per length, the allocations that ``grape.sim.memory.Pool``,
  replaying that length's mallocs and frees, puts elsewhere than PyTorch did;
- ``places``: how many captures ``grape.passes.places`` moved to the places of the first
  (largest) capture that allocated alike, and why it refused the others (each capture marks
  where its operations start and records its history, ``capture(marks=True)``, as
  ``capture_family(same_places=True)``'s do).

On the H200 (``results/families_warm_start_h200/pool_layout_ac0ebfb.json``, lengths 1..1017
step 8, so all 1 modulo 8; lengths 7 modulo 8 allocate otherwise, run 22 found): the same
sequence of 340 allocations at every length, every size affine in its class,
257 allocations placed elsewhere than at the largest length, and none misplaced by the replay
(that run captured through ``torch.cuda.graph``, before ``places`` was reported). Through
``grape.torch.capture`` with marks (``pool_layout_72ad2ff.json``, lengths 1..1023 step 7,
every residue): two ways of allocating (328 allocations at the largest), sizes affine, none
misplaced by the replay, and ``places`` moved 145 of 145 captures to the two references'
places, refusing none; its histories are ``traces/h200_pool/``.
``python benchmarks/pool_layout.py [--lengths 1:1023:7] [--period 8] [--out F] [--histories H]``
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import sys
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path

from grape.passes.places import History
from grape.sim.memory import Pool

Event = tuple[str, int, int]  # ("malloc" | "free", block number, size): History.requests()


def events(history: History) -> tuple[list[Event], list[tuple[int, int]]]:
    """One capture's allocator history as ``Pool.run`` takes it, and each allocation's place:
    (the segment it lies in, segments numbered as the capture made them, its offset there)."""
    return history.requests(), history.placed()


def _affine(points: list[tuple[int, int]]) -> bool:
    if len(points) < 3:
        return True  # two points make a line: nothing to say
    (x0, y0), (x1, y1) = points[0], points[1]
    slope = Fraction(y1 - y0, x1 - x0)
    return all(y0 + slope * (x - x0) == y for x, y in points[2:])


def report(histories: Mapping[int, History], period: int = 8) -> dict:
    """What the module says, from each length's allocator history."""
    got = {n: events(h) for n, h in histories.items()}
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
            if action == "malloc":
                sizes.setdefault(i, {}).setdefault(n % period, []).append((n, size))
        for i, place in enumerate(places):
            if place != got[largest][1][i]:
                moved[i] = moved.get(i, 0) + 1
    not_affine = sorted(i for i, classes in sizes.items()
                        if not all(_affine(sorted(p)) for p in classes.values()))
    misplaced = {n: sum(a != b for a, b in zip(Pool().placements(seq), places, strict=True))
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

    from grape.errors import UnsupportedError
    from grape.ir import BufferRole
    from grape.passes.places import to_reference
    from grape.torch.capture import capture, capture_stream

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from families import MAX_LEN, _range, gpt2_decode

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1:1023:7",
                        help="first:last[:stride] KV lengths (the default's stride, 7, meets "
                             "every residue modulo 8)")
    parser.add_argument("--period", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, metavar="FILE")
    parser.add_argument("--histories", type=Path, default=None, metavar="FILE.json.gz",
                        help="also write every length's allocator history (its acts, blocks "
                             "and segments), for checking grape.sim.memory.Pool on the CPU")
    args = parser.parse_args()
    lengths = _range(args.lengths, "KV lengths", 1, MAX_LEN - 1)
    w = gpt2_decode(1, lengths)
    side = capture_stream()
    histories, graphs = {}, []
    references: dict[tuple, tuple] = {}  # acts -> (history, buffers) of its first capture
    moved: dict[int, int] = {}  # length -> pointers moved to its reference's places
    refused: dict[int, str] = {}
    for n in sorted(lengths, reverse=True):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            w.step(n)  # warm-up outside capture, on the capture's stream
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        cap = capture(lambda n=n: w.step(n), params=w.params, warmup=0, instantiate=False,
                      collect=False, pool=torch.cuda.graph_pool_handle(), marks=True)
        if cap.history is None:
            raise SystemExit("expected to record the allocator's history, found the process "
                             "recording it already")
        histories[n] = history = cap.history
        if history.acts not in references:
            references[history.acts] = (history, [b for b in cap.ir.buffers.values()
                                                  if b.role is BufferRole.INTERNAL])
        else:
            try:
                moved[n] = to_reference(cap.ir, history, *references[history.acts],
                                        marks=cap.marks).moved
            except UnsupportedError as e:
                refused[n] = str(e)
        graphs.append(cap.torch_graph)  # kept: a graph's pool lives as long as the graph
    got = report(histories, args.period)
    got["places"] = {"references": len(references), "moved": len(moved),
                     "pointers_moved": sum(moved.values()), "refused": len(refused),
                     "why": {str(n): why for n, why in sorted(refused.items())}}
    got.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
               command=" ".join(sys.argv))
    print(json.dumps({k: v for k, v in got.items() if k not in ("moved", "parted", "places")}))
    print(f"{len(lengths)} lengths, {got['allocations_at_largest']} allocations at the "
          f"largest; same sequence at every length: {got['same_sequence']}; sizes not affine "
          f"in their class: {len(got['not_affine'])}; allocations placed elsewhere than at "
          f"the largest: {len(got['moved'])}; misplaced by the replay, most at one length: "
          f"{max(got['misplaced_by_replay'].values(), default=0)}")
    print(f"moved to a reference's places (grape.passes.places, {len(references)} "
          f"references): {len(moved)} captures, {sum(moved.values())} pointers; refused "
          f"{len(refused)}" + (f", the first: {next(iter(refused.values()))}" if refused
                              else ""))
    if args.out:
        args.out.write_text(json.dumps(got, indent=1) + "\n")
    if args.histories:
        with gzip.open(args.histories, "wt") as f:
            json.dump({"device": got["device"], "torch": got["torch"], "command": got["command"],
                       "histories": {str(n): dataclasses.asdict(h)
                                     for n, h in sorted(histories.items())}}, f)


if __name__ == "__main__":
    main()
