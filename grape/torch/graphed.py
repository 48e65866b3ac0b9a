"""``grape.graphed(fn)``: any PyTorch callable as graph launches, its inputs never copied.

``torch.cuda.make_graphed_callables`` and a plain capture read their inputs from static
placeholder tensors, so every call first copies the caller's tensors into them. A
:class:`Graphed` callable reads the caller's tensors where they lie instead (alias
prediction): the first call of each input signature (shapes, dtypes, strides) captures
``fn`` on the caller's tensors into the IR; a later call whose tensors sit at other addresses
updates only the nodes that read them (``grape.passes.alias.repoint``), and one whose tensors
sit where they did (PyTorch's caching allocator tends to give a call site the same block
again) updates nothing. ``copy_bytes`` stays 0 but for one case: a tensor argument lying in
memory a graph of the callable writes (an output of an earlier call, passed back in) would be
overwritten while the graph reads it, so its storage is copied first, with one warning, and
counted there.

Signatures form families: a signature whose graph has the topology of one captured before
(an encoder at another sequence length, usually) joins that signature's executable as a
parameter delta (``grape.passes.delta.join``) instead of instantiating its own, and a call
brings the executable to its signature by updating the nodes that differ, prepared once per
pair of signatures. So executables' device memory grows with the topologies a callable has,
not with its shapes. A signature the executable cannot take in place (a kernel whose launch
attributes change with the shape) gets an executable of its own. ``shapes`` (argument tuples)
captures signatures when the callable is made, largest first, so that no call pays a capture.

What a call returns are the graph's own output tensors, valid until the next call: the next
call of the same signature writes its results into them, and a call of another signature may
write its activations over them (signatures share one memory pool, so that every length's
activations fit in the memory of the largest: PyTorch's graphs sharing a pool behave alike).
Clone what must outlive the call. Calls run on the current stream, one at a time: threads
that call one graphed callable take turns (a lock), since a call brings the shared executable
to its signature before it launches.

``concurrent=True`` builds each signature's graph as the DAG its memory demands
(``grape.passes.concurrency``, as ``grape.generate``'s default does for its steps), so that
operations touching no common memory run side by side: a gain where the callable's kernels
leave most of the GPU idle (small batches, short sequences). Signatures share an executable
only where their DAGs have the same edges too. A capture the pass cannot take (operations it
cannot fit to the graph's nodes) keeps the captured chain, with a warning.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from grape.cuda.build import Executable, Graph, Update
from grape.errors import GrapeError, UnsupportedError
from grape.ir import Kernel, KernelGraph, Memcpy, Memset, fingerprint
from grape.passes.alias import repoint
from grape.passes.concurrency import concurrent as concurrent_dag
from grape.passes.delta import ShapeDelta, identity, join
from grape.torch.aliasing import Inputs, signature
from grape.torch.capture import TorchCapture, capture, pool_segments
from grape.torch.control import capturing
from grape.torch.experts import experts_on_device
from grape.torch.hfmasks import no_padding_shortcut
from grape.torch.masked_writes import masked_writes

__all__ = ["CallStats", "Graphed", "graphed"]

_LOG = logging.getLogger("grape")

# A switch that changes more than this fraction of an executable's nodes takes the signature's
# whole graph in one cuGraphExecUpdate: on the H200 that cost about 0.9 us per node of the
# graph, against about 2.4 us per changed node updated one cuda-python call at a time
# (benchmarks/README.md, families).
_WHOLE = 0.4


@dataclass
class CallStats:
    calls: int = 0
    captures: int = 0
    pointer_updates: int = 0  # nodes re-pointed at inputs that moved, over all calls
    switches: int = 0  # calls that brought a shared executable to another signature
    switch_updates: int = 0  # nodes those calls updated
    whole_updates: int = 0  # switches made as one whole-graph update
    # inputs copied: only those lying in a graph output's memory (see the module)
    copy_bytes: int = 0


@dataclass(eq=False)
class _Shared:
    """One executable, and the graph whose topology every signature it serves shares."""

    template: KernelGraph  # the first signature's graph; its table takes every member's buffers
    graph: Graph
    executable: Executable
    holds: _Entry | None = None  # the signature whose parameters the executable has now


@dataclass(eq=False)
class _Entry:
    captured: TorchCapture  # keeps the capture's memory in the pool, and its outputs
    ir: KernelGraph  # this signature's graph, reading its inputs where they lay last
    shared: _Shared
    delta: ShapeDelta  # against shared.template
    nodes: dict[str, str]  # template node -> this graph's node
    inputs: Inputs
    reads: frozenset[str]  # template nodes whose parameters name this signature's inputs
    varies: frozenset[str]  # template nodes whose parameters this signature changes, or reads
    # This signature's own graph, built as the executable's was (host memory only; for the
    # first signature, the one the executable was instantiated from): a switch that changes
    # most nodes takes its parameters in one cuGraphExecUpdate. None: the driver refused it.
    graph: Graph | None = None
    captured_at: tuple[int, ...] = ()  # input addresses ``graph`` reads
    updates: dict[str, Update] = field(default_factory=dict)  # per template node, prepared
    switches: dict[int, list[str]] = field(default_factory=dict)  # nodes to update, by holder
    depth: int = 0  # nodes on the graph's longest path (its node count, captured as a chain)

    def update(self, node: str) -> Update:
        """The prepared update that gives ``node`` this signature's parameters as they are."""
        u = self.updates.get(node)
        if u is None:
            (u,) = self.shared.graph.prepare({node: self.ir.op(self.nodes[node])})
            self.updates[node] = u
        return u


