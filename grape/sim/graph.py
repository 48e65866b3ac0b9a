"""A kernel graph (the IR the CUDA backend builds from) as the GPU runs it.

:func:`run_graph` schedules a :class:`~grape.ir.KernelGraph`'s DAG: a node starts when every
node it depends on has finished and the GPU's front end has dispatched it; the front end
dispatches nodes in order, one per ``Costs.graph_node_overhead`` at most, and prepares the next
while the current one runs. A chain of kernels longer than that overhead therefore costs its
kernels alone, a chain of shorter ones the overhead per node, and independent branches overlap
as the capture forked them, as far as the front end keeps up. Conditional nodes run their
bodies: a WHILE node its body as many times as it iterates plus ``Costs.while_per_iteration``
each time, an IF node its body where taken, a SWITCH node the chosen branch. Those choices are
data on the device, so the caller gives them (:class:`Choices`), and a conditional without one
is an error, not a guess. A programmatic edge (``grape.ir.EDGE_KINDS``: a kernel launched with
programmatic dependent launch) is priced as a full dependency: how much of its kernel overlaps
the one before depends on where each triggers and waits in its code, which no trace shows. On
the H200 a GPT-2 step ran the same with its 12 programmatic edges made full
(``benchmarks/README.md``, runs 16 and 17); but compiled steps whose Inductor kernels all launch
dependently ran 4% (a Llama shape, 183 edges) and 20% (GPT-2 small, 100 edges) faster than the
same kernels with every edge full (H100; "Programmatic dependent launch in compiled steps"):
0.3 and 1.0 us an edge, too far apart for one constant. Such a step is predicted as if its
edges were full, so this model prices it slow by about that much.

Where this model stands: a graph's kernels on the H200 run either back to back or with about
0.3 us more between each and the next, by machine and by phase of one process (the step of
``traces/h200_ir`` ran 835 us in its process's first seconds, 717 us in another process, and the
loop of the same step recorded seconds later ran at its kernels' pace). torch.profiler shows
which: the gaps between a launch's consecutive kernels cluster at about 0.1 us (CUPTI's own,
the profile's ``profiler_graph_gap``) or about 0.42 us (``grape.records.graph_kernel_gap``).
The schedule puts what a durations trace shows beyond CUPTI's own between each node and the
one it waits for, so a prediction is for the machine as it was when its kernels were traced.
On grape's own executions (``traces/h200_ir/twin_*``: a GPT-2 decode step, the step in a WHILE
node, a 5-beam step and its loop, each timed just before its trace was taken) this predicts
each launch within 2.4% (``tests/test_sim_graph.py``); without the traced gap the step was 13.6%
short. The trace-based path (``grape.sim.whatif.profiled_graph_launches``) keeps the profile's
per-node constant instead, because ``grape record`` profiles after timing every mode and its
traces' gaps describe a later phase.

Two things a profiled trace cannot say, found on the H200 (``benchmarks/README.md``, 2026-12-05,
fifth session): every trace of six device loops (GPT-2 and Llama, greedy, sampling, 5 beams)
showed 0.42 us between consecutive kernels, while the same loops timed without the profiler ran
0.001 to 0.005 us (Llama) and 0.10 us (GPT-2's sampling and beams) a node beyond their kernels,
so at the traced gap the chains came out 8 to 13% slow. A launch timed without the profiler
calibrates it (:func:`calibrated_gap`, ``Durations.node_gap``), and from a chain's trace and
timing the same loops remade as DAGs were predicted within 3%. That needed the second: kernels
side by side share the GPU. Each holds a share of the SMs by its blocks (the processor-sharing
model of ``grape.sim.sharing``, where the trace gave the SM count: ``Durations.sms``); without
it Llama's DAGs came out 6 to 7% fast, their overlapping GEMVs taken to run at their solo pace.

Durations come from a trace of the same kernels (:class:`Durations`): the median duration of
each kernel by function and launch configuration (its demangled name, as CUPTI reports it, grid
and block), and of copies and memsets by kind and size; one the trace did not see is priced from
the device profile's copy latency and bandwidth; or each node's own, where a traced launch
of the graph pairs with its node executions by position (``grape.sim.traced_durations``:
CUPTI named a loop body's kernels after other graphs' nodes in a process that had run them).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Generator, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import cxxfilt
import networkx as nx

from grape.errors import SimulationError, UnsupportedError
from grape.ir import Conditional, ConditionalKind, Kernel, KernelGraph, Memcpy, Memset, Op
from grape.passes.variants import Variants, device_switchable
from grape.program import GpuWork, GraphLaunch, HostWork, Launch, Program, Sync
from grape.records import GpuRecord, graph_kernel_gap
from grape.sim.engine import Costs
from grape.sim.ranks import collective_name
from grape.trace import Trace

__all__ = ["Choices", "Durations", "GraphRun", "calibrated_gap", "check_choices", "conditionals",
           "family_program", "is_nccl_collective", "kernel_key", "program_from_graph",
           "run_graph", "run_graph_ranks"]

KernelKey = tuple[str, tuple[int, int, int], tuple[int, int, int]]


def demangle(name: str) -> str:
    """A kernel's name as CUPTI reports it: demangled (``extern "C"`` names stay as they are)."""
    try:
        return cxxfilt.demangle(name)
    except cxxfilt.InvalidName:
        return name


