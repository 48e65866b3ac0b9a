"""Ranks recorded apart, simulated together: eager traces of each rank of a tensor-parallel
step, their collectives matched, priced, and graphed.

A collective's kernel in an eager trace runs from when its rank launched it to when the last
rank's arrived and the data moved: on every rank but the last to arrive, part of its recorded
time is waiting. Each rank's trace alone cannot tell the parts apart, but together they can:
the rank that arrived last waited least, so the n-th collective's own cost is taken as the
shortest of its recorded times across the ranks (:func:`calibrate_collectives`). Run together
(``grape.sim.engine.simulate_ranks``: a host and a GPU per rank, each collective ending its
cost after the last rank's has started), the ranks then wait for each other where their hosts
or GPUs differ, as they did.

Graphed (:func:`predict_ranks` with ``graph=True``), each rank's iteration becomes one graph
launch whose GPU time holds its collectives at their own cost: the ranks' graphs run the same
work, so they are taken to reach each collective together. That assumption is listed with the
program's approximations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from grape.errors import GrapeError
from grape.program import GpuWork, Launch, Program
from grape.sim.engine import Costs, SimResult, simulate_ranks

__all__ = ["calibrate_collectives", "collective_name", "mark_collectives", "predict_ranks"]


def collective_name(name: str) -> bool:
    """NCCL's collective kernels, by name (``ncclDevKernel_AllReduce_Sum_f16_RING_LL`` and
    the like; also ``ncclKernel_`` of older NCCL versions)."""
    return "nccl" in name.lower() and "Kernel" in name


def mark_collectives(program: Program,
                     is_collective: Callable[[str], bool] = collective_name) -> Program:
    """``program`` with the kernels ``is_collective`` names made collectives (kind
    ``"collective"``), which meet across ranks in ``simulate_ranks``."""
    def mark(w: GpuWork) -> GpuWork:
        return replace(w, kind="collective") if w.kind == "kernel" and is_collective(w.name) \
            else w
    return _map_work(program, mark)


def _map_work(program: Program, fn: Callable[[GpuWork], GpuWork]) -> Program:
    """``program`` with every launch's GPU work passed through ``fn``, in program order."""
    return program.with_iterations([
        tuple(replace(s, work=tuple(map(fn, s.work))) if isinstance(s, Launch) else s
              for s in steps) for steps in program.iterations])


def _priced(cost: list[float]) -> Callable[[GpuWork], GpuWork]:
    """A pass giving the n-th collective it meets the time ``cost[n]``."""
    left = iter(cost)

    def own(w: GpuWork) -> GpuWork:
        return replace(w, dur=next(left)) if w.kind == "collective" else w
    return own


def _collectives(program: Program) -> list[GpuWork]:
    return [w for s in program.steps() if isinstance(s, Launch) for w in s.work
            if w.kind == "collective"]


def calibrate_collectives(programs: Sequence[Program]) -> list[Program]:
    """The ranks' programs with each collective's time set to its own cost: the shortest of
    the n-th collective's recorded times across the ranks (see the module).

    Raises
    ------
    GrapeError
        Ranks that run different numbers of collectives, or whose n-th collectives differ by
        name (the recordings are not of one step).
    """
    per_rank = [_collectives(p) for p in programs]
    counts = [len(c) for c in per_rank]
    if len(set(counts)) > 1:
        raise GrapeError(f"expected every rank's trace to hold the same collectives, found "
                         f"{', '.join(f'rank {r}: {n}' for r, n in enumerate(counts))}")
    if not counts or counts[0] == 0:
        raise GrapeError("expected collectives (NCCL kernels) in the ranks' traces, found none")
    cost = []
    for i, works in enumerate(zip(*per_rank, strict=True)):
        if len({w.name for w in works}) > 1:
            names = ", ".join(f"rank {r}: {w.name!r}" for r, w in enumerate(works))
            raise GrapeError(f"expected collective {i + 1} to be one operation on every rank, "
                             f"found {names}")
        cost.append(min(w.dur for w in works))
    return [_map_work(program, _priced(cost)) for program in programs]


def predict_ranks(programs: Sequence[Program], costs: Costs, graph: bool = False
                  ) -> tuple[list[Program], list[SimResult]]:
    """The ranks' eager programs (collectives marked) run together, as recorded or, with
    ``graph``, each iteration one graph launch per rank: the programs run (their
    approximations and blockers say what was assumed) and each rank's result."""
    from grape.sim.whatif import graph_iterations

    ranks = calibrate_collectives(programs)
    if graph:
        ranks = [graph_iterations(p, costs) for p in ranks]
        for p in ranks:
            p.approximations.append("collectives inside each rank's graph priced at their own "
                                    "cost: the ranks' graphs assumed to reach them together")
    return ranks, simulate_ranks(ranks, costs)