def _reading(ir: KernelGraph, names: set[str]) -> set[str]:
    """The nodes of ``ir`` that point into one of the buffers ``names``."""
    nodes = set()
    for node, op in ir.ops():
        if isinstance(op, Kernel):
            spans = [p.target for p in op.pointers]
        elif isinstance(op, Memcpy | Memset):
            spans = list(op.spans())
        else:
            continue
        if any(s.buffer in names for s in spans):
            nodes.add(node)
    return nodes


@dataclass
class Graphed:
    fn: Callable[..., Any]
    params: Mapping[str, torch.Tensor] | None = None
    share: bool = True  # signatures of one topology share an executable (False: one each)
    warmup: int = 1  # eager runs before each capture (0 where fn changes state it keeps)
    concurrent: bool = False  # each signature's graph as the DAG its memory demands
    stats: CallStats = field(default_factory=CallStats)
    _entries: dict[tuple, _Entry] = field(default_factory=dict)
    _shared: dict[str, list[_Shared]] = field(default_factory=dict)  # by topology
    _pool: Any = None
    # The pool outputs' storages, merged: disjoint (start, end) ranges in address order
    _written: list[tuple[int, int]] = field(default_factory=list)
    _warned: bool = False  # that an input in an output's memory was copied
    # One call at a time: bringing the executable to a signature, then launching it, is one
    # step. The driver orders launches of one executable behind each other (cuGraphLaunch), but
    # graph objects are not thread-safe, and another thread's updates landing between this
    # call's updates and its launch would run this launch with that thread's parameters.
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @property
    def signatures(self) -> int:
        return len(self._entries)

    @property
    def executables(self) -> int:
        return sum(len(v) for v in self._shared.values())

    @property
    def paths(self) -> list[tuple[int, int]]:
        """Each signature's (nodes, nodes on its longest path), in the order captured: equal
        in a chain, the second smaller where ``concurrent`` let operations run side by side."""
        return [(len(e.ir), e.depth) for e in self._entries.values()]

    @property
    def device_bytes(self) -> int:
        """Device memory the executables took at instantiation (free memory's drop, so exact
        only to the driver's allocation granularity: see ``Executable``)."""
        return sum(s.executable.device_bytes for v in self._shared.values() for s in v)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            entry, tensors = self._entry(args, kwargs)
            self._bring(entry, tensors)
            entry.shared.executable.launch(torch.cuda.current_stream().cuda_stream)
            self.stats.calls += 1
            return entry.captured.outputs

    def prepare(self, *args: Any, **kwargs: Any) -> None:
        """Capture the arguments' signature now, if it is new, without running ``fn`` for it."""
        with self._lock:
            self._entry(args, kwargs)

    def _entry(self, args: tuple, kwargs: dict) -> tuple[_Entry, list[torch.Tensor]]:
        # Arguments as PyTorch's pytrees see them: tensors anywhere in tuples, lists and dicts
        # (keyword arguments too) are inputs; everything else is part of the signature.
        leaves, spec = tree_flatten((args, kwargs))
        tensors, key = [], [spec]
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                if not leaf.is_cuda:
                    raise GrapeError(f"expected CUDA tensors as inputs of a graphed callable, "
                                     f"found one on {leaf.device}")
                if self._written and self._inside_output(leaf):
                    leaf = leaves[i] = self._apart(leaf)
                tensors.append(leaf)
                key.append(signature(leaf))
            else:
                try:
                    hash(leaf)
                except TypeError:
                    raise GrapeError(f"expected tensors and hashable values as arguments, "
                                     f"found a {type(leaf).__name__}") from None
                key.append(("value", leaf))
        entry = self._entries.get(tuple(key))
        if entry is None:
            entry = self._entries[tuple(key)] = self._capture(leaves, spec, tensors)
        return entry, tensors

    def _note_written(self, outputs: Any) -> None:
        """Remember the outputs a launch writes: those in the graphs' pool. An output that is
        a view of an input, a parameter or other memory of the caller's is not the graph's
        (an in-place function's result is its argument, which must stay where it lies)."""
        segments = pool_segments(self._pool)
        for out in tree_flatten(outputs)[0]:
            if isinstance(out, torch.Tensor):
                storage = out.untyped_storage()
                start = storage.data_ptr()
                if any(a <= start < a + size for a, size in segments):
                    self._add_written(start, start + storage.nbytes())

    def _add_written(self, start: int, end: int) -> None:
        merged: list[tuple[int, int]] = []
        for a, b in sorted([*self._written, (start, end)]):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self._written = merged

    def _inside_output(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage overlaps an output of one of the callable's graphs: memory
        a launch writes (a signature's outputs, or temporaries of another signature sharing
        the pool, placed where that output was free at its capture). One bisection a call,
        however many signatures: of the disjoint ranges starting before ``t``'s storage ends,
        only the last can reach into it."""
        storage = t.untyped_storage()
        start = storage.data_ptr()
        end = start + storage.nbytes()
        i = bisect.bisect_left(self._written, (end,)) - 1
        return i >= 0 and self._written[i][1] > start

    def _apart(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` over a copy of its storage (its offset and strides kept, so its signature too),
        where no launch writes."""
        storage = t.untyped_storage().clone()
        self.stats.copy_bytes += storage.nbytes()
        if not self._warned:
            self._warned = True
            warnings.warn("grape.graphed: an argument lies in the memory of an output of an "
                          "earlier call, which the graph writes while reading it; it is copied "
                          "first (clone outputs you pass back in to avoid the copy)",
                          stacklevel=4)  # (_apart, _entry, __call__, the caller's line)
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            storage, t.storage_offset(), t.shape, t.stride())

    def _capture(self, leaves: list, spec: Any, tensors: list[torch.Tensor]) -> _Entry:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Each signature names its inputs and outputs apart: members of one executable share
        # its buffer table.
        tag = f"s{len(self._entries)}/"
        inputs = Inputs.of(tensors, tag)  # refuses views sharing memory, before the capture
        # The values kept, not the first call's tensors (they would stay alive with the entry).
        kept = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        fn = self.fn

        def call(*given: torch.Tensor) -> Any:
            filled = list(kept)
            for i, t in zip(at, given, strict=True):
                filled[i] = t
            args, kwargs = tree_unflatten(filled, spec)
            # A Hugging Face model given no padding mask attends without one under the
            # capture too, as it does eagerly (its fused kernels; grape.torch.hfmasks); a
            # write through a mask reads no count back (grape.torch.masked_writes).
            with no_padding_shortcut(), (masked_writes() if capturing()
                                         else contextlib.nullcontext()):
                return fn(*args, **kwargs)

        began = time.perf_counter()
        # (the experts that would read back, of the modules fn runs, run on the device:
        # grape.torch.experts)
        with contextlib.ExitStack() as switched:
            for module in modules_of(fn):
                switched.enter_context(experts_on_device(module))
            captured = capture(call, *tensors, params=self.params, pool=self._pool,
                               instantiate=False, tag=tag, warmup=self.warmup,
                               accesses=self.concurrent)
        if made := next((t.grad_fn for t in tree_flatten(captured.outputs)[0]
                         if isinstance(t, torch.Tensor) and t.grad_fn is not None), None):
            # Autograd would run the capture's one backward graph over whatever a later launch
            # left in its saved tensors, and only once.
            raise GrapeError(f"expected outputs that need no gradient (grape.graphed replays "
                             f"the forward alone), found one made by {type(made).__name__}: "
                             f"call it under torch.no_grad() or torch.inference_mode()")
        self.stats.captures += 1
        ir, depth = self._dag(captured)
        variants = self._shared.setdefault(fingerprint(ir, launch=False), [])
        for shared in variants if self.share else ():
            try:
                d = join(shared.template, ir)
            except UnsupportedError:
                continue
            nodes = dict(d.mapping)
            break
        else:
            graph = Graph.build(ir)
            shared = _Shared(ir, graph, graph.instantiate())
            variants.append(shared)
            d, nodes = identity(ir), {n: n for n in ir.dag}
        back = {mine: t for t, mine in nodes.items()}
        reads = frozenset(back[n] for n in _reading(ir, set(inputs.names)))
        varies = reads | {nd.node for nd in d.nodes}
        entry = _Entry(captured, ir, shared, d, nodes, inputs, reads, varies, depth=depth)
        self._note_written(captured.outputs)
        # Built now, so that a first switch costs what later ones do.
        entry.graph = shared.graph if shared.holds is None else Graph.build(ir)
        entry.captured_at = tuple(inputs.addresses)
        if shared.holds is None:  # instantiated from this signature's graph
            shared.holds = entry
        _LOG.info("grape.graphed: signature %d of %s (inputs %s) captured in %.2f s: %d "
                  "nodes, %d on the longest path, %s", len(self._entries) + 1,
                  getattr(self.fn, "__name__", type(self.fn).__name__),
                  ", ".join(f"{tuple(t.shape)}" for t in tensors),
                  time.perf_counter() - began, len(ir), depth,
                  "a new executable" if shared.template is ir else "joining an executable")
        return entry

    def _dag(self, captured: TorchCapture) -> tuple[KernelGraph, int]:
        """The graph a signature runs, and its longest path in nodes."""
        if not self.concurrent:
            return captured.ir, len(captured.ir)
        try:
            dag = concurrent_dag(captured.ir, captured.accesses, captured.allocations)
        except UnsupportedError as e:
            # (stacklevel: _dag, _capture, _entry, __call__, then the caller's line)
            warnings.warn(f"grape.graphed(concurrent=True): the capture runs as captured, one "
                          f"operation after another: {str(e).splitlines()[0]}", stacklevel=5)
            return captured.ir, len(captured.ir)
        return dag.graph, dag.depth

    def _bring(self, entry: _Entry, tensors: list[torch.Tensor]) -> None:
        """Update the entry's executable to read ``tensors`` with the entry's parameters."""
        shared = entry.shared
        moved = entry.inputs.moves(tensors, entry.ir.buffers)
        changed: list[str] = []
        if moved:
            entry.ir, ops = repoint(entry.ir, moved)
            for name in moved:  # copies and memsets resolve addresses through the table
                shared.template.buffers[name] = entry.ir.buffers[name]
            back = {mine: t for t, mine in entry.nodes.items()}
            changed = [back[n] for n in ops]
            for n in changed:
                entry.updates.pop(n, None)
            self.stats.pointer_updates += len(changed)
        held = shared.holds
        if held is entry:
            Graph.apply(shared.executable, [entry.update(n) for n in changed])
            return
        # Another signature's parameters: update every node either signature changes against
        # the template or reads its inputs through, a superset of those that differ between
        # the two, found without decoding a delta's arguments (which cost milliseconds per
        # pair in Python, and most nodes differ anyway).
        nodes = entry.switches.get(id(held))
        if nodes is None:
            nodes = entry.switches[id(held)] = sorted(held.varies | entry.varies)
        updated = len(nodes)
        if entry.graph is not None and len(nodes) > _WHOLE * len(shared.template):
            try:
                shared.executable.update(entry.graph)
                self.stats.whole_updates += 1
                # The graph reads the inputs where the capture found them: re-point if moved.
                moved_since = tuple(entry.inputs.addresses) != entry.captured_at
                nodes = sorted(entry.reads) if moved_since else []
            except UnsupportedError:
                entry.graph = None  # the driver refuses: node by node from now on
        Graph.apply(shared.executable, [entry.update(n) for n in nodes])
        shared.holds = entry
        self.stats.switches += 1
        self.stats.switch_updates += updated

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        for entry in self._entries.values():
            if entry.graph is not None and entry.graph is not entry.shared.graph:
                entry.graph.close()
        for variants in self._shared.values():
            for shared in variants:
                shared.executable.close()
                shared.graph.close()
        self._shared.clear()
        self._entries.clear()
        self._written.clear()


