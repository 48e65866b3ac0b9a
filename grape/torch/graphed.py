"""``grape.graphed(fn)``: any PyTorch callable as graph launches, its inputs never copied.

``torch.cuda.make_graphed_callables`` and a plain capture read their inputs from static
placeholder tensors, so every call first copies the caller's tensors into them. A
:class:`Graphed` callable reads the caller's tensors where they lie instead (alias
prediction): the first call of each input signature (shapes, dtypes, strides) captures
``fn`` on the caller's tensors into the IR and builds its own executable; a later call whose
tensors sit at other addresses updates only the nodes that read them
(``grape.passes.alias.repoint``), and one whose tensors sit where they did (PyTorch's caching
allocator tends to give a call site the same block again) updates nothing. :attr:`stats`
counts both per call; ``copy_bytes`` is always 0.

What a call returns are the graph's own output tensors: the next call of the same signature
writes its results into them, so clone what must outlive it (as with any CUDA graph's
outputs). Signatures share one memory pool; calls run on the current stream, one at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from grape.cuda.build import Executable, Graph
from grape.errors import GrapeError
from grape.torch.aliasing import Inputs, signature
from grape.torch.capture import TorchCapture, capture

__all__ = ["Graphed", "graphed"]


@dataclass
class CallStats:
    calls: int = 0
    captures: int = 0
    pointer_updates: int = 0  # nodes re-pointed at inputs that moved, over all calls
    copy_bytes: int = 0  # inputs copied into placeholders: none, by construction


@dataclass
class _Entry:
    captured: TorchCapture
    graph: Graph
    executable: Executable
    inputs: Inputs  # where the executable reads each tensor argument


@dataclass
class Graphed:
    fn: Callable[..., Any]
    params: Mapping[str, torch.Tensor] | None = None
    stats: CallStats = field(default_factory=CallStats)
    _entries: dict[tuple, _Entry] = field(default_factory=dict)
    _pool: Any = None

    def __call__(self, *args: Any) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        for a in args:
            if isinstance(a, torch.Tensor) and not a.is_cuda:
                raise GrapeError(f"expected CUDA tensors as inputs of a graphed callable, found "
                                 f"one on {a.device}")
            if isinstance(a, list | tuple | dict):
                raise GrapeError(f"expected tensors and plain values as arguments, found a "
                                 f"{type(a).__name__} (pass its tensors one by one)")
        key = tuple(signature(a) if isinstance(a, torch.Tensor) else ("value", a)
                    for a in args)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = self._capture(args, tensors)
        else:
            self.stats.pointer_updates += entry.inputs.point(entry.graph, entry.executable,
                                                             tensors)
        entry.executable.launch(torch.cuda.current_stream().cuda_stream)
        self.stats.calls += 1
        return entry.captured.outputs

    def _capture(self, args: tuple, tensors: list[torch.Tensor]) -> _Entry:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        inputs = Inputs.of(tensors)  # refuses views sharing memory, before the capture's cost
        captured = capture(self.fn, *args, params=self.params, pool=self._pool,
                           instantiate=False)
        graph = Graph.build(captured.ir)
        self.stats.captures += 1
        return _Entry(captured, graph, graph.instantiate(), inputs)

    def close(self) -> None:
        for entry in self._entries.values():
            entry.executable.close()
            entry.graph.close()
        self._entries.clear()


def graphed(fn: Callable[..., Any], *, params: Mapping[str, torch.Tensor] | None = None
            ) -> Graphed:
    """``fn`` as graph launches: captured on its first call per input signature, then re-pointed
    at each call's tensors rather than copying them (see the module's documentation).

    ``fn`` must be capturable (no host syncs, no copies from pageable CPU memory) and run on
    its tensor arguments; its first call per signature runs it once eagerly before capturing
    it (lazy initialisation must happen outside a capture), so it should not update state in
    place, or tolerate doing so twice. ``params`` (``dict(model.named_parameters())``) names
    the weights in the IR. Non-tensor arguments are part of the signature: another value
    captures anew.
    """
    if not callable(fn):
        raise GrapeError(f"expected a callable to graph, found {type(fn).__name__}")
    return Graphed(fn, params)
