"""Programs from recorded traces, what-ifs on them, and validation against measurements."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from grape.cli import main
from grape.errors import GrapeError
from grape.profile import DEFAULT_PROFILE, load_profile
from grape.program import (
    GpuWork,
    GraphLaunch,
    HostWork,
    Launch,
    ProfilerOverhead,
    Program,
    StreamWait,
    Sync,
    program_from_trace,
)
from grape.sim.engine import Costs, simulate
from grape.sim.validate import validate
from grape.sim.whatif import (
    copy_into_placeholders,
    costs_from_profile,
    graph_iterations,
    graph_region,
    loop_on_device,
    scale_host,
    set_launch_cost,
    unprofiled_program,
    update_per_shape,
)
from grape.trace import GrapeMeta, read_trace, write_trace

TRACES = Path(__file__).resolve().parent.parent / "traces"
EAGER = TRACES / "h200" / "gpt2_small_decode_b1_kv128.eager.json.gz"
GRAPH = TRACES / "h200" / "gpt2_small_decode_b1_kv128.graph.json.gz"
SAMPLE = TRACES / "gpt2_small_decode_b1_past64.eager.kineto.json.gz"
PROFILE = load_profile(DEFAULT_PROFILE)


def test_eager_program_keeps_every_launch_and_every_microsecond():
    t = read_trace(EAGER)
    p = program_from_trace(t)
    for it, steps in zip(t.iterations, p.iterations, strict=True):
        launches = [s for s in steps if isinstance(s, Launch)]
        assert len(launches) == len(it.launches) == 247
        assert sum(len(s.work) for s in launches) == 247
        # Without a profiler correction, host work + call costs + sync waits fill the window
        # (to rounding: calls that overlap by a few nanoseconds in the trace are not doubled).
        waited = sum(c.dur for c in it.syncs)
        spent = sum(s.dur if isinstance(s, HostWork) else s.cost for s in steps)
        assert spent + waited == pytest.approx(it.host_time, abs=0.1)


def _removed_from_calls(calls, per_call):
    """Each top-level call loses per_call, or all it lasted where it was shorter."""
    removed, end = 0.0, float("-inf")
    for c in sorted(calls, key=lambda c: c.ts):
        if c.ts >= end:
            removed, end = removed + min(c.dur, per_call), c.end
    return removed


@pytest.mark.parametrize("path", [SAMPLE, EAGER], ids=["operators recorded", "CUDA only"])
def test_profiler_correction_takes_its_cost_out(path):
    t = read_trace(path)
    plain = simulate(program_from_trace(t)).iteration_times
    corrected = simulate(program_from_trace(t, ProfilerOverhead(1.0, 2.0))).iteration_times
    it = t.iterations[1]
    ops = sum(1 for o in t.ops if it.start <= o.ts < it.end)
    assert (ops > 0) == (path == SAMPLE)
    # Nested driver calls are part of their runtime call: the correction counts each call once.
    expected = ops + _removed_from_calls(it.calls, 2.0)
    assert plain[1] - corrected[1] == pytest.approx(expected, rel=0.05)


def test_graph_program_has_one_launch_of_the_captured_nodes():
    p = program_from_trace(read_trace(GRAPH))
    for steps in p.iterations:
        (launch,) = [s for s in steps if isinstance(s, GraphLaunch)]
        assert launch.nodes == 290 and 500 < launch.gpu_time < 2000
        assert any(isinstance(s, Sync) for s in steps)


def test_graphing_removes_host_work_and_keeps_gpu_work():
    costs = costs_from_profile(PROFILE)
    eager = program_from_trace(read_trace(EAGER))
    graphed = graph_iterations(eager, costs)
    for steps in graphed.iterations:
        launch, *rest = steps
        assert isinstance(launch, GraphLaunch) and launch.nodes == 247
        assert all(isinstance(s, Sync) for s in rest)
    eager_time = simulate(eager, costs).iteration_times[1]
    graph_time = simulate(graphed, costs).iteration_times[1]
    assert graph_time < eager_time / 5
    kernels = sum(w.dur for s in eager.iterations[1] if isinstance(s, Launch) for w in s.work)
    assert graph_time > kernels  # never faster than the kernels back to back


def test_host_what_ifs():
    costs = costs_from_profile(PROFILE)
    eager = program_from_trace(read_trace(EAGER))
    base = simulate(eager, costs).iteration_times[1]
    assert simulate(scale_host(eager, 0.5), costs).iteration_times[1] < 0.6 * base
    faster = simulate(set_launch_cost(eager, 0.0), costs).iteration_times[1]
    assert faster < base
    with pytest.raises(GrapeError, match="expected a finite, non-negative host scale, found -1"):
        scale_host(eager, -1)
    with pytest.raises(GrapeError, match="expected a finite, non-negative launch cost, found -2"):
        set_launch_cost(eager, -2)


def test_validate_predicts_both_questions(tmp_path):
    for path in (EAGER, GRAPH):
        shutil.copy(path, tmp_path)
    preds = validate(sorted(tmp_path.iterdir()), PROFILE)
    assert sorted(p.question for p in preds) == ["eager -> graph",
                                                 "eager -> graph, borrowed GPU time",
                                                 "replay eager", "replay graph"]
    what_if = next(p for p in preds if p.question == "eager -> graph")
    assert "capture runs 290 kernels against 247 eagerly" in what_if.note
    assert all(p.measured > 0 and p.predicted > 0 for p in preds)


def test_validate_command_exits_by_its_bounds(capsys, tmp_path):
    for path in (EAGER, GRAPH):
        shutil.copy(path, tmp_path)
    assert main(["validate", str(tmp_path), "--median-bound", "1000", "--max-bound",
                 "1000"]) == 0
    out = capsys.readouterr().out
    assert "median absolute error" in out and "4 predictions" in out
    with pytest.raises(SystemExit) as info:
        main(["validate", str(tmp_path), "--median-bound", "0", "--max-bound", "0"])
    assert info.value.code == 1


def test_validate_takes_trace_files_as_well_as_directories(capsys, tmp_path):
    for path in (EAGER, GRAPH):
        shutil.copy(path, tmp_path)
    files = sorted(str(p) for p in tmp_path.iterdir())
    assert main(["validate", *files, "--median-bound", "1000", "--max-bound", "1000"]) == 0
    assert "4 predictions" in capsys.readouterr().out
    # A path that is neither: said, not taken for a folder without traces.
    assert main(["validate", str(tmp_path / "missing.json.gz")]) == 2
    assert "expected directories or trace files, found nothing at" in capsys.readouterr().err


def test_simulate_command_prints_side_by_side_and_writes_a_grape_trace(capsys, tmp_path):
    out_path = tmp_path / "sim.json"
    assert main(["simulate", str(EAGER), "--graph", "--chrome", str(out_path)]) == 0
    out = capsys.readouterr().out
    assert "measured (no profiler)" in out and "predicted from the trace" in out
    assert "what if: graphed" in out and "critical path: GPU busy" in out
    assert "graph memory: one executable of 247 nodes" in out
    # The what-if's run as a grape trace: what grape reads recordings with reads it.
    simulated = read_trace(out_path)
    assert simulated.grape.mode == "simulated" and len(simulated.iterations) == 3
    assert simulated.device_name == PROFILE.device
    assert all(len(it.graph_launches) == 1 and it.syncs for it in simulated.iterations)
    assert main(["info", str(out_path)]) == 0
    assert "; simulated 0." in capsys.readouterr().out  # not "measured": nothing was


def test_a_simulated_trace_replayed_is_the_simulation_it_came_from(tmp_path):
    from grape.sim.tracing import write_simulated_trace

    program = unprofiled_program(read_trace(EAGER), PROFILE)
    costs = costs_from_profile(PROFILE)
    result = simulate(program, costs, record=True)
    path = write_simulated_trace(tmp_path / "eager.sim.json.gz", result, "gpt2", "H200")
    again = read_trace(path)
    assert len(again.iterations) == len(program.iterations)
    assert [len(it.kernels) for it in again.iterations] == [
        len(it.kernels) for it in read_trace(EAGER).iterations]
    (replay,) = [p for p in validate([path], PROFILE) if p.question.startswith("replay")]
    assert abs(replay.error) < 0.01, replay


def test_simulate_refuses_a_bad_profile(capsys, tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    assert main(["simulate", str(EAGER), "--profile", str(bad)]) == 2
    assert "expected a grape.device document" in capsys.readouterr().err


def test_a_device_loop_replaces_per_iteration_launches_and_syncs():
    costs = costs_from_profile(PROFILE)
    graphed = program_from_trace(read_trace(GRAPH))
    looped = loop_on_device(graphed, costs)
    (steps,) = looped.iterations
    assert [type(s).__name__ for s in steps] == ["GraphLaunch", "Sync"]
    per_step = sum(s.gpu_time for it in graphed.iterations for s in it
                   if isinstance(s, GraphLaunch))
    assert steps[0].gpu_time == pytest.approx(per_step + 3 * costs.while_per_iteration)
    assert simulate(looped, costs).end < simulate(graphed, costs).end
    with pytest.raises(GrapeError, match="expected one graph launch per iteration"):
        loop_on_device(program_from_trace(read_trace(EAGER)), costs)


def test_updating_one_executable_per_shape_costs_host_time_per_changed_node():
    costs = costs_from_profile(PROFILE)
    graphed = program_from_trace(read_trace(GRAPH))
    updated = update_per_shape(graphed, costs, changed_nodes=40)
    steps = updated.iterations[0]
    launch = next(i for i, s in enumerate(steps) if isinstance(s, GraphLaunch))
    assert steps[launch - 1] == HostWork(40 * costs.set_params)
    assert len(steps) == len(graphed.iterations[0]) + 1
    assert simulate(updated, costs).end > simulate(graphed, costs).end
    with pytest.raises(GrapeError, match="expected a finite, non-negative number of changed nodes"):
        update_per_shape(graphed, costs, -1)


def test_simulate_plots_a_timeline_and_a_what_if_curve(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    out = tmp_path / "sim.png"
    assert main(["simulate", str(EAGER), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert f"plot: {out}" in capsys.readouterr().out


def test_what_the_model_does_not_know_is_listed(tmp_path):
    events = json.loads(__import__("gzip").decompress(EAGER.read_bytes()))
    events["traceEvents"].append({"ph": "X", "cat": "cuda_sync", "name": "wait", "pid": 1,
                                  "tid": 1, "ts": 1.0, "dur": 1.0, "args": {}})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(events))
    p = program_from_trace(read_trace(path))
    assert p.approximations == ["1 trace events of category 'cuda_sync' are not modelled: "
                                "their time counts as host work"]


def test_graphing_a_region_keeps_the_rest_eager():
    costs = costs_from_profile(PROFILE)
    eager = program_from_trace(read_trace(EAGER))
    region = graph_region(eager, costs, 10, 109)
    assert len(region.iterations) == len(eager.iterations)
    for steps in region.iterations:
        launches = [s for s in steps if isinstance(s, Launch)]
        (graph,) = [s for s in steps if isinstance(s, GraphLaunch)]
        assert len(launches) == 247 - 100 and graph.nodes == 100
    full = simulate(eager, costs).iteration_times[1]
    part = simulate(region, costs).iteration_times[1]
    whole = simulate(graph_iterations(eager, costs), costs).iteration_times[1]
    assert whole < part < full
    with pytest.raises(GrapeError, match=r"expected a region of launches within 0..246 in "
                                         r"iteration 0, found 200..300"):
        graph_region(eager, costs, 200, 300)
    with pytest.raises(GrapeError, match="expected eager launches to graph in iteration 0, "
                                         "found none"):
        graph_region(program_from_trace(read_trace(GRAPH)), costs, 0, 1)


def test_simulate_refuses_a_malformed_region(capsys):
    assert main(["simulate", str(EAGER), "--graph-region", "ten:20"]) == 2
    assert "expected --graph-region A:B with launch numbers, found 'ten:20'" in (
        capsys.readouterr().err)


def test_graphing_a_graphed_program_changes_nothing():
    costs = costs_from_profile(PROFILE)
    graphed = program_from_trace(read_trace(GRAPH))
    assert graph_iterations(graphed, costs).iterations == graphed.iterations
    mixed = Program("m", [graphed.iterations[0] + (Launch("l", 1.0, ()),)])
    with pytest.raises(GrapeError, match="expected iteration 0 to be all eager or all graphed"):
        graph_iterations(mixed, costs)


def _per_iteration(out: str) -> dict[str, float]:
    """grape simulate's rows: label -> ms per iteration."""
    rows = {}
    for line in out.splitlines():
        if "ms per iteration" in line:
            label, value = line.split(" ms per")[0].rsplit(None, 1)
            rows[label.strip()] = float(value)
    return rows


