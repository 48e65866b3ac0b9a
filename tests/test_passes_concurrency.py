"""A capture's chain remade as the DAG its memory demands (grape.passes.concurrency), no GPU."""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grape.errors import UnsupportedError
from grape.ir import (
    Buffer,
    BufferRole,
    Conditional,
    ConditionalKind,
    Kernel,
    KernelGraph,
    Memcpy,
    Pointer,
    Span,
)
from grape.passes.concurrency import Allocations, OpAccess, concurrent

BASE = 0x7F00_0000_0000
SLOT = 0x100  # each tensor of the tests: 256 bytes of one pool buffer


def _pool(slots: int = 16) -> Buffer:
    return Buffer("pool", slots * SLOT, BufferRole.INTERNAL, address=BASE)


def _at(slot: int) -> tuple[int, int]:
    return BASE + slot * SLOT, SLOT


def _kernel(name: str, *slots: int) -> Kernel:
    """A kernel whose arguments point at ``slots`` of the pool, 8 bytes each."""
    return Kernel(f"f_{name}", name, (1, 1, 1), (32, 1, 1), args=bytes(8 * len(slots)),
                  pointers=tuple(Pointer(8 * i, Span("pool", s * SLOT))
                                 for i, s in enumerate(slots)))


def _chain(ops: list[list[Kernel]], before: int = 0) -> tuple[KernelGraph, list[int]]:
    """One stream's capture: every node after the one before, ``before`` kernels ahead of
    the first operation; returns the graph and each operation's first node."""
    g = KernelGraph()
    g.add_buffer(_pool())
    last: list[str] = []
    starts = []
    for i in range(before):
        last = [g.add(f"pre{i}", _kernel(f"pre{i}"), after=last)]
    for i, kernels in enumerate(ops):
        starts.append(len(g))
        for j, k in enumerate(kernels):
            last = [g.add(f"op{i}.{j}", k, after=last)]
    return g, starts


def _reaches(g: KernelGraph, a: str, b: str) -> bool:
    return nx.has_path(g.dag, a, b)


def test_independent_operations_run_side_by_side_and_dependent_ones_wait():
    # q = x @ wq; k = x @ wk (both read x); s = q . k; then x is overwritten (after s read it)
    g, starts = _chain([[_kernel("q", 0, 1)], [_kernel("k", 0, 2)], [_kernel("s", 1, 2, 3)],
                        [_kernel("x", 0, 3)]])
    ops = [OpAccess(starts[0], reads=(_at(0),), writes=(_at(1),), name="q"),
           OpAccess(starts[1], reads=(_at(0),), writes=(_at(2),), name="k"),
           OpAccess(starts[2], reads=(_at(1), _at(2)), writes=(_at(3),), name="s"),
           OpAccess(starts[3], reads=(_at(3),), writes=(_at(0),), name="x")]
    c = concurrent(g, ops)
    dag = c.graph.dag
    assert not _reaches(c.graph, "op0.0", "op1.0") and not _reaches(c.graph, "op1.0", "op0.0")
    assert set(dag.predecessors("op2.0")) == {"op0.0", "op1.0"}
    # x's writer waits for both readers of x, through s; the implied edges are dropped
    assert set(dag.predecessors("op3.0")) == {"op2.0"}
    assert (c.groups, c.barriers, c.widened, c.depth, c.nodes) == (4, (), (), 3, 4)
    assert c.graph.buffers == g.buffers and list(c.graph.dag) == list(g.dag)


def test_a_pointer_outside_the_declarations_widens_to_its_whole_buffer():
    # op1 declares slot 5 only, but its kernel points at slot 9 too (a workspace, a stale
    # argument word): it must then wait for op0, whose write lies in the same buffer.
    g, starts = _chain([[_kernel("a", 1)], [_kernel("b", 5, 9)]])
    declared = [OpAccess(starts[0], writes=(_at(1),)),
                OpAccess(starts[1], writes=(_at(5),), name="b")]
    c = concurrent(g, declared)
    assert _reaches(c.graph, "op0.0", "op1.0") and c.widened == ("b (buffer)",)
    honest = [declared[0], OpAccess(starts[1], writes=(_at(5), _at(9)))]
    assert not _reaches(concurrent(g, honest).graph, "op0.0", "op1.0")


