"""A family's sampling, recorded on the GPU and replayed on the host, to price its host work.

``capture_family(derive_every=...)`` spends its time in two places: capturing (the GPU, the
driver, the walk into the IR) and deciding what to capture and derive (``grape.passes.lengths.
derive_lengths``: fitting, checking, comparing: the host alone). The second needs no GPU once
the graphs it was given are known, so a run on the GPU records what ``derive_lengths`` was
asked and given (every capture, second capture and comparison's answer), and this replays it on
any machine: the same calls, the same graphs, the same answers, timed apart from the lookups
that stand in for the GPU. Host work can then be profiled and cut where it ran, on the graphs
of a real model, and the replay says whether the outcome stayed the same (which lengths were
captured, derived, compared) or not.

Recording (on the GPU; ``benchmarks/families.py --record-sampling DIR`` uses it)::

    with recording() as rec:
        family = capture_family(step, lengths, derive_every=16, ...)
    rec.save(folder)          # after timing: the graphs are serialized here, not during

Replaying::

    python benchmarks/sampling_replay.py DIR [--profile FILE] [--out FILE]

A replay whose ``derive_lengths`` asks for a capture or a comparison the recording does not
hold (the host's decisions changed) stops with a line saying which.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grape.errors import GrapeError  # noqa: E402
from grape.ir import KernelGraph  # noqa: E402
from grape.jsonio import check_schema, dump_json, load_json  # noqa: E402
from grape.passes import lengths as lengths_module  # noqa: E402

SCHEMA = "grape-sampling-recording"
VERSION = 1
KEYWORDS = ("every", "checks", "period", "start")  # derive_lengths' numbers that are recorded


def digest(graph: KernelGraph) -> str:
    """A graph's content, as a hash of its IR's JSON: what a comparison was asked about."""
    text = json.dumps(graph.to_json(), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@dataclass
class Call:
    """One ``derive_lengths`` call: its arguments and everything the GPU gave it."""

    lengths: list[int]
    keywords: dict[str, int]
    has_again: bool
    has_verify: bool
    captured: list[tuple[int, KernelGraph]] = field(default_factory=list)
    again: list[tuple[int, KernelGraph]] = field(default_factory=list)
    verified: list[tuple[int, KernelGraph, KernelGraph, bool]] = field(default_factory=list)
    outcome: dict[str, list[int]] = field(default_factory=dict)


def _outcome(sampled: Any) -> dict[str, list[int]]:
    return {"captured": list(sampled.captured), "repeated": list(sampled.repeated),
            "derived": sorted(sampled.derived), "tie_breaks": list(sampled.tie_breaks),
            "verified": [n for n, _, _ in sampled.verified]}


@dataclass
class Recording:
    calls: list[Call] = field(default_factory=list)

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        """``derive_lengths`` as ``real`` with every call's inputs and answers kept (by
        reference: nothing is serialized while the family is timed)."""
        def recorded(capture, lengths, *, again=None, verify=None, **kwargs):
            lengths = list(lengths)
            call = Call(lengths, {k: kwargs[k] for k in KEYWORDS if k in kwargs},
                        again is not None, verify is not None)
            self.calls.append(call)

            def captured(n: int) -> KernelGraph:
                graph = capture(n)
                call.captured.append((n, graph))
                return graph

            def captured_again(n: int) -> KernelGraph:
                graph = again(n)
                call.again.append((n, graph))
                return graph

            def compared(n: int, graph: KernelGraph, first: KernelGraph) -> bool:
                answer = verify(n, graph, first)
                call.verified.append((n, graph, first, answer))
                return answer

            sampled = real(captured, lengths, again=captured_again if again else None,
                           verify=compared if verify else None, **kwargs)
            call.outcome = _outcome(sampled)
            return sampled
        return recorded

    def save(self, folder: Path) -> list[Path]:
        """One gzipped JSON file per call, ``sampling<i>.json.gz`` in ``folder``."""
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for i, call in enumerate(self.calls):
            doc = {"schema": SCHEMA, "version": VERSION, "lengths": call.lengths,
                   "keywords": call.keywords, "has_again": call.has_again,
                   "has_verify": call.has_verify,
                   "captured": [[n, g.to_json()] for n, g in call.captured],
                   "again": [[n, g.to_json()] for n, g in call.again],
                   "verified": [[n, digest(g), digest(first), answer]
                                for n, g, first, answer in call.verified],
                   "outcome": call.outcome}
            written.append(dump_json(folder / f"sampling{i}.json.gz", doc))
        return written


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Record every ``derive_lengths`` call ``grape.torch.family`` makes inside the block."""
    from grape.torch import family

    rec, real = Recording(), family.derive_lengths
    family.derive_lengths = rec.wrap(real)
    try:
        yield rec
    finally:
        family.derive_lengths = real


