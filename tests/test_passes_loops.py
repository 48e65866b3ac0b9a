"""The bounded WHILE loop built around a body, as IR, with no GPU."""

from __future__ import annotations

import pytest

from grape.errors import GrapeError
from grape.ir import (
    Buffer,
    BufferRole,
    Conditional,
    ConditionalKind,
    HandleRef,
    Kernel,
    KernelGraph,
    Memset,
)
from grape.passes.loops import while_loop_graph

REMAINING = Buffer("left", 4, BufferRole.INTERNAL, address=0x1000)
FLAG = Buffer("go", 1, BufferRole.INTERNAL, address=0x2000)


def _setter(name, handle="h"):
    return Kernel(f"f_{name}", name, (1, 1, 1), (1, 1, 1), args=bytes(16),
                  handles=(HandleRef(0, handle),))


def _body():
    g = KernelGraph()
    g.add_buffer(Buffer("state", 64, BufferRole.INTERNAL, address=0x3000))
    g.add("a", Kernel("fa", "a", (1, 1, 1), (32, 1, 1), args=bytes(8)))
    g.add("b", Kernel("fb", "b", (1, 1, 1), (32, 1, 1), args=bytes(8)), after=["a"])
    g.add("c", Kernel("fc", "c", (1, 1, 1), (32, 1, 1), args=bytes(8)), after=["a"])
    return g


def _loop(body=None, bound=256, **kw):
    return while_loop_graph(body or _body(), REMAINING, bound, handle="h",
                            start=_setter("start"), step=_setter("step"), extra=(FLAG,), **kw)


def test_loop_is_memset_start_then_a_while_node_whose_body_ends_in_the_step():
    g = _loop()
    assert list(g.dag.edges) == [("grape:remaining", "grape:start"),
                                 ("grape:start", "grape:while")]
    memset = g.op("grape:remaining")
    assert isinstance(memset, Memset) and (memset.dst.buffer, memset.value) == ("left", 256)
    loop = g.op("grape:while")
    assert isinstance(loop, Conditional) and loop.type is ConditionalKind.WHILE
    assert loop.handle == "h" and loop.default == 0
    (inner,) = loop.bodies
    # The step follows every sink of the body, so it sees the whole iteration's work.
    assert sorted(inner.dag.predecessors("grape:step")) == ["b", "c"]
    assert set(g.buffers) == {"state", "left", "go"}


def test_the_body_is_copied_not_changed():
    body = _body()
    before = (sorted(body.dag.edges), dict(body.ops()))
    _loop(body)
    assert (sorted(body.dag.edges), dict(body.ops())) == before


@pytest.mark.parametrize("bound", [0, -3, 2.5, True, None])
def test_a_loop_without_a_bound_is_refused(bound):
    with pytest.raises(GrapeError, match="a loop without one is refused"):
        _loop(bound=bound)


def test_setters_must_take_the_loops_handle():
    with pytest.raises(GrapeError, match="expected setter kernel 'start' to take handle 'h'"):
        while_loop_graph(_body(), REMAINING, 4, handle="h", start=_setter("start", "other"),
                         step=_setter("step"))


STATE = Buffer("state", 64, BufferRole.INTERNAL, address=0x3000)


def _prologue(state=STATE):
    g = KernelGraph()
    g.add_buffer(state)
    g.add_buffer(Buffer("prompt", 32, BufferRole.INTERNAL, address=0x4000))
    g.add("a", Kernel("fp", "prefill", (1, 1, 1), (32, 1, 1), args=bytes(8)))
    g.add("b", Kernel("fq", "first token", (1, 1, 1), (32, 1, 1), args=bytes(8)), after=["a"])
    return g


def test_a_prologue_runs_first_in_the_same_graph():
    g = _loop(prologue=_prologue())
    assert list(g.dag.predecessors("grape:remaining")) == ["prologue:b"]
    assert list(g.dag.predecessors("prologue:b")) == ["prologue:a"]
    assert g.op("prologue:a").name == "prefill"
    # The body's names are free to repeat the prologue's: each sits in its own graph.
    assert set(g.op("grape:while").bodies[0].dag) == {"a", "b", "c", "grape:step"}
    assert set(g.buffers) == {"state", "left", "go", "prompt"}


def test_a_prologue_that_names_a_buffer_otherwise_is_refused():
    moved = Buffer("state", 64, BufferRole.INTERNAL, address=0x9000)
    with pytest.raises(GrapeError, match="expected buffer 'state' to be one memory"):
        _loop(prologue=_prologue(moved))
