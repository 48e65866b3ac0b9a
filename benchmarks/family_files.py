"""Saved families for the CPU benchmarks of a family's host work: the file a command names,
widened to more lengths with ``--members N``."""

import dataclasses
import sys
import tempfile
from pathlib import Path

from grape.familyio import SavedFamily, load_family, save_family
from grape.ir import Kernel, Op


def widened(saved: SavedFamily, count: int) -> SavedFamily:
    """``saved`` with ``count`` lengths 0..count-1, each taking the changes of the saved length
    at its index modulo the saved count (neighbours then differ as the saved ones do).

    Every copy after the first has its changed kernels' arguments made its own (the copy's
    number written into the first 4 bytes no pointer covers): real lengths share few changed
    operations (121 of the 1,245 of GPT-2 small's 16 committed lengths,
    ``traces/h200_families``), and a family that keeps each distinct one once would find
    plain repeats far cheaper than real lengths."""
    real = [saved.members[s] for s in sorted(saved.members)]
    members = {}
    for i in range(count):
        key, changes = real[i % len(real)]
        copy = i // len(real)
        members[i] = (key, {node: _distinct(op, copy) for node, op in changes.items()}
                      if copy else changes)
    return SavedFamily.from_members(saved.templates, members, saved.environment, saved.scratch)


def _distinct(op: Op, copy: int) -> Op:
    if not isinstance(op, Kernel):
        return op
    covered = {o for p in op.pointers for o in range(p.offset, p.offset + 8)}
    free = next((o for o in range(0, len(op.args) - 3, 4)
                 if not covered & set(range(o, o + 4))), None)
    if free is None:
        return op
    args = bytearray(op.args)
    args[free:free + 4] = (int.from_bytes(args[free:free + 4], "little") ^ copy).to_bytes(
        4, "little")
    return dataclasses.replace(op, args=bytes(args))


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
