"""Work on several streams that overlaps, as it shares the GPU's SMs.

Eager work forked onto several streams runs, once captured, as branches of one graph that the
GPU runs side by side as far as the stream waits captured with them allow. Side by side at the
speed each kernel had alone is too fast wherever the branches' kernels together ask for more
SMs than the GPU has: on the H200 two towers of 88-block GEMMs ran their graph 27% slower than
that (``traces/h200_unseen/two_streams_*``). Here each kernel holds a share of the SMs
(``GpuWork.share``, from its grid: ``grape.records.sm_share``) and the kernels running at one
moment progress at their solo pace while their shares add up to at most the whole GPU, and
all at the pace the GPU divides among them once they add up to more (a processor-sharing
fluid model). ``grape.records.alone_times`` is its inverse: what a recording's overlapped
work would have taken alone.

Each node also pays the graph's per-node front-end cost on its stream before it starts; that
delay is not shared, as the old longest-chain pricing had it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from grape.program import Launch, Step, StreamWait

__all__ = ["branch_time"]

def branch_time(steps: Iterable[Step], per_node: float, shared: bool = True) -> float:
    """GPU time of ``steps``' eager work run as branches of one graph: each stream's work in
    its order, a stream that waits on another (``StreamWait``) held until the work queued on
    that one so far has finished, each node ``per_node`` after its stream is free to run it,
    at the work's alone time (``GpuWork.work``), slowed where overlapping work asks for more
    than the GPU's SMs (see the module). ``shared`` False runs overlapping work at its alone
    pace whatever it asks for: the bound for branches that never contend. (A wait counts only
    work queued before it, so every wait is met and every queue runs dry.)
    """
    queues: dict[int, deque] = {}  # per stream: ("work", alone time, share) or ("wait", on, count)
    queued: dict[int, int] = {}  # per stream: work queued so far
    for step in steps:
        if isinstance(step, Launch):
            for w in step.work:
                queues.setdefault(w.stream, deque()).append(("work", w.dur, w.share))
                queued[w.stream] = queued.get(w.stream, 0) + 1
        elif isinstance(step, StreamWait):
            queues.setdefault(step.stream, deque()).append(
                ("wait", step.on, queued.get(step.on, 0)))
    finished = dict.fromkeys(queues, 0)
    running: dict[int, list[float]] = {}  # per stream: [when it may start, work left, share]
    t = 0.0
    while True:
        for stream, queue in queues.items():
            if stream in running:
                continue
            while queue and queue[0][0] == "wait" and finished.get(queue[0][1], 0) >= queue[0][2]:
                queue.popleft()
            if queue and queue[0][0] == "work":
                _, work, share = queue.popleft()
                running[stream] = [t + per_node, work, share]
        if not running:
            break
        active = [r for r in running.values() if r[0] <= t]
        asked = sum(r[2] for r in active)
        pace = 1.0 / asked if shared and asked > 1.0 else 1.0
        # The next event: a node past its front-end delay, or the first running kernel's end.
        ends = [t + r[1] / pace for r in active]
        step_to = min([r[0] for r in running.values() if r[0] > t] + ends)
        for r, end in zip(active, ends, strict=True):
            r[1] = 0.0 if end <= step_to else r[1] - (step_to - t) * pace
        t = step_to
        for stream in [s for s, r in running.items() if r[0] <= t and r[1] <= 0.0]:
            del running[stream]
            finished[stream] += 1
    return t
