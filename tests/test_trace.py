from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import pytest

from grape.errors import (
    EmptyTraceError,
    IterationError,
    SchemaVersionError,
    TraceFormatError,
)
from grape.trace import GrapeMeta, read_trace, write_trace

TRACES = Path(__file__).resolve().parent.parent / "traces"
EAGER = TRACES / "gpt2_small_decode_b1_past64.eager.kineto.json.gz"
GRAPH = TRACES / "gpt2_small_decode_b1_past64.graph.kineto.json.gz"

META = GrapeMeta(workload="gpt2_small_decode_b1_past64", mode="eager", device="NVIDIA H200",
                 driver="580.159.04", libraries={"torch": "2.11.0+cu130"},
                 wall_time_us=(42740.0, 42700.5))


# --- the H200 samples ----------------------------------------------------------------------------


def test_eager_sample_holds_three_iterations_of_247_kernels(eager_trace):
    t = eager_trace
    assert [len(it.kernels) for it in t.iterations] == [247, 247, 247]
    assert "repeating launch sequence" in t.split_method
    assert t.streams == [(0, 7)]
    assert not any(it.graph_launches for it in t.iterations)
    # Every kernel belongs to exactly one iteration, each to its own launch call.
    assert sum(len(it.kernels) for it in t.iterations) == len(t.gpu_ops) == 741
    assert not t.orphans and not t.unknown
    # The profiling harness synchronised twice after the last step; no step synchronised.
    assert [c.name for c in t.outside] == ["cudaDeviceSynchronize"] * 2
    assert all(not it.syncs for it in t.iterations)


def test_eager_iterations_start_where_the_forward_call_starts(eager_trace):
    its = eager_trace.iterations
    for prev, it in itertools.pairwise(its):
        assert prev.end <= it.start
        # Each step opens with the same host-only work before its first launch.
        first_launch = it.launches[0].call.ts
        inside = [c.name for c in it.calls if c.ts < first_launch]
        assert inside == ["cudaStreamIsCapturing"]
    for it in its:
        assert it.gpu_busy_time < it.gpu_span < it.host_time
        assert 0 < it.host_launch_time < it.host_time


def test_graph_sample_is_three_launches_of_290_kernels(graph_trace):
    t = graph_trace
    assert len(t.iterations) == 3
    for it in t.iterations:
        (launch,) = it.launches
        assert launch.is_graph and launch.call.name == "cudaGraphLaunch"
        assert len(launch.ops) == 290
        assert {op.correlation for op in launch.ops} == {launch.call.correlation}


def test_explicit_iteration_count(tmp_path):
    assert len(read_trace(EAGER, iterations=1).iterations) == 1
    assert [len(it.kernels) for it in read_trace(EAGER, iterations=3).iterations] == [247] * 3
    with pytest.raises(IterationError, match="741 launches to divide into 2 equal iterations, "
                                             "found a remainder of 1"):
        read_trace(EAGER, iterations=2)


# --- grape's own traces --------------------------------------------------------------------------


@pytest.mark.parametrize("source", [EAGER, GRAPH])
def test_written_trace_reads_back_the_same(tmp_path, source):
    t = read_trace(source)
    out = write_trace(tmp_path / "t.json.gz", t, META)
    back = read_trace(out)
    assert back.grape == META
    assert back.split_method == "3 ProfilerStep annotations"
    assert back.gpu_ops == t.gpu_ops and back.calls == t.calls and back.ops == t.ops
    for a, b in zip(t.iterations, back.iterations, strict=True):
        assert (a.start, a.end, a.launches, a.calls) == (b.start, b.end, b.launches, b.calls)
    # Reproducible bytes: the same trace written twice is the same file.
    again = write_trace(tmp_path / "u.json.gz", t, META)
    assert out.read_bytes() == again.read_bytes()


def test_written_trace_is_a_well_formed_chrome_trace(tmp_path, graph_trace):
    """What Perfetto's JSON importer needs: typed events, complete spans, paired flow arrows."""
    doc = json.loads(gzip.decompress(write_trace(tmp_path / "t.json.gz", graph_trace,
                                                 META).read_bytes()))
    events = doc["traceEvents"]
    assert doc["displayTimeUnit"] == "ms" and doc["grape"]["schema_version"] == 1
    for e in events:
        assert e["ph"] in "XMsf"
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], float)
    starts = {e["id"] for e in events if e["ph"] == "s"}
    finishes = {e["id"] for e in events if e["ph"] == "f"}
    assert starts == finishes == {it.launches[0].call.correlation
                                  for it in graph_trace.iterations}
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert (0, "GPU 0") in names


