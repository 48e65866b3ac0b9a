"""The analysis of benchmarks/pool_layout.py: allocator histories made up here, in
torch.cuda.memory._snapshot()'s trace format, read by grape.passes.places.History."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from grape.passes.places import History

_SPEC = importlib.util.spec_from_file_location(
    "pool_layout", Path(__file__).resolve().parent.parent / "benchmarks" / "pool_layout.py")
pool_layout = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(pool_layout)

BASE = 0x7F00_0000_0000


def _trace(n: int, *, past: bool = False) -> list[dict]:
    """A capture at length ``n``: a 2 MiB segment; a temporary of 512 * n bytes, one of 512
    after it, the first freed, and another of 512 in the freed block (best fit); ``past``
    puts the last past the second instead, which no replay of those rules does."""
    a, b = BASE, BASE + 512 * n
    c = b + 512 if past else BASE
    return [
        {"action": "segment_alloc", "addr": BASE, "size": 2 << 20},
        {"action": "alloc", "addr": a, "size": 512 * n},
        {"action": "alloc", "addr": b, "size": 512},
        {"action": "free_requested", "addr": a, "size": 512 * n},
        {"action": "free_completed", "addr": a, "size": 512 * n},
        {"action": "alloc", "addr": c, "size": 512},
    ]


def test_a_layout_that_moves_with_the_length_and_a_replay_that_reproduces_it():
    got = pool_layout.report({n: History.of_trace(_trace(n)) for n in (8, 16, 24, 32)},
                             period=8)
    assert got["same_sequence"] and got["parted"] == {}
    assert got["allocations_at_largest"] == 3
    assert got["not_affine"] == []  # 512 n, and 512
    assert got["moved"] == {"1": 3}  # the second block follows the first's size
    assert set(got["misplaced_by_replay"].values()) == {0}


def test_what_a_replay_misplaces_and_a_sequence_that_parts_are_counted():
    traces = {n: _trace(n) for n in (8, 16, 24)}
    traces[16] = _trace(16, past=True)
    traces[24] = traces[24][:-1]  # one allocation fewer: the sequence parts at its end
    got = pool_layout.report({n: History.of_trace(t) for n, t in traces.items()}, period=8)
    assert got["misplaced_by_replay"]["16"] == 1 and got["misplaced_by_replay"]["8"] == 0
    assert got["misplaced_by_replay"]["24"] == 0
    assert not got["same_sequence"]
    assert got["parted"] == {"8": 3, "16": 3}  # from event 3 on: the largest (24) lacks it