def kernel_key(k: Kernel) -> KernelKey:
    return demangle(k.name), tuple(k.grid), tuple(k.block)


@dataclass(frozen=True)
class Durations:
    """Kernel durations (us) by :func:`kernel_key`, the median of every time a trace saw one."""

    table: Mapping[KernelKey, float]
    source: str = "a duration table"
    transfers: Mapping[tuple[str, int], float] = field(default_factory=dict)  # (kind, bytes)
    # The median gap between consecutive kernels of the trace's graph launches
    # (grape.records.graph_kernel_gap; None where it launched no graphs): with the profiler's
    # own gap (Costs.profiler_graph_gap) it says what the machine added per node when recorded.
    graph_gap: float | None = None
    # Durations of particular nodes by name (grape.sim.traced_durations: a traced launch of
    # this graph read by position), before any by function: CUPTI may name a kernel otherwise.
    nodes: Mapping[str, float] = field(default_factory=dict)
    # The GPU's SM count where the trace gave it: overlapping kernels then share the SMs
    # (_Schedule.share); None runs them side by side at their own pace.
    sms: int | None = None
    # The time a node waits beyond its predecessors' end, calibrated against a timed launch
    # (calibrated_gap); None takes it from the trace's gaps (graph_gap).
    node_gap: float | None = None

    @classmethod
    def from_trace(cls, trace: Trace, source: str) -> Durations:
        """:meth:`from_ops` over ``trace``'s GPU work, with its GPU's SM count."""
        return dataclasses.replace(cls.from_ops(trace.gpu_ops, source),
                                   sms=trace.device.get("numSms"))

    @classmethod
    def from_ops(cls, ops: Iterable[GpuRecord], source: str) -> Durations:
        seen: dict[KernelKey, list[float]] = defaultdict(list)
        moved: dict[tuple[str, int], list[float]] = defaultdict(list)
        for op in ops:
            if op.kind == "kernel" and op.grid is not None and op.block is not None:
                seen[(op.name, tuple(op.grid), tuple(op.block))].append(op.dur)
            elif op.bytes is not None and (op.kind == "memset" or "DtoD" in op.name):
                moved[(op.kind, op.bytes)].append(op.dur)
        if not seen:
            raise SimulationError(f"{source}: expected kernels with their grid and block (a "
                                  f"torch.profiler trace with CUDA activity), found none")
        return cls({k: statistics.median(v) for k, v in seen.items()}, source,
                   {k: statistics.median(v) for k, v in moved.items()}, graph_kernel_gap(ops))

    def merged(self, other: Durations) -> Durations:
        """Both tables; where both time a kernel, this one's figure, and its gap where it has
        one (the recording a prediction starts from says what the machine added per node)."""
        return Durations({**other.table, **self.table}, f"{self.source} and {other.source}",
                         {**other.transfers, **self.transfers},
                         self.graph_gap if self.graph_gap is not None else other.graph_gap,
                         {**other.nodes, **self.nodes}, self.sms or other.sms,
                         self.node_gap if self.node_gap is not None else other.node_gap)

    def kernel(self, k: Kernel, node: str) -> float:
        if node in self.nodes:
            return self.nodes[node]
        key = kernel_key(k)
        if key not in self.table:
            raise SimulationError(f"expected a duration for node {node!r} ({key[0][:80]}, grid "
                                  f"{key[1]}, block {key[2]}) in {self.source}, found none")
        return self.table[key]


