"""The traces and device profile recorded on the H200 are golden files: each must read, and
say what traces/README.md says it does."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from grape.profile import CONSTANTS, DEFAULT_PROFILE, load_profile
from grape.sim.validate import FAMILY_SUFFIX, IR_SUFFIX, RAW_SUFFIX
from grape.trace import read_trace

TRACES = Path(__file__).resolve().parent.parent / "traces"
RECORDED = sorted((TRACES / "h200").glob("*.json.gz"))
RAW = sorted(TRACES.rglob(f"*{RAW_SUFFIX}"))
GRAPHS = sorted(TRACES.rglob(f"*{IR_SUFFIX}"))
# grape's own executions (benchmarks/ir_twin.py): torch.profiler traces of a few launches, kept
# for their kernels' durations beside the kernel graphs they ran.
TWINS = sorted((TRACES / "h200_ir").glob("twin_*.kineto.json.gz"))
# Saved graph families (grape.familyio), kept for the CPU benchmarks of a family's host work.
FAMILIES = sorted(TRACES.rglob(f"*{FAMILY_SUFFIX}"))
# The caching allocator's histories around captures (benchmarks/pool_layout.py), which
# tests/test_sim_memory.py replays through grape.sim.memory.Pool.
HISTORIES = sorted(TRACES.rglob("*.histories.json.gz"))
# One launch of a device loop each, its chain's IR beside it (benchmarks/concurrent_step.py):
# read by tests/test_sim_traced_durations.py.
LOOPS = sorted((TRACES / "h200_concurrent").glob("*.kineto.json.gz"))
ALL = sorted(p for p in TRACES.rglob("*.json.gz")
             if p not in RAW and p not in GRAPHS and p not in TWINS and p not in FAMILIES
             and p not in HISTORIES and p not in LOOPS)
# Kernels per iteration, by trace: a GPT-2 family trace steps through lengths, across the
# topology change at KV 512; the other traces repeat one step.
KERNELS = {"gpt2_small_family_b1": {292, 316}, "gpt2_small_family_b5": {292, 316},
           "gpt2_small_family_b1_whole": {292, 316}, "gpt2_small_family_b1_device": {292, 316},
           "wav2vec2_base_family": {481}, "gpt2_small_greedy_b1": {337},
           "gpt2_small_greedy_b8": {336}}
# Traces of three iterations whose step runs fewer than a hundred kernels.
SMALL = {"two_streams_b64_w4096_d8": 33}


def test_the_suite_is_committed():
    names = {p.name.split(".")[0] for p in RECORDED}
    assert len(RECORDED) == 38 and len(names) == 19
    for model in ("gpt2_small", "gpt2_medium"):
        for batch in (1, 8):
            for kv in (32, 128, 512, 1000):
                assert f"{model}_decode_b{batch}_kv{kv}" in names
    assert {f"wav2vec2_base_forward_{n}" for n in (16000, 64000, 160000)} <= names


@pytest.mark.parametrize("path", GRAPHS, ids=lambda p: p.name)
def test_every_committed_kernel_graph_reads_and_validates(path):
    from grape.ir import KernelGraph

    graph = KernelGraph.load(path)
    graph.validate()
    assert sum(1 for _ in graph.kernels()) > 0


@pytest.mark.parametrize("path", FAMILIES, ids=lambda p: p.name)
def test_every_committed_family_loads_and_validate_skips_it(path):
    from grape.familyio import load_family
    from grape.profile import DEFAULT_PROFILE, load_profile
    from grape.sim.validate import validate

    saved = load_family(path)
    assert saved.templates and saved.members
    assert all(key in saved.templates for key, _ in saved.members.values())
    said: list[str] = []
    assert validate([path], load_profile(DEFAULT_PROFILE), said.append) == []
    assert said == [f"skipped {path}: a saved graph family, not a recorded run"]


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.name)
def test_every_committed_allocator_history_reads(path):
    from grape.passes.places import History

    with gzip.open(path, "rt") as f:
        data = json.load(f)
    assert data["device"] == "NVIDIA H200" and data["command"].startswith("benchmarks/")
    histories = [History.of_json(h) for h in data["histories"].values()]
    assert histories and all(len(h) and len(h.placed()) == len(h) for h in histories)


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_every_committed_trace_reads(path):
    t = read_trace(path)
    name = path.name.split(".")[0]
    kernels = {len(it.kernels) for it in t.iterations}
    if name in KERNELS:
        assert len(t.iterations) == 32 and kernels == KERNELS[name]
    elif name in SMALL:
        assert len(t.iterations) == 3 and kernels == {SMALL[name]}
    else:
        assert len(t.iterations) == 3 and len(kernels) == 1 and kernels.pop() > 100
    assert not t.orphans


@pytest.mark.parametrize("path", TWINS, ids=lambda p: p.name)
def test_each_twin_recording_times_every_kernel_of_its_graph(path):
    from grape.ir import Conditional, Kernel, KernelGraph
    from grape.sim.graph import Durations

    def kernels_of(graph):  # bodies of conditional nodes included
        for node, op in graph.ops():
            if isinstance(op, Kernel):
                yield node, op
            elif isinstance(op, Conditional):
                for body in op.bodies:
                    yield from kernels_of(body)

    graph = KernelGraph.load(path.with_name(path.name.replace(".kineto.", ".ir.")))
    durations = Durations.from_ops(read_trace(path).gpu_ops, path.name)
    kernels = list(kernels_of(graph))
    assert len(kernels) > 300
    for node, kernel in kernels:
        assert durations.kernel(kernel, node) > 0


@pytest.mark.parametrize("path", RAW, ids=lambda p: p.name)
def test_raw_profiler_exports_open_as_chrome_traces(path):
    """Work launched by cuda-python (a device loop, a family's updated executable) as
    torch.profiler saw it: kernels with no host call that launched them (the driver calls are
    not recorded), and for a device loop the note of how it was cut."""
    doc = json.loads(gzip.decompress(path.read_bytes()))
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    launches = [e for e in doc["traceEvents"] if e.get("cat") == "cuda_runtime"
                and "Launch" in e["name"]]
    assert kernels and not launches
    if ".device_loop." in path.name:
        kept = re.search(r"first (\d+) of 127 loop iterations", doc["grape_note"])
        assert kept is not None
        assert sum(e["name"] == "grape_while_bounded" for e in kernels) == int(kept.group(1))
    else:  # a family over 31 KV lengths, across the topology change at 512
        assert len(kernels) == 9700


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.name)
def test_recorded_traces_carry_their_measurement(path):
    t = read_trace(path)
    workload, mode = path.name.split(".")[:2]
    assert (t.grape.workload, t.grape.mode) == (workload, mode)
    assert t.grape.device == "NVIDIA H200" and len(t.grape.wall_time_us) == 30
    assert t.split_method == "3 ProfilerStep annotations"
    graph_launches = [len(it.graph_launches) for it in t.iterations]
    assert graph_launches == ([1, 1, 1] if mode == "graph" else [0, 0, 0])


@pytest.mark.parametrize("batch", [1, 5])
def test_family_traces_carry_the_family_beside_them(batch):
    t = read_trace(TRACES / "h200_families" / f"gpt2_small_family_b{batch}.graph.json.gz")
    assert len(t.grape.wall_time_us) == 32 and t.grape.iterations == 32
    assert all(len(it.graph_launches) == 1 for it in t.iterations)
    c = t.grape.counters
    assert c["shapes"] == 128 and c["topologies"] == 2
    assert c["naive_graph_bytes"] > 40 * c["family_graph_bytes"] > 0
    assert 0 < c["changed_nodes_per_step"] < c["nodes"]


@pytest.mark.parametrize("workload", sorted({p.name.split(".")[0] for p in RECORDED}))
def test_graphed_runs_more_kernels_and_is_not_slower(workload):
    eager = read_trace(TRACES / "h200" / f"{workload}.eager.json.gz")
    graph = read_trace(TRACES / "h200" / f"{workload}.graph.json.gz")
    assert len(graph.iterations[0].kernels) > len(eager.iterations[0].kernels)
    # Measured on the H200, side by side; GPU-bound Wav2Vec2 runs tie within 5%.
    assert graph.grape.wall_time_median_us < 1.05 * eager.grape.wall_time_median_us


def test_device_profile_holds_every_constant():
    profile = load_profile(DEFAULT_PROFILE)
    assert profile.device == "NVIDIA H200"
    values = {name: profile.get(name) for name in CONSTANTS}
    assert 1 < values["eager_launch"] < values["torch_launch"] < 50
    assert 0 < values["graph_gpu_per_node"] < 5
    assert 1000 < values["copy_bandwidth"] < 10_000  # GB/s, read plus write
    assert 500 < values["executable_bytes_per_node"] < 20_000
