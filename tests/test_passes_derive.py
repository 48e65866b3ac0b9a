"""Deriving a family's graphs at lengths it never captured (grape.passes.derive)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grape.errors import GrapeError, GraphError, UnsupportedError
from grape.ir import Buffer, BufferRole, Kernel, KernelGraph, Memcpy, Param, Pointer, Span
from grape.passes.derive import LENGTH, Quotient, derive
from grape.passes.lengths import derive_lengths

ROW = 128  # bytes of cache per position


def step(n: int, function: str = "attn@0x1", square: bool = False,
         constant: int = 64) -> KernelGraph:
    """A decode step at KV length ``n``: an attention kernel whose grid is ceil(n / 64), whose
    arguments hold a pointer to the cache's row ``n``, the length and a constant, and a copy
    of that row out."""
    g = KernelGraph()
    g.add_buffer(Buffer("cache", 1 << 20, BufferRole.INTERNAL, address=0x10000))
    g.add_buffer(Buffer("out", 4096, BufferRole.OUTPUT, address=0x90000))
    value = n * n if square else n
    args = ((0x10000 + ROW * n).to_bytes(8, "little") + value.to_bytes(4, "little")
            + constant.to_bytes(4, "little"))
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
    # The grid steps from 1 to 2 somewhere between the captured 57 and 65. As a rounded-up
    # quotient of the length's slot, ceil(n / d), the samples leave d anywhere in 63..64: 60
    # takes one block either way, 64 one or two.
    assert d.quotients == {("attn", "grid0"): (Quotient("a8", 63, 64),)}
    assert d.covers(60) and d.check(60, step(60)) == []
    assert not d.covers(64) and d.uncovered(64) == [("attn", "grid0")]
    with pytest.raises(UnsupportedError, match="derivable at length 64, found 1 that are not "
                                               "\\(first: grid0 of 'attn'; captured lengths "
                                               "1..249\\): capture it"):
        d.graph_at(64)
    assert not d.covers(256)  # past the last captured length: no extrapolation


def test_a_grid_that_steps_between_samples_is_derived_as_a_quotient_of_its_element_count():
    # One sample in 32 lengths: two samples on each step of ceil(n / 64), which no stretch of
    # its own trusts; as ceil(n / d) with d in 57..64 it derives wherever that range agrees.
    sparse = range(1, 257, 32)
    d = derive({n: step(n) for n in sparse})
    assert d.quotients == {("attn", "grid0"): (Quotient("a8", 57, 64),)}
    derived = [n for n in range(1, 226) if n not in sparse and d.covers(n)]
    assert len(derived) > 150
    assert all(d.graph_at(n) == step(n) for n in derived)
    assert not any(d.covers(n) for n in (58, 64, 120, 128))  # where 57..64 disagree
    # A grid that is no such quotient at some sample finds none (the length squared beside
    # it), only the same staircase in the length itself
    assert derive({n: step(n, square=True) for n in sparse}).quotients == {
        ("attn", "grid0"): (Quotient(LENGTH, 57, 64),)}
    got = derive_lengths(_recorder(step)[0], range(1, 257), every=32, checks=1)
    assert len(got.derived) > 150 and not got.refused
    assert all(got.graphs[n] == step(n) for n in got.derived)


def behind_a_growing_block(n: int) -> KernelGraph:
    """A multiply whose input sits behind a block of one byte a position that the allocator
    rounds to 512: 26,624 + 512 * ceil(n / 512) bytes into the pool, as a Llama step's did on
    the H200 over KV lengths 1..2047 (run 47); its grid and length are a line."""
    g = KernelGraph()
    g.add_buffer(Buffer("pool", 1 << 20, BufferRole.INTERNAL, address=0x100000))
    offset = 26_624 + 512 * -(-n // 512)
    args = (0x100000 + offset).to_bytes(8, "little") + n.to_bytes(4, "little") + bytes(4)
    g.add("mul", Kernel("mul@0x4", "mul", grid=(n, 1, 1), block=(128, 1, 1), args=args,
                        params=(Param(0, 8), Param(8, 4), Param(12, 4)),
                        pointers=(Pointer(0, Span("pool", offset)),)))
    return g


def test_a_pointer_that_steps_with_the_length_is_derived_between_its_steps():
    # Samples 128 lengths apart in a class modulo 8, the steps between them: no stretch
    # reaches across a step, a staircase in the length does.
    lengths = range(5, 2042, 8)
    samples = [*lengths[::16], lengths[-1]]
    d = derive({n: behind_a_growing_block(n) for n in samples})
    ((q,),) = {d.quotients[("mul", "p0")]}
    assert (q.source, q.scale, q.intercept) == (LENGTH, 512, 26_624) and q.low <= 512 <= q.high
    derived = [n for n in lengths if n not in samples and d.covers(n)]
    assert len(derived) > 200
    assert all(d.graph_at(n) == behind_a_growing_block(n) for n in derived)
    # Where the divisors the samples leave open part, nothing is derived
    assert not any(q.low * k < n <= q.high * k for k in (1, 2, 3) for n in derived)
    got = derive_lengths(_recorder(behind_a_growing_block)[0], lengths, every=16, checks=1)
    assert len(got.derived) > 200 and not got.refused
    assert all(got.graphs[n] == behind_a_growing_block(n) for n in got.derived)
    _columns_agree_with_lengths([d, *got.derivations], range(-3, 2100))


def test_a_word_that_changed_once_is_no_staircase_in_the_length():
    # A leftover that held one value, then another: one rise (on the H200 a Llama step's
    # leftovers fitted such a form 68 times before two rises of one size were asked for).
    from grape.passes.derive import _length_steps

    assert _length_steps([(8, 32694), (136, 32694), (256, 32697), (392, 32697)]) == ()
    assert _length_steps([(8, 1), (136, 5), (256, 7), (392, 7)]) == ()  # rises of two sizes
    assert _length_steps([(8, 1), (136, 5), (264, 9), (392, 9)])  # two of one size


def test_a_size_padded_to_a_multiple_is_derived_as_a_scaled_quotient():
    # A row of the mask padded to 256 positions, in bytes (512 per 256 begun), beside the
    # length: a staircase with steps 256 lengths wide, sampled every 128.
    def padded(n: int) -> KernelGraph:
        g = KernelGraph()
        g.add_buffer(Buffer("mask", 1 << 20, BufferRole.INTERNAL, address=0x10000))
        args = n.to_bytes(4, "little") + (512 * -(-n // 256)).to_bytes(4, "little")
        g.add("where", Kernel("where@0x3", "where", grid=(1, 1, 1), block=(128, 1, 1),
                              args=args, params=(Param(0, 4), Param(4, 4))))
        return g

    d = derive({n: padded(n) for n in [*range(1, 1024, 128), 1023]})
    assert d.quotients[("where", "a4")] == (Quotient("a0", 256, 256, scale=512),)
    got = derive_lengths(_recorder(padded)[0], range(1, 1024), every=128, checks=1)
    assert len(got.derived) > 900 and not got.refused
    assert all(got.graphs[n] == padded(n) for n in got.derived)
    # Sampled once a step (every 256), the samples 1, 257, 513 and 769 lie on a line, which
    # misses the lengths between them; the quotient holds at all of them. Where the two give
    # two values nothing is derived: only a capture could say which is right.
    d = derive({n: padded(n) for n in (1, 257, 513, 769)})
    assert d._fitted(("where", "a4"), 300) == 510 + 2 * 300  # the line's, not 1024
    assert not d.covers(300) and d.uncovered(300) == [("where", "a4")]
    assert d.disputed([300, 513]) == [300]  # at a sample the two agree
    # A sample off that line (1023: 1024, where the line says 2556) leaves the quotient the
    # one form true at every sample, and it derives the lengths the line would have missed.
    d = derive({n: padded(n) for n in (1, 257, 513, 769, 1023)})
    assert d.fits[("where", "a4")][0].last == 769  # the line, broken after 769
    assert d.covers(300) and d.graph_at(300) == padded(300)
    assert d.covers(900) and d.graph_at(900) == padded(900)
    assert d.disputed(range(2, 1023)) == []
    # derive_lengths captures where the forms part, and derives the rest right.
    got = derive_lengths(_recorder(padded)[0], range(1, 1024), every=256, checks=1)
    assert not got.refused and all(got.graphs[n] == padded(n) for n in got.derived)
    assert len(got.derived) > 900 and len(got.tie_breaks) <= 2, got.tie_breaks


def test_a_capture_where_a_line_and_a_staircase_part_settles_which_one_holds():
    # The H200's memory-efficient attention over GPT-2's KV lengths 1..1023 holds a count
    # padded to 16 beside the length; sampled every 16 lengths of a class modulo 8 (128
    # apart), every sample lies on one step of it, and on the line n + 8 too. They part at
    # half the lengths between: nothing there derived, until a capture where they part.
    def padded(n: int, line: bool = False) -> KernelGraph:
        g = KernelGraph()
        g.add_buffer(Buffer("out", 1 << 20, BufferRole.INTERNAL, address=0x10000))
        count = n + 8 if line and n % 128 != 8 else 16 * -(-n // 16)
        args = n.to_bytes(4, "little") + count.to_bytes(4, "little")
        g.add("attn", Kernel("attn@0x5", "attn", grid=(1, 1, 1), block=(128, 1, 1),
                             args=args, params=(Param(0, 4), Param(4, 4))))
        return g

    got = derive_lengths(_recorder(padded)[0], range(1, 1024), every=16, period=8, checks=1)
    assert all(got.graphs[n] == padded(n) for n in got.derived)
    assert len(got.derived) > 800 and not got.refused
    assert len(got.tie_breaks) <= 2 * 8  # at most two a class
    # Before any capture where they part, and with a sample off the line (which then holds
    # in stretches, refuted as one line), whole columns give what single lengths give.
    parting = derive({n: padded(n) for n in range(1, 1024, 128)})
    assert parting.disputed(range(1, 1024))
    refuted = derive({n: padded(n) for n in [*range(1, 1024, 128), 2, 3]})
    _columns_agree_with_lengths([parting, refuted, *got.derivations], range(1, 1024))
    # The same samples from a number that is the line (the staircase only where sampled):
    # the captures where the two part find the line, and nothing is derived wrong.
    def line(n: int) -> KernelGraph:
        return padded(n, line=True)

    got = derive_lengths(_recorder(line)[0], range(1, 1024), every=16, period=8, checks=1)
    assert all(got.graphs[n] == line(n) for n in got.derived)
    assert got.tie_breaks
    _columns_agree_with_lengths(got.derivations, range(1, 1024))


def test_a_number_that_is_not_affine_in_the_length_is_refused():
    d = derive({n: step(n, square=True) for n in SAMPLED})
    assert not any(d.covers(n) for n in (9, 100, 200))
    assert ("attn", "a8") in d.uncovered(100)  # the 32-bit slot at byte 8


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
    captured = step(100, constant=65)  # the constant no sample had
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
    # The smallest and largest sample again, for loose slots (this step has none).
    assert got.repeated == [1, 256]
    assert sorted(calls) == sorted(got.captured + got.repeated)
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
    with pytest.raises(GrapeError, match="expected lengths, every >= 1, checks >= 0, period >= 1 "
                                         "and start >= every, found 0 lengths, every=8, "
                                         "checks=1, period=1, start=8"):
        derive_lengths(step, [])
    with pytest.raises(GrapeError, match="every=0"):
        derive_lengths(step, [1, 2], every=0)
    with pytest.raises(GrapeError, match="period=0"):
        derive_lengths(step, [1, 2], period=0)
    with pytest.raises(GrapeError, match="every=8, checks=1, period=1, start=4"):
        derive_lengths(step, [1, 2], start=4)


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
    assert sorted(calls) == sorted(got.captured + got.repeated)
    assert len(set(got.captured)) == len(got.captured)  # none captured twice but for loose slots
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


# Arguments as PyTorch packs them: a length, an IntDivider of the length (divisor, multiplier,
# shift), and a slot it never fills, which holds whatever the host's stack held.
def packed(n: int, junk: int) -> KernelGraph:
    from grape.passes.derive import _divider

    g = KernelGraph()
    multiplier, shift = _divider(n + 1)
    words = [n, n + 1, multiplier, shift, junk & 0xFFFFFFFF]
    g.add("k", Kernel("k@0x1", "k", grid=(1, 1, 1), block=(32, 1, 1),
                      args=b"".join(w.to_bytes(4, "little") for w in words)))
    return g


def test_loose_slots_are_what_two_captures_of_a_length_do_not_share():
    from grape.passes.derive import loose_slots

    assert loose_slots(packed(5, 123), packed(5, 456)) == {"k": frozenset({16})}
    assert loose_slots(packed(5, 123), packed(5, 123)) == {}


def test_a_node_that_ran_another_kernel_in_the_second_capture_has_no_loose_slots():
    import dataclasses

    from grape.passes.derive import loose_slots

    again = packed(5, 456)
    again.dag.nodes["k"]["op"] = dataclasses.replace(again.op("k"), function="k_other@0x2")
    assert loose_slots(packed(5, 123), again) == {}  # not every word of it taken as leftover
    again = packed(5, 456)
    again.dag.nodes["k"]["op"] = dataclasses.replace(again.op("k"), grid=(2, 1, 1))
    assert loose_slots(packed(5, 123), again) == {}


def test_divider_multipliers_and_loose_slots_do_not_keep_a_length_from_deriving():
    import random

    from grape.passes.derive import loose_slots

    rng = random.Random(0)
    samples = {n: packed(n, rng.getrandbits(32)) for n in range(10, 200, 9)}
    assert not derive(samples).covers(100)  # the junk and the multiplier lie on no line
    loose = loose_slots(samples[10], packed(10, rng.getrandbits(32)))
    d = derive(samples, loose)
    assert d.dividers == {"k": frozenset({8})}
    captured = packed(100, rng.getrandbits(32))
    assert d.covers(100) and d.check(100, captured) == []
    derived = d.graph_at(100).op("k").args
    assert derived[:16] == captured.op("k").args[:16]  # the multiplier computed, not fitted
    assert derived[16:] == samples[10].op("k").args[16:]  # the loose slot: the template's
    # A slot that is loose in one pair of captures but fitted elsewhere is no loose slot of
    # the other: a derivation given the wrong slots still refuses what does not fit.
    assert derive(samples, {"k": frozenset({0})}).uncovered(100)


def test_a_second_capture_elsewhere_finds_the_leftovers_a_second_capture_here_repeats():
    import random

    # An unfilled word holding the host stack's leftover: the same in every capture of a
    # length on one thread (the same calls ran before), another on another thread's stack.
    junk = {n: random.Random(n).getrandbits(32) for n in range(1, 257)}

    def here(n):
        return packed(n, junk[n])

    def elsewhere(n):
        return packed(n, junk[n] ^ 0x5A5A5A5A)

    lengths = range(10, 200)
    same = derive_lengths(here, lengths, every=9, checks=1)
    assert same.derived == []  # the leftovers look like numbers on no line
    calls = []
    got = derive_lengths(here, lengths, every=9, checks=1,
                         again=lambda n: calls.append(n) or elsewhere(n))
    assert calls == got.repeated == [10, 199]  # the second captures, and only those, elsewhere
    assert got.refused == [] and len(got.derived) > len(lengths) // 2
    for n in got.derived[::7]:
        derived, captured = got.graphs[n].op("k").args, here(n).op("k").args
        assert derived[:16] == captured[:16], n  # every number right; the leftover the template's
        assert derived[16:] == here(got.derived_from[n]).op("k").args[16:]


def test_lengths_are_derived_within_their_residue_class():
    # Another kernel at every length 7 mod 8 (as a small GPT-2's attention on the H200):
    # sampled one in eight from 1, no sample would show it, and its lengths would be derived
    # with the other kernel. By residue class, each class keeps one kernel. (Samples one in two
    # of a class, 16 lengths apart: the grid's steps, 64 lengths apart, need three a stretch.)
    def aligned(n):
        return step(n, function="attn_unaligned@0x2" if n % 8 == 7 else "attn@0x1")

    got = derive_lengths(_recorder(aligned)[0], range(1, 513), every=2, checks=1, period=8)
    assert got.refused == [] and got.cuts == []
    assert sorted(got.captured + got.derived) == list(range(1, 513))
    for n in got.derived:
        assert got.graphs[n] == aligned(n), n
    assert {n % 8 for n in got.derived} == set(range(8)) and len(got.derived) > 512 // 3
    # One topology: its smallest and largest sample captured again, once each.
    assert got.repeated == [1, 512]
    # Without classes, the kernel of lengths 7 mod 8 is never seen and they are derived wrong:
    # the reason for ``period``.
    blind = derive_lengths(_recorder(aligned)[0], range(1, 513), every=8, checks=1)
    assert any(blind.graphs[n] != aligned(n) for n in blind.derived if n % 8 == 7)


def test_lengths_of_a_real_decode_step_derive_byte_for_byte_but_for_loose_slots():
    # GPT-2 small decode on the H200, KV lengths 240..255 captured twice in one process
    # (traces/README.md). From every other length of the larger executable, with the slots that
    # differ between the two captures of its first and last sample left out, the lengths
    # between samples on one stretch derive as captured, outside the loose slots.
    from grape.passes.families import match
    from tests.h200_captures import captures

    got = captures()
    graphs, samples, lengths = got.graphs, got.samples, got.lengths
    first, last = got.first, got.last
    assert not any(derive({n: graphs[n] for n in samples}).covers(n)
                   for n in lengths if n not in samples)
    d = got.derivation()
    assert sum(map(len, d.dividers.values())) == 13
    derivable = [n for n in lengths if n not in samples and d.covers(n)]
    assert len(derivable) >= 3
    for n in derivable:
        assert d.check(n, graphs[n]) == [], n
    # A derived graph keeps its derivation's template's nodes: matched once, that template's
    # pairs with another graph of the structure give the derived graph's delta unchanged.
    from grape.passes.delta import delta

    executable = graphs[last]  # a family's first capture, its largest length
    known = match(executable, d.template)
    for n in derivable:
        assert delta(executable, d.graph_at(n), pairs=known) == delta(executable,
                                                                      d.graph_at(n)), n
    # Placed without its graph: the derivation's template's own changes to the executable,
    # with the nodes the derivation rebuilds, are the same versions.
    from grape.passes.variants import Variants
    from tests.h200_captures import changes_at

    whole, direct = Variants(executable), Variants(executable)
    for v in (whole, direct):
        v.add_graph(first, graphs[first])
    for n in derivable:
        whole.add_graph(n, d.graph_at(n), pairs=known)
        direct.add_changes(n, changes_at(d, n, direct.ops(first), known))
        assert direct.ops(n) == whole.ops(n) and direct.ops(n), n


def test_differences_name_each_number_a_check_refuses():
    d = derive({n: step(n) for n in SAMPLED})
    captured = step(100, constant=65)  # the constant no sample had
    assert d.differences(100, captured) == [("attn", "a12", 64, 65)]
    assert d.differences(100, step(100)) == []
    got = derive_lengths(_recorder(step)[0], range(1, 257), every=8, checks=1)
    # Every derivation made is kept, its samples among the captured lengths.
    assert got.derivations
    assert all(set(d.lengths) <= set(got.captured) for d in got.derivations)


def _later_another(address_after: int, calls_before: int, before: int = 0x7F3A_1234_5678):
    """A capture function whose kernels carry a host word that changes after a number of
    captures (as a heap address left on the host stack did on the H200), not with the length."""
    count = [0]

    def capture(n):
        count[0] += 1
        g = step(n)
        attn = g.op("attn")
        word = before if count[0] <= calls_before else address_after
        import dataclasses

        g.dag.nodes["attn"]["op"] = dataclasses.replace(
            attn, args=attn.args + word.to_bytes(8, "little"))
        return g
    return capture


def test_a_host_address_that_changed_since_the_samples_is_loose_not_refused():
    # 33 samples, then the two captured again for loose slots: the word is the same in all.
    # The held-out check sees another address there and makes it loose, not a refusal.
    got = derive_lengths(_later_another(0x7F3A_0000_1000, 35), range(1, 257), every=8,
                         checks=1)
    assert got.refused == [] and got.derived
    assert [(node, offset) for _, node, offset in got.host_words] == [("attn", 16)]
    # Zero at the samples, an address later: the same.
    got = derive_lengths(_later_another(0x7F3A_0000_1000, 35, before=0), range(1, 257),
                         every=8, checks=1)
    assert got.refused == [] and got.host_words
    # A small number that changes so is no address: the check refuses its stretch.
    got = derive_lengths(_later_another(12345, 35, before=777), range(1, 257), every=8,
                         checks=1)
    assert got.refused and not got.host_words


def with_word(n: int, pointer: bool, word: int = 0x7F25_5320_4B20) -> KernelGraph:
    """``step(n)`` with one more argument word, at offset 16: a pointer to a weight's first
    byte, or ``word`` (by default a heap address: what PyTorch's unfilled bytes held)."""
    g = step(n)
    g.add_buffer(Buffer("weight", 4096, BufferRole.PARAMETER, address=0x7F24_1E80_0000))
    attn = g.op("attn")
    if pointer:
        g.dag.nodes["attn"]["op"] = dataclasses.replace(
            attn, args=attn.args + (0x7F24_1E80_0000).to_bytes(8, "little"),
            pointers=(*attn.pointers, Pointer(16, Span("weight", 0))))
    else:
        g.dag.nodes["attn"]["op"] = dataclasses.replace(
            attn, args=attn.args + word.to_bytes(8, "little"))
    return g


def test_a_word_that_is_a_pointer_at_some_lengths_and_a_host_address_at_others_is_loose():
    # Measured on the H200: a Llama-shaped decoder's RMS-norm reduction kept a weight's address
    # in an unfilled word at some KV lengths and a heap address at others; every neighbouring
    # pair of captures was cut there, and nothing derived.
    def stray(n):
        return with_word(n, pointer=n % 3 == 0)
    got = derive_lengths(stray, range(1, 257), every=8, checks=2)
    assert got.cuts == [] and got.refused == []
    assert len(got.derived) > 3 * 256 // 4
    for d in got.derivations:
        assert d.loose["attn"] == {16, 20}
    for n in got.derived:
        # Every byte but the stray word's, which keeps what the template had.
        d = got.graphs.derived[n]
        assert d.check(n, stray(n)) == []
        assert got.graphs[n].op("attn").args[:16] == stray(n).op("attn").args[:16]


def test_a_pointer_that_is_null_at_some_lengths_is_not_taken_for_a_stray_one():
    # A null (or a small number) might be an optional pointer the kernel skips: a change of
    # structure, nothing derived across it.
    def optional(n):
        return with_word(n, pointer=n >= 129, word=0)
    got = derive_lengths(optional, range(1, 257), every=8, checks=1)
    assert any("pointers' buffers" in why for *_, why in got.cuts)
    assert all(d.lengths[-1] < 129 or d.lengths[0] >= 129 for d in got.derivations)
    for n in got.derived:
        assert got.graphs[n] == optional(n), n


def test_a_stray_pointer_first_seen_at_a_held_out_length_is_loose_not_refused():
    # The samples all held the heap address there; a held-out capture finds the weight's
    # address instead (the word follows the host's history, not the length).
    count = [0]

    def later(n):
        count[0] += 1
        return with_word(n, pointer=count[0] > 35)
    got = derive_lengths(later, range(1, 257), every=8, checks=1)
    assert got.refused == [] and got.derived
    assert {(node, offset) for _, node, offset in got.host_words} == {("attn", 16)}


def leftover(n: int, split: bool = False) -> KernelGraph:
    """``step(n)`` with two more argument words: a leftover that switches between a few
    values with the host's history (a function of the length no form follows, the same in a
    second capture), and a word the kernel reads that is constant, or with ``split`` steps
    once, at length 100 (a split count chosen by size)."""
    g = step(n)
    attn = g.op("attn")
    junk = 0x7F00_0000 + ((n * 2654435761) >> 7) % 5 * 0x40
    word = 2 if split and n >= 100 else 1
    g.dag.nodes["attn"]["op"] = dataclasses.replace(
        attn, args=attn.args + junk.to_bytes(4, "little") + word.to_bytes(4, "little"))
    return g


def _reads(n: int, graph: KernelGraph, captured: KernelGraph) -> bool:
    """What running tells on these steps: a kernel reads all its bytes but the leftover's."""
    mine, theirs = graph.op("attn"), captured.op("attn")
    return (mine.args[:16] + mine.args[20:], mine.grid) == (theirs.args[:16] + theirs.args[20:],
                                                            theirs.grid)


def test_leftovers_no_second_capture_sees_are_shown_unread_by_running():
    plain = derive_lengths(leftover, range(1, 257), every=8, checks=2)
    assert len(plain.derived) < 256 // 4  # the leftover holds most lengths back
    calls = []

    def verify(n, graph, captured):
        calls.append(n)
        return _reads(n, graph, captured)
    got = derive_lengths(leftover, range(1, 257), every=8, checks=2, verify=verify)
    assert len(got.derived) > 3 * 256 // 4 and got.refused == []
    assert all(d.unread == {"attn": {16}} for d in got.derivations if d.unread)
    for n in got.derived:
        assert _reads(n, got.graphs[n], leftover(n)), n
    # A run per sample until the leftover has differed from the template once, and one per
    # held-out check: a few, not one per length.
    assert {what for _, what, _ in got.verified} == {"unread slots", "derived"}
    assert all(agrees for *_, agrees in got.verified) and len(calls) < 20


def test_leftovers_shown_unread_in_one_class_are_not_run_again_in_the_next():
    # Two residue classes of one kernel hold the same leftover slot: the first class runs its
    # samples to show it unread, the second takes that and runs only its held-out checks.
    calls = []

    def verify(n, graph, captured):
        calls.append(n)
        return _reads(n, graph, captured)
    got = derive_lengths(leftover, range(1, 257), every=8, checks=2, period=2, verify=verify)
    assert len(got.derived) > 3 * 256 // 4 and got.refused == []
    first, second = got.derivations
    assert first.unread == second.unread == {"attn": {16}}
    runs = [(n % 2, what) for n, what, _ in got.verified]
    assert (first.lengths[0] % 2, "unread slots") in runs
    assert (second.lengths[0] % 2, "unread slots") not in runs
    assert (second.lengths[0] % 2, "derived") in runs  # its held-out checks still run
    for n in got.derived:
        assert _reads(n, got.graphs[n], leftover(n)), n
    # Where a kernel reads the slot at the other class's lengths after all (it runs otherwise
    # there), that class's held-out checks, run, refuse its stretch: nothing derived wrong.
    def reads_odd(n, graph, captured):
        return _reads(n, graph, captured) and (n % 2 == 0 or graph == captured)
    got = derive_lengths(leftover, range(1, 257), every=8, checks=2, period=2,
                         verify=reads_odd)
    assert [first % 2 for first, _ in got.refused] == [1]
    assert not [n for n in got.derived if n % 2]


def test_a_leftover_that_lies_on_a_line_across_three_samples_by_chance_is_still_run():
    # A leftover can lie on a line across three samples by chance, and a sloped stretch then
    # counted as a form of the length, so that no run was made for it. (On the H200, run 45,
    # a Llama step's leftover held 696 lengths back without a run; whether for this reason
    # was not recorded.)
    def on_a_line(n):
        g = leftover(n)
        if n in (17, 25, 33):
            attn = g.op("attn")
            args = bytearray(attn.args)
            args[16:20] = (0x7F10_0000 + 0x40 * n).to_bytes(4, "little")
            g.dag.nodes["attn"]["op"] = dataclasses.replace(attn, args=bytes(args))
        return g
    from grape.passes.lengths import _unread_candidates

    plain = derive_lengths(on_a_line, range(1, 257), every=8, checks=2)
    (d,) = plain.derivations
    assert any(g.slope != 0 and g.support >= 3 for g in d.fits[("attn", "a16")])  # the line
    assert _unread_candidates(d, list(range(2, 256))) == {"attn": {16}}
    got = derive_lengths(on_a_line, range(1, 257), every=8, checks=2, verify=_reads)
    assert len(got.derived) > 3 * 256 // 4 and got.refused == []
    assert [d.unread for d in got.derivations] == [{"attn": {16}}]
    for n in got.derived:
        assert _reads(n, got.graphs[n], on_a_line(n)), n


def test_a_word_the_kernel_reads_is_not_shown_unread_and_nothing_is_derived_wrong():
    # The split word differs from the template past length 100: run with the template's
    # bytes there, the sample runs otherwise; halving the slots tells it from the leftover,
    # which is shown unread, while the split word stays fitted.
    def split(n):
        return leftover(n, split=True)
    got = derive_lengths(split, range(1, 257), every=8, checks=2, verify=_reads)
    assert "unread slots" in {what for _, what, agrees in got.verified if not agrees}
    assert [d.unread for d in got.derivations] == [{"attn": {16}}]
    assert got.refused == [] and len(got.derived) > 3 * 256 // 4
    for n in got.derived:
        assert _reads(n, got.graphs[n], split(n)), n


def test_halving_finds_the_slots_a_kernel_reads_in_a_few_runs():
    from grape.passes.lengths import _agreeing

    items = [("k", 4 * i) for i in range(64)]
    read = {("k", 40), ("k", 200)}
    runs = []

    def agrees(part):
        runs.append(len(part))
        return not read & set(part)
    assert _agreeing(items, agrees) == set(items) - read
    assert len(runs) <= 2 * len(read) * 6  # two runs a read slot per halving of 64


def test_a_held_out_length_that_runs_otherwise_refuses_its_stretch():
    samples = set(range(1, 257, 8)) | {256}
    got = derive_lengths(leftover, range(1, 257), every=8, checks=1,
                         verify=lambda n, graph, captured: n in samples)
    assert got.refused and ("derived" in {w for _, w, agrees in got.verified if not agrees})
    assert not got.derived


def _late_word(at: int):
    """``step(n)`` with two more argument words, a leftover (offset 16) and one the kernel
    reads (offset 20), where the word at ``at`` holds one value in the first 35 captures (the
    samples and their second captures) and another in later ones: what every sample held
    alike, and a held-out length not."""
    count = [0]

    def late(n: int) -> KernelGraph:
        count[0] += 1
        g = step(n)
        attn = g.op("attn")
        words = [0x7F00_0000, 1]
        if count[0] > 35:
            words[(at - 16) // 4] += 0x40
        g.dag.nodes["attn"]["op"] = dataclasses.replace(
            attn, args=attn.args + b"".join(w.to_bytes(4, "little") for w in words))
        return g
    return late


def test_a_word_alike_at_every_sample_that_a_held_out_length_holds_otherwise_is_run():
    # Measured on the H200 (run 43): ReduceOp fields of a Llama step's RMS norms held one
    # value at every sample of a stretch and another at its held-out length, and refused
    # five of eight stretches. Running the derived graph as the capture runs shows them unread.
    got = derive_lengths(_late_word(16), range(1, 257), every=8, checks=1, verify=_reads)
    assert got.refused == [] and len(got.derived) > 3 * 256 // 4
    assert ("held-out words" in {what for _, what, agrees in got.verified if agrees})
    assert [d.unread for d in got.derivations] == [{"attn": {16}}]
    # Without running, the same words refuse the stretch.
    plain = derive_lengths(_late_word(16), range(1, 257), every=8, checks=1)
    assert plain.refused and not plain.derived


def test_a_word_the_kernel_reads_that_a_held_out_length_holds_otherwise_refuses():
    late = _late_word(20)
    got = derive_lengths(late, range(1, 257), every=8, checks=1, verify=_reads)
    assert got.refused and not got.derived
    assert ("held-out words" in {what for _, what, agrees in got.verified if not agrees})
    assert all(not d.unread for d in got.derivations)


def _row_ops(d, node, lengths):
    """Each length's operation for ``node`` as Derivation.rows makes it (through NodeVersions,
    which turns rows back into operations)."""
    from grape.passes.variants import NodeVersions

    versions = NodeVersions(node, d.template.op(node))
    rows = d.rows(node, lengths)
    # as place_derived makes them: every number's stretches evaluated at once, beforehand
    table = d.rows(node, lengths, d._table(np.asarray(lengths, dtype=np.int64)))
    assert all(np.array_equal(a, b) for a, b in zip(rows, table, strict=True))
    return [versions.op(v) for v in versions.add_rows(*rows)]


def test_rows_are_the_derived_operations_byte_for_byte():
    # Pointers, grid steps and plain numbers (step), and IntDivider magic computed from a
    # fitted divisor with a loose slot kept as the template's (packed).
    import random

    from grape.passes.derive import loose_slots

    d = derive({n: step(n) for n in SAMPLED})
    lengths = [n for n in range(1, 250) if d.covers(n)]
    assert len(lengths) > 200 and d.covered(range(-5, 300)) == lengths
    assert _row_ops(d, "attn", lengths) == [d.op_at("attn", n) for n in lengths] == [
        step(n).op("attn") for n in lengths]
    rng = random.Random(0)
    samples = {n: packed(n, rng.getrandbits(32)) for n in range(10, 200, 9)}
    d = derive(samples, loose_slots(samples[10], packed(10, rng.getrandbits(32))))
    lengths = [n for n in range(10, 200) if d.covers(n)]
    assert _row_ops(d, "k", lengths) == [d.graph_at(n).op("k") for n in lengths]
    with pytest.raises(UnsupportedError, match="derivable at length 5"):
        d.rows("k", [12, 5])
    # A line of slope 3/2 (computed with fractions, not in numpy): whole at even lengths only.

    def halves(n: int) -> KernelGraph:
        g = KernelGraph()
        g.add("k", Kernel("k@0x1", "k", grid=(1, 1, 1), block=(32, 1, 1),
                          args=(3 * n // 2).to_bytes(4, "little")))
        return g

    d = derive({n: halves(n) for n in range(10, 100, 10)})
    assert d.covers(12) and not d.covers(13)
    assert d.covered(range(100)) == [n for n in range(100) if d.covers(n)]
    assert _row_ops(d, "k", [12, 40, 88]) == [halves(n).op("k") for n in (12, 40, 88)]
    with pytest.raises(UnsupportedError, match="derivable at length 13"):
        d.rows("k", [12, 13])


def test_derived_lengths_placed_at_once_take_the_versions_placed_one_by_one():
    # GPT-2 small decode on the H200 (the committed captures): every other length of the
    # larger executable sampled, the rest derived; placed in one go, a node at a time, each
    # length takes the versions it takes placed length by length from its operations.
    from grape.passes.derive import place_derived
    from grape.passes.families import match
    from grape.passes.variants import Variants
    from tests.h200_captures import captures, changes_at

    got = captures()
    graphs, samples, lengths = got.graphs, got.samples, got.lengths
    first, last = got.first, got.last
    d = got.derivation()
    derivable = [n for n in lengths if n not in samples and d.covers(n)]
    assert len(derivable) >= 3
    executable = graphs[last]
    pairs = match(executable, d.template)
    one, many = Variants(executable), Variants(executable)
    for v in (one, many):
        v.add_graph(first, graphs[first])
    for n in derivable:
        one.add_changes(n, changes_at(d, n, one.ops(first), pairs))
    place_derived(many, d, derivable, first, pairs)
    assert all(many.ops(n) == one.ops(n) for n in derivable)
    assert sum(nv.rows for nv in many.nodes.values()) >= len(many.nodes) - 12  # copies aside
    with pytest.raises(UnsupportedError):
        place_derived(many, d, [last + 1], first, pairs)
    assert last + 1 not in many.shapes


def laid_out(n: int) -> KernelGraph:
    """A step whose temporary sits where the allocator put it: its offset in the graphs' pool
    grows with the length and jumps every 40 lengths (a block's rounded size crossing a
    boundary), as GPT-2 small's did on the H200."""
    g = KernelGraph()
    g.add_buffer(Buffer("pool", 1 << 20, BufferRole.INTERNAL, address=0x100000))
    jumps = n // 40
    offset = 512 * jumps * (jumps + 3) + 16 * n  # jumps of other sizes: no line through them
    args = (0x100000 + offset).to_bytes(8, "little") + n.to_bytes(4, "little") + bytes(4)
    g.add("n0", Kernel("ew@0x2", "ew", grid=(1, 1, 1), block=(128, 1, 1), args=args,
                       params=(Param(0, 8), Param(8, 4), Param(12, 4)),
                       pointers=(Pointer(0, Span("pool", offset)),)))
    return g


def test_what_holds_lengths_back_is_named():
    # Samples 32 lengths apart leave each 40-length stretch of the pointer's line one or two
    # samples: nothing between them derives, and the pointer is named as the reason.
    lines = []
    got = derive_lengths(_recorder(laid_out)[0], range(1, 257), every=32, checks=1,
                         progress=lines.append)
    assert got.derived == []
    # the pointer, as its offset in the pool (p0) and as the argument word holding it (w0)
    top = got.held_back.most_common()
    assert {key for key, _ in top[:2]} == {("ew", "p0"), ("ew", "w0")} and top[0][1] > 0
    assert f"most held back by {top[0][0][1]} of ew ({top[0][1]} lengths" in lines[-1]
    # by node rather than kernel, for a kernel that runs at several nodes
    d = got.derivations[0]
    inside = range(d.lengths[0] + 1, d.lengths[-1])
    assert set(d.holding_back(inside, by_node=True)) == {("n0", "p0"), ("n0", "w0")}
    # Sampled densely enough, the same steps derive and nothing is held back
    dense = derive_lengths(_recorder(laid_out)[0], range(1, 257), every=8, checks=1)
    assert len(dense.derived) > 100


def test_without_checks_a_regular_staircase_derives_wrongly_and_a_warning_says_so():
    def regular(n: int) -> KernelGraph:  # a pointer jumping 4096 bytes every 40 lengths
        g = KernelGraph()
        g.add_buffer(Buffer("pool", 1 << 20, BufferRole.INTERNAL, address=0x100000))
        offset = 4096 * (n // 40) + 16 * n
        args = (0x100000 + offset).to_bytes(8, "little") + bytes(8)
        g.add("n0", Kernel("ew@0x2", "ew", grid=(1, 1, 1), block=(128, 1, 1), args=args,
                           params=(Param(0, 8), Param(8, 8)),
                           pointers=(Pointer(0, Span("pool", offset)),)))
        return g

    # Sampled every 32, one sample a step: the samples 65..161 lie on one line
    with pytest.warns(UserWarning, match="checks=0: no derived stretch is checked"):
        blind = derive_lengths(_recorder(regular)[0], range(1, 257), every=32, checks=0)
    assert blind.derived and all(blind.graphs[n] != regular(n) for n in blind.derived)
    checked = derive_lengths(_recorder(regular)[0], range(1, 257), every=32, checks=1)
    assert checked.refused and all(checked.graphs[n] == regular(n) for n in checked.derived)


@settings(max_examples=150, deadline=None)
@given(slope=st.integers(1, 12), intercept=st.integers(0, 40), divisor=st.integers(1, 600),
       scale=st.sampled_from([1, 2, 8, 512]), every=st.sampled_from([8, 16, 32, 64, 128]),
       first=st.integers(1, 40), line=st.integers(1, 64))
def test_a_staircase_is_derived_right_or_captured(slope, intercept, divisor, scale, every,
                                                  first, line):
    # Any number scale * ceil(x / divisor) beside its x = slope * n + intercept, and a number
    # on a line (line * n, which samples sharing a factor make look like a staircase), sampled
    # at any spacing with one held-out check a stretch: every length derived is derived right
    # (lines through samples one a step, staircases the samples of a line fall on, quotients
    # of the wrong scale and divisors the samples leave open: refused, captured or left
    # underived).
    def stepped(n: int) -> KernelGraph:
        x = slope * n + intercept
        g = KernelGraph()
        g.add_buffer(Buffer("out", 1 << 20, BufferRole.INTERNAL, address=0x10000))
        args = b"".join(v.to_bytes(4, "little")
                        for v in (x, scale * -(-x // divisor), line * n))
        g.add("k", Kernel("k@0x4", "k", grid=(-(-x // divisor), 1, 1), block=(64, 1, 1),
                          args=args, params=(Param(0, 4), Param(4, 4), Param(8, 4))))
        return g

    got = derive_lengths(_recorder(stepped)[0], range(first, first + 700), every=every,
                         checks=1)
    wrong = [n for n in got.derived if got.graphs[n] != stepped(n)]
    assert not wrong, wrong[:5]
    _columns_agree_with_lengths(got.derivations, range(first - 8, first + 708))


def _columns_agree_with_lengths(derivations, lengths) -> None:
    """Each derivation's numbers computed for many lengths at once (numpy) are what they are
    one length at a time, and so are the lengths where forms part."""
    lengths = list(lengths)
    at = np.asarray(lengths, dtype=np.int64)
    for d in derivations:
        table = d._table(at)  # every number's stretches at once, as coverage takes them
        for key in d.fits:
            one = [d._value(key, n) for n in lengths]
            for values, ok in (d._column(key, at), d._column(key, at, table)):
                assert ok.tolist() == [v is not None for v in one], key
                derived = [int(v) for v, good in zip(values, ok, strict=True) if good]
                assert derived == [v for v in one if v is not None], key
        assert d.covered(lengths) == [n for n in lengths if d.covers(n)]
        assert d.disputed(lengths) == [n for n in lengths
                                       if any(d._disputed_at(key, n) for key in d.quotients)]


def _bent(n: int) -> KernelGraph:
    """``step`` whose constant word leaves its line at 600 for another slope (a kernel's
    split count that starts growing with the length)."""
    return step(n, constant=64 if n < 600 else 64 + (n - 600))


def _uniform_and_coarse(make, lengths, every=8, start=128, **kw):
    got = {}
    for s in (None, start):
        capture, calls = _recorder(make)
        got[s] = derive_lengths(capture, lengths, every=every, start=s, checks=1, **kw), calls
        assert all(got[s][0].graphs[n] == make(n) for n in got[s][0].derived), s
    return got[None], got[start]


def test_a_coarse_start_captures_a_tenth_where_the_numbers_are_simple():
    (uniform, calls), (coarse, few) = _uniform_and_coarse(step, range(1, 1025))
    # One length in 128 (9 samples, a check, the two ends again): every length derived that
    # one in 8 derived, and more (fewer samples, fewer lengths captured to be samples)
    assert len(few) <= 12 and len(calls) > 10 * len(few)
    assert set(uniform.derived) <= set(coarse.derived)
    assert not coarse.superseded and not coarse.refused


def test_a_coarse_start_samples_finer_only_where_lengths_stay_underived():
    # The bend leaves the lengths between its two neighbouring samples underived: those gaps,
    # and only those, are halved down to one in 8.
    (uniform, calls), (coarse, few) = _uniform_and_coarse(_bent, range(1, 1025))
    assert coarse.superseded and not any(refuted for _, refuted in coarse.superseded)
    assert len(few) < len(calls) / 4
    assert len(coarse.derived) >= len(uniform.derived)
    assert not any(d.covers(600) and d.covers(599) for d in coarse.derivations)
    # Finer samples sit between the coarse ones around 600, nowhere else
    finer = set(coarse.captured) - set(range(1, 1025, 128)) - {1024} - set(coarse.checked)
    assert finer and all(512 < n < 768 for n in finer), sorted(finer)


def test_a_coarse_start_refused_by_every_check_ends_as_a_uniform_one_does():
    def odd(n):  # off its line at every length no sample sits on: only a check can tell
        return step(n) if n % 8 == 1 or n == 100 else step(n, square=True)

    (uniform, _), (coarse, _) = _uniform_and_coarse(odd, range(1, 101), start=32)
    for got in (uniform, coarse):
        assert got.refused and got.derived == [] and sorted(got.captured) == list(range(1, 101))
    # Sampled finer (where its forms parted, then between) before a check refused it for good
    assert coarse.superseded and coarse.superseded[-1][1]


def test_a_coarse_start_bisects_a_change_of_kernel_as_a_uniform_one_does():
    def switching(n):
        return step(n, function="attn@0x1" if n < 530 else "attn_split@0x2")

    (uniform, calls), (coarse, few) = _uniform_and_coarse(switching, range(1, 1025))
    for got in (uniform, coarse):
        assert {529, 530} <= set(got.captured) and not got.refused
    assert len(few) < len(calls) / 4


def test_a_coarse_start_cannot_see_a_number_off_its_line_between_its_samples():
    # What no sample or check lands on, no check refuses (derive_lengths says so): a constant
    # that holds another value at 300..309 only is caught one length in 8 and missed one in
    # 128. Sparser samples trade captures for that risk.
    def excursion(n):
        return step(n, constant=99 if 300 <= n < 310 else 64)

    capture, _ = _recorder(excursion)
    uniform = derive_lengths(capture, range(1, 1025), every=8, checks=1)
    coarse = derive_lengths(capture, range(1, 1025), every=8, start=128, checks=1)
    assert all(uniform.graphs[n] == excursion(n) for n in uniform.derived)
    wrong = [n for n in coarse.derived if coarse.graphs[n] != excursion(n)]
    assert wrong == list(range(300, 310))


def test_a_capture_where_forms_parted_that_runs_another_kernel_cuts_its_run():
    # The padded count above, with another kernel at 504 and 512 only: the capture taken where
    # the line and the staircase part (512) runs it. The run spans a change its samples missed:
    # it is settled again with that capture as a sample, the change bisected, both sides
    # derived. (Before, the run's held-out check at 504 refused all of its class: 197 captures.)
    def padded(n: int) -> KernelGraph:
        g = KernelGraph()
        g.add_buffer(Buffer("out", 1 << 20, BufferRole.INTERNAL, address=0x10000))
        args = n.to_bytes(4, "little") + (16 * -(-n // 16)).to_bytes(4, "little")
        function = "attn_split@0x6" if n in (504, 512) else "attn@0x5"
        g.add("attn", Kernel(function, "attn", grid=(1, 1, 1), block=(128, 1, 1), args=args,
                             params=(Param(0, 4), Param(4, 4))))
        return g

    for start in (None, 64):
        capture, calls = _recorder(padded)
        got = derive_lengths(capture, range(1, 1024), every=16, period=8, checks=1,
                             start=start)
        assert 512 in got.tie_breaks and got.checked[512]  # another function there
        assert not got.refused and all(got.graphs[n] == padded(n) for n in got.derived)
        assert {504, 512} <= set(got.captured) and len(calls) < 100, start


def test_a_topology_found_again_by_its_structure_is_its_fingerprint():
    from grape.ir import Empty, fingerprint
    from grape.passes.lengths import _topology

    known: dict = {}
    a, b = step(8), step(200)  # numbers apart, one structure: hashed once
    assert _topology(a, known) == fingerprint(a, launch=False) == _topology(b, known)
    assert len(known) == 1
    c = step(8)
    c.add("after", Empty(), after=["copy"])  # another structure: hashed, and apart
    assert _topology(c, known) == fingerprint(c, launch=False) != _topology(a, known)
    assert len(known) == 2


def test_two_captures_under_the_same_ids_are_compared_node_to_node_not_in_order():
    # The same nodes and edges, made in another order, with the two kernels' functions
    # swapped between the nodes: in order they look alike, node to node they differ.
    from grape.passes.derive import _differs

    def made(order, functions):
        g = KernelGraph()
        for node, function in zip(order, functions, strict=True):
            g.add(node, Kernel(function, function, grid=(1, 1, 1), block=(32, 1, 1)))
        return g

    a = made(["x", "y"], ["f@0x1", "g@0x2"])
    b = made(["y", "x"], ["f@0x1", "g@0x2"])  # y runs f, x runs g
    assert "node 'x'" in _differs(a, 1, b, 2) and "function changed" in _differs(a, 1, b, 2)
    assert _differs(a, 1, made(["x", "y"], ["f@0x1", "g@0x2"]), 2) is None
