"""Mutation fuzzing of every reader: each malformed document is read cleanly or refused.

Each sample is a committed document with one structural mutation (``tests/mutate.py``). It must
either go through what ``grape info``, ``simulate`` and ``validate`` do with finite results
everywhere, or raise a ``GrapeError``; anything else (a traceback, a NaN) fails the test with the
seed and sample index that reproduce it.

CI explores the same samples every run (seed 0); set ``GRAPE_FUZZ_SEED`` to explore others and
``GRAPE_FUZZ_SAMPLES`` to draw more (the trace samples are shared among the traces below).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from grape.cli import main
from grape.errors import GrapeError
from grape.ir import (
    Buffer,
    BufferRole,
    Conditional,
    ConditionalKind,
    Empty,
    EventRecord,
    EventWait,
    HandleRef,
    Kernel,
    KernelGraph,
    Memcpy,
    Memory,
    Memset,
    Param,
    Pointer,
    Span,
)
from grape.jsonio import dump_json, load_json
from grape.profile import DEFAULT_PROFILE, load_profile, profile_from_json
from grape.sim.engine import simulate
from grape.sim.validate import predictions
from grape.sim.whatif import costs_from_profile, graph_iterations, unprofiled_program
from grape.summary import graph_summary, profile_summary, trace_summary
from grape.trace import trace_from_json
from tests.mutate import mutant, paths

SEED = int(os.environ.get("GRAPE_FUZZ_SEED", "0"))
SAMPLES = int(os.environ.get("GRAPE_FUZZ_SAMPLES", "2000"))
TRACES = Path(__file__).resolve().parent.parent / "traces"
PROFILE = load_profile(DEFAULT_PROFILE)
COSTS = costs_from_profile(PROFILE)

# Three traces that between them hold every kind of record grape reads: a grape block with
# counters and a graph launch; two streams with CUPTI's stream-wait records; PyTorch operators
# and no grape block (torch.profiler's own export). Shares of the samples, by cost per sample.
FUZZED_TRACES = {
    "h200/gpt2_small_decode_b1_kv32.graph.json.gz": 0.5,
    "h200_second/wav2vec2_base_forward_16000.eager.json.gz": 0.4,
    "gpt2_small_decode_b1_past64.eager.kineto.json.gz": 0.1,
}


def _finite_json(data: Any) -> None:
    """``data`` as JSON, refusing NaN and infinities wherever they hide."""
    json.dumps(data, allow_nan=False)


def _trace_commands(doc: Any) -> None:
    """What ``grape info``, ``grape simulate --graph`` and ``grape validate`` do with one
    document, in process; every figure they produce must be finite."""
    trace = trace_from_json(doc, "mutant")
    _finite_json(trace_summary(trace).data)
    program = unprofiled_program(trace, PROFILE)
    results = [simulate(program, COSTS), simulate(graph_iterations(program, COSTS), COSTS)]
    for r in results:
        if not (math.isfinite(r.per_iteration) and math.isfinite(r.gpu_busy_fraction)):
            raise AssertionError(f"simulated {r.per_iteration} us per iteration, busy "
                                 f"{r.gpu_busy_fraction}")
    if trace.grape is not None and trace.grape.wall_time_us:
        for p in predictions(trace, PROFILE, costs=COSTS):
            if not math.isfinite(p.error):
                raise AssertionError(f"prediction {p} has error {p.error}")


def _ir_commands(doc: Any) -> None:
    """What ``grape info`` does with a kernel-graph file, and a JSON round trip."""
    graph = KernelGraph.from_json(doc)
    graph.validate()
    _finite_json(graph_summary(graph, "mutant").data)
    assert KernelGraph.from_json(json.loads(json.dumps(graph.to_json()))) == graph


def _profile_commands(doc: Any) -> None:
    profile = profile_from_json(doc, "mutant")
    _finite_json(profile_summary(profile).data)
    costs = costs_from_profile(profile)
    _finite_json(vars(costs))


def _fuzz(doc: Any, count: int, commands: Callable[[Any], None], seed: int = SEED) -> dict:
    """Run ``count`` mutants of ``doc`` through ``commands``; outcomes by kind, and the first
    few samples that neither succeeded nor raised a GrapeError."""
    places = list(paths(doc))
    outcomes = {"read": 0, "refused": 0}
    escaped: list[str] = []
    for index in range(count):
        sample, how = mutant(doc, seed, index, places=places)
        try:
            commands(sample)
            outcomes["read"] += 1
        except GrapeError as e:
            outcomes["refused"] += 1
            assert "\n" not in str(e), f"sample {index} ({how}): a multi-line error: {e}"
        except Exception as e:  # what the test exists to catch
            escaped.append(f"seed {seed} sample {index} ({how}): {type(e).__name__}: {e}"[:300])
    assert not escaped, f"{len(escaped)} of {count} mutants escaped: " + "; ".join(escaped[:5])
    return outcomes


@pytest.mark.parametrize("name, share", FUZZED_TRACES.items())
def test_mutated_traces_are_read_or_refused_with_a_grape_error(name, share):
    doc = load_json(TRACES / name)
    outcomes = _fuzz(doc, round(SAMPLES * share), _trace_commands)
    # Both outcomes occur: the mutations reach the readers' checks, and many mutants (a name
    # changed, an unknown argument) are still traces.
    assert outcomes["read"] > 0 and outcomes["refused"] > 0, outcomes


def _rich_graph() -> KernelGraph:
    """A small graph with every node kind, buffer role and kernel field the IR has."""
    g = KernelGraph()
    for i, role in enumerate(BufferRole):
        g.add_buffer(Buffer(f"b{i}", 4096, role, address=0x7F0000000000 + i * 4096))
    g.add_buffer(Buffer("host", 64, BufferRole.INPUT, Memory.HOST))
    args = bytes(range(40))
    setter = Kernel("mod:set", "set_condition", (1, 1, 1), (1, 1, 1), args=args,
                    params=(Param(0, 8), Param(8, 8), Param(16, 4)),
                    pointers=(Pointer(8, Span("b0", 16)),), handles=(HandleRef(0, "loop"),))
    body = KernelGraph()
    body.add("step", Kernel("mod:step", "step", (64, 1, 1), (128, 1, 1), 1024,
                            (("priority", 1), ("cluster_dim", (2, 1, 1))), args,
                            (Param(0, 8), Param(8, 8)), (Pointer(0, Span("b1")),
                                                         Pointer(8, Span("b2", 8)))))
    body.add("next", setter, after=["step"])
    g.add("copy", Memcpy(Span("b0"), Span("b1", 64), 256))
    g.add("zero", Memset(Span("b2"), 0, 4, 64))
    g.add("start", setter, after=["copy", "zero"])
    g.add("loop", Conditional(ConditionalKind.WHILE, "loop", (body,), 0), after=["start"])
    g.add("record", EventRecord("e0"), after=["loop"])
    g.add("wait", EventWait("e0"), after=["record"])
    g.add("join", Empty(), after=["wait"])
    g.validate()
    return g


# A graph grape captured on the H200 (GPT-2 small's decode step, benchmarks/soak.py --ir-out),
# and a small one with every node kind the IR has, which no capture so far produced.
CAPTURED_IR = TRACES / "h200_ir" / "gpt2_small_decode_step.ir.json.gz"


@pytest.mark.parametrize("source, share", [("captured", 0.05), ("every kind", 0.25)])
def test_mutated_kernel_graphs_are_read_or_refused_with_a_grape_error(source, share):
    doc = load_json(CAPTURED_IR) if source == "captured" else _rich_graph().to_json()
    outcomes = _fuzz(doc, max(round(SAMPLES * share), 1), _ir_commands)  # 60 ms per captured
    assert outcomes["read"] > 0 and outcomes["refused"] > 0, outcomes


def test_mutated_device_profiles_are_read_or_refused_with_a_grape_error():
    outcomes = _fuzz(load_json(DEFAULT_PROFILE), max(SAMPLES // 4, 1), _profile_commands)
    assert outcomes["read"] > 0 and outcomes["refused"] > 0, outcomes


def test_the_cli_on_mutated_traces_exits_cleanly(tmp_path, capsys):
    """Through the real commands: each mutant file gives exit 0 or a one-line error (exit 2),
    and one ``grape validate`` over all of them reports each bad file and goes on."""
    source = TRACES / "h200" / "gpt2_small_decode_b1_kv32.graph.json.gz"
    doc = load_json(source)
    places = list(paths(doc))
    refused = 0
    for index in range(40):
        sample, how = mutant(doc, SEED + 1, index, places=places)
        path = dump_json(tmp_path / f"m{index:02d}.graph.json.gz", sample)
        codes = {main(["info", str(path)]), main(["simulate", str(path), "--graph"])}
        out, err = capsys.readouterr()
        assert codes <= {0, 2}, f"sample {index} ({how}): exit codes {codes}"
        assert not re.search(r"\b(nan|inf)\b", out, re.IGNORECASE), f"sample {index} ({how})"
        assert all(line.startswith("grape ") for line in err.splitlines()), err
        refused += 2 in codes
    assert refused  # some mutants are unreadable, so validate below meets bad files
    code = main(["validate", str(tmp_path)])
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("grape validate: error: ")]
    # Every unreadable file is named, the readable ones are still predicted, and the run fails.
    assert code == 2 and len(errors) >= refused and "predictions" in out
    assert errors[-1].endswith("that could not be (each named above)")
