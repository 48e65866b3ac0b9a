"""A capture's temporaries moved to a reference capture's places (grape.passes.places).

The captures here are made up but laid out as PyTorch lays them out: ``grape.sim.memory.Pool``
placed all 340 of GPT-2 small decode's blocks where PyTorch did at 128 KV lengths on the H200
(benchmarks/results/families_warm_start_h200/pool_layout_ac0ebfb.json)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grape.errors import UnsupportedError
from grape.ir import Buffer, BufferRole, Kernel, KernelGraph, Memcpy, Pointer, Span
from grape.passes.derive import derive
from grape.passes.places import MARKER_BYTES, History, Mark, to_reference
from grape.sim.memory import Pool

SEGMENT = 1 << 30  # where the made-up segments lie apart
BASE = 0x7F00_0000_0000
CACHE = 0x10_0000_0000


def _rounded(size: int) -> int:
    return -(-size // 512) * 512


class Capture:
    """One made-up capture: the allocator's trace and the graph, built as a step runs."""

    def __init__(self) -> None:
        self.pool = Pool()
        self.trace: list[dict] = []
        self.graph = KernelGraph()
        self.graph.add_buffer(Buffer("cache", 1 << 24, BufferRole.INTERNAL, address=CACHE))
        self.last: str | None = None
        self.marks: list[Mark] = []

    def mark(self) -> None:
        """Where an operation starts, as grape.torch.capture marks it: a marker allocated and
        freed at once."""
        marker = self.malloc(MARKER_BYTES, record=False)
        self.trace.append({"action": "alloc", "addr": marker, "size": MARKER_BYTES})
        self.marks.append(Mark(len(self.graph), marker))
        self.free(marker)

    def malloc(self, size: int, record: bool = True) -> int:
        segments = len(self.pool.segments)
        seg, offset = self.pool.malloc(size)
        if len(self.pool.segments) > segments:
            base = BASE + seg * SEGMENT
            self.graph.add_buffer(Buffer(f"alloc@{base:#x}", self.pool.segments[seg],
                                         BufferRole.INTERNAL, address=base))
            self.trace.append({"action": "segment_alloc", "addr": base,
                               "size": self.pool.segments[seg]})
        address = BASE + seg * SEGMENT + offset
        if record:
            self.trace.append({"action": "alloc", "addr": address, "size": _rounded(size)})
        self._handles = getattr(self, "_handles", {})
        self._handles[address] = (seg, offset)
        return address

    def free(self, address: int) -> None:
        self.pool.free(self._handles.pop(address))
        self.trace += [{"action": "free_requested", "addr": address},
                       {"action": "free_completed", "addr": address}]

    def span(self, address: int) -> Span:
        buffer = next(b for b in self.graph.buffers.values()
                      if b.address <= address < b.address + b.size)
        return Span(buffer.id, address - buffer.address)

    def kernel(self, name: str, *addresses: int, number: int = 0) -> str:
        args = b"".join(a.to_bytes(8, "little") for a in addresses) + number.to_bytes(4, "little")
        pointers = tuple(Pointer(8 * i, self.span(a)) for i, a in enumerate(addresses))
        node = f"n{len(self.graph)}"
        self.graph.add(node, Kernel(f"{name}@0x1", name, (1, 1, 1), (128, 1, 1), args=args,
                                    pointers=pointers), after=[self.last] if self.last else [])
        self.last = node
        return node

    def copy(self, src: int, dst: int, size: int) -> None:
        node = f"n{len(self.graph)}"
        self.graph.add(node, Memcpy(self.span(src), self.span(dst), size),
                       after=[self.last] if self.last else [])
        self.last = node

    def history(self) -> History:
        segments = [(e["addr"], e["size"]) for e in self.trace if e["action"] == "segment_alloc"]
        return History.of_trace(self.trace, segments, [m.marker for m in self.marks])