def modules_of(fn: Callable[..., Any]) -> list[torch.nn.Module]:
    """The modules ``fn`` runs, as far as they can be found without running it: ``fn`` itself,
    the module whose method it is, what a ``functools.partial`` binds, and the modules a
    closure holds (``lambda ids: model(ids).logits``). A module reached only through globals
    is not found (its experts are then not switched, and a capture that reads back says
    where)."""
    found: dict[int, torch.nn.Module] = {}
    pending: list[Any] = [fn]
    seen: set[int] = set()  # (closures may hold each other)
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.nn.Module):
            found[id(item)] = item
        elif isinstance(item, functools.partial):
            pending += [item.func, *item.args, *item.keywords.values()]
        elif callable(item):
            pending.append(getattr(item, "__self__", None))
            for cell in getattr(item, "__closure__", None) or ():
                try:
                    pending.append(cell.cell_contents)
                except ValueError:  # (a cell not yet filled)
                    continue
    return list(found.values())


def graphed(fn: Callable[..., Any], *, params: Mapping[str, torch.Tensor] | None = None,
            shapes: Iterable[tuple] | None = None, share: bool = True,
            warmup: int = 1, concurrent: bool = False) -> Graphed:
    """``fn`` as graph launches: captured on its first call per input signature, then re-pointed
    at each call's tensors rather than copying them, signatures of one topology sharing one
    executable (see the module's documentation).

    ``fn`` must be capturable (no host syncs, no copies from pageable CPU memory), return
    nothing that needs a gradient (call it under ``torch.no_grad()``: a training step graphs
    its backward inside ``fn``, as ``grape.torch.training`` does), and run on
    its tensor arguments, which may sit anywhere in its positional and keyword arguments
    (tuples, lists and dicts of them, as PyTorch's pytrees see them); its first call per
    signature runs it once eagerly before capturing it (lazy initialisation must happen
    outside a capture), so it should not update state in place, or tolerate doing so twice.
    ``params`` (``dict(model.named_parameters())``) names the weights in the IR. Non-tensor
    arguments (hashable values) and the arguments' structure are part of the signature:
    another value captures anew. ``shapes``: positional argument tuples whose signatures are
    captured now, in the order given (largest first lets every smaller shape's activations
    reuse the largest's memory).
    ``share=False`` instantiates an executable per signature (what per-shape graphs cost; for
    comparisons). ``warmup=0`` captures without running ``fn`` first, for a ``fn`` that
    changes state it keeps (a training step) and has already run once. ``concurrent=True``:
    each signature's graph as the DAG its memory demands, independent operations side by side
    (see the module). A mixture of experts' layers that would read back, in the modules ``fn``
    runs (as :func:`modules_of` finds them), run on the device while it is captured
    (``grape.torch.experts``).
    """
    if not callable(fn):
        raise GrapeError(f"expected a callable to graph, found {type(fn).__name__}")
    if not isinstance(concurrent, bool):
        raise GrapeError(f"expected concurrent=True or False, found {concurrent!r}")
    g = Graphed(fn, params, share, warmup, concurrent)
    for args in shapes or ():
        if not isinstance(args, tuple):
            raise GrapeError(f"expected shapes as tuples of arguments, found a "
                             f"{type(args).__name__}")
        g.prepare(*args)
    return g
