"""``grape.generate``: a Hugging Face model's whole generation as one graph launch.

``generate(model, input_ids, attention_mask=None, *, max_new_tokens, ...)`` returns what
``model.generate`` returns for the same arguments (the prompt and the new token ids, finished
rows padded), for greedy decoding, sampling and beam search. The prompt runs eagerly, at its
own shape, straight from the caller's tensors; every later token is one iteration of a WHILE
node on the device (``DeviceLoop``): one launch and one read-back per generation, no host sync
per token.

What a generation needs is built on the first call of its shape and kept: the decoder's static
tensors and the captured loop, keyed by model, batch, prompt length, strategy and its options.
A later call of that shape pays no capture. Before a step is trusted in a loop it is captured
at two lengths and the two graphs compared (``grape.passes.audit``): a forward that sizes its
kernels by a length it keeps on the host would be frozen into the graph at one length, and is
refused. (A value read back to the host breaks the capture itself, and is refused as well.)
Small host constants the forward copies to the GPU (``torch.tensor(0.0, device=...)``, a list
used as an index) are staged through pinned memory (``grape.torch.staging``), and refused where
they differ between the two captures.

Whatever grape cannot run itself (an option it does not reproduce, a model on the CPU, a
forward that cannot be captured) runs through ``model.generate`` after one warning saying why;
bad input raises ``GrapeError``.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from grape.errors import CaptureError, GrapeError, UnsupportedError
from grape.passes.audit import step_dependence
from grape.torch.beam import BeamDecoder
from grape.torch.capture import capture
from grape.torch.decoding import Decoder, TokenDecoder
from grape.torch.loop import DeviceLoop
from grape.torch.options import NotGraphable, Options, resolve
from grape.torch.staging import HostConstants, PinnedArena

__all__ = ["GenerationStats", "clear_cache", "generate", "last_stats"]


@dataclass
class GenerationStats:
    """What the last ``generate`` call did, for benchmarks and users who want to know."""

    graphed: bool
    reason: str = ""  # why it fell back, where it did
    captured: bool = False  # this call built its loop (the first of its shape)
    capture_s: float = 0.0
    copy_bytes: int = 0  # caller's bytes copied into the loop's tensors
    # read-backs after the loop's launch (the result's length); the eager prefill may make
    # more (Hugging Face's mask code reads values back there: 4 to 6 on the H200)
    host_syncs: int = 0
    launches: int = 0


@dataclass
class _Entry:
    decoder: Decoder
    loop: DeviceLoop
    capture_s: float
    arena: PinnedArena  # host constants the loop's copies read at every launch


@dataclass
class _Cache:
    entries: dict[tuple, _Entry] = field(default_factory=dict)


# Per model: its built loops. They hold the model (their decoders call it), so they and it stay
# until clear_cache(model); a weak key would not help, the value keeping the key alive.
_CACHES: dict[torch.nn.Module, _Cache] = {}
_LAST = GenerationStats(graphed=False, reason="no call yet")


def last_stats() -> GenerationStats:
    return _LAST


def clear_cache(model: torch.nn.Module | None = None) -> None:
    """Close the loops built for ``model`` (every model's, without one) and let go of it: the
    loops keep their model alive until then."""
    models = [model] if model is not None else list(_CACHES)
    for m in models:
        cache = _CACHES.pop(m, None)
        for entry in (cache.entries.values() if cache else ()):
            entry.loop.close()


def _decoder(model: torch.nn.Module, batch: int, prompt_len: int,
             options: Options) -> Decoder:
    if options.strategy == "beam":
        return BeamDecoder(model, batch, prompt_len, options)
    return TokenDecoder(model, batch, prompt_len, options)


def _build(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor | None,
           options: Options) -> _Entry:
    """The decoder and its loop for this shape: warmed up eagerly (lazy initialisation stays
    out of the capture), the step audited for host-side state, then captured in a loop."""
    began = time.perf_counter()
    batch, prompt_len = input_ids.shape
    decoder = _decoder(model, batch, prompt_len, options)
    if isinstance(decoder, TokenDecoder) and options.strategy == "sample":
        decoder.set_seed(0)
    params = dict(model.named_parameters())
    arena, device = PinnedArena(), input_ids.device
    staged = [HostConstants(arena, device), HostConstants(arena, device)]
    decoder.prefill(input_ids, mask)
    decoder.step()
    first = capture(decoder.step, params=params, warmup=0, instantiate=False,
                    staging=staged[0])
    decoder.step()
    second = capture(decoder.step, params=params, warmup=0, instantiate=False,
                     staging=staged[1])
    if differences := step_dependence(first.ir, second.ir):
        raise NotGraphable(f"the forward sizes its work by a length it keeps on the host, "
                           f"which a captured step would freeze: {differences[0]}")
    if staged[0].values != staged[1].values:
        raise NotGraphable("the forward copies a host value to the GPU that changes from step "
                           "to step, which a captured step would freeze")
    del first, second
    decoder.prefill(input_ids, mask)
    loop = DeviceLoop(decoder.step, decoder.running, options.max_new_tokens, params=params,
                      staging=HostConstants(arena, device))
    return _Entry(decoder, loop, time.perf_counter() - began, arena)


def generate(model: torch.nn.Module, input_ids: torch.Tensor,
             attention_mask: torch.Tensor | None = None, *, max_new_tokens: int,
             seed: int | None = None, **kwargs: Any) -> torch.Tensor:
    """``model.generate(input_ids, attention_mask=..., max_new_tokens=..., **kwargs)``, graphed.

    Takes the ``GenerationConfig`` fields users pass most (``do_sample``, ``temperature``,
    ``top_k``, ``top_p``, ``num_beams``, ``length_penalty``, ``early_stopping``,
    ``eos_token_id`` (one or several), ``pad_token_id``, ``min_new_tokens``, or a
    ``generation_config``); the model's own generation config fills the rest, as in
    ``generate``. ``seed`` seeds sampling (default: drawn from torch's global generator, so
    ``torch.manual_seed`` makes a call repeatable); sampled tokens follow the processed
    distribution exactly but are not ``torch.multinomial``'s, so they differ from
    ``generate``'s for the same seed.

    Returns
    -------
    torch.Tensor
        (batch, prompt length + new tokens), as ``generate`` returns it.

    Raises
    ------
    GrapeError
        Bad input (ids that are not a (batch, length) long tensor on the model's device, a
        mask of another shape, ``max_new_tokens`` below 1, an option out of range).
    """
    global _LAST
    if not (isinstance(model, torch.nn.Module)
            and hasattr(model, "prepare_inputs_for_generation")):
        raise GrapeError(f"expected a Hugging Face generative model, found "
                         f"{type(model).__name__}")
    hf_kwargs = dict(kwargs, max_new_tokens=max_new_tokens)
    try:
        options, mask = resolve(model, input_ids, attention_mask, hf_kwargs)
        if input_ids.device.type != "cuda":
            raise NotGraphable(f"the model is on {input_ids.device}, and graphs need a CUDA "
                               f"device")
        return _graphed_generate(model, input_ids, mask, options, seed)
    except (NotGraphable, CaptureError, UnsupportedError) as e:
        reason = str(e).splitlines()[0]
    warnings.warn(f"grape.generate runs model.generate instead: {reason}", stacklevel=2)
    _LAST = GenerationStats(graphed=False, reason=reason)
    if attention_mask is not None:
        hf_kwargs["attention_mask"] = attention_mask
    return model.generate(input_ids, **hf_kwargs)


def _graphed_generate(model: torch.nn.Module, input_ids: torch.Tensor,
                      mask: torch.Tensor | None, options: Options,
                      seed: int | None) -> torch.Tensor:
    global _LAST
    cache = _CACHES.setdefault(model, _Cache())
    key = (tuple(input_ids.shape), options.key)
    entry = cache.entries.get(key)
    captured = entry is None
    if entry is None:
        entry = cache.entries[key] = _build(model, input_ids, mask, options)
    decoder = entry.decoder
    if isinstance(decoder, TokenDecoder) and options.strategy == "sample":
        decoder.set_seed(int(torch.randint(0, 2**62, ()).item()) if seed is None else seed)
    copied = decoder.prefill(input_ids, mask)
    entry.loop.launch()
    result = decoder.result(input_ids)
    _LAST = GenerationStats(graphed=True, captured=captured,
                            capture_s=entry.capture_s if captured else 0.0,
                            copy_bytes=copied, host_syncs=1, launches=1)
    return result
