"""How long ``grape.passes.concurrency.concurrent`` takes on a chain of operations, no GPU.

Synthetic programs shaped like a decode step's conflicts: each operation reads one of 15
private ranges and writes another, and reads (with probability ``--shared``) and writes (a
quarter as often) one range all share, as a cache or a running mask is shared; one kernel per
operation. Prints the seconds the pass took (best of ``--repeats``), the DAG's longest path and
its edges, for each operation count.

Run: python benchmarks/concurrency_pass_cost.py [--ops 600,1200] [--shared 0.5]
"""

from __future__ import annotations

import argparse
import random
import time

from grape.ir import Buffer, BufferRole, Kernel, KernelGraph, Pointer, Span
from grape.passes.concurrency import OpAccess, concurrent

BASE, SLOT = 0x7F00_0000_0000, 0x100


def program(n: int, shared: float, seed: int = 0) -> tuple[KernelGraph, list[OpAccess]]:
    rng = random.Random(seed)
    graph = KernelGraph()
    graph.add_buffer(Buffer("pool", 16 * SLOT, BufferRole.INTERNAL, address=BASE))
    ops, last = [], []
    for i in range(n):
        reads = [rng.randrange(1, 16)] + ([0] if rng.random() < shared else [])
        writes = [rng.randrange(1, 16)] + ([0] if rng.random() < shared / 4 else [])
        slots = reads + writes
        kernel = Kernel(f"k{i}", f"k{i}", (1, 1, 1), (32, 1, 1), args=bytes(8 * len(slots)),
                        pointers=tuple(Pointer(8 * j, Span("pool", s * SLOT))
                                       for j, s in enumerate(slots)))
        last = [graph.add(f"n{i}", kernel, after=last)]
        ops.append(OpAccess(i, tuple((BASE + s * SLOT, SLOT) for s in reads),
                            tuple((BASE + s * SLOT, SLOT) for s in writes), f"op{i}"))
    return graph, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="600,1200")
    parser.add_argument("--shared", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'operations':>10} {'seconds':>8} {'depth':>6} {'edges':>6}")
    for n in map(int, args.ops.split(",")):
        graph, ops = program(n, args.shared)
        best, found = float("inf"), None
        for _ in range(args.repeats):
            began = time.perf_counter()
            found = concurrent(graph, ops)
            best = min(best, time.perf_counter() - began)
        print(f"{n:>10} {best:>8.3f} {found.depth:>6} {found.edges:>6}")


if __name__ == "__main__":
    main()
