"""The model's pieces on tiny programs, checked against exact event logs (SimPy's own style)."""

from __future__ import annotations

import dataclasses

import pytest

from grape.errors import GrapeError
from grape.program import GpuWork, GraphLaunch, HostWork, Launch, Program, StreamWait, Sync
from grape.sim.engine import Costs, simulate

COSTS = Costs(launch_latency=2, kernel_gap=1, graph_launch_fixed=3, graph_launch_per_node=0,
              queue_depth=1024)


def _k(dur, stream=7, name="k"):
    return GpuWork("kernel", name, dur, stream)


def _log(program, costs=COSTS):
    r = simulate(program, costs, timeline=True)
    return r, [(i.track, i.name, i.start, i.end) for i in
               sorted(r.intervals, key=lambda i: (i.start, i.track))]


def test_launch_then_sync():
    r, log = _log(Program("p", [(Launch("cudaLaunchKernel", 5, (_k(10),)), Sync("sync", 0))]))
    assert log == [("host", "Launch", 0, 5), ("host", "Sync", 5, 17),
                   ("stream 7", "k", 7, 17)]
    assert r.iteration_times == [17] and r.gpu_busy == 10


def test_kernels_queue_behind_each_other_with_the_front_end_gap():
    p = Program("p", [(Launch("l", 1, (_k(10, name="a"),)), Launch("l", 1, (_k(10, name="b"),)),
                       Sync("s", 0))])
    _, log = _log(p)
    assert [entry for entry in log if entry[0] == "stream 7"] == [
        ("stream 7", "a", 3, 13), ("stream 7", "b", 14, 24)]


def test_host_bound_launches_leave_the_gpu_idle():
    p = Program("p", [(HostWork(20), Launch("l", 5, (_k(1),)), HostWork(20),
                       Launch("l", 5, (_k(1),)), Sync("s", 0))])
    r, log = _log(p)
    assert [e[2:] for e in log if e[0] == "stream 7"] == [(27, 28), (52, 53)]
    assert r.iteration_times == [53]


def test_streams_run_in_parallel():
    p = Program("p", [(Launch("l", 1, (_k(10, 7),)), Launch("l", 1, (_k(10, 8),)), Sync("s", 0))])
    r, log = _log(p)
    assert [e for e in log if e[0] != "host"] == [("stream 7", "k", 3, 13),
                                                  ("stream 8", "k", 4, 14)]
    assert r.gpu_busy == 11 and r.iteration_times == [14]


def test_a_full_launch_queue_stalls_the_host():
    costs = Costs(launch_latency=0, kernel_gap=0, queue_depth=2)
    p = Program("p", [tuple(Launch("l", 1, (_k(10, name=str(i)),)) for i in range(4))
                      + (Sync("s", 0),)])
    r, log = _log(p, costs)
    starts = [e[2] for e in log if e[0] == "stream 7"]
    assert starts == [1, 11, 21, 31]
    # Kernels 2 and 3 wait in the queue; launch 4 finds it full and stalls until kernel 2
    # starts at t=11.
    assert [e[2:] for e in log if e[0] == "host"][:4] == [(0, 1), (1, 2), (2, 3), (3, 11)]
    assert r.host_stall == 11 - 4


def test_graph_launch_runs_as_one_unit():
    p = Program("p", [(GraphLaunch(cost=3, nodes=290, gpu_time=600, stream=7), Sync("s", 0))])
    _, log = _log(p)
    assert log == [("host", "GraphLaunch", 0, 3), ("host", "Sync", 3, 605),
                   ("stream 7", "graph (290 nodes)", 5, 605)]


def test_iterations_are_timed_separately():
    it = (Launch("l", 1, (_k(4),)), Sync("s", 0))
    r = simulate(Program("p", [it, it, it]), COSTS)
    assert r.iteration_times == [7, 7, 7]


def test_impossible_costs_are_refused():
    with pytest.raises(GrapeError, match="expected a finite, non-negative launch_latency, "
                                         "found -1"):
        Costs(launch_latency=-1)
    with pytest.raises(GrapeError, match="expected a finite, non-negative kernel_gap, found nan"):
        Costs(kernel_gap=float("nan"))
    with pytest.raises(GrapeError, match="expected a finite, positive copy_bandwidth, found inf"):
        Costs(copy_bandwidth=float("inf"))
    with pytest.raises(GrapeError, match="expected a queue depth of at least 1, found 0"):
        Costs(queue_depth=0)


def test_without_syncs_the_host_runs_ahead_and_the_gpu_sets_the_pace():
    it = (Launch("l", 1, (_k(10),)),)
    r = simulate(Program("p", [it, it, it]), COSTS)
    assert r.iteration_times == [1, 1, 1] and not r.synchronised
    # Kernels start at 3, 14, 25 (latency 2, gap 1): the run ends at 35.
    assert r.end == 35 and r.per_iteration == 35 / 3
    synced = simulate(Program("p", [it + (Sync("s", 0),)] * 3), COSTS)
    assert synced.synchronised and synced.per_iteration == 13