def test_simulate_prices_a_family_update_per_launch(capsys):
    family = TRACES / "h200_families" / "gpt2_small_family_b1.graph.json.gz"
    assert main(["simulate", str(family), "--update-nodes", "100"]) == 0
    out = capsys.readouterr().out
    lines = _per_iteration(out)
    added = (lines["what if: 100 nodes updated per launch"]
             - lines["predicted from the trace"]) * 1000
    assert added == pytest.approx(100 * PROFILE.get("set_params"), rel=0.02)
    assert main(["simulate", str(EAGER), "--update-nodes", "3"]) == 2
    assert "expected graph launches to update per shape" in capsys.readouterr().err


def test_simulate_prices_a_loop_on_the_device(capsys):
    family = TRACES / "h200_families" / "gpt2_small_family_b1.graph.json.gz"
    assert main(["simulate", str(family), "--device-loop"]) == 0
    out = capsys.readouterr().out
    per = _per_iteration(out)
    # One launch and one sync for all 32 steps: no host gap between steps, a WHILE iteration's
    # cost instead; faster per step than a launch and a sync each.
    assert per["what if: one device loop"] < per["predicted from the trace"]
    assert "GPU busy 100.0%" in out
    assert main(["simulate", str(EAGER), "--device-loop"]) == 2
    assert "expected one graph launch per iteration" in capsys.readouterr().err