def decode(n: int, layers: int = 3) -> Capture:
    """A decode step at KV length ``n`` whose temporaries' sizes are not multiples of the
    allocator's 512 bytes, so that their places step with the length: each layer's scores
    (1000 n bytes), a small vector, the scores freed, a context vector (300 n + 100 bytes)
    taking the freed place or another."""
    c = Capture()
    for _ in range(layers):
        c.mark()
        c.kernel("norm", CACHE, number=n)  # a node that uses no temporary
        c.mark()
        scores = c.malloc(1000 * n)
        small = c.malloc(256)
        c.kernel("scores", CACHE, scores, number=n)
        c.kernel("reduce", scores + 8 * n, small, number=n)
        c.free(scores)
        context = c.malloc(300 * n + 100)
        c.kernel("context", small, context, number=n)
        c.copy(context, CACHE + 64 * n, 64)
        c.free(small)
        c.free(context)
    return c


LENGTHS = range(8, 513, 8)


def moved(n: int, reference: Capture) -> KernelGraph:
    c = decode(n)
    return to_reference(c.graph, c.history(), reference.history(),
                        reference.graph.buffers.values()).graph


def test_places_that_step_with_the_length_derive_nothing_and_moved_derive_everything():
    raw = derive({n: decode(n).graph for n in LENGTHS[::4]})
    inside = [n for n in LENGTHS if n not in LENGTHS[::4] and n < LENGTHS[::4][-1]]
    assert not any(raw.covers(n) for n in inside)  # the context's place steps with 300 n
    largest = decode(max(LENGTHS))
    d = derive({n: moved(n, largest) for n in LENGTHS[::4]})
    assert all(d.covers(n) for n in inside)
    for n in inside:
        assert d.check(n, moved(n, largest)) == [], n


def test_a_moved_capture_reads_and_writes_where_the_reference_does():
    largest, small = decode(512), decode(40)
    got = to_reference(small.graph, small.history(), largest.history(),
                       largest.graph.buffers.values())
    # every pointer into a temporary moved, 6 a layer (the scores twice, the small vector
    # twice, the context once and the copy's source); the cache's pointers stay
    assert (got.moved, got.left) == (3 * 6, 0)
    for node in ("n1", "n2", "n3"):
        ours, theirs = got.graph.op(node), largest.graph.op(node)
        assert [p.target.buffer for p in ours.pointers] == [p.target.buffer
                                                            for p in theirs.pointers]
    # the scores' block starts where the largest's did; the reduce reads 8 n into it
    scores = largest.graph.op("n1").args[8:16]
    assert got.graph.op("n1").args[8:16] == scores
    assert (int.from_bytes(got.graph.op("n2").args[:8], "little")
            == int.from_bytes(scores, "little") + 8 * 40)
    assert got.graph.op("n4").src == largest.graph.op("n4").src
    assert got.graph.op("n4").dst == small.graph.op("n4").dst  # the cache: not a temporary
    assert got.graph.op("n0") == small.graph.op("n0")
    assert list(got.graph.dag) == list(small.graph.dag)
    assert got.graph.edges() == small.graph.edges()


def test_histories_that_part_or_outgrow_the_reference_are_refused():
    reference = decode(64)
    fewer = decode(64, layers=2)
    with pytest.raises(UnsupportedError, match="expected the reference capture's 18 allocator "
                                               "acts in its order, found 12 parting from them "
                                               "at act 12"):
        to_reference(fewer.graph, fewer.history(), reference.history(),
                     reference.graph.buffers.values())
    larger = decode(72)
    with pytest.raises(UnsupportedError, match="expected no block larger than the "
                                               "reference's, found block 0 of 72192 bytes "
                                               "against 64000"):
        to_reference(larger.graph, larger.history(), reference.history(),
                     reference.graph.buffers.values())


def _reuse(reference: bool) -> Capture:
    """Two blocks one after the other, the second at the first's place; in the reference the
    second lies after a third block instead. A first kernel points at the shared place and
    nothing pins when it ran."""
    c = Capture()
    first = c.malloc(4096)
    c.free(first)
    if reference:
        c.pool.malloc(4096)  # an allocation outside the history's acts shifts the second
    second = c.malloc(4096)
    c.kernel("a", first)
    c.kernel("b", second)
    c.free(second)
    return c


def test_a_pointer_that_could_mean_two_blocks_placed_apart_is_refused():
    c, reference = _reuse(False), _reuse(True)
    with pytest.raises(UnsupportedError, match="expected each pointer to mean one block, "
                                               "found node 'n0'"):
        to_reference(c.graph, c.history(), reference.history(),
                     reference.graph.buffers.values())


