"""Hugging Face's no-padding shortcut, kept under a CUDA capture where there is no mask to read.

transformers skips building an attention mask when it sees no padding, and SDPA then runs its
fused kernels (cuDNN's, FlashAttention's) as with no mask at all. To see it, it reads the
padding mask's values; while anything is being traced, a CUDA stream capture included, it reads
nothing and builds the full mask, even when there is no padding mask at all. Under a capture
that changes the kernels: a Wav2Vec2-base training step captured on the H200 ran SDPA's fp32
math path (72 fp32 GEMMs per step) where the same step run eagerly ran cuDNN's fused attention
(traces/h200_training), so the graph computed other bits than eager and ran slower.

:func:`no_padding_shortcut` lets the two shortcut tests decide during a CUDA capture when they
are given no padding mask: nothing is read, so nothing can break the capture, and the captured
kernels are the eager ones. With a padding mask they behave as before (reading it would sync).
Under ``torch.compile``, ``torch.jit`` or ``torch.fx`` nothing changes. transformers 5.24 does
this itself (its bidirectional test no longer gives up without a padding mask); there the block
changes nothing that matters, and on 5.17, the GPU machine's, it is what keeps the kernels.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["no_padding_shortcut"]

# The shortcut tests of transformers.masking_utils that give up whenever tracing is under way.
_SHORTCUTS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


def _capture_alone() -> bool:
    """A CUDA stream capture is what makes transformers think it is tracing."""
    return (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing())


def _decided_without_tracing(masking: Any, test: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(test)
    def shortcut(padding_mask: Any, *args: Any, **kwargs: Any) -> bool:
        if padding_mask is not None or not _capture_alone():
            return test(padding_mask, *args, **kwargs)
        tracing = masking.is_tracing
        masking.is_tracing = lambda *a, **k: False
        try:
            return test(padding_mask, *args, **kwargs)
        finally:
            masking.is_tracing = tracing
    shortcut.grape_original = test  # type: ignore[attr-defined]
    return shortcut


@contextlib.contextmanager
def no_padding_shortcut() -> Iterator[None]:
    """Inside the block, transformers skips attention masks that have no padding mask behind
    them during CUDA captures too (see the module). A no-op where transformers lacks the tests
    (another version): the masks are then built as that version builds them."""
    try:
        from transformers import masking_utils as masking
    except ImportError:  # pragma: no cover - transformers without masking_utils
        yield
        return
    saved = {name: getattr(masking, name) for name in _SHORTCUTS if hasattr(masking, name)}
    for name, test in saved.items():
        if not hasattr(test, "grape_original"):  # not wrapped already (nested blocks)
            setattr(masking, name, _decided_without_tracing(masking, test))
    try:
        yield
    finally:
        for name, test in saved.items():
            setattr(masking, name, test)
