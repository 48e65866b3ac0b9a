"""Models whose class has a ``generate`` of its own, graphed where it calls the generic one.

Whisper's ``generate`` detects the language, builds the decoder's prompt (start, language,
task and no-timestamps tokens), makes logits processors of its own, splits long audio into
windows, and strips its prompt from what it returns; SeamlessM4T's puts a target-language token
before the decoder's prompt; Granite Speech's merges audio into the prompt's embeddings. Each is
Python around one call of the generic loop, ``GenerationMixin.generate`` (``super().generate``),
per window or per try. Rather than reproduce each model's wrapper, grape lets the wrapper run
as it is and takes over the call it makes: for the length of one ``generate``, the model's class
is a subclass whose ``GenerationMixin`` part routes that call to grape (:func:`routed`), and the
call's arguments are read as ``grape.generate``'s (:func:`inner_arguments`): the processors the
wrapper passes as objects become the options they stand for where grape reproduces their kind
(``grape.torch.options``), and a call grape cannot take runs through ``GenerationMixin.generate``
itself, with the reason. A wrapper that never calls it (MusicGen's, BLIP-2's, which call
another model's ``generate``) runs eagerly, as it would without grape.

The class is swapped on the instance, not patched on ``GenerationMixin``: other models, and
this one outside the call, are untouched. Another thread calling the same model's ``generate``
during the call would be routed too (and graphed: grape runs one generation at a time per
model).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import GenerationMixin

from grape.torch.options import NotGraphable, Options

__all__ = ["inner_arguments", "note_no_speech", "owns_generate", "routed"]

# The generic loop's named parameters beyond the inputs that grape takes as generate's
# keyword arguments (grape.torch.options.resolve reads them); the others must be unset.
_PASSED_ON = ("generation_config", "logits_processor", "stopping_criteria", "streamer")
_SIGNATURE = inspect.signature(GenerationMixin.generate)

# What the call is routed to: (model, the call's positional and keyword arguments) -> what
# GenerationMixin.generate returns. Keyed by the instance, set only inside ``routed``.
Handler = Callable[[torch.nn.Module, tuple, dict], Any]
_HANDLERS: dict[int, tuple[type, Handler]] = {}
_SUBCLASSES: dict[type, type] = {}


def owns_generate(model: torch.nn.Module) -> bool:
    """Whether the model's class replaces ``GenerationMixin.generate`` with its own."""
    method = getattr(type(model), "generate", None)
    return (isinstance(model, GenerationMixin) and method is not None
            and method is not GenerationMixin.generate)