def test_a_word_no_live_block_holds_is_left_and_counted():
    c = Capture()
    gone = c.malloc(4096)
    spacer = c.malloc(4096)
    c.free(gone)
    live = c.malloc(8192)  # after the spacer: the freed place is too small
    c.kernel("k", live, live + 64)
    c.kernel("k", live, gone)  # the second word: a leftover pointing at the freed block
    c.free(live)
    c.free(spacer)
    got = to_reference(c.graph, c.history(), c.history(), c.graph.buffers.values())
    assert (got.moved, got.left) == (3, 1)
    assert got.graph.op("n1").args == c.graph.op("n1").args  # itself: nothing moves


def test_history_reads_the_pool_blocks_of_a_trace():
    c = decode(16, layers=1)
    outside = [{"action": "alloc", "addr": 0x1000, "size": 512}]  # a block of another pool
    h = History.of_trace(outside + c.trace, [(BASE, 2 << 20)], [m.marker for m in c.marks])
    assert h.marks == (0, 0)  # both of the layer's marks before its first allocation
    assert len(h) == 3 and h.made == (0, 1, 3) and h.freed == (2, 4, 5)
    assert h.acts == (("alloc", 0), ("alloc", 1), ("free", 0), ("alloc", 2), ("free", 1),
                      ("free", 2))


def _two_ops(reference: bool) -> Capture:
    """Two operations, each writing a block it allocates, the first's freed before the second
    allocates, so that the second takes the first's place; the reference puts it elsewhere.
    Each operation starts with a mark."""
    c = Capture()
    c.mark()
    x = c.malloc(4096)
    c.kernel("a", x)
    c.free(x)
    c.mark()
    if reference:
        c.pool.malloc(4096)  # outside the history's acts: the next block lies past it
    y = c.malloc(4096)
    c.kernel("b", y)
    c.free(y)
    return c


def test_where_operations_started_tells_which_block_a_reused_place_meant():
    c, reference = _two_ops(False), _two_ops(True)
    args = (c.graph, c.history(), reference.history(), reference.graph.buffers.values())
    with pytest.raises(UnsupportedError, match="found node 'n0''s pointer"):
        to_reference(*args)  # from the blocks' lives alone, 'a' could have run after 'b'
    got = to_reference(*args, marks=c.marks)
    assert got.graph.op("n0").args == reference.graph.op("n0").args
    assert got.graph.op("n1").args == reference.graph.op("n1").args
    assert got.moved == 2


def test_markers_are_no_blocks_and_a_history_lacking_them_is_refused():
    c = _two_ops(False)
    h = c.history()
    assert h.marks == (0, 2) and len(h) == 2  # each mark before its operation's two acts
    assert h.acts == (("alloc", 0), ("free", 0), ("alloc", 1), ("free", 1))
    bare = History.of_trace(c.trace, [(BASE, 2 << 20)])  # markers not named: blocks too
    assert len(bare) == 4 and bare.marks == ()
    with pytest.raises(UnsupportedError, match="expected the capture's 2 markers in its "
                                               "allocator's history, found 0"):
        to_reference(c.graph, bare, bare, c.graph.buffers.values(), marks=c.marks)


def test_an_operation_s_small_block_where_the_next_marker_will_lie_is_no_marker():
    # A layer norm's statistics (512 bytes, the size the trace gives a marker too), freed as
    # the operation returns: the next marker takes their place. Taken for that marker, the
    # operation's allocation would start the next operation too early (on an H100 the
    # concurrent step then gave a later layer norm's temporaries to the one before, and ran
    # a multiplication beside the kernels still reading the place it wrote).
    c = Capture()
    c.mark()
    stats = c.malloc(256)
    out = c.malloc(4096)
    c.kernel("norm", stats, out)
    c.free(stats)
    c.mark()
    assert c.marks[1].marker == stats  # the freed place
    later = c.malloc(4096)
    c.kernel("mul", out, later)
    h = c.history()
    assert h.marks == (0, 3)  # after the norm's three acts
    assert h.acts == (("alloc", 0), ("alloc", 1), ("free", 0), ("alloc", 2))
    assert h.address == (stats, out, later)


# Random programs: either a move is refused, or every pointer lands where its own block lies in
# the reference. The generator knows which block each pointer meant; the pass does not.