@dataclass(frozen=True)
class Choices:
    """What conditional nodes do in one launch, by their node name (the outer graph's; a body's
    conditional as ``<node>/<body index>/<inner node>``): WHILE iteration counts, IF taken or
    not, SWITCH branch indices."""

    iterations: Mapping[str, int] = field(default_factory=dict)
    taken: Mapping[str, bool] = field(default_factory=dict)
    branch: Mapping[str, int] = field(default_factory=dict)


def conditionals(graph: KernelGraph, prefix: str = "") -> dict[str, ConditionalKind]:
    """Every conditional node of ``graph`` and its bodies, by the name :class:`Choices` takes
    (a body's as ``<node>/<body index>/<inner node>``)."""
    found: dict[str, ConditionalKind] = {}
    for node, op in graph.ops():
        if isinstance(op, Conditional):
            found[f"{prefix}{node}"] = op.type
            for i, body in enumerate(op.bodies):
                found.update(conditionals(body, f"{prefix}{node}/{i}/"))
    return found


_FLAGS = {"iterations": ("--while", "a WHILE node", (ConditionalKind.WHILE,)),
          "taken": ("--if", "an IF node", (ConditionalKind.IF, ConditionalKind.IF_ELSE)),
          "branch": ("--switch", "a SWITCH node", (ConditionalKind.SWITCH,))}


def check_choices(graph: KernelGraph, choices: Choices, source: str,
                  counts: bool = True) -> None:
    """Refuse choices that name no conditional of the right kind in ``graph`` (read from
    ``source``), and a WHILE node without an iteration count: a run that would ignore what it
    was told, or guess. Messages name the command-line flags.

    Raises
    ------
    SimulationError
        The first such choice or node, in one line.
    """
    nodes = conditionals(graph)
    for field_name, (flag, what, kinds) in _FLAGS.items():
        fitting = sorted(n for n, k in nodes.items() if k in kinds)
        for name in getattr(choices, field_name):
            if name not in fitting:
                raise SimulationError(f"expected {flag} to name {what} of {source} "
                                      f"({', '.join(fitting) or 'it has none'}), found {name!r}")
    # Loops inside bodies may never run, so need no count: only the outer graph's are asked
    # for here, and run_graph asks for the others when it meets them. (``counts`` False: the
    # names alone, before counts are read from a trace.)
    for name, op in graph.ops() if counts else ():
        if (isinstance(op, Conditional) and op.type is ConditionalKind.WHILE
                and name not in choices.iterations):
            raise SimulationError(f"expected an iteration count for WHILE node {name!r} of "
                                  f"{source} (--while {name}=N), found none")


@dataclass(frozen=True)
class GraphRun:
    """One launch of a graph on the GPU: its time from the first dispatch to the last node's
    end, and each node's interval (start, end, name), bodies' nodes included."""

    gpu_time: float
    intervals: tuple[tuple[float, float, str], ...]
    nodes_run: int  # node executions, a body's nodes once per iteration
    # What ran in each interval, as a trace names it (a kernel's demangled name, "Memcpy DtoD",
    # "Memset"), and its kind ("kernel", "memcpy", "memset"; "" for nodes that run nothing).
    names: tuple[tuple[str, str], ...] = ()


