"""What reading a saved family costs on the host (no GPU): ``grape.familyio.load_family`` on a
file, timed REPEATS times in one process, and a sample of the shapes read back compared with
the family that was written, graph by graph. ``--members N``: first rewrite the file with N
lengths (``family_files.py``).

``python benchmarks/family_read_cost.py
traces/h200_families/gpt2_small_decode_b1_kv240_255.family.json.gz --members 255``
(this repository's 2-core CPU machine, 2026-12-01): version 1 files (each member's changed
operations in full) read in 1.4-1.6 s reusing the templates' fields, 2.4 s decoding every
field; version 2 (node versions as arrays, ``grape.familyio``): see the commit that wrote it.
"""

import sys
import time
from pathlib import Path

from grape import familyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_files import family_file, widened

path = family_file()
repeats = 3
seconds = []
for _ in range(repeats):
    t = time.perf_counter()
    read = familyio.load_family(path)
    seconds.append(time.perf_counter() - t)
written = familyio.load_family(sys.argv[1])
if "--members" in sys.argv:
    written = widened(written, int(sys.argv[sys.argv.index("--members") + 1]))
shapes = list(written.shapes)
sample = shapes[::max(1, len(shapes) // 16)] + shapes[-1:]
same = list(read.shapes) == shapes and all(read.graph(s) == written.graph(s) for s in sample)
print(f"{len(read.shapes)} shapes ({path.stat().st_size} bytes): read in "
      f"{' '.join(f'{s:.2f}' for s in seconds)} s; {len(sample)} shapes compared, identical: "
      f"{same}")