# --- synthetic traces ----------------------------------------------------------------------------


def _x(name, cat, ts, dur, corr=None, **args):
    a = dict(args)
    if corr is not None:
        a["correlation"] = corr
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
            "args": a}


def _step(t0: float, corr: int) -> list[dict]:
    """One iteration: a host-only op, an op launching one kernel, a trailing host-only op."""
    return [
        _x("aten::view", "cpu_op", t0, 2),
        _x("aten::mm", "cpu_op", t0 + 3, 10),
        _x("cudaLaunchKernel", "cuda_runtime", t0 + 4, 5, corr),
        _x("gemm", "kernel", t0 + 8, 20, corr, stream=7, grid=[4, 1, 1], block=[128, 1, 1]),
        _x("aten::detach", "cpu_op", t0 + 14, 1),
    ]


def _write(tmp_path, events, name="t.json", **top) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events, **top}))
    return path


def test_host_only_work_goes_to_the_iteration_it_precedes(tmp_path):
    events = [_x("cudaGetDevice", "cuda_runtime", 0, 1)]  # set-up before the first step
    for i in range(3):
        events += _step(100 + 50 * i, corr=i)
    events.append(_x("cudaDeviceSynchronize", "cuda_runtime", 300, 5))
    t = read_trace(_write(tmp_path, events))
    assert [(it.start, it.end) for it in t.iterations] == [(100, 115), (150, 165), (200, 215)]
    assert [c.name for c in t.outside] == ["cudaGetDevice", "cudaDeviceSynchronize"]


def test_profiler_steps_decide_iterations(tmp_path):
    events = []
    for i in range(2):
        events.append(_x(f"ProfilerStep#{i}", "user_annotation", 100 * i, 90))
        events += _step(100 * i + 10, corr=i)
    # A launch after the last step is in no iteration: the annotations say where steps are.
    events += _step(500, corr=9)
    t = read_trace(_write(tmp_path, events))
    assert t.split_method == "2 ProfilerStep annotations"
    assert [(it.start, it.end, len(it.kernels)) for it in t.iterations] == [(0, 90, 1),
                                                                             (100, 190, 1)]


def test_multi_stream_copies_and_memsets_are_kept(tmp_path):
    events = [
        _x("cudaMemcpyAsync", "cuda_runtime", 0, 3, 1),
        _x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 5, 4, 1, stream=13, bytes=4096),
        _x("cudaMemsetAsync", "cuda_runtime", 6, 2, 2),
        _x("Memset (Device)", "gpu_memset", 10, 1, 2, stream=7, bytes=64),
        _x("cudaStreamSynchronize", "cuda_runtime", 9, 8),
    ]
    t = read_trace(_write(tmp_path, events))
    (it,) = t.iterations
    assert [(op.kind, op.stream, op.bytes) for op in it.gpu_ops] == [("memcpy", 13, 4096),
                                                                     ("memset", 7, 64)]
    assert t.streams == [(0, 7), (0, 13)]
    assert [c.name for c in it.syncs] == ["cudaStreamSynchronize"]


def test_unknown_categories_are_counted_not_dropped_silently(tmp_path):
    events = _step(0, 1) + [_x("mystery", "cuda_sync", 3, 1), _x("x", "cuda_sync", 4, 1)]
    assert read_trace(_write(tmp_path, events)).unknown == {"cuda_sync": 2}


# --- bad input -----------------------------------------------------------------------------------


