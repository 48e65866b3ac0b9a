"""Which of a family's lengths to capture, which to derive, and the checks that decide.

:func:`derive_lengths` is the procedure a family's capture runs (``grape.torch.family.
capture_family(derive_every=...)``) over the forms of ``grape.passes.derive``: capture every few
lengths of each residue class, fit the numbers that vary (:func:`grape.passes.derive.derive`),
check each trusted stretch against a held-out capture, capture again where two forms part, find
the slots a second capture shows loose and those running shows unread, and capture what no
stretch covers. :class:`Sampled` says how each length was had, and why the others were not
derived. Kept apart from the forms themselves, which need no captures to test.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from itertools import pairwise

from grape.errors import GrapeError, GraphError
from grape.ir import Kernel, KernelGraph, Op, fingerprint
from grape.passes.derive import (
    _ADDRESS_HIGH,
    MIN_SUPPORT,
    TIE_BREAKS,
    Derivation,
    Slots,
    _both,
    _differs,
    _flatten,
    _u32,
    derive,
    loose_slots,
    stray_slots,
)
from grape.passes.families import match, structure
from grape.passes.memo import remembering

__all__ = ["Graphs", "Sampled", "derive_lengths"]


class Graphs(MutableMapping):
    """Graphs by length: captured ones kept, derived ones made from their derivation each time
    one is asked for (a family places derived lengths from their rows alone,
    :func:`place_derived`, and never needs their whole graph)."""

    def __init__(self) -> None:
        self.captured: dict[int, KernelGraph] = {}
        self.derived: dict[int, Derivation] = {}

    def __getitem__(self, length: int) -> KernelGraph:
        if length in self.captured:
            return self.captured[length]
        return self.derived[length].graph_at(length)

    def __setitem__(self, length: int, graph: KernelGraph) -> None:
        self.captured[length] = graph

    def __delitem__(self, length: int) -> None:
        if length in self.captured:
            del self.captured[length]
        else:
            del self.derived[length]

    def __contains__(self, length: object) -> bool:
        return length in self.captured or length in self.derived

    def __iter__(self) -> Iterator[int]:
        yield from self.captured
        yield from (n for n in self.derived if n not in self.captured)

    def __len__(self) -> int:
        return len(self.captured.keys() | self.derived.keys())


@dataclass
class Sampled:
    """Graphs at every length asked for, and how each was had (see :func:`derive_lengths`)."""

    graphs: Graphs = field(default_factory=Graphs)
    captured: list[int] = field(default_factory=list)  # in the order captured
    derived: list[int] = field(default_factory=list)
    checked: dict[int, list[str]] = field(default_factory=dict)  # held-out length -> differing
    refused: list[tuple[int, int]] = field(default_factory=list)  # stretches a check refuted
    # Neighbouring captured lengths nothing is derived across, and why (a change of topology or
    # kernel, or buffers that differ): what to read when fewer lengths were derived than hoped.
    cuts: list[tuple[int, int, str]] = field(default_factory=list)
    # Each length's fingerprint(launch=False), computed once (thousands of nodes take a while).
    topologies: dict[int, str] = field(default_factory=dict)
    # Lengths captured a second time to find loose slots (not in ``captured``; in ``again``).
    repeated: list[int] = field(default_factory=list)
    # Each derived length's derivation's template (a captured length): the derived graph has
    # that graph's nodes and edges, so what matches the one matches the other.
    derived_from: dict[int, int] = field(default_factory=dict)
    # Words a held-out check found holding other host addresses than the samples (held-out
    # length, node, byte offset), made loose (``_host_words``).
    host_words: list[tuple[int, str, int]] = field(default_factory=list)
    # Every derivation made, trusted or refused: what to read where a check refused one
    # (``Derivation.differences`` at the lengths in ``checked``).
    derivations: list[Derivation] = field(default_factory=list)
    # Inside trusted derivations' stretches, the lengths each number left underived
    # (``Derivation.holding_back``): what to read where few lengths derived.
    held_back: Counter[tuple[str, str]] = field(default_factory=Counter)
    # Lengths captured where two forms fitting the samples parted (``Derivation.disputed``).
    tie_breaks: list[int] = field(default_factory=list)
    # Per topology: its smallest and largest sample, and the slots each one's second capture
    # found loose, by each one's nodes (a slot is loose only at both): what to read where
    # leftovers held lengths back.
    loose_ends: dict[str, tuple[int, int, dict[str, Slots], dict[str, Slots]]] = field(
        default_factory=dict)
    again: dict[int, KernelGraph] = field(default_factory=dict)  # those second captures
    # Derivations a finer sampling of their stretch replaced, each with whether a held-out
    # check had refuted it (``start``); not in ``derivations``.
    superseded: list[tuple[Derivation, bool]] = field(default_factory=list)
    # ``verify``'s calls: (length, what it compared, its answer), what it compared being
    # "unread slots" (a sample with candidate slots swapped for the template's bytes) or
    # "derived" (a held-out length's derived graph against its capture).
    verified: list[tuple[int, str, bool]] = field(default_factory=list)


def _runs(graphs: Mapping[int, KernelGraph], cuts: list[tuple[int, int, str]] | None = None,
          seen: dict[tuple[int, int], str | None] | None = None,
          prints: dict[int, str] | None = None, known: dict | None = None
          ) -> list[list[int]]:
    """Captured lengths, ascending, cut wherever the next one's graph differs in more than
    numbers (another topology, another kernel function): lengths between two runs belong to
    neither, so nothing is derived across a change. Each cut's lengths and reason are appended
    to ``cuts`` where given; ``seen`` keeps what neighbouring pairs gave (comparing two graphs
    of thousands of nodes takes a while, and refinement asks again and again), ``prints``
    each length's topology and ``known`` the topologies by structure (:func:`_topology`)."""
    seen = {} if seen is None else seen
    prints = {} if prints is None else prints
    known = {} if known is None else known
    runs: list[list[int]] = []
    last_topology = None
    for n in sorted(graphs):
        if n not in prints:
            prints[n] = _topology(graphs[n], known)
        topology = prints[n]
        why: str | None = "another topology"
        if runs and topology == last_topology:
            pair = (runs[-1][-1], n)
            if pair not in seen:
                seen[pair] = _differs(graphs[pair[0]], pair[0], graphs[n], n)
            why = seen[pair]
            if why is None:
                runs[-1].append(n)
                continue
        if runs and cuts is not None:
            previous = runs[-1][-1]
            if why == "another topology":
                why = (f"another topology ({len(graphs[previous].dag)} nodes, then "
                       f"{len(graphs[n].dag)})")
            cuts.append((previous, n, why))
        runs.append([n])
        last_topology = topology
    return runs


