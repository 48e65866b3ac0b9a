"""Ranks recorded apart, simulated together (grape.sim.ranks and grape simulate --rank)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from grape.cli import main
from grape.errors import GrapeError
from grape.program import GpuWork, HostWork, Launch, Program, Sync
from grape.sim.engine import Costs
from grape.sim.ranks import calibrate_collectives, mark_collectives, predict_ranks

TRACES = Path(__file__).resolve().parent.parent / "traces"
EAGER = TRACES / "h200" / "gpt2_small_decode_b1_kv128.eager.json.gz"
NCCL = "ncclDevKernel_AllReduce_Sum_f16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _rank(host: float, waited: float, name: str = NCCL) -> Program:
    def launch(kernel, dur):
        return Launch("cudaLaunchKernel", 1.0, (GpuWork("kernel", kernel, dur, 7),))
    return Program("rank", [(HostWork(host), launch("gemv", 10.0), launch(name, 5.0 + waited),
                             launch("gemv", 10.0), Sync("cudaStreamSynchronize", 0.0))])


def test_a_collective_costs_its_shortest_recorded_time_across_the_ranks():
    # Rank 1 reached the all-reduce 7 us before rank 0 and spun there: its kernel ran 12 us.
    ranks = [mark_collectives(_rank(0.0, 0.0)), mark_collectives(_rank(0.0, 7.0))]
    priced = calibrate_collectives(ranks)
    durations = [[w.dur for s in p.steps() if isinstance(s, Launch) for w in s.work]
                 for p in priced]
    assert durations == [[10.0, 5.0, 10.0], [10.0, 5.0, 10.0]]
    assert [w.kind for s in priced[0].steps() if isinstance(s, Launch)
            for w in s.work] == ["kernel", "collective", "kernel"]


def test_together_the_slower_host_sets_both_ranks_pace_and_a_graph_removes_it():
    costs = Costs(launch_latency=0.0, kernel_gap=0.0)
    ranks = [mark_collectives(_rank(100.0, 0.0)), mark_collectives(_rank(0.0, 100.0))]
    _, eager = predict_ranks(ranks, costs)
    assert [r.iteration_times for r in eager] == [[126.0], [126.0]]
    programs, graphed = predict_ranks(ranks, costs, graph=True)
    assert all(r.per_iteration < 126.0 for r in graphed)
    assert "assumed to reach them together" in programs[0].approximations[-1]


def test_ranks_that_did_not_record_one_step_are_refused():
    with pytest.raises(GrapeError, match="expected collectives \\(NCCL kernels\\) in the ranks' "
                                         "traces, found none"):
        calibrate_collectives([_rank(0.0, 0.0), _rank(0.0, 0.0)])
    with pytest.raises(GrapeError, match="expected collective 1 to be one operation on every "
                                         "rank, found rank 0: "):
        calibrate_collectives([mark_collectives(_rank(0.0, 0.0)),
                               mark_collectives(_rank(0.0, 0.0, "ncclDevKernel_AllGather"))])
    lonely = mark_collectives(Program("rank", [(HostWork(1.0),)]))
    with pytest.raises(GrapeError, match="expected every rank's trace to hold the same "
                                         "collectives, found rank 0: 1, rank 1: 0"):
        calibrate_collectives([mark_collectives(_rank(0.0, 0.0)), lonely])


def _rank_traces(tmp_path: Path) -> list[Path]:
    """Two ranks made from one recorded eager trace: every 25th kernel renamed an NCCL
    all-reduce; on rank 1 each of those ran 2 ms longer (it waited for rank 0), which alone
    would make it GPU-bound."""
    doc = json.loads(gzip.decompress(EAGER.read_bytes()))
    kernels = sorted((e for e in doc["traceEvents"] if e.get("cat") == "kernel"),
                     key=lambda e: e["ts"])
    for e in kernels[::25]:
        e["name"] = NCCL
    paths = []
    for rank in range(2):
        if rank == 1:
            for e in kernels[::25]:
                e["dur"] += 2000.0
        path = tmp_path / f"rank{rank}.json.gz"
        path.write_bytes(gzip.compress(json.dumps(doc).encode()))
        paths.append(path)
    return paths


def _row(out: str, label: str) -> list[float]:
    line = next(line for line in out.splitlines() if line.strip().startswith(label))
    return [float(x) for x in line[len(line) - len(line.lstrip()) + len(label):].split()[::2]]


def test_grape_simulate_runs_two_ranks_together_and_graphed(tmp_path, capsys):
    rank0, rank1 = _rank_traces(tmp_path)
    assert main(["simulate", str(rank0), "--rank", str(rank1), "--graph"]) == 0
    out = capsys.readouterr().out
    alone = _row(out, "predicted, each rank alone")
    together = _row(out, "predicted, ranks together")
    graphed = _row(out, "what if: each iteration one graph")
    # Alone, rank 1's collectives keep their recorded waiting; together, each is priced at
    # rank 0's time and the ranks meet.
    assert alone[1] > 2 * alone[0]
    assert together[0] == pytest.approx(together[1], rel=0.02)
    assert together[1] == pytest.approx(alone[0], rel=0.02)
    assert all(g < t for g, t in zip(graphed, together, strict=True))
    assert "collectives in each rank's trace: " in out and "approximated: collectives inside" in out


def test_grape_simulate_with_ranks_refuses_what_it_cannot_do(tmp_path, capsys):
    rank0, rank1 = _rank_traces(tmp_path)
    assert main(["simulate", str(rank0), "--rank", str(rank1), "--device-loop"]) == 2
    assert ("expected only --graph, --iterations and --profile with --rank, found "
            "--device-loop") in capsys.readouterr().err
