"""A cache's rows reordered in place in a few kernels: beam search's step, made cheap.

Beam search moves the cache with the beams every token: row ``r`` of every keys, values and
recurrent-state tensor takes the contents of row ``order[r]``. One gather and one copy back
per tensor is 4 kernels a layer; at batch 1 those are small kernels far from the GPU's
bandwidth: on the H200, 24 tensors of 1.6 MB took 195 us that way, and 39 us stacked as below
(``benchmarks/row_reorder.py``; at 40 rows, 318 against 296 us, the bytes' own pace).

:class:`RowReorder` therefore gives every such tensor of one dtype and size a slice of one
stacked buffer, ``(tensors, rows, elements per row)``, and reorders the whole stack with one
gather and one copy. Re-homing keeps each tensor's sizes, strides and offset, so the model's
kernels see the same layouts as before, and it re-makes every tensor attribute of a layer that
shares a moved storage (a layer's keys may be a view of a buffer it also keeps). Tensors whose
storage is not theirs alone, with rows outermost, keep the per-tensor gather.

It must be built eagerly, after the cache's layers allocated their tensors (the prompt's
forward allocates them) and before any capture reads their addresses.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["RowReorder", "state_tensors"]

# A stack's gather needs a temporary the size of the stack: stacks are cut at this many bytes
# (a tensor larger than this is a stack of its own), so that a long cache at a large batch does
# not hold a second copy of itself.
CHUNK_BYTES = 64 << 20


def state_tensors(layer: Any) -> list[torch.Tensor]:
    """Every tensor of a cache layer that holds per-row state: keys and values, convolution
    and recurrent states, and any other tensor the layer keeps with a row per sequence, as
    its keys have (an indexer's keys beside them, in dynamic sparse attention): beam search
    reorders them all by beam, in place. A layer's counts (0- or 1-dimensional) are shared by
    its rows and stay."""
    held = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
            if t is not None]
    for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
        held += [t for t in states.values() if t is not None]
    if held and held[0].ndim >= 2:
        # (a tensor over memory already held is another view of it, as exact lengths' token-
        # major buffers are of their keys and values: reordered once, through the first)
        rows = held[0].shape[0]
        storages = {t.untyped_storage().data_ptr() for t in held}
        held += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)
                 and t.ndim >= 2 and t.shape[0] == rows
                 and t.untyped_storage().data_ptr() not in storages]
    return held


def _owns_rows(t: torch.Tensor, rows: int) -> bool:
    """Whether ``t``'s storage is ``rows`` equal contiguous ranges with row ``r`` of ``t``
    inside the r-th: then reordering the storage's ranges reorders ``t``'s rows, whatever its
    other strides (a transposed view, or a view of part of each row, too)."""
    if t.ndim == 0 or t.shape[0] != rows or t.numel() == 0 or min(t.stride()) < 0:
        return False
    span = t.stride(0)  # elements per range
    last = t.storage_offset() + sum((n - 1) * stride for n, stride in
                                    zip(t.shape[1:], t.stride()[1:], strict=True))
    return span * rows * t.element_size() == t.untyped_storage().nbytes() and last < span


def _attributes(layer: Any) -> Iterator[tuple[dict, Any, torch.Tensor]]:
    """(where, key, tensor) for every tensor a layer holds, directly or in a dict attribute."""
    for name, value in list(vars(layer).items()):
        if isinstance(value, torch.Tensor):
            yield vars(layer), name, value
        elif isinstance(value, dict):
            for key, item in list(value.items()):
                if isinstance(item, torch.Tensor):
                    yield value, key, item


def _grouped(layers: list[Any], rows: int) -> tuple[dict[tuple, list[torch.Tensor]],
                                                   list[torch.Tensor]]:
    """The state tensors to stack, one per storage (a storage two layers share moves once), by
    (dtype, device, bytes); and the others, to be gathered one by one: those that do not own
    their rows, and any over the same storage as one of those (moving that storage would
    leave the other's entry behind)."""
    states = [t for layer in layers for t in state_tensors(layer)]
    shared = {t.untyped_storage().data_ptr() for t in states if not _owns_rows(t, rows)}
    groups: dict[tuple, list[torch.Tensor]] = {}
    loose: list[torch.Tensor] = []
    seen: set[int] = set()
    for t in states:
        address = t.untyped_storage().data_ptr()
        if address in shared:
            loose.append(t)
        elif address not in seen:
            seen.add(address)
            groups.setdefault((t.dtype, t.device, t.untyped_storage().nbytes()), []).append(t)
    return groups, loose


class RowReorder:
    """Reorders by row, in place, every per-row state tensor of ``layers`` (see the module).

    Parameters
    ----------
    layers
        The cache's layers, their tensors allocated.
    rows
        The cache's batch: every state tensor's first dimension.
    """

    def __init__(self, layers: Iterable[Any], rows: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        layers = list(layers)
        self.stacks: list[torch.Tensor] = []
        groups, self.loose = _grouped(layers, rows)
        # Stack by stack, each group's tensors leaving the lists as they move: the old
        # storages are freed as soon as their layers hold the new ones, so that a cache near
        # the device's capacity needs one stack more at a time, not a second cache.
        for (_, _, nbytes), members in groups.items():
            per_stack = max(1, chunk_bytes // nbytes)
            while members:
                self._stack(layers, [members.pop(0) for _ in range(min(per_stack, len(members)))],
                            rows)
        self.tensors = sum(stack.shape[0] for stack in self.stacks)
        # A stack's rows as the rows of one matrix, gathered along its first dimension: on
        # the H200 that kept to the bytes' pace at 5 and 40 rows, where a gather along the
        # stack's second dimension ran 2.5x slower at 5 and 2.1x at 40 (row_reorder.py).
        # ``firsts``: each tensor's first row in the matrix.
        self._matrices = [(stack.view(-1, stack.shape[2]),
                           torch.arange(0, stack.shape[0] * rows, rows, device=stack.device))
                          for stack in self.stacks]

    def _stack(self, layers: list[Any], chunk: list[torch.Tensor], rows: int) -> None:
        """Moves ``chunk`` (tensors of one dtype and size, each owning its storage) into one
        new stack, and re-makes every layer attribute over their storages there."""
        numel = chunk[0].untyped_storage().nbytes() // chunk[0].element_size()
        stack = torch.empty((len(chunk), rows, numel // rows), dtype=chunk[0].dtype,
                            device=chunk[0].device)
        moved: dict[int, torch.Tensor] = {}  # old storage address -> its flat new home
        for i, t in enumerate(chunk):
            flat = stack[i].view(-1)
            flat.copy_(t.as_strided((numel,), (1,), 0))
            moved[t.untyped_storage().data_ptr()] = flat
        for layer in layers:
            for where, key, t in _attributes(layer):
                flat = moved.get(t.untyped_storage().data_ptr())
                if flat is None:
                    continue
                # as_strided's offset counts from the storage's start, not the view's.
                new = flat.as_strided(t.shape, t.stride(),
                                      flat.storage_offset() + t.storage_offset())
                if getattr(t, "_dynamo_static_input_type", None) is not None:
                    # The cache marks its tensors for torch.compile (a fixed address):
                    # compile=True's step must see the new ones marked alike.
                    torch._dynamo.mark_static_address(new)
                where[key] = new
        self.stacks.append(stack)

    def __call__(self, order: torch.Tensor) -> None:
        """Row ``r`` of every tensor becomes its row ``order[r]`` (``order``: long, on the
        device, one entry per row)."""
        for matrix, firsts in self._matrices:
            matrix.copy_(matrix.index_select(0, (firsts[:, None] + order[None, :]).view(-1)))
        for t in self.loose:
            t.copy_(t.index_select(0, order))
