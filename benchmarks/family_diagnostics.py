"""Two questions about a graph family of GPT-2 small decode (KV lengths 240..255), on a GPU.

``save``: which allocations the family's capture leaves alive. Captures the family with
PyTorch's memory history on, then groups the blocks still allocated by the C++ frames that
allocated them (the 12 groups holding the most bytes), and saves the family to
``$OUT/fam.json.gz``.

``load`` (in another process, after ``save``): why a saved template does not move onto the
same shape captured here. For the first template, every kernel node whose pointers lie at other
argument offsets in the two captures: the words that differ, as pointers or raw values (the
first four such nodes), and how many there are.

``$OUT`` defaults to ``/tmp``. Run on a GPU:
    python benchmarks/family_diagnostics.py save && python benchmarks/family_diagnostics.py load
"""

from __future__ import annotations

import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from families import _steps, gpt2_decode

from grape.torch.family import capture_family

LENGTHS = list(range(240, 256))


def live_blocks(out: str, w) -> None:
    torch.cuda.memory._record_memory_history(max_entries=200000)
    before = torch.cuda.memory_allocated()
    family = capture_family(w.step, sorted(LENGTHS, reverse=True), w.params)
    print("allocated growth", torch.cuda.memory_allocated() - before, "for", len(LENGTHS),
          "shapes")
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    blocks: collections.Counter[str] = collections.Counter()
    sizes: collections.Counter[str] = collections.Counter()
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            where = " | ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}"
                               for f in block.get("frames", [])[:12])
            blocks[where] += 1
            sizes[where] += block["size"]
    for where, _ in sizes.most_common(12):
        print(f"{sizes[where] / 2**20:9.2f} MiB {blocks[where]:5d} blocks  {where[:900]}")
    family.save(f"{out}/fam.json.gz", w.params)


def _word(args: bytes, offset: int) -> int:
    return int.from_bytes(args[offset:offset + 8], "little")


def refusal(out: str, w) -> None:
    from grape.familyio import load_family
    from grape.passes.families import match
    from grape.torch.capture import capture

    saved = load_family(f"{out}/fam.json.gz")
    key, template = next(iter(saved.templates.items()))
    first = next(s for s, (k, changes) in saved.members.items() if k == key and not changes)
    fresh = capture(lambda: w.step(first), params=w.params, instantiate=False,
                    collect=False).ir
    nodes = match(template, fresh)
    differing = 0
    for old_node, new_node in nodes.items():
        old, new = template.op(old_node), fresh.op(new_node)
        if not hasattr(old, "pointers"):
            continue
        here = {p.offset: p for p in new.pointers}
        there = {p.offset: p for p in old.pointers}
        if set(here) == set(there):
            continue
        differing += 1
        if differing > 4:
            continue
        print("node", old_node, old.name[:120], "args", len(old.args))
        for offset in sorted(set(here) ^ set(there)):
            a = f"ptr {there[offset].target}" if offset in there else hex(_word(old.args,
                                                                                 offset))
            b = f"ptr {here[offset].target}" if offset in here else hex(_word(new.args,
                                                                              offset))
            print(f"   offset {offset}: saved {a} | here {b}")
        print("   saved pointers:", {p.offset: str(p.target) for p in old.pointers})
        print("   here pointers: ", {p.offset: str(p.target) for p in new.pointers})
    print("template", first, "nodes with other pointer offsets:", differing, "of", len(nodes))


def main() -> None:
    out = os.environ.get("OUT", "/tmp")
    w = gpt2_decode(1, LENGTHS)
    _steps(w.step, sorted(LENGTHS), sync_each=False)
    {"save": live_blocks, "load": refusal}[sys.argv[1]](out, w)


if __name__ == "__main__":
    main()
