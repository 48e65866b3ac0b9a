"""The profiler's cost calibrated in a recording's process (grape.torch.profiler_cost) and the
simulator's use of it (grape.sim.whatif, grape.sim.validate): the fit on known numbers, the
loops' wiring with stand-ins for the profiler, and a committed recording given calibrations."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from grape.errors import GrapeError
from grape.profile import DEFAULT_PROFILE, load_profile
from grape.sim.engine import simulate
from grape.sim.validate import predictions
from grape.sim.whatif import calibrated, costs_from_profile, unprofiled_program
from grape.trace import read_trace

torch = pytest.importorskip("torch", reason="torch is not installed")

from grape.torch import profiler_cost  # noqa: E402
from grape.torch.profiler_cost import Observation, counters, fit_round  # noqa: E402

TRACES = Path(__file__).resolve().parent.parent / "traces"


def _round(fixed, per_op, per_call, pace=1.0, ops_recorded=True):
    """The three loops' observations for known costs: extra time = fixed + per event."""
    out = []
    for name, ops, calls in (("operators_1000", 1000, 0), ("launches_500", 500, 500),
                             ("launches_1000", 1000, 1000)):
        ops = ops if ops_recorded else 0
        plain = 3.0 * ops + 4.0 * calls + 50.0
        out.append(Observation(name, ops, calls, plain + fixed + per_op * ops + per_call * calls,
                               plain, plain / pace))
    return out


def test_a_round_gives_back_the_costs_it_was_made_with():
    fixed, per_op, per_call = fit_round(_round(30.0, 2.0, 6.0))
    assert fixed == pytest.approx(30.0) and per_op == pytest.approx(2.0)
    assert per_call == pytest.approx(6.0)


def test_operators_never_recorded_cost_nothing_and_calls_carry_the_rest():
    # CUDA activity only: the profiler records no operators, so none can be subtracted; the
    # launches' operators' cost shows in the cost per call.
    rounds = [_round(30.0, 0.0, 6.0, ops_recorded=False)]
    fixed, per_op, per_call = fit_round(rounds[0])
    assert per_op == 0.0 and per_call == pytest.approx(6.0) and fixed == pytest.approx(30.0)
    with pytest.raises(GrapeError, match="expected at least two calibration loops"):
        fit_round(rounds[0][:1])


def test_counters_give_each_figures_median_and_range_over_the_rounds():
    rounds = [_round(30.0, 2.0, c, pace=p) for c, p in ((5.0, 1.5), (6.0, 1.7), (9.0, 1.6))]
    got = counters(rounds)
    assert got["profiler_per_call_us"] == pytest.approx(6.0)
    assert got["profiler_per_call_us_low"] == pytest.approx(5.0)
    assert got["profiler_per_call_us_high"] == pytest.approx(9.0)
    assert got["host_pace_after_profiling"] == pytest.approx(1.6)
    assert (got["host_pace_after_profiling_low"], got["host_pace_after_profiling_high"]) == (
        pytest.approx(1.5), pytest.approx(1.7))
    with pytest.raises(GrapeError, match="expected at least one calibration round"):
        counters([])


def _stand_in_loops(monkeypatch, names, operators=()):
    """Calibration loops that do nothing but return their name (``operators``: those whose
    events are operators)."""
    monkeypatch.setattr(profiler_cost, "LOOPS", {n: (lambda n=n: (lambda: n)) for n in names})
    monkeypatch.setattr(profiler_cost, "OPERATOR_LOOPS", frozenset(operators))


def test_calibrate_pairs_each_profiled_loop_with_a_timed_one_round_by_round(monkeypatch):
    # Stand-ins: loops that do nothing, a profiler whose one iteration holds a known number of
    # operators and calls with a known host time, and a timer; the fit comes back as made.
    events = {"a": (100, 0), "b": (50, 50), "c": (100, 100)}
    _stand_in_loops(monkeypatch, events)

    def profiled(run, n):
        ops, calls = events[run()]
        it = SimpleNamespace(start=0.0, end=1e6, calls=[None] * calls,
                             host_time=1000.0 + 10.0 + 2.0 * ops + 7.0 * calls)
        return SimpleNamespace(iterations=[it] * n, ops=[SimpleNamespace(ts=1.0)] * ops)

    timed, settled = [0], []

    def timer(run, n):
        timed[0] += n
        return [1000.0] * n

    got = profiler_cost.calibrate(timer, profiled, {n: 800.0 for n in events}, rounds=3,
                                  settle=lambda run: settled.append(run()))
    # every loop settled past the session's transient, then timed as often, in every round
    assert settled == ["a", "b", "c"] * 3
    assert timed[0] == 9 * profiler_cost.TIMED_PER_ROUND
    assert got["profiler_per_op_us"] == pytest.approx(2.0)
    assert got["profiler_per_call_us"] == pytest.approx(7.0)
    assert got["profiler_per_step_us"] == pytest.approx(10.0)
    assert got["host_pace_after_profiling"] == pytest.approx(1.25)


