"""What one derivation costs on the host (no GPU), on real captures.

The six committed H200 samples of a Llama-shaped decode step (606 nodes, KV lengths 8..504 of
one class modulo 8: ``traces/h200_families/llama_bench_decode_b1_leftovers``, with the slots
their second captures found loose, as ``tests/test_llama_leftovers.py`` reads them) are
derived: afresh, asked again inside ``grape.passes.memo.remembering`` (as ``derive_lengths``'
rounds ask), and with one sample's node changed (what showing words unread asks); and the
derivation's ``coverage`` of the lengths between the samples. Each the best of ``--repeat``
rounds, in milliseconds.

``python benchmarks/derive_cost.py [--repeat N] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grape.passes.derive import derive  # noqa: E402
from grape.passes.memo import remembering  # noqa: E402
from tests.test_llama_leftovers import INSIDE, RUN, _loose, load, one_node_changed  # noqa: E402


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    graphs = load()
    samples, loose = graphs["sample"], _loose(graphs)
    runs, changed = one_node_changed(samples)

    def again() -> None:
        with remembering():
            derive(runs, loose)
            t = time.perf_counter()
            derive(runs, loose)
            timings["again"] = min(timings.get("again", 1e9), time.perf_counter() - t)
            t = time.perf_counter()
            derive(changed, loose)
            timings["changed"] = min(timings.get("changed", 1e9), time.perf_counter() - t)

    timings: dict[str, float] = {}
    fresh = _best(lambda: derive(runs, loose), args.repeat)
    for _ in range(args.repeat):
        again()
    d = derive(runs, loose)
    coverage = _best(lambda: d.coverage(INSIDE), args.repeat)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    row = {"commit": commit, "nodes": len(samples[RUN[0]]), "samples": len(RUN),
           "fresh_ms": round(fresh, 2), "again_ms": round(timings["again"] * 1e3, 2),
           "one_node_changed_ms": round(timings["changed"] * 1e3, 2),
           "coverage_ms": round(coverage, 2), "lengths_covered_asked": len(INSIDE)}
    print(" ".join(f"{k}={v}" for k, v in row.items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
