"""What the profiler costs the host, measured in the recording's own process.

An eager step's profiled run is slower than its timed runs for two reasons the simulator must
take back out before it predicts the timed ones: the profiler's host cost for every event it
records (a PyTorch operator, a CUDA API call), and a slower pace of the whole host once a
profiling session has run in the process (on the H200, 6.5 ms per GPT-2 step before a session
and 11.8 ms after; the cost per API call implied by single recordings ranged 5.1-26.5 us). One
constant per event kind, measured once on one model, missed eager replays by up to 104%.

So ``grape record`` measures both beside each recording, on loops whose events it counts in
their traces: PyTorch operators on CPU tensors (operators, one launch) and tiny kernels
launched one by one (an operator and a launch call each), at two sizes. Each loop is timed
before any profiling (``clean``), then, after the recording's own profiling, profiled and timed
again, round after round. Per round, the profiled loop's extra time is fitted as a fixed cost
per profiled step plus a cost per operator and per API call (least squares over the loops); the
host's pace is the loops' unprofiled time after profiling over their clean time. The workload's
own timings never enter the fit: its prediction stays a prediction. The rounds' spread is the
interval the prediction states.

Two things measured on the H200 shape how the loops are timed. A profiling session leaves the
host slow for about a tenth of a second after it ends (a GPT-2 step ran 14-15 ms four times in
a row after one, then 6.3-6.7 ms): a loop timed once right after profiling measured that
transient, not the pace, and the fitted costs came out negative. So every timing after a
session waits until the loop has run untimed for ``SETTLE_S`` and takes the median of
``TIMED_PER_ROUND`` calls. And where the profiler records CUDA activity only, the operator loop
leaves no event to count and its iteration's window holds no host work (58-224 us against a
3 ms loop): it enters only fits whose traces record operators.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from grape.errors import GrapeError

__all__ = ["LOOPS", "OPERATOR_LOOPS", "Observation", "calibrate", "clean_times", "counters",
           "fit_round"]


def _cpu_operators(n: int) -> Callable[[], None]:
    a = torch.zeros(4)
    x = torch.zeros(4, device="cuda")

    def loop() -> None:
        for _ in range(n):
            a.add_(1)
        x.add_(1)  # one launch: a trace without GPU work is refused, and says nothing
    return loop


def _launches(n: int) -> Callable[[], None]:
    x = torch.zeros(4, device="cuda")

    def loop() -> None:
        for _ in range(n):
            x.add_(1)
    return loop


# name -> loop factory: operators alone, and launches at three sizes (the fixed cost per
# profiled step apart from the per-event costs). With CUDA activity only, the launch loops are
# the whole fit: two sizes solved it exactly, and one noisy point swung the fixed cost between
# -3.3 and +2.9 ms per step over 14 recordings on the H200; a third over-determines it.
LOOPS: dict[str, Callable[[], Callable[[], None]]] = {
    "operators_1000": lambda: _cpu_operators(1000),
    "launches_100": lambda: _launches(100),
    "launches_500": lambda: _launches(500),
    "launches_1000": lambda: _launches(1000),
}
# Loops whose events are operators: they say nothing where the profiler records none.
OPERATOR_LOOPS = frozenset({"operators_1000"})

SETTLE_S = 0.15  # untimed running after a profiling session, past its slow transient
TIMED_PER_ROUND = 5  # unprofiled calls per loop and round; their median is the round's time
PROFILED_PER_ROUND = 3  # profiled calls per loop and round (one session); their median, too


@dataclass(frozen=True)
class Observation:
    """One loop in one round."""

    loop: str
    operators: int  # operators the profiler recorded in one profiled iteration
    calls: int  # CUDA API calls it recorded there
    profiled_us: float  # that iteration's host time
    unprofiled_us: float  # the loop timed without the profiler, after profiling had run
    clean_us: float  # the loop timed before any profiling in the process


def fit_round(observations: Sequence[Observation]) -> tuple[float, float, float]:
    """(per profiled step, per operator, per API call) in microseconds: the profiled loops'
    extra time, least squares over one round's loops. A kind no loop recorded (operators where
    the profiler took CUDA activity only) costs nothing here: its cost shows in the others."""
    if len(observations) < 2:
        raise GrapeError(f"expected at least two calibration loops per round, found "
                         f"{len(observations)}")
    design = np.array([[1.0, o.operators, o.calls] for o in observations])
    extra = np.array([o.profiled_us - o.unprofiled_us for o in observations])
    # lstsq's minimum-norm answer gives a column of zeros (a kind never recorded) no cost.
    (fixed, per_op, per_call), *_ = np.linalg.lstsq(design, extra, rcond=None)
    return float(fixed), max(float(per_op), 0.0), max(float(per_call), 0.0)


def counters(rounds: Sequence[Sequence[Observation]]) -> dict[str, float]:
    """The trace counters the simulator reads (``grape.sim.whatif``): each figure's median
    over the rounds, with its lowest and highest."""
    if not rounds:
        raise GrapeError("expected at least one calibration round, found none")
    fits = [fit_round(r) for r in rounds]
    paces = [o.unprofiled_us / o.clean_us for r in rounds for o in r if o.clean_us > 0]
    out: dict[str, float] = {}
    for name, values in (("profiler_per_step_us", [f[0] for f in fits]),
                         ("profiler_per_op_us", [f[1] for f in fits]),
                         ("profiler_per_call_us", [f[2] for f in fits]),
                         ("host_pace_after_profiling", paces)):
        if values:
            out[name] = statistics.median(values)
            out[f"{name}_low"], out[f"{name}_high"] = min(values), max(values)
    return out


def clean_times(timed: Callable[[Callable[[], None], int], list[float]], rounds: int
                ) -> dict[str, float]:
    """Each loop's median time before any profiling (``timed(run, n)``: microseconds of n
    synchronised calls)."""
    return {name: statistics.median(timed(make(), rounds)) for name, make in LOOPS.items()}


def _settle(run: Callable[[], None], seconds: float = SETTLE_S) -> None:
    """Run ``run`` untimed for ``seconds``: past the slow stretch a profiling session leaves."""
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        run()
        torch.cuda.synchronize()


def calibrate(timed: Callable[[Callable[[], None], int], list[float]],
              profiled: Callable[[Callable[[], None], int], object],
              clean: Mapping[str, float], rounds: int, operators: bool = True,
              settle: Callable[[Callable[[], None]], None] = _settle) -> dict[str, float]:
    """The counters for one profiler configuration, measured now (after the recording's own
    profiling), round after round, each loop profiled ``PROFILED_PER_ROUND`` times in one
    session and then, once ``settle(run)`` has run it past the session's slow transient, timed
    ``TIMED_PER_ROUND`` times; each side's median is the round's observation:
    ``profiled(run, n)`` returns the grape Trace of n profiled calls, configured as the
    recording's; ``timed(run, n)`` the microseconds of n unprofiled calls; ``clean``:
    :func:`clean_times`; ``operators``: whether that configuration records operators (the
    operator loops are left out where it does not)."""
    loops = {name: make() for name, make in LOOPS.items()
             if operators or name not in OPERATOR_LOOPS}
    by_round: list[list[Observation]] = []
    for _ in range(rounds):
        observed = []
        for name, run in loops.items():
            trace = profiled(run, PROFILED_PER_ROUND)
            settle(run)
            wall = statistics.median(timed(run, TIMED_PER_ROUND))
            iterations = trace.iterations  # type: ignore[attr-defined]
            if len(iterations) != PROFILED_PER_ROUND:
                raise GrapeError(f"expected {PROFILED_PER_ROUND} profiled iterations of "
                                 f"calibration loop {name}, found {len(iterations)}")
            ops = [sum(1 for op in trace.ops if it.start <= op.ts < it.end)  # type: ignore
                   for it in iterations]
            observed.append(Observation(
                name, round(statistics.median(ops)),
                round(statistics.median(len(it.calls) for it in iterations)),
                statistics.median(it.host_time for it in iterations), wall, clean[name]))
        by_round.append(observed)
    return counters(by_round)
