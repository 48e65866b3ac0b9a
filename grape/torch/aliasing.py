"""Alias prediction on an executable: point it at the caller's tensors where they lie now.

A graph captured on a caller's tensors reads them at the addresses the capture found
(``grape.torch.capture`` names each tensor's memory ``input<i>`` in the IR). :class:`Inputs`
remembers where the executable reads each one; :meth:`Inputs.point` moves it to the tensors of
a later call, updating only the nodes that read a tensor that moved
(``grape.passes.alias.repoint``), and nothing at all where every tensor lies where it did,
which PyTorch's caching allocator makes the common case. No byte is copied either way.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from grape.cuda.build import Executable, Graph
from grape.errors import GrapeError
from grape.passes.alias import repoint

__all__ = ["Inputs", "signature"]


def signature(t: torch.Tensor) -> tuple:
    """What a graph captured on ``t`` assumes of a later tensor in its place: everything but
    the address (the storage offset too: a tensor is re-pointed by its memory's start)."""
    return tuple(t.shape), t.dtype, t.stride(), t.storage_offset(), t.device


def _addresses(tensors: Sequence[torch.Tensor]) -> list[int]:
    return [t.untyped_storage().data_ptr() for t in tensors]


@dataclass
class Inputs:
    names: list[str]  # the IR buffer of each tensor, in order
    addresses: list[int]  # where the executable reads each now

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], tag: str = "") -> Inputs:
        """The tensors a graph is captured on, as its capture (with ``tag``) names them."""
        addresses = _addresses(tensors)
        if len(set(addresses)) != len(addresses):
            raise GrapeError("expected every tensor argument to have its own memory, found two "
                             "that share one (views of one tensor)")
        return cls([f"{tag}input{i}" for i in range(len(tensors))], addresses)

    def moves(self, tensors: Sequence[torch.Tensor], read: Collection[str]) -> dict[str, int]:
        """The buffers of ``read`` (those a graph reads) whose tensor now lies elsewhere, with
        their new addresses; from now on the tensors are where the executable reads them."""
        now = _addresses(tensors)
        moved = {n: a for n, a, was in zip(self.names, now, self.addresses, strict=True)
                 if a != was and n in read}
        self.addresses = now
        return moved

    def point(self, graph: Graph, executable: Executable,
              tensors: Sequence[torch.Tensor]) -> int:
        """Point ``executable`` (built from ``graph``) at ``tensors``; the nodes updated."""
        # A tensor the graph never reads (absent from its table) needs no pointing.
        moved = self.moves(tensors, graph.ir.buffers)
        if not moved:
            return 0
        ir, changed = repoint(graph.ir, moved)
        graph.ir = ir  # the builder takes copies' and memsets' addresses from the table
        Graph.apply(executable, graph.prepare(changed))
        return len(changed)
