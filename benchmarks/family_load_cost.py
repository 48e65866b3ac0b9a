"""Where a warm start's host time goes, without a GPU: ``grape.torch.family.load_family``'s
steps on a saved family, each timed: reading the file, relocating each template onto itself
(here, the capture of the template in the loading process), moving and joining each member
(``relocate_all``, ``join_changes``), and preparing every node update with the driver's
parameter structs (``grape.cuda.build.kernel_params``, kernel handles stubbed). ``--members N``
as in ``family_switch_cost.py``.

``python benchmarks/family_load_cost.py
traces/h200_families/gpt2_small_decode_b1_kv240_255.family.json.gz --members 1023`` (this
repository's 2-core CPU machine, 2026-12-01, at the commit that added it; four runs): read
4.82-5.40 s, templates 0.12-0.13, members 6.57-7.29, prepare 1.21-1.29 (69,888 kernel
updates), 12.8-13.8 s in all. The members here change 68 kernels each, GPT-2's real lengths
1..1023 about 190 (run 7 in ``benchmarks/README.md``: 194,472 updates).
"""

import sys
import time
from pathlib import Path

import grape.cuda.build as build
from grape import familyio
from grape.passes.delta import join_changes
from grape.passes.relocate import relocate_all, relocation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_files import family_file

build.resolve = lambda function: 0  # no driver here: every kernel handle is 0
path = family_file()
seconds: dict[str, float] = {}


def timed(phase: str, began: float) -> float:
    now = time.perf_counter()
    seconds[phase] = now - began
    return now


t = time.perf_counter()
saved = familyio.load_family(path)
t = timed("read", t)
moved = {key: relocation(g, g) for key, g in saved.templates.items()}
mappings = {key: tuple((n, n) for n in g.dag) for key, g in saved.templates.items()}
t = timed("templates", t)
ops, deltas = {}, {}
for shape, (key, changes) in saved.members.items():
    ops[shape] = relocate_all(changes, moved[key])
    deltas[shape] = join_changes(saved.templates[key], ops[shape], mappings[key])
t = timed("members", t)
updates = 0
for shape in saved.members:
    for nd in deltas[shape].nodes:
        op = ops[shape].get(nd.node)
        if op is not None and op.kind == "kernel":
            build.kernel_params(op)
            updates += 1
t = timed("prepare", t)
print(f"{len(saved.members)} members, {updates} kernel updates: "
      + ", ".join(f"{phase} {s:.2f} s" for phase, s in seconds.items())
      + f"; {sum(seconds.values()):.2f} s in all")
