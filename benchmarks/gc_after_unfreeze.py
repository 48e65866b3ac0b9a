"""What a family's first pass paid for objects unfrozen at the end of its capture (no GPU).

Shapes of ~1,200 tracked objects each (about what a GPT-2 shape keeps) are made inside
``grape.torch.capture.frozen_heap`` with a full collection before each (as captures do), then a
pass of 1,023 steps allocates a little each (a switch's list, cached), timing the oldest
generation's collections. With ``--settle``, the heap is settled as capture_family now settles
it (``frozen_heap(settle=True)``: one full collection at the end).

``python benchmarks/gc_after_unfreeze.py 1023`` and ``... 1023 --settle`` (this repository's
2-core CPU machine, Python 3.11, 2026-12-01): 0.205 s with one full collection of 0.187 s in
the pass, and 0.019 s with none.
"""

import gc
import sys
import time

from grape.torch.capture import frozen_heap, full_collection

spent = [0.0, 0]
_start = [0.0]


def _timed(phase: str, info: dict) -> None:
    if info["generation"] != 2:
        return
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        spent[0] += time.perf_counter() - _start[0]
        spent[1] += 1


class Delta:
    __slots__ = ("node", "words")

    def __init__(self, node, words):
        self.node, self.words = node, words


shapes = int(sys.argv[1]) if len(sys.argv) > 1 else 1023
settle = "--settle" in sys.argv
gc.callbacks.append(_timed)
kept = []
with frozen_heap(settle=settle):
    for _ in range(shapes):
        full_collection()
        kept.append([Delta(i, [i]) for i in range(600)])
spent[:] = [0.0, 0]
t = time.perf_counter()
switches = {}
for step in range(1023):
    switches[step] = [[j] for j in range(90)]
print(f"{shapes} shapes kept, settle={settle}: a pass of 1023 steps took "
      f"{time.perf_counter() - t:.3f} s, {spent[1]} full collections in it taking "
      f"{spent[0]:.3f} s")
