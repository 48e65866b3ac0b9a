"""Moving a saved graph's operations into another process (grape.passes.relocate)."""

from __future__ import annotations

import dataclasses

import pytest

from grape.errors import UnsupportedError
from grape.ir import Buffer, BufferRole, Kernel, KernelGraph, Memcpy, Param, Pointer, Span
from grape.passes.relocate import Moved, relocate, relocate_all, relocation


def _kernel(function, name, grid, pointers, extra=7):
    """A kernel whose arguments are one word per pointer (address + offset), then ``extra``."""
    args = b"".join(address.to_bytes(8, "little") for address, _ in pointers)
    args += extra.to_bytes(8, "little")
    return Kernel(function, name, (grid, 1, 1), (128, 1, 1), args=args,
                  params=tuple(Param(8 * i, 8) for i in range(len(pointers) + 1)),
                  pointers=tuple(Pointer(8 * i, span) for i, (_, span) in enumerate(pointers)))


def _step(pool: int, weight: int, out: int, functions=("f@0x1", "g@0x2"), grid=2,
          offset=256, extra=7) -> KernelGraph:
    """Two kernels and a copy over a pool block, a weight and an output, at these addresses."""
    g = KernelGraph()
    block = f"alloc@{pool:#x}"
    g.add_buffer(Buffer(block, 4096, BufferRole.INTERNAL, address=pool))
    g.add_buffer(Buffer("param:w", 1024, BufferRole.PARAMETER, address=weight))
    g.add_buffer(Buffer(f"alloc@{out:#x}", 64, BufferRole.INTERNAL, address=out))
    g.add("a", _kernel(functions[0], "f", 1, [(pool + 64, Span(block, 64)),
                                               (weight, Span("param:w"))], extra))
    g.add("b", _kernel(functions[1], "g", grid, [(pool + offset, Span(block, offset))]),
          after=["a"])
    g.add("c", Memcpy(Span(block, offset), Span(f"alloc@{out:#x}"), 16), after=["b"])
    return g


SAVED = _step(0x1000, 0x9000, 0x20000)
FRESH = _step(0x5000, 0xA000, 0x30000, functions=("f@0x7", "g@0x8"))


def test_the_saved_template_maps_onto_the_capture_here():
    r = relocation(SAVED, FRESH)
    assert r.functions == {"f@0x1": "f@0x7", "g@0x2": "g@0x8"}
    assert r.buffers["alloc@0x1000"] == Moved("alloc@0x5000", 0x4000, 0, 4096)
    assert r.buffers["param:w"] == Moved("param:w", 0x1000, 0, 1024)
    assert {n: relocate(SAVED.op(n), r) for n in SAVED.dag} == dict(FRESH.ops())


def test_a_member_shapes_changes_move_with_it():
    r = relocation(SAVED, FRESH)
    member = _step(0x1000, 0x9000, 0x20000, grid=3, offset=512)
    moved = relocate_all({"b": member.op("b"), "c": member.op("c")}, r)
    here = _step(0x5000, 0xA000, 0x30000, functions=("f@0x7", "g@0x8"), grid=3, offset=512)
    assert moved == {"b": here.op("b"), "c": here.op("c")}


def test_what_the_template_never_used_cannot_move():
    r = relocation(SAVED, FRESH)
    other_kernel = dataclasses.replace(SAVED.op("b"), function="h@0x3", name="h")
    with pytest.raises(UnsupportedError, match="found 'h', which it never runs here"):
        relocate(other_kernel, r)
    past = _step(0x1000, 0x9000, 0x20000, offset=4096 + 64).op("b")
    with pytest.raises(UnsupportedError, match="expected memory within the 4096 bytes of "
                                               "buffer 'alloc@0x5000' here, found offset 4160"):
        relocate(past, r)
    elsewhere = _step(0x2000, 0x9000, 0x20000).op("b")
    with pytest.raises(UnsupportedError, match="found buffer 'alloc@0x2000', which it never "
                                               "touches"):
        relocate(elsewhere, r)


def test_argument_words_that_differ_between_processes_are_taken_from_here():
    # PyTorch's kernels carry slots they never fill: the host's stack bytes, which differ
    # between processes. The template takes this process's, and so does a member that left
    # them as the template had them; a member that wrote its own value there keeps it.
    fresh = _step(0x5000, 0xA000, 0x30000, functions=("f@0x7", "g@0x8"), extra=8)
    r = relocation(SAVED, fresh)
    assert r.loose["a"].offsets == (16,)
    assert relocate(SAVED.op("a"), r, "a") == fresh.op("a")
    kept = _step(0x1000, 0x9000, 0x20000, grid=3)  # a member: a's grid changed, its word not
    kept.dag.nodes["a"]["op"] = dataclasses.replace(kept.op("a"), grid=(3, 1, 1))
    moved = relocate_all({"a": kept.op("a")}, r)["a"]
    assert moved == dataclasses.replace(fresh.op("a"), grid=(3, 1, 1))
    wrote = _step(0x1000, 0x9000, 0x20000, extra=9).op("a")  # a size, say: kept as saved
    assert relocate_all({"a": wrote}, r)["a"] == _step(
        0x5000, 0xA000, 0x30000, functions=("f@0x7", "g@0x8"), extra=9).op("a")


