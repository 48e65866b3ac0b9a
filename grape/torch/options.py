"""What a ``generate`` call asks for, resolved the way Hugging Face resolves it.

``resolve(model, input_ids, attention_mask, kwargs)`` merges the caller's arguments into the
model's ``generation_config`` (as ``model.generate`` does), checks them, and returns
:class:`Options`: the strategy, its parameters, and the special tokens and attention mask
``generate`` would use. Anything grape does not reproduce exactly raises
:class:`NotGraphable` with the reason, for the caller to fall back to ``model.generate``; bad
input raises ``GrapeError``.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    WhisperNoSpeechDetection,
    WhisperTimeStampLogitsProcessor,
)

from grape.errors import GrapeError
from grape.torch.sampling import MOST_CANDIDATES, SPARE
from grape.torch.warpers import DeviceTemperature, DeviceTopP

__all__ = ["NotGraphable", "Options", "check_positions", "decoder_prompt", "resolve",
           "sampling_warpers", "sequence_head"]


class NotGraphable(Exception):  # a reason to fall back, not an error of the caller
    """grape cannot run this generation itself; the message says why (one line)."""


# GenerationConfig fields grape reproduces, or that do not change what generate computes.
_HANDLED = {
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature",
    "top_k", "top_p", "num_beams", "length_penalty", "early_stopping", "eos_token_id",
    "pad_token_id", "bos_token_id", "decoder_start_token_id", "use_cache", "cache_implementation",
    "num_return_sequences", "return_dict_in_generate", "output_scores", "output_logits",
    "output_attentions", "output_hidden_states", "transformers_version", "_from_model_config",
    "compile_config", "disable_compile", "prefill_chunk_size", "is_assistant",
    "num_beam_groups", "diversity_penalty", "low_memory", "forced_bos_token_id",
    "forced_eos_token_id", "repetition_penalty", "bad_words_ids", "suppress_tokens",
    "begin_suppress_tokens", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "stop_strings",
    "remove_invalid_values", "exponential_decay_length_penalty", "renormalize_logits",
    "sequence_bias", "encoder_repetition_penalty",
}
# Sampling's cutoffs after temperature, top-k and top-p, in generate's order: (the field, its
# warper for a value on a device, whether generate applies it for this value).
_CUTOFFS = (
    ("min_p", lambda v, device: MinPLogitsWarper(v), lambda v: True),
    ("typical_p", lambda v, device: TypicalLogitsWarper(mass=v), lambda v: v < 1.0),
    ("epsilon_cutoff", lambda v, device: EpsilonLogitsWarper(epsilon=v),
     lambda v: 0.0 < v < 1.0),
    # (its epsilon a tensor made once, where the scores lie)
    ("eta_cutoff", lambda v, device: EtaLogitsWarper(v, device=device),
     lambda v: 0.0 < v < 1.0),
)
# Of the handled fields, the values grape supports when they are set.
_ONLY = {"output_attentions": (None, False),
         "output_hidden_states": (None, False),
         "use_cache": (None, True), "prefill_chunk_size": (None,), "num_beam_groups": (None, 1),
         "low_memory": (None, False), "cache_implementation": (None, "static"),
         "diversity_penalty": (None, 0.0)}


# The steps grape.torch.api._build runs eagerly after the prompt before its loop exists (a
# warm-up, and the audit that compares captures at two lengths).
STEPS_BEFORE_CAPTURE = 2


@dataclass(frozen=True)
class Options:
    strategy: str  # "greedy", "sample" or "beam"
    max_new_tokens: int
    min_new_tokens: int
    eos: tuple[int, ...]  # empty: no EOS, generation runs to max_new_tokens
    pad: int  # what finished sequences produce
    temperature: float
    top_k: int
    top_p: float
    num_beams: int
    length_penalty: float
    early_stopping: bool | str
    config: GenerationConfig  # the merged config, as generate would use it
    # Tokens the static cache holds, prompt included (None: prompt + max_new_tokens). Not a
    # generate option: grape's, for a cache sized once for generations of several lengths.
    cache_length: int | None = None
    # return_dict_in_generate: a GenerateDecoderOnlyOutput rather than the tokens alone, with
    # what ``kept`` names of "scores" (output_scores) and "logits" (output_logits).
    return_dict: bool = False
    kept: tuple[str, ...] = ()
    # An encoder-decoder model's decoder start token (generate's decoder_start_token_id, else
    # its bos_token_id); None for a decoder-only model.
    start: int | None = None
    # generate's ForcedBOSTokenLogitsProcessor and ForcedEOSTokenLogitsProcessor: the first
    # token where the decoder's prompt is one token long, and the last token allowed.
    forced_bos: int | None = None
    forced_eos: tuple[int, ...] = ()
    # generate's other processors grape reproduces: RepetitionPenaltyLogitsProcessor,
    # NoRepeatNGramLogitsProcessor, EncoderNoRepeatNGramLogitsProcessor, NoBadWordsLogitsProcessor,
    # MinLengthLogitsProcessor (min_length counts the prompt, as generate's does),
    # SuppressTokensLogitsProcessor and SuppressTokensAtBeginLogitsProcessor.
    repetition_penalty: float = 1.0
    no_repeat_ngram: int = 0
    source_ngram: int = 0  # encoder_no_repeat_ngram_size (encoder-decoder models)
    # What the encoder takes the prompt as: input_ids, or a speech model's input_features...
    source: str = "input_ids"
    bad_words: tuple[int, ...] = ()  # words of one token
    bad_sequences: tuple[tuple[int, ...], ...] = ()  # words of several, banned after their prefix
    min_length: int = 0
    suppressed: tuple[int, ...] = ()
    begin_suppressed: tuple[int, ...] = ()
    # The sequence's length (its prompt or decoder prompt counted) at which begin_suppressed
    # applies, where a SuppressTokensAtBeginLogitsProcessor given as an object says so (a
    # model's own generate passes Whisper's so); None: where generate puts the one it makes,
    # at the first new token (the second after a forced first one).
    begin_at: int | None = None
    # WhisperTimeStampLogitsProcessor, given as an object (Whisper's generate passes it where
    # timestamps are asked for, as in long-form audio): (its begin index, the no-timestamps
    # token, the EOS it keeps text below, the latest first timestamp or None, whether a row
    # whose timestamps outweigh every text token must take one), after the suppression.
    timestamps: tuple[int, int, int, int | None, bool] | None = None
    # A decoder-only model's prompt given as inputs_embeds (the cache's prompt is theirs): how
    # many token ids generate's sequences start with (the input_ids given with them, of their
    # length, or none); None for a prompt of token ids.
    embedded_head: int | None = None
    # Tensors the call gives the model beside the prompt (a vision model's pixel_values), by
    # name: generate passes them to every forward's input preparation; grape gives them to the
    # prompt's, and refuses a model whose steps would read them.
    model_inputs: tuple[str, ...] = ()
    # Values read back to the host to resolve the call (processor objects' tokens on a GPU).
    read_backs: int = field(default=0, compare=False)
    # An encoder-decoder model's decoder prompt: its start token alone (1), or the
    # decoder_input_ids the caller gave, as generate prepares them (decoder_prompt).
    decoder_prompt_len: int = 1
    # num_return_sequences: sequences per prompt (sampled independently, or a beam search's
    # best), adjacent in the result as generate returns them.
    num_return: int = 1
    # A WhisperNoSpeechDetection given as an object (Whisper's generate passes one where
    # no_speech_threshold is set): it changes no score, and records the probability of "no
    # speech" on the call's first step, which grape.torch.own_generate.note_no_speech
    # reproduces beside the graph. Not part of the graph's key.
    no_speech: Any = field(default=None, compare=False, repr=False)
    # generate's streamer: handed the sequences' head, then each token as it is made
    # (grape.torch.streaming); not part of the graph's key.
    streamer: Any = field(default=None, compare=False, repr=False)
    # Sampling's cutoffs beyond top-k and top-p that generate applies (min_p, typical_p,
    # epsilon_cutoff, eta_cutoff), as (field, value), in its order (sampling_warpers).
    cutoffs: tuple[tuple[str, float], ...] = ()
    # stop_strings, and the tokenizer generate takes them with (the call's ``tokenizer``): a
    # sequence ends where its text ends with one (StopStringCriteria over the tokens' text).
    stop_strings: tuple[str, ...] = ()
    tokenizer: Any = field(default=None, compare=False, repr=False)
    # InfNanRemoveLogitsProcessor (remove_invalid_values), ExponentialDecayLengthPenalty
    # ((start, factor): EOS's score raised by |score| * (factor ** (made - start) - 1) once
    # more than start tokens are made) and LogitNormalization (renormalize_logits, last).
    remove_invalid: bool = False
    decay: tuple[int, float] | None = None
    renormalize: bool = False
    # SequenceBiasLogitsProcessor: (token ids, bias) in the caller's order.
    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] = ()
    # EncoderRepetitionPenaltyLogitsProcessor: the prompt's (an encoder-decoder's source's)
    # tokens' scores raised (or lowered, below 1) by this factor.
    source_penalty: float = 1.0
    # Sample with generate's warpers over the whole vocabulary even where the candidates'
    # sampler could (samples_candidates): a generation made again after its candidates
    # overflowed (grape.torch.sampling).
    whole_vocabulary: bool = False

    @property
    def samples_candidates(self) -> bool:
        """Whether sampling runs over top-k's candidates (``grape.torch.sampling``): top-k
        given and at most ``MOST_CANDIDATES - SPARE``, no other cutoff, nothing that keeps
        the processed scores (``output_scores``, ``renormalize_logits``), and no streamer (a
        generation made again would have streamed other tokens)."""
        return (self.strategy == "sample" and 0 < self.top_k <= MOST_CANDIDATES - SPARE
                and not self.whole_vocabulary
                and not self.cutoffs and not self.renormalize and "scores" not in self.kept
                and self.streamer is None)

    @property
    def key(self) -> tuple:
        """What the generation's graph depends on (everything but the prompt and the seed)."""
        # (sampling's temperature and top-p are read from the device, set for each call:
        # only whether top-p applies is the graph's)
        return (self.strategy, self.max_new_tokens, self.min_new_tokens, self.eos, self.pad,
                self.top_k, self.top_p < 1.0, self.num_beams, self.length_penalty,
                self.early_stopping, self.cache_length, self.return_dict, self.kept,
                self.start, self.forced_bos, self.forced_eos, self.repetition_penalty,
                self.no_repeat_ngram, self.source_ngram, self.source, self.bad_words,
                self.bad_sequences, self.min_length, self.suppressed, self.begin_suppressed,
                self.begin_at, self.timestamps, self.embedded_head, self.model_inputs,
                self.decoder_prompt_len, self.num_return, self.cutoffs,
                self.stop_strings,
                # (the tokenizer's table of token texts is the graph's: one per tokenizer)
                id(self.tokenizer) if self.stop_strings else None, self.remove_invalid,
                self.decay, self.renormalize, self.sequence_bias, self.source_penalty,
                self.samples_candidates)

    @property
    def room(self) -> int:
        """Tokens a decoder's per-token state holds: ``max_new_tokens``, and at least what
        the steps run before a capture reach (``STEPS_BEFORE_CAPTURE``, after the prompt's
        token), so that a generation of one or two tokens does not index past its buffers
        there (on a GPU, a device-side assert that ends the process's CUDA context)."""
        return max(self.max_new_tokens, STEPS_BEFORE_CAPTURE + 1)

    def cache_tokens(self, prompt_len: int) -> int:
        """The static cache's length for a prompt of ``prompt_len`` tokens."""
        return max(self.cache_length or 0, prompt_len + self.room)


