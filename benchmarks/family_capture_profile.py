"""Where a family's capture time goes (GPU): cProfile over ``capture_family`` for GPT-2 small
decode at KV lengths 1..32, after timing one allocator snapshot (``live_blocks``).

``python benchmarks/family_capture_profile.py`` (H200, 2026-12-01, on the working tree that
became 673ca81 before its ``frozen_heap`` change; run as a scratch file, tidied for lint
since): ``live_blocks`` found 177 blocks in 1 ms; capture took 0.39 s a shape, 8.07 of the
profiled 12.4 s in 64 calls of ``gc.collect`` (0.126 s each): ``frozen_heap`` then left a
heap the caller had frozen alone, and this machine's Python starts with objects frozen
(``gc_frozen_at_start.py``).
"""

import cProfile
import pstats
import sys
import time

import torch

from grape.torch.capture import live_blocks
from grape.torch.family import capture_family

sys.path.insert(0, "benchmarks")
from families import _steps, gpt2_decode

w = gpt2_decode(1, list(range(1, 33)))
_steps(w.step, sorted(w.shapes), sync_each=False)
t = time.perf_counter()
b = live_blocks()
print("live_blocks", len(b), f"{time.perf_counter() - t:.3f} s")
t = time.perf_counter()
s = torch.cuda.memory._snapshot()
print("snapshot segments", len(s["segments"]), sum(len(x["blocks"]) for x in s["segments"]),
      f"{time.perf_counter() - t:.3f} s")
pr = cProfile.Profile()
pr.enable()
fam = capture_family(w.step, sorted(w.shapes, reverse=True), params=w.params)
pr.disable()
print("capture_s", fam.capture_s, "per shape", fam.capture_s / 32, "scratch", sorted(fam.scratch))
pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