def test_simulate_prices_graphs_at_another_per_node_overhead(capsys):
    """The overhead moved between H200 machines (0.35 us per node, or none): a what-if for the
    trace's own graphs, and for graphs a what-if makes."""
    graphed = TRACES / "h200_predication" / "gpt2_small_greedy_b1.graph.json.gz"
    assert main(["simulate", str(graphed), "--node-overhead", "0"]) == 0
    per = _per_iteration(capsys.readouterr().out)
    saved = (per["predicted from the trace"] - per["what if: 0 us per graph node"]) * 1000
    nodes = 337  # kernels of this step's graph
    assert saved == pytest.approx(nodes * PROFILE.get("graph_node_overhead"), rel=0.02)
    assert main(["simulate", str(EAGER), "--graph", "--node-overhead", "0.5"]) == 0
    per = _per_iteration(capsys.readouterr().out)
    assert main(["simulate", str(EAGER), "--graph"]) == 0
    assert per["what if: 0.5 us per graph node, graphed"] > \
        _per_iteration(capsys.readouterr().out)["what if: graphed"]
    for bad in ("-1", "nan", "inf", "x"):
        with pytest.raises(SystemExit) as refused:
            main(["simulate", str(graphed), "--node-overhead", bad])
        assert refused.value.code == 2
        assert (f"argument --node-overhead: expected a finite, non-negative number, found "
                f"{bad!r}") in capsys.readouterr().err


