"""Conditional nodes' choices read from a traced launch: the streams their bodies ran on
(grape.sim.traced_choices), and `grape simulate` taking them where no flag gives them."""

from __future__ import annotations

import gzip
import json

import pytest

from grape.cli import main
from grape.errors import SimulationError
from grape.ir import Conditional, ConditionalKind, Kernel, KernelGraph
from grape.records import GpuRecord, HostCall, LaunchRecord
from grape.sim.traced_choices import choices_in_launch, choices_in_trace


def _kernel(name):
    return Kernel(function=f"{name}@0x1", name=name, grid=(1, 1, 1), block=(32, 1, 1))


def _body(*names):
    b = KernelGraph()
    for i, name in enumerate(names):
        b.add(f"n{i}", _kernel(name), after=[f"n{i - 1}"] if i else [])
    return b


def _attention_pairs(layers):
    """As grape.torch.hfmasks captures a prompt's attention: per layer a kernel, then an IF
    pair (the unmasked kernels, then the masked ones on the negated predicate)."""
    g = KernelGraph()
    last = []
    for layer in range(layers):
        g.add(f"qkv{layer}", _kernel("qkv"), after=last)
        g.add(f"if{layer}a", Conditional(ConditionalKind.IF, "h", (_body("sdpa"),)),
              after=[f"qkv{layer}"])
        g.add(f"if{layer}b", Conditional(ConditionalKind.IF, "h",
                                         (_body("fill", "where", "sdpa"),)),
              after=[f"if{layer}a"])
        last = [f"if{layer}b"]
    return g


def _op(name, ts, stream, kind="kernel"):
    return GpuRecord(kind, name, ts, 1.0, stream, 0, grid=(1, 1, 1), block=(32, 1, 1))


def _launch(ops):
    call = HostCall(name="cuGraphLaunch", category="driver", ts=0.0, dur=1.0, tid=1)
    return LaunchRecord(call, tuple(ops))


def _ran(bodies, main_kernels=("qkv",)):
    """A launch's GPU work: the outer kernels on stream 7, each body run on a stream of its
    own (with a memset kernel, as an H100 ran the memset nodes), in turn."""
    ops, t = [], 0.0
    for i, body in enumerate(bodies):
        ops += [_op(k, t, 7) for k in main_kernels]
        t += 2
        ops += [_op(k, t + j, 100 + 2 * i) for j, k in enumerate(("memset32", *body))]
        t += 10
    return ops


def test_an_unpadded_prompt_s_launch_took_the_first_of_each_pair():
    g = _attention_pairs(3)
    choices = choices_in_launch(g, _ran([("sdpa",)] * 3), "t")
    assert choices.taken == {"if0a": True, "if0b": False, "if1a": True, "if1b": False,
                             "if2a": True, "if2b": False}
    padded = choices_in_launch(g, _ran([("fill", "where", "sdpa")] * 3), "t")
    assert [padded.taken[f"if{i}{s}"] for i in range(3) for s in "ab"] == [False, True] * 3


def test_a_launch_without_its_bodies_or_with_streams_out_of_turn_is_refused():
    g = _attention_pairs(2)
    with pytest.raises(SimulationError, match="expected a graph launch that ran a body"):
        choices_in_trace(g, [_launch(_ran([]))], "t")
    # Three bodies' streams for two pairs: one cannot be placed in turn.
    with pytest.raises(SimulationError, match=r"found 1 left over \(of 1 x 1 kernels\)"):
        choices_in_launch(g, _ran([("sdpa",)] * 3), "t")
    # One body of each kind for two pairs: the first pair's two, or the first's unmasked
    # and the second's masked? The streams alone cannot tell.
    with pytest.raises(SimulationError,
                       match="fitting nodes 'if0a' to 'if1b' in more than one way"):
        choices_in_launch(g, _ran([("sdpa",), ("fill", "where", "sdpa")]), "t")
    # Two launches choosing differently.
    first = _launch(_ran([("sdpa",), ("sdpa",)]))
    other = _launch(_ran([("fill", "where", "sdpa")] * 2))
    with pytest.raises(SimulationError, match=r"launch 2 choosing otherwise at \['if0a', "
                                              r"'if0b', 'if1a'\]"):
        choices_in_trace(g, [first, other], "t")
    assert choices_in_trace(g, [first, first], "t").taken["if1a"]


