"""Node durations read from a traced launch by position (grape.sim.traced_durations): the
order a chain runs its work in is the graph's, whatever names CUPTI gave the records."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from grape.errors import SimulationError
from grape.ir import Conditional, ConditionalKind, Kernel, KernelGraph, Memset, Span
from grape.records import GpuRecord
from grape.sim.engine import Costs
from grape.sim.graph import Choices, Durations, run_graph
from grape.sim.traced_durations import node_durations


def _kernel(name):
    return Kernel(function=f"{name}@0x1", name=name, grid=(1, 1, 1), block=(32, 1, 1))


def _chain(*names, graph=None):
    g = graph if graph is not None else KernelGraph()
    last = list(g.dag)[-1:] if graph is not None else []
    for name in names:
        op = _kernel(name) if name != "zero" else Memset(Span("b"), 0, element_size=4, width=64)
        g.add(name, op, after=last)
        last = [name]
    return g


def _loop():
    """A device loop as grape builds one: a prompt kernel, an IF (taken or not), a WHILE whose
    body is a chain with a memset in it."""
    g = _chain("prompt")
    g.add("if", Conditional(ConditionalKind.IF, "h", (_chain("mask"),)), after=["prompt"])
    g.add("loop", Conditional(ConditionalKind.WHILE, "h", (_chain("step", "zero", "pick"),)),
          after=["if"])
    return g


def _records(durations, names=None):
    names = names or ["x"] * len(durations)
    return [GpuRecord("kernel", n, 10.0 * i, d, 7, 0, grid=(1, 1, 1), block=(32, 1, 1))
            for i, (n, d) in enumerate(zip(names, durations, strict=True))]


def test_each_node_takes_the_mean_of_the_operations_in_its_turns():
    choices = Choices(iterations={"loop": 2}, taken={"if": True})
    # prompt, mask, then (step, zero, pick) twice; the trace names every kernel "x".
    found = node_durations(_loop(), _records([5, 1, 2, 0.5, 3, 4, 0.7, 5]), choices, "t")
    assert found.table == {"prompt": 5, "if/0/mask": 1, "loop/0/step": 3, "loop/0/zero": 0.6,
                           "loop/0/pick": 4}
    assert (found.executions, found.renamed) == (8, 6)  # the memset's records are no kernels'
    # The IF skipped: one operation fewer, and the mask has no turn.
    skipped = node_durations(_loop(), _records([5, 2, 0.5, 3, 4, 0.7, 5]),
                             dataclasses.replace(choices, taken={"if": False}), "t")
    assert "if/0/mask" not in skipped.table and skipped.table["loop/0/step"] == 3


def test_names_in_the_trace_that_fit_the_nodes_count_as_such():
    g = _chain("a", "b")
    found = node_durations(g, _records([1, 2], ["a", "b"]), Choices(), "t")
    assert found.renamed == 0


def test_the_run_prices_nodes_by_their_own_durations_before_any_by_name():
    g = _chain("a", "b")
    by_name = Durations({("a", (1, 1, 1), (32, 1, 1)): 100.0,
                         ("b", (1, 1, 1), (32, 1, 1)): 100.0}, "t")
    table = node_durations(g, _records([1, 2]), Choices(), "t").table
    run = run_graph(g, dataclasses.replace(by_name, nodes=table), Costs(graph_node_overhead=0.0))
    assert run.gpu_time == pytest.approx(3.0)


@pytest.mark.parametrize("records, choices, message", [
    (_records([1] * 7), Choices(iterations={"loop": 2}, taken={"if": True}),
     "expected 8 GPU operations in the launch (the graph's node executions at the choices "
     "given), found 7"),
    (_records([1] * 8), Choices(taken={"if": True}),
     "expected an iteration count for WHILE node 'loop'"),
    (_records([1] * 8), Choices(iterations={"loop": 2}), "expected whether IF node 'if' is taken"),
])
def test_a_trace_that_does_not_pair_is_refused_in_one_line(records, choices, message):
    with pytest.raises(SimulationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        node_durations(_loop(), records, choices, "t")


def test_a_graph_whose_work_forks_is_refused():
    g = _chain("a")
    g.add("b", _kernel("b"), after=["a"])
    g.add("c", _kernel("c"), after=["a"])
    with pytest.raises(SimulationError, match="1 of its 3 operations off its longest path"):
        node_durations(g, _records([1, 1, 1]), Choices(), "t")


def test_simulate_prices_a_graph_from_the_chain_it_was_made_from_and_its_timed_launch(
        tmp_path, capsys):
    """`grape simulate DAG --durations CHAIN_TRACE --durations-ir CHAIN --timed US`: the what-if
    of a concurrent step from its chain's recording; CUPTI's names are not needed."""
    import gzip

    from grape.cli import main

    chain, dag = _chain("a", "b", "c"), _chain("a")
    dag.add("b", _kernel("b"), after=["a"])
    dag.add("c", _kernel("c"), after=["a"])  # b and c side by side
    for name, g in (("chain", chain), ("dag", dag)):
        g.save(tmp_path / f"{name}.ir.json.gz")
    events = [{"ph": "X", "cat": "cpu_op", "name": "grape:cuGraphLaunch", "ts": -5.0,
               "dur": 2.0, "pid": 1, "tid": 1}]
    for i, dur in enumerate((2.0, 10.0, 10.0)):  # named "other" each: a stale record's name
        events.append({"ph": "X", "cat": "kernel", "name": "other", "ts": 20.0 * i,
                       "dur": dur, "pid": 0, "tid": 7,
                       "args": {"stream": 7, "correlation": 5, "grid": [1, 1, 1],
                                "block": [32, 1, 1]}})
    trace = tmp_path / "chain.kineto.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"schemaVersion": 1, "traceEvents": events}, f)
    argv = ["simulate", str(tmp_path / "dag.ir.json.gz"), "--durations", str(trace),
            "--durations-ir", str(tmp_path / "chain.ir.json.gz"), "--node-overhead", "0"]
    assert main(argv + ["--timed", "24"]) == 0  # 22 us of kernels: 1 us a wait
    out = capsys.readouterr().out
    assert "node durations by position" in out and "3 kernel records named otherwise" in out
    assert "a node waits 1.000 us beyond the ones before it" in out
    assert "GPU time per launch                 0.013 ms" in out  # 2 + 1 + 10, b and c together
    # Without the chain's IR the forked graph cannot pair, and "other" prices nothing.
    assert main(argv[:4] + ["--node-overhead", "0"]) == 2
    assert "expected a duration for node 'a'" in capsys.readouterr().err


# --- a real recording: a GPT-2 five-beam device loop on the H200 ---------------------------

CONCURRENT = Path(__file__).resolve().parent.parent / "traces" / "h200_concurrent"


@pytest.fixture(scope="module")
def beams():
    """The chain's IR and trace, the DAG's IR, both launches' GPU time as timed, the H200
    profile's costs, and the choices the script's unpadded prompt makes (the first IF of each
    attention pair; the trace's streams do tell them here, the same)."""
    from grape.profile import DEFAULT_PROFILE, load_profile
    from grape.sim.traced_choices import choices_in_trace
    from grape.sim.whatif import costs_from_profile
    from grape.trace import read_trace

    row = next(r for r in json.loads((CONCURRENT / "concurrent_step.json").read_text())["results"]
               if (r["arch"], r["strategy"]) == ("gpt2", "beam5"))
    chain = KernelGraph.load(CONCURRENT / "gpt2_beam5_chain.ir.json.gz")
    dag = KernelGraph.load(CONCURRENT / "gpt2_beam5_dag.ir.json.gz")
    trace = read_trace(CONCURRENT / "gpt2_beam5_chain.kineto.json.gz")
    choices = dataclasses.replace(choices_in_trace(chain, trace.launches, "t"),
                                  iterations={"grape:while": row["new_tokens"] - 1})
    measured = {w: row[f"{w}_gpu_us_per_token"] * row["new_tokens"] for w in ("chain", "dag")}
    return chain, dag, trace, choices, measured, costs_from_profile(load_profile(DEFAULT_PROFILE))


def test_cupti_s_names_for_a_loop_body_are_not_its_nodes_but_their_positions_are(beams):
    chain, _, trace, choices, measured, costs = beams
    launch = next(launch for launch in trace.launches if launch.is_graph)
    paired = node_durations(chain, launch.ops, choices, "t")
    assert paired.executions == len(launch.ops) == 22407
    assert paired.renamed == 13923  # of 21,105 kernel records of the body: other graphs' names
    by_name = Durations.from_trace(trace, "t")
    alone = dataclasses.replace(by_name, graph_gap=None)
    # Priced by name, the loop's kernels come out 18% short of what they took; by position,
    # within 4% (the rest: the gap a node adds, below).
    short = run_graph(chain, alone, costs, choices).gpu_time / measured["chain"] - 1
    placed = run_graph(chain, dataclasses.replace(alone, nodes=paired.table), costs,
                       choices).gpu_time / measured["chain"] - 1
    assert short < -0.15 and -0.05 < placed < 0


def test_the_dag_is_predicted_from_the_chain_s_trace_and_timed_launch_within_5_percent(beams):
    """The what-if of grape.generate(concurrent=True): measured 891.9 us a token against the
    chain's 974.8 (H200, one process, alternating); predicted 1.8% fast."""
    from grape.sim.graph import calibrated_gap

    chain, dag, trace, choices, measured, costs = beams
    launch = next(launch for launch in trace.launches if launch.is_graph)
    durations = dataclasses.replace(Durations.from_trace(trace, "t"),
                                    nodes=node_durations(chain, launch.ops, choices, "t").table)
    timed = calibrated_gap(chain, durations, costs, choices, measured["chain"])
    predicted = run_graph(dag, timed, costs, choices).gpu_time
    assert abs(predicted / measured["dag"] - 1) < 0.05
    # The chain's own traced gap (0.42 us, 0.32 beyond CUPTI's) is not the unprofiled one:
    # at it the chain comes out 7.8% slow.
    traced = run_graph(chain, durations, costs, choices).gpu_time / measured["chain"] - 1
    assert traced > 0.05


def test_simulate_without_a_timed_launch_states_the_time_with_kernels_back_to_back(
        beams, capsys):
    """The chain from its own trace: at the trace's gap 7.8% slow, back to back 3.6% fast; the
    launch as timed lies between, and the output says both."""
    import re

    from grape.cli import main

    *_, measured, _ = beams
    assert main(["simulate", str(CONCURRENT / "gpt2_beam5_chain.ir.json.gz"), "--durations",
                 str(CONCURRENT / "gpt2_beam5_chain.kineto.json.gz")]) == 0
    out = capsys.readouterr().out
    assert "WHILE iterations as" in out and "grape:while=63" in out  # read by count
    high, low = map(float, re.search(r"GPU time per launch +([\d.]+) ms \(at the trace's gap; "
                                     r"([\d.]+) with kernels back to back", out).groups())
    assert low * 1000 < measured["chain"] < high * 1000