def _merged(model: torch.nn.Module, kwargs: dict[str, Any]
            ) -> tuple[GenerationConfig, tuple[str, ...]]:
    """The call's generation config as ``generate`` makes it: by the model's own
    ``_prepare_generation_config`` (a given ``generation_config``'s unset fields taken from the
    model's, then the library's defaults, then the keyword arguments over both); and the
    names of the tensors among the other arguments, which ``generate`` passes to the model
    (``pixel_values``...). Other arguments than those are refused."""
    given = kwargs.pop("generation_config", None)
    prepare = getattr(model, "_prepare_generation_config", None)
    try:
        if prepare is not None:
            config, unknown = prepare(given, **kwargs)
            unknown = {k for k in unknown if k not in ("output_attentions", "output_hidden_states")}
        else:
            base = given if given is not None else getattr(model, "generation_config", None)
            config = copy.deepcopy(base) if base is not None else GenerationConfig()
            unknown = config.update(**kwargs)
    except ValueError as e:  # transformers checks some values as it sets them
        raise GrapeError(f"expected generation options generate accepts, found: "
                         f"{str(e).splitlines()[0]}") from None
    inputs = tuple(sorted(k for k in unknown if isinstance(kwargs[k], torch.Tensor)))
    if refused := sorted(k for k in unknown if k not in inputs and kwargs[k] is not None):
        raise NotGraphable(f"arguments grape does not pass on: {refused}")
    return _with_defaults(config), inputs


