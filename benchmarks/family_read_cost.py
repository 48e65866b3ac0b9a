"""What reading a saved family costs on the host (no GPU): ``grape.familyio.load_family`` on a
file, timed REPEATS times in one process, and the decoded family compared with one decoded
without reusing the templates' fields (``graph_from_json`` with no ``like``), operation by
operation. ``--members N``: first rewrite the file with N lengths, each taking the changes of
the file's length at its index modulo the file's count (as ``family_switch_cost.py`` does).

``python benchmarks/family_read_cost.py
traces/h200_families/gpt2_small_decode_b1_kv240_255.family.json.gz --members 255``
"""

import sys
import time
from pathlib import Path

from grape import familyio
from grape.irjson import graph_from_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_files import family_file

path = family_file()
repeats = 3
seconds = []
for _ in range(repeats):
    t = time.perf_counter()
    fast = familyio.load_family(path)
    seconds.append(time.perf_counter() - t)
plain_decode = familyio.graph_from_json
familyio.graph_from_json = lambda doc, like=None: graph_from_json(doc)
t = time.perf_counter()
plain = familyio.load_family(path)
plain_s = time.perf_counter() - t
familyio.graph_from_json = plain_decode
same = fast.members == plain.members and all(
    dict(fast.templates[k].ops()) == dict(plain.templates[k].ops()) for k in plain.templates)
print(f"{len(fast.members)} members: read in {' '.join(f'{s:.2f}' for s in seconds)} s "
      f"reusing the templates' fields, {plain_s:.2f} s decoding every field; "
      f"identical: {same}")
