"""What building one switch between two shapes costs a family on the host (no GPU): each
consecutive pair of lengths of a saved family (``families.py --keep-family``), its updates
prepared by the tests' stand-in for the driver, then ``Family._switch`` timed over the pairs
(what a family's first pass pays per step before its switches are cached). ``--members N``
makes a family of N lengths out of the file's, each length taking the changes of the file's
length at its index modulo the file's count (neighbours then differ as the file's do).

``python benchmarks/family_switch_cost.py FAMILY.json.gz`` (this repository's 2-core CPU
machine, 2026-12-01, GPT-2 small's 255-shape family saved on the H200): 191 pairs, 232 and
251 us each in two runs. With the committed 16-length family, ``python
benchmarks/family_switch_cost.py traces/h200_families/gpt2_small_decode_b1_kv240_255.family.json.gz
--members 255`` (same machine and day, two runs each): 205 and 202 us a switch before it
compared the deltas' hashes first, 65 and 68 us after, 52 and 47 once it looked its prepared
updates up in place.
"""

import itertools
import sys
import time
from pathlib import Path

from grape.familyio import load_family
from grape.ir import fingerprint
from grape.passes.variants import Variants
from grape.torch.family import Family, _Group, _place

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_files import widened

from tests.standins import RecordingGraph

saved = load_family(sys.argv[1])
if "--members" in sys.argv:
    saved = widened(saved, int(sys.argv[sys.argv.index("--members") + 1]))
shapes = sorted(saved.members, reverse=True)
groups, variants, group_of = {}, {}, {}
for s in shapes:
    ir = saved.graph(s)
    key = group_of[s] = _place(groups, variants, fingerprint(ir, launch=False), s, ir)
    if key not in groups:
        groups[key] = _Group(s, ir, RecordingGraph([]), None, s)
        variants[key] = Variants(ir)
        variants[key].shapes[s] = {}
family = Family(lambda s: None, groups, group_of, variants, 0, 0.0)
family.prepare_updates()
order = sorted(shapes)
pairs = [(a, b) for a, b in itertools.pairwise(order) if group_of[a] == group_of[b]]
t = time.perf_counter()
for a, b in pairs:
    family._switch(group_of[a], a, b)
print(f"_switch: {len(pairs)} pairs, {(time.perf_counter() - t) / len(pairs) * 1e6:.0f} us each")