def test_a_stale_word_naming_a_declared_tensor_widens_to_that_tensor_alone():
    # PyTorch's offset calculators keep stale slots: op2's kernel carries a word inside the
    # tensor op0 wrote (slot 1). op2 is ordered after op0 (whose tensor the word may mean),
    # not after op1, which touches nothing of it.
    g, starts = _chain([[_kernel("a", 1)], [_kernel("b", 2)], [_kernel("c", 5, 1)]])
    ops = [OpAccess(starts[0], writes=(_at(1),)), OpAccess(starts[1], writes=(_at(2),)),
           OpAccess(starts[2], writes=(_at(5),), name="c")]
    c = concurrent(g, ops)
    assert _reaches(c.graph, "op0.0", "op2.0") and not _reaches(c.graph, "op1.0", "op2.0")
    assert c.widened == ("c (tensor)",)


def test_an_operations_own_kernel_naming_another_operations_tensor_holds_a_stale_word():
    # The same words, where the capture says op2's kernel ran inside op2's dispatch (end):
    # PyTorch's contract is that it touches op2's tensors alone, so the word in op0's tensor
    # is stale and orders nothing. A kernel after the dispatch returned (launched outside the
    # dispatcher, so attributed to op2) is still widened. A word in no declared tensor (here
    # a whole buffer: no allocations given) is widened even inside the dispatch.
    g, starts = _chain([[_kernel("a", 1)], [_kernel("b", 2)], [_kernel("c", 5, 1)],
                        [_kernel("d", 6, 2), _kernel("outside", 7, 1)]])
    ops = [OpAccess(starts[0], writes=(_at(1),), end=starts[0] + 1),
           OpAccess(starts[1], writes=(_at(2),), end=starts[1] + 1),
           OpAccess(starts[2], writes=(_at(5),), name="c", end=starts[2] + 1),
           OpAccess(starts[3], writes=(_at(6), _at(7)), name="d", end=starts[3] + 1)]
    c = concurrent(g, ops)
    assert not _reaches(c.graph, "op0.0", "op2.0")
    assert _reaches(c.graph, "op0.0", "op3.1") and not _reaches(c.graph, "op1.0", "op3.0")
    assert c.stale == ("c", "d") and c.widened == ("d (tensor)",)
    g, starts = _chain([[_kernel("a", 1)], [_kernel("b", 5, 9)]])
    c = concurrent(g, [OpAccess(starts[0], writes=(_at(1),), end=1),
                       OpAccess(starts[1], writes=(_at(5),), name="b", end=2)])
    assert _reaches(c.graph, "op0.0", "op1.0") and c.widened == ("b (buffer)",)
    # A copy's ends are exact, not words that may be stale: one inside the dispatch that
    # reaches another operation's tensor is widened.
    g = KernelGraph()
    g.add_buffer(_pool())
    g.add("a", _kernel("a", 1))
    g.add("copy", Memcpy(Span("pool", 1 * SLOT), Span("pool", 6 * SLOT), SLOT), after=["a"])
    c = concurrent(g, [OpAccess(0, writes=(_at(1),), end=1),
                       OpAccess(1, reads=(_at(6),), writes=(_at(7),), name="copy", end=2)])
    assert _reaches(c.graph, "a", "copy") and c.stale == () and c.widened == ("copy (tensor)",)


def test_the_allocators_view_tells_workspaces_from_stale_words():
    # The pool is one allocator segment. op1 and op2 point at slot 9, a block some tensor
    # held during the capture that no operation declared (a library's workspace): they are
    # ordered against each other, and only so. op3 points at slot 12, which no tensor held
    # (a stale word): nothing orders it. op0 writes slot 1 and meets none of them.
    g, starts = _chain([[_kernel("a", 1)], [_kernel("b", 2, 9)], [_kernel("c", 3, 9)],
                        [_kernel("d", 4, 12)]])
    ops = [OpAccess(s, writes=(_at(i + 1),), name=f"op{i}") for i, s in enumerate(starts)]
    seen = Allocations(segments=((BASE, 16 * SLOT),), held=(_at(9),))
    c = concurrent(g, ops, seen)
    assert _reaches(c.graph, "op1.0", "op2.0")
    assert not any(_reaches(c.graph, a, b) for a, b in [("op0.0", "op1.0"), ("op0.0", "op2.0"),
                                                         ("op0.0", "op3.0"), ("op2.0", "op3.0")])
    assert c.widened == ("op1 (block)", "op2 (block)")
    # memory the allocator does not manage (a library's own allocation): its whole buffer
    c = concurrent(g, ops, Allocations(segments=(), held=(_at(9),)))
    assert _reaches(c.graph, "op0.0", "op3.0")


def test_an_operations_kernels_keep_their_order_and_their_edge_kinds():
    g, starts = _chain([[_kernel("a1", 1), _kernel("a2", 1)], [_kernel("b", 2)]])
    g.dag.edges["op0.0", "op0.1"]["kind"] = "programmatic"
    ops = [OpAccess(starts[0], writes=(_at(1),)), OpAccess(starts[1], writes=(_at(2),))]
    c = concurrent(g, ops)
    assert c.graph.dag.edges["op0.0", "op0.1"].get("kind") == "programmatic"
    assert set(c.graph.dag.edges) == {("op0.0", "op0.1")}  # b shares nothing with a