def _bad(tmp_path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("name, data, error, message", [
    ("t.json", b'{"traceEvents": [{"ph": "X", ', TraceFormatError,
     "expected JSON, found .* the file looks truncated"),
    ("t.json", b"{not json}", TraceFormatError, "expected JSON, found 'expecting property name"),
    ("t.json.gz", b'{"traceEvents": []}', TraceFormatError,
     r"expected gzip data \(the name ends in .gz\)"),
    ("t.json.gz", gzip.compress(b'{"traceEvents": [' * 50)[:-12], TraceFormatError,
     "expected a complete gzip stream"),
    ("t.json", b"\xff\xfe\x00binary", TraceFormatError, "expected UTF-8 JSON text"),
    ("t.json", b'{"events": []}', TraceFormatError,
     r"expected a Chrome trace \(an object with 'traceEvents' or a list of events\)"),
    ("t.json", b'{"schemaVersion": 9, "traceEvents": []}', SchemaVersionError,
     "expected Kineto schemaVersion 1, found 9"),
    ("t.json", b'{"traceEvents": [], "grape": {"schema_version": 2}}', SchemaVersionError,
     "expected grape trace schema version 1, found 2"),
    ("t.json", b'{"traceEvents": [], "grape": {"schema_version": 1}}', TraceFormatError,
     "expected the grape block's 'workload' to be a string, found 'nothing'"),
    ("t.json", b'{"traceEvents": [3]}', TraceFormatError,
     "expected trace events to be objects, found int at index 0"),
    ("t.json", b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1}]}',
     TraceFormatError, r"event 0 \('kernel' 'k'\): expected 'dur' a duration in microseconds, "
                       r"a number from 0 to 2\*\*53, found nothing"),
    ("t.json", json.dumps({"traceEvents": [_x("aten::mm", "cpu_op", 0, 5)]}).encode(),
     EmptyTraceError, "expected GPU work launched from the host, found none"),
    ("t.json", json.dumps({"traceEvents": [_x("k", "kernel", 0, 5, 3, stream=7)]}).encode(),
     EmptyTraceError, r"found none \(1 GPU operations had no host call\)"),
])
def test_bad_traces_give_one_line_naming_the_file(tmp_path, name, data, error, message):
    path = _bad(tmp_path, name, data)
    with pytest.raises(error, match=message) as info:
        read_trace(path)
    assert str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(TraceFormatError, match="nope.json: expected a readable file, found No "
                                               "such file or directory"):
        read_trace(tmp_path / "nope.json")


def _one_kernel(**change) -> list[dict]:
    """A one-launch trace whose kernel event has ``change`` applied (``...`` deletes a key)."""
    events = _step(0, 1)
    kernel = events[3]
    for key, value in change.items():
        target, key = (kernel["args"], key[5:]) if key.startswith("args_") else (kernel, key)
        if value is ...:
            del target[key]
        else:
            target[key] = value
    return events


# What a mutation fuzzer found reaching past the readers (issue 13), and values a reader must not
# take as numbers: each is refused where it is read, in one line naming the event and field.
@pytest.mark.parametrize("change, message", [
    (dict(args_correlation=[1]), r"expected args.'correlation' an integer, found \[1\]"),
    (dict(args=7), r"expected 'args' an object, found 7"),
    (dict(name=["gemm"]), r"expected 'name' a string, found \['gemm'\]"),
    (dict(cat=["kernel"]), r"expected 'cat' a string, found \['kernel'\]"),
    (dict(dur=-5), r"expected 'dur' a duration in microseconds, a number from 0 to 2\*\*53, "
                   r"found -5"),
    (dict(dur=float("nan")), r"expected 'dur' a duration .*, found nan"),
    (dict(dur="5"), r"expected 'dur' a duration .*, found '5'"),
    (dict(dur=True), r"expected 'dur' a duration .*, found True"),
    (dict(ts=1e300), r"expected 'ts' a timestamp in microseconds, a number from -9.0072e\+15 "
                     r"to 2\*\*53, found 1e\+300"),
    (dict(ts=None), r"expected 'ts' a timestamp .*, found None"),
    (dict(ts=...), r"expected 'ts' a timestamp .*, found nothing"),
    (dict(args_stream="7"), r"expected args.'stream' an integer, found '7'"),
    (dict(args_grid=[4, 1]), r"expected args.'grid' three positive integers, found \[4, 1\]"),
    (dict(args_device=-1), r"expected args.'device' an integer of at least 0, found -1"),
    (dict(args_correlation=None), r"expected args.'correlation' an integer, found None"),
    (dict(args_correlation=...), r"expected args.'correlation' an integer, found nothing"),
])
def test_malformed_event_fields_are_refused_where_read(tmp_path, change, message):
    path = _write(tmp_path, _one_kernel(**change))
    with pytest.raises(TraceFormatError, match=message) as info:
        read_trace(path)
    assert str(info.value).startswith(f"{path}: event 3 (")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("top, message", [
    (dict(deviceProperties={"0": {"name": "H200"}}),
     r"expected 'deviceProperties' a list of objects, found \{'0'"),
    (dict(deviceProperties=3.5), r"expected 'deviceProperties' a list of objects, found 3.5"),
    (dict(deviceProperties="H200"), r"expected 'deviceProperties' a list of objects"),
    (dict(deviceProperties=[{"name": 7}]), r"expected the device's 'name' a string, found 7"),
    (dict(cuda_driver_version=[13000]), r"expected 'cuda_driver_version' an integer or a string"),
    (dict(schemaVersion=True), r"expected Kineto schemaVersion 1, found True"),
    (dict(grape={**META.to_json(), "mode": ["eager"]}),
     r"expected the grape block's 'mode' to be a string, found \['eager'\]"),
    (dict(grape={**META.to_json(), "wall_time_us": [float("nan")]}),
     r"'wall_time_us' to be a list of positive, finite microseconds, found \[nan\]"),
    (dict(grape={**META.to_json(), "wall_time_us": ["5"]}),
     r"'wall_time_us' to be a list of positive, finite microseconds"),
    (dict(grape={**META.to_json(), "counters": {"nodes": float("inf")}}),
     r"'counters' to be an object of finite numbers"),
    (dict(grape={**META.to_json(), "iterations": 0}), r"'iterations' to be a positive integer"),
    (dict(grape={**META.to_json(), "extra": 1}), r"expected grape block fields among"),
])
def test_malformed_trace_metadata_is_refused(tmp_path, top, message):
    path = _write(tmp_path, _step(0, 1), **top)
    with pytest.raises((TraceFormatError, SchemaVersionError), match=message) as info:
        read_trace(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)


