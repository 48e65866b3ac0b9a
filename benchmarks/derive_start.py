"""What sampling coarse first (``derive_lengths``' ``start``) saves on the host, without a GPU.

A Llama-shaped decode step's graph (606 nodes) at any KV length of one class modulo 8: the
derivation of the six committed H200 samples (``traces/h200_families/
llama_bench_decode_b1_leftovers``, the words running would show unread made loose, as
``tests/test_llama_leftovers.py`` finds them) gives the graph at every length of 8..504, each
number on the form the samples fitted. ``derive_lengths`` over those lengths, with that
derivation as its capture, then counts the captures each way makes and times its host work
(fitting, comparing, checking: everything but capturing; a confirm's run is counted, not
timed, and compares the graph with the model's). The graphs hold no host leftovers
(every number is on its form), so this prices the sampling alone; the GPU's Llama family
(``families.py --derive-start``) prices the rest.

``python benchmarks/derive_start.py [--out PATH]`` prints one row a way and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grape.ir import KernelGraph  # noqa: E402
from grape.passes.derive import derive  # noqa: E402
from grape.passes.lengths import _unread_candidates, derive_lengths  # noqa: E402
from tests.test_llama_leftovers import FOLDER, RUN, _loose  # noqa: E402

# (every, start, confirm): confirm stands in for running a derived graph against the eager
# step, which agrees here wherever the graph is the model's (it always is: no leftovers)
WAYS = [(2, None, False), (4, None, False), (8, None, False), (2, 16, False), (4, 16, False),
        (2, 32, False), (2, 16, True), (4, 16, True)]


def model() -> tuple[object, list[int]]:
    """The derivation that stands in for capturing, and the lengths it covers."""
    graphs: dict[str, dict[int, KernelGraph]] = {"sample": {}, "again": {}}
    for path in FOLDER.glob("*.ir.json.gz"):
        kind, length = re.fullmatch(r"([a-z]+)(\d+)\.ir\.json\.gz", path.name).groups()
        graphs[kind][int(length)] = KernelGraph.load(path)
    samples, loose = graphs["sample"], _loose(graphs)
    inside = [n for n in range(RUN[0] + 8, RUN[-1], 8) if n not in RUN]
    candidates = _unread_candidates(derive({n: samples[n] for n in RUN}, loose), inside) or {}
    slots = {node: loose.get(node, frozenset()) | candidates.get(node, frozenset())
             for node in loose.keys() | candidates.keys()}
    d = derive({n: samples[n] for n in RUN}, slots)
    return d, [n for n in range(RUN[0], RUN[-1] + 1, 8) if d.covers(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    d, lengths = model()
    graphs = {n: d.graph_at(n) for n in lengths}  # made once: capturing costs nothing here
    rows = []
    for every, start, confirming in WAYS:
        runs = []

        def confirm(n, graph, template, runs=runs):
            runs.append(n)
            return graph == graphs[n]

        t = time.perf_counter()
        got = derive_lengths(graphs.__getitem__, lengths, every=every, start=start, checks=1,
                             confirm=confirm if confirming else None)
        seconds = time.perf_counter() - t
        wrong = sum(got.graphs[n] != graphs[n] for n in got.derived)
        rows.append({"every": every, "start": start, "confirm": confirming,
                     "lengths": len(lengths), "confirms": len(runs),
                     "captured": len(got.captured), "again": len(got.repeated),
                     "derived": len(got.derived), "derived_wrong": wrong,
                     "host_s": round(seconds, 3)})
        print(f"every {every:2} start {start!s:>4} confirm {confirming!s:5}: "
              f"{len(got.captured):3} captured (+{len(got.repeated)} again), {len(runs):3} "
              f"confirms, {len(got.derived):3} derived ({wrong} wrong), host {seconds:.2f} s",
              flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