def _copy_time(op: Memcpy | Memset, costs: Costs) -> float:
    # Bytes read plus written for a copy, written for a memset, at the profiled bandwidth.
    moved = 2 * op.size if isinstance(op, Memcpy) else op.extent
    return costs.copy_latency + moved / (costs.copy_bandwidth * 1e3)  # GB/s -> bytes per us


def _graph_copy_time(op: Memcpy | Memset, costs: Costs) -> float | None:
    """A copy or memset node's time in a graph from the profile's in-graph measurement (its
    dispatch, which the schedule adds, taken out), or None where the profile lacks it."""
    if isinstance(op, Memcpy):
        latency, per_byte, size = costs.graph_copy_latency, costs.graph_copy_us_per_byte, op.size
    else:
        latency, per_byte = costs.graph_memset_latency, costs.graph_memset_us_per_byte
        size = op.extent
    if latency is None:
        return None
    return max(latency - costs.graph_node_overhead + size * per_byte, 0.0)


class _Schedule:
    """The schedule of one graph launch, as a generator: it yields ``(start, node, kernel)``
    where a collective's kernel starts (only where ``collective`` says a kernel is one) and
    takes back the time that collective ends, which depends on the other ranks."""

    def __init__(self, durations: Durations, costs: Costs, choices: Choices,
                 collective: Callable[[Kernel], bool] | None = None) -> None:
        self.durations, self.costs, self.choices = durations, costs, choices
        self.collective = collective
        self.intervals: list[tuple[float, float, str]] = []
        self.names: list[tuple[str, str]] = []
        self.nodes_run = 0
        # What the recording's machine put between a node and the one it waits for: as a
        # timed launch calibrated it, else as the trace's gaps say.
        self.gap = (durations.node_gap if durations.node_gap is not None
                    else costs.node_gap(durations.graph_gap) or 0.0)

    def share(self, op: Op) -> float:
        """The share of the SMs ``op`` holds while it runs (``grape.records.sm_share``: a
        kernel's blocks over the GPU's SMs, other work the whole GPU); none where the durations'
        trace did not say how many SMs its GPU has, so that nothing is slowed."""
        sms = self.durations.sms
        if not sms:
            return 0.0
        if isinstance(op, Kernel):
            return min(1.0, op.grid[0] * op.grid[1] * op.grid[2] / sms)
        return 1.0

    def graph(self, graph: KernelGraph, begin: float, prefix: str) -> Generator:
        """Run ``graph`` from ``begin``; returns when its last node ends.

        The front end dispatches the nodes in one topological order, each once the nodes it
        waits for have ended (plus the gap, for GPU work) and at least
        ``graph_node_overhead`` after the one before it. Kernels, copies and memsets then run
        at their traced pace while the shares of the work running together add up to at most
        the GPU, and all at the pace the GPU divides among them beyond (the processor-sharing
        model of ``grape.sim.sharing``, for eager branches). A conditional node or a
        collective holds no share: its body runs as a graph of its own from its start."""
        order = list(nx.topological_sort(graph.dag))
        finish: dict[str, float] = {}
        running: dict[str, list] = {}  # node: [work left at its own pace, share, interval]
        fixed: dict[str, float] = {}  # node: when it ends, whatever else runs
        t = front = begin
        at = 0
        while at < len(order) or running or fixed:
            due = math.inf
            if at < len(order):
                node = order[at]
                waits = list(graph.dag.predecessors(node))
                if all(p in finish for p in waits):
                    op = graph.op(node)
                    ready = max((finish[p] for p in waits), default=begin)
                    if waits and isinstance(op, Kernel | Memcpy | Memset):  # not a join
                        ready += self.gap
                    due = max(ready, front + self.costs.graph_node_overhead, t)
            asked = sum(r[1] for r in running.values())
            pace = 1.0 / asked if asked > 1.0 else 1.0
            next_end = min([t + r[0] / pace for r in running.values()] + list(fixed.values()),
                           default=math.inf)
            step_to = min(due, next_end)
            for r in running.values():
                r[0] -= (step_to - t) * pace
            t = step_to
            if due <= next_end:
                front = t
                op, name = graph.op(node), f"{prefix}{node}"
                ended, work = yield from self.op(op, t, name)
                if ended is not None:
                    fixed[node] = ended
                elif work > 0.0:
                    running[node] = [work, self.share(op), len(self.intervals) - 1]
                else:
                    finish[node] = t
                at += 1
                continue
            for node in [n for n, r in running.items() if r[0] <= 1e-9 * max(1.0, t)]:
                index = running.pop(node)[2]
                start, _, name = self.intervals[index]
                self.intervals[index] = (start, t, name)
                finish[node] = t
            for node in [n for n, e in fixed.items() if e <= t]:
                finish[node] = fixed.pop(node)
        return max(finish.values(), default=begin)

    def op(self, op: Op, start: float, name: str) -> Generator:
        """Dispatch ``op`` at ``start``. Returns ``(end, 0.0)`` where its end is settled now (a
        conditional's body run, a collective's meeting), else ``(None, work)``: its duration
        at its own pace, its interval opened, to be closed where it ends."""
        self.nodes_run += 1
        if isinstance(op, Conditional):
            return (yield from self.conditional(op, start, name)), 0.0
        if isinstance(op, Kernel):
            self.names.append((demangle(op.name), "kernel"))
            if self.collective is not None and self.collective(op):
                end = yield start, name, op
                self.intervals.append((start, end, name))
                return end, 0.0
            dur = self.durations.kernel(op, name)
        elif isinstance(op, Memcpy | Memset):
            dur = self.durations.nodes.get(name)
            if dur is None:
                dur = _graph_copy_time(op, self.costs)
            if dur is None:
                key = ("memcpy", op.size) if isinstance(op, Memcpy) else ("memset", op.extent)
                dur = self.durations.transfers.get(key)
            if dur is None:
                dur = _copy_time(op, self.costs)
            self.names.append(("Memcpy DtoD (Device -> Device)", "memcpy")
                              if isinstance(op, Memcpy) else ("Memset (Device)", "memset"))
        else:  # empty nodes and events: dependencies only
            dur = 0.0
            self.names.append((type(op).__name__, ""))
        self.intervals.append((start, start + dur, name))
        return None, dur

    def conditional(self, op: Conditional, start: float, name: str) -> Generator:
        choices = self.choices
        if op.type is ConditionalKind.WHILE:
            if name not in choices.iterations:
                raise SimulationError(f"expected an iteration count for WHILE node {name!r}, "
                                      f"found none")
            t = start
            for _ in range(choices.iterations[name]):
                t = (yield from self.graph(op.bodies[0], t, f"{name}/0/")) + (
                    self.costs.while_per_iteration)
            return t
        if op.type in (ConditionalKind.IF, ConditionalKind.IF_ELSE):
            if name not in choices.taken:
                raise SimulationError(f"expected whether IF node {name!r} is taken, found none")
            body = 0 if choices.taken[name] else 1
            if body >= len(op.bodies):
                return start
            return (yield from self.graph(op.bodies[body], start, f"{name}/{body}/"))
        if name not in choices.branch:
            raise SimulationError(f"expected the branch SWITCH node {name!r} takes, found none")
        branch = choices.branch[name]
        if not 0 <= branch < len(op.bodies):  # CUDA runs no branch for an index out of range
            return start
        return (yield from self.graph(op.bodies[branch], start, f"{name}/{branch}/"))

    def result(self, end: float) -> GraphRun:
        return GraphRun(end, tuple(self.intervals), self.nodes_run, tuple(self.names))


