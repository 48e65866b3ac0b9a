"""Does a capture's memory layout repeat? Two captures of one shape, in one process and in two.

GPT-2 small decode (``families.py``'s workload) at KV length 255, after an eager pass over
lengths 1..255 (``HIST=full``; otherwise over 255 and 200 only). With PyTorch's memory history
on (no stacks), ``step(255)`` is captured twice into fresh pools, first without and then with
a full ``gc.collect()`` before each capture. For each pair: the allocator's events in each
capture (allocations and frees with their sizes, segments, and offsets within their
segments), the order of each capture's new segments by address, whether the two event
sequences are the same, where they first differ, and whether
``grape.passes.relocate.relocation`` maps one capture's IR onto the other's. ``A`` writes the
first capture of each mode (IR and events) to ``$OUT`` (``/tmp`` without it); ``B``, run after
``A`` in another process, also compares its own first captures with those.

Run on a GPU: HIST=full python benchmarks/capture_layout.py A && HIST=full python
benchmarks/capture_layout.py B

It ran at 89ec7e8, where ``capture()`` paused the collector but did not collect before
capturing (H200, both with and without ``HIST=full``): without the collection, the first
capture made 1261 allocator events (1256 without ``HIST``) and the second 1251 (1250), their
first allocations at other places, and relocation between them refused ("expected one buffer
here for saved ..."); with it, 1251 and 1251 (1250, 1250), the same sequence at the same
offsets, relocation mapped; across the two processes each mode's first captures matched. Since
6fe8b7b ``capture()`` collects before every capture itself, so the two modes no longer differ.
The first capture of each process was also its first capture ever, which alone may explain the
10 extra events (see ``grape/torch/capture.py`` on the warm-up stream).
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from families import _steps, gpt2_decode

from grape.errors import UnsupportedError
from grape.irjson import graph_from_json, graph_to_json
from grape.passes.relocate import relocation
from grape.torch.capture import capture

LENGTH = 255


def traced_capture(w, collect: bool):
    """One capture of ``step(LENGTH)`` into a fresh pool, and the allocator events it made."""
    before = len(torch.cuda.memory._snapshot()["device_traces"][0])
    if collect:
        gc.collect()
    cap = capture(lambda: w.step(LENGTH), params=w.params, pool=torch.cuda.graph_pool_handle(),
                  instantiate=False, collect=False)
    return cap, torch.cuda.memory._snapshot()["device_traces"][0][before:]


def layout(events) -> list[tuple]:
    """Each event as (action, size, segment by order of allocation, offset in the segment)."""
    segments: dict[int, int] = {}
    out = []
    for e in events:
        if e["action"] == "segment_alloc":
            segments[e["addr"]] = len(segments)
            out.append(("segment", e["size"], segments[e["addr"]], 0))
        if e["action"] in ("alloc", "free_completed"):
            base = max((a for a in segments if a <= e["addr"]), default=None)
            out.append((e["action"], e["size"], segments.get(base),
                        e["addr"] - base if base is not None else None))
    return out


def _address_order(events) -> list[int]:
    """The capture's new segments, numbered in the order they were allocated, listed by
    address: [0, 1, 2, ...] where the driver handed out rising addresses. The allocator breaks
    ties between free blocks of one size by address, so two captures whose segments come in
    another address order may place a tensor in another block (a hypothesis for the warm
    start's refusals; added after the run the docstring reports)."""
    segments = [e["addr"] for e in events if e["action"] == "segment_alloc"]
    return sorted(range(len(segments)), key=segments.__getitem__)


def _relocates(saved, fresh) -> str:
    try:
        relocation(saved, fresh)
        return "ok"
    except UnsupportedError as e:
        return str(e)[:300]


def _first_difference(a: list, b: list) -> int | None:
    """The first index where the two differ (one ending counts); None where they are equal."""
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return min(len(a), len(b)) if first is None and len(a) != len(b) else first


def main() -> None:
    role, out = sys.argv[1], os.environ.get("OUT", "/tmp")
    full = os.environ.get("HIST") == "full"
    lengths = list(range(1, 256)) if full else [LENGTH, 200, LENGTH]
    w = gpt2_decode(1, sorted(set(lengths)))
    _steps(w.step, lengths, sync_each=False)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(context=None, stacks="python",
                                             max_entries=1_000_000)
    report, keep = {}, []
    for mode in ("no collection", "collected"):
        (c1, e1), (c2, e2) = (traced_capture(w, mode == "collected") for _ in range(2))
        keep += [c1, c2]  # their pools stay, as a family's would
        s1, s2 = layout(e1), layout(e2)
        first = _first_difference(s1, s2)
        row = dict(segment_address_order=(_address_order(e1), _address_order(e2)),
                   events=(len(s1), len(s2)), same_sizes=[x[:2] for x in s1] == [x[:2] for x in s2],
                   same_layout=s1 == s2, first_difference=first,
                   around=None if first is None else [s1[first:first + 3], s2[first:first + 3]],
                   relocation=_relocates(c1.ir, c2.ir))
        slug = mode.replace(" ", "_")
        if role == "A":
            with open(f"{out}/layout_{slug}.json", "w") as f:
                json.dump(graph_to_json(c1.ir), f)
            with open(f"{out}/layout_events_{slug}.json", "w") as f:
                json.dump(s1, f)
        else:
            with open(f"{out}/layout_{slug}.json") as f:
                saved = graph_from_json(json.load(f))
            with open(f"{out}/layout_events_{slug}.json") as f:
                saved_events = [tuple(x) for x in json.load(f)]
            first = _first_difference(saved_events, s1)
            row.update(cross_process=_relocates(saved, c1.ir),
                       cross_same_layout=saved_events == s1, cross_first_difference=first)
        report[mode] = row
    print(role, json.dumps(report, default=str))


if __name__ == "__main__":
    main()