class _Routed(GenerationMixin):
    """Sits just before ``GenerationMixin`` in a routed subclass's MRO, so that the model's own
    ``super().generate(...)`` lands here."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        held = _HANDLERS.get(id(self))
        if held is None:  # another instance of the subclass, outside any routed call
            return GenerationMixin.generate(self, *args, **kwargs)
        original, handler = held
        routed_class = type(self)
        self.__class__ = original  # grape's own code sees the model as the caller made it
        try:
            return handler(self, args, kwargs)
        finally:
            self.__class__ = routed_class


def _subclass(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        # Named as the model's class, so that messages name what the caller built.
        sub = type(cls.__name__, (cls, _Routed), {"__module__": cls.__module__,
                                                  "__qualname__": cls.__qualname__})
        mro = sub.__mro__
        if mro.index(_Routed) + 1 != mro.index(GenerationMixin):
            raise NotGraphable(f"{cls.__name__}'s classes put another class between its "
                               f"generate and GenerationMixin's")
        _SUBCLASSES[cls] = sub
    return sub


@contextlib.contextmanager
def routed(model: torch.nn.Module, handler: Handler) -> Iterator[None]:
    """Within the block, the model's own ``generate`` calls ``handler(model, args, kwargs)``
    where it would call ``GenerationMixin.generate(model, *args, **kwargs)``."""
    original = type(model)
    if id(model) in _HANDLERS:
        raise NotGraphable(f"{original.__name__}.generate is already running under grape "
                           f"(a nested call)")
    model.__class__ = _subclass(original)
    _HANDLERS[id(model)] = (original, handler)
    try:
        yield
    finally:
        del _HANDLERS[id(model)]
        model.__class__ = original


def inner_arguments(model: torch.nn.Module, args: tuple, kwargs: dict
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, Any]]:
    """A call of ``GenerationMixin.generate(model, *args, **kwargs)`` as ``grape.generate``'s
    (inputs, attention mask, keyword arguments): the inputs by position or by the model's main
    input name (None where the prompt is ``inputs_embeds``, left among the keywords);
    ``max_new_tokens`` from the arguments, else the generation config given or the model's,
    else from ``max_length`` as generate derives it where the prompt's length is known (token
    ids, or no decoder prompt given: its start token alone).

    Raises
    ------
    NotGraphable
        What grape does not take there: an assistant model, a negative prompt,
        ``custom_generate``, ``prefix_allowed_tokens_fn``, ``synced_gpus``, encoder outputs or a
        cache given, no prompt, no length it can derive.
    """
    try:
        bound = _SIGNATURE.bind(model, *args, **kwargs)
    except TypeError as e:
        raise NotGraphable(f"GenerationMixin.generate was called with arguments it does not "
                           f"take: {e}") from None
    named = dict(bound.arguments)
    named.pop("self")
    rest = dict(named.pop("kwargs", {}))
    inputs = named.pop("inputs", None)
    for name, value in named.items():
        if name in _PASSED_ON:
            if value is not None:
                rest[name] = value
        elif value is not None and value is not False:
            raise NotGraphable(f"{name} given to GenerationMixin.generate")
    main = getattr(model, "main_input_name", "input_ids")
    if main in rest:
        if inputs is not None:
            raise NotGraphable(f"GenerationMixin.generate was given inputs twice (by position "
                               f"and as {main})")
        inputs = rest.pop(main)
    for name in ("encoder_outputs", "past_key_values"):
        if rest.get(name) is not None:
            raise NotGraphable(f"{name} given to GenerationMixin.generate")
    # (a decoder-only model's prompt may be inputs_embeds alone: grape.torch.options checks)
    if not isinstance(inputs, torch.Tensor) and rest.get("inputs_embeds") is None:
        raise NotGraphable(f"GenerationMixin.generate was called without {main} or "
                           f"inputs_embeds")
    mask = rest.pop("attention_mask", None)
    if rest.get("max_new_tokens") is None:
        rest["max_new_tokens"] = _new_tokens(model, inputs, rest)
    return inputs, mask, rest


def _new_tokens(model: torch.nn.Module, inputs: torch.Tensor | None,
                kwargs: dict[str, Any]) -> int:
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    new = getattr(config, "max_new_tokens", None)
    if new is not None:
        return new
    length = kwargs.get("max_length", getattr(config, "max_length", None))
    if length is None:
        defaults = getattr(type(config), "_get_default_generation_params", dict)()
        length = defaults.get("max_length")
    seq2seq = getattr(model.config, "is_encoder_decoder", False)
    for given, what in (("decoder_input_ids", "a decoder prompt"),
                        ("inputs_embeds", "inputs_embeds")):
        # (generate may put the start token before a decoder prompt, and counts embeddings
        # apart from token ids: the count would be guessed)
        if kwargs.get(given) is not None:
            raise NotGraphable(f"GenerationMixin.generate was given max_length, not "
                               f"max_new_tokens, with {what}")
    head = 1 if seq2seq else inputs.shape[1]
    if not isinstance(length, int) or length - head < 1:
        raise NotGraphable(f"GenerationMixin.generate was given no max_new_tokens and a "
                           f"max_length ({length!r}) that leaves no new token after "
                           f"{head}")
    return length - head


def note_no_speech(options: Options) -> None:
    """What the call's ``WhisperNoSpeechDetection`` (``options.no_speech``) records on the
    first step, recorded beside grape's graphs: the probability of its no-speech token, which
    Whisper's generate reads after the call to skip a window of silence. The processor changes
    no score, so it has no place in the graph; it runs the model itself over the decoder prompt
    (an eager forward, as under ``generate``) and takes the logits at the prompt's start token.
    Where that prompt is the start token alone it reads the first step's scores instead: the
    prompt's logits in float32, as log-probabilities in a beam search (one row per beam),
    computed as ``generate`` computes them (:func:`_first_step_scores`). As under
    ``generate``, it records only where the decoder prompt is as long as its ``begin_index``
    says; nothing is read back to the host."""
    detector = options.no_speech
    if detector is None or options.decoder_prompt_len != detector.begin_index:
        return
    if detector.inputs is None:  # Whisper sets them before each call of the loop
        raise NotGraphable("a WhisperNoSpeechDetection whose inputs were never set")
    rows = options.num_beams if options.strategy == "beam" else options.num_return
    with torch.no_grad():
        if detector.start_of_trans_offset > 1:
            logits = detector.model(**detector.inputs).logits
            scores = logits[:, detector.begin_index - detector.start_of_trans_offset].float()
            probs = scores.softmax(dim=-1)
        else:
            scores = _first_step_scores(detector.model, detector.inputs, rows)
            probs = (scores.log_softmax(dim=-1).exp() if detector.is_scores_logprobs
                     else scores.softmax(dim=-1))
    detector._no_speech_prob = probs[:, detector.no_speech_token]


# What a detector's inputs may hold for its first step to be run as generate runs it (the
# encoder once per prompt, the decoder over every row).
_EXPANDABLE = {"input_features", "decoder_input_ids", "decoder_attention_mask"}


def _first_step_scores(model: torch.nn.Module, inputs: dict[str, Any], rows: int
                       ) -> torch.Tensor:
    """The first step's scores at the decoder prompt's last token, float32, ``rows`` per
    prompt. ``generate`` runs the encoder once per prompt and the decoder over the rows its
    beams (or returned sequences) expanded: run so, the products have its shapes, so its
    bits (the decoder over the prompts alone, repeated afterwards, came out one float32 step
    apart in a beam search on an Intel Xeon's BLAS). Inputs of other kinds run the prompts
    alone, repeated."""
    if rows == 1 or not set(inputs) <= _EXPANDABLE or "input_features" not in inputs:
        return model(**inputs).logits[:, -1].float().repeat_interleave(rows, dim=0)
    given = dict(inputs)
    encoded = model.get_encoder()(given.pop("input_features"))
    expanded = {k: v.repeat_interleave(rows, dim=0) for k, v in given.items() if v is not None}
    hidden = encoded.last_hidden_state.repeat_interleave(rows, dim=0)
    return model(encoder_outputs=(hidden,), **expanded).logits[:, -1].float()
