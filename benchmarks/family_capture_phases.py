"""Where a family's capture time grows with its shapes (GPU): GPT-2 small decode (or
``--decoder``'s) over KV lengths 1..N (largest first), each shape's time in ``capture``
(warm-up, collection, PyTorch's capture, the walk into the IR), in the walk alone, and in
placing it (``_add_shape``: fingerprint, join, delta), and the cycle collector's calls; per
shape, over each 50 shapes.

Written for the open question of 2026-12-01 (family capture 0.085 s a shape over 255 lengths,
0.31 s over 1,023, `benchmarks/README.md`). ``python benchmarks/family_capture_phases.py 400``
on the H200 at e8f2d07 (its output in
``benchmarks/results/families_warm_start_h200/family_capture_phases_400_e8f2d07.log``): 400
shapes in 57.0 s, the collections growing from 8.5 to 210 ms a shape while the other phases
stayed flat; fixed since by ``grape.torch.capture.full_collection``.

``--same-places`` (``python benchmarks/family_capture_phases.py 255 --same-places``) captures
as a deriving family does, each capture's temporaries moved to a reference's places, and
times its parts apart: the allocator's snapshot taken after each capture (``snapshot``),
reading it into a ``History`` (``history``) and the move itself (``move``); ``marks`` is the
operations marked per capture. Written because on the H200 such a capture took about 0.1 s
against 0.017-0.024 s for a plain ``torch.cuda.graph`` (benchmarks/README.md, runs 25 to 30),
and nothing said where the difference goes.

``--derive-every K`` captures as ``capture_family(derive_every=K, derive_period=8)`` does (places
moved); the shapes' rows then cover the captures made, and the time outside them is derivation.
"""

import argparse
import cProfile
import gc
import pstats
import sys
import time

import torch

import grape.cuda.build as build_module
import grape.passes.places as places_module
import grape.torch.family as family_module

sys.path.insert(0, "benchmarks")
from families import (
    MAX_LEN,
    _device_bytes,
    _range,
    _steps,
    decode,
    first_graph_bytes,
    stream_state_bytes,
    thread_state_bytes,
)

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("n", type=int, nargs="?", default=400, help="KV lengths 1..N")
parser.add_argument("--lengths", default=None, metavar="FIRST:LAST[:STRIDE]",
                    help="KV lengths in place of 1..N (as families.py takes them)")
parser.add_argument("--max-len", type=int, default=None, metavar="N",
                    help="the cache's positions (as families.py takes them)")
parser.add_argument("--verify-unread", action="store_true",
                    help="as capture_family(verify_unread=True): words shown unread by running")
parser.add_argument("--update", choices=("nodes", "device", "graph"), default="nodes")
parser.add_argument("--same-places", action="store_true",
                    help="move each capture's temporaries to a reference's places")
parser.add_argument("--derive-every", type=int, default=None, metavar="K",
                    help="capture as a deriving family does: one length in K (period 8), "
                         "places moved, the rest derived")
parser.add_argument("--derive-start", type=int, default=None, metavar="S",
                    help="with --derive-every: sample one length in S first, finer where "
                         "lengths stay underived (capture_family's derive_start)")
parser.add_argument("--decoder", default=None, metavar="ARCH[:SIZE]",
                    help="another architecture of generate.py (as families.py takes it)")
parser.add_argument("--profile", metavar="PATH",
                    help="profile the family's capture with cProfile, stats written to PATH")
args = parser.parse_args()
DERIVE_EVERY = args.derive_every
SAME_PLACES = args.same_places or DERIVE_EVERY is not None
MAX = args.max_len or MAX_LEN
lengths = (_range(args.lengths, "--lengths", 1, MAX - 1) if args.lengths
           else list(range(1, args.n + 1)))
N = len(lengths)
w = decode(1, lengths, args.decoder, MAX)
_steps(w.step, sorted(w.shapes), sync_each=False)
seconds: dict[str, list[float]] = {"capture": [], "walk": [], "place": [], "collect": []}
if SAME_PLACES:
    seconds |= {"snapshot": [], "history": [], "move": [], "marks": []}


def timed(name, f):
    def run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            seconds[name].append(time.perf_counter() - t)
    return run