def test_operator_loops_enter_only_fits_whose_profiler_records_operators(monkeypatch):
    # CUDA activity only: an operator loop's window holds no host work (measured: 58 us for a
    # 3 ms loop), so fitted with the others it made the fixed cost -2.8 ms on the H200.
    events = {"ops": (0, 1), "b": (0, 50), "c": (0, 100)}
    _stand_in_loops(monkeypatch, events, operators={"ops"})
    seen = []

    def profiled(run, n):
        name = run()
        seen.append(name)
        calls = events[name][1]
        host = 58.0 if name == "ops" else 1000.0 + 20.0 + 3.0 * calls
        it = SimpleNamespace(start=0.0, end=1e6, calls=[None] * calls, host_time=host)
        return SimpleNamespace(iterations=[it] * n, ops=[])

    def timer(run, n):
        return [3000.0 if run() == "ops" else 1000.0] * n

    got = profiler_cost.calibrate(timer, profiled, dict.fromkeys(events, 1000.0), rounds=2,
                                  operators=False, settle=lambda run: None)
    assert "ops" not in seen
    assert got["profiler_per_step_us"] == pytest.approx(20.0)
    assert got["profiler_per_call_us"] == pytest.approx(3.0)


def _with_counters(trace, **values):
    return dataclasses.replace(trace, grape=dataclasses.replace(trace.grape, counters=values))


def test_a_recordings_calibration_replaces_the_profile_constant_and_its_pace_scales_the_host():
    profile = load_profile(DEFAULT_PROFILE)
    costs = costs_from_profile(profile)
    trace = read_trace(TRACES / "h200" / "gpt2_small_decode_b1_kv32.eager.json.gz")
    assert not calibrated(trace)
    plain = simulate(unprofiled_program(trace, profile), costs).per_iteration
    # The profile's own constant, given as the recording's calibration: the same prediction.
    same = _with_counters(trace, profiler_per_call_us=profile.get("profiler_per_call"),
                          profiler_per_op_us=0.0, profiler_per_step_us=0.0,
                          host_pace_after_profiling=1.0)
    assert calibrated(same)
    assert simulate(unprofiled_program(same, profile), costs).per_iteration == \
        pytest.approx(plain, rel=1e-9)
    # A host measured twice as slow after profiling: this host-bound step predicted near half.
    slow = _with_counters(trace, profiler_per_call_us=profile.get("profiler_per_call"),
                          host_pace_after_profiling=2.0)
    halved = simulate(unprofiled_program(slow, profile), costs).per_iteration
    assert 0.5 * plain <= halved < 0.6 * plain


def test_an_eager_replays_interval_spans_the_calibrations_rounds():
    profile = load_profile(DEFAULT_PROFILE)
    eager = read_trace(TRACES / "h200" / "gpt2_small_decode_b1_kv32.eager.json.gz")
    per_call = profile.get("profiler_per_call")
    narrow = _with_counters(eager, profiler_per_call_us=per_call, host_pace_after_profiling=1.0)
    wide = _with_counters(eager, profiler_per_call_us=per_call,
                          profiler_per_call_us_low=per_call / 2,
                          profiler_per_call_us_high=per_call * 1.5,
                          host_pace_after_profiling=1.0, host_pace_after_profiling_low=0.8,
                          host_pace_after_profiling_high=1.3)
    (a,) = [p for p in predictions(narrow, profile) if p.question == "replay eager"]
    (b,) = [p for p in predictions(wide, profile) if p.question == "replay eager"]
    assert a.predicted == pytest.approx(b.predicted)
    assert b.low < a.low <= a.predicted <= a.high < b.high


def test_a_round_takes_the_median_of_its_profiled_calls(monkeypatch):
    # One profiled call in three runs into the host's slow stretch: the round's observation is
    # the median, so the fit is the loops' own cost, not the outlier's.
    events = {"a": (0, 100), "b": (0, 500), "c": (0, 1000)}
    _stand_in_loops(monkeypatch, events)

    def profiled(run, n):
        calls = events[run()][1]
        plain = 1000.0 + 15.0 + 2.0 * calls
        hosts = [plain + 5000.0, plain, plain]  # the session's first call, slowed
        assert n == len(hosts)
        return SimpleNamespace(ops=[], iterations=[
            SimpleNamespace(start=0.0, end=1e6, calls=[None] * calls, host_time=h)
            for h in hosts])

    got = profiler_cost.calibrate(lambda run, n: [1000.0] * n, profiled,
                                  dict.fromkeys(events, 1000.0), rounds=2, operators=False,
                                  settle=lambda run: None)
    assert got["profiler_per_step_us"] == pytest.approx(15.0)
    assert got["profiler_per_call_us"] == pytest.approx(2.0)
