"""Shapes a family never captured, derived from the ones it did: numbers as functions of length.

A decode step's graph at KV length ``n`` differs from its graph at another length in numbers
only: grid sizes, sizes and strides in the kernels' arguments, pointer offsets into the cache,
copy sizes. For these workloads each such number is an affine function of ``n`` over stretches
of lengths (a grid of ``ceil(n / 64)`` blocks is constant for 64 lengths, then steps).
:func:`derive` takes graphs captured at a few lengths, all of one structure, and fits every
number that varies to a piecewise-affine function of the length, in exact integer arithmetic: a
stretch is trusted only where at least three captured lengths lie on its line, and a length is
derivable only where every varying number has a trusted stretch around it.
:meth:`Derivation.graph_at` then builds the graph at a derivable length without capturing it,
and :meth:`Derivation.check` compares a derived graph with a captured one, operation by
operation, byte for byte. :func:`derive_lengths` is the whole procedure a family's capture
runs: capture every few lengths, derive the rest where a captured check agrees, capture what
cannot be derived.

What is not a number (a kernel's function, its launch attributes, which buffer a pointer points
into, a node's kind) must be equal at every captured length; a node where it is not refuses the
whole derivation, with the node and the field named.

Numbers are read from: a kernel's grid, block, shared memory, its argument bytes as 8-byte
little-endian words (a trailing part shorter than 8 bytes as one word of its own), and its
pointers' offsets into their buffers; a copy's size and offsets; a memset's value, width,
height, pitch and offset; every buffer's size and address.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import pairwise
from typing import Any

import networkx as nx

from grape.errors import GrapeError, GraphError, UnsupportedError
from grape.ir import Kernel, KernelGraph, Memcpy, Memset, Op, Pointer, Span, fingerprint
from grape.passes.families import match

__all__ = ["Derivation", "Sampled", "Segment", "derive", "derive_lengths"]

MIN_SUPPORT = 3  # captured lengths on a stretch's line before it is trusted


@dataclass(frozen=True)
class Segment:
    """``value = intercept + slope * length`` for lengths from ``first`` to ``last`` (both
    captured), fitted through ``support`` captured lengths."""

    first: int
    last: int
    slope: Fraction
    intercept: Fraction
    support: int

    def at(self, length: int) -> int | None:
        value = self.intercept + self.slope * length
        return int(value) if value.denominator == 1 else None


def _segments(points: list[tuple[int, int]]) -> list[Segment]:
    """Greedy piecewise-affine fit of (length, value) points sorted by length."""
    out, i = [], 0
    while i < len(points):
        j = i + 1
        if j == len(points):
            out.append(Segment(points[i][0], points[i][0], Fraction(0), Fraction(points[i][1]),
                               1))
            break
        (x0, y0), (x1, y1) = points[i], points[j]
        slope = Fraction(y1 - y0, x1 - x0)
        while j + 1 < len(points) and y0 + slope * (points[j + 1][0] - x0) == points[j + 1][1]:
            j += 1
        out.append(Segment(x0, points[j][0], slope, y0 - slope * x0, j - i + 1))
        i = j + 1
    return out


def _words(data: bytes) -> list[int]:
    return [int.from_bytes(data[k:k + 8], "little") for k in range(0, len(data), 8)]


def _flatten(op: Op) -> tuple[tuple, dict[str, int]]:
    """What must stay equal, and the numbers that may vary, of one operation."""
    if isinstance(op, Kernel):
        numbers = {f"grid{i}": v for i, v in enumerate(op.grid)}
        numbers |= {f"block{i}": v for i, v in enumerate(op.block)}
        numbers["shared_mem"] = op.shared_mem
        numbers |= {f"arg{k}": w for k, w in enumerate(_words(op.args))}
        numbers |= {f"ptr{k}": p.target.offset for k, p in enumerate(op.pointers)}
        fixed = ("kernel", op.function, op.name, op.attributes, op.params, op.handles,
                 len(op.args), tuple((p.offset, p.target.buffer) for p in op.pointers))
        return fixed, numbers
    if isinstance(op, Memcpy):
        return (("memcpy", op.src.buffer, op.dst.buffer),
                {"size": op.size, "src": op.src.offset, "dst": op.dst.offset})
    if isinstance(op, Memset):
        return (("memset", op.dst.buffer, op.element_size),
                {"value": op.value, "width": op.width, "height": op.height, "pitch": op.pitch,
                 "dst": op.dst.offset})
    return (op,), {}  # nodes without numbers (empty, events, conditionals) must be equal


def _rebuild(op: Op, numbers: Mapping[str, int]) -> Op:
    if isinstance(op, Kernel):
        words = [numbers[f"arg{k}"] for k in range(len(_words(op.args)))]
        args = b"".join(w.to_bytes(min(8, len(op.args) - 8 * k), "little")
                        for k, w in enumerate(words))
        pointers = tuple(Pointer(p.offset, Span(p.target.buffer, numbers[f"ptr{k}"]))
                         for k, p in enumerate(op.pointers))
        return dataclasses.replace(
            op, grid=tuple(numbers[f"grid{i}"] for i in range(3)),
            block=tuple(numbers[f"block{i}"] for i in range(3)),
            shared_mem=numbers["shared_mem"], args=args, pointers=pointers)
    if isinstance(op, Memcpy):
        return Memcpy(Span(op.src.buffer, numbers["src"]), Span(op.dst.buffer, numbers["dst"]),
                      numbers["size"])
    if isinstance(op, Memset):
        return dataclasses.replace(op, dst=Span(op.dst.buffer, numbers["dst"]),
                                   value=numbers["value"], width=numbers["width"],
                                   height=numbers["height"], pitch=numbers["pitch"])
    return op


@dataclass
class Derivation:
    """Graphs of one structure at every derivable length (see the module)."""

    template: KernelGraph  # the graph at the smallest captured length
    lengths: tuple[int, ...]  # the captured lengths
    fits: dict[tuple[str, str], list[Segment]]  # (node or buffer, number) -> its stretches

    def _value(self, key: tuple[str, str], length: int) -> int | None:
        for seg in self.fits[key]:
            if seg.first <= length <= seg.last:
                return seg.at(length) if seg.support >= MIN_SUPPORT else None
        return None

    def uncovered(self, length: int) -> list[tuple[str, str]]:
        """The numbers that cannot be derived at ``length`` (none: it is derivable)."""
        return [key for key in self.fits if self._value(key, length) is None]

    def covers(self, length: int) -> bool:
        return not self.uncovered(length)

    def graph_at(self, length: int) -> KernelGraph:
        """The graph at ``length``, derived, not captured.

        Raises
        ------
        UnsupportedError
            ``length`` lies where some number has no trusted stretch: capture it instead.
        """
        if missing := self.uncovered(length):
            where, what = missing[0]
            raise UnsupportedError(
                f"expected every varying number of the graph to be derivable at length "
                f"{length}, found {len(missing)} that are not (first: {what} of {where!r}; "
                f"captured lengths {self.lengths[0]}..{self.lengths[-1]}): capture it")
        numbers: dict[str, dict[str, int]] = {}
        for (where, what), _ in self.fits.items():
            numbers.setdefault(where, {})[what] = self._value((where, what), length)
        out = KernelGraph()
        for b in self.template.buffers.values():
            got = numbers.get(f"buffer:{b.id}", {})
            out.add_buffer(dataclasses.replace(b, size=got.get("size", b.size),
                                               address=got.get("address", b.address)))
        for node in nx.topological_sort(self.template.dag):  # an edge's ends exist first
            op = self.template.op(node)
            fixed = dict(_flatten(op)[1])
            fixed.update(numbers.get(node, {}))
            out.add(node, _rebuild(op, fixed), after=list(self.template.dag.predecessors(node)))
        return out

    def check(self, length: int, captured: KernelGraph) -> list[str]:
        """The nodes (and buffers) whose derived form differs from ``captured``'s, at a
        captured length: none means the derivation reproduces it byte for byte."""
        derived = self.graph_at(length)
        pairs = match(derived, captured)
        differ = [node for node in derived.dag.nodes
                  if derived.op(node) != captured.op(pairs[node])]
        differ += [f"buffer:{b}" for b, buf in derived.buffers.items()
                   if captured.buffers.get(b) != buf]
        return differ


def derive(samples: Mapping[int, KernelGraph]) -> Derivation:
    """Fit every varying number of ``samples`` (graphs by length, one structure) to the length.

    Raises
    ------
    GraphError
        The samples differ in structure, in buffers, or in something that is not a number at
        some node (a kernel's function, which buffer a pointer points into): the message names
        the node, the field and the two lengths.
    """
    if len(samples) < 2:
        raise GraphError(f"expected graphs at two or more lengths, found {len(samples)}")
    lengths = tuple(sorted(samples))
    template = samples[lengths[0]]
    series: dict[tuple[str, str], list[tuple[int, int]]] = {}
    fixed_at: dict[str, Any] = {}
    for length in lengths:
        graph = samples[length]
        pairs = match(template, graph)
        if set(graph.buffers) != set(template.buffers):
            extra = sorted(set(graph.buffers) ^ set(template.buffers))
            raise GraphError(f"expected the same buffers at every length, found {extra[0]!r} "
                             f"at one of lengths {lengths[0]} and {length} only")
        for b in graph.buffers.values():
            for what, value in (("size", b.size), ("address", b.address)):
                if value is not None:
                    series.setdefault((f"buffer:{b.id}", what), []).append((length, value))
        for node in template.dag.nodes:
            fixed, numbers = _flatten(graph.op(pairs[node]))
            if fixed_at.setdefault(node, fixed) != fixed:
                field = _first_difference(fixed_at[node], fixed)
                raise GraphError(f"expected node {node!r} to differ in numbers only between "
                                 f"lengths {lengths[0]} and {length}, found its {field} "
                                 f"changed")
            for what, value in numbers.items():
                series.setdefault((node, what), []).append((length, value))
    fits = {key: _segments(points) for key, points in series.items()
            if len({v for _, v in points}) > 1}
    return Derivation(template, lengths, fits)


_FIXED_NAMES = ("kind", "function", "name", "attributes", "parameter layout", "handles",
                "argument length", "pointers' buffers")


def _first_difference(a: tuple, b: tuple) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return _FIXED_NAMES[i] if a[0] == "kernel" and i < len(_FIXED_NAMES) else "kind"
    return "kind"


@dataclass
class Sampled:
    """Graphs at every length asked for, and how each was had (see :func:`derive_lengths`)."""

    graphs: dict[int, KernelGraph]
    captured: list[int] = field(default_factory=list)  # in the order captured
    derived: list[int] = field(default_factory=list)
    checked: dict[int, list[str]] = field(default_factory=dict)  # held-out length -> differing
    refused: list[tuple[int, int]] = field(default_factory=list)  # stretches a check refuted
    # Neighbouring captured lengths nothing is derived across, and why (a change of topology or
    # kernel, or buffers that differ): what to read when fewer lengths were derived than hoped.
    cuts: list[tuple[int, int, str]] = field(default_factory=list)
    # Each length's fingerprint(launch=False), computed once (thousands of nodes take a while).
    topologies: dict[int, str] = field(default_factory=dict)


def _runs(graphs: Mapping[int, KernelGraph], cuts: list[tuple[int, int, str]] | None = None,
          seen: dict[tuple[int, int], str | None] | None = None,
          prints: dict[int, str] | None = None) -> list[list[int]]:
    """Captured lengths, ascending, cut wherever the next one's graph differs in more than
    numbers (another topology, another kernel function): lengths between two runs belong to
    neither, so nothing is derived across a change. Each cut's lengths and reason are appended
    to ``cuts`` where given; ``seen`` keeps what neighbouring pairs gave (comparing two graphs
    of thousands of nodes takes a while, and refinement asks again and again)."""
    seen = {} if seen is None else seen
    prints = {} if prints is None else prints
    runs: list[list[int]] = []
    last_topology = None
    for n in sorted(graphs):
        if n not in prints:
            prints[n] = fingerprint(graphs[n], launch=False)
        topology = prints[n]
        why: str | None = "another topology"
        if runs and topology == last_topology:
            pair = (runs[-1][-1], n)
            if pair not in seen:
                try:
                    derive({pair[0]: graphs[pair[0]], n: graphs[n]})
                    seen[pair] = None
                except GraphError as e:
                    seen[pair] = str(e)
            why = seen[pair]
            if why is None:
                runs[-1].append(n)
                continue
        if runs and cuts is not None:
            previous = runs[-1][-1]
            if why == "another topology":
                why = (f"another topology ({len(graphs[previous].dag)} nodes, then "
                       f"{len(graphs[n].dag)})")
            cuts.append((previous, n, why))
        runs.append([n])
        last_topology = topology
    return runs


def _refine(want: list[int], graphs: Mapping[int, KernelGraph],
            take: Callable[[int], KernelGraph], seen: dict[tuple[int, int], str | None],
            prints: dict[int, str]) -> None:
    """Capture more lengths where the samples alone cannot carry a derivation: between two runs
    (a change of topology or kernel somewhere in the gap: bisected until the change lies between
    neighbouring lengths, so each run reaches it) and inside a run of fewer than MIN_SUPPORT
    samples (its widest gap halved until it has the support or no gap is left).

    Without this, a model whose kernels change every few lengths (small GPT-2 models pick
    another attention or GEMM kernel every few KV lengths) leaves runs of one or two samples,
    and nothing is derived at all. Each change costs about log2(every) captures."""
    while True:
        runs = _runs(graphs, seen=seen, prints=prints)
        todo = set()
        for left, right in pairwise(runs):
            todo.add(_middle([n for n in want if left[-1] < n < right[0]]))
        for run in runs:
            if 1 < len(run) < MIN_SUPPORT:
                gaps = [[n for n in want if a < n < b] for a, b in pairwise(run)]
                todo.add(_middle(max(gaps, key=len)))
        todo.discard(None)
        if not todo:
            return
        for n in sorted(todo, reverse=True):
            take(n)


def _middle(lengths: list[int]) -> int | None:
    return lengths[len(lengths) // 2] if lengths else None


def _spread(candidates: list[int], k: int) -> list[int]:
    """``k`` of ``candidates`` (ascending), spread evenly across them."""
    if k <= 0 or not candidates:
        return []
    if k >= len(candidates):
        return candidates
    return sorted({candidates[(2 * i + 1) * len(candidates) // (2 * k)] for i in range(k)})


def derive_lengths(capture: Callable[[int], KernelGraph], lengths: Iterable[int], *,
                   every: int = 8, checks: int = 1,
                   progress: Callable[[str], None] = lambda line: None) -> Sampled:
    """The graphs at ``lengths``, most derived rather than captured.

    ``capture(n)`` gives the graph at length ``n``; it is called for every ``every``-th length
    and the last, largest first (a family's pool then holds the largest shape's memory), then
    for ``checks`` lengths per stretch that a derivation covers but no sample is at (held-out
    checks: a stretch whose derived graph differs from the captured one in any byte is refused,
    and its lengths are captured), and last for every length no trusted stretch covers.

    What a held-out check cannot see, it cannot refuse: a number that leaves its line between
    two samples and returns to it (a kernel chosen for a few lengths only) is derived wrongly
    there. Samples closer together (smaller ``every``) and more ``checks`` narrow that.

    Raises
    ------
    GrapeError
        ``every`` below 1, ``checks`` below 0, or no lengths.
    """
    want = sorted(set(lengths))
    if not want or every < 1 or checks < 0:
        raise GrapeError(f"expected lengths, every >= 1 and checks >= 0, found "
                         f"{len(want)} lengths, every={every}, checks={checks}")
    out = Sampled({})

    def take(n: int) -> KernelGraph:
        out.graphs[n] = capture(n)
        out.captured.append(n)
        if len(out.captured) % 10 == 0:
            progress(f"captured {len(out.captured)} lengths")
        return out.graphs[n]

    for n in sorted(set(want[::every]) | {want[-1]}, reverse=True):
        take(n)
    seen: dict[tuple[int, int], str | None] = {}
    _refine(want, out.graphs, take, seen, out.topologies)
    derivations = [derive({n: out.graphs[n] for n in run})
                   for run in _runs(out.graphs, seen=seen, prints=out.topologies)
                   if len(run) >= MIN_SUPPORT]
    trusted = []
    for d in derivations:
        inside = [n for n in want if d.lengths[0] < n < d.lengths[-1]
                  and n not in out.graphs and d.covers(n)]
        refuted = False
        for n in _spread(inside, checks):
            out.checked[n] = d.check(n, take(n))
            refuted = refuted or bool(out.checked[n])
        if refuted:
            out.refused.append((d.lengths[0], d.lengths[-1]))
        else:
            trusted.append(d)
    for n in want:
        if n in out.graphs:
            continue
        d = next((d for d in trusted if d.lengths[0] <= n <= d.lengths[-1] and d.covers(n)),
                 None)
        if d is None:
            take(n)
        else:
            out.graphs[n] = d.graph_at(n)
            out.derived.append(n)
            out.topologies[n] = out.topologies[d.lengths[0]]  # numbers differ, nothing else
    # The cuts between captured lengths (their pairs were compared already, in ``seen``).
    _runs({n: out.graphs[n] for n in out.captured}, out.cuts, seen, out.topologies)
    progress(f"{len(want)} lengths: {len(out.captured)} captured, {len(out.derived)} derived, "
             f"{len(out.refused)} stretches refused by a check, {len(out.cuts)} changes")
    return out