def _launches(t0: float, corr: int, kernels: list[str]) -> list[dict]:
    """One iteration launching ``kernels`` in turn, each from its own operator."""
    events = []
    for i, name in enumerate(kernels):
        ts, c = t0 + 20 * i, corr + i
        events += [_x("aten::op", "cpu_op", ts, 10),
                   _x("cudaLaunchKernel", "cuda_runtime", ts + 1, 5, c),
                   _x(name, "kernel", ts + 4, 8, c, stream=7, grid=[1, 1, 1],
                      block=[32, 1, 1])]
    return events


STEP = ["embed", "gemv", "add", "gemv", "softmax", "gemv", "add", "gemv", "norm", "gemv",
        "argmax"]


def test_a_first_iteration_whose_library_picked_another_kernel_is_still_one_of_four(tmp_path):
    first = ["gemv_first_call" if i == 1 else k for i, k in enumerate(STEP)]
    events = []
    for i, kernels in enumerate([first, STEP, STEP, STEP]):
        events += _launches(1000 * i, 100 * i, kernels)
    t = read_trace(_write(tmp_path, events))
    assert len(t.iterations) == 4 and t.split_warning is None
    assert "iteration 0 launched other kernels in places" in t.split_method
    assert [k.name for k in t.iterations[0].kernels][1] == "gemv_first_call"


def test_two_iterations_that_differ_are_not_taken_for_a_repeat(tmp_path):
    # With two blocks there is no majority to tell the odd one: one iteration, no guess.
    other = ["gemv_first_call" if i == 1 else k for i, k in enumerate(STEP)]
    events = _launches(0, 0, other) + _launches(1000, 100, STEP)
    t = read_trace(_write(tmp_path, events))
    assert len(t.iterations) == 1 and "no repeating launch sequence" in t.split_method


def test_one_iteration_that_obviously_repeats_is_flagged_with_what_to_do(tmp_path, capsys):
    from grape.cli import main

    events = _launches(0, 0, ["warm_up"])  # one extra launch before three iterations
    for i in range(3):
        events += _launches(1000 * (i + 1), 100 * (i + 1), STEP)
    path = _write(tmp_path, events)
    t = read_trace(path)
    assert len(t.iterations) == 1
    assert t.split_warning.endswith("found one iteration of 34 launches, though its last 3 x "
                                    "11 launches repeat: split it with --iterations N (N "
                                    "dividing 34), or record torch.profiler's step "
                                    "annotations (its schedule)")
    assert main(["info", str(path)]) == 0
    assert "grape: warning:" in capsys.readouterr().err
    assert main(["simulate", str(path), "--iterations", "2"]) == 0
    captured = capsys.readouterr()
    assert "2 iterations" in captured.out and "warning" not in captured.err


# --- grape's own driver calls, which torch.profiler does not record --------------------------


def _grape_launches(t0: float, corr: int, kernels: int = 3) -> list[dict]:
    """A grape launch as the profiler records it: grape's annotation of the driver call, and
    the graph's kernels under a correlation no recorded call has (CUPTI's count from 1)."""
    return [_x("aten::add", "cpu_op", t0, 1),
            _x("cudaLaunchKernel", "cuda_runtime", t0 + 1, 2, corr + 1000),
            _x("add", "kernel", t0 + 2, 1, corr + 1000, stream=7),
            _x("grape:cuGraphExecKernelNodeSetParams", "user_annotation", t0 + 4, 1),
            _x("grape:cuGraphLaunch", "user_annotation", t0 + 6, 3)] + [
        _x(f"k{i}", "kernel", t0 + 10 + 2 * i, 1, corr, stream=7) for i in range(kernels)]


