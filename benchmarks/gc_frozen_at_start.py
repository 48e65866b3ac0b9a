"""Whether this Python starts with objects frozen (``gc.freeze``), and what a full collection
costs with GPT-2 small loaded.

``python benchmarks/gc_frozen_at_start.py`` (H200 machine, Python 3.12.3, 2026-12-01;
run as a scratch file, tidied for lint since): 375
objects frozen at start, before any import; 474,761 objects with the model built; a full
collection 0.291 s, a collection of the two young generations 5 us.
"""

import gc
import sys
import time

print("start", gc.get_freeze_count(), sys.version)
import torch  # noqa: E402, F401

print("torch", gc.get_freeze_count())
import transformers  # noqa: E402, F401

print("transformers", gc.get_freeze_count())
sys.path.insert(0, "benchmarks")
from families import _steps, gpt2_decode  # noqa: E402

print("families", gc.get_freeze_count())
w = gpt2_decode(1, list(range(1, 9)))
print("workload", gc.get_freeze_count(), "objects", len(gc.get_objects()))
_steps(w.step, sorted(w.shapes), sync_each=False)
print("steps", gc.get_freeze_count())
t = time.perf_counter()
gc.collect()
print("full collect", time.perf_counter() - t)
t = time.perf_counter()
gc.collect(1)
print("collect(1)", time.perf_counter() - t)
