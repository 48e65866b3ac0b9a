"""What bringing an executable to a shape costs in Python alone (no GPU): ``Graph.apply`` over
84 prepared updates (a GPT-2 small step's changed nodes) whose driver call is a stub that
returns success, against the stubs called bare in a loop, microseconds per update, best of
five rounds of 2,000 applies.

``python benchmarks/apply_overhead.py`` (this repository's 2-core CPU machine, 2026-12-01):
1.99 us an update when each call went through ``grape.cuda.check.call`` (its message built per
call), 0.39 since apply makes the calls itself; the calls bare 0.45 and 0.44.
"""

import time

from cuda.bindings import driver

from grape.cuda.build import Graph, Update

_OK = (driver.CUresult.CUDA_SUCCESS,)


def stub(*args):
    return _OK


class Executable:
    handle = 1


updates = [Update(f"n{i}", stub, (i, None)) for i in range(84)]
executable = Executable()


def best(run) -> float:
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(2000):
            run()
        rounds.append((time.perf_counter() - t) / 2000 / len(updates) * 1e6)
    return min(rounds)


def bare() -> None:
    for u in updates:
        u.fn(executable.handle, *u.args)


applied = best(lambda: Graph.apply(executable, updates))
print(f"Graph.apply {applied:.2f} us an update, the calls bare {best(bare):.2f}")