def run_graph(graph: KernelGraph, durations: Durations, costs: Costs,
              choices: Choices | None = None) -> GraphRun:
    """One launch of ``graph`` (see the module).

    Raises
    ------
    SimulationError
        A kernel without a duration, a conditional without its choice.
    """
    schedule = _Schedule(durations, costs, choices or Choices())
    run = schedule.graph(graph, 0.0, "")
    try:
        next(run)  # without a collective predicate the schedule never yields
    except StopIteration as done:
        return schedule.result(done.value)
    raise AssertionError("unreachable: a schedule without collectives yielded")


def calibrated_gap(graph: KernelGraph, durations: Durations, costs: Costs, choices: Choices,
                   measured: float) -> Durations:
    """``durations`` with the time each node waits beyond its predecessors' end set so that
    one launch of ``graph`` takes ``measured`` (us, a launch timed without the profiler): what
    a profiled trace cannot say (on the H200 every trace of a loop showed 0.42 us between its
    kernels, while the same loops unprofiled ran 0.001 to 0.10 us apart; ``benchmarks/README.md``,
    2026-12-05, fifth session). The run is nearly linear in that gap: found from two runs, and
    none below zero (a launch faster than its kernels back to back says the durations are
    long, which a gap cannot mend)."""
    at = [run_graph(graph, dataclasses.replace(durations, node_gap=g), costs, choices).gpu_time
          for g in (0.0, 1.0)]
    slope = at[1] - at[0]
    gap = max((measured - at[0]) / slope, 0.0) if slope > 0 else 0.0
    return dataclasses.replace(durations, node_gap=gap)


