"""Deriving a family's graphs at lengths it never captured (grape.passes.derive)."""

from __future__ import annotations

import pytest

from grape.errors import GrapeError, GraphError, UnsupportedError
from grape.ir import Buffer, BufferRole, Kernel, KernelGraph, Memcpy, Param, Pointer, Span
from grape.passes.derive import derive, derive_lengths

ROW = 128  # bytes of cache per position


def step(n: int, function: str = "attn@0x1", square: bool = False) -> KernelGraph:
    """A decode step at KV length ``n``: an attention kernel whose grid is ceil(n / 64), whose
    arguments hold a pointer to the cache's row ``n``, the length and a constant, and a copy
    of that row out."""
    g = KernelGraph()
    g.add_buffer(Buffer("cache", 1 << 20, BufferRole.INTERNAL, address=0x10000))
    g.add_buffer(Buffer("out", 4096, BufferRole.OUTPUT, address=0x90000))
    value = n * n if square else n
    args = ((0x10000 + ROW * n).to_bytes(8, "little") + value.to_bytes(4, "little")
            + (64).to_bytes(4, "little"))
    g.add("attn", Kernel(function, "attn", grid=(-(-n // 64), 1, 1), block=(128, 1, 1),
                         args=args, params=(Param(0, 8), Param(8, 4), Param(12, 4)),
                         pointers=(Pointer(0, Span("cache", ROW * n)),)))
    g.add("copy", Memcpy(Span("cache", ROW * n), Span("out", 0), ROW), after=["attn"])
    return g


SAMPLED = range(1, 257, 8)  # every eighth length: 1, 9, ..., 249


def test_a_length_never_captured_is_derived_byte_for_byte():
    d = derive({n: step(n) for n in SAMPLED})
    for n in (100, 2, 245, 129):
        assert d.covers(n)
        assert d.check(n, step(n)) == [], n
    assert d.graph_at(100) == step(100)


def test_a_length_between_two_stretches_is_not_guessed():
    d = derive({n: step(n) for n in SAMPLED})
    # The grid steps from 1 to 2 somewhere between the captured 57 and 65: not derivable.
    assert not d.covers(60) and d.uncovered(60) == [("attn", "grid0")]
    with pytest.raises(UnsupportedError, match="derivable at length 60, found 1 that are not "
                                               "\\(first: grid0 of 'attn'; captured lengths "
                                               "1..249\\): capture it"):
        d.graph_at(60)
    assert not d.covers(256)  # past the last captured length: no extrapolation


def test_a_number_that_is_not_affine_in_the_length_is_refused():
    d = derive({n: step(n, square=True) for n in SAMPLED})
    assert not any(d.covers(n) for n in (9, 100, 200))
    assert ("attn", "arg1") in d.uncovered(100)


def test_two_points_on_a_line_are_not_trusted():
    d = derive({n: step(n) for n in (1, 9)})
    assert not d.covers(5)


def test_samples_that_differ_in_more_than_numbers_are_refused():
    samples = {n: step(n) for n in SAMPLED}
    samples[33] = step(33, function="attn_split@0x2")
    with pytest.raises(GraphError, match="expected node 'attn' to differ in numbers only "
                                         "between lengths 1 and 33, found its function changed"):
        derive(samples)
    other = step(41)
    other.add("extra", Kernel("k@0x3", "k", (1, 1, 1), (32, 1, 1)))
    with pytest.raises(GraphError, match="expected graphs of one structure"):
        derive({1: step(1), 41: other})
    with pytest.raises(GraphError, match="expected graphs at two or more lengths"):
        derive({1: step(1)})


def test_check_names_the_nodes_a_derivation_does_not_reproduce():
    d = derive({n: step(n) for n in SAMPLED})
    captured = step(100)
    attn = captured.op("attn")
    import dataclasses

    captured.dag.nodes["attn"]["op"] = dataclasses.replace(
        attn, args=attn.args[:12] + (65).to_bytes(4, "little"))
    assert d.check(100, captured) == ["attn"]


def _recorder(make):
    calls = []

    def capture(n):
        calls.append(n)
        return make(n)
    return capture, calls


def test_a_family_captures_one_length_in_eight_and_derives_the_rest_byte_for_byte():
    capture, calls = _recorder(step)
    got = derive_lengths(capture, range(1, 257), every=8, checks=2)
    assert calls == got.captured
    samples = sorted(set(range(1, 257, 8)) | {256}, reverse=True)
    assert calls[:len(samples)] == samples  # samples first, largest first
    assert len(got.checked) == 2 and all(v == [] for v in got.checked.values())
    assert got.refused == []
    assert sorted(got.captured + got.derived) == list(range(1, 257))
    for n in got.derived:
        assert got.graphs[n] == step(n), n
    # Only the lengths where the grid steps between two samples are captured besides them.
    assert len(got.captured) < 256 // 4 and len(got.derived) > 3 * 256 // 4


def test_a_check_that_disagrees_refuses_its_stretch_and_its_lengths_are_captured():
    def odd(n):  # off its line at every length no sample sits on: only a check can tell
        return step(n) if n % 8 == 1 or n == 100 else step(n, square=True)

    capture, _ = _recorder(odd)
    got = derive_lengths(capture, range(1, 101), every=8, checks=1)
    assert got.refused and all(v for v in got.checked.values())
    assert got.derived == [] and sorted(got.captured) == list(range(1, 101))


def test_nothing_is_derived_across_a_change_of_kernel():
    def switching(n):
        return step(n, function="attn@0x1" if n < 130 else "attn_split@0x2")

    capture, _ = _recorder(switching)
    got = derive_lengths(capture, range(1, 257), every=8, checks=1)
    assert got.refused == []
    for n in got.derived:
        assert got.graphs[n] == switching(n), n
    # The change, between the samples 129 and 137, is bisected down to its two sides.
    assert {129, 130} <= set(got.captured) and len(got.captured) < 256 // 4


def test_derive_lengths_refuses_bad_arguments():
    with pytest.raises(GrapeError, match="expected lengths, every >= 1 and checks >= 0, found "
                                         "0 lengths, every=8, checks=1"):
        derive_lengths(step, [])
    with pytest.raises(GrapeError, match="every=0"):
        derive_lengths(step, [1, 2], every=0)


def test_kernels_that_change_every_few_lengths_are_located_and_the_runs_between_derived():
    # A kernel change every 12 lengths: sampled one in eight, no run has three samples and
    # nothing could be derived. Each change is bisected down to its neighbouring lengths and
    # runs short of support get more samples; everything else is derived, byte for byte.
    def choppy(n):
        return step(n, function=f"attn@{(n - 1) // 12:#x}")

    capture, calls = _recorder(choppy)
    got = derive_lengths(capture, range(1, 97), every=8, checks=1)
    assert got.refused == [] and got.derived
    assert sorted(got.captured + got.derived) == list(range(1, 97))
    assert len(set(calls)) == len(calls)  # no length captured twice
    for n in got.derived:
        assert got.graphs[n] == choppy(n), n
    assert [(a, b) for a, b, _ in got.cuts] == [(c, c + 1) for c in range(12, 96, 12)]
    assert "function changed" in got.cuts[0][2]
    for change in range(12, 96, 12):  # both sides of every change were captured
        assert {change, change + 1} <= set(got.captured), change


def test_a_topology_that_changes_at_every_length_is_captured_at_every_length():
    capture, _ = _recorder(lambda n: step(n, function=f"attn@{n:#x}"))
    got = derive_lengths(capture, range(1, 41), every=8, checks=1)
    assert got.derived == [] and sorted(got.captured) == list(range(1, 41))
