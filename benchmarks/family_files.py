"""Saved families for the CPU benchmarks of a family's host work: the file a command names,
widened to more lengths with ``--members N``."""

import sys
import tempfile
from pathlib import Path

from grape.familyio import SavedFamily, load_family, save_family


def widened(saved: SavedFamily, count: int) -> SavedFamily:
    """``saved`` with ``count`` lengths 0..count-1, each taking the changes of the saved length
    at its index modulo the saved count (neighbours then differ as the saved ones do)."""
    real = [saved.members[s] for s in sorted(saved.members)]
    return SavedFamily(saved.templates, {i: real[i % len(real)] for i in range(count)},
                       saved.environment, saved.scratch)


def family_file(argv: list[str] = sys.argv) -> Path:
    """The file ``argv[1]`` names, or with ``--members N`` that family widened to N lengths and
    written to a temporary file (whose path is returned)."""
    path = Path(argv[1])
    if "--members" not in argv:
        return path
    count = int(argv[argv.index("--members") + 1])
    out = Path(tempfile.mkdtemp()) / "family.json.gz"
    save_family(out, widened(load_family(path), count))
    return out