def test_if_else_and_switch_nodes_take_the_body_their_stream_holds():
    g = KernelGraph()
    g.add("pre", _kernel("qkv"))
    g.add("either", Conditional(ConditionalKind.IF_ELSE, "h", (_body("x"), _body("y"))),
          after=["pre"])
    g.add("pick", Conditional(ConditionalKind.SWITCH, "s", (_body("w"), _body("z"))),
          after=["either"])
    choices = choices_in_launch(g, _ran([("y",), ("z",)]), "t")
    assert choices.taken == {"either": False} and choices.branch == {"pick": 1}
    alone = choices_in_launch(g, _ran([("x",)]), "t")
    assert alone.taken == {"either": True} and alone.branch == {"pick": 2}  # none ran
    with pytest.raises(SimulationError, match="IF/ELSE node 'either'"):
        choices_in_launch(g, _ran([("z",)]), "t")


def _chrome(ops):
    events = [{"ph": "X", "cat": "cpu_op", "name": "grape:cuGraphLaunch", "ts": -5.0,
               "dur": 2.0, "pid": 1, "tid": 1}]
    for op in ops:
        events.append({"ph": "X", "cat": "kernel", "name": op.name, "ts": op.ts,
                       "dur": op.dur, "pid": 0, "tid": op.stream,
                       # (as on the H100: the bodies' work under correlation 0)
                       "args": {"stream": op.stream, "correlation": 5 if op.stream == 7 else 0,
                                "grid": list(op.grid), "block": list(op.block)}})
    return {"schemaVersion": 1, "traceEvents": events}


def test_simulate_reads_the_choices_from_the_durations_trace(tmp_path, capsys):
    g = _attention_pairs(2)
    ir = tmp_path / "g.ir.json.gz"
    g.save(ir)
    trace = tmp_path / "t.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump(_chrome(_ran([("sdpa",), ("sdpa",)])), f)
    # (fill and where never ran, so a skipped body's kernels need no duration)
    assert main(["simulate", str(ir), "--durations", str(trace)]) == 0
    out = capsys.readouterr().out
    assert f"conditional nodes as {trace} shows them: 2 of 4 ran a body" in out
    # A flag wins over the trace: the masked body taken needs its kernels' durations.
    assert main(["simulate", str(ir), "--durations", str(trace), "--if", "if0b=taken"]) == 2
    assert "expected a duration for node" in capsys.readouterr().err


def test_a_body_without_kernels_leaves_its_node_undecided_unless_its_other_body_ran():
    from grape.ir import Buffer, BufferRole, Memset, Span

    def memset_only():
        b = KernelGraph()
        b.add_buffer(Buffer("x", 4, BufferRole.INTERNAL))
        b.add("clear", Memset(dst=Span("x"), value=0, element_size=4, width=1))
        return b

    g = KernelGraph()
    g.add("pre", _kernel("qkv"))
    g.add("maybe", Conditional(ConditionalKind.IF, "h", (memset_only(),)), after=["pre"])
    g.add("either", Conditional(ConditionalKind.IF_ELSE, "e", (_body("x"), memset_only())),
          after=["maybe"])
    choices = choices_in_launch(g, _ran([]), "t")
    assert "maybe" not in choices.taken  # no stream shows it: the simulator asks
    assert choices.taken["either"] is False  # x's stream absent: the other body ran
    assert choices_in_launch(g, _ran([("x",)]), "t").taken == {"either": True}


# --- read by count, where CUPTI's streams and names for the bodies are another graph's ------

