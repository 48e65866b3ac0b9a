"""Splitting a trace into iterations of the workload.

Three ways, in order of trust: an explicit count from the user; ``ProfilerStep#N`` annotations
that torch.profiler's schedule writes (and grape's own traces always carry); otherwise the
smallest period of the launch sequence, where a launch is identified by its call and the GPU work
it caused (a graph launch and its 290 kernels is one launch).

Host work that issues nothing (framework operators that only reshape, API queries) sits between
the last launch of one iteration and the first launch of the next. It is divided by comparison
with the first iteration: the host items that precede the first iteration's first launch are
that iteration's head, so the same names before a later iteration's first launch are its head,
and the rest of the gap is the previous iteration's tail. Whatever matches no iteration (set-up
before the first, synchronisation after the last) is reported as outside every iteration.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass, replace

from grape.errors import EmptyTraceError, IterationError
from grape.kineto import Decoded
from grape.records import HostCall, Iteration, LaunchRecord, top_level

__all__ = ["Split", "repeating_period", "smallest_period", "split_iterations"]


@dataclass(frozen=True)
class Split:
    iterations: tuple[Iteration, ...]
    method: str  # how the iterations were found, for people
    outside: tuple[HostCall, ...]  # CUDA API calls outside every iteration
    warning: str | None = None  # a split the user should look at (one iteration that repeats)


def smallest_period(seq: list) -> int:
    """Smallest p dividing len(seq) such that seq repeats every p items (len(seq) if none).

    >>> smallest_period(list("abcabcabc"))
    3
    >>> smallest_period(list("abcab"))
    5
    """
    n = len(seq)
    for p in range(1, n):
        if n % p == 0 and seq[p:] == seq[:-p]:
            return p
    return n


def repeating_period(seq: list) -> tuple[int, list[int]]:
    """Smallest p dividing len(seq) such that seq is blocks of p that repeat, allowing a few
    blocks to differ in a few places: at most one block in ten (at least one, of three or more
    blocks) may differ from the blocks' majority, each in at most one position in ten (at least
    one). That is a first iteration whose library picked other kernels (cuBLAS choosing another
    GEMV on its first call) among identical ones. Returns p (len(seq) if none) and the indices
    of the blocks that differ.

    >>> repeating_period(list("abcabcabc"))
    (3, [])
    >>> repeating_period(list("axcabcabcabc"))
    (3, [0])
    >>> repeating_period(list("abcd"))
    (4, [])
    """
    n = len(seq)
    for p in range(1, n):
        if n % p:
            continue
        blocks = [seq[i:i + p] for i in range(0, n, p)]
        if all(b == blocks[0] for b in blocks[1:]):
            return p, []
        if len(blocks) < 3:
            continue
        majority = [Counter(column).most_common(1)[0][0] for column in zip(*blocks, strict=True)]
        odd = {i: sum(a != b for a, b in zip(block, majority, strict=True))
               for i, block in enumerate(blocks) if block != majority}
        if (len(odd) <= max(1, len(blocks) // 10)
                and max(odd.values()) <= max(1, p // 10)):
            return p, sorted(odd)
    return n, []


def _repeating_tail(seq: list) -> tuple[int, int] | None:
    """(period, repeats) of the longest run of identical blocks that ends the sequence and
    covers at least three quarters of it in two or more blocks, where one exists."""
    n = len(seq)
    for p in range(1, n // 2 + 1):
        k = 1
        while (k + 1) * p <= n and seq[n - (k + 1) * p:n - k * p] == seq[n - p:]:
            k += 1
        if k >= 2 and k * p >= 0.75 * n:
            return p, k
    return None


def split_iterations(d: Decoded, count: int | None = None, source: str = "trace") -> Split:
    """Group a decoded trace's launches into iterations with their host windows.

    Raises
    ------
    EmptyTraceError
        No host call in the trace launched GPU work.
    IterationError
        ``count`` does not divide the launches evenly.
    """
    launches = sorted(d.launches, key=lambda launch: launch.call.ts)
    if not launches:
        orphans = f" ({len(d.orphans)} GPU operations had no host call)" if d.orphans else ""
        raise EmptyTraceError(f"{source}: expected GPU work launched from the host, "
                              f"found none{orphans}")
    if count is not None:
        if count < 1 or len(launches) % count:
            raise IterationError(f"{source}: expected {len(launches)} launches to divide into "
                                 f"{count} equal iterations, found a remainder of "
                                 f"{len(launches) % count if count >= 1 else len(launches)}")
        period = len(launches) // count
        method = f"explicit count: {count} iterations of {period} launches"
    elif d.steps:
        return _split_by_steps(d, launches)
    else:
        signatures = [launch.signature for launch in launches]
        period, odd = repeating_period(signatures)
        n = len(launches) // period
        method = (f"repeating launch sequence: {n} iterations of {period} launches" if n > 1 else
                  f"no repeating launch sequence: one iteration of {period} launches")
        if odd:
            method += (f" (iteration{'s' if len(odd) > 1 else ''} "
                       f"{', '.join(map(str, odd))} launched other kernels in places)")
        tail = _repeating_tail(signatures) if n == 1 else None
        if tail is not None:
            p, k = tail
            warning = (f"{source}: found one iteration of {len(launches)} launches, though its "
                       f"last {k} x {p} launches repeat: split it with --iterations N (N "
                       f"dividing {len(launches)}), or record torch.profiler's step "
                       f"annotations (its schedule)")
            groups = [launches]
            return replace(_assemble(d, groups, _host_windows(d, groups), method),
                           warning=warning)
    groups = [launches[i:i + period] for i in range(0, len(launches), period)]
    windows = _host_windows(d, groups)
    return _assemble(d, groups, windows, method)


def _split_by_steps(d: Decoded, launches: list[LaunchRecord]) -> Split:
    starts = [launch.call.ts for launch in launches]
    groups = [launches[bisect_left(starts, s.ts):bisect_left(starts, s.end)] for s in d.steps]
    windows = [(s.ts, s.end) for s in d.steps]
    return _assemble(d, groups, windows, f"{len(d.steps)} ProfilerStep annotations")


def _assemble(d: Decoded, groups: list[list[LaunchRecord]], windows: list[tuple[float, float]],
              method: str) -> Split:
    starts = [c.ts for c in d.calls]
    iterations, inside = [], set()
    for i, (group, (lo, hi)) in enumerate(zip(groups, windows, strict=True)):
        a, b = bisect_left(starts, lo), bisect_left(starts, hi)
        inside.update(range(a, b))
        iterations.append(Iteration(i, lo, hi, tuple(group), tuple(d.calls[a:b])))
    outside = tuple(c for i, c in enumerate(d.calls) if i not in inside)
    return Split(tuple(iterations), method, outside)


def _host_windows(d: Decoded, groups: list[list[LaunchRecord]]) -> list[tuple[float, float]]:
    # Work on the thread that issued most launches; other threads join by time in _assemble.
    tid = Counter(launch.call.tid for g in groups for launch in g).most_common(1)[0][0]
    calls = [(launch.call.ts, gi) for gi, g in enumerate(groups) for launch in g
             if launch.call.tid == tid]
    calls.sort()
    call_ts = [ts for ts, _ in calls]
    items = sorted((c for c in d.ops + d.calls if c.tid == tid), key=lambda c: (c.ts, -c.dur))
    while True:
        top = top_level(items)
        labels = []
        wrappers = set()
        for item in top:
            inner = {gi for _, gi in calls[bisect_left(call_ts, item.ts):
                                           bisect_right(call_ts, item.end)]}
            if len(inner) > 1:  # wraps several iterations (a user's outer annotation): look inside
                wrappers.add(id(item))
            labels.append(inner.pop() if len(inner) == 1 else None)
        if not wrappers:
            break
        items = [c for c in items if id(c) not in wrappers]
    if set(range(len(groups))) - set(labels):
        # Some iteration issued nothing from this thread: fall back to the launch calls' own spans.
        return [(g[0].call.ts, max(launch.call.end for launch in g)) for g in groups]
    return _windows_from_labels(top, labels, len(groups))


def _windows_from_labels(top: list[HostCall], labels: list[int | None],
                         n: int) -> list[tuple[float, float]]:
    first = [labels.index(g) for g in range(n)]
    last = [len(labels) - 1 - labels[::-1].index(g) for g in range(n)]
    names = [item.name for item in top]
    head0 = names[:first[0]]

    def matched_head(gap: list[str]) -> int:
        k = 0
        while k < min(len(gap), len(head0)) and gap[-1 - k] == head0[-1 - k]:
            k += 1
        return k

    heads = [0] * n
    for g in range(1, n):
        heads[g] = matched_head(names[last[g - 1] + 1:first[g]])
    after = names[last[-1] + 1:]
    if n == 1:  # nothing to compare with: the whole trace is the iteration
        heads[0], tail_last = len(head0), len(after)
    else:  # the first head and the last tail are what the gaps between iterations agree on
        heads[0] = heads[1]
        tail_names = names[last[0] + 1:first[1] - heads[1]]
        tail_last = 0
        while (tail_last < min(len(tail_names), len(after))
               and after[tail_last] == tail_names[tail_last]):
            tail_last += 1
    windows = []
    for g in range(n):
        lo = first[g] - heads[g]
        hi = first[g + 1] - heads[g + 1] - 1 if g + 1 < n else last[g] + tail_last
        windows.append((top[lo].ts, max(item.end for item in top[lo:hi + 1])))
    return windows