def _topology(graph: KernelGraph, known: dict) -> str:
    """``fingerprint(graph, launch=False)``, found again without hashing where an earlier
    graph had the same nodes (ids and kinds) and edges (``known``: fingerprints by that
    :func:`structure`): the walk names one step's nodes alike in every capture, and a Llama
    step's 1,086 nodes took 36 ms a fingerprint (an H100, profiled). A graph with a
    conditional node (whose bodies are part of its topology) is hashed."""
    key = structure(graph)
    if key is None:
        return fingerprint(graph, launch=False)
    if key not in known:
        known[key] = fingerprint(graph, launch=False)
    return known[key]


def _refine(want: list[int], graphs: Mapping[int, KernelGraph],
            take: Callable[[int], KernelGraph], seen: dict[tuple[int, int], str | None],
            prints: dict[int, str], known: dict) -> None:
    """Capture more lengths where the samples alone cannot carry a derivation: between two runs
    (a change of topology or kernel somewhere in the gap: bisected until the change lies between
    neighbouring lengths, so each run reaches it) and inside a run of fewer than MIN_SUPPORT
    samples (its widest gap halved until it has the support or no gap is left).

    Without this, a model whose kernels change every few lengths (small GPT-2 models pick
    another attention or GEMM kernel every few KV lengths) leaves runs of one or two samples,
    and nothing is derived at all. Each change costs about log2(every) captures."""
    while True:
        runs = _runs({n: graphs[n] for n in want if n in graphs}, seen=seen, prints=prints,
                     known=known)
        todo = set()
        for left, right in pairwise(runs):
            todo.add(_middle([n for n in want if left[-1] < n < right[0]]))
        for run in runs:
            if 1 < len(run) < MIN_SUPPORT:
                gaps = [[n for n in want if a < n < b] for a, b in pairwise(run)]
                todo.add(_middle(max(gaps, key=len)))
        todo.discard(None)
        if not todo:
            return
        for n in sorted(todo, reverse=True):
            take(n)


