"""What sampling coarse first (``derive_lengths``' ``start``) saves on the host, without a GPU.

A Llama-shaped decode step's graph (606 nodes) at any KV length of one class modulo 8: the
derivation of the six committed H200 samples (``traces/h200_families/
llama_bench_decode_b1_leftovers``, the words running would show unread made loose, as
``tests/test_llama_leftovers.py`` finds them) gives the graph at every length of 8..504, each
number on the form the samples fitted. ``derive_lengths`` over those lengths, with that
derivation as its capture, then counts the captures each way makes and times its host work
(fitting, comparing, checking: everything but capturing). The graphs hold no host leftovers
(every number is on its form), so this prices the sampling alone; the GPU's Llama family
(``families.py --derive-start``) prices the rest.

``python benchmarks/derive_start.py [--out PATH]`` prints one row a way and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grape.passes.derive import derive  # noqa: E402
from grape.passes.lengths import _unread_candidates, derive_lengths  # noqa: E402
from tests.test_llama_leftovers import RUN, _loose, load  # noqa: E402

WAYS = [(2, None), (4, None), (8, None), (2, 16), (4, 16), (2, 32)]  # (every, start)


def model() -> tuple[object, list[int]]:
    """The derivation that stands in for capturing, and the lengths it covers."""
    graphs = load()
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
    for every, start in WAYS:
        t = time.perf_counter()
        got = derive_lengths(graphs.__getitem__, lengths, every=every, start=start, checks=1)
        seconds = time.perf_counter() - t
        wrong = sum(got.graphs[n] != graphs[n] for n in got.derived)
        rows.append({"every": every, "start": start, "lengths": len(lengths),
                     "captured": len(got.captured), "again": len(got.repeated),
                     "derived": len(got.derived), "derived_wrong": wrong,
                     "host_s": round(seconds, 3)})
        print(f"every {every:2} start {start!s:>4}: {len(got.captured):3} captured "
              f"(+{len(got.repeated)} again), {len(got.derived):3} derived ({wrong} wrong), "
              f"host {seconds:.2f} s", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
