"""Graph families: one executable per topology, brought to each shape by updating its nodes.

``capture_family(step, shapes)`` captures ``step(shape)`` for every shape, in the order given
(largest first: every shape's activations then live in the memory the largest one took),
into one shared memory pool, and reads each capture into the IR. Shapes group by topology
fingerprint (``grape.passes.families``); each group instantiates one executable, from its
first shape's graph (the template), and every other shape keeps only the versions it takes of
the template's nodes it changes, each distinct version kept once (``grape.passes.variants``).
A kernel whose launch attributes (cluster shape) change with the shape gets an alternate
chained after its node, one enabled at a time (``Variants.executable_graph``; Wav2Vec2-base
over 101 audio lengths on the H200: 8 executables, not 45); a shape an executable cannot take
in place otherwise (a kernel the driver will not disable, whole-graph updates) starts another
executable of its topology. ``family.run(shape)`` updates the executable's nodes whose
versions differ between the shape it holds and ``shape``, with driver calls prepared for every
version of a node at once, and launches it; with ``update="device"`` a kernel on the GPU gives
the kernel nodes their versions instead, from tables on the device, in one launch
(``grape.cuda.switch``). A shape outside the family runs ``step`` eagerly,
with a warning.

``step`` must keep its buffers in place across shapes (a preallocated cache such as
``grape.torch.cache.PrefixCache``, outputs written into a static tensor): what it returns is
dropped, so that one shape's outputs do not push the next shape's allocations elsewhere.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grape.cuda.build import Executable, Graph, Update, can_disable
from grape.cuda.compare import Comparison
from grape.cuda.switch import DeviceSwitch
from grape.errors import GrapeError, GraphError, UnsupportedError
from grape.familyio import SavedFamily, graph_with, save_family
from grape.ir import Buffer, BufferRole, KernelGraph, Memory, Op, fingerprint
from grape.passes.derive import Derivation, place_derived
from grape.passes.families import match, same_ids
from grape.passes.lengths import Sampled, derive_lengths
from grape.passes.places import History, Mark, to_reference
from grape.passes.switch_plan import SwitchPlan
from grape.passes.switch_plan import plan as switch_plan
from grape.passes.variants import Variants
from grape.torch.capture import (
    capture,
    capture_stream,
    frozen_heap,
    functions_run,
    on_another_thread,
    pool_segments,
)

__all__ = ["Family", "capture_family", "environment", "load_family"]

_LOG = logging.getLogger("grape")


def _logged(caller: str) -> Callable[[str], None]:
    """The default ``progress``: each line on the ``grape`` logger at INFO, after ``caller``
    (a family's capture or load takes seconds to tens of seconds)."""
    return lambda line: _LOG.info("%s: %s", caller, line)


@dataclass
class _Group:
    template_shape: Hashable
    template: KernelGraph
    graph: Graph
    executable: Executable
    holds: Hashable  # the shape whose parameters the executable holds now
    alternates: int = 0  # alternates the executable was built with (Variants.alternates)


@dataclass
class _Places:
    """Every capture's temporaries at the places the first capture that made the same
    allocations in the same order gave them (``grape.passes.places``): captures of another
    kernel path (GPT-2 small's attention at KV lengths 7 mod 8 on the H200) allocate
    differently, and the first of each, in a family's largest-first order its largest, is
    their reference."""

    references: dict[tuple, tuple[History, list[Buffer]]] = field(default_factory=dict)
    moved: int = 0  # captures moved
    pointers: int = 0  # pointer words moved, all captures
    refused: list[str] = field(default_factory=list)  # why the others were not moved

    def __call__(self, ir: KernelGraph, history: History | None,
                 marks: Sequence[Mark] = ()) -> KernelGraph:
        if history is None:
            self.refused.append("the process records the allocator's history itself")
            return ir
        reference = self.references.get(history.acts)
        if reference is None:
            self.references[history.acts] = (history, [b for b in ir.buffers.values()
                                                       if b.role is BufferRole.INTERNAL])
            return ir
        try:
            got = to_reference(ir, history, *reference, marks=marks)
        except UnsupportedError as e:
            self.refused.append(str(e))
            return ir
        self.moved += 1
        self.pointers += got.moved
        return got.graph

    def summary(self) -> str:
        line = (f"temporaries moved to a reference capture's places in {self.moved} of "
                f"{self.moved + len(self.refused)} captures ({len(self.references)} references, "
                f"{self.pointers} pointers moved)")
        if self.refused:
            line += f"; the first not moved: {self.refused[0]}"
        return line


def _pool_bytes(pool: Any) -> int:
    """What the family's shared pool holds: its segments, all made while it captured. The
    allocator's reserved growth over the capture, counted before, took in its other caching
    too: on an H100's Llama-shaped family it came out at -38 MiB (the eager pass's blocks
    released while the family captured)."""
    return sum(size for _, size in pool_segments(pool))


@dataclass
class Family:
    step: Callable[[Hashable], Any]
    groups: dict[str, _Group]
    group_of: dict[Hashable, str]
    # each executable's shapes, as the versions they take of its template's nodes
    variants: dict[str, Variants]
    pool_bytes: int  # the shared pool's segments at the end of the capture (_pool_bytes)
    capture_s: float  # capture, reading into the IR, deltas and instantiation, all shapes
    keep: list[Any] = field(default_factory=list)  # the torch graph that holds the pool
    # Each changed node's versions as prepared driver calls, by (executable, node), made for
    # all its versions at once; a switch between two shapes is the nodes whose versions
    # differ, looked up, cached per pair.
    _prepared: dict[tuple[Hashable, Hashable], list[Update]] = field(default_factory=dict)
    _versions: dict[tuple[str, str], list[Update]] = field(default_factory=dict)
    _warned: set[Hashable] = field(default_factory=set)
    update_s: float = 0.0  # host time spent bringing executables to shapes, all runs
    updated_nodes: int = 0
    # update="graph": every shape's own graph, built as its executable's was (host memory);
    # an executable is brought to a shape by one cuGraphExecUpdate from it.
    graphs: dict[Hashable, Graph] = field(default_factory=dict)
    update: str = "nodes"  # how executables are brought to shapes: "nodes", "device", "graph"
    # update="device": per executable, the kernel nodes a kernel on the GPU switches, and each
    # shape's row in its executable's switch
    _device: dict[str, DeviceSwitch] = field(default_factory=dict)
    _row: dict[Hashable, int] = field(default_factory=dict)
    _changed: dict[tuple[Hashable, Hashable], int] = field(default_factory=dict)
    sampled: Sampled | None = None  # with derive_every: which lengths were captured, derived
    # same_places: the captures whose temporaries moved to a reference capture's places, and
    # why the others did not
    places: _Places | None = None
    # load_family: shapes captured in this process rather than moved from the file, and why
    # the first few did not move (relocation's refusal, naming the node)
    captured_here: int = 0
    not_moved: list[str] = field(default_factory=list)
    # buffers only the graphs use (their pool's memory, no tensor in it): a saved family's
    # warm start moves them whole (grape.familyio, grape.passes.relocate)
    scratch: frozenset[str] = frozenset()
    # One run at a time: bringing an executable to a shape and launching it is one step
    # (graph objects are not thread-safe; see grape.torch.graphed's lock).
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @property
    def graph_bytes(self) -> int:
        """Device memory the family's executables took at instantiation (one per topology),
        as free memory's drop: one or two executables can sit below the driver's allocation
        granularity and read 0 (they did on the H200), so measure over many copies for a
        figure (``benchmarks/families.py`` does)."""
        return sum(g.executable.device_bytes for g in self.groups.values())

    @property
    def switch_bytes(self) -> int:
        """Device memory the device switches' tables hold (``update="device"``)."""
        return sum(s.device_bytes for s in self._device.values())

    @property
    def host_bytes(self) -> int:
        """Host bytes the shapes' versions keep beyond the templates, all executables (their
        argument rows are also what prepared updates point into)."""
        return sum(v.host_bytes for v in self.variants.values())

    def ops(self, shape: Hashable) -> dict[str, Op]:
        """The operations ``shape`` changes in its executable's template, by template node."""
        return self.variants[self.group_of[shape]].ops(shape)

    def save(self, path: str | Path, params: Mapping[str, torch.Tensor] | None = None) -> Path:
        """Write the family to ``path`` (``grape.familyio``): each executable's template, each
        shape's changes to it, and the environment it was captured in (``params``: the model's
        parameters, whose layout a reload must match). ``grape simulate`` runs the file."""
        return save_family(path, SavedFamily(dict(self.variants), dict(self.group_of),
                                             environment(params), self.scratch))

    def run(self, shape: Hashable, stream: int | None = None) -> None:
        """Run ``step(shape)``: the family's executable brought to ``shape``, or eagerly (with
        a warning, once per shape) when ``shape`` was never captured. Threads that run one
        family take turns."""
        with self._lock:
            self._run(shape, stream)

    def _run(self, shape: Hashable, stream: int | None) -> None:
        name = self.group_of.get(shape)
        if name is None:
            if shape not in self._warned:
                self._warned.add(shape)
                warnings.warn(f"shape {shape!r} is not in the family (captured: "
                              f"{len(self.group_of)} shapes): running it eagerly", stacklevel=3)
            self.step(shape)
            return
        group = self.groups[name]
        stream = torch.cuda.current_stream().cuda_stream if stream is None else stream
        if self.update == "device" and (name not in self._device or shape not in self._row):
            self._on_device(name)  # first use, or a shape added since the switch was made
        if group.holds != shape:
            key = (group.holds, shape)
            if self.update == "graph":
                t = time.perf_counter()
                group.executable.update(self.graphs[shape])
                self.update_s += time.perf_counter() - t
                changed = self._count(name, key)
            else:
                t = time.perf_counter()
                updates = self._prepared.get(key)
                if updates is None:
                    updates = self._prepared[key] = self._switch(name, group.holds, shape)
                Graph.apply(group.executable, updates)
                if self.update == "device":
                    self._device[name].launch(self._row[shape], stream, self._row[group.holds])
                self.update_s += time.perf_counter() - t
                changed = len(updates) if self.update == "nodes" else self._count(name, key)
            group.holds = shape
            self.updated_nodes += changed
        group.executable.launch(stream)

    def _count(self, name: str, key: tuple[Hashable, Hashable]) -> int:
        """How many nodes a switch changes (for reports; counted once per pair, outside the
        timed update)."""
        changed = self._changed.get(key)
        if changed is None:
            changed = self._changed[key] = len(self.variants[name].switch(*key))
        return changed

    def prepare_updates(self) -> int:
        """Prepare now every driver call a switch between two shapes can need (every version
        of every node some shape changes, the template's own among them), so that the first
        pass over the shapes costs what later passes cost; ``capture_family`` and
        ``load_family`` call it. Returns the number of node updates prepared."""
        if self.update == "graph":
            return 0
        on_device = 0
        if self.update == "device":
            for name in self.variants:
                if name not in self._device:
                    on_device += self._on_device(name)
        before = sum(map(len, self._versions.values()))
        for name, v in self.variants.items():
            switched = self._device[name].nodes if name in self._device else frozenset()
            for node in v.nodes.keys() - switched:
                self._node(name, node)
        return sum(map(len, self._versions.values())) - before + on_device

    def _on_device(self, name: str) -> int:
        """Give executable ``name`` a :class:`DeviceSwitch` for every node a kernel on the GPU
        can switch (``device_switchable``): its graph is built again from the template with
        those nodes made device-updatable (the attribute must be there at instantiation) and
        instantiated in place of the old executable, which held the template too. Returns the
        versions put on the device."""
        group, v = self.groups[name], self.variants[name]
        if (old := self._device.pop(name, None)) is not None:
            old.close()
        made = switch_plan(v)
        self._row.update((shape, i) for i, shape in enumerate(made.shapes))
        self._device[name] = _instantiate(group, v, made)
        # host calls prepared against the old graph's nodes: made again against the new one's
        for key in [k for k in self._versions if k[0] == name]:
            del self._versions[key]
        self._prepared = {k: u for k, u in self._prepared.items()
                          if self.group_of.get(k[1]) != name}
        return sum(len(nv) for nv in made.versions)

    def _node(self, name: str, node: str) -> list[Update]:
        """Node ``node``'s versions in executable ``name`` as prepared calls, by version:
        made for all of them at once (``Graph.prepare_versions``), and again where a shape
        added versions since."""
        versions = self.variants[name].nodes[node]
        prepared = self._versions.get((name, node))
        if prepared is None or len(prepared) < len(versions):
            prepared = self._versions[name, node] = self.groups[name].graph.prepare_versions(
                versions)
        return prepared

    def _switch(self, name: str, holds: Hashable, shape: Hashable) -> list[Update]:
        """The prepared calls that bring an executable holding ``holds`` to ``shape``: the
        nodes whose versions differ between the two (``Variants.switch``)."""
        versions = self._versions
        switched = self._device[name].nodes if name in self._device else frozenset()
        out = []
        for node, version in self.variants[name].switch(holds, shape):
            if node in switched:
                continue
            prepared = versions.get((name, node))
            if prepared is None or version >= len(prepared):
                prepared = self._node(name, node)
            out.append(prepared[version])
        graph = self.groups[name].graph
        out += [graph.prepare_enabled(node, on)
                for node, on in self.variants[name].toggles(holds, shape)]
        return out

    def check(self) -> None:
        """Raise if a device switch failed on the GPU since the family was made (``update=
        "device"``; reads each switch's status, so it waits for the GPU). :meth:`run` never
        waits for the GPU, so it cannot tell."""
        for switch in self._device.values():
            switch.check()

    def close(self) -> None:
        for switch in self._device.values():
            switch.close()
        for g in self.groups.values():
            g.executable.close()
            g.graph.close()
        for graph in self.graphs.values():
            if all(graph is not g.graph for g in self.groups.values()):
                graph.close()


def environment(params: Mapping[str, torch.Tensor] | None = None) -> dict[str, str]:
    """What a captured graph depends on beyond itself: the driver, the GPU, the libraries whose
    kernels it runs, and (given ``params``) the parameters' names, shapes, dtypes and strides."""
    import hashlib

    import grape
    from grape.cuda.capability import driver_version

    env = {"grape": grape.__version__, "torch": torch.__version__,
           "cuda runtime": str(torch.version.cuda), "cudnn": str(torch.backends.cudnn.version()),
           "driver": str(driver_version()), "gpu": torch.cuda.get_device_name()}
    if params is not None:
        layout = repr([(n, tuple(t.shape), str(t.dtype), t.stride()) for n, t in params.items()])
        env["parameters"] = hashlib.blake2b(layout.encode(), digest_size=8).hexdigest()
    return env


def _built_family(build: Callable[..., Family]) -> Callable[..., Family]:
    """``build`` under a frozen heap (many captures in a row: each one's collection costs what
    was made since, ``grape.torch.capture.frozen_heap``), settled by one full collection at
    the end, which ``capture_s`` counts with the rest."""
    @functools.wraps(build)
    def built(*args: Any, **kwargs: Any) -> Family:
        if not torch.cuda.is_available():
            raise GrapeError(f"expected a CUDA device for {build.__name__}, found none "
                             f"(torch.cuda.is_available() is False)")
        began = time.perf_counter()
        with frozen_heap(settle=True):
            family = build(*args, **kwargs)
        family.capture_s = time.perf_counter() - began
        return family
    return built


@_built_family
def capture_family(step: Callable[[Hashable], Any], shapes: Iterable[Hashable],
                   params: Mapping[str, torch.Tensor] | None = None,
                   progress: Callable[[str], None] | None = None,
                   update: str = "nodes", derive_every: int | None = None,
                   checks: int = 1, derive_period: int = 1, warmup: int = 1,
                   prepare: bool = True, same_places: bool | None = None,
                   verify_unread: bool = False, derive_start: int | None = None) -> Family:
    """Capture ``step(shape)`` for each shape (largest first) into one family.

    ``update`` says how an executable is brought to a shape: ``"nodes"`` updates the nodes
    that differ, one driver call each, prepared from their versions; ``"device"`` puts every
    version of the kernel nodes that allow it on the device and switches them all with one
    kernel launch (``grape.cuda.switch``; the rest as ``"nodes"``); ``"graph"`` keeps every shape's
    graph on the host and updates the whole executable from it in one ``cuGraphExecUpdate``.
    With ``"nodes"`` and ``"device"``, a kernel whose launch attributes change runs as one of
    its node's alternates, enabled from the host; with ``"graph"`` (which cannot enable
    nodes), and for kernels the driver will not disable (``grape.cuda.build.can_disable``), a
    shape whose kernels' launch attributes change starts another executable (the driver took
    attribute changes in ``cuGraphExecUpdate`` on the H200, and the kernels then stopped on an
    illegal instruction).

    ``derive_every`` (shapes then are integer lengths): capture one length in that many, and
    derive the others' graphs from them (``grape.passes.lengths.derive_lengths``: numbers
    fitted as piecewise-affine functions of the length, ``checks`` held-out lengths per
    stretch captured and compared byte for byte, a stretch they refute captured whole, any
    length no trusted stretch covers captured, ``derive_period``: lengths derived only from
    lengths equal to them modulo it, for kernels chosen by a length's alignment; the smallest
    and largest sample of each topology captured once more, on another thread, to find the
    argument bytes PyTorch leaves unfilled: they hold the launching thread's stack leftovers,
    which two captures on one thread often share; numbers that are rounded-up quotients of
    others, grids and padded sizes, derived as such; a length captured where such a form and
    a line both fit and part). On the H200, GPT-2 small over 1..1023 at one length in 16
    captured 81 lengths and derived 942 (benchmarks/README.md, run 34).
    :attr:`Family.sampled` says which were which. ``derive_start``: sample one length in that
    many first, and finer (down to ``derive_every``) only where lengths stay underived
    (``derive_lengths``' ``start``: fewer captures, and a short excursion off a line is more
    likely to go unseen). On an H100, the Llama shape over 1..2047:4 sampled from one in 64
    captured 22 lengths against 52 from one in 16, and took 17.0 s against 26.4 s in all,
    side by side (benchmarks/README.md, "Sampling coarse first").

    ``warmup``: eager runs of ``step(shape)`` before each capture (lazy initialisation must not
    happen inside one); 0 where running the step changes state the caller keeps (a training
    step) and it has already run once.

    ``same_places``: move every capture's temporaries (its blocks in the graphs' pool) to the
    places the first capture that made the same allocations in the same order gave them
    (``grape.passes.places``), where no block outgrows that reference's: their pointers then
    stop moving with the shape, which derivation needs to fit them. A capture that cannot move
    keeps the allocator's places (why, in :attr:`Family.places`). Shapes given largest first
    make each reference the largest of its kind. None (the default): on where
    ``derive_every`` is given, off otherwise. On the H200 (GPT-2 small decode, benchmarks/
    README.md, runs 25 to 34) it moved every capture, and with it (and grids taken as
    quotients) one length in 16 derived 942 of 1,023 lengths, where without it earlier runs
    derived none at one in 32 and 0 to 88 in different processes at one in 2; each capture it
    moves costs about twice a capture's host time (the allocator's history and a mark before
    every operation), and it changes no fewer nodes between neighbouring lengths, so without
    derivation it buys nothing.

    ``verify_unread`` (with ``derive_every``): where only argument words that no form of the
    length explains hold a derivation's lengths back, run captured samples on the GPU with
    the template's bytes in those words, and each checked length's derived graph, against
    their captures (``grape.cuda.compare.runs_alike``: every buffer but the parameters,
    bit for bit, from the same state, restored after); words so shown unread stay template
    bytes (``derive_lengths``' ``verify``). For models whose argument structs hold leftovers
    that change with the host's history. Measured on the H200: a Llama-shaped decoder over
    KV lengths 1..511, sampled one in 16 of each class modulo 8, derived none without and 457
    with (44 runs, each alike), bitwise equal to per-shape graphs at every length checked;
    the issue's Llama shape (hidden 2048, 22 layers, 1..2047 every 4) 476 of 512 (36
    captured). Each run builds and instantiates two executables and keeps every buffer but
    the parameters on the device between runs (0.23 to 0.25 s a run there, runs 52 and 55).
    A graph that runs differently twice (atomics, a random stream) shows nothing. A word a
    kernel does read gets, in such a run, a value valid at the template's length in a pool
    laid out for the largest: a wrong size could still write past its buffer into memory not
    restored (parameters); off by default for that reason.

    ``progress``: called with a line at each stage (captures, derivation, placing, updates
    prepared); by default each line goes to the ``grape`` logger at INFO.

    ``prepare``: make every node update a switch between shapes can need now
    (:meth:`Family.prepare_updates`, counted in ``capture_s``), not on first use: on a
    Llama-shaped model the first pass over 256 lengths ran 38 ms per step against 26 ms eager
    when each (from, to) pair was prepared on first use.

    Raises
    ------
    CaptureError
        ``step`` cannot be captured for some shape (the message names the user's line).
    GrapeError
        No shapes, a shape given twice, an unknown ``update``, or ``derive_every`` with shapes
        that are not integers.
    """
    progress = progress or _logged("capture_family")
    if update not in ("nodes", "device", "graph"):
        raise GrapeError(f"expected update 'nodes', 'device' or 'graph', found {update!r}")
    shapes = list(shapes)
    if not shapes or len(set(shapes)) != len(shapes):
        raise GrapeError(f"expected distinct shapes to capture, found {len(shapes)} with "
                         f"{len(shapes) - len(set(shapes))} repeated")
    if derive_every is not None and not all(type(s) is int for s in shapes):
        odd = next(s for s in shapes if type(s) is not int)
        raise GrapeError(f"expected integer lengths as shapes to derive between, found "
                         f"{odd!r}")
    began = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    torch_graphs: dict[Hashable, Any] = {}
    # The step's live tensors, found once (after the first warm-up) for every capture: a saved
    # family then moves to another process tensor by tensor (capture's ``blocks``).
    blocks: list[tuple[int, int]] | bool = True

    if same_places is None:
        same_places = derive_every is not None
    places = _Places() if same_places else None

    spent = {"capturing": 0.0, "running": 0.0}  # seconds, for the progress lines

    def taken(shape: Hashable) -> tuple[Any, KernelGraph]:
        t = time.perf_counter()
        cap = capture(lambda s=shape: step(s), params=params, pool=pool, instantiate=False,
                      collect=False, warmup=warmup, blocks=blocks, marks=places is not None)
        ir = cap.ir if places is None else places(cap.ir, cap.history, cap.marks)
        spent["capturing"] += time.perf_counter() - t
        return cap, ir

    def captured(shape: Hashable) -> KernelGraph:
        nonlocal blocks, moved_on
        moved_on = True  # a capture's warm-up changes the state compared from
        cap, ir = taken(shape)
        torch_graphs[shape] = cap.torch_graph
        blocks = cap.blocks
        return ir

    def captured_elsewhere(shape: Hashable) -> KernelGraph:
        """``shape`` captured once more on another thread, to find the argument words that
        hold the host's leftovers (``derive_lengths``' ``again``); not kept."""
        nonlocal moved_on
        moved_on = True
        return on_another_thread(lambda: taken(shape)[1])

    # The captured graph last compared with, kept built and run (``Comparison``): derivation
    # compares one sample with several versions of it as it halves the words it tries, and
    # the next sample, of its structure, is set in the same executable (``rebase``), from
    # the state the captures since left (``moved_on``).
    comparing: Comparison | None = None
    moved_on = False

    def forget_comparison() -> None:
        nonlocal comparing
        if comparing is not None:
            comparing, kept = None, comparing
            kept.close()

    def runs_alike(length: int, graph: KernelGraph, captured: KernelGraph) -> bool:
        """``derive_lengths``' ``verify``: a graph that cannot be compared shows nothing."""
        nonlocal comparing, moved_on
        t = time.perf_counter()
        try:
            if comparing is None or comparing.first is not captured or moved_on:
                if not (comparing is not None and comparing.rebase(captured)):
                    forget_comparison()
                    comparing = Comparison(captured, capture_stream().cuda_stream)
                moved_on = False
            try:
                pairs = match(captured, graph)
            except GraphError:
                pairs = None  # built whole, and compared as such
            return comparing.alike(graph, pairs)
        except GrapeError as e:
            forget_comparison()
            progress(f"length {length}: not compared by running ({e})")
            return False
        finally:
            spent["running"] += time.perf_counter() - t

    sampled = None
    if derive_every is not None:
        try:
            sampled = derive_lengths(captured, shapes, every=derive_every, checks=checks,
                                     period=derive_period, progress=progress, start=derive_start,
                                     again=captured_elsewhere,
                                     verify=runs_alike if verify_unread else None)
        finally:
            forget_comparison()
        progress(f"sampled and derived in {time.perf_counter() - began:.2f} s: "
                 f"{spent['capturing']:.2f} s capturing "
                 f"{len(sampled.captured) + len(sampled.repeated)} graphs, "
                 f"{spent['running']:.2f} s running {len(sampled.verified)} comparisons")
    groups: dict[str, _Group] = {}
    group_of: dict[Hashable, str] = {}
    variants: dict[str, Variants] = {}
    graphs: dict[Hashable, Graph] = {}
    keep: list[Any] = []
    matched: dict[tuple[str, int], dict[str, str]] = {}

    def pairs_for(shape: Hashable) -> Callable[[str], dict[str, str] | None] | None:
        """For a derived length: each executable's template node to the derived graph's, by
        way of the captured length it was derived from (matched once, not per length)."""
        if sampled is None or shape not in sampled.derived_from:
            return None
        base = sampled.derived_from[shape]

        def pairs(key: str) -> dict[str, str] | None:
            if (key, base) not in matched:
                try:
                    matched[key, base] = match(groups[key].template, sampled.graphs[base])
                except GraphError:  # add_graph then says why, matching the derived graph
                    return None
            return matched[key, base]
        return pairs

    def placed_derived(d: Derivation, lengths: list[int]) -> str | None:
        """Lengths derived by ``d`` placed all at once, from the rows their derivation makes
        (``place_derived``: no graph, no operation per length and node): their executable's
        key, or None where they must be placed one by one, as graphs."""
        key = group_of.get(d.lengths[0])
        pairs = pairs_for(lengths[0])(key) if key is not None and not d.buffers_vary else None
        if pairs is None:
            return None
        try:
            place_derived(variants[key], d, lengths, d.lengths[0], pairs)
        except UnsupportedError:
            return None
        return key

    def placed(shape: Hashable, key: str) -> None:
        group_of[shape] = key
        # The first captured graph keeps the shared pool, and with it every shape's memory;
        # the others go (largest first, every later shape's blocks came from the pool).
        if shape in torch_graphs and (not keep or groups[key].template_shape == shape):
            keep.append(torch_graphs[shape])
        torch_graphs.pop(shape, None)
        if len(group_of) % 10 == 0 or len(group_of) == len(shapes):
            progress(f"placed {len(group_of)}/{len(shapes)} shapes, {len(groups)} executables")

    def place_graph(shape: Hashable) -> None:
        ir = sampled.graphs[shape] if sampled is not None else captured(shape)
        if update == "graph":
            graphs[shape] = Graph.build(ir)
        placed(shape, _add_shape(groups, variants, shape, ir, graphs.get(shape),
                                 sampled.topologies.get(shape) if sampled else None,
                                 pairs_for(shape)))

    # Captured shapes first: every executable's template is a capture, and the captured
    # length a derivation starts from is placed before the lengths derived from it, which then
    # go a derivation at a time.
    derived = set(sampled.derived) if sampled is not None else set()
    by_derivation: dict[int, tuple[Derivation, list[int]]] = {}
    for shape in shapes:
        if shape in derived:
            d = sampled.graphs.derived[shape]
            by_derivation.setdefault(id(d), (d, []))[1].append(shape)
        else:
            place_graph(shape)
    for d, lengths in by_derivation.values():
        key = placed_derived(d, lengths) if update != "graph" else None
        for shape in lengths:
            if key is None:
                place_graph(shape)
            else:
                placed(shape, key)
    for v in variants.values():
        v.settle()
    # (A device switch builds each executable again, with its alternates, before it runs.)
    if update != "device" and (rebuilt := _with_alternates(groups, variants)):
        progress(f"built {rebuilt} executables again with the alternates of kernels whose "
                 f"launch attributes change ({_count_alternates(variants)} alternates)")
    torch.cuda.synchronize()
    family = Family(step, groups, group_of, variants, _pool_bytes(pool),
                    0.0, keep, graphs=graphs, update=update, sampled=sampled,
                    scratch=scratch_of([g.template for g in groups.values()],
                                       pool_segments(pool, idle=True)), places=places)
    if places is not None:
        progress(places.summary())
    progress(f"placed {len(shapes)} shapes in {len(groups)} executables, "
             f"{time.perf_counter() - began:.2f} s in all")
    if prepare:
        progress(f"prepared {family.prepare_updates()} node updates, "
                 f"{time.perf_counter() - began:.2f} s in all")
    return family


@_built_family
def load_family(step: Callable[[Hashable], Any], path: str | Path,
                params: Mapping[str, torch.Tensor] | None = None,
                progress: Callable[[str], None] | None = None,
                prepare: bool = True, update: str = "nodes") -> Family:
    """A family saved by :meth:`Family.save`, in this process, capturing one shape per
    executable rather than every shape (the warm start).

    The file is refused, naming what differs, where its environment (driver, GPU, library
    versions, ``params``' layout) is not this process's. Each executable's template shape is
    captured here and the saved template moved onto it (``grape.passes.relocate``: kernel
    functions by name, memory by the pointers' places, checked byte for byte against the
    capture); every other shape's saved changes are moved the same way. The family's scratch
    (its pool's memory, which only its graphs use) is moved whole into one allocation of this
    process, in the saved layout, rather than onto the blocks the capture here happened to
    take; the captures' own pool is then given back. A shape whose changes use a kernel or
    memory its template never did, and every shape of an executable whose template does not
    move, is captured here instead (with a warning that counts them). So is a shape that runs
    a kernel function the template never ran (cuBLAS picks its kernels by size; this process
    may not even have loaded that one), unless the functions it runs here, read from a capture
    that is not walked into the IR (``grape.torch.capture.functions_run``), pair with the saved
    ones by name (``learn_functions_by_name``: a name that is one function on each side); each
    shape captured teaches the relocation its functions too
    (``grape.passes.relocate.learn_functions``), and later shapes that run them move.
    ``prepare``, ``progress``, ``update`` (``"nodes"`` or ``"device"``): as for
    :func:`capture_family`.

    Raises
    ------
    GrapeError
        The file is not a family, or was captured elsewhere, or ``update`` is another word.
    """
    progress = progress or _logged("load_family")
    if update not in ("nodes", "device"):
        raise GrapeError(f"expected update 'nodes' or 'device' for a loaded family, found "
                         f"{update!r}")
    from grape.familyio import load_family as read_family
    from grape.passes.relocate import (
        learn_functions,
        learn_functions_by_name,
        relocate_all,
        relocate_variants,
        relocation,
    )

    began = time.perf_counter()
    progress(f"reading {path}")
    saved = read_family(path)
    saved.check(environment(params), str(path))
    pool = torch.cuda.graph_pool_handle()
    groups: dict[str, _Group] = {}
    group_of: dict[Hashable, str] = {}
    variants: dict[str, Variants] = {}
    pool_graphs: list[Any] = []  # the captures here: the first keeps the pool alive
    captured: list[Hashable] = []
    not_moved: list[str] = []
    blocks: list[tuple[int, int]] | bool = True  # as capture_family finds them

    def here(shape: Hashable) -> KernelGraph:
        nonlocal blocks
        cap = capture(lambda s=shape: step(s), params=params, pool=pool, instantiate=False,
                      collect=False, blocks=blocks)
        if not pool_graphs:
            pool_graphs.append(cap.torch_graph)  # keeps the shared pool, as capture_family does
        captured.append(shape)
        blocks = cap.blocks
        return cap.ir

    # Every template captured before the scratch is allocated: memory outside the pool (the
    # workspaces a warm-up allocates) is then laid out as it was in the saving process.
    firsts = {key: next(s for s, versions in v.shapes.items() if not versions)
              for key, v in saved.variants.items()}
    fresh = {key: here(first) for key, first in firsts.items()}
    progress(f"read the file and captured {len(fresh)} templates here in "
             f"{time.perf_counter() - began:.2f} s")
    arena, scratch = _arena(saved.scratch_buffers().values())
    scratch_here = scratch_of(fresh.values(), pool_segments(pool))
    # Saved kernel functions no template ran, each paired with its handle here by a shape
    # captured here (``learn_functions``): a function is the process's, not an executable's,
    # so one learned for one executable moves the shapes of every later one that runs it.
    learned: dict[str, str] = {}
    why: dict[Hashable, str] = {}  # each shape captured here, not a template: the last reason
    moved_later = 0  # shapes that moved once a function was learned
    looked = 0  # shapes whose kernel functions were looked up (functions_run)
    for key, template in saved.templates.items():
        try:
            moved = relocation(template, fresh[key], scratch, scratch_here)
            for saved_function, function in learned.items():
                moved.functions.setdefault(saved_function, function)
            # The saved template itself, moved: its members' changes assume its scratch layout.
            base = graph_with(fresh[key], relocate_all(dict(template.ops()), moved),
                              scratch.values())
        except UnsupportedError as e:
            moved, base = None, fresh[key]
            _note(not_moved, f"template {firsts[key]!r}: {e}")
            # Said now, not only in the warning at the end: every shape of this executable
            # is captured here instead, which takes as long as the saving process's capture.
            progress(f"template {firsts[key]!r} did not move ({str(e).splitlines()[0]}); "
                     f"capturing its {len(saved.variants[key].shapes) - 1} other shapes here")
        first = firsts[key]
        name = group_of[first] = _add_shape(groups, variants, first, base)
        rest = [s for s in saved.variants[key].shapes if s != first]
        if moved is not None and groups[name].template_shape == first:
            # base is its executable's template: every saved version moves onto it at once
            variants[name], failed = relocate_variants(saved.variants[key], moved, base)
            variants[name].takes_alternates = can_disable  # for shapes captured here
            group_of.update(dict.fromkeys(variants[name].shapes, name))
            why.update(failed)
            rest = list(failed)
        elif moved is not None:  # base joined another executable: placed graph by graph
            left = []
            for shape in rest:
                try:
                    ops = relocate_all(saved.variants[key].ops(shape), moved)
                    group_of[shape] = _add_shape(groups, variants, shape, graph_with(base, ops))
                except UnsupportedError as e:
                    why[shape] = str(e)
                    left.append(shape)
            rest = left
        else:
            why.update(dict.fromkeys(rest, "its template did not move"))
        tried = len(learned)  # what the functions known when the shapes failed could not move
        for shape in rest:
            theirs = saved.graph(shape) if moved is not None else None
            if theirs is not None and any(k.function not in moved.functions
                                          for _, k in theirs.kernels()):
                # Functions not paired yet (cuBLAS picks kernels by size, and loads their
                # modules as it first picks them): the ones this shape runs, from a capture
                # never read into the IR, by name, where a name is one function each side.
                looked += 1
                learned.update(learn_functions_by_name(
                    moved, theirs, functions_run(lambda s=shape: step(s), pool=pool)))
            if moved is not None and len(learned) > tried:
                try:  # moved after all, where what held it back was such a function
                    ops = relocate_all(saved.variants[key].ops(shape), moved)
                    group_of[shape] = _add_shape(groups, variants, shape, graph_with(base, ops))
                    del why[shape]
                    moved_later += 1
                    continue
                except UnsupportedError as e:
                    why[shape] = str(e)
            ir = here(shape)
            group_of[shape] = _add_shape(groups, variants, shape, ir)
            if theirs is not None:
                learned.update(learn_functions(moved, theirs, ir))
    progress(f"placed every shape ({looked} shapes' kernel functions looked up, "
             f"{len(captured)} captured) in {time.perf_counter() - began:.2f} s")
    if update != "device" and (rebuilt := _with_alternates(groups, variants)):
        progress(f"built {rebuilt} executables again with their alternates "
                 f"({_count_alternates(variants)})")
    for shape, reason in why.items():
        _note(not_moved, f"shape {shape!r}: {reason}")
    keep: list[Any] = [arena]
    if not_moved:  # executables that run on memory captured here
        keep += pool_graphs[:1]
    else:  # every executable runs on the arena: the captures' pool goes back
        pool_graphs.clear()
        fresh.clear()
        torch.cuda.empty_cache()
    if len(captured) > len(saved.templates):
        warnings.warn(f"{path}: {len(captured)} of {len(saved.shapes)} shapes captured here "
                      f"({len(saved.templates)} templates; the others' saved changes did not "
                      f"move to this process; first: {not_moved[0].splitlines()[0]})",
                      stacklevel=2)
    progress(f"loaded {len(saved.shapes)} shapes, {len(captured)} captured here, in "
             f"{time.perf_counter() - began:.2f} s"
             + (f" ({len(learned)} kernel functions, learned from the kernels of {looked} "
                f"shapes run here and from the captures, moved {moved_later} more)"
                if learned else ""))
    torch.cuda.synchronize()
    family = Family(step, groups, group_of, variants, _pool_bytes(pool),
                    0.0, keep, update=update, captured_here=len(captured),
                    not_moved=not_moved, scratch=frozenset(b.id for b in scratch.values()))
    if prepare:
        progress(f"prepared {family.prepare_updates()} node updates, "
                 f"{time.perf_counter() - began:.2f} s in all")
    return family


# Where a saved scratch buffer goes here keeps its address modulo this: kernels were chosen on
# the host for their pointers' alignment (vectorised loads), which the move must not change.
_ALIGN = 2 << 20


def _arena(buffers: Iterable[Buffer]) -> tuple[torch.Tensor | None, dict[str, Buffer]]:
    """One allocation holding each saved scratch buffer whole (``_placed``): the allocation
    (None without buffers) and each saved id's buffer here."""
    buffers = list(buffers)
    if not buffers:
        return None, {}
    arena = torch.empty(_arena_bytes(buffers), dtype=torch.uint8, device="cuda")
    return arena, _placed(buffers, arena.data_ptr())


def _arena_bytes(buffers: Iterable[Buffer]) -> int:
    return sum(b.size + _ALIGN for b in buffers)


def _placed(buffers: Iterable[Buffer], start: int) -> dict[str, Buffer]:
    """Each saved buffer's place in an arena from ``start`` of ``_arena_bytes`` bytes: one after
    another, each at its saved address modulo ``_ALIGN``."""
    cursor, here = start, {}
    for b in sorted(buffers, key=lambda b: b.id):
        address = cursor + (b.address - cursor) % _ALIGN
        here[b.id] = Buffer(f"scratch@{address:#x}", b.size, BufferRole.INTERNAL,
                            address=address)
        cursor = address + b.size
    return here


def scratch_of(graphs: Iterable[KernelGraph],
               segments: Iterable[tuple[int, int]]) -> frozenset[str]:
    """The internal device buffers of ``graphs`` inside ``segments`` (address, size) that no
    named buffer (input, output, parameter) overlaps: memory only the graphs use."""
    segments = list(segments)
    buffers = [b for g in graphs for b in g.buffers.values()
               if b.address is not None and b.memory == Memory.DEVICE]

    def overlaps(b: Buffer, start: int, size: int) -> bool:
        return b.address < start + size and start < b.address + b.size

    clean = [(a, n) for a, n in segments
             if not any(b.role != BufferRole.INTERNAL and overlaps(b, a, n) for b in buffers)]
    return frozenset(b.id for b in buffers if b.role == BufferRole.INTERNAL and any(
        a <= b.address and b.address + b.size <= a + n for a, n in clean))


def _with_alternates(groups: Mapping[str, _Group], variants: Mapping[str, Variants]) -> int:
    """Build again, with their alternates (``Variants.executable_graph``), the executables whose
    shapes added alternates since they were instantiated, each holding its template's shape
    (its alternates disabled). Returns how many were built."""
    rebuilt = 0
    for name, group in groups.items():
        v = variants[name]
        if v.alternate_count == group.alternates:
            continue
        _instantiate(group, v)
        rebuilt += 1
    return rebuilt


def _instantiate(group: _Group, v: Variants, plan: SwitchPlan | None = None
                 ) -> DeviceSwitch | None:
    """Give ``group`` a new graph and executable built from ``v``'s template and alternates,
    holding the template's shape; the old ones are closed. ``plan``: a device switch's, made
    on the new graph before it is instantiated (its nodes must be device-updatable then), and
    returned."""
    graph = Graph.build(v.executable_graph())
    switch = None
    try:
        if plan is not None:
            switch = DeviceSwitch(graph, plan.versions, plan.table)
        executable = graph.instantiate()
        Graph.apply(executable, [graph.prepare_enabled(n, False)
                                 for n in v.disabled(group.template_shape)])
    except BaseException:
        if switch is not None:
            switch.close()
        graph.close()
        raise
    group.executable.close()
    group.graph.close()
    group.graph, group.executable = graph, executable
    group.holds = group.template_shape
    group.alternates = v.alternate_count
    return switch


def _count_alternates(variants: Mapping[str, Variants]) -> int:
    return sum(v.alternate_count for v in variants.values())


def _note(reasons: list[str], reason: str, keep: int = 5) -> None:
    """Keep the first few reasons: one per shape would repeat itself hundreds of times."""
    if len(reasons) < keep:
        reasons.append(reason)


def _add_shape(groups: dict[str, _Group], variants: dict[str, Variants], shape: Hashable,
               ir: KernelGraph, graph: Graph | None = None, topology: str | None = None,
               pairs: Callable[[str], Mapping[str, str] | None] | None = None) -> str:
    """Put ``shape`` in the group whose executable can take it, or start one; returns the
    group's key. ``graph``: the shape's own graph, built, for whole-graph updates (the
    executable is then brought to it here); ``topology``: its ``fingerprint(launch=False)``
    where already known; ``pairs``: a group's key to its template's match with ``ir``, where
    known without matching."""
    topology = topology or _topology(groups, ir)
    if graph is not None:
        key = _place_whole(groups, variants, topology, shape, ir, graph)
    else:
        key = _place(groups, variants, topology, shape, ir, pairs)
    if key not in groups:
        built = graph or Graph.build(ir)
        groups[key] = _Group(shape, ir, built, built.instantiate(), shape)
        # Alternates (kernels whose launch attributes change) for updates in place, of kernels
        # the driver lets an executable disable; a whole-graph update cannot enable or disable
        # nodes, so there such a shape starts another executable.
        variants[key] = Variants(ir, alternates=can_disable if graph is None else False)
        variants[key].shapes[shape] = {}
    elif graph is not None:
        groups[key].holds = shape  # _place_whole brought the executable to it
    return key


def _topology(groups: Mapping[str, _Group], ir: KernelGraph) -> str:
    """``ir``'s ``fingerprint(launch=False)``: an executable's, where its template is the same
    structure under the same node ids (``same_ids``: captures of one step usually are), which
    spares hashing the graph (a third of a captured shape's placement on the host)."""
    return next((k.split("#")[0] for k, g in groups.items() if same_ids(g.template, ir)),
                None) or fingerprint(ir, launch=False)


def _variants_of(groups: Mapping[str, _Group], topology: str) -> list[str]:
    return [k for k in groups if k.split("#")[0] == topology]


def _new_key(groups: Mapping[str, _Group], topology: str) -> str:
    count = len(_variants_of(groups, topology))
    return f"{topology}#{count}" if count else topology


def _place_whole(groups: Mapping[str, _Group], variants: Mapping[str, Variants], topology: str,
                 shape: Hashable, ir: KernelGraph, graph: Graph) -> str:
    """The group a shape joins under whole-graph updates: the first executable of its
    topology that the driver updates to the shape's graph (tried here, so that a refusal shows
    at capture, not at run time), or a new one."""
    for key in _variants_of(groups, topology):
        try:
            # add_graph refuses kernels whose attributes change: cuGraphExecUpdate took such
            # changes on the H200 and the kernels then hit an illegal instruction (Wav2Vec2's,
            # whose cluster shapes vary with the length).
            variants[key].add_graph(shape, ir)
        except UnsupportedError:
            continue
        try:
            groups[key].executable.update(graph)
        except UnsupportedError:
            variants[key].discard(shape)
            continue
        return key
    return _new_key(groups, topology)


def _place(groups: Mapping[str, _Group], variants: Mapping[str, Variants], topology: str,
           shape: Hashable, ir: KernelGraph,
           pairs: Callable[[str], Mapping[str, str] | None] | None = None) -> str:
    """The group a shape joins: the first executable of its topology that can take the shape
    by updates in place (``Variants.add_graph``, alternates included), which then holds the
    shape's versions. Where none can (a kernel whose attributes change with the shape and
    that the driver will not disable, as a cuDNN convolution for Wav2Vec2 in clusters of 16
    blocks on the H200), the shape starts another executable of that topology, keyed
    ``topology#n``."""
    for key in _variants_of(groups, topology):
        try:
            variants[key].add_graph(shape, ir, pairs(key) if pairs else None)
        except UnsupportedError:
            continue
        return key
    return _new_key(groups, topology)