def test_nodes_before_the_first_operation_and_conditionals_order_everything():
    g, starts = _chain([[_kernel("a", 1)], [_kernel("b", 2)], [_kernel("c", 3)]], before=1)
    body = KernelGraph()
    body.add_buffer(_pool())
    body.add("inner", _kernel("inner", 4))
    g.dag.nodes["op1.0"]["op"] = Conditional(ConditionalKind.IF, "h", (body,))
    ops = [OpAccess(s, writes=(_at(i + 1),)) for i, s in enumerate(starts)]
    c = concurrent(g, ops)
    assert _reaches(c.graph, "pre0", "op0.0")
    assert _reaches(c.graph, "op0.0", "op1.0") and _reaches(c.graph, "op1.0", "op2.0")
    assert c.barriers == ("before the first operation", "")


def test_copies_are_placed_by_their_spans():
    g = KernelGraph()
    g.add_buffer(_pool())
    g.add("copy", Memcpy(Span("pool", 0), Span("pool", 6 * SLOT), SLOT))
    g.add("k", _kernel("k", 7), after=["copy"])
    c = concurrent(g, [OpAccess(0, reads=(_at(0),), writes=(_at(6),)),
                       OpAccess(1, reads=(_at(6),), writes=(_at(7),))])
    assert _reaches(c.graph, "copy", "k")


def test_bad_input_says_what_was_expected():
    g, _ = _chain([[_kernel("a", 1)], [_kernel("b", 2)]])
    with pytest.raises(UnsupportedError, match="expected operations starting in order"):
        concurrent(g, [OpAccess(1), OpAccess(0)])
    with pytest.raises(UnsupportedError, match="expected operations starting in order"):
        concurrent(g, [OpAccess(0), OpAccess(3)])
    loaded = KernelGraph()
    loaded.add_buffer(Buffer("pool", 64, BufferRole.INTERNAL))
    loaded.add("k", Kernel("f", "k", (1, 1, 1), (1, 1, 1), args=bytes(8),
                           pointers=(Pointer(0, Span("pool")),)))
    with pytest.raises(UnsupportedError, match="without one"):
        concurrent(loaded, [OpAccess(0)])


def test_no_operations_keeps_the_chain():
    g, _ = _chain([[_kernel("a", 1), _kernel("b", 2)]])
    c = concurrent(g, [])
    assert set(c.graph.dag.edges) == set(g.dag.edges) and len(c.barriers) == 1


_programs = st.lists(
    st.tuples(st.lists(st.integers(0, 7), max_size=3), st.lists(st.integers(0, 7), max_size=2),
              st.integers(0, 2)),
    min_size=1, max_size=14)


@settings(max_examples=150, deadline=None)
@given(_programs)
def test_an_operation_waits_exactly_for_the_ones_it_conflicts_with(program):
    """Sound and no more than needed: operation j's first node is reachable from operation
    i's last exactly where the conflict relation's transitive closure orders i before j, and
    the edges between operations are networkx's transitive reduction of that relation."""
    kernels = [[_kernel(f"{i}.{n}", *reads, *writes) for n in range(count)]
               for i, (reads, writes, count) in enumerate(program)]
    g, starts = _chain(kernels)
    ops = [OpAccess(s, tuple(map(_at, reads)), tuple(map(_at, writes)))
           for s, (reads, writes, _) in zip(starts, program, strict=True)]
    c = concurrent(g, ops)
    conflicts = nx.DiGraph()
    made = [i for i, (_, _, count) in enumerate(program) if count]
    conflicts.add_nodes_from(made)
    for a in made:
        for b in made:
            ra, wa, _ = program[a]
            rb, wb, _ = program[b]
            if a < b and (set(wa) & (set(rb) | set(wb)) or set(ra) & set(wb)):
                conflicts.add_edge(a, b)
    closure = nx.transitive_closure_dag(conflicts)
    for a in made:
        for b in made:
            if a < b:
                last, first = f"op{a}.{program[a][2] - 1}", f"op{b}.0"
                assert _reaches(c.graph, last, first) == closure.has_edge(a, b), (a, b)
    lasts = {a: f"op{a}.{program[a][2] - 1}" for a in made}
    firsts = {b: f"op{b}.0" for b in made}
    between = {(u, v) for u, v in c.graph.dag.edges if u.split(".")[0] != v.split(".")[0]}
    assert between == {(lasts[a], firsts[b]) for a, b in nx.transitive_reduction(conflicts).edges}
