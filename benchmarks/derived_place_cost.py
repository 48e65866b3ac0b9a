"""What a derived length costs on the host before it runs (no GPU): building its graph
(``Derivation.graph_at``) and placing it in the family's executable, as a delta matched whole,
as a delta or versions through the derivation's template (matched once), or as versions from
the operations its derivation rebuilds, without the graph: length by length
(``tests.h200_captures.changes_at``) and all at once (``place_derived``, what
``capture_family`` does).

On GPT-2 small's decode family captured twice on the H200 (``traces/h200_families``, KV
lengths 240..255): the larger executable's lengths derived from every other one, loose slots
from the two captures of its first and last sample, as ``derive_lengths`` finds them.

``python benchmarks/derived_place_cost.py`` (prints milliseconds a length, best of 5 rounds).
This repository's 2-core CPU machine, 2026-12-01, three lengths derived (245, 250, 252): at
a996434's derive and family code, graph_at 13.85 ms, the delta matched whole 37.12 ms and
through the template 6.94 ms (one run, the delta's ``pairs`` added for it); with graph_at
copying the template's DAG, two runs: 7.07 and 6.87, 22.58 and 22.24, 4.27 and 4.22. With
node versions, ``match`` taking graphs of one structure under the same ids node to node
without hashing, and Segment.at in integers, one run: graph_at 8.77, delta whole 9.37,
through the template 7.62, versions through the template 1.81, versions without the graph
5.55 (against graph_at and versions through the template, 10.58); derive of the 8 samples
223 ms once. The machine's pace moved by a third between runs that day: compare within one.
With lengths placed a derivation at a time (``place_derived``: rows of arrays a node at a
time, numbers a stretch at a time in numpy, versions as one bytes object each), one run:
graph_at 5.98, versions without the graph 3.84 length by length, all at once 5.25 (three
lengths: the per-node work is not shared yet); with the derivation's stretches extended over
100 and 1,000 lengths (cost only), 4.10 and 4.78 ms a length length by length against 0.440
and 0.315 all at once. After the length-by-length reference moved into the tests
(``changes_at``: each rebuilt node's ``Derivation.op_at``), one run: 6.72 and 6.76 length by
length against 0.710 and 0.505 all at once (the three real lengths all at once 8.25: slower
throughout than the run before).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from grape.passes.delta import delta
from grape.passes.derive import derive, place_derived
from grape.passes.families import match
from grape.passes.variants import Variants

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.h200_captures import captures, changes_at


def main() -> None:
    got = captures()
    graphs, samples, lengths, loose = got.graphs, got.samples, got.lengths, got.loose
    first, last = got.first, got.last
    d = got.derivation()
    derived = [n for n in lengths if n not in samples and d.covers(n)]
    executable = graphs[last]
    known = match(executable, d.template)

    def best(work) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for n in derived:
                work(n)
            times.append((time.perf_counter() - t) / len(derived) * 1000)
        return min(times)

    built = {n: d.graph_at(n) for n in derived}
    print(f"{len(derived)} lengths derived ({derived}); ms a length, best of 5:")
    print(f"  graph_at                      {best(d.graph_at):6.2f}")
    print(f"  delta, matched whole          {best(lambda n: delta(executable, built[n])):6.2f}")
    print(f"  delta, through the template   "
          f"{best(lambda n: delta(executable, built[n], pairs=known)):6.2f}")
    versions = Variants(executable)
    print(f"  versions, through the template "
          f"{best(lambda n: versions.add_graph(n, built[n], pairs=known)):5.2f}")
    versions.add_graph(first, graphs[first])
    base = versions.ops(first)
    print(f"  versions, without the graph    "
          f"{best(lambda n: versions.add_changes(n, changes_at(d, n, base, known))):5.2f}"
          f" (length by length)")
    together = at_once(d, derived, executable, graphs[first], first, known)
    print(f"  versions, all at once          {together:5.2f} (place_derived: what "
          f"capture_family does)")
    t = time.perf_counter()
    derive({n: graphs[n] for n in samples}, loose)
    print(f"  derive, {len(samples)} samples      {1000 * (time.perf_counter() - t):6.0f} (once)")
    # A derivation covers as many lengths as its captured samples span; these span 16. For the
    # cost at scale, its trusted stretches extended (the numbers then are not checked: cost
    # only), a length at a time against all at once:
    for count in (100, 1000):
        fits = {key: [dataclasses.replace(s, first=first, last=first + count)
                      for s in segments if s.support >= 3][:1] for key, segments in d.fits.items()}
        wide = dataclasses.replace(d, fits=fits, bits={})
        many = [n for n in range(first + 1, first + count + 1) if wide.covers(n)]
        one_by_one = Variants(executable)
        one_by_one.add_graph(first, graphs[first])
        base = one_by_one.ops(first)
        t = time.perf_counter()
        for n in many[:100]:
            one_by_one.add_changes(n, changes_at(wide, n, base, known))
        single = (time.perf_counter() - t) / len(many[:100]) * 1000
        print(f"  {len(many)} lengths, stretches extended: length by length {single:.2f}, all "
              f"at once {at_once(wide, many, executable, graphs[first], first, known):.3f}")


def at_once(d, lengths, executable, captured, first, known) -> float:
    """Milliseconds a length of ``place_derived``, best of 3, each into fresh versions."""
    times = []
    for _ in range(3):
        fresh = Variants(executable)
        fresh.add_graph(first, captured)
        t = time.perf_counter()
        place_derived(fresh, d, lengths, first, known)
        times.append((time.perf_counter() - t) / len(lengths) * 1000)
    return min(times)

if __name__ == "__main__":
    main()