def is_nccl_collective(k: Kernel) -> bool:
    """NCCL's collective kernels, by name (``ncclDevKernel_AllReduce_...`` and the like)."""
    return collective_name(k.name)


def run_graph_ranks(graphs: Sequence[KernelGraph], durations: Sequence[Durations],
                    costs: Costs, collective_cost: Callable[[Kernel], float],
                    choices: Choices | None = None,
                    collective: Callable[[Kernel], bool] = is_nccl_collective
                    ) -> list[GraphRun]:
    """One launch of each rank's graph, launched together, their collectives meeting: the n-th
    collective kernel of every rank ends ``collective_cost(kernel)`` after the last rank's has
    started (each rank's other kernels take their traced durations).

    Raises
    ------
    SimulationError
        Ranks whose collectives differ (in name at one index, or in number).
    """
    if len(graphs) != len(durations) or not graphs:
        raise SimulationError(f"expected a graph and a duration table per rank, found "
                              f"{len(graphs)} and {len(durations)}")
    schedules = [_Schedule(d, costs, choices or Choices(), collective) for d in durations]
    runs = [s.graph(g, 0.0, "") for s, g in zip(schedules, graphs, strict=True)]
    ends: list[float | None] = [None] * len(runs)
    waiting: list[tuple[float, str, Kernel] | None] = [None] * len(runs)

    def advance(rank: int, value: float | None) -> None:
        try:
            waiting[rank] = runs[rank].send(value) if value is not None else next(runs[rank])
        except StopIteration as done:
            waiting[rank], ends[rank] = None, done.value

    for rank in range(len(runs)):
        advance(rank, None)
    index = 0
    while any(w is not None for w in waiting):
        index += 1
        if any(w is None for w in waiting):
            done = [r for r, w in enumerate(waiting) if w is None]
            raise SimulationError(f"expected every rank to reach collective {index}, found "
                                  f"rank{'s' if len(done) > 1 else ''} {done} finished")
        names = {demangle(w[2].name) for w in waiting}
        if len(names) > 1:
            raise SimulationError(f"expected collective {index} to be one operation on every "
                                  f"rank, found {sorted(names)}")
        end = max(w[0] for w in waiting) + collective_cost(waiting[0][2])
        for rank in range(len(runs)):
            advance(rank, end)
    return [s.result(e) for s, e in zip(schedules, ends, strict=True)]