def _with_defaults(config: GenerationConfig) -> GenerationConfig:
    """Fields left unset take the library's defaults, as generate gives them (transformers 5
    keeps them apart from the config; 4.x sets them in the constructor)."""
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    for name, value in defaults.items():
        if getattr(config, name, None) is None:
            setattr(config, name, value)
    return config


def _unsupported(config: GenerationConfig) -> list[str]:
    defaults = _with_defaults(GenerationConfig()).to_dict()
    found = []
    for name, value in config.to_dict().items():
        restricted = name in _ONLY and value not in _ONLY[name]
        changed = name not in _HANDLED and value is not None and value != defaults.get(name, value)
        if restricted or changed:
            found.append(f"{name}={value!r}")
    return found


def _ids(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = [value] if isinstance(value, int) else list(value)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise GrapeError(f"expected {name} to be a token id or a list of token ids (non-negative "
                         f"integers), found {value!r}")
    return tuple(values)


def _integer(value: Any, name: str, least: int | None = None) -> int:
    if (not isinstance(value, int) or isinstance(value, bool)
            or (least is not None and value < least)):
        bound = "" if least is None else f" of at least {least}"
        raise GrapeError(f"expected {name} to be an integer{bound}, found {value!r}")
    return value


def _real(value: Any, name: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise GrapeError(f"expected {name} to be a number, found {value!r}")
    return float(value)


def resolve(model: torch.nn.Module, input_ids: Any, attention_mask: Any,
            kwargs: dict[str, Any], wrapped: bool = False) -> tuple[Options, torch.Tensor | None]:
    """The options of one generate call, and the attention mask generate would use (None
    where it is all ones). ``wrapped``: the call is one a model's own generate makes of the
    generic loop (``grape.torch.own_generate``), whose mask over a speech source is taken at
    any shape, and passed on, as the loop takes it (Whisper passes a long audio's whole mask
    beside each 30-second window, and the whole batch's beside the rows still decoding, which
    its encoder does not read; a model that read it would fail as under ``generate``).

    Raises
    ------
    GrapeError
        Bad input: not token ids on the model's device, a mask of another shape, no
        ``max_new_tokens``, a value out of range.
    NotGraphable
        Something grape does not reproduce (the reason is the message).
    """
    source = source_of(model)
    tokens = source == "input_ids"
    kwargs = dict(kwargs)
    embeds = kwargs.pop("inputs_embeds", None)
    if embeds is not None:
        head = _embedded(model, input_ids, embeds)
        input_ids, tokens = embeds, False  # the cache's prompt: checked as a speech source's
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim < 2 \
            or (tokens and (input_ids.ndim != 2 or input_ids.dtype != torch.long)) \
            or (not tokens and not input_ids.is_floating_point()) \
            or input_ids.shape[1] < 1 or input_ids.shape[0] < 1:
        found = (f"shape {tuple(input_ids.shape)} and {input_ids.dtype}"
                 if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__)
        expected = ("of shape (batch, length >= 1) and dtype long" if tokens else
                    "of shape (batch, length >= 1, ...) and a floating dtype")
        raise GrapeError(f"expected {source} {expected}, found {found}")
    device = next(model.parameters()).device
    if input_ids.device != device:
        raise GrapeError(f"expected {source} on the model's device ({device}), found them on "
                         f"{input_ids.device}")
    # A mask over the prompt's tokens, or a speech source's frames: its second dimension, or
    # its last where the features come first (Whisper's processor masks (batch, frames) of
    # (batch, features, frames)).
    shapes = [tuple(input_ids.shape[:2])]
    if not tokens and embeds is None and input_ids.ndim > 2:
        shapes.append((input_ids.shape[0], input_ids.shape[-1]))
    any_length = wrapped and not tokens and embeds is None and isinstance(
        attention_mask, torch.Tensor) and attention_mask.ndim == 2
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or (tuple(attention_mask.shape) not in shapes
                                           and not any_length)
                                       or attention_mask.device != device):
        found = (f"shape {tuple(attention_mask.shape)} on {attention_mask.device}"
                 if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__)
        raise GrapeError(f"expected an attention_mask of shape "
                         f"{' or '.join(map(str, shapes))} on {device}, found {found}")
    # (A model whose class has its own generate, Whisper's, reaches here for the calls that
    # generate makes of GenerationMixin's: grape.torch.own_generate.)
    if not tokens and embeds is None and not getattr(model.config, "is_encoder_decoder", False):
        raise NotGraphable(f"{type(model).__name__} is a decoder-only model that generates "
                           f"from {source}, and grape's decoders read token ids")
    tokenizer = kwargs.pop("tokenizer", None)  # generate's argument, for stop strings
    streamer = kwargs.pop("streamer", None)
    given = _given_processors(kwargs.pop("logits_processor", None))
    _given_criteria(kwargs.pop("stopping_criteria", None))
    max_new = _integer(kwargs.get("max_new_tokens"), "max_new_tokens", 1)
    config, model_inputs = _merged(model, kwargs)
    if elsewhere := [k for k in model_inputs if kwargs[k].device != device]:
        raise GrapeError(f"expected the model's arguments on its device ({device}), found "
                         f"{elsewhere[0]} on {kwargs[elsewhere[0]].device}")
    if unsupported := _unsupported(config):
        raise NotGraphable(f"generation options grape does not reproduce: "
                           f"{', '.join(unsupported)}")
    eos = _ids(config.eos_token_id, "eos_token_id")
    pad_ids = _ids(config.pad_token_id, "pad_token_id")
    pad = pad_ids[0] if pad_ids else (eos[0] if eos else 0)
    beams = _integer(1 if config.num_beams is None else config.num_beams, "num_beams", 1)
    if config.early_stopping not in (None, True, False, "never"):
        raise GrapeError(f"expected early_stopping to be True, False or 'never', found "
                         f"{config.early_stopping!r}")
    if beams > 1 and config.do_sample:
        raise NotGraphable("beam search with sampling (do_sample=True and num_beams > 1)")
    if beams > 1 and streamer is not None:
        raise GrapeError(f"expected num_beams=1 with a streamer (generate streams no beam "
                         f"search), found num_beams={beams}")
    strategy = "beam" if beams > 1 else "sample" if config.do_sample else "greedy"
    # generate's own checks: greedy decoding makes one sequence per prompt, a beam search at
    # most its beams.
    num_return = _integer(1 if config.num_return_sequences is None
                          else config.num_return_sequences, "num_return_sequences", 1)
    if num_return > 1 and strategy == "greedy":
        raise GrapeError(f"expected num_return_sequences=1 for greedy decoding (generate "
                         f"refuses more), found {num_return}")
    if num_return > beams and strategy == "beam":
        raise GrapeError(f"expected num_return_sequences of at most num_beams ({beams}), found "
                         f"{num_return}")
    temperature = _real(config.temperature if config.temperature is not None else 1.0,
                        "temperature")
    top_p = _real(config.top_p if config.top_p is not None else 1.0, "top_p")
    top_k = _integer(config.top_k or 0, "top_k")  # its range is checked below
    if strategy == "sample" and not (temperature > 0 and 0 < top_p <= 1 and top_k >= 0):
        raise GrapeError(f"expected temperature > 0, 0 < top_p <= 1 and top_k >= 0 for "
                         f"sampling, found {temperature}, {top_p} and {top_k}")
    return_dict = bool(config.return_dict_in_generate)
    # generate keeps scores and logits only in its return dict; without one it drops them.
    kept = tuple(name for name, wanted in (("scores", config.output_scores),
                                           ("logits", config.output_logits))
                 if wanted and return_dict)
    start = None
    if getattr(model.config, "is_encoder_decoder", False):
        start = (config.decoder_start_token_id if config.decoder_start_token_id is not None
                 else config.bos_token_id)
        if not (isinstance(start, int) and not isinstance(start, bool) and start >= 0):
            raise NotGraphable(f"an encoder-decoder model's decoder starts from one token id, "
                               f"and its decoder_start_token_id (or bos_token_id) is "
                               f"{start!r}")
    penalty = _real(1.0 if config.repetition_penalty is None else config.repetition_penalty,
                    "repetition_penalty")
    if not 0 < penalty < float("inf"):
        raise GrapeError(f"expected repetition_penalty to be a positive number, found "
                         f"{config.repetition_penalty!r}")
    bad = _bad_words(config.bad_words_ids, eos)
    forced_bos = _ids(config.forced_bos_token_id, "forced_bos_token_id")
    if len(forced_bos) > 1:
        raise GrapeError(f"expected forced_bos_token_id to be one token id, found "
                         f"{config.forced_bos_token_id!r}")
    options = Options(strategy, max_new,
                      _integer(config.min_new_tokens or 0, "min_new_tokens", 0), eos, pad,
                      temperature, top_k, top_p, beams,
                      _real(config.length_penalty, "length_penalty"), config.early_stopping,
                      config, return_dict=return_dict, kept=kept, start=start,
                      forced_bos=forced_bos[0] if forced_bos else None,
                      forced_eos=_ids(config.forced_eos_token_id, "forced_eos_token_id"),
                      repetition_penalty=penalty,
                      no_repeat_ngram=_integer(config.no_repeat_ngram_size or 0,
                                               "no_repeat_ngram_size", 0),
                      # generate ignores it, with a warning, for a decoder-only model
                      source_ngram=_integer(config.encoder_no_repeat_ngram_size or 0,
                                            "encoder_no_repeat_ngram_size", 0) if start is not None
                      else 0,
                      source=source,
                      bad_words=tuple(w[0] for w in bad if len(w) == 1),
                      bad_sequences=tuple(w for w in bad if len(w) > 1),
                      min_length=_integer(config.min_length or 0, "min_length", 0),
                      suppressed=_ids(config.suppress_tokens, "suppress_tokens"),
                      begin_suppressed=_ids(config.begin_suppress_tokens,
                                            "begin_suppress_tokens"),
                      num_return=num_return,
                      cutoffs=_cutoffs(config) if strategy == "sample" else (),
                      stop_strings=_stop_strings(config.stop_strings, tokenizer),
                      tokenizer=tokenizer, streamer=streamer,
                      remove_invalid=bool(config.remove_invalid_values),
                      decay=_decay(config.exponential_decay_length_penalty),
                      renormalize=bool(config.renormalize_logits),
                      sequence_bias=_sequence_bias(config.sequence_bias),
                      source_penalty=_real(1.0 if config.encoder_repetition_penalty is None
                                           else config.encoder_repetition_penalty,
                                           "encoder_repetition_penalty"))
    if given:  # the caller's objects replace those generate makes of their kinds
        options = dataclasses.replace(options, **given)
    if model_inputs:
        if start is not None:
            raise NotGraphable(f"model arguments beside an encoder-decoder model's source: "
                               f"{', '.join(model_inputs)}")
        options = dataclasses.replace(options, model_inputs=model_inputs)
    if embeds is not None:
        options = dataclasses.replace(options, embedded_head=head)
        if options.source_penalty != 1.0:
            raise NotGraphable("encoder_repetition_penalty over a prompt given as "
                               "inputs_embeds, which holds no tokens")
    if options.decay is not None and not eos:
        raise GrapeError("expected an EOS token with exponential_decay_length_penalty (it "
                         "raises EOS's score; generate fails without one), found none")
    if not 0 < options.source_penalty < float("inf"):
        raise GrapeError(f"expected encoder_repetition_penalty to be a positive number, found "
                         f"{config.encoder_repetition_penalty!r}")
    try:  # the warpers check their own values, as they do inside generate
        _check_sampling(options)
    except ValueError as e:
        raise GrapeError(f"expected sampling options generate accepts, found: "
                         f"{str(e).splitlines()[0]}") from None
    if options.source_penalty != 1.0 and not tokens:
        raise NotGraphable(f"encoder_repetition_penalty over a source of {source}, which "
                           f"holds no tokens")
    if options.source_ngram and not tokens:
        raise NotGraphable(f"encoder_no_repeat_ngram_size over a source of {source}, which "
                           f"holds no tokens")
    if not tokens:  # generate infers no mask from features or embeddings
        return options, attention_mask if attention_mask is None or \
            attention_mask.dtype == torch.long else attention_mask.long()
    return options, _attention_mask(input_ids, attention_mask, pad_ids, eos)


def decoder_prompt(model: torch.nn.Module, options: Options, source: torch.Tensor,
                   decoder_input_ids: Any, decoder_attention_mask: Any
                   ) -> tuple[Options, torch.Tensor | None, torch.Tensor | None, int]:
    """An encoder-decoder model's decoder prompt as ``generate`` prepares it: the caller's
    ``decoder_input_ids`` (and ``decoder_attention_mask``) through the model's own
    ``_prepare_decoder_input_ids_for_generation``, which puts the start token before a prompt
    whose rows all lack it (reading that back once) and leaves some models' prompts as they
    are. Returns the options with the prompt's length, the ids and the mask (None, None where
    no prompt was given: the decoder starts from its start token), and the bytes copied (the
    start token's column put before them).

    Raises
    ------
    GrapeError
        A decoder prompt for a decoder-only model, or not (batch, length >= 1) token ids on
        the source's device, or a mask of another shape.
    """
    if decoder_input_ids is None:
        if decoder_attention_mask is not None:
            raise GrapeError("expected decoder_attention_mask only with decoder_input_ids, "
                             "found it alone")
        return options, None, None, 0
    if options.start is None:
        raise GrapeError(f"expected decoder_input_ids only for an encoder-decoder model, found "
                         f"them for {type(model).__name__}, a decoder-only model")
    batch, device = source.shape[0], source.device
    ids = decoder_input_ids
    if not (isinstance(ids, torch.Tensor) and ids.ndim == 2 and ids.dtype == torch.long
            and ids.shape[0] == batch and ids.shape[1] >= 1 and ids.device == device):
        found = (f"shape {tuple(ids.shape)}, {ids.dtype} on {ids.device}"
                 if isinstance(ids, torch.Tensor) else type(ids).__name__)
        raise GrapeError(f"expected decoder_input_ids of shape ({batch}, length >= 1), long, on "
                         f"{device}, found {found}")
    kwargs: dict[str, Any] = {"decoder_input_ids": ids}
    if decoder_attention_mask is not None:
        mask = decoder_attention_mask
        if not (isinstance(mask, torch.Tensor) and mask.shape == ids.shape
                and mask.device == device):
            found = (f"shape {tuple(mask.shape)} on {mask.device}"
                     if isinstance(mask, torch.Tensor) else type(mask).__name__)
            raise GrapeError(f"expected a decoder_attention_mask of shape {tuple(ids.shape)} on "
                             f"{device}, found {found}")
        kwargs["decoder_attention_mask"] = mask if mask.dtype == torch.long else mask.long()
    start = torch.tensor(options.start, dtype=torch.long, device=device)
    prepared, kwargs = model._prepare_decoder_input_ids_for_generation(
        batch_size=batch, model_input_name=options.source, model_kwargs=kwargs,
        decoder_start_token_id=start, device=device)
    mask = kwargs.get("decoder_attention_mask")
    copied = 0 if prepared is ids else ids.numel() * ids.element_size() + (
        0 if mask is None else mask.numel() * mask.element_size())
    return (dataclasses.replace(options, decoder_prompt_len=prepared.shape[1]), prepared, mask,
            copied)


def _embedded(model: torch.nn.Module, input_ids: Any, embeds: Any) -> int:
    """A prompt given as ``inputs_embeds``: checked, and the count of token ids that
    ``generate``'s sequences start with (``input_ids`` given beside them, or none).

    Raises
    ------
    GrapeError
        Embeddings that are not (batch, length >= 1, hidden) floats on the model's device, or
        token ids beside them of another batch.
    NotGraphable
        An encoder-decoder model's (its encoder takes them), or token ids of another length.
    """
    if getattr(model.config, "is_encoder_decoder", False):
        raise NotGraphable("inputs_embeds for an encoder-decoder model (its encoder's input)")
    device = next(model.parameters()).device
    if not (isinstance(embeds, torch.Tensor) and embeds.ndim == 3 and embeds.is_floating_point()
            and min(embeds.shape) >= 1 and embeds.device == device):
        found = (f"shape {tuple(embeds.shape)}, {embeds.dtype} on {embeds.device}"
                 if isinstance(embeds, torch.Tensor) else type(embeds).__name__)
        raise GrapeError(f"expected inputs_embeds of shape (batch, length >= 1, hidden), "
                         f"floating, on {device}, found {found}")
    if input_ids is None:
        return 0
    if not (isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2
            and input_ids.dtype == torch.long and input_ids.shape[0] == embeds.shape[0]):
        found = (f"shape {tuple(input_ids.shape)} and {input_ids.dtype}"
                 if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__)
        raise GrapeError(f"expected input_ids beside inputs_embeds of shape "
                         f"({embeds.shape[0]}, length) and dtype long, or none, found {found}")
    if input_ids.shape[1] != embeds.shape[1]:
        raise NotGraphable(f"input_ids of another length ({input_ids.shape[1]}) than the "
                           f"inputs_embeds beside them ({embeds.shape[1]})")
    return input_ids.shape[1]


def check_positions(model: torch.nn.Module, options: Options, prompt_len: int) -> None:
    """Refuse a generation that would run past a learned position table.

    A model that looks positions up in a table (GPT-2's ``wpe``, OPT's and BART's
    ``embed_positions``: an embedding, not the token table, as long as the config's
    ``max_position_embeddings``, ``n_positions`` or ``max_target_positions``, or up to two
    longer for the offset some keep) indexes past it once the sequence outgrows it: on the CPU
    an IndexError, on a GPU a device-side assert that ends the process's CUDA context, inside
    or outside a graph. Rotary, sinusoidal and ALiBi positions, computed rather than looked
    up, have no such table and are not limited here.

    Raises
    ------
    GrapeError
        The prompt (an encoder-decoder's decoder prompt) and the tokens the loop feeds back
        (``Options.room`` less the last) need more positions than the table holds.
    """
    found = _TABLES.get(model)
    if found is None:
        found = _TABLES[model] = _position_table(model)
    if not found:
        return
    limit, name = found
    head = options.decoder_prompt_len if options.start is not None else prompt_len
    fed = options.room - 1  # the new tokens a forward reads: all but the last
    if head + fed > limit:
        raise GrapeError(f"expected the prompt ({head} tokens) and the new tokens but the last "
                         f"({fed}) to fit the model's {limit} positions (its table {name}), "
                         f"found {head + fed}")


# Per model: its position table's (limit, name), or () for none, found once (walking a
# 32-layer Llama's 423 modules took 0.32 ms on this project's CPU machine: not per call).
_TABLES: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def _position_table(model: torch.nn.Module) -> tuple:
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    limits = {v for n in ("max_position_embeddings", "n_positions", "max_target_positions")
              if isinstance(v := getattr(config, n, None), int) and v > 0}
    tokens = {id(m) for m in (getattr(model, "get_input_embeddings", lambda: None)(),
                              getattr(model, "get_output_embeddings", lambda: None)())
              if m is not None}
    tables = [(limit, name) for name, module in model.named_modules()
              if isinstance(module, torch.nn.Embedding) and id(module) not in tokens
              for limit in limits if 0 <= module.num_embeddings - limit <= 2]
    return min(tables) if tables else ()


def sequence_head(input_ids: torch.Tensor | None, embeds: torch.Tensor | None) -> torch.Tensor:
    """What ``generate``'s sequences start with: the token ids given, or for a prompt of
    embeddings alone none, as (batch, 0) ids."""
    if input_ids is not None or embeds is None:
        return input_ids
    return torch.empty((embeds.shape[0], 0), dtype=torch.long, device=embeds.device)


def _given_processors(value: Any) -> dict[str, Any]:
    """``logits_processor`` objects as the options they stand for, where grape reproduces
    their kind. ``generate`` puts a given object in place of the one of its kind it would make,
    else after the processors it makes, before sampling's warpers; for the kinds taken here
    both places are the same, the end of what it makes (and each only sets scores to -inf, so
    their order among themselves does not matter). A model's own generate passes Whisper's
    token suppression this way (``grape.torch.own_generate``).

    Raises
    ------
    NotGraphable
        A processor of another kind (named), or two suppressing at different lengths.
    """
    if value is None:
        return {}
    if not isinstance(value, list | tuple):
        raise GrapeError(f"expected logits_processor to be a list of logits processors, found "
                         f"{type(value).__name__}")
    found: dict[str, Any] = {}
    for position, processor in enumerate(value):
        if type(processor) is WhisperNoSpeechDetection:
            # It reads the scores as it finds them only where its decoder prompt is one token
            # long (else it runs the model itself): first, it finds them unprocessed.
            if position and processor.start_of_trans_offset <= 1:
                raise NotGraphable("a WhisperNoSpeechDetection after other logits processors "
                                   "(it reads the scores they leave)")
            found["no_speech"] = processor
            continue
        if type(processor) is SuppressTokensLogitsProcessor:
            tokens = _read(processor.suppress_tokens, found)
            found["suppressed"] = tuple(dict.fromkeys(found.get("suppressed", ()) + tokens))
        elif type(processor) is SuppressTokensAtBeginLogitsProcessor:
            at = int(processor.begin_index)
            if found.get("begin_at", at) != at:
                raise NotGraphable(f"tokens suppressed at two lengths ({found['begin_at']} and "
                                   f"{at}) by SuppressTokensAtBeginLogitsProcessor objects")
            tokens = _read(processor.begin_suppress_tokens, found)
            found["begin_suppressed"] = tuple(dict.fromkeys(found.get("begin_suppressed", ())
                                                            + tokens))
            found["begin_at"] = at
        elif type(processor) is WhisperTimeStampLogitsProcessor:
            found["timestamps"] = _timestamps(processor)
        else:
            raise NotGraphable(f"a logits processor grape does not reproduce: "
                               f"{type(processor).__name__}")
        if "timestamps" in found and type(processor) is not WhisperTimeStampLogitsProcessor:
            # grape applies it after the suppression (where Whisper puts it), which it does
            # not commute with: its log-softmax sees the suppressed tokens' -inf
            raise NotGraphable(f"a {type(processor).__name__} after a "
                               f"WhisperTimeStampLogitsProcessor")
    return found


def _timestamps(processor: Any) -> tuple[int, int, int, int | None, bool]:
    """A WhisperTimeStampLogitsProcessor's settings (Options.timestamps)."""
    eos = processor.eos_token_id
    values = (processor.begin_index, processor.no_timestamps_token_id, eos,
              processor.max_initial_timestamp_index)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values[:3]) or not (
            values[3] is None or isinstance(values[3], int)):
        raise NotGraphable(f"a WhisperTimeStampLogitsProcessor with settings grape does not "
                           f"take (begin index, no-timestamps token, EOS, first timestamp "
                           f"limit: {values})")
    if processor.timestamp_begin != processor.no_timestamps_token_id + 1:
        raise NotGraphable("a WhisperTimeStampLogitsProcessor whose timestamps do not follow "
                           "its no-timestamps token")
    return (*values, bool(processor._detect_timestamp_from_logprob))


