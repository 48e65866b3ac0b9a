"""Programmatic edges kept only out of kernels launched dependently, as IR, with no GPU."""

from __future__ import annotations

from grape.ir import (
    Buffer,
    BufferRole,
    Conditional,
    ConditionalKind,
    Kernel,
    KernelGraph,
    Memset,
    Span,
)
from grape.passes.dependent_launch import dependent_edges


def _kernel(name):
    return Kernel(f"f_{name}", name, (1, 1, 1), (32, 1, 1), args=bytes(8))


def _step():
    """A compiled step as captured: ``attention`` (cuDNN's, launched plainly after a memset),
    then Inductor's kernels ``o``, ``norm`` and ``up``, each launched dependently, and
    ``argmax`` (PyTorch's, plainly) with ``pick`` (Inductor's) behind it; ``up`` also waits
    fully for a memset beside the chain."""
    g = KernelGraph()
    g.add_buffer(Buffer("ws", 64, BufferRole.INTERNAL, address=0x1000))
    g.add("zero", Memset(Span("ws"), 0, 4, 16))
    g.add("attention", _kernel("attention"), after=["zero"])
    g.add("o", _kernel("o"), after=["attention"], kinds={"attention": "programmatic"})
    g.add("norm", _kernel("norm"), after=["o"], kinds={"o": "programmatic"})
    g.add("clear", Memset(Span("ws"), 0, 4, 16), after=["norm"])
    g.add("up", _kernel("up"), after=["norm", "clear"], kinds={"norm": "programmatic"})
    g.add("argmax", _kernel("argmax"), after=["up"])
    g.add("pick", _kernel("pick"), after=["argmax"], kinds={"argmax": "programmatic"})
    return g


def test_edges_out_of_kernels_launched_plainly_become_full_and_the_others_stay():
    g = _step()
    out = dependent_edges(g)
    assert out.edges() == {("zero", "attention", None), ("attention", "o", None),
                           ("o", "norm", "programmatic"), ("norm", "clear", None),
                           ("norm", "up", "programmatic"), ("clear", "up", None),
                           ("up", "argmax", None), ("argmax", "pick", None)}
    # (o's edge in was weakened, but o was launched dependently: its edge out stays)
    assert list(out.dag.nodes) == list(g.dag.nodes)
    assert [op for _, op in out.ops()] == [op for _, op in g.ops()]
    assert g.kinds_into("o") == {"attention": "programmatic"}  # the graph given is left alone


def test_a_graph_without_programmatic_edges_is_returned_as_it_is():
    plain = KernelGraph()
    plain.add("a", _kernel("a"))
    plain.add("b", _kernel("b"), after=["a"], kinds={"a": "launch_order"})
    plain.add("c", _kernel("c"), after=["b"])
    assert dependent_edges(plain) is plain


def test_bodies_of_conditional_nodes_are_passed_too():
    body = _step()
    outer = KernelGraph()
    outer.buffers = dict(body.buffers)
    outer.add("loop", Conditional(ConditionalKind.WHILE, "h", (body,)))
    out = dependent_edges(outer)
    (inner,) = out.op("loop").bodies
    assert inner.kinds_into("o") == {} and inner.kinds_into("norm") == {"o": "programmatic"}
    assert outer.op("loop").bodies[0] is body
