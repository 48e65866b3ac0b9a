"""Where a family's capture time grows with its shapes (GPU): GPT-2 small decode over KV lengths
1..N (largest first), each shape's time in ``capture`` (warm-up, collection, PyTorch's
capture, the walk into the IR), in the walk alone, and in placing it (``_add_shape``:
fingerprint, join, delta), and the cycle collector's calls per capture; means per 50 shapes.

Written for the open question of 2026-12-01 (family capture 0.085 s a shape over 255 lengths,
0.31 s over 1,023, `benchmarks/README.md`). ``python benchmarks/family_capture_phases.py 400``
on the H200 at e8f2d07 (its output in
``benchmarks/results/families_warm_start_h200/family_capture_phases_400_e8f2d07.log``): 400
shapes in 57.0 s, the collections growing from 8.5 to 210 ms a shape while the other phases
stayed flat; fixed since by ``grape.torch.capture.full_collection``.
"""

import gc
import sys
import time

import grape.torch.capture as capture_module
import grape.torch.family as family_module

sys.path.insert(0, "benchmarks")
from families import _steps, gpt2_decode

N = int(sys.argv[1]) if len(sys.argv) > 1 else 400
w = gpt2_decode(1, list(range(1, N + 1)))
_steps(w.step, sorted(w.shapes), sync_each=False)
seconds: dict[str, list[float]] = {"capture": [], "walk": [], "place": [], "collect": []}


def timed(name, f):
    def run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            seconds[name].append(time.perf_counter() - t)
    return run


family_module.capture = timed("capture", family_module.capture)
family_module._add_shape = timed("place", family_module._add_shape)
capture_module.read_graph = timed("walk", capture_module.read_graph)
gc.collect = timed("collect", gc.collect)
t = time.perf_counter()
family_module.capture_family(w.step, sorted(w.shapes, reverse=True), params=w.params,
                             prepare=False)
print(f"{N} shapes in {time.perf_counter() - t:.1f} s; {len(gc.get_objects())} objects tracked")
per_capture = len(seconds["collect"]) / max(1, len(seconds["capture"]))
for a in range(0, N, 50):
    row = {k: v[a:a + 50] for k, v in seconds.items() if k != "collect"}
    collect = seconds["collect"][int(a * per_capture):int((a + 50) * per_capture)]
    print(f"shapes {a}..{a + 49}: " + " ".join(
        f"{k} {1000 * sum(v) / max(1, len(v)):.1f} ms" for k, v in row.items())
        + f" collections {1000 * sum(collect) / 50:.1f} ms a shape")