def test_grape_s_marked_launches_take_the_gpu_work_they_caused(tmp_path):
    events = [e for i in range(3) for e in _grape_launches(100 * i, corr=i + 1)]
    t = read_trace(_write(tmp_path, events))
    assert not t.orphans
    graphs = [launch for launch in t.launches if launch.is_graph]
    assert [(g.call.name, g.call.category, len(g.ops)) for g in graphs] == [
        ("cuGraphLaunch", "driver", 3)] * 3
    assert [c.name for c in t.calls].count("cuGraphExecKernelNodeSetParams") == 3
    assert not any(op.name.startswith("grape:") for op in t.ops)  # calls now, not operators
    assert len(t.iterations) == 3
    written = read_trace(write_trace(tmp_path / "w.json.gz", t, META))
    assert [len(g.ops) for g in written.launches if g.is_graph] == [3, 3, 3]
    assert written.calls == t.calls and not written.orphans


def test_marked_launches_that_do_not_pair_with_the_orphaned_work_leave_it_orphaned(tmp_path):
    events = [e for i in range(2) for e in _grape_launches(100 * i, corr=i + 1)]
    events.append(_x("stray", "kernel", 400, 1, 77, stream=7))  # a third group, two launches
    t = read_trace(_write(tmp_path, events))
    assert not [launch for launch in t.launches if launch.is_graph]
    assert len(t.orphans) == 7
    assert [c.name for c in t.calls].count("cuGraphLaunch") == 2  # the calls are kept


def test_a_conditional_body_s_work_under_correlation_0_joins_the_launch_before_it(tmp_path):
    # On an H100 CUPTI gave a device loop's body kernels correlation 0 and the graph's others
    # the launch's own: each launch keeps both, in the order they ran.
    events = []
    for i in range(2):
        events += _grape_launches(100 * i, corr=i + 1, kernels=2)
        events += [_x(f"body{j}", "kernel", 100 * i + 20 + 2 * j, 1, 0, stream=7)
                   for j in range(4)]
    t = read_trace(_write(tmp_path, events))
    graphs = [launch for launch in t.launches if launch.is_graph]
    assert not t.orphans
    assert [[op.name for op in g.ops] for g in graphs] == [
        ["k0", "k1", "body0", "body1", "body2", "body3"]] * 2


def test_a_pytorch_replay_s_conditional_body_under_correlation_0_joins_its_launch(tmp_path):
    # torch's CUDAGraph.replay of a graph with an IF node (grape.torch.control): the runtime's
    # launch call has the graph's kernels, the body's come under 0; an eager kernel after.
    events = [_x("cudaGraphLaunch", "cuda_runtime", 0, 5, 11),
              _x("top", "kernel", 6, 2, 11, stream=7),
              _x("body", "kernel", 9, 2, 0, stream=40),
              _x("cudaLaunchKernel", "cuda_runtime", 20, 3, 12),
              _x("eager", "kernel", 24, 2, 12, stream=7)]
    t = read_trace(_write(tmp_path, events))
    assert not t.orphans
    assert [[op.name for op in launch.ops] for launch in t.launches] == [["top", "body"],
                                                                         ["eager"]]


def test_work_under_correlation_0_stays_orphaned_where_the_launches_do_not_pair(tmp_path):
    events = _grape_launches(100, corr=1) + [_x("stray", "kernel", 400, 1, 77, stream=7),
                                             _x("body", "kernel", 120, 1, 0, stream=7)]
    t = read_trace(_write(tmp_path, events))
    assert not [launch for launch in t.launches if launch.is_graph]
    assert sorted(op.name for op in t.orphans) == ["body", "k0", "k1", "k2", "stray"]


def test_the_committed_recordings_of_grape_s_own_launches_are_graph_launches():
    # benchmarks/ir_twin.py on the H200 marked each launch "grape launch N": five launches of a
    # GPT-2 decode step rebuilt by grape (342 kernels each) and of its device loop, whose
    # conditional body CUPTI reports once per launch (345 kernels over a 48 ms span).
    for name, kernels in (("twin_step", 342), ("twin_loop", 345)):
        t = read_trace(Path(__file__).resolve().parents[1] / "traces" / "h200_ir"
                       / f"{name}.kineto.json.gz")
        graphs = [launch for launch in t.launches if launch.is_graph]
        assert not t.orphans and [len(g.ops) for g in graphs] == [kernels] * 5