def program_from_graph(graph: KernelGraph, durations: Durations, costs: Costs,
                       choices: Choices | None = None, launches: int = 1,
                       name: str = "kernel graph") -> tuple[Program, GraphRun]:
    """``launches`` launches of ``graph``, each waited for: a Program whose graph launches hold
    the IR, with the GPU time of running its DAG, and that run (the same for every launch)."""
    run = run_graph(graph, durations, costs, choices)
    nodes = graph.dag.number_of_nodes()
    work = tuple(GpuWork(kind, name, end - start, 0)
                 for (start, end, _), (name, kind) in zip(run.intervals, run.names, strict=True)
                 if kind)
    launch = GraphLaunch(cost=costs.graph_launch_fixed + costs.graph_launch_per_node * nodes,
                         nodes=nodes, gpu_time=run.gpu_time, stream=0, work=work, graph=graph)
    program = Program(name, [(launch, Sync("cudaStreamSynchronize", 0.0))] * launches)
    program.approximations.append("a graph launch's host cost is the device profile's replay "
                                  "cost; the sync after it costs nothing on the host")
    program.approximations.append(_gap_note(durations, costs))
    return program, run


def _gap_note(durations: Durations, costs: Costs) -> str:
    """What the schedule put between a node and the one it waits for, and why; and whether
    overlapping work shared the SMs."""
    sharing = (f"; overlapping work shares the GPU's {durations.sms} SMs by its blocks"
               if durations.sms else "; overlapping work runs at its own pace (the trace gave "
                                     "no SM count)")
    return _wait_note(durations, costs) + sharing


def _wait_note(durations: Durations, costs: Costs) -> str:
    if durations.node_gap is not None:
        return (f"{durations.node_gap:.3f} us between a node and the one it waits for, "
                f"calibrated to a timed launch")
    gap = costs.node_gap(durations.graph_gap)
    if gap is None:
        why = ("its trace launched no graphs" if durations.graph_gap is None
               else "the profile has no profiler_graph_gap")
        return f"nothing between a node and the one it waits for beyond dispatch ({why})"
    return (f"{gap:.3f} us between a node and the one it waits for: the trace shows "
            f"{durations.graph_gap:.3f} us between a graph's kernels, CUPTI's own "
            f"{costs.profiler_graph_gap:.3f} (the machine as it was when traced)")


