"""GPT-2 small decode's family over KV lengths 240..255, captured twice in one process on the
H200 (``traces/h200_families/gpt2_small_decode_b1_kv240_255.capture_{a,b}``), set up as
derivation uses it, and the length-by-length placement of derived lengths to compare
``place_derived`` with: for the tests and ``benchmarks/derived_place_cost.py``."""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from grape.familyio import SavedFamily, load_family
from grape.ir import KernelGraph, Op
from grape.passes.derive import Derivation, derive, loose_at_both

FOLDER = Path(__file__).resolve().parent.parent / "traces" / "h200_families"


@dataclass
class Captures:
    a: SavedFamily  # the first capture of every length
    b: SavedFamily  # the second
    lengths: list[int]  # the larger executable's lengths
    graphs: dict[int, KernelGraph]  # each of them, from the first capture
    samples: list[int]  # every other length, and the last
    loose: dict  # the slots loose at the first and last sample (loose_at_both)

    @property
    def first(self) -> int:
        return self.samples[0]

    @property
    def last(self) -> int:
        return self.samples[-1]

    def derivation(self) -> Derivation:
        """The samples' derivation, loose slots left out (what derive_lengths would make)."""
        return derive({n: self.graphs[n] for n in self.samples}, self.loose)


def changes_at(d: Derivation, length: int, base: Mapping[str, Op],
               pairs: Mapping[str, str]) -> dict[str, Op]:
    """Length by length, what ``place_derived`` adds all at once: the operations a derived
    ``length`` changes in an executable's template, those of the captured length it is derived
    from (``base``, by template node) with each node the derivation rebuilds over them
    (``pairs``: the template's nodes to the captured length's)."""
    back = {theirs: mine for mine, theirs in pairs.items()}
    return {**base, **{back[node]: d.op_at(node, length) for node in d.varying}}


def captures() -> Captures:
    a, b = (load_family(FOLDER / f"gpt2_small_decode_b1_kv240_255.capture_{x}.family.json.gz")
            for x in "ab")
    by_key = collections.defaultdict(list)
    for n, key in a.shapes.items():
        by_key[key].append(n)
    lengths = sorted(max(by_key.values(), key=len))
    graphs = {n: a.graph(n) for n in lengths}
    samples = lengths[::2] + lengths[-1:]
    first, last = samples[0], samples[-1]
    loose = loose_at_both((graphs[first], b.graph(first)), (graphs[last], b.graph(last)))
    return Captures(a, b, lengths, graphs, samples, loose)