def _counted_launch(bodies, stale=False):
    """A launch of _attention_pairs: each layer's own kernel under the launch's correlation
    (5), then the bodies that ran under correlation 0; ``stale``: every body record named
    "gemm" on stream 7, as CUPTI named a loop's after an earlier graph's nodes."""
    from grape.records import GpuRecord

    ops, t = [], 0.0
    for body in bodies:
        ops.append(GpuRecord("kernel", "qkv", t, 1.0, 7, 5, grid=(1, 1, 1), block=(32, 1, 1)))
        for k in body:
            t += 2
            ops.append(GpuRecord("kernel", "gemm" if stale else k, t, 1.0, 7 if stale else 100,
                                 0, grid=(1, 1, 1), block=(32, 1, 1)))
        t += 2
    return ops


def test_choices_are_read_from_the_count_between_the_graph_s_own_operations():
    from grape.sim.traced_choices import choices_by_count

    g = _attention_pairs(3)
    # Layer 0 ran the unmasked body (1 kernel), layer 1 the masked one (3), layer 2 both (4).
    ops = _counted_launch([("sdpa",), ("fill", "where", "sdpa"), ("sdpa", "fill", "where",
                                                                   "sdpa")], stale=True)
    c = choices_by_count(g, ops, "t")
    assert c.taken == {"if0a": True, "if0b": False, "if1a": False, "if1b": True,
                       "if2a": True, "if2b": True}
    # The streams alone show no body at all (every record on the launch's own stream), so
    # would say none ran; the trace's reading takes the count.
    assert not any(choices_in_launch(g, ops, "t").taken.values())
    assert choices_in_trace(g, [_launch(ops)], "t").taken == c.taken


def test_a_loop_s_count_is_read_and_a_count_no_choice_makes_is_refused():
    from grape.records import GpuRecord
    from grape.sim.traced_choices import choices_by_count

    g = KernelGraph()
    g.add("pre", _kernel("qkv"))
    g.add("loop", Conditional(ConditionalKind.WHILE, "h", (_body("a", "b"),)), after=["pre"])
    ops = [GpuRecord("kernel", "qkv", 0.0, 1.0, 7, 5, grid=(1, 1, 1), block=(32, 1, 1))]
    ops += [GpuRecord("kernel", "x", 2.0 + i, 0.5, 9, 0, grid=(1, 1, 1), block=(32, 1, 1))
            for i in range(14)]
    assert choices_by_count(g, ops, "t").iterations == {"loop": 7}
    with pytest.raises(SimulationError, match="13 operations .* in one way, found none"):
        choices_by_count(g, ops[:-1], "t")
    pairs = _attention_pairs(1)  # two IF nodes of one-kernel bodies: 1 is either
    ops = _counted_launch([("sdpa",)])
    pairs_same = KernelGraph()
    pairs_same.add("qkv0", _kernel("qkv"))
    pairs_same.add("if0a", Conditional(ConditionalKind.IF, "h", (_body("sdpa"),)),
                   after=["qkv0"])
    pairs_same.add("if0b", Conditional(ConditionalKind.IF, "h", (_body("sdpa"),)),
                   after=["if0a"])
    assert choices_by_count(pairs, ops, "t").taken == {"if0a": True, "if0b": False}
    with pytest.raises(SimulationError, match="in one way, found more than one"):
        choices_by_count(pairs_same, ops, "t")


def test_a_trace_of_many_launches_orders_the_graph_once(monkeypatch):
    # The chain's order (a topological sort and a longest path over the whole graph) is the
    # same for every launch: a trace of many launches of one graph works it out once.
    from grape.sim import traced_durations

    g = _attention_pairs(3)
    ops = _counted_launch([("sdpa",), ("fill", "where", "sdpa"), ("sdpa",)], stale=True)
    calls = []
    original = traced_durations.chain_order
    monkeypatch.setattr(traced_durations, "chain_order",
                        lambda *a: calls.append(a) or original(*a))
    found = choices_in_trace(g, [_launch(ops)] * 50, "t")
    assert len(calls) == 1
    assert found.taken == {"if0a": True, "if0b": False, "if1a": False, "if1b": True,
                           "if2a": True, "if2b": False}