def _fork_trace(tmp_path, wait_on_stream=-1):
    """One iteration: a on stream 7; an event recorded, stream 13 made to wait on it; b on 13
    starting on the GPU just after a ends; c on stream 14, issued before the record, which
    ended long before; then a device sync."""
    host, gpu = 1 << 20, 0

    def call(name, ts, dur, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": host, "tid": 1,
                "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def kernel(name, ts, dur, stream, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "pid": gpu, "tid": stream, "ts": ts,
                "dur": dur, "args": {"stream": stream, "correlation": corr, "device": 0}}

    events = [call("cudaLaunchKernel", 0, 4, 1), kernel("c", 8, 2, 14, 1),
              call("cudaLaunchKernel", 5, 4, 2), kernel("a", 12, 100, 7, 2),
              call("cudaEventRecord", 10, 2, 3),
              call("cudaStreamWaitEvent", 13, 2, 4),
              {"ph": "X", "cat": "cuda_sync", "name": "Stream Wait Event", "pid": gpu,
               "tid": 13, "ts": 14, "dur": 1,
               "args": {"stream": 13, "correlation": 4, "device": 0,
                        "wait_on_stream": wait_on_stream}},
              call("cudaLaunchKernel", 16, 4, 5), kernel("b", 113, 50, 13, 5),
              call("cudaDeviceSynchronize", 21, 150, 6)]
    path = tmp_path / "fork.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return read_trace(path, iterations=1)


def test_a_stream_wait_is_ordered_by_the_work_its_next_kernel_followed(tmp_path):
    trace = _fork_trace(tmp_path)
    p = program_from_trace(trace)
    assert [s for s in p.iterations[0] if isinstance(s, StreamWait)] == [StreamWait(13, 7)]
    assert p.approximations == ["1 stream waits ordered by the stream whose work their next "
                                "kernel followed on the GPU (the trace does not say where their "
                                "events were recorded)"]
    # b waits for a on the simulated GPU too: it ends after a's 100 us, not beside it.
    r = simulate(p, Costs(launch_latency=2, kernel_gap=0), timeline=True)
    ends = {i.name: i.end for i in r.intervals if i.track.startswith("stream")}
    starts = {i.name: i.start for i in r.intervals if i.track.startswith("stream")}
    assert starts["b"] == ends["a"]