family_module.capture = timed("capture", family_module.capture)
family_module._add_shape = timed("place", family_module._add_shape)
# PyTorch's captured graph is read into the IR by ``Graph.of_raw``, through build's name.
build_module.read_graph = timed("walk", build_module.read_graph)
gc.collect = timed("collect", gc.collect)
if SAME_PLACES:
    torch.cuda.memory._snapshot = timed("snapshot", torch.cuda.memory._snapshot)
    family_module.to_reference = timed("move", family_module.to_reference)
    of_trace = places_module.History.of_trace.__func__

    def read_history(cls, trace, segments=(), markers=()):
        seconds["marks"].append(len(markers))  # a count, not seconds: printed apart
        return timed("history", of_trace)(cls, trace, segments, markers)

    places_module.History.of_trace = classmethod(read_history)
# As families.py measures: the driver's first graph and the capture stream's library state
# made before, so that the drop below is the capture's own.
first_graph_bytes()
stream_state_bytes(w.step, max(lengths), family_module.capture_stream())
# and a deriving family's second thread (run 51, at 6d8da1d, counted it in the drop: its
# cuBLAS workspace was the 32 MiB allocated growth)
if DERIVE_EVERY is not None:
    made = thread_state_bytes(w.step, max(lengths), family_module.capture_stream())
    print(f"second thread's state {made / 2**20:.1f} MiB, made before")
profiler = cProfile.Profile() if args.profile else None
free0, reserved0 = _device_bytes()
allocated0 = torch.cuda.memory_allocated()
t = time.perf_counter()
if profiler:
    profiler.enable()
family = family_module.capture_family(
    w.step, sorted(w.shapes, reverse=True), params=w.params, prepare=False,
    same_places=SAME_PLACES, derive_every=DERIVE_EVERY, derive_period=8 if DERIVE_EVERY else 1,
    update=args.update, verify_unread=args.verify_unread, derive_start=args.derive_start,
    progress=lambda line: print(f"  family: {line}", flush=True))
total = time.perf_counter() - t
free1, reserved1 = _device_bytes()
# Where the capture's device memory went (families.py charges the family the drop in free
# memory): PyTorch's reserved and allocated growth, and the segments allocated now, by pool
# and stream, the largest blocks first.
print(f"free memory drop {(free0 - free1) / 2**20:.1f} MiB; reserved growth "
      f"{(reserved1 - reserved0) / 2**20:.1f} MiB; allocated growth "
      f"{(torch.cuda.memory_allocated() - allocated0) / 2**20:.1f} MiB; pool "
      f"{family.pool_bytes / 2**20:.1f} MiB")
blocks = sorted(((b["size"], seg["segment_pool_id"], seg["stream"])
                 for seg in torch.cuda.memory_snapshot() for b in seg["blocks"]
                 if b["state"] == "active_allocated"), reverse=True)
print("largest live blocks (bytes, pool, stream):", blocks[:8])
if profiler:
    profiler.disable()
    profiler.dump_stats(args.profile)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
print(f"{N} shapes in {total:.1f} s; {len(gc.get_objects())} objects tracked"
      + (f"; {len(family.sampled.captured)} lengths captured, {len(family.sampled.derived)} "
         f"derived" if family.sampled else ""))
captures = max(1, len(seconds["capture"]))
print(f"{len(seconds['capture'])} captures; " + " ".join(
    f"{k} {sum(v):.2f} s" for k, v in seconds.items() if k != "marks")
    + f"; outside captures and placing {total - sum(seconds['capture'] + seconds['place']):.2f} s")
for a in range(0, captures, 50):
    # Each phase's calls in these 50 captures' share of its calls (some run more than once a
    # capture, the snapshot for one, or not at every capture, the move), per capture.
    row = {k: v[a * len(v) // captures:(a + 50) * len(v) // captures]
           for k, v in seconds.items()}
    made = min(50, captures - a)
    marks = row.pop("marks", [])
    print(f"captures {a}..{a + made - 1}: " + " ".join(
        f"{k} {1000 * sum(v) / made:.1f} ms" for k, v in row.items())
        + (f"; {sum(marks) / len(marks):.0f} operations marked a capture" if marks else ""))