class Mismatch(GrapeError):
    """The replay asked for something the recording does not hold."""


def replay(path: Path, profile: cProfile.Profile | None = None) -> dict[str, Any]:
    """Run ``derive_lengths`` again over a recorded call; its host seconds (lookups standing
    in for the GPU left out) and whether it came to the recorded outcome."""
    doc = check_schema(load_json(path), SCHEMA, VERSION, GrapeError, f"{path}: ")
    captures = {n: KernelGraph.from_json(g) for n, g in doc["captured"]}
    agains = {n: KernelGraph.from_json(g) for n, g in doc["again"]}
    answers = {(n, g, first): answer for n, g, first, answer in doc["verified"]}
    lookups = [0.0]

    def looked_up(fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                lookups[0] += time.perf_counter() - t
        return timed

    def take(table: dict[int, KernelGraph], what: str) -> Callable[[int], KernelGraph]:
        def got(n: int) -> KernelGraph:
            if n not in table:
                raise Mismatch(f"{path}: the replay asked for a {what} at length {n}, which "
                               f"the recording does not hold (recorded: "
                               f"{sorted(table)[:12]}...)")
            return table[n]
        return got

    def compared(n: int, graph: KernelGraph, first: KernelGraph) -> bool:
        key = (n, digest(graph), digest(first))
        if key not in answers:
            raise Mismatch(f"{path}: the replay asked for a comparison at length {n} that the "
                           f"recording does not hold (the graph compared differs)")
        return answers[key]

    t = time.perf_counter()
    if profile is not None:
        profile.enable()
    try:
        sampled = lengths_module.derive_lengths(
            looked_up(take(captures, "capture")), doc["lengths"],
            again=looked_up(take(agains, "second capture")) if doc["has_again"] else None,
            verify=looked_up(compared) if doc["has_verify"] else None, **doc["keywords"])
    finally:
        if profile is not None:
            profile.disable()
    seconds = time.perf_counter() - t - lookups[0]
    got = _outcome(sampled)
    return {"file": str(path), "lengths": len(doc["lengths"]), **doc["keywords"],
            "captured": len(got["captured"]), "again": len(got["repeated"]),
            "derived": len(got["derived"]), "compared": len(got["verified"]),
            "host_s": round(seconds, 3), "lookups_s": round(lookups[0], 3),
            "same_outcome": got == doc["outcome"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a recording (sampling<i>.json.gz files)")
    parser.add_argument("--profile", type=Path, default=None, metavar="FILE",
                        help="write a cProfile of the host work (pstats format)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the rows as JSON")
    args = parser.parse_args()
    files = sorted(args.folder.glob("sampling*.json.gz"))
    if not files:
        raise SystemExit(f"{args.folder}: expected sampling<i>.json.gz files, found none")
    profile = cProfile.Profile() if args.profile else None
    rows = []
    for path in files:
        try:
            row = replay(path, profile)
        except GrapeError as e:
            raise SystemExit(str(e)) from None
        rows.append(row)
        print(f"{path.name}: {row['lengths']} lengths, {row['captured']} captured "
              f"(+{row['again']} again), {row['derived']} derived, {row['compared']} "
              f"compared; host {row['host_s']:.2f} s; same outcome: {row['same_outcome']}",
              flush=True)
    if profile is not None:
        profile.dump_stats(args.profile)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
