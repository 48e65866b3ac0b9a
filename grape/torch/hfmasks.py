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

:func:`prompt_padding_on_device` does the same where there is a padding mask, for a prompt
captured into a graph (``grape.generate``'s launch): eagerly, transformers reads the prompt's
mask and, where it has no padding, passes SDPA no mask (its causal kernels); under a capture it
cannot read and always builds the mask (SDPA's masked kernels), so a graphed prompt computed
other bits than ``generate``'s, and greedy tokens parted where two logits were near a tie. In
the block the question transformers would have asked of the mask's values is asked on the
device instead: the mask is built, and each attention call that reads it becomes a branch
(``grape.torch.control.cond``, an IF node pair under capture) between SDPA without the mask,
taken where the mask has no padding, and SDPA with it. The GPU picks, per launch, the kernels
``generate`` would have run for that prompt; nothing is read back.

Both blocks replace transformers' shortcut tests (and, for the prompt, its SDPA mask and
attention entries) while they last. The prompt's wrappers act only in the context that entered
the block; ``no_padding_shortcut``'s act under any CUDA capture with no padding mask, where they
decide as eager code does. Everything else passes through, and the answers a test gets are
bound into a copy of it for that call, never swapped into transformers' module: another thread
running a model meanwhile computes what it would have.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from grape.torch.control import can_branch, cond

__all__ = ["no_padding_shortcut", "prompt_padding_on_device"]

# The shortcut tests of transformers.masking_utils that give up whenever tracing is under way.
_SHORTCUTS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


def _capture_alone() -> bool:
    """A CUDA stream capture is what makes transformers think it is tracing."""
    return (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing())


def _not_tracing(*args: Any, **kwargs: Any) -> bool:
    return False


def _rebound(test: Callable[..., bool], **names: Any) -> Callable[..., bool]:
    """``test`` with some of the global names it reads bound otherwise, for this call alone:
    its module is left as it is, so that another thread running transformers meanwhile sees
    transformers' own functions. (A decorated test is unwrapped first: the names are read by
    the function transformers wrote.)"""
    test = inspect.unwrap(test)
    fn = types.FunctionType(test.__code__, {**test.__globals__, **names}, test.__name__,
                            test.__defaults__, test.__closure__)
    fn.__kwdefaults__ = test.__kwdefaults__
    return fn


def _decided_without_tracing(test: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(test)
    def shortcut(padding_mask: Any, *args: Any, **kwargs: Any) -> bool:
        if padding_mask is not None or not _capture_alone():
            return test(padding_mask, *args, **kwargs)
        return _rebound(test, is_tracing=_not_tracing)(padding_mask, *args, **kwargs)
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
            setattr(masking, name, _decided_without_tracing(test))
    try:
        yield
    finally:
        for name, test in saved.items():
            setattr(masking, name, test)


# --- the prompt's padding, decided on the device --------------------------------------------

# Inside prompt_padding_on_device: each mask whose skipping depends on the mask's values, by
# its storage's address, with the mask (kept alive, so that no other tensor takes its address
# while the block lasts) and the device predicate "transformers would have skipped it".
_DECIDED: ContextVar[dict[int, tuple[torch.Tensor, torch.Tensor]] | None] = ContextVar(
    "grape_prompt_masks", default=None)
# Inside one sdpa_mask call in the block: the predicates its shortcut tests deferred.
_DEFERRED: ContextVar[list[torch.Tensor] | None] = ContextVar("grape_deferred", default=None)
# Whether to defer without a capture (the cond then reads its predicate): for checking the
# mechanism without a GPU.
_EAGERLY: ContextVar[bool] = ContextVar("grape_decide_eagerly", default=False)


def _deciding() -> bool:
    return (_EAGERLY.get() or _capture_alone()) and can_branch()


class _Values:
    """The padding mask, for a shortcut test that asks its values through the mask's own
    methods rather than ``fast_all`` (transformers' bidirectional test calls
    ``padding_mask.all()``): each question is answered "yes" and noted, as ``fast_all``'s are;
    anything else is the mask's."""

    def __init__(self, mask: torch.Tensor, read: list[torch.Tensor]) -> None:
        self._mask, self._read = mask, read

    def all(self, *args: Any, **kwargs: Any) -> bool:
        self._read.append(self._mask)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mask, name)


def _deferred_test(test: Callable[..., bool]) -> Callable[..., bool]:
    """``test`` (a shortcut test) that, in an sdpa_mask call of the block, answers the
    questions it would ask of the padding mask's values on the device: it says "build the
    mask", and leaves the predicate under which eager code would have skipped it."""
    @functools.wraps(test)
    def shortcut(padding_mask: Any, *args: Any, **kwargs: Any) -> bool:
        deferred = _DEFERRED.get()
        if deferred is None or not _deciding():
            return test(padding_mask, *args, **kwargs)
        bound = inspect.signature(test).bind(padding_mask, *args, **kwargs)
        # A prompt starts on an empty cache: where the query offset is a tensor (transformers
        # 5.25's static caches) it is 0, which the test would have read back to learn.
        if isinstance(bound.arguments.get("q_offset"), torch.Tensor):
            bound.arguments["q_offset"] = 0
        if any(isinstance(v, torch.Tensor) for k, v in bound.arguments.items()
               if k != "padding_mask"):
            return test(*bound.args, **bound.kwargs)  # something else on the device: as is
        read: list[torch.Tensor] = []

        def optimistic(t: torch.Tensor) -> bool:  # every value question answered "yes"
            read.append(t)
            return True

        if isinstance(padding_mask, torch.Tensor) and "fast_all" not in test.__code__.co_names:
            bound.arguments["padding_mask"] = _Values(padding_mask, read)
        skips = _rebound(test, is_tracing=_not_tracing, fast_all=optimistic)(
            *bound.args, **bound.kwargs)
        if not skips or not read:
            # Not skipped whatever the values say (their answers only ever allow a skip), or
            # skipped without reading any (no padding mask: no_padding_shortcut's case):
            # decided on the host, as eagerly.
            return skips
        deferred.append(torch.stack([t.all() for t in read]).all())
        return False
    shortcut.grape_original = test  # type: ignore[attr-defined]
    return shortcut


def _deciding_mask(build: Callable[..., Any]) -> Callable[..., Any]:
    """``sdpa_mask`` that records, for a mask built only because its values could not be read
    here, when transformers would have skipped it."""
    @functools.wraps(build)
    def mask(*args: Any, **kwargs: Any) -> Any:
        decided = _DECIDED.get()
        if decided is None:
            return build(*args, **kwargs)
        deferred: list[torch.Tensor] = []
        token = _DEFERRED.set(deferred)
        try:
            built = build(*args, **kwargs)
        finally:
            _DEFERRED.reset(token)
        if deferred and isinstance(built, torch.Tensor):
            # Either test skipping (the causal one, or the bidirectional one after it) skips.
            skip = deferred[0] if len(deferred) == 1 else torch.stack(deferred).any()
            decided[built.untyped_storage().data_ptr()] = (built, skip)
        return built
    mask.grape_original = build  # type: ignore[attr-defined]
    return mask


def _branching_attention(sdpa: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' SDPA attention that, given a mask :func:`_deciding_mask` recorded, runs
    as eager code would have: without the mask where its predicate holds, with it otherwise."""
    @functools.wraps(sdpa)
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None, *args: Any,
                  **kwargs: Any) -> Any:
        decided = _DECIDED.get()
        entry = (decided.get(attention_mask.untyped_storage().data_ptr())
                 if decided and isinstance(attention_mask, torch.Tensor) else None)
        if entry is None:
            return sdpa(module, query, key, value, attention_mask, *args, **kwargs)

        def unmasked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return sdpa(module, q, k, v, None, *args, **kwargs)[0]

        def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return sdpa(module, q, k, v, attention_mask, *args, **kwargs)[0]

        return cond(entry[1], unmasked, masked, query, key, value), None
    attention.grape_original = sdpa  # type: ignore[attr-defined]
    return attention


@contextlib.contextmanager
def prompt_padding_on_device(eagerly: bool = False) -> Iterator[None]:
    """Inside the block, a prompt's attention under a CUDA capture runs the kernels eager code
    would run for the prompt's mask, chosen on the device at each launch (see the module).

    Only for a prompt: a forward over an empty cache (a tensor query offset is taken as 0).
    ``eagerly``: decide the same way outside a capture too (each branch then reads its
    predicate back), which lets the mechanism be checked without a GPU. A no-op where
    transformers lacks what it wraps (another version): masks are built as that version does.
    """
    try:
        from transformers import AttentionInterface
        from transformers import masking_utils as masking
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # pragma: no cover - transformers without masking_utils
        yield
        return
    tests = {name: getattr(masking, name) for name in _SHORTCUTS if hasattr(masking, name)}
    masks, attentions = AttentionMaskInterface._global_mapping, AttentionInterface._global_mapping
    needed = (hasattr(masking, "sdpa_mask") and hasattr(masking, "fast_all")
              and hasattr(masking, "is_tracing") and "sdpa" in masks and "sdpa" in attentions
              and "_ignore_causal_mask_sdpa" in tests)
    if not needed or _DECIDED.get() is not None:  # another version, or nested: as it is
        yield
        return
    saved = (masking.sdpa_mask, masks["sdpa"], attentions["sdpa"])
    for name, test in tests.items():
        setattr(masking, name, _deferred_test(getattr(test, "grape_original", test)))
    masking.sdpa_mask = _deciding_mask(saved[0])
    masks["sdpa"] = _deciding_mask(saved[1])
    attentions["sdpa"] = _branching_attention(saved[2])
    tokens = _DECIDED.set({}), _EAGERLY.set(eagerly)
    try:
        yield
    finally:
        _EAGERLY.reset(tokens[1])
        _DECIDED.reset(tokens[0])
        masking.sdpa_mask, masks["sdpa"], attentions["sdpa"] = saved
        for name, test in tests.items():
            setattr(masking, name, test)