def test_a_stream_wait_the_profiler_matched_names_its_stream(tmp_path):
    p = program_from_trace(_fork_trace(tmp_path, wait_on_stream=14))
    assert [s for s in p.iterations[0] if isinstance(s, StreamWait)] == [StreamWait(13, 14)]
    assert p.approximations == []


def test_stream_waits_without_the_profilers_records_are_reported(tmp_path):
    trace = _fork_trace(tmp_path)
    trace.waits = []
    p = program_from_trace(trace)
    assert not any(isinstance(s, StreamWait) for s in p.iterations[0])
    assert p.approximations == ["1 stream waits without the profiler's records of them: "
                                "streams run unordered (record with torch.profiler's "
                                "enable_cuda_sync_events, as grape record does)"]


def test_stream_waits_survive_writing_a_grape_trace(tmp_path):
    trace = _fork_trace(tmp_path)
    again = read_trace(write_trace(tmp_path / "t.json.gz", trace,
                                   GrapeMeta("fork", "eager", "H200", "580")))
    assert again.waits == trace.waits
    assert program_from_trace(again).iterations == program_from_trace(trace).iterations


def test_placeholder_copies_go_in_front_of_every_graph_launch():
    graph = GraphLaunch(cost=3, nodes=10, gpu_time=100, stream=7)
    p = Program("p", [(graph, Sync("s", 0))] * 2)
    costs = Costs(launch_latency=0, kernel_gap=0, copy_call=2, copy_latency=5,
                  copy_bandwidth=1)  # 1 GB/s: 1000 bytes per microsecond, read plus written
    copied = copy_into_placeholders(p, costs, 4000)
    steps = copied.iterations[0]
    assert [type(s).__name__ for s in steps] == ["Launch", "GraphLaunch", "Sync"]
    assert steps[0].cost == 2 and steps[0].work[0].dur == 5 + 2 * 4000 / 1000
    assert steps[0].work[0].stream == 7
    # the host pays the copy's call then the launch; the GPU, the copy then the graph
    assert simulate(copied, costs).iteration_times == [2 + 13 + 100] * 2
    assert simulate(p, costs).iteration_times == [3 + 100] * 2
    with pytest.raises(GrapeError, match="non-negative number of bytes"):
        copy_into_placeholders(p, costs, -1)


