"""A KV cache whose buffers never move: what makes one decode step per length graphable.

Hugging Face's ``DynamicCache`` concatenates every new token onto its keys and values, so each
step allocates a new cache and every captured length reads and writes other addresses. A
``PrefixCache`` preallocates each layer's keys and values to the longest length once, writes a
step's tokens at the current length, and hands attention a view of the valid prefix. The
buffers' addresses are the same at every length; only the prefix's size changes, so graphs of
consecutive lengths differ in the few kernels that touch the cache (the write's offset, the
attention's length), which is what a graph family updates per step.

>>> import torch
>>> cache = PrefixCache(layers=1, max_len=8)
>>> k, v = cache.update(torch.ones(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
>>> tuple(k.shape), cache.get_seq_length()
((1, 2, 3, 4), 3)
>>> cache.set_length(1)
>>> tuple(cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), 0)[0].shape)
(1, 2, 2, 4)
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from grape.errors import GrapeError

__all__ = ["PrefixCache", "PrefixLayer"]


class _Slot:
    """Where one decode step writes, on the device; shared by a cache's layers.

    A step's single token is written with ``index_copy_`` at this index rather than through a
    slice at a host-side offset: then only the one kernel that fills the index (the first
    layer's) takes the length as an argument, and every layer's write kernel is the same at
    every length, so neighbouring lengths' graphs differ in fewer nodes.
    """

    def __init__(self) -> None:
        self.index: torch.Tensor | None = None
        self.holds = -1  # the length the index was last filled with, as the host knows it


class PrefixLayer(DynamicLayer):
    """One layer's keys and values in buffers of ``max_len`` tokens, filled from the front."""

    def __init__(self, max_len: int, slot: _Slot | None = None) -> None:
        super().__init__()
        self.max_len = max_len
        self.length = 0
        self.slot = slot or _Slot()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.key_buffer = torch.zeros(b, h, self.max_len, d, dtype=self.dtype, device=self.device)
        self.value_buffer = torch.zeros(b, h, self.max_len, value_states.shape[-1],
                                        dtype=self.dtype, device=self.device)
        self.is_initialized = True
        self._view()

    def _view(self) -> None:
        self.keys = self.key_buffer[:, :, :self.length]
        self.values = self.value_buffer[:, :, :self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.max_len:
            raise GrapeError(f"expected at most {self.max_len} cached tokens, found {end} "
                             f"(the cache was preallocated to {self.max_len})")
        if end - start == 1:
            slot = self.slot
            if slot.index is None:
                slot.index = torch.zeros(1, dtype=torch.long, device=self.device)
            if slot.holds != start:
                slot.index.fill_(start)
                slot.holds = start
            self.key_buffer.index_copy_(2, slot.index, key_states)
            self.value_buffer.index_copy_(2, slot.index, value_states)
        else:  # a prompt: written once, eagerly, so an offset argument costs nothing
            self.key_buffer[:, :, start:end].copy_(key_states)
            self.value_buffer[:, :, start:end].copy_(value_states)
        self.length = end
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_len

    def set_length(self, length: int) -> None:
        if not 0 <= length <= self.max_len:
            raise GrapeError(f"expected a cache length in 0..{self.max_len}, found {length}")
        self.length = length
        # A graph replayed since may have left another length in the index: fill it again.
        self.slot.holds = -1
        if self.is_initialized:
            self._view()

    def crop(self, tokens_to_remove: int) -> None:
        # DynamicLayer's meaning: a negative count removes that many tokens, else keep that many.
        self.set_length(self.length + tokens_to_remove if tokens_to_remove < 0
                        else min(self.length, tokens_to_remove))

    def reset(self) -> None:
        self.set_length(0)


class PrefixCache(Cache):
    """A ``transformers`` cache of :class:`PrefixLayer` s, one per decoder layer.

    Call :meth:`set_length` before each step that runs as a graph, and before eager steps that
    follow graph replays: replays change the buffers without the host knowing.
    """

    def __init__(self, layers: int, max_len: int) -> None:
        slot = _Slot()
        super().__init__(layers=[PrefixLayer(max_len, slot) for _ in range(layers)])
        self.max_len = max_len

    def set_length(self, length: int) -> None:
        """Make the first ``length`` cached tokens the valid prefix (no GPU work)."""
        for layer in self.layers:
            layer.set_length(length)
