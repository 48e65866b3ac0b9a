"""What placing a family's shapes costs on the host, shape after shape (no GPU): each shape of a
saved family (``families.py --keep-family``) fingerprinted and joined to its executable's
template as ``capture_family`` does, then a full collection under a frozen heap, as each
capture's is; mean milliseconds per 50 shapes.

``python benchmarks/family_place_cost.py FAMILY.json.gz`` (this repository's 2-core CPU
machine, 2026-12-01, on GPT-2 small's 255-shape family saved on the H200): placing took
41 to 48 ms a shape; the collection grew from 1.7 ms to 24.6 ms (about 0.09 ms per shape
kept). On the committed 16-length family
(``traces/h200_families/gpt2_small_decode_b1_kv240_255.capture_a.family.json.gz``), the
version before node versions (a worktree at 9352c90) and this one, one run each, same day:
29.0 ms a shape, then 3.6 (node versions, and ``match`` and the topology taken without
hashing where the graphs are one structure under the same ids, as a saved family's members
are; captures here are numbered in recording order, which the H200 has not yet confirmed).
"""

import gc
import sys
import time

from grape.familyio import load_family
from grape.passes.variants import Variants
from grape.torch.family import _Group, _place, _topology

saved = load_family(sys.argv[1])
shapes = sorted(saved.members, reverse=True)
groups, variants = {}, {}
gc.collect()
gc.freeze()
times = []
for s in shapes:
    ir = saved.graph(s)
    t = time.perf_counter()
    topo = _topology(groups, ir)
    key = _place(groups, variants, topo, s, ir)
    if key not in groups:
        groups[key] = _Group(s, ir, None, None, s)
        variants[key] = Variants(ir)
        variants[key].shapes[s] = {}
    t2 = time.perf_counter()
    gc.collect()
    times.append((t2 - t, time.perf_counter() - t2))
for a in range(0, len(times), 50):
    c = times[a:a + 50]
    print(a, f"place {sum(x for x, _ in c) / len(c) * 1000:.1f} ms "
             f"gc {sum(y for _, y in c) / len(c) * 1000:.1f} ms")