def _read(tokens: torch.Tensor, found: dict[str, Any]) -> tuple[int, ...]:
    """A processor's token ids, read back (counted in ``found["read_backs"]`` from a GPU)."""
    if tokens.device.type != "cpu":
        found["read_backs"] = found.get("read_backs", 0) + 1
    return tuple(int(t) for t in tokens.reshape(-1).tolist())


def _given_criteria(value: Any) -> None:
    """``stopping_criteria`` objects: none is reproduced (an empty list is nothing)."""
    if value is None:
        return
    if not isinstance(value, list | tuple):
        raise GrapeError(f"expected stopping_criteria to be a list of stopping criteria, found "
                         f"{type(value).__name__}")
    if value:
        raise NotGraphable(f"stopping criteria grape does not reproduce: "
                           f"{', '.join(type(c).__name__ for c in value)}")


def _cutoffs(config: GenerationConfig) -> tuple[tuple[str, float], ...]:
    """The cutoffs of ``_CUTOFFS`` that generate applies for ``config`` (sampling), in order."""
    found = []
    for name, _, applies in _CUTOFFS:
        value = getattr(config, name, None)
        if value is not None and applies(value := _real(value, name)):
            found.append((name, value))
    return tuple(found)


def sampling_warpers(options: Options, device: torch.device) -> list[Any]:
    """generate's warpers for sampling with ``options``, in its order: temperature, top-k,
    top-p, then the cutoffs (``Options.cutoffs``); each keeps at least one token, as generate's
    do without beams. None for the other strategies. The temperature and top-p are
    ``grape.torch.warpers``' (generate's bit for bit, their values on the device, set for each
    call): the temperature always (1 changes no bit), top-p where it is below 1."""
    if options.strategy != "sample":
        return []
    warpers: list[Any] = [DeviceTemperature(options.temperature, device)]
    if options.top_k:
        warpers.append(TopKLogitsWarper(options.top_k))
    if options.top_p < 1.0:
        warpers.append(DeviceTopP(options.top_p, device))
    return warpers + _cutoff_warpers(options, device)


