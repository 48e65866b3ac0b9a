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
operation, byte for byte. ``grape.passes.lengths.derive_lengths`` (``derive_lengths`` below)
is the whole procedure a family's capture runs: capture every few lengths, derive the rest
where a captured check agrees, capture what cannot be derived.

What is not a number (a kernel's function, its launch attributes, which buffer a pointer points
into, a node's kind) must be equal at every captured length; a node where it is not refuses the
whole derivation, with the node and the field named.

Numbers are read from: a kernel's grid, block, shared memory, its argument bytes as 32-bit
little-endian slots (a trailing part shorter than 4 bytes as a slot of its own), each pointer in
its arguments as one 64-bit word and its offset into its buffer; a copy's size and offsets; a
memset's value, width, height, pitch and offset; every buffer's size and address. 32 bits, not
64: PyTorch packs 32-bit sizes, strides and divisors two to a word, and a word of two numbers
that each lie on a line in the length does not.

Two kinds of argument bytes are not fitted, both measured on the H200 (GPT-2 small decode, KV
lengths 240..254: of 248 varying words on no line, 199 were the first kind and 49 the second):

- *Loose* slots (``grape.passes.relocate`` explains them): bytes PyTorch never fills (a
  TensorIterator's offset calculator has room for 25 dimensions and fills as many as the
  tensor has), which hold whatever the host's stack held. They are found by capturing a length
  twice (:func:`loose_slots`: the slots that differ between the two captures and lie under no
  pointer both have); a derived graph keeps its template's bytes there, and a check ignores
  them.
- *Stray* pointers: an unfilled word holding, at some lengths, an address that falls into the
  graph's memory (so the capture reads it as a pointer) and at others an address outside it.
  On the H200 a Llama-shaped decoder's RMS-norm reduction (``reduce_kernel``, a 1,048-byte
  ``ReduceOp``) kept an MLP weight's address at some KV lengths and a heap address at the
  others, in a word it never reads: every neighbouring pair of 489 over 1..511 was cut there
  (``benchmarks/derive_refusals.py --decoder llama``). A real pointer points into the graph's
  memory at every length, so such a word is loose (:func:`stray_slots`), not a change of
  structure.
- *Unread* slots: words that no second capture finds loose but that running shows the kernel
  does not read (:func:`derive_lengths` with ``verify``: a sample run with the template's bytes
  there leaves what its capture leaves, bit for bit).
- PyTorch's fast integer division (``IntDivider<uint32_t>``: a divisor, then its multiplier
  and shift, three 32-bit slots): the multiplier and shift are no affine function of the
  length, but are the divisor's, so where three slots are such a triple at every sample the
  last two are computed from the first (which is fitted) rather than fitted.

A grid dimension is most often the kernel's element count divided by the work of a block,
rounded up: a staircase in the length whose steps samples far apart cannot follow (PyTorch's
``arange`` of ``n + 1`` positions runs ``ceil((n + 1) / 64)`` blocks, which at one sample in
32 lengths of a residue class leaves two samples a step: on the H200 it held back 144 of GPT-2
small's 255 lengths once the pool's pointers had moved); sizes and strides padded to a
multiple are the same staircase, scaled. So where a grid dimension or an argument number
equals ``c * ceil(x / d)`` at every sample, ``x`` another of the node's argument numbers that
varies, ``c`` 1 or the greatest common divisor of the number's samples and ``d`` a constant, it
is also derived so where its own stretches do not reach (:class:`Quotient`). The samples bound
``d`` to an interval, not a value: a length where the interval, or two such forms, give two
values is not derived. Nor is a length where a number's form and its stretch give two: both
explain the samples, and which is right only a capture there could say, so
:func:`derive_lengths` takes one (``Derivation.disputed``, at most ``TIE_BREAKS`` a run): a
sample off the line leaves the quotient the one form true at every sample, and it then decides
over the stretches wherever the two part; a sample on the line drops the quotient. On the H200,
GPT-2 small's attention over 1..1023, sampled every 16 lengths of a class modulo 8, held a
count padded to 16 whose samples all lay on one step and on the line ``n + 8``, which left 63
of a class's 125 lengths underived (``benchmarks/derive_refusals.py``). Samples that fall one
a step of a staircase, or in step with its period, lie on lines that miss the lengths between
them (on the H200, GPT-2's mask row at one length in 32 of a class over 1..1023 made such a
line, which the held-out checks refused everywhere; a property test found lines of three
samples that no check refused); and a line's samples can fit a staircase they happen to fall
on the steps of.