def family_program(graphs: Mapping[Hashable, KernelGraph], sequence: Sequence[Hashable],
                   durations: Durations, costs: Costs, choices: Choices | None = None,
                   whole: bool = False, name: str = "graph family",
                   variants: Mapping[str, Variants] | None = None, device: bool = False
                   ) -> tuple[Program, list[int]]:
    """A graph family run over ``sequence`` of shapes, from the shapes' own kernel graphs.

    Each executable holds one shape at a time. A step to a shape the executable does not hold
    first updates it on the host: one node update (``Costs.set_params``) per node whose version
    differs between the two shapes (``Variants.switch``, what ``grape.torch.family`` updates on
    the GPU), or with ``whole``, one ``cuGraphExecUpdate`` priced per node of the graph, or
    with ``device``, as ``update="device"`` does it: the nodes a kernel can switch
    (``device_switchable``) by one switch kernel before the graph (``Costs.switch_launch`` on
    the host, ``Costs.switch_per_node`` a node on the GPU), the others from the host; then
    the launch, at the GPU time of running the shape's own graph, and a sync. A kernel whose
    launch attributes change runs as an alternate chained after its node, as
    ``grape.torch.family`` runs it (except with ``whole``, where such a shape starts another
    executable, as there): each alternate enabled or disabled
    is one host call, priced as a node update, and every alternate is a node of the launch
    (a disabled one runs as an empty node; its time on the GPU is not priced). ``variants``:
    the family's executables (a saved family's, each starting out holding its template's
    shape, the first it lists); without them, shapes group by structure
    (``grape.passes.families.group``), each group one executable made from its first shape's
    graph. Returns the Program and the nodes updated before each step.

    Raises
    ------
    SimulationError
        A shape in ``sequence`` that ``graphs`` (or ``variants``) lacks; ``whole`` and
        ``device`` together; what :func:`run_graph` raises.
    """
    if whole and device:
        raise SimulationError("expected whole-graph updates or a device switch, found both")
    if missing := [s for s in sequence if s not in graphs]:
        raise SimulationError(f"expected a kernel graph for every shape of the sequence, found "
                              f"none for {missing[0]!r}")
    variants = dict(variants) if variants is not None else _variants(graphs, not whole)
    key_of = {shape: key for key, v in variants.items() for shape in v.shapes}
    if missing := [s for s in sequence if s not in key_of]:
        raise SimulationError(f"expected every shape of the sequence in the family, found "
                              f"{missing[0]!r} in none of its executables")
    runs = {shape: run_graph(graphs[shape], durations, costs, choices) for shape in set(sequence)}
    # each executable starts out holding its template's shape
    holds = {key: next(s for s, versions in v.shapes.items() if not versions)
             for key, v in variants.items()}
    on_device = {key: ({node for node, nv in v.nodes.items() if device_switchable(nv)}
                       - v.alternated if device else set()) for key, v in variants.items()}
    iterations, updated = [], []
    for shape in sequence:
        key = key_of[shape]
        v = variants[key]
        # an executable's nodes: its template's and every alternate (disabled ones launch as
        # empty nodes)
        nodes = v.template.dag.number_of_nodes() + v.alternate_count
        switched = 0  # nodes the device switch updates
        if holds[key] == shape:
            changed = 0
        elif whole:
            changed = nodes
        else:
            switch = v.switch(holds[key], shape)
            # each node enabled or disabled: one host call, priced as a node update
            changed = len(switch) + len(v.toggles(holds[key], shape))
            switched = sum(node in on_device[key] for node, _ in switch)
        holds[key] = shape
        cost = (nodes * costs.exec_update_per_node if whole and changed
                else (changed - switched) * costs.set_params)
        launch = GraphLaunch(cost=costs.graph_launch_fixed + costs.graph_launch_per_node * nodes,
                             nodes=nodes, gpu_time=runs[shape].gpu_time, stream=0,
                             graph=graphs[shape])
        steps: tuple = (HostWork(cost),) if cost else ()
        if switched:
            steps += (Launch("grape_switch_versions", costs.switch_launch, (GpuWork(
                "kernel", "grape_switch_versions", switched * costs.switch_per_node, 0),)),)
        iterations.append((*steps, launch, Sync("cudaStreamSynchronize", 0.0)))
        updated.append(changed)
    program = Program(name, iterations)
    program.approximations.append("a graph launch's host cost is the device profile's replay "
                                  "cost; the sync after it costs nothing on the host")
    program.approximations.append(_gap_note(durations, costs))
    if device:
        program.approximations.append(
            f"a device switch costs {costs.switch_per_node} us of GPU time a node it updates, "
            f"whatever bytes it writes (one H200 run's figure, not the device profile's); the "
            f"1-3% an executable of device-updatable nodes ran slower there is not priced")
    return program, updated


def _variants(graphs: Mapping[Hashable, KernelGraph], alternates: bool = True
              ) -> dict[str, Variants]:
    """Shapes grouped by structure, as ``grape.torch.family`` groups them: each shape joins
    the first executable of its structure that can be brought to it in place (with
    ``alternates``, as for node updates, a kernel whose launch attributes change gets an
    alternate), or starts another, of which it is the template."""
    from grape.passes.families import group

    out: dict[str, Variants] = {}
    for topology, shapes in group(graphs).items():
        mine: list[Variants] = []
        for shape in shapes:
            for v in mine:
                try:
                    v.add_graph(shape, graphs[shape])
                    break
                except UnsupportedError:
                    continue
            else:
                v = Variants(graphs[shape], alternates)
                v.shapes[shape] = {}
                out[f"{topology}#{len(mine)}" if mine else topology] = v
                mine.append(v)
    return out