def test_a_stream_waits_for_the_work_another_had_queued_then():
    # b waits for a (queued before the wait), not for c (queued after it).
    p = Program("p", [(Launch("l", 1, (_k(10, 7, "a"),)), StreamWait(8, 7),
                       Launch("l", 1, (_k(5, 8, "b"),)), Launch("l", 1, (_k(20, 7, "c"),)),
                       Sync("s", 0))])
    r, log = _log(p)
    assert [e for e in log if e[0] != "host"] == [("stream 7", "a", 3, 13),
                                                  ("stream 8", "b", 13, 18),
                                                  ("stream 7", "c", 14, 34)]
    assert r.iteration_times == [34]


def test_a_wait_on_finished_work_holds_nothing_back():
    p = Program("p", [(Launch("l", 1, (_k(1, 7, "a"),)), HostWork(10), StreamWait(8, 7),
                       Launch("l", 1, (_k(5, 8, "b"),)), Sync("s", 0))])
    _, log = _log(p)
    assert [e for e in log if e[0] != "host"] == [("stream 7", "a", 3, 4),
                                                  ("stream 8", "b", 14, 19)]


def _rank_program(host_before: float, collective: str = "all_reduce") -> Program:
    from grape.program import GpuWork

    def launch(kind, name, dur):
        return Launch("cudaLaunchKernel", 1.0, (GpuWork(kind, name, dur, 7),))
    return Program("rank", [(HostWork(host_before), launch("kernel", "gemv", 10.0),
                             launch("collective", collective, 5.0),
                             launch("kernel", "gemv", 10.0), Sync("cudaStreamSynchronize", 0.0))])


def test_ranks_meet_at_their_collectives_and_the_slow_host_sets_the_pace():
    from grape.sim.engine import simulate_ranks

    costs = Costs(launch_latency=0.0, kernel_gap=0.0)
    slow, fast = _rank_program(100.0), _rank_program(0.0)
    # Alone, the fast rank would finish at 1 + 10 + 5 + 10.
    assert simulate(fast, costs).iteration_times == [26.0]
    results = simulate_ranks([slow, fast], costs)
    # The slow rank's collective starts at 111 (after its first kernel, 101-111); both leave
    # it at 116 and run their last kernel to 126. The fast rank's GPU waited inside it.
    assert [r.iteration_times for r in results] == [[126.0], [126.0]]
    assert results[1].gpu_busy == 126.0 - 1.0


def test_ranks_whose_collectives_do_not_match_are_refused():
    from grape.errors import GrapeError
    from grape.sim.engine import simulate_ranks

    with pytest.raises(GrapeError, match="expected collective 1 to be 'all_reduce' on every "
                                         "rank, found 'all_gather' on rank 1"):
        simulate_ranks([_rank_program(0.0), _rank_program(0.0, "all_gather")])
    lonely = Program("rank", [(Launch("cudaLaunchKernel", 1.0, ()),)])
    with pytest.raises(GrapeError, match="reached by ranks \\[0\\] alone"):
        simulate_ranks([_rank_program(0.0), lonely])


def _counting_steps(monkeypatch):
    import simpy

    steps = [0]
    original = simpy.Environment.step

    def counting(env):
        steps[0] += 1
        original(env)

    monkeypatch.setattr(simpy.Environment, "step", counting)
    return steps


def test_launches_cost_events_only_where_another_process_looks(monkeypatch):
    # The host runs ahead on its own clock and waits only on a full queue, a sync or the end;
    # a stream runs ahead of the simulation while no other process can look. What makes a
    # million launches simulate in seconds (benchmarks/sim_speed.py). Counts, not times.
    steps = _counting_steps(monkeypatch)
    launch = (HostWork(4.0), Launch("cudaLaunchKernel", 5.0, (_k(3.0),)))
    r = simulate(Program("p", [launch * 500 + (Sync("sync", 0),)] * 4), COSTS)
    assert r.iteration_times[0] == pytest.approx(500 * 9 + 2 + 3)  # host-bound, then drained
    assert steps[0] <= 4 * 10  # a handful per iteration (one per launch before: 2,000)
    # GPU-bound behind a full queue: each launch waits for a slot, at most three events each
    # (the host's look at its own time, the freed slot, the kernel that freed it ending).
    steps[0] = 0
    slow = (Launch("cudaLaunchKernel", 1.0, (_k(30.0),)),)
    simulate(Program("p", [slow * 500 + (Sync("sync", 0),)]),
             dataclasses.replace(COSTS, queue_depth=8))
    assert 500 <= steps[0] <= 3 * 500 + 10