def _cutoff_warpers(options: Options, device: torch.device) -> list[Any]:
    """generate's warpers for ``Options.cutoffs``, in order."""
    made = {name: warper for name, warper, _ in _CUTOFFS}
    return [made[name](value, device) for name, value in options.cutoffs]


def _check_sampling(options: Options) -> None:
    """generate's warpers, made and dropped: they check their own values."""
    if options.strategy != "sample":
        return
    TemperatureLogitsWarper(options.temperature)
    TopPLogitsWarper(options.top_p)
    if options.top_k:
        TopKLogitsWarper(options.top_k)
    _cutoff_warpers(options, torch.device("cpu"))


def source_of(model: torch.nn.Module) -> str:
    """The input ``generate`` takes its prompt (an encoder-decoder model's source) as: token
    ids, or a speech model's features or samples (``model.main_input_name``)."""
    name = getattr(model, "main_input_name", "input_ids")
    return name if isinstance(name, str) else "input_ids"


def _sequence_bias(value: Any) -> tuple[tuple[tuple[int, ...], float], ...]:
    """sequence_bias as generate's processor reads it (a list of [token ids, bias], or a dict
    of token-id tuples to biases), checked by that processor."""
    if value is None:
        return ()
    try:
        items = SequenceBiasLogitsProcessor(value).sequence_bias.items()
    except (ValueError, TypeError) as e:
        raise GrapeError(f"expected sequence_bias as generate takes it, found: "
                         f"{str(e).splitlines()[0]}") from None
    return tuple((tuple(int(t) for t in ids), float(bias)) for ids, bias in items)