def _program(rng: random.Random, operations: int) -> list[dict]:
    """Operations as a step runs them: each allocates outputs and temporaries (sizes affine
    in the length), launches kernels that point into live blocks (at offsets affine in the
    length) or, now and then, hold a freed block's address (a word PyTorch left unfilled),
    frees its temporaries, and drops some earlier blocks."""
    program, live, made = [], [], 0
    for _ in range(operations):
        outputs = [(made + i, rng.randrange(1, 40) * 100, rng.randrange(0, 8) * 64)
                   for i in range(rng.randrange(0, 3))]
        made += len(outputs)
        temps = [(made + i, rng.randrange(1, 40) * 100, rng.randrange(0, 8) * 64)
                 for i in range(rng.randrange(0, 2))]
        made += len(temps)
        usable = live + [b for b, *_ in outputs + temps]
        kernels = [[(rng.choice(usable), rng.randrange(0, 4) * 8) for _ in range(
            rng.randrange(1, 4))] for _ in range(rng.randrange(1, 3))] if usable else []
        dropped = rng.sample(live, k=min(len(live), rng.randrange(0, 3)))
        program.append({"outputs": outputs, "temps": temps, "kernels": kernels,
                        "drop": dropped, "stale": rng.random() < 0.2})
        live = [b for b in live if b not in dropped] + [b for b, *_ in outputs]
    return program


def _run(program: list[dict], n: int) -> tuple[Capture, dict[tuple[str, int], tuple[int, int]]]:
    """The program at length ``n``: its capture, and what each kernel's pointer meant
    (node, index) -> (block, offset); stale words are left out."""
    c, address, meant, gone = Capture(), {}, {}, []
    for op in program:
        c.mark()
        for block, base, slope in op["outputs"] + op["temps"]:
            address[block] = c.malloc(base + slope * n)
        for pointers in op["kernels"]:
            node = f"n{len(c.graph)}"
            words = [address[b] + off * (n // 8) for b, off in pointers]
            for j, (b, off) in enumerate(pointers):
                meant[node, j] = (b, off * (n // 8))
            if op["stale"] and gone:
                words.append(gone[-1])  # a freed block's address, no pointer of the kernel's
            c.kernel("k", *words)
        for block, *_ in op["temps"]:
            c.free(address[block])
            gone.append(address[block])
        for block in op["drop"]:
            c.free(address[block])
            gone.append(address[block])
    return c, meant


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 12), st.integers(8, 63))
def test_a_move_is_refused_or_puts_every_pointer_where_its_block_lies(seed, operations, n):
    program = _program(random.Random(seed), operations)
    small, meant = _run(program, n)
    large, _ = _run(program, 64)
    try:
        got = to_reference(small.graph, small.history(), large.history(),
                           large.graph.buffers.values(), marks=small.marks)
    except UnsupportedError:
        return  # refusing is always safe
    there = {}  # block -> its address in the large run
    for e in large.trace:
        if e["action"] == "alloc" and e["size"] != MARKER_BYTES:
            there.setdefault(len(there), e["addr"])
    for (node, j), (block, offset) in meant.items():
        word = int.from_bytes(got.graph.op(node).args[8 * j:8 * j + 8], "little")
        assert word == there[block] + offset, (node, j)


def test_derive_lengths_over_moved_captures_captures_a_few_and_derives_the_rest():
    """The whole procedure a family with same_places runs, on made-up captures: every capture
    moved to the largest's places (grape.torch.family._Places does it there), then one length
    in eight captured, the others derived and checked against held-out captures."""
    from grape.passes.lengths import derive_lengths

    largest = decode(max(LENGTHS))

    def captured(n: int) -> KernelGraph:
        c = decode(n)
        return to_reference(c.graph, c.history(), largest.history(),
                            largest.graph.buffers.values(), marks=c.marks).graph

    def raw(n: int) -> KernelGraph:
        return decode(n).graph

    moved = derive_lengths(captured, LENGTHS, every=8)
    assert len(moved.derived) > len(LENGTHS) / 2
    assert not any(moved.checked.values())  # every held-out check agreed byte for byte
    for n in moved.derived[::7]:
        assert moved.graphs[n] == captured(n), n
    assert derive_lengths(raw, LENGTHS, every=8).derived == []  # the places step: nothing
