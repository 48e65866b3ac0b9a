"""Why a derivation's held-out checks refuse GPT-2's stretches (GPU).

``benchmarks/families.py --derive-every 2 --derive-period 8`` over KV lengths 1..255 derived 88
lengths in one process on the H200 and none in others: held-out checks differed from the
derived graphs outside the slots found loose. This captures the same family the same way and,
for every held-out check that differed, prints each number that differed (node, kernel, slot,
derived and captured value) and what the derivation knew of it (fitted or not, its template
value), then a count by kernel and number. Full lines go to ``--out`` (JSON).

``--same-places`` / ``--no-same-places``: the family's captures moved to a reference capture's
places or not (default: ``capture_family``'s, on where deriving).

``--decoder ARCH[:SIZE]``: another architecture's decode step (``families.py --decoder``).
``--verify-unread``: ``capture_family``'s running check for unread argument words.
``--keep-samples DIR`` / ``--keep-cuts DIR``: IR files of a derivation's samples and second
captures, or of the graphs either side of the first cuts, to study without a GPU.

``python benchmarks/derive_refusals.py [--lengths 1:255[:stride]] [--max-len N] [--every 2]
[--period 8] [--[no-]same-places] [--decoder ARCH[:SIZE]] [--verify-unread] [--keep-samples DIR]
[--keep-cuts DIR] [--out F]``
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

from grape.ir import fingerprint
from grape.passes.derive import _flatten


def pointer_changes(a, b) -> list[str]:
    """Where two graphs of one topology differ in a kernel's pointers: per node, the pointers
    only one has or whose buffer differs, with the raw words (what a cut by "pointers'
    buffers" hides)."""
    from grape.passes.families import match

    out = []
    pairs = match(a, b)
    for node, op in a.kernels():
        other = b.op(pairs[node])
        mine = {p.offset: p.target for p in op.pointers}
        theirs = {p.offset: p.target for p in other.pointers}
        changed = sorted(o for o in mine.keys() | theirs.keys()
                         if mine.get(o) is None or theirs.get(o) is None
                         or mine[o].buffer != theirs[o].buffer)
        if changed:
            words = [f"@{o}: {mine.get(o)} / {theirs.get(o)} "
                     f"({op.args[o:o + 8].hex()} / {other.args[o:o + 8].hex()})"
                     for o in changed[:4]]
            out.append(f"{node} {op.name[:50]} args {len(op.args)}: {len(changed)} pointers "
                       f"changed: " + "; ".join(words))
    return out


def loose_ends(sampled, d):
    """A function of a derivation's (node, number): where the second captures of its
    topology's smallest and largest sample found the number's slot loose ("both" never holds
    back: such a slot is loose), or "no slot" for a pointer, launch dimension or buffer."""
    from grape.passes.families import match

    small, large, at_small, at_large = sampled.loose_ends[fingerprint(d.template, launch=False)]
    to_small = match(d.template, sampled.graphs[small])
    to_large = match(d.template, sampled.graphs[large])

    def where(node: str, number: str) -> str:
        if node.startswith("buffer:") or not number.startswith("a"):
            return "no slot"
        o = int(number[1:])
        found = (o in at_small.get(to_small[node], ()), o in at_large.get(to_large[node], ()))
        return {(True, True): "both", (True, False): "smallest only",
                (False, True): "largest only", (False, False): "neither"}[found]
    return where


def main() -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from families import decode

    from grape.torch.family import capture_family

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1:255", help="first:last[:stride] KV lengths")
    parser.add_argument("--max-len", type=int, default=None, metavar="N",
                        help="positions of the decode step's cache (families.py's default)")
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--period", type=int, default=8)
    parser.add_argument("--same-places", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--decoder", default=None, metavar="ARCH[:SIZE]",
                        help="another architecture of generate.py (as families.py takes it)")
    parser.add_argument("--verify-unread", action="store_true",
                        help="capture_family's verify_unread: words shown unread by running")
    parser.add_argument("--keep-samples", default=None, metavar="DIR",
                        help="save the samples of the derivation with the most (at most 8, "
                             "spread) and its topology's second captures into DIR (gzipped IR "
                             "files: sample<N>, again<N>), to study leftovers without a GPU")
    parser.add_argument("--keep-cuts", default=None, metavar="DIR",
                        help="save the captured graphs on both sides of the first cuts into "
                             "DIR (gzipped IR files), to look into without a GPU")
    args = parser.parse_args()
    try:
        first, last, stride = (int(x) for x in (args.lengths + ":1").split(":")[:3])
    except ValueError:
        parser.error(f"expected --lengths first:last[:stride], found {args.lengths!r}")
    lengths = list(range(first, last + 1, stride))
    w = decode(1, lengths, args.decoder, **({"max_len": args.max_len} if args.max_len else {}))
    family = capture_family(w.step, sorted(lengths, reverse=True), w.params,
                            derive_every=args.every, derive_period=args.period,
                            prepare=False, same_places=args.same_places,
                            verify_unread=args.verify_unread, progress=print)
    sampled = family.sampled
    rows = []
    for n, differ in sorted(sampled.checked.items()):
        if not differ:
            continue
        d = next((d for d in sampled.derivations if d.lengths[0] < n < d.lengths[-1]
                  and (n - d.lengths[0]) % args.period == 0), None)
        if d is None:
            raise SystemExit(f"no derivation holds held-out length {n}: a bug")
        for node, what, derived, captured in d.differences(n, sampled.graphs[n]):
            op = d.template.op(node)
            template = _flatten(op, d.loose.get(node, frozenset()))[1].get(what)
            rows.append({"length": n, "samples": [d.lengths[0], d.lengths[-1]], "node": node,
                         "kernel": getattr(op, "name", op.kind)[:60], "number": what,
                         "derived": derived, "captured": captured, "template": template,
                         "fitted": (node, what) in d.fits,
                         "loose_slots_of_node": len(d.loose.get(node, ()))})
    print(f"{len(lengths)} lengths: {len(sampled.captured)} captured, {len(sampled.derived)} "
          f"derived, {len(sampled.repeated)} captured again; "
          f"{sum(bool(v) for v in sampled.checked.values())} of {len(sampled.checked)} "
          f"held-out checks differed, in {len(rows)} numbers; host words made loose: "
          f"{sampled.host_words}")
    # What kept lengths from any derivation, trusted or refused: per derivation, the numbers
    # whose stretches leave lengths between its samples (in its class) underived.
    gaps = collections.Counter()
    ends = collections.Counter()  # held-back numbers by where a second capture found them loose
    for d in sampled.derivations:
        inside = [n for n in lengths if d.lengths[0] < n < d.lengths[-1]
                  and (n - d.lengths[0]) % args.period == 0]
        if not inside:
            continue
        held = d.holding_back(inside, by_node=True)
        kernel = {node: node if node.startswith("buffer:") else getattr(
            d.template.op(node), "name", node) for node, _ in held}
        for (node, number), count in held.items():
            gaps[kernel[node], number] += count
        loose_where = loose_ends(sampled, d)
        for node, number in held:
            ends[loose_where(node, number)] += 1
        for (node, number), count in held.most_common(3):
            forms = d.quotients.get((node, number), ())
            print(f"  uncovered {count} of {len(inside)} in {d.lengths[0]}..{d.lengths[-1]}: "
                  f"{number} of {kernel[node][:50]}: " + "; ".join(
                      f"{g.first}..{g.last} {g.intercept}+{g.slope}n ({g.support})"
                      for g in d.fits[node, number])
                  + "; as quotients: " + (", ".join(
                      f"{q.intercept:+d}+{q.scale}*ceil({q.source}/{q.low}..{q.high})"
                      for q in forms) or "none"))
    print(f"numbers leaving lengths underived (kernel, number: lengths): {gaps.most_common(25)}")
    print(f"those numbers (per derivation) by where a second capture found them loose: "
          f"{dict(ends)}")
    # Reasons with their numbers (nodes, lengths) made alike, so that alike ones count together.
    reasons = collections.Counter(re.sub(r"[0-9]+", "N", why) for *_, why in sampled.cuts)
    print(f"cuts: {reasons.most_common(10)}")
    print(f"first cuts: {sampled.cuts[:4]}")
    if args.verify_unread:
        shown = [(d.lengths[0], d.lengths[-1], sum(map(len, d.unread.values())))
                 for d in sampled.derivations if d.unread]
        print(f"runs to show slots unread: {sampled.verified}; derivations with slots shown "
              f"unread (first, last, slots): {shown}")
    for a, b, _ in sampled.cuts[:4]:
        for line in pointer_changes(sampled.graphs[a], sampled.graphs[b])[:6]:
            print(f"  {a}->{b} {line}")
    if args.keep_samples and sampled.derivations:
        os.makedirs(args.keep_samples, exist_ok=True)
        d = max(sampled.derivations, key=lambda d: len(d.lengths))
        spread = d.lengths[::max(1, -(-len(d.lengths) // 8))]
        for n in sorted({*spread, d.lengths[-1]}):
            sampled.graphs[n].save(os.path.join(args.keep_samples, f"sample{n}.ir.json.gz"))
        small, large, *_ = sampled.loose_ends[fingerprint(d.template, launch=False)]
        for n in (small, large):
            sampled.again[n].save(os.path.join(args.keep_samples, f"again{n}.ir.json.gz"))
            sampled.graphs[n].save(os.path.join(args.keep_samples, f"sample{n}.ir.json.gz"))
    if args.keep_cuts:
        os.makedirs(args.keep_cuts, exist_ok=True)
        for n in sorted({n for a, b, _ in sampled.cuts[:3] for n in (a, b)}):
            sampled.graphs[n].save(os.path.join(args.keep_cuts, f"length{n}.ir.json.gz"))
    for r in rows[:40]:
        print(json.dumps(r))
    counts = collections.Counter((r["kernel"][:40], r["number"], r["fitted"]) for r in rows)
    for (kernel, number, fitted), count in counts.most_common(20):
        print(f"  {count:4d}  {number:8s} fitted={fitted!s:5s} {kernel}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    family.close()


if __name__ == "__main__":
    main()
