"""Exact lengths inside one launch: decode attention that reads each row's key count on the device.

A device loop runs one captured step for every token, so the step's kernels are sized once, at
capture. With a static cache that means attention over the whole preallocated length: at token
100 of a 4,000-token generation every layer still reads 4,000 keys per row, masked. Families
(``grape.torch.family``) size kernels exactly but need the host to update the executable per
length, which a device loop has no host to do.

This module takes the third way the problem allows: an attention kernel whose work is bounded
by lengths it reads from device memory, so that one captured step serves every length and each
token pays for the keys that exist. FlashAttention's variable-length forward (PyTorch's
``_flash_attention_forward`` with ``seqused_k``) does that: rows are ranges of one flattened key
tensor (``cu_seqlens_k``), and each range is cut to the row's used count, which the step
advances on the device. Its grid depends on the maximum length only (fixed); the blocks past a
row's used count exit at once.

Three pieces make a Hugging Face model run it:

- :class:`TokenMajorLayer`, a static cache layer whose buffers are laid out (batch, tokens,
  heads, dim) and handed to the model as the (batch, heads, tokens, dim) views it expects (no
  copy): flattened, every row's keys are one contiguous range of one tensor, which the varlen
  kernel needs.
- :class:`Lengths`: where each row's keys start (after its left padding) and how many it uses,
  on the device; the prompt sets the starts, each step advances the counts.
- :func:`attention`, registered with transformers' ``AttentionInterface`` as ``grape_exact``
  and switched on around the decode step only (:func:`active`): a single-query call over
  grape's cache runs the varlen kernel; anything else (the prompt, an option the kernel does not
  reproduce: a sliding window shorter than the cache, soft-capping, attention sinks, dropout,
  32-bit floats) runs transformers' SDPA path unchanged, and is counted with its reason.
- :func:`mask`, the mask function registered under the same name: once a step has run every
  decoder layer's attention through :func:`attention`, exactly, the next steps' causal mask
  over grape's cache is not built (the varlen kernel never reads it; under capture
  transformers builds it in about a dozen kernels a token). A model whose layers attend by
  their own code (GPT-J, Falcon, Bloom: they never call :func:`attention`) keeps its mask; a
  call that falls back to SDPA where the mask was left unbuilt builds the same one from the
  lengths (:meth:`Lengths.mask`). Every other mask (the prompt's, a sliding window's) is
  SDPA's own.

Left padding only: a row's valid keys must be one range. A prompt mask with zeros after its
first one is detected on the device (``Lengths.ok``) and reported when the result is read.

The kernels differ from SDPA's masked ones by design (another kernel, fewer keys summed), so
tokens are compared with generate's by agreement and logit tolerance, not for equality.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from grape.torch.static_layers import CountedLayer, LinearAttentionLayer, StateBeside

__all__ = ["NAME", "Lengths", "TokenMajorHybridLayer", "TokenMajorLayer", "active", "attention",
           "register"]

NAME = "grape_exact"

# A sliding window's attention over its own keys, shorter than grape's cache: SDPA runs it over
# the window's mask, which transformers builds for it, exact lengths or not.
_WINDOW = "a sliding window's own keys"

# Keyword arguments transformers' attention modules pass that change nothing here (their
# meaning is carried by the cache and the lengths); any other keyword is a reason to fall back.
_INERT = {"position_ids", "cache_position", "output_attentions", "is_causal", "layer_idx",
          "position_embeddings", "use_cache", "past_key_values", "cache",
          # the model's outputs, which its **kwargs carry down to every layer
          "logits_to_keep", "output_router_logits"}


class TokenMajorLayer(CountedLayer):
    """``CountedLayer`` with (batch, tokens, heads, dim) buffers, seen as (batch, heads, tokens,
    dim): flattening batch and tokens then makes each row's keys one contiguous range."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        shape = (self.batch_size, self.max_cache_len, self.num_heads)
        self.key_buffer = torch.zeros((*shape, self.k_head_dim), dtype=self.dtype,
                                      device=self.device)
        self.value_buffer = torch.zeros((*shape, self.v_head_dim), dtype=self.dtype,
                                        device=self.device)
        self.keys = self.key_buffer.transpose(1, 2)
        self.values = self.value_buffer.transpose(1, 2)
        self._take_count()
        self.is_initialized = True


