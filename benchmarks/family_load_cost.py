"""Where a warm start's host time goes, without a GPU: ``grape.torch.family.load_family``'s
steps on a saved family, each timed: reading the file, relocating each template onto itself
(here, the capture of the template in the loading process), moving every shape's node versions
(``relocate_variants``), and preparing the driver's calls for every kernel version
(``grape.cuda.build.version_updates`` for versions kept as rows, ``kernel_params`` for the
others, kernel handles stubbed). ``--members N`` as in ``family_files.py``.

``python benchmarks/family_load_cost.py
traces/h200_families/gpt2_small_decode_b1_kv240_255.family.json.gz --members 1023`` (this
repository's 2-core CPU machine, 2026-12-01). Before node versions (each member's changed
operations read, moved and coded one by one; members repeating the file's 16 exactly), four
runs: read 4.82-5.40 s, templates 0.12-0.13, members 6.57-7.29, prepare 1.21-1.29 (69,888
kernel updates), 12.8-13.8 s in all. With the members made distinct, the version before node
versions (a worktree at 9352c90, its own ``grape``) and this one alternating, two runs each:
before 16.55 and 15.97 s (read 6.47/6.33, members 8.55/8.10, prepare 1.39/1.42; 69,875 kernel
updates), after 0.92 and 0.91 s (read 0.25, templates 0.13, members 0.10, prepare 0.44; 63,551
kernel versions: members whose kernels have no argument word free of pointers stay alike and
share versions). With ``Update`` a named tuple rather than a frozen dataclass, two runs:
prepare 0.35 s, 0.76 and 0.77 s in all. The members here change 68 kernels each, GPT-2's real
lengths 1..1023 about 190 (run 7 in ``benchmarks/README.md``: 194,472 updates).
"""

import sys
import time
from pathlib import Path

import grape.cuda.build as build
from grape import familyio
from grape.passes.relocate import relocate_variants, relocation

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
t = timed("templates", t)
here = {}
for key, v in saved.variants.items():
    here[key], failed = relocate_variants(v, moved[key], v.template)
    assert not failed, failed
t = timed("members", t)
updates = 0
for v in here.values():
    for node, versions in v.nodes.items():
        if versions.rows:
            updates += len(build.version_updates(node, 0, versions)) - 1
        elif versions.template.kind == "kernel":
            for version in range(1, len(versions)):
                build.kernel_params(versions.op(version))
                updates += 1
t = timed("prepare", t)
print(f"{len(saved.shapes)} members, {updates} kernel versions prepared: "
      + ", ".join(f"{phase} {s:.2f} s" for phase, s in seconds.items())
      + f"; {sum(seconds.values()):.2f} s in all")