def _middle(lengths: list[int]) -> int | None:
    return lengths[len(lengths) // 2] if lengths else None


def _spread(candidates: list[int], k: int) -> list[int]:
    """``k`` of ``candidates`` (ascending), spread evenly across them."""
    if k <= 0 or not candidates:
        return []
    if k >= len(candidates):
        return candidates
    return sorted({candidates[(2 * i + 1) * len(candidates) // (2 * k)] for i in range(k)})


@remembering()  # samples matched and fitted again in every round, check and comparison
def derive_lengths(capture: Callable[[int], KernelGraph], lengths: Iterable[int], *,
                   every: int = 8, checks: int = 1, period: int = 1,
                   progress: Callable[[str], None] = lambda line: None,
                   again: Callable[[int], KernelGraph] | None = None,
                   verify: Callable[[int, KernelGraph, KernelGraph], bool] | None = None,
                   start: int | None = None) -> Sampled:
    """The graphs at ``lengths``, most derived rather than captured.

    ``capture(n)`` gives the graph at length ``n``. The lengths are split into their residue
    classes modulo ``period``, and each class is handled on its own: PyTorch picks kernels by a
    length's alignment (on the H200 a small GPT-2's attention took another path at every KV
    length 7 mod 8), so a class of lengths ``period`` apart keeps one path where the lengths
    themselves alternate, and a number rounded up to a multiple of ``period`` is affine within
    a class. In each class, ``capture`` is called for every ``every``-th length and the last,
    largest first (a family's pool then holds the largest shape's memory), then for
    ``checks`` lengths per stretch that a derivation covers but no sample is at (held-out
    checks: a stretch whose derived graph differs from the captured one in any byte but loose
    ones is refused, and its lengths are captured), and last for every length no trusted
    stretch covers. The smallest and largest sample of each topology are captured once more
    to find its loose slots (:func:`loose_slots`; a slot is loose only where it is loose at
    both, so a slot PyTorch fills at some lengths and not at others is fitted, and where it
    holds no number, not derived). ``again(n)`` makes those second captures (default:
    ``capture``): best from where the host's leftovers differ (``capture_family`` captures them
    on another thread, ``grape.torch.capture.on_another_thread``), since a word PyTorch leaves
    unfilled holds the same leftover in two captures on one thread, and only a second capture
    that differs there finds it loose.

    What a held-out check cannot see, it cannot refuse: a number that leaves its line between
    two samples and returns to it (a kernel chosen for a few lengths only) is derived wrongly
    there. Samples closer together (smaller ``every``) and more ``checks`` narrow that.

    ``start`` (at least ``every``; default ``every``): sample each class one length in
    ``start`` first, and finer only where that leaves lengths underived, in rounds: a run a
    held-out check refutes has every gap wider than ``every`` halved, a trusted run the gaps
    that hold lengths it does not derive; a run whose samples did not change keeps what it
    settled, and a refuted check's capture is a sample of the finer run. Where nothing needs
    it, a class then costs its samples one in ``start``, not one in ``every`` (a CPU test:
    12 captures for 1,024 lengths at 128 where 8 took 132). The price is the paragraph
    above's, ``start`` apart: a number off its line for fewer lengths than the samples are
    apart is seen only where a sample or check lands on it (a CPU test: ten lengths derived
    wrong at 128, none at 8). Running derived lengths against the step run eagerly, to buy
    that evidence back without captures, was tried on an H100 and did not work: the eager
    step's bits differed from its own capture's (GPT-2 and Llama steps), so eager is no
    bitwise reference (benchmarks/README.md, "Sampling coarse first").

    ``verify(n, graph, captured)``, where given, says whether running ``graph`` leaves what
    running ``captured`` (the capture at length ``n``) leaves, bit for bit: it lets words that
    no second capture finds loose be shown unread by running instead (:func:`_unread`). On the
    H200 a Llama-shaped decoder's argument structs held such words (offset calculators past
    their dimensions, unused entries, padding) that switch between a few values with the
    host's history, so that no length derived (``tests/test_llama_leftovers.py``). Where a
    derivation's underived lengths are held back only by argument slots that no form of the
    length explains, each sample where such a slot differs from the template is run with the
    template's bytes there; the slots with which it runs as its capture does (halved until
    the ones the kernels read are found) are loose (``Derivation.unread``), and every
    held-out check is then run as well as compared. A held-out check that differs from its
    capture in argument words only (words every sample held alike: on the H200, ReduceOp
    fields of a Llama step) is run too, and where it runs as its capture does those words
    are shown unread as well, not refused.

    Raises
    ------
    GrapeError
        ``every`` or ``period`` below 1, ``checks`` below 0, ``start`` below ``every``, or
        no lengths.
    """
    want = sorted(set(lengths))
    start = every if start is None else start
    if not want or every < 1 or checks < 0 or period < 1 or start < every:
        raise GrapeError(f"expected lengths, every >= 1, checks >= 0, period >= 1 and start >= "
                         f"every, found {len(want)} lengths, every={every}, checks={checks}, "
                         f"period={period}, start={start}")
    if checks == 0:
        # A regular staircase sampled once a step lies on a line: a pointer jumping every 40
        # lengths, sampled every 32, derived 93 lengths of 256, all wrong (a CPU test).
        warnings.warn("derive_lengths with checks=0: no derived stretch is checked against a "
                      "capture, and a number that steps as often as the samples do derives "
                      "wrongly; give checks >= 1", stacklevel=2)
    out = Sampled()
    # The captured lengths derivations are fitted to. A held-out check is one only once its
    # stretch is sampled again, finer: it then stands where a capture was needed anyway.
    samples: set[int] = set()

    def take(n: int) -> KernelGraph:
        out.graphs[n] = capture(n)
        out.captured.append(n)
        if len(out.captured) % 10 == 0:
            progress(f"captured {len(out.captured)} lengths")
        return out.graphs[n]

    def sample(n: int) -> KernelGraph:
        samples.add(n)
        return out.graphs[n] if n in out.graphs else take(n)

    sampled = _Subset(out.graphs, samples)
    classes = [c for c in ([n for n in want if n % period == r] for r in range(period)) if c]
    for n in sorted({n for c in classes for n in c[::start] + c[-1:]}, reverse=True):
        sample(n)
    seen: dict[tuple[int, int], str | None] = {}
    known: dict[tuple, str] = {}  # topologies by structure (_topology)
    loose = _LooseByTopology(out, again or capture)

    def settle(c: list[int], run: list[int]) -> tuple[Derivation, bool, list[int]]:
        """``run``'s derivation, after the captures where its forms part, the runs that show
        slots unread and its held-out checks: (derivation, whether a check refuted it, the
        run with the captures where forms parted)."""
        d = derive({n: out.graphs[n] for n in run}, loose(run[0]))
        for _ in range(TIE_BREAKS):
            # Where two forms both fit the samples and part between them (samples one a
            # staircase's step apart lie on a line too), a capture where they part says which
            # holds; the one it refutes is dropped when the run is derived again.
            n = _middle(d.disputed(n for n in c if d.lengths[0] < n < d.lengths[-1]
                                   and n not in out.graphs))
            if n is None:
                break
            out.tie_breaks.append(n)
            if (why := _differs(out.graphs[run[0]], run[0], take(n), n)) is not None:
                # Not one structure there after all: the run spans a change its samples
                # missed, and no derivation of it holds across that. Refuted (sampled finer,
                # where the change is then found, or refused), never trusted over it.
                samples.add(n)
                out.checked[n] = [f"a capture where forms parted: {why}"]
                out.derivations.append(d)
                out.refused.append((d.lengths[0], d.lengths[-1]))
                return d, True, run
            samples.add(n)
            run = sorted([*run, n])
            d = derive({m: out.graphs[m] for m in run}, loose(run[0]))
        if verify is not None:
            d = _unread(d, [n for n in c if d.lengths[0] < n < d.lengths[-1]
                            and n not in out.graphs], out, verify)
        out.derivations.append(d)
        inside = d.covered(n for n in c if d.lengths[0] < n < d.lengths[-1]
                           and n not in out.graphs)
        refuted = False
        for n in _spread(inside, checks):
            captured = take(n)
            out.checked[n] = d.check(n, captured)
            if out.checked[n] and (words := _host_words(d, n, captured)):
                for node, offset in words:
                    d.loose[node] = d.loose.get(node, frozenset()) | {offset, offset + 4}
                    out.host_words.append((n, node, offset))
                out.checked[n] = d.check(n, captured)
            if verify is not None and out.checked[n] and (
                    words := _argument_words(d, n, captured, out.checked[n])):
                # Words every sample held alike and this length not: leftovers too (run 43,
                # H200: ReduceOp fields of a Llama step's RMS norms), or words a kernel reads.
                # Running the derived graph as the capture runs tells which.
                agrees = verify(n, d.graph_at(n), captured)
                out.verified.append((n, "held-out words", agrees))
                if agrees:
                    d = out.derivations[-1] = _shown_unread(d, words, out)
                    out.checked[n] = d.check(n, captured)
            elif d.unread and not out.checked[n]:
                # The bytes agree but for slots only running showed unread: run it too.
                agrees = verify(n, d.graph_at(n), captured)
                out.verified.append((n, "derived", agrees))
                if not agrees:
                    out.checked[n] = sorted(d.unread)
            refuted = refuted or bool(out.checked[n])
        if refuted:
            out.refused.append((d.lengths[0], d.lengths[-1]))
        return d, refuted, run

    # Sampled at ``start``, then finer where the samples leave lengths underived, down to
    # ``every``: each round settles the runs its samples make (a run whose samples did not
    # change keeps what it settled), and halves the gaps wider than ``every`` in the runs a
    # check refuted (all of them) or whose lengths are held back (those holding them).
    settled: dict[tuple[int, ...], tuple[Derivation, bool, list[int]]] = {}
    while True:
        for c in classes:
            _refine(c, sampled, sample, seen, out.topologies, known)
        runs = [(c, run) for c in classes
                for run in _runs(_Subset(out.graphs, samples & set(c)), seen=seen,
                                 prints=out.topologies, known=known)
                if len(run) >= MIN_SUPPORT]
        loose.learn([run for _, run in runs])
        finer: set[int] = set()
        again = False  # a run superseded: the next round settles what replaces it
        for c, run in runs:
            if tuple(run) not in settled:
                settled[tuple(run)] = result = settle(c, run)
                settled[tuple(result[2])] = result  # with its tie-breaks: the next round's run
            d, refuted, run = settled[tuple(run)]
            wide = [(a, b) for a, b in pairwise(run) if sum(a < n < b for n in c) >= every]
            if not refuted:
                under = set(n for n in c if run[0] < n < run[-1] and n not in out.graphs)
                under -= set(d.covered(under))
                wide = [(a, b) for a, b in wide if any(a < n < b for n in under)]
            # A sample inside the run's span that the run does not hold (a capture where its
            # forms parted, of another structure): the samples cut the span anew next round.
            reshaped = any(run[0] < n < run[-1] for n in samples.difference(run) if n in c)
            if wide or reshaped:
                again = True
                del out.derivations[next(i for i, e in enumerate(out.derivations) if e is d)]
                out.superseded.append((d, refuted))
                if refuted:  # not refused for good: its stretch is sampled again
                    out.refused.remove((d.lengths[0], d.lengths[-1]))
                finer.update(_middle([n for n in c if a < n < b]) for a, b in wide)
                # Its held-out checks are captures already: samples of the finer run (a
                # refuting one where the forms it refuted fail)
                samples.update(n for n in out.checked if run[0] < n < run[-1] and n in c)
        if not again:
            break
        if finer:
            progress(f"sampling finer: {len(finer)} lengths where {len(samples)} samples left "
                     f"lengths underived")
        for n in sorted(finer, reverse=True):
            sample(n)
    trusted = [(c, settled[tuple(run)][0]) for c, run in runs if not settled[tuple(run)][1]]
    # What each trusted derivation covers, found for all its lengths at once, and what held
    # back the lengths inside it that it does not.
    covering = []
    for c, d in trusted:
        covered, held = d.coverage(n for n in c if d.lengths[0] <= n <= d.lengths[-1]
                                   and n not in out.graphs)
        covering.append((d, set(covered)))
        out.held_back.update(held)
    for n in want:
        if n in out.graphs:
            continue
        d = next((d for d, lengths in covering if n in lengths), None)
        if d is None:
            take(n)
        else:
            out.graphs.derived[n] = d
            out.derived.append(n)
            out.derived_from[n] = d.lengths[0]
            out.topologies[n] = out.topologies[d.lengths[0]]  # numbers differ, nothing else
    # The cuts between captured lengths (their pairs were compared already, in ``seen``).
    captured = set(out.captured)
    for c in classes:
        _runs({n: out.graphs[n] for n in c if n in captured}, out.cuts, seen, out.topologies,
              known)
    held = ""
    if out.held_back:
        (kernel, number), count = out.held_back.most_common(1)[0]
        held = (f"; most held back by {number} of {kernel[:48]} ({count} lengths inside "
                f"trusted stretches left underived)")
    unread = ""
    if out.verified:
        shown = sum(bool(d.unread) for d in out.derivations)
        unread = (f"; {len(out.verified)} runs to show slots unread, {shown} derivations "
                  f"with slots shown so")
    if out.superseded:
        unread += f"; {len(out.superseded)} stretches sampled finer"
    progress(f"{len(want)} lengths: {len(out.captured)} captured "
             f"(and {len(out.repeated)} again for loose slots; {len(out.tie_breaks)} where two "
             f"forms parted{unread}), {len(out.derived)} derived, "
             f"{len(out.refused)} stretches refused by a check, {len(out.cuts)} changes{held}")
    return out


def _unread_candidates(d: Derivation, inside: list[int]) -> dict[str, Slots] | None:
    """The argument slots that leave lengths of ``inside`` underived and that no form of the
    length explains, by template node: words a kernel might not read. A slot is explained
    where every sample of it lies on a stretch of three or more samples and one stretch has a
    slope, or where it is a rounded-up quotient of an explained number; what else holds
    lengths back (a pointer's offset, a launch dimension, a copy, a buffer, an explained
    slot) is left to the held-out checks. None where no slot is a candidate."""
    held = d.holding_back(inside, by_node=True)
    words = {(node, what) for node, what in held
             if not node.startswith("buffer:") and what.startswith("a") and what[1:].isdigit()}
    # A leftover that switches between a few host values can lie on a line across three
    # samples by chance; its other samples lie on no stretch, which a length's function does
    # not do. (H200, run 45: a Llama step's a356 held 696 lengths back without a run.)
    unexplained = {key for key in words - d.quotients.keys()
                   if not (any(g.slope != 0 and g.support >= MIN_SUPPORT for g in d.fits[key])
                           and all(g.support >= MIN_SUPPORT for g in d.fits[key]))}
    # A quotient of another slot explains a number only where that slot is explained: on the
    # H200 a Llama step's leftover word held the one before it plus one, an odd number, which
    # "is" twice its half rounded up.
    quotients = {key for key in words if key in d.quotients}
    while grown := {(node, what) for node, what in quotients
                    if all((node, q.source) in unexplained for q in d.quotients[node, what])}:
        unexplained |= grown
        quotients -= grown
    out: dict[str, set[int]] = {}
    for node, what in unexplained:
        out.setdefault(node, set()).add(int(what[1:]))
    return {node: frozenset(slots) for node, slots in out.items()} or None


def _swapped(op: Op, template: Op, slots: Slots) -> Op:
    """``op`` with the bytes of ``slots`` taken from ``template`` (one kernel's two versions)."""
    args = bytearray(op.args)
    for o in slots:
        args[o:o + 4] = template.args[o:o + 4]
    return dataclasses.replace(op, args=bytes(args))


def _unread(d: Derivation, inside: list[int], out: Sampled,
            verify: Callable[[int, KernelGraph, KernelGraph], bool]) -> Derivation:
    """``d`` derived again with those of its candidate unread slots (:func:`_unread_candidates`)
    that running shows unread loose: at samples where some of them differ from the template
    (the one where most not yet shown differ first, until each has differed at one), the
    captured graph with the template's bytes in them must run as the captured graph does
    (``verify``). Where it does not, the slots are
    halved until each part runs alike or is one slot, which the kernel reads: that one stays
    fitted (:func:`_agreeing`). A derived graph holds the template's bytes in the slots shown
    unread, as the samples showed harmless. Slots shown unread in a trusted derivation of
    another class, on the same kernel in the same place, count as shown without a run
    (:func:`_shown_elsewhere`). ``d`` itself where no slot is shown so."""
    candidates = _unread_candidates(d, inside)
    if not candidates:
        return d
    template = d.template
    kept = {(node, o) for node, slots in candidates.items() for o in slots}
    # Slots running showed unread in a trusted derivation of another class, on the same
    # kernel in the same place, are not run again: a kernel that ignores a word of its
    # arguments ignores it whatever the length (a class's derived lengths rest on that too),
    # and this derivation's held-out checks still run. (On the H200, run 55: the Llama
    # shape's two classes ran 16 comparisons each for much the same leftovers.)
    shown: set[tuple[str, int]] = kept & _shown_elsewhere(d, out)
    samples = []  # (length, graph, template node -> its node, the kept slots differing there)
    for n in d.lengths[1:]:
        graph = out.graphs[n]
        pairs = match(template, graph)
        samples.append((n, graph, pairs, {
            (node, o) for node, o in kept
            if graph.op(pairs[node]).args[o:o + 4] != template.op(node).args[o:o + 4]}))
    while samples and not shown >= kept:
        # The sample where most slots not yet shown differ first, the earliest of equals (a
        # greedy cover: each slot needs one run where it differs; on the H200's Llama bench
        # samples, four runs where taking samples in order took five).
        best = max(samples, key=lambda sample: len((sample[3] & kept) - shown))
        n, graph, pairs, differ = best
        differing = differ & kept
        if not differing - shown:
            break
        samples.remove(best)

        def agrees(slots: Iterable[tuple[str, int]], n: int = n, graph: KernelGraph = graph,
                   pairs: Mapping[str, str] = pairs) -> bool:
            by_node: dict[str, set[int]] = {}
            for node, o in slots:
                by_node.setdefault(node, set()).add(o)
            swapped = graph.with_ops({
                pairs[node]: _swapped(graph.op(pairs[node]), template.op(node), frozenset(os))
                for node, os in by_node.items()})
            alike = verify(n, swapped, graph)
            out.verified.append((n, "unread slots", alike))
            return alike

        if not agrees(differing):
            part = _agreeing(sorted(differing), agrees)
            if part and not agrees(part):
                return d  # each half alike, not together: nothing shown
            kept -= differing - part
            differing = part
        shown |= differing
    kept &= shown  # a slot that never differed from the template was never run: not shown
    unread: dict[str, Slots] = {}
    for node, o in kept:
        unread[node] = unread.get(node, frozenset()) | {o}
    return _shown_unread(d, unread, out)


def _shown_elsewhere(d: Derivation, out: Sampled) -> set[tuple[str, int]]:
    """The slots that running showed unread in the trusted derivations made before ``d``, as
    (node of ``d``'s template, offset), where their node runs the same kernel as ``d``'s in
    that place (a graph of the same structure)."""
    refused = set(out.refused)
    found: set[tuple[str, int]] = set()
    stood = [*out.derivations, *(e for e, refuted in out.superseded if not refuted)]
    for e in stood:
        if not e.unread or (e.lengths[0], e.lengths[-1]) in refused:
            continue
        try:
            pairs = match(e.template, d.template)
        except GraphError:
            continue  # another structure: no node of it is in d's place
        for node, slots in e.unread.items():
            theirs, mine = e.template.op(node), d.template.op(pairs[node])
            if (isinstance(mine, Kernel) and isinstance(theirs, Kernel)
                    and mine.function == theirs.function and len(mine.args) == len(theirs.args)):
                found |= {(pairs[node], o) for o in slots}
    return found


def _shown_unread(d: Derivation, unread: Mapping[str, Slots], out: Sampled) -> Derivation:
    """``d`` derived again with ``unread`` (template node -> argument slots, shown unread by
    running) loose as well; ``d`` itself where there are none."""
    if not any(unread.values()):
        return d
    unread = {node: d.unread.get(node, frozenset()) | unread.get(node, frozenset())
              for node in d.unread.keys() | unread.keys()}
    loose = {node: d.loose.get(node, frozenset()) | unread.get(node, frozenset())
             for node in d.loose.keys() | unread.keys()}
    again = derive({n: out.graphs[n] for n in d.lengths}, loose)
    again.unread = unread
    return again


def _argument_words(d: Derivation, length: int, captured: KernelGraph, checked: list[str]
                    ) -> dict[str, Slots]:
    """The argument slots where ``captured`` (a held-out length) differs from ``d``'s derived
    graph, by template node, when every difference is one (no pointer, launch dimension,
    copy, buffer or change of kernel): what running may show unread. Empty otherwise.
    ``checked``: what ``d.check`` found there (its buffers, which ``differences`` leaves out)."""
    if any(what.startswith("buffer:") for what in checked):
        return {}
    out: dict[str, set[int]] = {}
    for node, what, _, _ in d.differences(length, captured):
        if not (what.startswith("a") and what[1:].isdigit()):
            return {}
        out.setdefault(node, set()).add(int(what[1:]))
    return {node: frozenset(slots) for node, slots in out.items()}


def _agreeing(items: list[tuple[str, int]],
              agrees: Callable[[Iterable[tuple[str, int]]], bool]) -> set[tuple[str, int]]:
    """Of ``items``, which together run otherwise, those that run alike, found by halving: a
    half that runs alike is kept whole, one that does not is halved again, down to single
    items, which the kernel reads and are dropped. About two runs a read item per halving."""
    if len(items) == 1:
        return set()
    out: set[tuple[str, int]] = set()
    for part in (items[:len(items) // 2], items[len(items) // 2:]):
        out |= set(part) if agrees(part) else _agreeing(part, agrees)
    return out


def _host_words(d: Derivation, length: int, captured: KernelGraph) -> list[tuple[str, int]]:
    """The argument words where ``captured`` (a held-out length) differs from ``d``'s derived
    graph, when every difference is one: a word no sample's fit covers (the same at every
    sample), that holds a user-space address in one of the two and lies under no pointer into
    the graph's memory (no size or stride of these kernels reaches 2**40), or a stray pointer
    (:func:`stray_slots`) the samples held as a pointer and this length not, or the reverse.
    Measured on the H200 (``benchmarks/derive_refusals.py``): an elementwise kernel's unfilled
    slot held one heap address at every sample of a family and another at lengths captured
    later, the same in two captures of one length, so no pair of captures finds it loose. Such
    a word is the host stack's leftover: the samples themselves, captured graphs, hold the
    template's value there, so a derived graph holding it is as right as they are. Empty where
    any difference is something else: the check then refuses."""
    derived = d.graph_at(length)
    pairs = match(derived, captured)
    words: set[tuple[str, int]] = set()
    for node, what, _, _ in d.differences(length, captured):
        mine, theirs = derived.op(node), captured.op(pairs[node])
        loose = d.loose.get(node, frozenset())
        # A stray pointer (the module): one at the samples, an address outside the graph here,
        # or the reverse. A pointer whose offset the samples fitted is a real one.
        stray = stray_slots((mine, theirs)) - loose
        strays = {p.offset for p in (*mine.pointers, *theirs.pointers) if p.offset in stray}
        if any((node, f"p{o}") in d.fits or (node, f"w{o}") in d.fits for o in strays):
            return []
        if what == "pointers' buffers":
            if _flatten(mine, loose | stray, fixed_only=True) \
                    != _flatten(theirs, loose | stray, fixed_only=True):
                return []
            words.update((node, o) for o in strays)
            continue
        if what[:1] in ("w", "p", "a") and what[1:].isdigit() and int(what[1:]) in stray:
            continue  # the stray word itself, read as a pointer on one side, numbers on the other
        if not what.startswith("a") or (node, what) in d.fits:
            return []
        offset = int(what[1:]) - int(what[1:]) % 8
        if offset + 8 > len(mine.args) or any(
                offset - 8 < p.offset < offset + 8 for p in (*mine.pointers, *theirs.pointers)):
            return []
        # In either: a slot that held an address at the samples and zero later, or the
        # reverse (measured: an index kernel's slot, 0 at every sample, 0x7f21 later).
        if not any(_u32(op.args, offset + 4) in _ADDRESS_HIGH for op in (mine, theirs)):
            return []
        words.add((node, offset))
    return sorted(words)


class _LooseByTopology:
    """The slots loose in each topology's graphs: the smallest and largest sampled length of
    each topology :meth:`learn` is shown are captured again (counted in ``out.repeated``),
    and a slot is loose where it is loose at both (:func:`loose_slots`). A topology learns its
    ends once, from the first runs that show it (a later round's finer samples lie between
    them); calling the object gives the slots for any graph of a learnt topology, by its own
    nodes."""

    def __init__(self, out: Sampled, capture: Callable[[int], KernelGraph]) -> None:
        self.out, self.capture = out, capture
        self.found: dict[str, tuple[KernelGraph, dict[str, Slots]]] = {}

    def learn(self, runs: list[list[int]]) -> None:
        out = self.out
        ends: dict[str, list[int]] = {}
        for run in runs:
            if (topology := out.topologies[run[0]]) not in self.found:
                ends.setdefault(topology, []).extend((run[0], run[-1]))
        for topology, lengths in ends.items():
            small, large = min(lengths), max(lengths)
            again = {}
            for n in dict.fromkeys((small, large)):
                again[n] = out.again[n] = self.capture(n)
                out.repeated.append(n)
            at_small = loose_slots(out.graphs[small], again[small])
            at_large = loose_slots(out.graphs[large], again[large])
            out.loose_ends[topology] = (small, large, at_small, at_large)
            self.found[topology] = (out.graphs[small], _both(out.graphs[small], at_small,
                                                             out.graphs[large], at_large))

    def __call__(self, length: int) -> dict[str, Slots]:
        """The loose slots of captured ``length``'s nodes."""
        graph = self.out.graphs[length]
        reference, slots = self.found[self.out.topologies[length]]
        pairs = match(reference, graph)
        return {pairs[node]: s for node, s in slots.items() if s}


class _Subset(Mapping):
    """The graphs of ``lengths`` (a set that may grow) among ``graphs``, as a mapping."""

    def __init__(self, graphs: Mapping[int, KernelGraph], lengths: set[int]) -> None:
        self.graphs, self.lengths = graphs, lengths

    def __getitem__(self, n: int) -> KernelGraph:
        if n not in self.lengths:
            raise KeyError(n)
        return self.graphs[n]

    def __contains__(self, n: object) -> bool:
        return n in self.lengths

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.lengths))

    def __len__(self) -> int:
        return len(self.lengths)