if StateBeside is not None:
    class TokenMajorHybridLayer(StateBeside, TokenMajorLayer):
        """transformers' hybrid layer (``LinearAttentionAndStaticFullAttentionLayer``: a
        recurrent state and attention keys in one layer, as Zamba, Zaya and Falcon-H1 keep
        them) with its keys laid out by tokens and written at the decoder's count, as
        :class:`TokenMajorLayer` writes them."""

        attention_side = TokenMajorLayer

        def __init__(self, max_cache_len: int, count: torch.Tensor, tokens: Any = None,
                     number_of_states: int = 1) -> None:
            TokenMajorLayer.__init__(self, max_cache_len=max_cache_len, count=count,
                                     tokens=tokens)
            LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
else:  # pragma: no cover - transformers without linear-attention layers
    TokenMajorHybridLayer = None


class Lengths:
    """Each row's key range in the flattened cache, on the device, for ``rows`` rows of
    ``max_len`` tokens: row r's keys are tokens ``pad[r]`` to the cache's length."""

    def __init__(self, rows: int, max_len: int, device: torch.device) -> None:
        self.rows, self.max_len = rows, max_len
        i32 = dict(dtype=torch.int32, device=device)
        self.cu_q = torch.arange(rows + 1, **i32)  # one query per row
        self.starts = torch.arange(rows + 1, **i32) * max_len  # cu_seqlens_k
        self.row_starts = self.starts[:-1].clone()  # each row's first token, unpadded
        self.used = torch.zeros(rows, **i32)  # keys each row attends to
        self.pad = torch.zeros(rows, dtype=torch.long, device=device)
        self.ok = torch.ones((), dtype=torch.bool, device=device)
        self.columns = torch.arange(max_len, device=device)
        # (asked here, not in each attention call: a compiled step traces those)
        self.before_ampere = (torch.device(device).type == "cuda"
                              and torch.cuda.get_device_capability(device) < (8, 0))
        self.served: Counter[str] = Counter()  # attention calls by what ran them
        # The cache layers laid out by tokens (TokenMajorLayer), which its owner counts: the
        # layers whose attention the causal mask over the whole cache serves (a sliding
        # window's has a mask of its own, a recurrent state none).
        self.layers: int | None = None
        # Whether the last step ran every such layer's attention here, exactly, and nothing
        # else over the whole cache: then the next step's causal mask is read by no one, and
        # :func:`mask` does not build it.
        self.mask_unread = False

    def set_prompt(self, mask: torch.Tensor | None, prompt_len: int) -> None:
        """The prompt's padding, from its (rows, prompt_len) mask (None: no padding); on the
        device, so a captured prompt reads a new caller's mask at every launch."""
        if mask is None:
            self.pad.zero_()
            self.ok.fill_(True)
        else:
            self.pad.copy_(prompt_len - mask.sum(dim=-1))
            left_padded = (mask != 0) == (self.columns[:prompt_len] >= self.pad[:, None])
            torch.all(left_padded, out=self.ok)
        self.starts[:-1].copy_(self.row_starts + self.pad)

    def before_step(self, cached: torch.Tensor) -> None:
        """The counts for a step that appends one token to ``cached`` tokens (the cache's
        device length before the step)."""
        self.used.copy_(cached + 1 - self.pad)

    def mask(self, keys: int) -> torch.Tensor:
        """The (rows, 1, 1, ``keys``) boolean mask of a decode step over the cache's first
        ``keys`` tokens: row r sees its ``used[r]`` tokens from ``pad[r]`` on. For a left-padded
        prompt that is the causal mask transformers builds from the running attention mask
        (``ok`` says whether the prompt was left-padded)."""
        columns = self.columns[:keys]
        end = self.pad + self.used
        return ((columns >= self.pad[:, None]) & (columns < end[:, None]))[:, None, None, :]


_ACTIVE: Lengths | None = None


def register() -> None:
    """Make ``grape_exact`` a name transformers' attention and mask dispatch know (the masks
    are SDPA's: the prompt and every fallback run SDPA)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, mask)


def mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: int = 0,
         mask_function: Any = None, attention_mask: torch.Tensor | None = None,
         **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask interface (``sdpa_mask``'s arguments): None for a decode step's
    plain causal mask over grape's whole cache where the step before ran every layer's
    attention exactly (``Lengths.mask_unread``): no exact call reads it, and a fallback
    rebuilds it from the lengths (:func:`attention`); ``sdpa_mask``'s mask otherwise."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    lengths = _ACTIVE
    # (kv_offset last, and only where it is a number: a sliding window's is a device tensor,
    # which a comparison would read back, inside a capture)
    if (lengths is not None and lengths.mask_unread and mask_function is causal_mask_function
            and q_length == 1 and kv_length == lengths.max_len and batch_size == lengths.rows
            and isinstance(kv_offset, int) and kv_offset == 0):
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=mask_function or causal_mask_function,
                     attention_mask=attention_mask, **kwargs)


@contextlib.contextmanager
def active(lengths: Lengths, model: torch.nn.Module) -> Iterator[None]:
    """Run ``model``'s attention through :func:`attention` with ``lengths`` inside the block."""
    global _ACTIVE
    register()
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    _ACTIVE, lengths.served = lengths, Counter()
    try:
        yield
    finally:
        config._attn_implementation = before
        _ACTIVE = None
        # (A layer that attends by its own code never comes here, and is missing from the
        # exact calls; a sliding window's reads a mask of its own.)
        others = set(lengths.served) - {"exact", f"sdpa: {_WINDOW}"}
        lengths.mask_unread = (lengths.layers is not None and not others
                               and lengths.served["exact"] >= lengths.layers > 0)