def _decay(value: Any) -> tuple[int, float] | None:
    """exponential_decay_length_penalty as (start index, decay factor), checked."""
    if value is None:
        return None
    if not (isinstance(value, list | tuple) and len(value) == 2):
        raise GrapeError(f"expected exponential_decay_length_penalty to be (start index, decay "
                         f"factor), found {value!r}")
    return (_integer(value[0], "exponential_decay_length_penalty's start index", 0),
            _real(value[1], "exponential_decay_length_penalty's decay factor"))


def _stop_strings(value: Any, tokenizer: Any) -> tuple[str, ...]:
    """generate's stop strings (one string or several), checked as it checks them: they need
    the call's tokenizer."""
    if value is None:
        return ()
    strings = [value] if isinstance(value, str) else value
    if not (isinstance(strings, list | tuple) and strings
            and all(isinstance(s, str) and s for s in strings)):
        raise GrapeError(f"expected stop_strings to be a non-empty string or a list of them, "
                         f"found {value!r}")
    if tokenizer is None:
        raise GrapeError("expected a tokenizer (generate's tokenizer=...) with stop_strings, "
                         "found none")
    return tuple(strings)


def _bad_words(value: Any, eos: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The words generate's NoBadWordsLogitsProcessor bans: ``bad_words_ids`` less the words
    that are an EOS token alone (which it drops too), each once."""
    if value is None:
        return ()
    if not (isinstance(value, list | tuple) and value
            and all(isinstance(w, list | tuple) and w for w in value)):
        raise GrapeError(f"expected bad_words_ids to be a non-empty list of non-empty lists of "
                         f"token ids, found {value!r}")
    words = [_ids(list(w), "bad_words_ids") for w in value]
    return tuple(dict.fromkeys(w for w in words if not (len(w) == 1 and w[0] in eos)))


def _attention_mask(input_ids: torch.Tensor, given: torch.Tensor | None,
                    pad: tuple[int, ...], eos: tuple[int, ...]) -> torch.Tensor | None:
    """The mask generate uses: the caller's, else one inferred from pad tokens in the prompt
    where the pad token is not an EOS token (one read-back, at the call), else all ones
    (None)."""
    if given is not None:
        return given if given.dtype == torch.long else given.long()
    if pad and pad[0] not in eos and bool((input_ids == pad[0]).any()):
        return input_ids.ne(pad[0]).long()
    return None