def test_simulate_prices_placeholder_copies(capsys):
    assert main(["simulate", str(GRAPH), "--placeholder-copies", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "what if: 1 GB copied in per launch" in out
    assert main(["simulate", str(EAGER), "--placeholder-copies", "100"]) == 2
    assert "expected graph launches to copy inputs in front of" in capsys.readouterr().err


def _kernel(stream, dur, name="k", share=1.0):
    return Launch("cudaLaunchKernel", 5.0, (GpuWork("kernel", name, dur, stream, share=share),))


def test_graphing_flags_what_a_capture_would_refuse_with_the_iterations():
    pageable = Launch("cudaMemcpyAsync", 5.0, (GpuWork(
        "memcpy", "Memcpy HtoD (Pageable -> Device)", 2.0, 7),))
    read_back = Launch("cudaMemcpyAsync", 5.0, (GpuWork(
        "memcpy", "Memcpy DtoH (Device -> Pageable)", 2.0, 7),))
    clean = (_kernel(7, 10.0), Sync("cudaStreamSynchronize", 1.0))
    syncing = (_kernel(7, 10.0), Sync("cudaStreamSynchronize", 1.0), _kernel(7, 10.0),
               Sync("cudaStreamSynchronize", 1.0))
    p = Program("p", [clean, (pageable, *clean), (pageable, *clean), clean, syncing,
                      (_kernel(7, 1.0), read_back, Sync("cudaStreamSynchronize", 1.0))])
    graphed = graph_iterations(p, Costs())
    assert graphed.blockers == [
        "a copy from pageable host memory (Memcpy HtoD (Pageable -> Device), cudaMemcpyAsync), "
        "in iterations 1-2",
        "a host sync (cudaStreamSynchronize) before the iteration's last launch, in iteration 4",
        "a copy to the host (Memcpy DtoH (Device -> Pageable), cudaMemcpyAsync), in iteration 5"]
    assert graph_iterations(Program("p", [clean]), Costs()).blockers == []


def test_a_graph_overlaps_streams_as_the_recorded_waits_allow():
    costs = Costs(graph_node_overhead=0.5)
    forked = (_kernel(7, 10.0), StreamWait(13, 7), _kernel(13, 30.0, share=0.25),
              _kernel(7, 20.0, share=0.5), StreamWait(7, 13), _kernel(7, 5.0),
              Sync("cudaStreamSynchronize", 1.0))
    graphed = graph_iterations(Program("p", [forked]), costs)
    (launch, _), = graphed.iterations
    # 13 waits for 7's first kernel (10.5), runs 30.5; 7 runs on (20.5) then waits for 13. The
    # two in the middle fit the GPU together, so neither slows the other.
    assert launch.gpu_time == pytest.approx(10.5 + 30.5 + 5.5)
    assert launch.nodes == 4
    assert graphed.approximations == []
    # Kernels that fill the GPU share it while they overlap: both at half pace until the 20 us
    # one ends (40 us), then the other's last 10 us alone.
    full = tuple(_kernel(s.work[0].stream, s.work[0].dur) if isinstance(s, Launch) else s
                 for s in forked)
    graphed = graph_iterations(Program("p", [full, full]), costs)
    (launch, _), _ = graphed.iterations
    assert launch.gpu_time == pytest.approx(10.5 + 0.5 + 40.0 + 10.0 + 0.5 + 5.0)
    # Said once, with the iterations and how much slower than overlapped at alone speed.
    assert graphed.approximations == [
        "iterations 0-1: branches on several streams priced as they share the GPU's SMs where "
        "they overlap, 43% slower than side by side at their alone speed (grape.sim.sharing; "
        "memory bandwidth and blocks sharing an SM are not modelled)"]
    (launch, _), = graph_iterations(Program("p", [full]), costs,
                                    branches="overlapped").iterations
    assert launch.gpu_time == pytest.approx(10.5 + 30.5 + 5.5)
    unordered = tuple(s for s in forked if not isinstance(s, StreamWait))
    graphed = graph_iterations(Program("p", [unordered]), costs)
    assert graphed.iterations[0][0].gpu_time == pytest.approx(10.5 + 30.5 + 20.5 + 5.5)
    assert "no stream waits" in graphed.approximations[-1]


def test_the_what_if_chain_applies_in_order_and_refuses_what_does_not_apply():
    from grape.sim.whatif import WhatIf, apply

    trace = read_trace(EAGER)
    looped = apply(trace, PROFILE, WhatIf(graph=True, update_nodes=4, device_loop=True))
    assert looped.labels == ["graphed", "4 nodes updated per launch", "one device loop"]
    assert looped.looped == len(trace.iterations) and len(looped.program.iterations) == 1
    copied = apply(trace, PROFILE, WhatIf(graph=True, placeholder_copies=2e6, node_overhead=0))
    assert copied.labels == ["0 us per graph node", "graphed", "2 MB copied in per launch"]
    assert copied.costs.graph_node_overhead == 0
    with pytest.raises(GrapeError, match="expected graph launches to update per shape"):
        apply(trace, PROFILE, WhatIf(update_whole=True))
    with pytest.raises(GrapeError, match="found both --update-nodes and --update-whole"):
        apply(trace, PROFILE, WhatIf(graph=True, update_nodes=1, update_whole=True))
    assert apply(trace, PROFILE, WhatIf()).labels == []


def test_work_that_ran_beside_other_streams_is_charged_its_share_of_the_gpu():
    from grape.records import GpuRecord, alone_times, busy_time

    ops = [GpuRecord("kernel", "a", 0.0, 10.0, 7, 1), GpuRecord("kernel", "b", 5.0, 10.0, 13, 2),
           GpuRecord("kernel", "c", 20.0, 4.0, 7, 3),
           GpuRecord("kernel", "d", 22.0, 4.0, 7, 4)]  # overlaps c on its own stream
    alone = alone_times(ops)
    # a and b share 5..10: each is charged 2.5 there; c and d are one stream, not divided.
    assert alone == [7.5, 7.5, 4.0, 4.0]
    assert sum(alone[:2]) == busy_time(ops[:2])
