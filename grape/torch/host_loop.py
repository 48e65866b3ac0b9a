"""A generation as ``grape.generate`` would run it, driven by the host: any device, the CPU
included.

``generate_on_host(model, input_ids, attention_mask, max_new_tokens=..., **kwargs)`` resolves
the call as ``grape.generate`` does (its options, a decoder prompt, a prompt given as
``inputs_embeds``, a model's own ``generate`` around the generic loop), builds the decoder whose
step a device loop would capture, and runs it with one read-back per token. Its tokens are the
launch's (the same step, the same kernels), so they can be held to ``generate``'s where no GPU
is: the CPU tests and ``benchmarks/arch_sweep.py --host-loop`` do. Where ``grape.generate``
would fall back it raises ``NotGraphable`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from grape.torch.beam import BeamDecoder
from grape.torch.decoding import Decoder, TokenDecoder
from grape.torch.experts import experts_on_device
from grape.torch.model_code import model_code
from grape.torch.options import (
    NotGraphable,
    Options,
    check_positions,
    decoder_prompt,
    resolve,
    sequence_head,
)
from grape.torch.own_generate import inner_arguments, note_no_speech, owns_generate, routed
from grape.torch.sampling import CandidatesOverflowed
from grape.torch.streaming import TokenFeed

__all__ = ["HostCall", "generate_on_host", "loop_on_host"]


@dataclass
class HostCall:
    """One generation the host loop ran: its decoder and the prompt it was given (``ids`` are
    what the sequences start with: (batch, 0) for a prompt of embeddings alone)."""

    decoder: Decoder
    options: Options
    ids: torch.Tensor
    mask: torch.Tensor | None
    decoder_ids: torch.Tensor | None = None
    decoder_mask: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    model_inputs: dict[str, torch.Tensor] | None = None  # Options.model_inputs' tensors

    def again(self) -> Decoder:
        """A new decoder of this one's shape and options, with the prompt read into it."""
        decoder = type(self.decoder)(self.decoder.model, self.ids.shape[0],
                                     self.decoder.prompt_len, self.options)
        decoder.prefill(self.ids, self.mask, self.decoder_ids, self.decoder_mask, self.embeds,
                        self.model_inputs)
        return decoder


def generate_on_host(model: torch.nn.Module, input_ids: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None, *, seed: int = 1,
                     check_written: bool = False, calls: list[HostCall] | None = None,
                     **kwargs: Any) -> Any:
    """What ``model.generate(input_ids, attention_mask=..., **kwargs)`` returns, made by
    grape's decoders driven by the host. ``seed`` seeds sampling (grape's draws, not
    ``torch.multinomial``'s); ``check_written`` first refuses, as ``grape.generate`` does, a
    model that reads cache positions it has not written; ``calls``, where given, gets each
    generation run (several where a model's own generate calls the generic loop more than
    once).

    Raises
    ------
    NotGraphable
        What ``grape.generate`` would run through ``model.generate`` instead.
    """
    if not owns_generate(model):
        return loop_on_host(model, input_ids, attention_mask, seed=seed,
                            check_written=check_written, calls=calls, **kwargs)
    ran: list[HostCall] = [] if calls is None else calls
    first = len(ran)

    def inner(model: torch.nn.Module, args: tuple, kw: dict) -> Any:
        ids, mask, rest = inner_arguments(model, args, kw)
        return loop_on_host(model, ids, mask, seed=seed, check_written=check_written,
                            calls=ran, wrapped=True, **rest)
    given = kwargs if attention_mask is None else dict(kwargs, attention_mask=attention_mask)
    with routed(model, inner):
        out = model.generate(input_ids, **given)
    if len(ran) == first:
        raise NotGraphable(f"{type(model).__name__}'s own generate never called "
                           f"GenerationMixin.generate, the part grape graphs")
    return out


def loop_on_host(model: torch.nn.Module, ids: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, *, seed: int = 1,
                 check_written: bool = False, calls: list[HostCall] | None = None,
                 wrapped: bool = False, **kwargs: Any) -> Any:
    """One call of the generic loop (``GenerationMixin.generate``, whatever the model's class
    puts around it), driven by the host; arguments as for :func:`generate_on_host`
    (``wrapped``: a call a model's own generate made, as ``grape.torch.options.resolve``
    takes it)."""
    prompt = [kwargs.pop(k, None) for k in ("decoder_input_ids", "decoder_attention_mask")]
    options, mask = resolve(model, ids, mask, kwargs, wrapped)
    embeds = kwargs.get("inputs_embeds")
    ids = sequence_head(ids, embeds)
    options, decoder_ids, decoder_mask, _ = decoder_prompt(model, options, ids, *prompt)
    cls = BeamDecoder if options.strategy == "beam" else TokenDecoder
    length = (ids if embeds is None else embeds).shape[1]
    check_positions(model, options, length)
    def made(options: Options) -> Decoder:
        with model_code(model):  # a model that fails on grape's state: as grape.generate says
            decoder = cls(model, ids.shape[0], length, options)
        if options.strategy == "sample":
            decoder.set_seed(seed)
        return decoder
    # (its experts run as the launch's would: grape.torch.experts)
    with experts_on_device(model):
        decoder = made(options)
        extra = {k: kwargs[k] for k in options.model_inputs}
        call = HostCall(decoder, options, ids, mask, decoder_ids, decoder_mask, embeds, extra)
        if check_written:
            # (where grape.generate first runs the model, before capture: a forward that fails
            # there is a reason to fall back, as it is there; a streamer's own errors, later,
            # stay the caller's)
            with model_code(model):
                decoder.check_written_only(ids, mask, decoder_ids, decoder_mask, embeds, extra)
        if calls is not None:
            calls.append(call)
        feed = None if options.streamer is None else TokenFeed(options.streamer)
        try:
            out = decoder.generate_on_host(ids, mask, decoder_ids, decoder_mask, embeds, extra,
                                           feed)
        except CandidatesOverflowed:  # as grape.generate does: again over the whole vocabulary
            options = replace(options, whole_vocabulary=True)
            decoder = made(options)
            call.decoder, call.options = decoder, options
            out = decoder.generate_on_host(ids, mask, decoder_ids, decoder_mask, embeds, extra,
                                           feed)
    note_no_speech(options)
    return out
