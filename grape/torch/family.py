"""Graph families: one executable per topology, brought to each shape by its parameter delta.

``capture_family(step, shapes)`` captures ``step(shape)`` for every shape, in the order given
(largest first: every shape's activations then live in the memory the largest one took),
into one shared memory pool, and reads each capture into the IR. Shapes group by topology
fingerprint (``grape.passes.families``); each group instantiates one executable, from its
first shape's graph (the template), and every other shape keeps only its delta against the
template (``grape.passes.delta``, coded by ``grape.passes.compress``). A shape whose delta an
executable cannot take in place (a kernel's attributes change) starts another executable of
its topology instead. ``family.run(shape)``
updates the executable's nodes that differ from the shape it holds (``transition``) and
launches it. A shape outside the family runs ``step`` eagerly, with a warning.

``step`` must keep its buffers in place across shapes (a preallocated cache such as
``grape.torch.cache.PrefixCache``, outputs written into a static tensor): what it returns is
dropped, so that one shape's outputs do not push the next shape's allocations elsewhere.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from grape.cuda.build import Executable, Graph, Update
from grape.errors import GrapeError, UnsupportedError
from grape.ir import KernelGraph, fingerprint
from grape.passes.delta import ShapeDelta, delta, transition
from grape.torch.capture import capture

__all__ = ["Family", "capture_family"]


@dataclass
class _Group:
    template_shape: Hashable
    template: KernelGraph
    graph: Graph
    executable: Executable
    holds: Hashable  # the shape whose parameters the executable holds now


@dataclass
class Family:
    step: Callable[[Hashable], Any]
    groups: dict[str, _Group]
    group_of: dict[Hashable, str]
    deltas: dict[Hashable, ShapeDelta]
    pool_bytes: int  # the shared pool's growth over the whole capture
    capture_s: float  # capture, reading into the IR, deltas and instantiation, all shapes
    keep: list[Any] = field(default_factory=list)  # the torch graph that holds the pool
    _prepared: dict[tuple[Hashable, Hashable], list[Update]] = field(default_factory=dict)
    _warned: set[Hashable] = field(default_factory=set)
    update_s: float = 0.0  # host time spent bringing executables to shapes, all runs
    updated_nodes: int = 0

    @property
    def graph_bytes(self) -> int:
        """Device memory the family's executables took at instantiation (one per topology),
        as free memory's drop: one or two executables can sit below the driver's allocation
        granularity and read 0 (they did on the H200), so measure over many copies for a
        figure (``benchmarks/families.py`` does)."""
        return sum(g.executable.device_bytes for g in self.groups.values())

    @property
    def delta_bytes(self) -> int:
        """Host bytes the coded argument deltas keep, all shapes."""
        return sum(d.args_bytes for d in self.deltas.values())

    def run(self, shape: Hashable, stream: int | None = None) -> None:
        """Run ``step(shape)``: the family's executable brought to ``shape``, or eagerly (with
        a warning, once per shape) when ``shape`` was never captured."""
        name = self.group_of.get(shape)
        if name is None:
            if shape not in self._warned:
                self._warned.add(shape)
                warnings.warn(f"shape {shape!r} is not in the family (captured: "
                              f"{len(self.group_of)} shapes): running it eagerly", stacklevel=2)
            self.step(shape)
            return
        group = self.groups[name]
        if group.holds != shape:
            t = time.perf_counter()
            key = (group.holds, shape)
            updates = self._prepared.get(key)
            if updates is None:
                ops = transition(group.template, self.deltas[group.holds], self.deltas[shape])
                updates = self._prepared[key] = group.graph.prepare(ops)
            Graph.apply(group.executable, updates)
            group.holds = shape
            self.update_s += time.perf_counter() - t
            self.updated_nodes += len(updates)
        group.executable.launch(torch.cuda.current_stream().cuda_stream
                                if stream is None else stream)

    def close(self) -> None:
        for g in self.groups.values():
            g.executable.close()
            g.graph.close()


def capture_family(step: Callable[[Hashable], Any], shapes: Iterable[Hashable],
                   params: Mapping[str, torch.Tensor] | None = None,
                   progress: Callable[[str], None] = lambda line: None) -> Family:
    """Capture ``step(shape)`` for each shape (largest first) into one family.

    Raises
    ------
    CaptureError
        ``step`` cannot be captured for some shape (the message names the user's line).
    GrapeError
        No shapes, or a shape given twice.
    """
    shapes = list(shapes)
    if not shapes or len(set(shapes)) != len(shapes):
        raise GrapeError(f"expected distinct shapes to capture, found {len(shapes)} with "
                         f"{len(shapes) - len(set(shapes))} repeated")
    began = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    reserved = torch.cuda.memory_reserved()
    groups: dict[str, _Group] = {}
    group_of: dict[Hashable, str] = {}
    deltas: dict[Hashable, ShapeDelta] = {}
    keep: list[Any] = []
    for i, shape in enumerate(shapes):
        cap = capture(lambda s=shape: step(s), params=params, pool=pool, instantiate=False,
                      collect=False)
        ir = cap.ir
        key, deltas[shape] = _place(groups, fingerprint(ir, launch=False), ir, shape)
        if key not in groups:
            graph = Graph.build(ir)
            groups[key] = _Group(shape, ir, graph, graph.instantiate(), shape)
            keep.append(cap.torch_graph)  # keeps the shared pool's memory for the family
        group_of[shape] = key
        if (i + 1) % 50 == 0 or i + 1 == len(shapes):
            progress(f"captured {i + 1}/{len(shapes)} shapes, {len(groups)} executables")
    torch.cuda.synchronize()
    return Family(step, groups, group_of, deltas,
                  torch.cuda.memory_reserved() - reserved, time.perf_counter() - began, keep)


def _place(groups: Mapping[str, _Group], topology: str, ir: KernelGraph, shape: Hashable
           ) -> tuple[str, ShapeDelta]:
    """The group a shape joins, and its delta against the group's template: the first
    executable of its topology that can take the shape by updates in place. Where none can (a
    kernel whose attributes change with the shape, as the H200's convolution kernels for
    Wav2Vec2 did), the shape starts another executable of that topology, keyed
    ``topology#n``, and its delta is empty."""
    variants = [k for k in groups if k.split("#")[0] == topology]
    for key in variants:
        template = groups[key].template
        d = delta(template, ir)
        clash = [b for b in ir.buffers.values()
                 if b.id in template.buffers and template.buffers[b.id] != b]
        try:
            _check_updatable(template, d, shape)
        except UnsupportedError:
            continue
        if clash:
            continue
        # The shape's nodes may write memory the template's never touched (the shared pool
        # handed its capture another block): the executable's builder resolves addresses
        # through the template's table, so the table takes the shape's buffers too.
        for b in ir.buffers.values():
            if b.id not in template.buffers:
                template.add_buffer(b)
        return key, d
    key = f"{topology}#{len(variants)}" if variants else topology
    return key, delta(ir, ir)


def _check_updatable(template: KernelGraph, d: ShapeDelta, shape: Hashable) -> None:
    """Refuse, at capture, a shape whose delta an executable cannot take in place."""
    for nd in d.nodes:
        if nd.kernel is not None and "attributes" in dict(nd.kernel.fields):
            raise UnsupportedError(f"node {nd.node!r} changes kernel attributes, which an "
                                   f"executable cannot update in place")
        op = template.op(nd.node)
        if nd.replacement is not None and op.kind not in ("memcpy", "memset"):
            raise UnsupportedError(f"node {nd.node!r} ({op.kind}) changes, and only kernels, "
                                   f"copies and memsets update in place")