def test_a_member_that_wrote_a_pointer_into_a_loose_word_has_it_moved():
    fresh = _step(0x5000, 0xA000, 0x30000, functions=("f@0x7", "g@0x8"), extra=8)
    r = relocation(SAVED, fresh)
    member = _step(0x1000, 0x9000, 0x20000, extra=0x1000 + 128).op("a")
    member = dataclasses.replace(member, pointers=member.pointers + (
        Pointer(16, Span("alloc@0x1000", 128)),))
    moved = relocate_all({"a": member}, r)["a"]
    assert moved.args[16:24] == (0x5000 + 128).to_bytes(8, "little")
    assert Pointer(16, Span("alloc@0x5000", 128)) in moved.pointers
    outside = dataclasses.replace(member, pointers=member.pointers[:-1] + (
        Pointer(16, Span("alloc@0x7000")),))
    with pytest.raises(UnsupportedError, match="found buffer 'alloc@0x7000', which it never"):
        relocate_all({"a": outside}, r)


def test_a_word_that_points_into_memory_in_one_capture_only_is_loose():
    # Stack bytes that happened to hold a device address in the saving process, 0 here.
    saved = _step(0x1000, 0x9000, 0x20000, extra=0x20000)
    op = saved.op("a")
    saved.dag.nodes["a"]["op"] = dataclasses.replace(
        op, pointers=op.pointers + (Pointer(16, Span("alloc@0x20000")),))
    fresh = _step(0x5000, 0xA000, 0x30000, functions=("f@0x7", "g@0x8"), extra=0)
    r = relocation(saved, fresh)
    assert r.loose["a"].offsets == (16,)
    assert relocate(saved.op("a"), r, "a") == fresh.op("a")


def test_a_capture_here_that_differs_beyond_addresses_is_refused():
    wider = _step(0x5000, 0xA000, 0x30000, functions=("f@0x7", "g@0x8"), grid=3)
    with pytest.raises(UnsupportedError, match="found node 'b' different beyond its functions, "
                                               "addresses and loose argument words"):
        relocation(SAVED, wider)
    renamed = _step(0x5000, 0xA000, 0x30000)
    renamed.dag.nodes["b"]["op"] = dataclasses.replace(renamed.op("b"), name="g2")
    with pytest.raises(UnsupportedError, match="expected kernel 'g' at node 'b' here, found "
                                               "'g2'"):
        relocation(SAVED, renamed)
    split = _step(0x5000, 0xA000, 0x30000, offset=512)  # b's memory moved within the block
    with pytest.raises(UnsupportedError, match="expected one buffer here for saved "
                                               "'alloc@0x1000'"):
        relocation(SAVED, split)


# The capture here put b's block at another place within the pool segment than the saving
# process did: pairing by pointers would need two shifts for one segment.
SPLIT = _step(0x5000, 0xA000, 0x30000, functions=("f@0x7", "g@0x8"), offset=512)
ARENA = Buffer("scratch@0x80000", 4096, BufferRole.INTERNAL, address=0x80000)


def test_saved_scratch_moves_whole_to_memory_of_its_own_in_the_saved_layout():
    r = relocation(SAVED, SPLIT, {"alloc@0x1000": ARENA}, {"alloc@0x5000"})
    assert r.buffers["alloc@0x1000"] == Moved("scratch@0x80000", 0x7F000, 0, 4096)
    assert r.buffers["param:w"] == Moved("param:w", 0x1000, 0, 1024)
    b = relocate(SAVED.op("b"), r, "b")
    assert b.args[:8] == (0x80000 + 256).to_bytes(8, "little")  # the saved offset, not 512
    assert b.pointers == (Pointer(0, Span("scratch@0x80000", 256)),)
    assert relocate(SAVED.op("c"), r, "c").src == Span("scratch@0x80000", 256)
    # A member's offsets in the scratch keep the saved layout too.
    member = _step(0x1000, 0x9000, 0x20000, grid=3, offset=1024)
    assert relocate_all({"b": member.op("b")}, r)["b"].pointers == (
        Pointer(0, Span("scratch@0x80000", 1024)),)


def test_scratch_another_executable_names_is_left_to_it():
    other = Buffer("scratch@0x90000", 64, BufferRole.INTERNAL, address=0x90000)
    r = relocation(SAVED, SPLIT, {"alloc@0x1000": ARENA, "alloc@0x7000": other},
                   {"alloc@0x5000"})
    assert "alloc@0x7000" not in r.buffers
    assert r.buffers["alloc@0x1000"].buffer == "scratch@0x80000"


def test_scratch_must_still_be_scratch_here_and_everything_else_still_equal():
    with pytest.raises(UnsupportedError, match=r"expected saved scratch 'alloc@0x1000' to be "
                                               r"scratch here too \(node 'a'\), found "
                                               r"'alloc@0x5000'"):
        relocation(SAVED, SPLIT, {"alloc@0x1000": ARENA}, set())
    wider = _step(0x5000, 0xA000, 0x30000, functions=("f@0x7", "g@0x8"), grid=3, offset=512)
    with pytest.raises(UnsupportedError, match="found node 'b' different beyond"):
        relocation(SAVED, wider, {"alloc@0x1000": ARENA}, {"alloc@0x5000"})
    small = dataclasses.replace(ARENA, size=1024)
    with pytest.raises(UnsupportedError, match="expected scratch here for saved buffer "
                                               "'alloc@0x1000' of its size"):
        relocation(SAVED, SPLIT, {"alloc@0x1000": small}, {"alloc@0x5000"})


def test_a_file_without_scratch_pairs_pool_memory_as_before():
    # Nothing named scratch in the saved family: the pool segment here is paired by pointers
    # (one shift), and its values checked by that pairing.
    r = relocation(SAVED, FRESH, {}, {"alloc@0x5000"})
    assert r.buffers["alloc@0x1000"] == Moved("alloc@0x5000", 0x4000, 0, 4096)
    with pytest.raises(UnsupportedError, match="expected one buffer here for saved "
                                               "'alloc@0x1000'"):
        relocation(SAVED, SPLIT, {}, {"alloc@0x5000"})