def _random_program(rng, streams: int) -> Program:
    iterations = []
    for _ in range(rng.randint(1, 4)):
        steps = []
        for _ in range(rng.randint(5, 60)):
            roll = rng.random()
            if roll < 0.45:
                work = tuple(_k(rng.choice([0.0, 0.5, 3.0, 40.0]), rng.randrange(streams),
                                f"k{len(steps)}") for _ in range(rng.randint(1, 3)))
                steps.append(Launch("cudaLaunchKernel", rng.choice([0.5, 5.0]), work))
            elif roll < 0.6:
                steps.append(HostWork(rng.choice([1.0, 20.0, 200.0])))
            elif roll < 0.7 and streams > 1:
                a, b = rng.sample(range(streams), 2)
                steps.append(StreamWait(a, b))
            elif roll < 0.8:
                work = tuple(_k(rng.choice([1.0, 9.0]), 0, "g") for _ in range(3))
                steps.append(GraphLaunch(3.0, 3, 25.0, rng.randrange(streams), work))
            elif roll < 0.85:
                steps.append(Sync("sync", rng.choice([0.0, 4.0])))
        if rng.random() < 0.7:
            steps.append(Sync("sync", 0.0))
        iterations.append(tuple(steps))
    return Program("random", iterations)


@pytest.mark.parametrize("seed", range(40))
def test_running_ahead_gives_the_times_an_event_per_kernel_gives(monkeypatch, seed):
    # The reference: a simulation whose next event always looks imminent, so every stream
    # ends every kernel with an event of its own (the engine before it ran ahead).
    import random

    import simpy

    rng = random.Random(seed)
    program = _random_program(rng, rng.choice([1, 2, 3]))
    costs = dataclasses.replace(COSTS, queue_depth=rng.choice([2, 5, 1024]))

    def run():
        r = simulate(program, costs, timeline=True, record=True)
        return (r.iteration_times, r.end, r.gpu_busy, r.host_stall, r.synchronised,
                sorted((i.track, i.name, i.start, i.end) for i in r.intervals),
                sorted((c.name, c.ts, c.dur) for c in r.calls),
                sorted((o.name, o.ts, o.dur, o.stream) for o in r.gpu_ops))

    ahead = run()
    monkeypatch.setattr(simpy.Environment, "peek", lambda env: env.now)
    assert run() == ahead


@pytest.mark.parametrize("seed", range(40))
def test_a_straight_run_queued_at_once_gives_the_times_step_by_step_gives(monkeypatch, seed):
    # Without a timeline or recording, the host queues an iteration's opening run of host
    # work and launches in one go where the launch queue holds it all (_straight); step by
    # step (the run made empty) must give the same times, stalls and ends.
    import random

    import grape.sim.engine as engine

    rng = random.Random(1000 + seed)
    program = _random_program(rng, rng.choice([1, 2, 3]))
    costs = dataclasses.replace(COSTS, queue_depth=rng.choice([2, 5, 1024]))

    def run():
        r = simulate(program, costs)
        return r.iteration_times, r.end, r.gpu_busy, r.host_stall, r.synchronised

    queued = [0]
    original = engine._Machine.submit_all

    def counting(self, run, at):
        queued[0] += run.launches
        original(self, run, at)

    monkeypatch.setattr(engine._Machine, "submit_all", counting)
    at_once = run()
    # the queue holds any of these runs: every opening run with launches went at once
    opening = sum(engine._straight(steps).launches for steps in program.iterations)
    monkeypatch.setattr(engine, "_straight", lambda steps: engine._Run({}, 0, 0.0, 0))
    assert run() == at_once
    if costs.queue_depth == 1024:
        assert queued[0] == opening


def test_a_straight_run_adds_its_host_times_in_another_order_only(monkeypatch):
    # Queued at once, a run's launch times are the iteration's start plus offsets summed from
    # zero, step by step they are summed from the start: equal but for rounding.
    import grape.sim.engine as engine

    step = (HostWork(4.3), Launch("cudaLaunchKernel", 5.1, (_k(2.7), _k(0.9, 1))))
    program = Program("p", [step * 300 + (Sync("sync", 0.1),)] * 5)

    def run():
        r = simulate(program, COSTS)
        return [*r.iteration_times, r.end, r.gpu_busy, r.host_stall]

    at_once = run()
    monkeypatch.setattr(engine, "_straight", lambda steps: engine._Run({}, 0, 0.0, 0))
    assert run() == pytest.approx(at_once, rel=1e-12, abs=1e-9)


def test_iterations_made_one_at_a_time_are_not_taken_for_each_other():
    # Straight runs are kept per iteration tuple by id; iterations from a generator are freed
    # as they go, and a later tuple may take a freed one's id: each must keep its own run.
    def iteration(i: int) -> tuple:
        return ((HostWork(1.0), Launch("cudaLaunchKernel", 2.0, (_k(float(i + 1)),))) * 3
                + (Sync("sync", 0.0),))

    made = simulate(Program("p", (iteration(i) for i in range(50))), COSTS)
    kept = simulate(Program("p", [iteration(i) for i in range(50)]), COSTS)
    assert made.iteration_times == kept.iteration_times and made.end == kept.end
    assert len(set(kept.iteration_times)) > 1  # the iterations differ