A number can also step with the length itself: a temporary's place in the pool moves by the
rounded size of a block before it that grows with the length. On the H200 a Llama step's
multiply read its input 27,136 bytes into the pool at KV lengths 1..385 and 512 bytes further
every 512 lengths after (a block of one byte a position, rounded to 512 by the allocator), its
steps between samples 128 lengths apart. Where a number's samples rise in steps and lie on no
one trusted line, it is also derived as ``c + s * ceil(n / d)`` of the length ``n``
(:data:`LENGTH` as a :class:`Quotient`'s source), ``s`` the one size of its rises (two or
more, between neighbouring samples), with every ``c`` and ``d`` the samples allow; where they
part, the length is not derived, and :func:`derive_lengths` may capture one there, as for the
forms above.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from collections.abc import (
    Hashable,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import pairwise

import numpy as np

from grape.errors import GraphError, UnsupportedError
from grape.ir import Kernel, KernelGraph, Memcpy, Memset, Op, Pointer, Span
from grape.passes.families import match, same_ids
from grape.passes.memo import recall
from grape.passes.variants import NodeVersions, Variants

__all__ = ["Derivation", "Quotient", "Segment", "derive", "loose_at_both", "loose_slots",
           "place_derived", "stray_slots"]

MIN_SUPPORT = 3  # captured lengths on a stretch's line before it is trusted
TIE_BREAKS = 2  # captures a run may take to tell two forms that fit its samples apart
LENGTH = "length"  # a Quotient's source that is the length itself, not one of its node's numbers
# The most steps a length staircase may have taken below its first sample (``c`` is tried for
# each): a derivation's first sample lies at the start of its range or after a change.
MAX_FIRST_STEP = 64


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
        slope, intercept = self.slope, self.intercept
        if slope.denominator == 1 and intercept.denominator == 1:  # most: integers, fast
            return intercept.numerator + slope.numerator * length
        value = intercept + slope * length
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
        rise, run = y1 - y0, x1 - x0
        # On the line where (y - y0) / (x - x0) == rise / run: compared cross-multiplied, in
        # integers (a Fraction a point cost most of a derivation's fitting)
        while j + 1 < len(points) and (points[j + 1][1] - y0) * run == rise * (
                points[j + 1][0] - x0):
            j += 1
        slope = Fraction(rise, run)
        out.append(Segment(x0, points[j][0], slope, y0 - slope * x0, j - i + 1))
        i = j + 1
    return out


@dataclass(frozen=True)
class Quotient:
    """A number that is ``intercept + scale * ceil(x / d)`` at every sample: ``x`` the same
    node's number ``source``, or the length where ``source`` is :data:`LENGTH`, ``d`` any
    integer from ``low`` to ``high`` (what the samples leave open)."""

    source: str
    low: int
    high: int
    scale: int = 1
    intercept: int = 0

    def at(self, x: int) -> int | None:
        """The number at ``x``, where every divisor left open gives the same one."""
        if x <= 0:
            return None
        most, least = -(-x // self.low), -(-x // self.high)
        return self.intercept + self.scale * most if most == least else None


def _quotient(source: str, points: Sequence[tuple[int, int]], scale: int = 1
              ) -> Quotient | None:
    """The divisors ``d`` for which ``scale * ceil(x / d) == v`` at every (x, v) of
    ``points``, as a :class:`Quotient`; None where there are none, or where ``v`` never
    exceeds ``scale`` (then any large ``d`` does, and nothing bounds it)."""
    low, high = 1, None
    for x, v in points:
        g, rest = divmod(v, scale)
        if x <= 0 or g <= 0 or rest:
            return None
        low = max(low, -(-x // g))  # x / d <= g
        if g > 1:  # x / d > g - 1: d below x / (g - 1)
            bound = -(-x // (g - 1)) - 1
            high = bound if high is None else min(high, bound)
        if high is not None and low > high:
            return None
    return None if high is None else Quotient(source, low, high, scale)


def _length_steps(points: Sequence[tuple[int, int]]) -> tuple[Quotient, ...]:
    """Every ``c + s * ceil(n / d)`` of the length ``n`` that gives each (n, value) of
    ``points`` (sorted by length), where the values rise two or more times between neighbouring
    samples and by the same ``s`` each time (samples closer than a step): one form for each
    count of steps below the first sample that some ``d`` allows. None otherwise."""
    values = [v for _, v in points]
    rises = [b - a for a, b in pairwise(values) if b != a]
    # Two rises or more, every one of the same size: a leftover word that changed once, or
    # by odd amounts, is no staircase (on the H200, 68 of a Llama step's leftovers fitted one
    # with a single rise).
    if len(rises) < 2 or rises[0] <= 0 or any(r != rises[0] for r in rises):
        return ()
    scale = rises[0]
    (first, v0), out = points[0], []
    for k in range(1, min(first, MAX_FIRST_STEP) + 1):
        q = _quotient(LENGTH, [(n, scale * (k + (v - v0) // scale)) for n, v in points], scale)
        if q is not None:
            out.append(dataclasses.replace(q, intercept=v0 - scale * k))
    return tuple(out)


def _quotients(series: Mapping[str, list[tuple[int, int]]],
               fits: Mapping[str, list[Segment]]) -> dict[str, tuple[Quotient, ...]]:
    """One node's numbers (``series`` and ``fits`` by number, ``buffer:`` entries apart): for
    each fitted grid dimension or argument number, the node's other varying argument numbers
    it is a rounded-up quotient of at every sample, as ``ceil(x / d)`` or as the values'
    greatest common divisor times that (a size or stride padded to a multiple: a ``where``
    over GPT-2's attention mask read 512 bytes per 256 positions begun on the H200); module
    docstring. A node's alone, so that a derivation remembers it with the node's share."""
    numbers = [what for what in fits if what.startswith("a")]
    out = {}
    for what in fits:
        if not what.startswith(("grid", "a")):
            continue
        values = series[what]
        scales = sorted({1, math.gcd(*(v for _, v in values))} - {0})
        found = []
        for source in numbers:
            if source == what or series[source] == values:
                continue  # itself, or a number equal to it at every sample: nothing to add
            points = [(x, v) for (_, x), (_, v) in zip(series[source], values, strict=True)]
            found += [q for scale in scales if (q := _quotient(source, points, scale))]
        if found:
            out[what] = tuple(found)
    # Staircases in the length itself, for numbers no one trusted line explains.
    for what, segments in fits.items():
        one_line = len(segments) == 1 and segments[0].support >= MIN_SUPPORT
        if (what not in out and not one_line and len(series[what]) > MIN_SUPPORT
                and (steps := _length_steps(series[what]))):
            out[what] = steps
    return out


Slots = frozenset[int]  # byte offsets of 4-byte argument slots

# Where a 64-bit word holding a user-space address lies: its upper half, on Linux x86-64 and
# aarch64, from the heap (0x55..) to the stacks and mappings (0x7f..).
_ADDRESS_HIGH = range(0x100, 0x8000)

# Where a kernel's launch numbers go in a row of ``grape.passes.variants.DIMS`` columns.
_DIM_COLUMNS = {"grid0": 0, "grid1": 1, "grid2": 2, "block0": 3, "block1": 4, "block2": 5,
                "shared_mem": 6}


def _slots(offset: int, size: int) -> range:
    """The 4-byte slots that bytes ``offset .. offset + size`` touch."""
    return range(offset - offset % 4, offset + size, 4)


def _u32(data: bytes, offset: int) -> int:
    return int.from_bytes(data[offset:offset + 4], "little")


def _divider(divisor: int) -> tuple[int, int]:
    """PyTorch's ``IntDivider<uint32_t>(divisor)``: the multiplier and shift it keeps
    (``ATen/cuda/detail/IntegerDivider.cuh``)."""
    shift = (divisor - 1).bit_length()
    return ((1 << 32) * ((1 << shift) - divisor)) // divisor + 1, shift


def _varying(ops: list[Kernel]) -> tuple[list[int], np.ndarray]:
    """The argument slots whose bytes are not the same at every sample (``ops``: one kernel,
    arguments of one length), found with numpy: kernels carry hundreds of slots, few vary;
    and every sample's slots, a row each (uint32; a trailing part of a slot zero-padded, as
    :func:`_u32` reads it)."""
    width = len(ops[0].args) + (-len(ops[0].args)) % 4
    rows = np.frombuffer(b"".join(op.args.ljust(width, b"\0") for op in ops),
                         dtype="<u4").reshape(len(ops), -1)
    return (np.flatnonzero((rows != rows[0]).any(axis=0)) * 4).tolist(), rows


def _kernel_numbers(node: str, seen: list[Kernel], lengths: Sequence[int], skip: Slots,
                    varying: list[int], rows: np.ndarray) -> dict[str, list[int]]:
    """One kernel node's numbers at each of its versions ``seen`` (one argument length), by
    name in :func:`_flatten`'s order: what :func:`_flatten` gives a version at a time, with
    the argument slots read from ``rows`` (:func:`_varying`) a column each rather than a
    version and slot at a time.

    Raises
    ------
    GraphError
        Something that is no number differs between two versions.
    """
    fixed_first = _flatten(seen[0], skip, fixed_only=True)[0]
    for length, op in zip(lengths[1:], seen[1:], strict=True):
        if (fixed := _flatten(op, skip, fixed_only=True)[0]) != fixed_first:
            what = _first_difference(fixed_first, fixed)
            raise GraphError(f"expected node {node!r} to differ in numbers only between "
                             f"lengths {lengths[0]} and {length}, found its {what} changed")
    numbers = {f"grid{i}": [op.grid[i] for op in seen] for i in range(3)}
    numbers |= {f"block{i}": [op.block[i] for op in seen] for i in range(3)}
    numbers["shared_mem"] = [op.shared_mem for op in seen]
    # The pointers left once ``skip`` is: at the same offsets in every version (they are
    # part of what must stay equal), though a version may have more under ``skip``.
    pointers = [op.pointers if not skip else
                [p for p in op.pointers if not skip.intersection(_slots(p.offset, 8))]
                for op in seen]
    taken = set(skip)
    for j, p in enumerate(pointers[0]):
        o = p.offset
        numbers[f"w{o}"] = [int.from_bytes(op.args[o:o + 8], "little") for op in seen]
        numbers[f"p{o}"] = [mine[j].target.offset for mine in pointers]
        taken.update(_slots(o, 8))
    for o in varying:
        if o not in taken:
            numbers[f"a{o}"] = rows[:, o // 4].tolist()
    return numbers


def _dividers(ops: list[Kernel], skip: Slots, varying: Iterable[int]) -> Slots:
    """The slots of ``ops`` (one kernel at every sample) among ``varying`` that hold an
    ``IntDivider``'s multiplier at every sample, the divisor in the slot before and the shift
    in the slot after: computed from the divisor, not fitted (module docstring)."""
    pointed = {o for op in ops for p in op.pointers for o in _slots(p.offset, 8)}
    out = set()
    for o in varying:
        if o < 4 or o + 8 > len(ops[0].args) or {o - 4, o, o + 4} & (skip | pointed):
            continue
        if all(_u32(op.args, o - 4) > 0
               and (_u32(op.args, o), _u32(op.args, o + 4)) == _divider(_u32(op.args, o - 4))
               for op in ops):
            out.add(o)
    return frozenset(out)


def _flatten(op: Op, skip: Slots = frozenset(), fixed_only: bool = False,
             slots: Iterable[int] | None = None) -> tuple[tuple, dict[str, int]]:
    """What must stay equal, and (unless ``fixed_only``) the numbers that may vary, of one
    operation; argument slots in ``skip`` (loose, or computed from others) are neither.
    ``slots``: the argument slots to read numbers from (default: every one)."""
    if isinstance(op, Kernel):
        # Most operations have no slot to skip: then every pointer counts, with no test each.
        pointers = (op.pointers if not skip else
                    [p for p in op.pointers if not skip.intersection(_slots(p.offset, 8))])
    if isinstance(op, Kernel) and fixed_only:
        return ("kernel", op.function, op.name, op.attributes, op.params, op.handles,
                len(op.args), tuple((p.offset, p.target.buffer) for p in pointers)), {}
    if isinstance(op, Kernel):
        numbers = {f"grid{i}": v for i, v in enumerate(op.grid)}
        numbers |= {f"block{i}": v for i, v in enumerate(op.block)}
        numbers["shared_mem"] = op.shared_mem
        taken = set(skip)
        for p in pointers:
            numbers[f"w{p.offset}"] = int.from_bytes(op.args[p.offset:p.offset + 8], "little")
            numbers[f"p{p.offset}"] = p.target.offset
            taken.update(_slots(p.offset, 8))
        numbers |= {f"a{o}": _u32(op.args, o)
                    for o in (range(0, len(op.args), 4) if slots is None else slots)
                    if o not in taken}
        fixed = ("kernel", op.function, op.name, op.attributes, op.params, op.handles,
                 len(op.args), tuple((p.offset, p.target.buffer) for p in pointers))
        return fixed, numbers
    if isinstance(op, Memcpy):
        return (("memcpy", op.src.buffer, op.dst.buffer),
                {"size": op.size, "src": op.src.offset, "dst": op.dst.offset})
    if isinstance(op, Memset):
        return (("memset", op.dst.buffer, op.element_size),
                {"value": op.value, "width": op.width, "height": op.height, "pitch": op.pitch,
                 "dst": op.dst.offset})
    return (op,), {}  # nodes without numbers (empty, events, conditionals) must be equal


def _bits(what: str, op: Op) -> int:
    """How wide number ``what`` of ``op`` is: a derived value that does not fit is no value."""
    if what.startswith("a"):
        return 8 * min(4, len(op.args) - int(what[1:]))
    return 32 if what.startswith(("grid", "block", "shared")) else 64


def _rebuild(op: Op, numbers: Mapping[str, int], dividers: Slots = frozenset()) -> Op:
    """``op`` with ``numbers`` (some of :func:`_flatten`'s: the others keep ``op``'s value);
    argument bytes that are no number (loose) keep ``op``'s too."""
    numbers = {**_flatten(op)[1], **numbers} if not isinstance(op, Kernel) else numbers
    if isinstance(op, Kernel):
        args = bytearray(op.args)
        for what, value in numbers.items():
            if what[0] in "aw":
                o = int(what[1:])
                size = 8 if what[0] == "w" else min(4, len(args) - o)
                args[o:o + size] = value.to_bytes(size, "little")
        for o in sorted(dividers):
            multiplier, shift = _divider(_u32(args, o - 4))
            args[o:o + 8] = multiplier.to_bytes(4, "little") + shift.to_bytes(4, "little")
        pointers = tuple(Pointer(p.offset, Span(p.target.buffer, numbers[f"p{p.offset}"]))
                         if f"p{p.offset}" in numbers else p for p in op.pointers)
        return dataclasses.replace(
            op, grid=tuple(numbers.get(f"grid{i}", v) for i, v in enumerate(op.grid)),
            block=tuple(numbers.get(f"block{i}", v) for i, v in enumerate(op.block)),
            shared_mem=numbers.get("shared_mem", op.shared_mem), args=bytes(args),
            pointers=pointers)
    if isinstance(op, Memcpy):
        return Memcpy(Span(op.src.buffer, numbers["src"]), Span(op.dst.buffer, numbers["dst"]),
                      numbers["size"])
    if isinstance(op, Memset):
        return dataclasses.replace(op, dst=Span(op.dst.buffer, numbers["dst"]),
                                   value=numbers["value"], width=numbers["width"],
                                   height=numbers["height"], pitch=numbers["pitch"])
    return op


def _masked(op: Op, loose: Slots) -> Op:
    """``op`` with its loose slots zeroed and the pointers in them dropped: what two captures
    of one length share."""
    if not loose or not isinstance(op, Kernel):
        return op
    args = bytearray(op.args)
    for o in loose:
        args[o:o + 4] = bytes(len(args[o:o + 4]))
    return dataclasses.replace(op, args=bytes(args), pointers=tuple(
        p for p in op.pointers if not loose.intersection(_slots(p.offset, 8))))


def stray_slots(ops: Sequence[Op]) -> Slots:
    """One node's slots under a stray pointer (see the module) among ``ops``, its versions at
    several lengths (or in several captures): a word that is a pointer into the graph's memory
    in some versions and, in another, an address into none of it (a user-space address's upper
    half, ``_ADDRESS_HIGH``; a null or a small number there might be a pointer the kernel
    skips, and is not taken for one)."""
    kernels = [op for op in ops if isinstance(op, Kernel)]
    if len(kernels) < 2 or len({(op.function, len(op.args)) for op in kernels}) > 1:
        return frozenset()
    offsets = [{p.offset for p in op.pointers} for op in kernels]
    out: set[int] = set()
    for offset in set().union(*offsets) - set.intersection(*offsets):
        if any(offset not in mine and offset + 8 <= len(op.args)
               and _u32(op.args, offset + 4) in _ADDRESS_HIGH
               for op, mine in zip(kernels, offsets, strict=True)):
            out.update(_slots(offset, 8))
    return frozenset(out)


def loose_slots(graph: KernelGraph, again: KernelGraph) -> dict[str, Slots]:
    """Two captures of one length: for each kernel node of ``graph``, its loose argument slots
    (module docstring): those whose bytes differ between the two and lie under no pointer both
    captures have, and those under a pointer one capture has and the other not.

    Raises
    ------
    GraphError
        The two differ in structure.
    """
    pairs = match(graph, again)
    out: dict[str, Slots] = {}
    for node, op in graph.ops():
        other = again.op(pairs[node])
        # A node that ran another kernel or launch in the second capture (a library may choose
        # by its handle or workspace) tells nothing of what is loose: none of its slots is, so
        # a derivation fits or refuses every number it has.
        if not isinstance(op, Kernel) or not isinstance(other, Kernel) \
                or len(op.args) != len(other.args) or op.function != other.function \
                or (op.grid, op.block, op.shared_mem) != (other.grid, other.block,
                                                            other.shared_mem):
            continue
        mine, theirs = {p.offset for p in op.pointers}, {p.offset for p in other.pointers}
        both = {o for p in mine & theirs for o in _slots(p, 8)}
        slots = {o for p in mine ^ theirs for o in _slots(p, 8)}
        slots |= {o for o in range(0, len(op.args), 4)
                  if o not in both and op.args[o:o + 4] != other.args[o:o + 4]}
        if slots:
            out[node] = frozenset(slots)
    return out


@dataclass(frozen=True)
class _Stretches:
    """Every stretch, trusted or not, of a derivation's numbers whose lines are in integers
    small enough for int64, as arrays of one entry per stretch, grouped by number
    (``starts``: each number's first stretch, in the order of ``keys``)."""

    keys: dict[tuple[str, str], int]  # number -> its row in a table
    starts: np.ndarray  # each number's first stretch
    first: np.ndarray
    last: np.ndarray
    slope: np.ndarray
    intercept: np.ndarray
    trusted: np.ndarray  # bool: support of MIN_SUPPORT or more
    top: np.ndarray  # the number's bound (its width), int64's largest where it has none

    def at(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each number's value by its own stretches at each of ``lengths``, and where a
        trusted stretch gives one in its bounds: (numbers, lengths) arrays. A number's
        stretches do not overlap (``_segments``), so at most one holds a length."""
        inside = ((lengths[None, :] >= self.first[:, None])
                  & (lengths[None, :] <= self.last[:, None]))
        # Clipped into each stretch, so that no product outside it overflows.
        x = np.clip(lengths[None, :], self.first[:, None], self.last[:, None])
        values = self.intercept[:, None] + self.slope[:, None] * x
        good = inside & self.trusted[:, None] & (values >= 0) & (values < self.top[:, None])
        return (np.add.reduceat(np.where(inside, values, 0), self.starts, axis=0),
                np.logical_or.reduceat(good, self.starts, axis=0))


@dataclass(frozen=True)
class _Forms:
    """Every :class:`Quotient` form of the numbers that have them, as arrays of one entry per
    form grouped by number (``starts``), where the form's numbers fit int64 and its source
    is the length or a number of :class:`_Stretches` (row ``source``; -1: the length)."""

    keys: list[tuple[str, str]]
    starts: np.ndarray
    source: np.ndarray
    low: np.ndarray
    high: np.ndarray
    scale: np.ndarray
    intercept: np.ndarray
    top: np.ndarray  # each number's bound, int64's largest where it has none


@dataclass
class _Table:
    """:class:`_Stretches` evaluated at some lengths: each number's value and whether it is
    derivable there by its own stretches (:meth:`Derivation._fitted_column`), and for the
    numbers of :class:`_Forms`, :meth:`Derivation._quotient_column`'s three arrays."""

    keys: dict[tuple[str, str], int]
    values: np.ndarray
    ok: np.ndarray
    quotients: dict[tuple[str, str], tuple[np.ndarray, np.ndarray, np.ndarray]] = field(
        default_factory=dict)


@dataclass
class Derivation:
    """Graphs of one structure at every derivable length (see the module)."""

    template: KernelGraph  # the graph at the smallest captured length
    lengths: tuple[int, ...]  # the captured lengths
    fits: dict[tuple[str, str], list[Segment]]  # (node or buffer, number) -> its stretches
    loose: dict[str, Slots] = field(default_factory=dict)  # template node -> loose slots
    dividers: dict[str, Slots] = field(default_factory=dict)  # node -> multipliers' slots
    bits: dict[tuple[str, str], int] = field(default_factory=dict)  # a number's width
    # numbers that are rounded-up quotients of another of their node's at every sample
    # (module docstring)
    quotients: dict[tuple[str, str], tuple[Quotient, ...]] = field(default_factory=dict)
    # Slots among ``loose`` shown unread by running rather than by a second capture
    # (:func:`derive_lengths`' ``verify``): template node -> slots.
    unread: dict[str, Slots] = field(default_factory=dict)

    def _value(self, key: tuple[str, str], length: int) -> int | None:
        fitted = self._fitted(key, length)
        if key not in self.quotients:
            return fitted
        value, undecided = self._quotient(key, length)
        if undecided:
            return None
        if value is not None and fitted is not None and value != fitted:
            # Two forms explain the samples. Where they lie on no one line, the quotient,
            # true at every sample, is the one form left: a stretch's line is then a piece of
            # a staircase its samples happen to fall on the same step of.
            return value if self._line_refuted(key) else None
        return fitted if value is None else value

    def _line_refuted(self, key: tuple[str, str]) -> bool:
        """Whether ``key``'s samples lie on no one line (its fit took several stretches)."""
        return len(self.fits[key]) > 1

    def disputed(self, lengths: Iterable[int]) -> list[int]:
        """The lengths among ``lengths`` where forms the samples all allow give a number two
        values (a stretch's line and a quotient, two quotients, or one quotient's divisors):
        a capture at one of them tells the forms apart (:func:`derive_lengths` takes one)."""
        lengths = list(lengths)
        at = np.asarray(lengths, dtype=np.int64)
        out = np.zeros(len(lengths), dtype=bool)
        table = self._table(at) if self.quotients else None
        for key in self.quotients:
            forms = self._quotient_column(key, at, table)
            fitted, fitted_ok = self._fitted_column(key, at, table)
            if forms is None or isinstance(fitted, list):
                out |= [self._disputed_at(key, n) for n in lengths]
                continue
            value, defined, undecided = forms
            out |= undecided
            if not self._line_refuted(key):
                out |= defined & fitted_ok & (fitted != value)
        return [n for n, hit in zip(lengths, out.tolist(), strict=True) if hit]

    def _disputed_at(self, key: tuple[str, str], length: int) -> bool:
        value, undecided = self._quotient(key, length)
        fitted = None if undecided or value is None else self._fitted(key, length)
        return undecided or (fitted is not None and fitted != value
                             and not self._line_refuted(key))

    def _fitted(self, key: tuple[str, str], length: int) -> int | None:
        """``key`` at ``length`` from its own trusted stretch, if one holds it."""
        for seg in self.fits[key]:
            if seg.first <= length <= seg.last:
                value = seg.at(length) if seg.support >= MIN_SUPPORT else None
                if value is None or not 0 <= value < 1 << self.bits.get(key, 64):
                    return None
                return value
        return None

    def _quotient(self, key: tuple[str, str], length: int) -> tuple[int | None, bool]:
        """``key`` at ``length`` by its quotient forms, and whether they leave it undecided: a
        divisor's interval that gives two values there, or two forms that give two. Each
        source is derived by its own stretches (two numbers that are each other's quotients
        do not chase each other); a form whose source is not derivable there says nothing, and
        where none can, the value is None and not undecided."""
        values = set()
        for q in self.quotients[key]:
            x = length if q.source == LENGTH else self._fitted((key[0], q.source), length)
            if x is not None:
                values.add(q.at(x))
        if not values:
            return None, False
        value = values.pop() if len(values) == 1 else None
        if value is None or value >= 1 << self.bits.get(key, 64):
            return None, True
        return value, False

    def _column(self, key: tuple[str, str], lengths: np.ndarray, table: _Table | None = None
                ) -> tuple[list[int] | np.ndarray, np.ndarray]:
        """``key``'s number at each of ``lengths`` (int64), as :meth:`_value` gives it one at a
        time, and where it is derivable (a mask; elsewhere the value means nothing), computed
        in numpy where the integers allow; else one length at a time. ``table``: every
        number's own stretches at ``lengths`` (:meth:`_table`), where the caller made it."""
        fitted, fitted_ok = self._fitted_column(key, lengths, table)
        if key not in self.quotients:
            return fitted, fitted_ok
        if ((forms := self._quotient_column(key, lengths, table)) is None
                or isinstance(fitted, list)):
            return self._column_by_length(key, lengths)
        value, defined, undecided = forms
        # As _value: undecided is underived; where a quotient gives a value and a trusted line
        # another, the quotient holds only if the samples lie on no one line.
        parted = defined & fitted_ok & (value != fitted)
        ok = np.where(defined, ~undecided & (~parted | self._line_refuted(key)), fitted_ok)
        return np.where(defined, value, fitted), ok

    def _column_by_length(self, key: tuple[str, str], lengths: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray]:
        out = np.zeros(len(lengths), dtype=np.int64)
        ok = np.zeros(len(lengths), dtype=bool)
        for i, length in enumerate(lengths.tolist()):
            if (value := self._value(key, length)) is not None:
                out[i], ok[i] = value, True
        return out, ok

    def _quotient_column(self, key: tuple[str, str], lengths: np.ndarray,
                         table: _Table | None = None
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """:meth:`_quotient` at each of ``lengths``: the value, where some form speaks
        (``defined``), and where the forms leave it undecided; None where the numbers may
        outgrow int64 (then :meth:`_column_by_length`). From ``table`` where it holds the
        number (made for these lengths)."""
        if table is not None and key in table.quotients:
            return table.quotients[key]
        count = len(lengths)
        value = np.zeros(count, dtype=np.int64)
        defined = np.zeros(count, dtype=bool)
        undecided = np.zeros(count, dtype=bool)
        for q in self.quotients[key]:
            if q.source == LENGTH:
                x, speaks = lengths, np.ones(count, dtype=bool)
            else:
                x, speaks = self._fitted_column((key[0], q.source), lengths, table)
                if isinstance(x, list):
                    return None
            largest = int(np.abs(x).max(initial=0))
            if (largest >= 1 << 62 or abs(q.intercept) >= 1 << 61
                    or abs(q.scale) * (largest // q.low + 1) >= 1 << 61):
                return None
            most, least = -(-x // q.low), -(-x // q.high)
            known = speaks & (x > 0) & (most == least)  # Quotient.at gives a number
            mine = q.intercept + q.scale * most
            # Undecided: a form that speaks and gives no number, or another than one before.
            undecided |= speaks & ~known
            undecided |= speaks & known & defined & (mine != value)
            value = np.where(known & ~defined, mine, value)
            defined |= speaks
        top = 1 << self.bits.get(key, 64)
        if top < 1 << 62:
            undecided |= defined & (value >= top)
        return value, defined, undecided

    @functools.cached_property
    def _stretches(self) -> _Stretches:
        """The stretches of every number whose lines all fit int64 (the others are computed
        number by number, :meth:`_fitted_column`). ``fits`` is not changed once made."""
        keys: dict[tuple[str, str], int] = {}
        starts, rows = [], []
        for key, segments in self.fits.items():
            if not all(seg.slope.denominator == 1 and seg.intercept.denominator == 1
                       and abs(seg.intercept.numerator) < 1 << 61
                       and abs(seg.slope.numerator) * (max(abs(seg.first), abs(seg.last)) + 1)
                       < 1 << 61 for seg in segments):
                continue
            top = 1 << self.bits.get(key, 64)
            top = top if top < 1 << 62 else np.iinfo(np.int64).max
            keys[key] = len(keys)
            starts.append(len(rows))
            rows += [(seg.first, seg.last, seg.slope.numerator, seg.intercept.numerator,
                      seg.support >= MIN_SUPPORT, top) for seg in segments]
        columns = np.array(rows, dtype=np.int64).reshape(-1, 6).T
        return _Stretches(keys, np.array(starts, dtype=np.intp), *columns[:4],
                          columns[4].astype(bool), columns[5])

    @functools.cached_property
    def _forms(self) -> _Forms:
        """The quotient forms :meth:`_table` computes at once (the others, number by number,
        :meth:`_quotient_column`). ``quotients`` is not changed once made."""
        rows = self._stretches.keys
        keys, starts, forms = [], [], []
        for key, quotients in self.quotients.items():
            sources = [-1 if q.source == LENGTH else rows.get((key[0], q.source))
                       for q in quotients]
            if None in sources or not all(abs(q.intercept) < 1 << 61 and abs(q.scale) < 1 << 61
                                          and q.high < 1 << 61 for q in quotients):
                continue
            top = 1 << self.bits.get(key, 64)
            top = top if top < 1 << 62 else np.iinfo(np.int64).max
            keys.append(key)
            starts.append(len(forms))
            forms += [(source, q.low, q.high, q.scale, q.intercept, top)
                      for source, q in zip(sources, quotients, strict=True)]
        columns = np.array(forms, dtype=np.int64).reshape(-1, 6).T
        return _Forms(keys, np.array(starts, dtype=np.intp), *columns[:5],
                      columns[5][np.array(starts, dtype=np.intp)])

    def _table(self, lengths: np.ndarray) -> _Table:
        """Every number's :meth:`_fitted_column` and :meth:`_quotient_column` at ``lengths``
        at once, where their numbers fit int64: a few numpy operations over all stretches and
        forms, where a call a number made tens of thousands of small ones in a derivation's
        rounds (on an H100, a Llama family's ``coverage`` and ``disputed`` spent 4.2 of 38 s
        so)."""
        stretches = self._stretches
        if not stretches.keys:
            empty = np.zeros((0, len(lengths)), dtype=np.int64)
            return _Table({}, empty, empty.astype(bool))
        table = _Table(stretches.keys, *stretches.at(lengths))
        forms = self._forms
        if not forms.keys or not len(lengths):
            return table
        length = forms.source < 0
        source = np.maximum(forms.source, 0)
        x = np.where(length[:, None], lengths[None, :], table.values[source])
        speaks = length[:, None] | table.ok[source]
        # As _quotient_column: a form whose numbers may outgrow int64 leaves its number to
        # that (checked in floats, with room for their rounding).
        largest = np.abs(x).max(axis=1)
        safe = (largest < 1 << 62) & (np.abs(forms.scale).astype(float)
                                      * (largest // forms.low + 1) < 2.0 ** 60)
        most, least = -(-x // forms.low[:, None]), -(-x // forms.high[:, None])
        known = speaks & (x > 0) & (most == least)  # Quotient.at gives a number
        mine = forms.intercept[:, None] + forms.scale[:, None] * most
        # A number is undecided where a form speaks and gives none, or two give two values.
        big = np.iinfo(np.int64).max
        given = speaks & known
        defined = np.logical_or.reduceat(speaks, forms.starts, axis=0)
        silent = np.logical_or.reduceat(speaks & ~known, forms.starts, axis=0)
        least_value = np.minimum.reduceat(np.where(given, mine, big), forms.starts, axis=0)
        most_value = np.maximum.reduceat(np.where(given, mine, -big), forms.starts, axis=0)
        undecided = silent | (defined & (least_value != most_value))
        undecided |= defined & (least_value >= forms.top[:, None])
        all_safe = np.logical_and.reduceat(safe, forms.starts)
        for i, key in enumerate(forms.keys):
            if all_safe[i]:
                table.quotients[key] = (least_value[i], defined[i], undecided[i])
        return table

    def _fitted_column(self, key: tuple[str, str], lengths: np.ndarray,
                       table: _Table | None = None
                       ) -> tuple[list[int] | np.ndarray, np.ndarray]:
        """:meth:`_fitted` at each of ``lengths``: from ``table`` where it holds the number
        (made for these lengths); else a stretch whose line is in integers small enough is
        computed in numpy at once, others one length at a time (then a list, in Python's
        integers)."""
        if table is not None and (row := table.keys.get(key)) is not None:
            return table.values[row], table.ok[row]
        out = np.zeros(len(lengths), dtype=np.int64)
        ok = np.zeros(len(lengths), dtype=bool)
        done = np.zeros(len(lengths), dtype=bool)  # the first stretch holding a length decides
        top = 1 << self.bits.get(key, 64)
        wide: dict[int, int] = {}  # lengths whose value needs Python's integers
        for seg in self.fits[key]:
            inside = (lengths >= seg.first) & (lengths <= seg.last) & ~done
            if not inside.any():
                continue
            done |= inside
            if seg.support < MIN_SUPPORT:
                continue
            slope, intercept = seg.slope, seg.intercept
            if (slope.denominator == 1 and intercept.denominator == 1
                    and abs(intercept.numerator) < 1 << 61
                    and abs(slope.numerator) * (seg.last + 1) < 1 << 61):
                values = intercept.numerator + slope.numerator * lengths[inside]
                valid = values >= 0
                if top < 1 << 62:
                    valid &= values < top
                out[inside] = values
                ok[inside] = valid
            else:
                for i in np.flatnonzero(inside).tolist():
                    value = self._fitted(key, int(lengths[i]))
                    if value is not None:
                        wide[i] = value
                        ok[i] = True
        if not wide:
            return out, ok
        values = out.tolist()
        for i, value in wide.items():
            values[i] = value
        return values, ok

    def covered(self, lengths: Iterable[int]) -> list[int]:
        """The lengths among ``lengths`` that are derivable (:meth:`covers`), found a number
        at a time for all of them."""
        return self.coverage(lengths)[0]

    def holding_back(self, lengths: Iterable[int], by_node: bool = False
                     ) -> Counter[tuple[str, str]]:
        """How many of ``lengths`` each fitted number leaves underived, by (kernel, or the
        buffer, and number; with ``by_node``, the node rather than its kernel): what to read
        where fewer lengths derived than hoped. On GPT-2 small sampled one length in 32 of a
        class: pointers into the graphs' pool, whose stretches between the allocator's
        changes of layout held too few samples."""
        return self.coverage(lengths, by_node)[1]

    def coverage(self, lengths: Iterable[int], by_node: bool = False
                 ) -> tuple[list[int], Counter[tuple[str, str]]]:
        """:meth:`covered` and :meth:`holding_back` together, each number's column computed
        once."""
        lengths = list(lengths)
        at = np.asarray(lengths, dtype=np.int64)
        ok = np.ones(len(lengths), dtype=bool)
        held: Counter[tuple[str, str]] = Counter()
        table = self._table(at)
        # Numbers of the table with no quotient form: derivable where their stretches say,
        # all at once; the others one by one.
        plain = [key for key in table.keys if key not in self.quotients]
        rows = [table.keys[key] for key in plain]
        missing = (~table.ok[rows]).sum(axis=1).tolist() if rows else []
        if rows:
            ok &= table.ok[rows].all(axis=0)
        counts = dict(zip(plain, missing, strict=True))
        for where, what in self.fits:
            if (where, what) in counts:
                missing = counts[where, what]
            else:
                mine = self._column((where, what), at, table)[1]
                ok &= mine
                missing = int((~mine).sum())
            if missing:
                op = None if by_node or where.startswith("buffer:") else self.template.op(where)
                held[getattr(op, "name", where), what] += missing
        return [n for n, good in zip(lengths, ok.tolist(), strict=True) if good], held

    def uncovered(self, length: int) -> list[tuple[str, str]]:
        """The numbers that cannot be derived at ``length`` (none: it is derivable)."""
        return [key for key in self.fits if self._value(key, length) is None]

    def covers(self, length: int) -> bool:
        return not self.uncovered(length)

    def _numbers(self, length: int) -> dict[str, dict[str, int]]:
        """Every fitted number at ``length``, by node (or ``buffer:<id>``)."""
        numbers: dict[str, dict[str, int]] = {}
        missing = []
        for where, what in self.fits:
            value = self._value((where, what), length)
            if value is None:
                missing.append((where, what))
            numbers.setdefault(where, {})[what] = value
        if missing:
            where, what = missing[0]
            raise UnsupportedError(
                f"expected every varying number of the graph to be derivable at length "
                f"{length}, found {len(missing)} that are not (first: {what} of {where!r}; "
                f"captured lengths {self.lengths[0]}..{self.lengths[-1]}): capture it")
        return numbers

    @property
    def buffers_vary(self) -> bool:
        """Whether some buffer's size or address is fitted (changes with the length)."""
        return any(where.startswith("buffer:") for where, _ in self.fits)

    @functools.cached_property
    def varying(self) -> dict[str, list[str]]:
        """The numbers fitted for each node (``buffer:<id>`` entries left out)."""
        out: dict[str, list[str]] = {}
        for where, what in self.fits:
            if not where.startswith("buffer:"):
                out.setdefault(where, []).append(what)
        return out

    def rows(self, node: str, lengths: Sequence[int], table: _Table | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Kernel node ``node`` at each of ``lengths``, as rows of arrays in the layout of
        ``grape.passes.variants``: argument bytes (lengths, bytes) uint8, launch dimensions
        (lengths, 7) and pointers' offsets (lengths, pointers) int64. What :meth:`op_at` gives
        for the node at each length, without making an operation per length.

        Raises
        ------
        UnsupportedError
            Some length is not derivable (:meth:`graph_at`).

        ``table``: :meth:`_table` at ``lengths``, made once for all the nodes placed.
        """
        t = self.template.op(node)
        count, width = len(lengths), len(t.args)
        args = np.repeat(np.frombuffer(t.args, dtype=np.uint8)[None], count, axis=0)
        dims = np.tile(np.array([*t.grid, *t.block, t.shared_mem], dtype=np.int64), (count, 1))
        targets = np.tile(np.array([p.target.offset for p in t.pointers], dtype=np.int64),
                          (count, 1))
        pointer = {p.offset: j for j, p in enumerate(t.pointers)}
        at = np.asarray(lengths, dtype=np.int64)
        for what in self.varying.get(node, ()):
            values, ok = self._column((node, what), at, table)
            if not ok.all():
                self._numbers(int(at[~ok][0]))  # raises, naming what is missing
            if what[0] in "aw":
                o = int(what[1:])
                size = 8 if what[0] == "w" else min(4, width - o)
                words = np.array(values, dtype="<u8").view(np.uint8).reshape(count, 8)
                args[:, o:o + size] = words[:, :size]
            else:
                column = np.array(values, dtype=np.int64)
                if what[0] == "p":
                    targets[:, pointer[int(what[1:])]] = column
                else:
                    dims[:, _DIM_COLUMNS[what]] = column
        for o in sorted(self.dividers.get(node, ())):
            divisors = np.ascontiguousarray(args[:, o - 4:o]).view("<u4")[:, 0]
            magic = {int(d): _divider(int(d)) for d in np.unique(divisors)}
            pairs = np.array([magic[int(d)] for d in divisors], dtype="<u4").reshape(count, 2)
            args[:, o:o + 8] = pairs.view(np.uint8).reshape(count, 8)
        return args, dims, targets

    def op_at(self, node: str, length: int) -> Op:
        """Node ``node``'s operation at ``length``, derived (:meth:`graph_at`'s, for one
        node)."""
        numbers = {what: self._value((node, what), length) for what in self.varying.get(node, ())}
        if None in numbers.values():
            self._numbers(length)  # raises, naming what is missing
        return _rebuild(self.template.op(node), numbers, self.dividers.get(node, frozenset()))

    def graph_at(self, length: int) -> KernelGraph:
        """The graph at ``length``, derived, not captured.

        Raises
        ------
        UnsupportedError
            ``length`` lies where some number has no trusted stretch: capture it instead.
        """
        numbers = self._numbers(length)
        out = KernelGraph()
        for b in self.template.buffers.values():
            got = numbers.get(f"buffer:{b.id}", {})
            out.add_buffer(dataclasses.replace(b, size=got.get("size", b.size),
                                               address=got.get("address", b.address)))
        # The template's nodes and edges (copy() copies each node's attributes, so replacing
        # an op here leaves the template's alone); only nodes with numbers are rebuilt.
        out.dag = self.template.dag.copy()
        for node, attributes in out.dag.nodes.items():
            if node in numbers:
                attributes["op"] = _rebuild(attributes["op"], numbers[node],
                                            self.dividers.get(node, frozenset()))
        return out

    def check(self, length: int, captured: KernelGraph) -> list[str]:
        """The nodes (and buffers) whose derived form differs from ``captured``'s, at a
        captured length, outside loose slots: none means the derivation reproduces it byte for
        byte there."""
        derived = self.graph_at(length)
        pairs = match(derived, captured)
        differ = [node for node in derived.dag.nodes
                  if _masked(derived.op(node), self.loose.get(node, frozenset()))
                  != _masked(captured.op(pairs[node]), self.loose.get(node, frozenset()))]
        differ += [f"buffer:{b}" for b, buf in derived.buffers.items()
                   if captured.buffers.get(b) != buf]
        return differ

    def differences(self, length: int, captured: KernelGraph
                    ) -> list[tuple[str, str, int | None, int | None]]:
        """What :meth:`check` found, number by number: (node, number, derived, captured) for
        each number outside loose slots that differs (divider slots read as numbers here), and
        (node, field, None, None) where something that is no number differs."""
        derived = self.graph_at(length)
        pairs = match(derived, captured)
        out: list[tuple[str, str, int | None, int | None]] = []
        for node in derived.dag.nodes:
            loose = self.loose.get(node, frozenset())
            mine, theirs = derived.op(node), captured.op(pairs[node])
            if _masked(mine, loose) == _masked(theirs, loose):
                continue
            (fixed, a), (their_fixed, b) = _flatten(mine, loose), _flatten(theirs, loose)
            if fixed != their_fixed:
                out.append((node, _first_difference(fixed, their_fixed), None, None))
            out += [(node, k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys())
                    if a.get(k) != b.get(k)]
        return out


@dataclass(frozen=True)
class _Share:
    """One node's share of a derivation: its stray slots, its dividers' slots, the fits of
    its numbers that vary, their widths in bits and their quotient forms."""

    stray: Slots
    dividers: Slots
    fits: dict[str, list[Segment]]
    bits: dict[str, int]
    quotients: dict[str, tuple[Quotient, ...]]


def _node_share(node: str, seen: list[Op], lengths: tuple[int, ...], loose: Slots
                ) -> _Share | None:
    """:func:`derive`'s work on one node, its versions ``seen`` at ``lengths``: None where
    nothing of it varies (about half a Llama step's nodes).

    Raises
    ------
    GraphError
        The node differs in something that is not a number between two lengths.
    """
    first = seen[0]
    if all(op == first for op in seen[1:]):
        return None
    stray = stray_slots(seen)
    skip = loose | stray
    one_kernel = isinstance(first, Kernel) and all(
        isinstance(op, Kernel) and len(op.args) == len(first.args) for op in seen)
    varying, rows = _varying(seen) if one_kernel else (None, None)
    dividers: Slots = frozenset()
    if varying and (dividers := _dividers(seen, skip, varying)):
        skip = skip | {o + k for o in dividers for k in (0, 4)}
    if one_kernel:
        numbers = _kernel_numbers(node, seen, lengths, skip, varying, rows)
    else:
        per = []  # the node's numbers at each length
        fixed_first = None
        for length, op in zip(lengths, seen, strict=True):
            fixed, mine = _flatten(op, skip, slots=varying)
            if fixed_first is None:
                fixed_first = fixed
            elif fixed != fixed_first:
                what = _first_difference(fixed_first, fixed)
                raise GraphError(f"expected node {node!r} to differ in numbers only between "
                                 f"lengths {lengths[0]} and {length}, found its {what} "
                                 f"changed")
            per.append(mine)
        numbers = {what: [mine.get(what) for mine in per]
                   for what in dict.fromkeys(k for mine in per for k in mine)}
    # Only numbers that vary are fitted, and most do not (a weight's pointer): a number's
    # values are gathered into points only once they are seen to differ.
    series, fits, bits = {}, {}, {}
    for what, values in numbers.items():
        if values.count(values[0]) != len(values):
            points = [(length, v) for length, v in zip(lengths, values, strict=True)
                      if v is not None]
            series[what] = points
            if len({v for _, v in points}) > 1:
                fits[what] = _segments(points)
                bits[what] = _bits(what, first)  # the template's
    return _Share(stray, dividers, fits, bits, _quotients(series, fits))


def derive(samples: Mapping[int, KernelGraph],
           loose: Mapping[str, Slots] | None = None) -> Derivation:
    """Fit every varying number of ``samples`` (graphs by length, one structure) to the length.

    ``loose``: the loose argument slots of the smallest length's nodes (:func:`loose_slots`),
    left out of the fits and the checks; the samples' stray pointers (:func:`stray_slots`)
    join them.

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
    loose = {node: slots for node, slots in (loose or {}).items() if slots}
    series: dict[tuple[str, str], list[tuple[int, int]]] = {}  # the buffers' numbers
    ops: dict[str, list[Op]] = {node: [] for node in template.dag.nodes}
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
        for node, seen in ops.items():
            seen.append(graph.op(pairs[node]))
    dividers: dict[str, Slots] = {}
    bits: dict[tuple[str, str], int] = {}
    quotients: dict[tuple[str, str], tuple[Quotient, ...]] = {}
    fits = {}
    for key, points in series.items():  # the buffers'
        if len({v for _, v in points}) > 1:
            fits[key] = _segments(points)
    for node, seen in ops.items():
        # A node's share depends on its versions and loose slots alone: derivation's rounds
        # and checks ask it of the same versions again (grape.passes.memo)
        mine = loose.get(node, frozenset())
        share = recall("derive node", tuple(seen), (lengths, mine),
                       lambda node=node, seen=seen, mine=mine: _node_share(
                           node, seen, lengths, mine))
        if share is None:
            continue
        if share.stray:
            loose[node] = mine | share.stray
        if share.dividers:
            dividers[node] = share.dividers
        for what, segments in share.fits.items():
            fits[(node, what)] = segments
            bits[(node, what)] = share.bits[what]
        for what, forms in share.quotients.items():
            quotients[(node, what)] = forms
    return Derivation(template, lengths, fits, loose, dividers, bits, quotients)


def place_derived(variants: Variants, d: Derivation, lengths: Sequence[int], base: Hashable,
                  pairs: Mapping[str, str]) -> None:
    """Add derived ``lengths`` (each derivable by ``d``) to an executable's ``variants``, all
    at once: each takes the versions of the captured length they are derived from (``base``,
    ``d.lengths[0]``, already among ``variants``' shapes) but for the nodes ``d`` rebuilds,
    whose versions come from :meth:`Derivation.rows` a node at a time (an operation per
    length only where the executable keeps that node's versions as operations). ``pairs``: the
    executable's template nodes to ``base``'s graph's. What ``Variants.add_changes`` gives
    length by length (``base``'s changes with each rebuilt node's :meth:`Derivation.op_at`
    over them), without an object per length and node.

    Raises
    ------
    UnsupportedError
        Some length is not derivable; nothing is added then.
    """
    # a derived length runs the alternates its base runs (Variants.runs)
    back = {theirs: variants.runs(mine, base) for mine, theirs in pairs.items()}
    lengths = list(lengths)
    made: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray] | list[Op]] = {}
    table = d._table(np.asarray(lengths, dtype=np.int64))  # every number's stretches at once
    for node in d.varying:  # every length's numbers first: a length that fails adds nothing
        mine = back[node]
        versions = variants.nodes.get(mine) or NodeVersions(mine, variants.op(mine))
        if versions.takes_rows(d.template.op(node)):
            made[node] = d.rows(node, lengths, table)
        else:
            made[node] = [d.op_at(node, length) for length in lengths]
    numbers = {}
    for node, found in made.items():
        versions = variants.node(back[node])
        numbers[back[node]] = versions.add_rows(*found) if isinstance(found, tuple) \
            else [versions.add(op) for op in found]
    variants.add_like(lengths, base, numbers)


def _differs(a: KernelGraph, at: int, b: KernelGraph, bt: int) -> str | None:
    """What keeps two graphs (at lengths ``at`` and ``bt``) from one derivation, as
    :func:`derive` would say it, without fitting anything: None where only numbers differ."""
    try:
        pairs = match(a, b)
    except GraphError as e:
        return str(e)
    if set(a.buffers) != set(b.buffers):
        extra = sorted(set(a.buffers) ^ set(b.buffers))
        return (f"expected the same buffers at every length, found {extra[0]!r} at one of "
                f"lengths {at} and {bt} only")
    if same_ids(a, b) and _fixed_parts(a) == _fixed_parts(b):
        return None  # node to node under the same ids (most neighbouring captures)
    for node, op in a.ops():
        other = b.op(pairs[node])
        mine, theirs = _flatten(op, fixed_only=True)[0], _flatten(other, fixed_only=True)[0]
        if mine != theirs and (stray := stray_slots((op, other))):
            # looked for only where something differs: most nodes differ in nothing fixed
            mine, theirs = (_flatten(op, stray, fixed_only=True)[0],
                            _flatten(other, stray, fixed_only=True)[0])
        if mine != theirs:
            return (f"expected node {node!r} to differ in numbers only between lengths {at} "
                    f"and {bt}, found its {_first_difference(mine, theirs)} changed")
    return None


def _fixed_parts(graph: KernelGraph) -> dict[str, tuple]:
    """What of each of ``graph``'s nodes must stay equal across lengths (:func:`_flatten`'s
    ``fixed_only``), by node, made once and remembered (``grape.passes.memo``): each capture
    is compared with its neighbours on both sides, and again as samples are added between
    them, and two graphs under the same ids then compare as two dictionaries."""
    return recall("fixed parts", (graph,), (), lambda: {
        node: _flatten(op, fixed_only=True)[0] for node, op in graph.ops()})


_FIXED_NAMES = ("kind", "function", "name", "attributes", "parameter layout", "handles",
                "argument length", "pointers' buffers")


def _first_difference(a: tuple, b: tuple) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return _FIXED_NAMES[i] if a[0] == "kernel" and i < len(_FIXED_NAMES) else "kind"
    return "kind"


def loose_at_both(small: tuple[KernelGraph, KernelGraph], large: tuple[KernelGraph, KernelGraph]
                  ) -> dict[str, Slots]:
    """The slots of ``small[0]``'s nodes that are loose (:func:`loose_slots`) both between the
    two captures in ``small`` and between the two in ``large`` (two lengths of one structure):
    a slot PyTorch fills at one of them is no loose slot."""
    return _both(small[0], loose_slots(*small), large[0], loose_slots(*large))


def _both(small: KernelGraph, at_small: Mapping[str, Slots], large: KernelGraph,
          at_large: Mapping[str, Slots]) -> dict[str, Slots]:
    pairs = match(small, large)
    return {node: s & at_large.get(pairs[node], frozenset()) for node, s in at_small.items()
            if s & at_large.get(pairs[node], frozenset())}