def _refusal(lengths: Lengths, query: torch.Tensor, key: torch.Tensor, dropout: float,
             kwargs: dict[str, Any]) -> str | None:
    """Why this attention call cannot run over exact lengths (None: it can)."""
    if query.shape[2] != 1:
        return "more than one query (a prompt)"
    window = kwargs.get("sliding_window")
    if (key.shape[0] == lengths.rows and key.shape[2] < lengths.max_len and window is not None
            and key.shape[2] <= window < lengths.max_len):
        return _WINDOW
    if key.shape[0] != lengths.rows or key.shape[2] != lengths.max_len:
        return "keys that are not grape's cache"
    if not key.transpose(1, 2).is_contiguous():
        return "a cache not laid out by tokens"
    if dropout:
        return "attention dropout"
    if window is not None and window < lengths.max_len:
        return "a sliding window shorter than the cache"
    for name, value in kwargs.items():
        if name not in _INERT and name != "sliding_window" and value is not None:
            return f"the keyword {name!r}"
    if query.device.type == "cuda":
        if query.dtype not in (torch.float16, torch.bfloat16):
            return f"{query.dtype} (the kernel takes 16-bit floats)"
        if query.shape[-1] % 8 or query.shape[-1] > 256:
            return f"head dimension {query.shape[-1]}"
        if lengths.before_ampere:
            return "a GPU before Ampere"
    return None


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
              scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: (batch, heads, queries, dim) in, (batch, queries,
    heads, dim) out."""
    lengths = _ACTIVE
    why = "outside a grape step" if lengths is None else _refusal(lengths, query, key, dropout,
                                                                  kwargs)
    if why is not None:
        if lengths is not None:
            lengths.served[f"sdpa: {why}"] += 1
            if (attention_mask is None and query.shape[2] == 1 and key.shape[0] == lengths.rows
                    and why != _WINDOW):
                # A decode step's mask, which :func:`mask` left unbuilt: the same from the
                # lengths (sliced to the keys, as transformers' SDPA path slices its own).
                attention_mask = lengths.mask(key.shape[2])
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    lengths.served["exact"] += 1
    rows, heads, _, dim = query.shape
    q = query.transpose(1, 2).reshape(rows, heads, dim)
    k = key.transpose(1, 2).reshape(rows * lengths.max_len, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(rows * lengths.max_len, value.shape[1], value.shape[-1])
    if q.device.type == "cuda":
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, lengths.cu_q, lengths.starts, 1, lengths.max_len, 0.0, False, False,
            scale=scaling, seqused_k=lengths.used)[0]
    else:
        out = _reference(q, k, v, lengths, scaling)
    return out.view(rows, 1, heads, -1), None


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Lengths,
               scaling: float | None) -> torch.Tensor:
    """What the varlen kernel computes, from what it is given: row r's keys are the flattened
    cache's tokens ``starts[r]`` to ``starts[r] + used[r]``, as a mask over the row's stretch
    (no read-back, so that a compiled step traces it whole; for CPU tests of the bookkeeping)."""
    rows, heads, dim = q.shape
    groups = heads // k.shape[1]
    keys = k.view(rows, lengths.max_len, k.shape[1], dim).transpose(1, 2)
    values = v.view(rows, lengths.max_len, v.shape[1], v.shape[-1]).transpose(1, 2)
    token = (torch.arange(rows, device=q.device)[:, None] * lengths.max_len
             + lengths.columns)  # each key's place in the flattened cache
    first = lengths.starts[:-1, None]
    seen = (token >= first) & (token < first + lengths.used[:, None])
    return torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), keys.repeat_interleave(groups, dim=1),
        values.repeat_interleave(groups, dim=1), attn_mask=seen[:, None, None, :],
        scale=scaling).squeeze(2)
