"""Static cache layers that write at one token count, kept by the decoder, not one per layer.

transformers' ``StaticLayer`` counts the tokens it holds in a device tensor of its own, and
every ``update`` turns that count into the positions to write (``arange(n) + count``) and
advances it: three kernels a layer, every token, which in a captured decode step are about a
tenth of a small model's kernels (GPT-2 at 12 layers: 36 of 350). All layers hold the same
count at the start of a step, and nothing reads it between one layer's update and the next
forward.

:class:`CountedLayer` writes at a count it is given instead (``count``, the decoder's device
count of tokens in the cache, shared by every layer): a single token is written at the count
itself, with no kernel to compute where; a prompt at ``arange(n) + count``, as before. No layer
advances it; the decoder does, once per forward. ``cumulative_length``, which transformers'
code reads as the length (``get_seq_length``, the mask's offsets), is a 0-dim view of the same
count, as transformers keeps it, so it reads the same value at every layer that a
transformers layer would hold at the start of the step.

The decoder advances the count by the tokens it gave the forward (:class:`Tokens`), once: a
forward must write each layer once, with those tokens. One that writes others (a prompt prefix
of the model's own, as CPM-Ant adds) is refused before its write, which would land past the
cache: on a GPU, a device-side assert that ends the process's CUDA context. One that writes a
layer twice (a model that runs its layers more than once a forward, as Dory's small configs
do) is refused too: transformers' layers append the second write after the first, grape's
would write it over the first, and the tokens would part from ``generate``'s unannounced. The
checks run on the host where the model's own code runs (the prompt is never compiled), not
inside ``torch.compile``'s trace, whose guards would take a count that changes every forward.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers.cache_utils
from transformers.cache_utils import StaticLayer

from grape.errors import GrapeError
from grape.torch.cache_length import CacheLength
from grape.torch.options import NotGraphable

__all__ = ["CountedIndexedLayer", "CountedLayer", "CountedLinearSlidingLayer",
           "CountedSlidingLayer", "StateBeside", "Tokens"]

# Dynamic sparse attention's static layer (DeepSeek-V3.2, GLM-MoE-DSA): a static layer with an
# indexer's key cache beside it. transformers versions without it have none.
StaticIndexedLayer: Any = getattr(transformers.cache_utils, "StaticIndexedLayer", None)


class Tokens:
    """The tokens given to the forward under way (``n``; None: no check) and which forward it is
    (``forward``, counted), set by the decoder; every layer sharing it holds its writes to one
    of ``n`` tokens a forward."""

    def __init__(self) -> None:
        self.n: int | None = None
        self.forward = 0
        # The range of tokens already in the cache as this forward begins, where the decoder
        # knows it (None: anything the cache holds).
        self.past: tuple[int, int] | None = None
        # What the layers of one forward compute alike from the count (a sliding window's
        # slots), made by the first and read by the others: a kernel or more a layer fewer.
        self.shared: dict[Any, Any] = {}

    def begin(self, n: int, past: tuple[int, int] | None = None) -> None:
        """A forward given ``n`` tokens begins, with between ``past[0]`` and ``past[1]``
        tokens in the cache before them."""
        self.n = n
        self.past = past
        self.forward += 1
        self.shared.clear()


class CountedLayer(StaticLayer):
    """``StaticLayer`` writing at ``count``, a (1,) long device tensor its owner advances by
    ``tokens`` a forward (:class:`Tokens`)."""

    def __init__(self, max_cache_len: int, count: torch.Tensor,
                 tokens: Tokens | None = None) -> None:
        super().__init__(max_cache_len=max_cache_len)
        if count.shape != (1,) or count.dtype != torch.long:
            raise GrapeError(f"expected a token count of shape (1,) and dtype long, found "
                             f"shape {tuple(count.shape)} and {count.dtype}")
        self.count = count
        self.tokens = tokens
        self.written_in = -1  # the forward that last wrote this layer (Tokens.forward)
        # The most tokens the count reaches: the buffers' length here (a sliding window's
        # buffers are shorter than the generation its count runs through).
        self.length_bound = max_cache_len
        # The length transformers' code reads: a CacheLength, whose host questions its range
        # answers (grape.torch.cache_length), where the decoder's steps run the model's own
        # code; the count's plain view where they run it compiled (Dynamo traces a plain
        # tensor; a subclass would be one more thing for it to guard).
        self.ranged = True

    @property
    def cumulative_length(self) -> torch.Tensor:
        """The length transformers reads. A CacheLength answers host questions from the range
        it can take; within one forward that range is narrower than the cache's size where the
        decoder says (``Tokens.past``): none yet while the prompt is read, at least the prompt
        at every step after. So a model's ``if past_length > 0`` (GIT's, under transformers
        5.25) is answered on the host, where over the whole cache it would read the count
        back, which a capture refuses."""
        length = self._length
        past = None if self.tokens is None else self.tokens.past
        if past is None or not isinstance(length, CacheLength):
            return length
        bounded = self._bounded.get(past)
        if bounded is None:
            low, high = max(past[0], 0), min(past[1], self.length_bound)
            bounded = self._bounded[past] = CacheLength.of(length._count, low, high)
        return bounded

    @cumulative_length.setter
    def cumulative_length(self, value: torch.Tensor) -> None:
        self._length = value
        self._bounded: dict[tuple[int, int], CacheLength] = {}

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._take_count()

    def _take_count(self) -> None:
        """After the buffers are made: read the length from the shared count. A layer on
        another device than the count (a model split over devices) keeps a count of its own
        and advances it as transformers' does, once per forward too."""
        if self.count.device == self.device:
            length = self.count.view(())  # what transformers reads as the length
            self.cumulative_length = (CacheLength.of(length, 0, self.length_bound)
                                      if self.ranged else length)
        else:
            self.count = None
            self.cumulative_length = self.cumulative_length.to(self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.count is None:
            return super().update(key_states, value_states, *args, **kwargs)
        n = key_states.shape[-2]
        self._check(n)
        at = self.count if n == 1 else torch.arange(n, device=self.device) + self.count
        self.keys.index_copy_(2, at, key_states)
        self.values.index_copy_(2, at, value_states)
        return self.keys, self.values

    def _check(self, n: int) -> None:
        """Refuse, before it lands, a write other than one of the forward's tokens (where the
        decoder says how many it gave, outside a compiled trace)."""
        if self.tokens is None or self.tokens.n is None or torch.compiler.is_compiling():
            return
        if n != self.tokens.n:
            raise NotGraphable(f"the forward wrote {n} tokens to the cache for the "
                               f"{self.tokens.n} it was given (it adds tokens of its own), "
                               f"where grape's cache holds one per token given")
        if self.written_in == self.tokens.forward:
            raise NotGraphable("the forward wrote a cache layer twice (it runs a layer more "
                               "than once), where grape's cache takes one write per layer and "
                               "forward")
        self.written_in = self.tokens.forward


class CountedSlidingLayer(CountedLayer):
    """transformers' ``StaticSlidingWindowLayer`` (the last ``window`` tokens, oldest first)
    for a generation longer than the window, with its position counted on the device.

    transformers' layer counts its tokens on the host: once the window is full, each token
    rolls the buffers left by one and writes at the end, and the mask's offset (the position
    of the window's first slot) is that host count less the window. A captured step would
    freeze both at their capture-time values. Here a decode step's token is written as
    transformers writes it, decided on the device: every slot takes its right neighbour's
    contents where the count has reached the window (a gather over slot indices shifted by
    that comparison), and the token lands at ``min(count, window - 1)``; the buffers hold what
    transformers' would, bit for bit. The mask's offset, ``max(count - window + 1, 0)``, is a
    :class:`CacheLength` whose range the decoder's ``Tokens.past`` bounds, so transformers'
    host question of it (whether to pad the 2D mask past its end) is answered on the host and
    its keys' positions are computed on the device. A forward of several tokens (a prompt)
    runs transformers' own arithmetic, at the cache length the decoder knows on the host
    (``Tokens.past`` exact); anywhere else it is refused."""

    is_sliding = True

    def __init__(self, max_cache_len: int, window: int, count: torch.Tensor,
                 tokens: Tokens | None = None) -> None:
        if not 0 < window < max_cache_len:
            raise GrapeError(f"expected a sliding window shorter than the generation's "
                             f"{max_cache_len} tokens, found {window}")
        super().__init__(max_cache_len=window, count=count, tokens=tokens)
        self.window = window
        self.length_bound = max_cache_len  # the count runs through the whole generation

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        if self.count is None:
            raise NotGraphable(f"a sliding window of {self.window} tokens on another device "
                               f"than the cache's count, whose position grape keeps on the "
                               f"count's device alone")
        self._slots = torch.arange(self.window, device=self.device)

    def _past(self, n: int) -> int:
        """The tokens in the cache before a forward of ``n`` tokens, as the host knows them."""
        past = None if self.tokens is None else self.tokens.past
        if past is None or past[0] != past[1]:
            raise NotGraphable(f"a forward of {n} tokens into a sliding window of "
                               f"{self.window} tokens at a cache length known on the device "
                               f"alone, where grape writes several tokens into a window only "
                               f"where the host knows the length (a prompt)")
        return past[0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._check(n)
        window = self.window
        if n == 1:
            # transformers' roll, where the window is full; its identity, where not.
            source, at = self._where()
            for buffer, state in ((self.keys, key_states), (self.values, value_states)):
                buffer.copy_(buffer.index_select(2, source))
                buffer.index_copy_(2, at, state)
            return self.keys, self.values
        past = self._past(n)
        # transformers' StaticSlidingWindowLayer.update, at the host's count
        if past >= window:
            keys = torch.cat((self.keys[:, :, 1:], key_states), dim=-2)
            values = torch.cat((self.values[:, :, 1:], value_states), dim=-2)
        elif past + n > window:
            keys = key_states if past == 0 else torch.cat((self.keys[:, :, :past], key_states),
                                                          dim=-2)
            values = value_states if past == 0 else torch.cat(
                (self.values[:, :, :past], value_states), dim=-2)
        else:
            at = torch.arange(n, device=self.device) + self.count
            self.keys.index_copy_(2, at, key_states)
            self.values.index_copy_(2, at, value_states)
            return self.keys, self.values
        self.keys.copy_(keys[:, :, -window:])
        self.values.copy_(values[:, :, -window:])
        return keys, values

    def _where(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's gather (each slot's source) and write position, from the count;
        computed once a forward for every layer of this window."""
        shared = None if self.tokens is None else self.tokens.shared
        key = ("sliding window", self.window, self.count.device)
        if shared is not None and key in shared:
            return shared[key]
        window = self.window
        made = ((self._slots + (self.count >= window)).clamp_(max=window - 1),
                self.count.clamp(max=window - 1))
        if shared is not None:
            shared[key] = made
        return made

    def get_mask_sizes(self, query_length: int) -> tuple[int, Any]:
        window = self.window
        if query_length == 1:
            # Full or not, the keys are the window's slots; the first holds position
            # max(count - window + 1, 0).
            offset = (self.count.view(()) - (window - 1)).clamp(min=0)
            past = None if self.tokens is None else self.tokens.past
            low, high = past if past is not None else (0, self.length_bound)
            return window, CacheLength.of(offset, max(low - window + 1, 0),
                                          max(min(high, self.length_bound) - window + 1, 0))
        past = self._past(query_length)  # transformers' sizes, at the host's count
        offset = max(past - window + 1, 0)
        if past >= window:
            return window + query_length - 1, offset
        if past + query_length > window:
            return past + query_length, offset
        return window, offset


if StaticIndexedLayer is not None:
    class CountedIndexedLayer(CountedLayer, StaticIndexedLayer):
        """A :class:`CountedLayer` with transformers' indexer key cache beside its keys and
        values (``StaticIndexedLayer``). The indexer counts its own tokens in a device tensor,
        written at ``arange(n) + length`` and advanced in place (``update_indexer``), as a
        recurrent layer counts its own: each forward writes it once with the tokens it was
        given, so its count stays the decoder's, and ``reset`` zeroes it with the cache. Its
        keys are one tensor per layer with a row per sequence, reordered by beam with the
        layer's other state (``grape.torch.rows``)."""
else:  # pragma: no cover - transformers without dynamic sparse attention
    CountedIndexedLayer = None


# A linear-attention state and an attention cache in one layer (transformers 5.25's hybrid
# layers). Releases without linear-attention layers have none.
LinearAttentionLayer: Any = getattr(transformers.cache_utils, "LinearAttentionLayer", None)


if LinearAttentionLayer is not None:
    class StateBeside(LinearAttentionLayer):
        """A recurrent state beside an attention cache in one layer, as transformers' hybrid
        layers keep them: a subclass names its attention side (``attention_side``, the class after
        this one in its bases) and initialises both. Built as transformers builds its own: the
        linear-attention side first in the method order (its states, its own token count, crop
        and compile flags), each side initialised and reset by its own code, the attention side
        lazily allocated by an attention update (two tensors) and the state side by a state
        update (keywords). Beam search reorders both sides' tensors by row
        (``grape.torch.rows``)."""

        attention_side: Any = None

        def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
            if len(args) == 2 and not kwargs:
                self.attention_side.lazy_initialization(self, *args)
            elif not args:
                LinearAttentionLayer.lazy_initialization(self, **kwargs)

        def reset(self) -> None:
            LinearAttentionLayer.reset(self)
            self.attention_side.reset(self)

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            LinearAttentionLayer.reorder_cache(self, beam_idx)
            self.attention_side.reorder_cache(self, beam_idx)

        def get_seq_length(self) -> int:
            return self.attention_side.get_seq_length(self)

    class CountedLinearSlidingLayer(StateBeside, CountedSlidingLayer):
        """transformers' ``LinearAttentionAndStaticSlidingWindowAttentionLayer`` (a recurrent
        state and a sliding window in one layer: Inkling) with its window counted on the
        device, as :class:`CountedSlidingLayer` counts one."""

        attention_side = CountedSlidingLayer

        def __init__(self, max_cache_len: int, window: int, count: torch.Tensor,
                     tokens: Tokens | None = None, number_of_states: int = 1) -> None:
            CountedSlidingLayer.__init__(self, max_cache_len=max_cache_len, window=window,
                                         count=count, tokens=tokens)
            LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
else:  # pragma: no cover - transformers without linear-attention layers
    StateBeside = CountedLinearSlidingLayer = None
