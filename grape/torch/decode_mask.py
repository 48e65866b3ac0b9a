"""A decode step's causal mask over grape's padded cache is its running 2D mask, as it stands.

Under a CUDA capture transformers cannot look at the 2D mask to skip the 4D one, so a captured
decode step builds it every token: positions for the batch, the heads, the query and the keys
(``arange`` and offsets), the causal test, the padding lookup and their conjunction, about
eleven kernels a token. Over grape's static cache the result is known without them. The
decoder's 2D mask (``grape.torch.decoding.Decoder.mask``) is one where a row's prompt token is
real and where a token has been written, up to and including the column the step writes, and
zero past it; the causal test keeps exactly the keys up to the query's position, which is that
column. So for one query, ``causal(kv <= q) & padding[b, kv]`` is ``padding[b, kv]``: the
boolean 2D mask transformers has already made of the decoder's, seen as (batch, 1, 1, keys).

:func:`running_mask` wraps transformers' ``sdpa`` mask entry for the block and returns that view
where, and only where, the equality holds by construction: the plain causal mask function
(not a sliding window, chunks, bidirectional or packed-sequence one, whose functions differ),
one query, keys the decoder's full width from offset 0, and a boolean 2D mask of the decoder's
shape. Everything else, and every call outside a CUDA capture (eagerly transformers may skip
the mask altogether, and the block keeps that), goes to transformers as it is. The wrapper acts
in the context that entered the block alone. :func:`checked` holds every view to the mask
transformers builds, without a GPU: the tests do, on several architectures, and so can
``benchmarks/arch_sweep.py --host-loop --check-decode-masks`` on every one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import Counter
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from grape.errors import GrapeError
from grape.torch.control import capturing

__all__ = ["checked", "running_mask"]

# Inside running_mask: the shape of the decoder's 2D mask, (rows, keys).
_SHAPE: ContextVar[tuple[int, int] | None] = ContextVar("grape_running_mask", default=None)
# Inside checked(): act outside a capture too, and count views held to transformers' masks.
_CHECKS: ContextVar[Counter[str] | None] = ContextVar("grape_running_mask_checks", default=None)


def _viewing(build: Callable[..., Any], causal: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(build)

    @functools.wraps(build)
    def mask(*args: Any, **kwargs: Any) -> Any:
        shape, checks = _SHAPE.get(), _CHECKS.get()
        if shape is None or not (checks is not None or capturing()):
            return build(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        padding = a.get("attention_mask")
        if (a.get("mask_function") is not causal or a.get("q_length") != 1
                or isinstance(a.get("kv_offset"), torch.Tensor) or a.get("kv_offset") != 0
                or a.get("kv_length") != shape[1] or a.get("batch_size") != shape[0]
                or not isinstance(padding, torch.Tensor) or padding.dtype != torch.bool
                or tuple(padding.shape) != shape):
            if checks is not None:
                checks["built"] += 1
            return build(*args, **kwargs)
        view = padding[:, None, None, :]
        if checks is not None:
            a["allow_is_causal_skip"] = False  # as under a capture: always built
            built = build(*bound.args, **bound.kwargs)
            if view.shape != built.shape or not torch.equal(view, built):
                raise GrapeError(f"expected the running mask to equal the causal mask "
                                 f"transformers builds, found {int((view != built).sum())} of "
                                 f"{built.numel()} elements differing")
            checks["viewed"] += 1
        return view
    mask.grape_original = build  # type: ignore[attr-defined]
    return mask


@contextlib.contextmanager
def checked() -> Iterator[Counter[str]]:
    """Inside the block, :func:`running_mask` acts without a capture too, and holds each view
    to the mask transformers builds (its skip turned off, as under a capture), raising
    ``GrapeError`` where an element differs: for tests and sweeps on any device. Yields the
    counts of masks ``viewed`` and of masks ``built`` by transformers as they were."""
    counts: Counter[str] = Counter()
    token = _CHECKS.set(counts)
    try:
        yield counts
    finally:
        _CHECKS.reset(token)


@contextlib.contextmanager
def running_mask(shape: tuple[int, int]) -> Iterator[None]:
    """Inside the block, a captured decode step's causal mask over a decoder's cache of
    ``shape`` (its 2D mask's: rows, keys) is that 2D mask's view (see the module). A no-op where
    transformers lacks the ``sdpa`` mask entry or its causal mask function (another version),
    and when nested."""
    try:
        from transformers import masking_utils as masking
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # pragma: no cover - transformers without masking_utils
        yield
        return
    entries = AttentionMaskInterface._global_mapping
    causal = getattr(masking, "causal_mask_function", None)
    if ("sdpa" not in entries or not hasattr(masking, "sdpa_mask") or causal is None
            or _SHAPE.get() is not None):
        yield
        return
    # The entry serves SDPA attention; the module's function also serves eager attention's
    # mask (transformers' eager_mask builds through it, then makes it additive).
    saved = masking.sdpa_mask, entries["sdpa"]
    masking.sdpa_mask = _viewing(saved[0], causal)
    entries["sdpa"] = _viewing(saved[1], causal)
    token = _SHAPE.set(tuple(shape))
    try:
        yield
    finally:
        _SHAPE.reset(token)
        masking.sdpa_mask, entries["sdpa"] = saved
