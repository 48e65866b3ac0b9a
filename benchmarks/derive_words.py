"""Why a GPT-2 decode family's lengths do not derive (no GPU): on a saved family, the numbers
that vary across the lengths of one executable (``grape.passes.derive``: argument words,
pointer offsets, sizes), how many lie on one line in the length, how many of the rest are the
magic numbers of PyTorch's fast integer division (``IntDivider``: a divisor, its multiplier
and its shift, as three 32-bit words), and, by kernel, where the rest are.

``python benchmarks/derive_words.py
traces/h200_families/gpt2_small_decode_b1_kv240_255.family.json.gz``
"""

import collections
import struct
import sys

from grape.familyio import load_family
from grape.passes.derive import _divider, derive


def _halves_explained(graphs, node: str, word: int) -> bool:
    """Every 32-bit half of argument word ``word`` that varies is part of a divider triple at
    every length."""
    for half in (2 * word, 2 * word + 1):
        values = set()
        explained = True
        for g in graphs:
            a = g.op(node).args
            if 4 * half + 4 > len(a):
                break
            u = struct.unpack_from(f"<{len(a) // 4}I", a)
            values.add(u[half])
            explained &= any(s >= 0 and s + 2 < len(u) and u[s] > 0
                             and (u[s + 1], u[s + 2]) == _divider(u[s])
                             for s in (half - 2, half - 1, half))
        if len(values) > 1 and not explained:
            return False
    return True


saved = load_family(sys.argv[1])
by_key = collections.defaultdict(list)
for length, (key, _) in sorted(saved.members.items()):
    by_key[key].append(length)
for key, lengths in by_key.items():
    if len(lengths) < 3:
        print(f"executable {key[:8]}: lengths {lengths}, too few to fit")
        continue
    graphs = {n: saved.graph(n) for n in lengths}
    fits = derive(graphs).fits
    lines = [k for k, segments in fits.items() if len(segments) == 1]
    rest = [k for k in fits if k not in lines]
    # derive reads 32-bit slots ("a{byte offset}") and computes divider multipliers itself
    # since 8de3adb, so this finds fewer numbers, and fewer dividers, than the 64-bit reading
    # benchmarks/README.md quotes.
    dividers = [k for k in rest if k[1].startswith("a")
                and _halves_explained(graphs.values(), k[0], int(k[1][1:]) // 8)]
    other = [k for k in rest if k not in dividers]
    template = graphs[lengths[0]]
    kernels = collections.Counter(template.op(node).name[:48] for node, _ in other
                                  if template.op(node).kind == "kernel")
    print(f"executable {key[:8]}, lengths {lengths[0]}..{lengths[-1]} ({len(lengths)}): "
          f"{len(fits)} numbers vary, {len(lines)} on one line, {len(dividers)} of the rest "
          f"divider magic, {len(other)} neither")
    for name, count in kernels.most_common(8):
        print(f"  {count:4d} in {name}")
