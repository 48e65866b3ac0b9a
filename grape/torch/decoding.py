"""Generation as a fixed-shape step over a Hugging Face causal LM, for any strategy.

A :class:`Decoder` keeps every tensor a decoding loop touches at a fixed shape and address: a
``StaticCache`` sized to prompt plus new tokens, the full-length attention mask, the next
input ids and positions, the tokens made so far and the loop's own state. ``prefill`` runs the
prompt eagerly (its shape is the prompt's, and it reads the caller's tensors where they lie)
and makes the first token; ``step`` makes the next with GPU work alone, so that it can be the
body of a device loop (``grape.torch.loop.DeviceLoop``); ``running`` is a GPU boolean.

The model is called the way ``model.generate`` calls it with a static cache: through the
model's own ``prepare_inputs_for_generation`` (which builds its 4D mask), with the positions
``generate`` computes from the attention mask. Hugging Face designed that path for CUDA graphs
(``torch.compile``'s), so models whose static-cache generation works capture here too.

Strategies: :class:`TokenDecoder` picks one token per sequence (greedy, or sampling with
temperature, top-k and top-p from a seeded random stream drawn before the loop);
``grape.torch.beam.BeamDecoder`` runs beam search.

Encoder-decoder models (T5, BART, Marian, Pegasus: ``config.is_encoder_decoder``) run the same
way, as ``generate`` runs them with a static cache: ``prefill`` runs the encoder over the
prompt (the source) and the decoder over its start token, which writes every cross-attention
layer's keys and values once; ``step`` runs the decoder alone, over a self-attention cache
sized to the new tokens, reading the cross-attention cache and the source's mask at fixed
addresses. Their outputs start with the decoder's start token, not the prompt.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
import transformers.cache_utils as hf_cache
from transformers import EncoderDecoderCache, StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer
from transformers.generation.logits_process import (
    EncoderRepetitionPenaltyLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    SequenceBiasLogitsProcessor,
)
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import (
    GenerateDecoderOnlyOutput,
    GenerateEncoderDecoderOutput,
    GenerationMixin,
)

from grape.errors import GrapeError
from grape.torch.cache_length import ranged_arange
from grape.torch.control import capturing
from grape.torch.decode_mask import running_mask
from grape.torch.deferred_checks import DeferredChecks
from grape.torch.exact import Lengths, TokenMajorHybridLayer, TokenMajorLayer, active
from grape.torch.hfmasks import prompt_padding_on_device
from grape.torch.masked_writes import masked_writes
from grape.torch.model_code import COMPILE_ERRORS
from grape.torch.options import NotGraphable, Options, sampling_warpers
from grape.torch.parallel import group_of
from grape.torch.sampling import CandidateSampler, CandidatesOverflowed
from grape.torch.sdpa_mask import convert_once
from grape.torch.static_layers import (
    CountedIndexedLayer,
    CountedLayer,
    CountedLinearSlidingLayer,
    CountedSlidingLayer,
    StaticIndexedLayer,
    Tokens,
)
from grape.torch.warpers import DeviceTemperature, DeviceTopP

__all__ = ["Decoder", "ExactRefused", "NotLeftPadded", "TokenDecoder", "static_cache"]

_LOG = logging.getLogger("grape")

# Whether generate leaves a prompt's left padding out of its repetition penalty (transformers
# 5.2x passes the padding's length to RepetitionPenaltyLogitsProcessor; 5.17 penalises the pad
# tokens too). Read from generate's own code, where the choice is made.
PENALTY_SKIPS_PADDING = "prompt_ignore_length" in inspect.getsource(
    GenerationMixin._get_logits_processor)

# What check_written_only writes where the cache holds nothing yet: large enough that any
# weight on it moves the logits far past kernels' noise, small enough for fp16.
POISON = 1000.0

# Cache layers that keep a recurrent state (Mamba's convolution and SSM states, linear
# attention's): fixed-size tensors at fixed addresses, updated in place, which a graph holds as
# it holds a static cache's keys and values. Their one host-side flag (has the prompt run?)
# turns once, in the prompt, and is the same at every step. transformers versions without
# them have none (the empty tuple matches nothing).
_RECURRENT: Any = getattr(hf_cache, "LinearAttentionCacheLayerMixin", ())
# A recurrent state beside a static attention cache, in one layer (hybrid models), and beside
# a sliding window (Inkling, transformers 5.25).
_HYBRID: Any = getattr(hf_cache, "LinearAttentionAndStaticFullAttentionLayer", ())
_HYBRID_SLIDING: Any = getattr(hf_cache, "LinearAttentionAndStaticSlidingWindowAttentionLayer",
                               ())
# A layer that holds nothing (a layer without attention, or one reading another's cache):
# nothing to keep in place, no position on the host. transformers 5.2x makes them.
_EMPTY: Any = getattr(hf_cache, "DummyLayer", ())


class ExactRefused(NotGraphable):
    """Exact lengths cannot serve this generation; the loop over the whole cache can."""


class CompileRefused(NotGraphable):
    """A compiled step cannot serve this generation; the model's own kernels can."""


class NotLeftPadded(ExactRefused):
    """Exact lengths were asked of a prompt whose mask has a zero after a one."""


def static_cache(model: torch.nn.Module, max_len: int, count: torch.Tensor,
                 layer: type[CountedLayer] = CountedLayer,
                 tokens: Tokens | None = None, ranged: bool = True) -> StaticCache:
    """The static cache ``generate`` would make, with every attention layer writing at
    ``count``, the caller's device count of tokens in the cache, which the caller advances
    after each forward (``grape.torch.static_layers``). A sliding-window layer whose window
    holds the whole generation is a plain static layer (the same attention), since the sliding
    layer counts its length on the host, which a captured step would freeze at its
    capture-time value. Layers with a recurrent state (``_RECURRENT``; beside a static
    attention cache in hybrid models), and layers that hold nothing, are kept as made.
    ``layer``: the static layer class (``grape.torch.exact.TokenMajorLayer`` for exact-length
    attention; a hybrid layer's keys then are ``grape.torch.exact.TokenMajorHybridLayer``'s,
    and windows shorter than the generation stay counted windows: their attention reads their
    own keys). Recurrent layers, and
    static ones that also hold a recurrent state, count their own tokens; they advance their
    count once per forward as well. ``tokens``: what each forward is given, which the
    attention layers hold their writes to (``grape.torch.static_layers.Tokens``). ``ranged``:
    the attention layers' length a ``grape.torch.cache_length.CacheLength`` (not for a
    compiled step).

    Raises
    ------
    ExactRefused
        Exact lengths were asked (``layer``) of a model none of whose layers holds attention
        over the whole generation, or whose indexer keeps keys at a length of its own.
    NotGraphable
        A layer that keeps host-side state the window cannot excuse, or a kind of layer grape
        does not know to hold in a graph.
    """
    try:
        cache = StaticCache(config=model.config, max_cache_len=max_len)
    except KeyError as e:
        # transformers' static cache makes its layers from the config's layer types, and
        # a type it has no static layer for (DeepSeek-V4's compressed attention) is a
        # KeyError there: generate itself runs such a model on its dynamic cache alone.
        kind = e.args[0] if e.args else None
        if kind in hf_cache.STATIC_LAYER_TYPE_MAPPING:
            raise
        raise NotGraphable(f"{type(model).__name__}'s config lists {kind!r} layers, which "
                           f"transformers' static cache has no layer for (it holds "
                           f"{', '.join(hf_cache.STATIC_LAYER_TYPE_MAPPING)})") from None
    for i, made in enumerate(cache.layers):
        kind = type(made)
        if kind in (StaticLayer, StaticSlidingWindowLayer) and made.max_cache_len >= max_len:
            cache.layers[i] = layer(max_cache_len=max_len, count=count, tokens=tokens)
            cache.layers[i].ranged = ranged
            # transformers finds the layer whose sizes a sliding window's mask takes by this
            # flag, else takes layer 0, which in a hybrid model can be a recurrent layer that
            # never counts a token (RecurrentGemma under transformers 5.25: a mask over one key).
            cache.layers[i].is_sliding = bool(getattr(made, "is_sliding", False))
            continue
        if isinstance(made, _EMPTY):
            continue
        if kind is StaticIndexedLayer and made.max_cache_len >= max_len:
            if layer is not CountedLayer:
                raise ExactRefused(f"exact lengths count attention caches alone, and cache "
                                   f"layer {i} keeps an indexer's keys ({kind.__name__}) at "
                                   f"a length of its own")
            cache.layers[i] = CountedIndexedLayer(max_cache_len=max_len, count=count,
                                                  tokens=tokens)
            cache.layers[i].ranged = ranged
            continue
        if kind is _HYBRID_SLIDING and made.max_cache_len >= max_len:
            # Its window holds the whole generation: a full-attention hybrid layer (_hybrid).
            cache.layers[i] = _hybrid(layer, max_len, count, tokens, ranged, made)
            cache.layers[i].is_sliding = True  # (which layer the masks' sizes come from)
            continue
        if kind in (StaticSlidingWindowLayer, _HYBRID_SLIDING):
            # A window shorter than the generation: its roll and its mask's offset decided on
            # the device (grape.torch.static_layers.CountedSlidingLayer), a recurrent state
            # beside it where the layer keeps one. Under exact lengths the window stays as it
            # is: its attention reads a window's keys, never the whole cache, and runs SDPA
            # over its own mask (grape.torch.exact) while the full layers run exactly.
            if not ranged:
                raise CompileRefused(f"cache layer {i} is a sliding window of "
                                     f"{made.max_cache_len} tokens, shorter than the "
                                     f"generation's {max_len}, whose mask offset a compiled "
                                     f"step would read back")
            if kind is _HYBRID_SLIDING:
                cache.layers[i] = CountedLinearSlidingLayer(
                    max_cache_len=max_len, window=made.max_cache_len, count=count,
                    tokens=tokens, number_of_states=made.number_of_states)
            else:
                cache.layers[i] = CountedSlidingLayer(max_cache_len=max_len,
                                                      window=made.max_cache_len, count=count,
                                                      tokens=tokens)
            continue
        if isinstance(made, _RECURRENT) and (not isinstance(made, StaticLayer)
                                             or kind is _HYBRID):
            # A state of fixed size, whatever the length: the model's own code keeps it (exact
            # lengths too), with attention keys beside it in hybrid layers.
            if kind is _HYBRID and layer is not CountedLayer:
                cache.layers[i] = _hybrid(layer, max_len, count, tokens, ranged, made)
            continue
        if kind is StaticSlidingWindowLayer or isinstance(made, _RECURRENT):
            raise NotGraphable(f"cache layer {i} is a {kind.__name__} over "
                               f"{getattr(made, 'max_cache_len', '?')} tokens, which keeps its "
                               f"position on the host, for a generation of {max_len} tokens")
        raise NotGraphable(f"cache layer {i} is a {kind.__name__}, a kind of cache layer "
                           f"grape does not hold in a graph (it knows static attention layers "
                           f"and recurrent states)")
    if layer is not CountedLayer and not any(isinstance(made, layer) for made in cache.layers):
        raise ExactRefused(f"exact lengths serve attention over the whole generation, and no "
                           f"cache layer of {type(model).__name__} holds it (its layers: "
                           f"{', '.join(sorted({type(made).__name__ for made in cache.layers}))})")
    return cache


def _hybrid(layer: type[CountedLayer], max_len: int, count: torch.Tensor, tokens: Any,
            ranged: Any, made: Any) -> Any:
    """A hybrid layer (a recurrent state and attention keys) for a generation of ``max_len``
    tokens: as transformers makes it, its attention side counting on the device; or, for
    exact lengths, with its keys laid out by tokens and written at ``count``."""
    if layer is CountedLayer:
        return _HYBRID(max_cache_len=max_len, number_of_states=made.number_of_states)
    hybrid = TokenMajorHybridLayer(max_cache_len=max_len, count=count, tokens=tokens,
                                   number_of_states=made.number_of_states)
    hybrid.ranged = ranged
    return hybrid


def _written(layer: Any) -> bool:
    """Whether the model has written anything into ``layer``."""
    return bool(getattr(layer, "is_initialized", False)
                or any(getattr(layer, "is_conv_states_initialized", {}).values())
                or any(getattr(layer, "is_recurrent_states_initialized", {}).values()))


def _accepts(model: torch.nn.Module, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


class Decoder:
    """Fixed-shape state shared by every strategy; subclasses choose tokens (``_emit``)."""

    # Whether compile=True compiles _moved_on too: a subclass whose _record traces as one
    # graph, and whose _choose keeps what needs eager kernels' bits (the choice itself); and
    # whether its _record divides floats (compiled only where they round as eager's).
    records_compiled = False
    records_divide = False

    def __init__(self, model: torch.nn.Module, rows: int, prompt_len: int,
                 options: Options, step_model: Any = None, exact: bool = False) -> None:
        self.model, self.options = model, options
        # What ``step`` calls: the model, or its compiled form (the prompt, at its own
        # shape, always runs the model itself).
        self.step_model = model if step_model is None else step_model
        self._unprepared = False  # compiling the step's input preparation failed
        # _moved_on compiled (compile=True): None until the first step asks, False where it
        # is not compiled (a subclass that does not ask for it, or compiling it failed)
        self._compiled_moved_on: Any = None
        self.rows, self.prompt_len = rows, prompt_len
        # An encoder-decoder model: the prompt is the encoder's source, and the decoder's own
        # prompt is its start token (Options.start).
        self.seq2seq = options.start is not None
        if self.seq2seq and exact:
            raise ExactRefused("exact lengths count the decoder's own cache, and an "
                               "encoder-decoder model's cross-attention reads the source's")
        if exact and not getattr(model, "_supports_sdpa", False):
            # The calls the varlen kernel cannot take run SDPA, and a model that does not
            # support it attends by its own eager code for a reason (attention sinks: SDPA
            # would run without them, and the tokens would part unannounced).
            raise ExactRefused(f"exact lengths run SDPA where their kernel cannot serve a call, "
                               f"and {type(model).__name__} does not support SDPA (it attends "
                               f"by {model.config._attn_implementation!r})")
        # The tokens before the new ones in the decoder's own sequence: the prompt, or an
        # encoder-decoder's decoder prompt (its start token, or the caller's decoder_input_ids).
        # (A prompt given as inputs_embeds: the token ids given beside them, or none.)
        head = self.head_len = (options.decoder_prompt_len if self.seq2seq else prompt_len
                                if options.embedded_head is None else options.embedded_head)
        self.max_len = options.cache_tokens(head if self.seq2seq else prompt_len)
        device = next(model.parameters()).device
        # Exact lengths: attention over each row's valid keys, counted on the device.
        self.lengths = Lengths(rows, self.max_len, device) if exact else None
        self._exact_learned = False  # (see _logits)
        # Tokens in the cache, on the device: every attention layer writes at this count (its
        # length, for transformers), and the decoder advances it once per forward; a recurrent
        # layer counts its own, in step with it.
        self.written = torch.zeros((1,), dtype=torch.long, device=device)
        self.given = Tokens()  # given to each forward: the layers write that many
        self.checks = DeferredChecks(device)  # the model's checks, read with the result
        self.cache = static_cache(model, self.max_len, self.written,
                                  TokenMajorLayer if exact else CountedLayer, self.given,
                                  ranged=step_model is None)
        self.layers = self.cache.layers  # the decoder's own, which follow beams
        if self.lengths is not None:
            self.lengths.layers = sum(isinstance(made, TokenMajorLayer) for made in self.layers)
        if self.seq2seq:
            # Cross-attention keys and values, written once by the prompt's forward (which
            # turns transformers' host-side is_updated flags, the same at every step after):
            # made by the first prompt, as long as the encoder's output (a speech encoder's is
            # shorter than its input), and self.cache then holds both (_prefill_source).
            self.cross: StaticCache | None = None
            # the source's mask, as its first prompt gives it (over tokens, frames or samples)
            self.source_mask: torch.Tensor | None = None
            self.encoded: torch.Tensor | None = None  # the encoder's output, made by the prompt
            self.encoder_outputs: Any = None  # and the rest it returned, as the decoder takes it
        self.mask = torch.zeros((rows, self.max_len), dtype=torch.long, device=device)
        self.next_ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.position = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.count = torch.zeros((1,), dtype=torch.long, device=device)  # tokens made so far
        self.running = torch.zeros((), dtype=torch.bool, device=device)
        self.eos = torch.tensor(options.eos or [-1], dtype=torch.long, device=device)
        # generate's ForcedBOSTokenLogitsProcessor (the first token, where the decoder's prompt
        # is one token long) and ForcedEOSTokenLogitsProcessor (the last token allowed), in its
        # order: (token ids on the device, the count of tokens made where they are forced).
        self.forced: list[tuple[torch.Tensor, int]] = [
            (torch.tensor(ids, dtype=torch.long, device=device), at) for ids, at in (
                ((options.forced_bos,) if options.forced_bos is not None and head == 1
                 else (), 0),
                (options.forced_eos, options.max_new_tokens - 1)) if ids]
        # (encoder-decoder models: generate gives their decoders no positions)
        self.uses_positions = _accepts(model, "position_ids") and not self.seq2seq
        # transformers 5.2x renames past_key_values to cache (the old name warns until 5.40);
        # Mamba-like models take theirs as cache_params (generate tells them by class name).
        prepare = inspect.signature(model.prepare_inputs_for_generation).parameters
        self.cache_name = ("cache" if "cache" in prepare else
                           "cache_params" if _accepts(model, "cache_params")
                           and not _accepts(model, "past_key_values") else "past_key_values")
        self.uses_mask = _accepts(model, "attention_mask")
        # generate has the model make the last position's logits alone, where it can
        # (logits_to_keep=1): the output layer's product then has generate's shape, and its bits.
        self.keeps_last_logits = bool(getattr(model, "_supports_logits_to_keep", bool)())
        # Split over ranks (grape.torch.parallel): the loop condition is agreed every step.
        self.group = group_of(model)
        self._agreed = (torch.zeros(1, dtype=torch.int32, device=device)
                        if self.group is not None else None)
        # What the return dict keeps, per token: (Options.room, rows, vocabulary) each,
        # made at the first token (the logits' width is the model's output's, which can be
        # wider than its config's vocabulary), written on the device at the token's count.
        self.kept: dict[str, torch.Tensor | None] = dict.fromkeys(options.kept)
        # generate's logits processors (``_process``): the tokens before the new ones, which
        # the processors count lengths from (a decoder's start token, or the prompt), the
        # tokens each row has seen (repetition_penalty; made with the first logits, whose width
        # can exceed the config's vocabulary), and masks over the vocabulary by name.
        self.min_new = max(options.min_new_tokens, options.min_length - head)
        # no_repeat_ngram_size and banned words of several tokens: every row's tokens so far,
        # the prompt's and the new ones.
        self.history = (torch.zeros((rows, head + options.room), dtype=torch.long, device=device)
                        if options.no_repeat_ngram or options.bad_sequences
                        or options.source_ngram or options.stop_strings or options.timestamps
                        or any(len(ids) > 1 for ids, _ in options.sequence_bias) else None)
        # encoder_no_repeat_ngram_size: the source's tokens, per row (a copy: read every step).
        self.source_ids = (torch.zeros((rows, prompt_len), dtype=torch.long, device=device)
                           if options.source_ngram else None)
        # Banned words of several tokens by length: (their prefixes, their last tokens).
        by_length: dict[int, list[tuple[int, ...]]] = {}
        for word in options.bad_sequences:
            by_length.setdefault(len(word), []).append(word)
        self.bad_sequences = {
            k: (torch.tensor([w[:-1] for w in words], dtype=torch.long, device=device),
                torch.tensor([w[-1] for w in words], dtype=torch.long, device=device))
            for k, words in by_length.items()}
        # The count at which SuppressTokensAtBegin acts: generate's begin index (the prompt's
        # length, one more after a one-token prompt whose first token is forced, or the length
        # a processor object named) less the prompt; never, where that lies before the prompt.
        self.begin = (int(head == 1 and options.forced_bos is not None)
                      if options.begin_at is None else options.begin_at - head)
        self.seen: torch.Tensor | None = None
        self._masks: dict[str, torch.Tensor] = {}
        self._bias: SequenceBiasLogitsProcessor | None = None  # made with the first logits
        self._source_penalty: EncoderRepetitionPenaltyLogitsProcessor | None = None
        self._longer: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        self._no_bias: torch.Tensor | None = None
        self.stops = _stops(options, device)  # stop_strings: generate's StopStringCriteria
        # exponential_decay_length_penalty's factor less one, per count of tokens made.
        self.decay = None if options.decay is None else torch.tensor(
            [float(options.decay[1] ** (c - options.decay[0]) - 1) if c > options.decay[0]
             else 0.0 for c in range(options.room + 1)], dtype=torch.float32, device=device)
        # check_written_only: what the cache's layers hold before the prompt writes them, and
        # the logits each forward made, while it runs.
        self._poison: float | None = None
        self._audit: list[torch.Tensor] | None = None
        # Options.model_inputs as the last prompt got them, until the first step has checked
        # that it reads none of them (_check_prompt_only); once checked, never held again (the
        # caller's tensors are not kept past their call).
        self._prompt_only: dict[str, torch.Tensor] | None = None
        self._prompt_only_checked = False
        # Model arguments with a value per token, which generate extends for each new token
        # (_update_model_kwargs_for_generation): token_type_ids by its last column,
        # mm_token_type_ids by zeros. A step's column of each, (rows, 1), set by the prompt.
        self._per_token: dict[str, torch.Tensor] = {}

    # --- the model, called as generate calls it ---------------------------------------------

    def _logits(self, ids: torch.Tensor, mask: torch.Tensor, position: torch.Tensor | None,
                first: bool, embeds: torch.Tensor | None = None,
                model_inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        kwargs: dict[str, Any] = {self.cache_name: self.cache, "use_cache": True}
        if embeds is not None:  # the prompt as inputs_embeds: generate's first iteration
            kwargs["inputs_embeds"] = embeds
        if model_inputs:
            kwargs.update(model_inputs)
        # What the attention layers may write (Tokens), and what the cache holds before: the
        # prompt is written from position 0; every step after it, past the prompt (a
        # decoder-only model's) or the decoder's prompt (an encoder-decoder's), within the cache.
        past = (0, 0) if first else (self.head_len if self.seq2seq else self.prompt_len,
                                     self.max_len - 1)
        self.given.begin((ids if embeds is None else embeds).shape[1], past)
        if self.keeps_last_logits:
            kwargs["logits_to_keep"] = 1
        if self.seq2seq:
            kwargs.update(encoder_outputs=self.encoder_outputs, attention_mask=self.source_mask,
                          decoder_attention_mask=mask)
        elif self.uses_mask:
            kwargs["attention_mask"] = mask
        if self.uses_positions and position is not None:
            kwargs["position_ids"] = position
        if not first:
            kwargs.update(self._per_token)  # (generate's own extension of them, at a step)
        if not first and self._prompt_only is not None:
            self._check_prompt_only(ids, kwargs)
        logits = None
        if first or self.lengths is None:
            # (transformers may build the step's 4D mask while preparing the inputs)
            with self._step_masks(first):
                logits = None if first else self._prepared_step(ids, kwargs, position)
                if logits is None:
                    inputs = self.model.prepare_inputs_for_generation(
                        ids, is_first_iteration=first, **kwargs)
                    self._decoder_positions(inputs, position)
                    out = (self.model if first else self.step_model)(**inputs, return_dict=True)
        else:
            # Once a step has run every layer's attention exactly (Lengths.mask_unread), the
            # inputs too are prepared with exact lengths on, so that the 4D mask no exact call
            # reads is not built (grape.torch.exact.mask); the model then gets the 2D mask, and
            # its own mask code leaves it unbuilt the same way. Until then, and for models
            # that attend by their own code, the inputs are prepared as generate prepares them.
            unread = self.lengths.mask_unread
            # A compiled step's first exact call runs the model's own forward: it learns
            # whether the mask is read, so that the step compiles once, for the steps after
            # it, not a second time for them (Dynamo guards on the mask given).
            forward = self.step_model if unread or self._exact_learned else self.model
            self._exact_learned = True
            if not unread:
                inputs = self.model.prepare_inputs_for_generation(ids, is_first_iteration=first,
                                                                  **kwargs)
            with active(self.lengths, self.model), self._step_masks(first):
                if unread:
                    inputs = self.model.prepare_inputs_for_generation(
                        ids, is_first_iteration=first, **kwargs)
                    if self.uses_mask and inputs.get("attention_mask") is None:
                        inputs["attention_mask"] = mask
                self._decoder_positions(inputs, position)
                out = forward(**inputs, return_dict=True)
        if logits is None:
            logits = out.logits[:, -1, :].to(dtype=torch.float32)
        if self._audit is not None:
            self._audit.append(logits.clone())
        return logits

    def _prepared_step(self, ids: torch.Tensor, kwargs: dict[str, Any],
                       position: torch.Tensor | None) -> torch.Tensor | None:
        """A step's float32 logits from a step model that compiles the input preparation with
        the forward (``grape.torch.compiled_step``); None where the step model does not, or
        where compiling the preparation failed once (the forward is then compiled alone, and
        said so on the ``grape`` logger)."""
        if self.step_model is self.model or self._unprepared:
            return None
        prepared = getattr(self.step_model, "prepared", None)
        if prepared is None:
            return None
        try:
            return prepared(ids, dict(kwargs, is_first_iteration=False),
                            position if self.seq2seq else None)
        except COMPILE_ERRORS as e:
            self._unprepared = True
            _LOG.info("grape.generate(compile=True): the step's input preparation did not "
                      "compile (%s); its forward is compiled alone",
                      str(e).splitlines()[0] if str(e) else type(e).__name__)
            return None

    def _extend_per_token(self, model_inputs: dict[str, torch.Tensor]) -> None:
        """The new tokens' column of the model arguments that have one per token (see
        ``_per_token``), from the prompt's, as generate extends them."""
        for name, fill in (("token_type_ids", "last"), ("mm_token_type_ids", "zeros")):
            given = model_inputs.get(name)
            if given is None or given.ndim != 2:
                continue
            column = self._per_token.get(name)
            if column is None or column.shape != (given.shape[0], 1):
                column = self._per_token[name] = given.new_zeros((given.shape[0], 1))
            if fill == "last":
                column.copy_(given[:, -1:])
            else:
                column.zero_()

    def _check_prompt_only(self, ids: torch.Tensor, kwargs: dict[str, Any]) -> None:
        """Once, eagerly, before any step is captured: the model's input preparation for a
        step takes nothing more from the call's model arguments (``Options.model_inputs``:
        LLaVA's ``pixel_values`` go to the prompt alone), so the steps run without them and
        read none of the caller's tensors.

        Raises
        ------
        NotGraphable
            A step's inputs would be made from them (the arguments named).
        """
        given, self._prompt_only = self._prompt_only, None
        self._prompt_only_checked = True
        # (those with a value per token the step gets from grape, as generate extends them)
        given = {k: v for k, v in given.items() if k not in self._per_token}
        if not given:
            return

        def prepared(extra: dict[str, Any]) -> set[str]:
            inputs = self.model.prepare_inputs_for_generation(ids, is_first_iteration=False,
                                                              **kwargs, **extra)
            return {k for k, v in inputs.items() if v is not None}
        if read := sorted(prepared(given) - prepared({})):
            raise NotGraphable(f"{type(self.model).__name__}'s steps take {', '.join(read)} "
                               f"from the arguments {', '.join(given)}, which grape gives the "
                               f"prompt alone")

    def _decoder_positions(self, inputs: dict[str, Any], position: torch.Tensor | None) -> None:
        """Where the model's own input preparation made an encoder-decoder's
        ``decoder_position_ids`` from the decoder's mask (Whisper's does: each token's count of
        ones before it), the positions it would make from ``generate``'s mask, which grows by
        a column a token; from the loop's mask, as long as the whole cache, it would read the
        unwritten tail's zeros."""
        if self.seq2seq and position is not None and "decoder_position_ids" in inputs:
            inputs["decoder_position_ids"] = position

    @contextlib.contextmanager
    def _step_masks(self, first: bool) -> Iterator[None]:
        """Around a step on the model's own kernels: its boolean mask converted for SDPA once,
        not in every layer (grape.torch.sdpa_mask), and under capture its causal mask over the
        padded cache taken as the running 2D mask's view (grape.torch.decode_mask). Compiled,
        Inductor fuses both itself; the prompt runs once a generation."""
        with contextlib.ExitStack() as stack:
            if self.step_model is self.model and capturing():
                # Positions made by torch.arange over the cache's length, on the device. Only
                # under a capture: eagerly the read-back is allowed and gives the same values,
                # and the mode costs a Python call per torch function (2 to 4% of a GPT-2-small
                # prompt's eager forward on the CPU: benchmarks/ranged_arange_cost.py).
                stack.enter_context(ranged_arange())
            if capturing() and (first or self.step_model is self.model):
                # x[mask] = values made torch.where where the values do not depend on the
                # mask's count, which a GPU reads back first (grape.torch.masked_writes).
                stack.enter_context(masked_writes())
            # The model's checks of device values (a vision-language prompt's image tokens
            # against its features), on the device until the result is read (under a capture).
            stack.enter_context(self.checks.deferring())
            if not first and self.step_model is self.model:
                stack.enter_context(convert_once())
                if self.lengths is None:
                    stack.enter_context(running_mask(tuple(self.mask.shape)))
            yield

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                decoder_ids: torch.Tensor | None = None,
                decoder_mask: torch.Tensor | None = None,
                embeds: torch.Tensor | None = None,
                model_inputs: dict[str, torch.Tensor] | None = None) -> int:
        """Run the prompt (eagerly) and make the first token. ``input_ids`` and
        ``attention_mask`` (None: all ones) are (batch, prompt_len), read where they lie; the
        mask is copied into the loop's full-length one. An encoder-decoder model's
        ``decoder_ids`` and ``decoder_mask`` (None: its start token; a mask of ones) are its
        decoder's prompt, (batch, ``Options.decoder_prompt_len``), as ``generate`` prepares
        it (``grape.torch.options.decoder_prompt``). A decoder-only model's prompt may be
        ``embeds`` instead, (batch, prompt_len, hidden), with ``input_ids`` the
        ``Options.embedded_head`` token ids its sequences start with. ``model_inputs`` are the
        tensors ``Options.model_inputs`` names (read where they lie, by the prompt alone).
        Returns the bytes copied."""
        self.cache.reset()
        if self._poison is not None:
            for layer in self.layers:
                if isinstance(layer, CountedLayer) and layer.is_initialized:
                    layer.values.fill_(self._poison)  # the keys stay: the same weights
        self.written.zero_()  # the prompt is written from position 0
        self.checks.reset()
        self._reset()
        copied = self._keep_source(input_ids)
        if self.seq2seq:
            return copied + self._prefill_source(input_ids, attention_mask, decoder_ids,
                                                 decoder_mask)
        if decoder_ids is not None:
            raise GrapeError("expected decoder_ids only for an encoder-decoder model")
        if (embeds is None) != (self.options.embedded_head is None):
            kinds = ("token ids", "inputs_embeds")
            built, given = (kinds[::-1] if embeds is None else kinds)
            raise GrapeError(f"expected a prompt of {built} (the one this decoder was built "
                             f"for), found {given}")
        ones = attention_mask is None
        input_ids = self._rows(input_ids)
        embeds = None if embeds is None else self._rows(embeds)
        if sorted(model_inputs or ()) != sorted(self.options.model_inputs):
            raise GrapeError(f"expected the model arguments {list(self.options.model_inputs)} "
                             f"(those this decoder was built for), found "
                             f"{sorted(model_inputs or ())}")
        model_inputs = {k: self._rows(v) for k, v in (model_inputs or {}).items()}
        self._extend_per_token(model_inputs)
        mask = (torch.ones((self.rows, self.prompt_len), dtype=torch.long,
                           device=input_ids.device)
                if ones else self._rows(attention_mask))
        position = mask.cumsum(-1) - 1
        position.masked_fill_(mask == 0, 0)
        if self.lengths is not None:
            self.lengths.set_prompt(None if ones else mask, self.prompt_len)
        # Captured, the prompt attends as generate's would for this mask (its causal kernels
        # where it has no padding), chosen on the device at each launch (grape.torch.hfmasks).
        with prompt_padding_on_device():
            logits = self._logits(input_ids, mask, position, first=True, embeds=embeds,
                                  model_inputs=model_inputs)
        if model_inputs and not self._prompt_only_checked and not capturing():
            self._prompt_only = model_inputs  # checked by the next step
        if not any(_written(layer) for layer in self.cache.layers):
            # Each step would run without the tokens before it: a model with no cache, or one
            # that keeps its own kind of state where grape cannot see it.
            raise NotGraphable(f"{type(self.model).__name__} did not write the static cache "
                               f"it was given while reading the prompt (it keeps no cache, or "
                               f"keeps its state elsewhere)")
        self.written.fill_(self.prompt_len)
        self.mask.zero_()
        if ones:
            self.mask[:, :self.prompt_len].fill_(1)
        else:
            self.mask[:, :self.prompt_len].copy_(mask)
        self.position.copy_(position[:, -1:] + 1)
        self.count.zero_()
        # (with embeddings alone no token precedes the new ones; token ids given beside them
        # are as long as they, and so is the mask)
        self._remember(input_ids, logits.shape[-1], mask)
        self._emit(logits)
        self._agree()
        return copied + (0 if ones else mask.numel() * mask.element_size())

    def _keep_source(self, input_ids: torch.Tensor) -> int:
        """encoder_repetition_penalty: the prompt (an encoder-decoder's source) as the caller
        gave it, one row per prompt, copied where generate's processor reads it every step
        (made by the first prompt). Returns the bytes copied."""
        if self.options.source_penalty == 1.0:
            return 0
        if self._source_penalty is None:
            self._source_penalty = EncoderRepetitionPenaltyLogitsProcessor(
                self.options.source_penalty, torch.empty_like(input_ids))
        self._source_penalty.encoder_input_ids.copy_(input_ids)
        return input_ids.numel() * input_ids.element_size()

    def _prefill_source(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                        decoder_ids: torch.Tensor | None, decoder_mask: torch.Tensor | None
                        ) -> int:
        """``prefill`` for an encoder-decoder model: the encoder over the source, as generate
        runs it (once per prompt, its output then repeated per beam), kept at a fixed address
        with the source's mask; then the decoder over its prompt (its start token, or the
        caller's ids, read where they lie), whose mask is copied into the running one."""
        head = self.head_len
        if (decoder_ids is None and head != 1) or (
                decoder_ids is not None and decoder_ids.shape != (input_ids.shape[0], head)):
            found = "none" if decoder_ids is None else f"shape {tuple(decoder_ids.shape)}"
            raise GrapeError(f"expected a decoder prompt of shape ({input_ids.shape[0]}, {head}) "
                             f"(the one this decoder was built for), found {found}")
        ones = attention_mask is None
        mask = (torch.ones(input_ids.shape[:2], dtype=torch.long, device=input_ids.device)
                if ones else attention_mask)
        with prompt_padding_on_device(), self.checks.deferring(), (
                masked_writes() if capturing() else contextlib.nullcontext()):
            outputs = self.model.get_encoder()(**{self.options.source: input_ids},
                                               attention_mask=mask, return_dict=True)
        # As generate expands them per beam: every tensor the encoder returned (some decoders
        # read more than its states: a mixture of experts' router logits).
        for name, value in outputs.items():
            if isinstance(value, torch.Tensor):
                outputs[name] = self._rows(value)
        encoded = outputs.last_hidden_state
        if self.encoded is None or self.encoded.shape != encoded.shape:
            self.encoded = torch.empty_like(encoded)
        if self.cross is None:
            cross = StaticCache(config=self.model.config, max_cache_len=encoded.shape[1])
            for i, layer in enumerate(cross.layers):
                if (isinstance(layer, StaticSlidingWindowLayer)
                        and layer.max_cache_len < encoded.shape[1]):
                    # transformers' static cross-attention cache keeps a sliding layer's
                    # window of the source's keys, not the source (T5Gemma's, with a window
                    # shorter than the source): grape does not reproduce that.
                    raise NotGraphable(f"cross-attention cache layer {i} is a sliding window "
                                       f"of {layer.max_cache_len} tokens over a source of "
                                       f"{encoded.shape[1]}, whose keys transformers' static "
                                       f"cache cuts to the window")
            self.cross = cross
            self.cache = EncoderDecoderCache(self.cache, self.cross)
        self.encoded.copy_(encoded)
        outputs["last_hidden_state"] = self.encoded
        self.encoder_outputs = outputs
        if self.source_mask is None or self.source_mask.shape != self._rows(mask).shape:
            self.source_mask = torch.empty_like(self._rows(mask), dtype=torch.long)
        self.source_mask.copy_(self._rows(mask))
        copied = 0 if ones else mask.numel() * mask.element_size()
        if self.source_ids is not None:
            self.source_ids.copy_(self._rows(input_ids))
            copied += input_ids.numel() * input_ids.element_size()
        self.mask.zero_()
        if decoder_mask is None:
            self.mask[:, :head] = 1
        else:
            copied += decoder_mask.numel() * decoder_mask.element_size()
            decoder_mask = self._rows(decoder_mask)
            self.mask[:, :head].copy_(decoder_mask)
        if decoder_ids is None:
            self.next_ids.fill_(self.options.start)
            ids = self.next_ids
        else:
            ids = self._rows(decoder_ids)
        given = self.mask[:, :head]  # each token's position: the decoder mask's ones before it
        position = (given.cumsum(-1) - 1).masked_fill_(given == 0, 0)
        logits = self._logits(ids, self.mask, position, first=True)
        self.position.copy_(position[:, -1:] + 1)
        if not any(_written(layer) for layer in self.cache.cross_attention_cache.layers):
            raise NotGraphable(f"{type(self.model).__name__} did not write the static "
                               f"cross-attention cache it was given while reading the "
                               f"decoder's prompt")
        self.written.fill_(head)
        self.count.zero_()
        self._remember(ids, logits.shape[-1], decoder_mask)
        self._emit(logits)
        self._agree()
        return copied

    def _process(self, scores: torch.Tensor) -> torch.Tensor:
        """generate's logits processors that grape reproduces, in generate's order, with the
        count of tokens made on the device: sequence biases, repetition penalty over the
        tokens each row has seen, repeated n-grams banned, banned words (of several tokens,
        after their prefix), EOS held back below the minimum length, forced first and last
        tokens (every score -inf but the forced token's, 0), NaN and infinities made finite,
        EOS raised by the length penalty that decays exponentially, suppressed tokens, and
        those suppressed at the first token. Each mask over the vocabulary is made once,
        eagerly, with the first logits (the prompt's)."""
        options = self.options
        if options.sequence_bias:
            scores = self._biased(scores)
        if self._source_penalty is not None:
            # (generate's processor holds the prompts one row each, against scores of a row per
            # beam or copy: it gathers and scatters within the first rows, as generate does)
            scores = self._source_penalty(None, scores)
        if self.seen is not None:
            penalty = options.repetition_penalty
            scores = torch.where(self.seen[:, :-1], torch.where(scores < 0, scores * penalty,
                                                                scores / penalty), scores)
        if options.no_repeat_ngram:
            scores = scores.masked_fill(self._repeating(scores.shape[-1]), -math.inf)
        if options.source_ngram:
            scores = scores.masked_fill(self._repeating(scores.shape[-1], self.source_ids),
                                        -math.inf)
        if options.bad_words:
            scores = scores.masked_fill(self._mask("bad_words", scores), -math.inf)
        if self.bad_sequences:
            scores = scores.masked_fill(self._completing(scores.shape[-1]), -math.inf)
        if self.min_new > 0 and options.eos:
            early = self.count < self.min_new
            scores = torch.where(early & self._mask("eos", scores), -math.inf, scores)
        for ids, at in self.forced:
            only = torch.full_like(scores, -math.inf).index_fill_(1, ids, 0.0)
            scores = torch.where(self.count == at, only, scores)
        if options.remove_invalid:
            scores = _REMOVE_INVALID(None, scores)
        if self.decay is not None:
            # generate adds |score| * (factor ** (made - start) - 1), a float32 rounding of
            # Python's power, to each EOS score once more than start tokens are made; before
            # that it adds nothing at all (not a zero: -inf + 0 * inf would be NaN).
            factor = self.decay.index_select(0, self.count)
            penalty = scores.index_select(1, self.eos).abs() * factor
            raised = scores + torch.zeros_like(scores).index_copy_(1, self.eos, penalty)
            scores = torch.where(self.count > options.decay[0], raised, scores)
        if options.suppressed:
            scores = scores.masked_fill(self._mask("suppressed", scores), -math.inf)
        if options.begin_suppressed:
            first = self.count == self.begin
            scores = torch.where(first & self._mask("begin_suppressed", scores), -math.inf,
                                 scores)
        if options.timestamps is not None:
            scores = self._timestamped(scores)
        return scores

    def _timestamped(self, scores: torch.Tensor) -> torch.Tensor:
        """generate's WhisperTimeStampLogitsProcessor with the history on the device: the
        no-timestamps token out; timestamps in pairs (after a pair, text; after a lone one,
        another timestamp or EOS) and never below the last; at the first token a timestamp no
        later than the limit; and where a row's timestamps together outweigh its likeliest
        text token, a timestamp. Its last rule reads each row's log-probabilities one row at a
        time, as the processor does, so that the comparison sees its bits."""
        begin, no_timestamps, eos, initial, detect = self.options.timestamps
        first = no_timestamps + 1  # the first timestamp token
        width, rows = scores.shape[-1], scores.shape[0]
        device = scores.device
        vocab = torch.arange(width, device=device)
        stamp = vocab >= first  # (width,)
        scores = scores.index_fill(1, torch.tensor([no_timestamps], device=device), -math.inf)
        history = self.history
        written = self.count + self.head_len  # the sequence's length, (1,)
        made = written - begin  # tokens since the begin index
        last = history.gather(1, (written - 1).clamp(min=0).expand(rows, 1)).squeeze(1)
        before = history.gather(1, (written - 2).clamp(min=0).expand(rows, 1)).squeeze(1)
        last_stamp = (made >= 1) & (last >= first)  # (rows,)
        lone = last_stamp & ~((made < 2) | (before >= first))  # a timestamp after text
        paired = last_stamp & ~lone
        scores = torch.where(paired.unsqueeze(1) & stamp, -math.inf, scores)
        scores = torch.where(lone.unsqueeze(1) & (vocab < eos), -math.inf, scores)
        # the last timestamp at or after the begin index, where there is one
        place = torch.arange(history.shape[1], device=device)
        stamps = (history >= first) & (place >= begin) & (place < written)
        at = torch.where(stamps, place, -1).amax(dim=1)
        latest = history.gather(1, at.clamp(min=0).unsqueeze(1)).squeeze(1)
        below = torch.where(lone, latest, latest + 1).unsqueeze(1)
        scores = torch.where((at >= 0).unsqueeze(1) & stamp & (vocab < below), -math.inf,
                             scores)
        opening = ~stamp if initial is None else ~stamp | (vocab > first + initial)
        scores = torch.where((written == begin) & opening, -math.inf, scores)
        if detect:
            logprobs = torch.nn.functional.log_softmax(scores.float(), dim=-1)
            outweigh = torch.stack([logprobs[k, first:].logsumexp(dim=-1)
                                    > logprobs[k, :first].max() for k in range(rows)])
            scores = torch.where(outweigh.unsqueeze(1) & ~stamp, -math.inf, scores)
        return scores

    def _repeating(self, width: int, source: torch.Tensor | None = None) -> torch.Tensor:
        """generate's NoRepeatNGramLogitsProcessor over the history, with its length on the
        device: each window of n tokens that lies inside what was written and whose first n - 1
        match the last n - 1 written bans its last token ((rows, width) booleans; windows that
        do not match land in a column past the vocabulary, as generate's do). With ``source``,
        EncoderNoRepeatNGramLogitsProcessor: the windows are the source's, every one of them,
        once n - 1 tokens are written."""
        history = self.history
        n = self.options.source_ngram if source is not None else self.options.no_repeat_ngram
        if (history if source is None else source).shape[1] < n:  # no n-gram fits: none banned
            return torch.zeros((history.shape[0], width), dtype=torch.bool,
                               device=history.device)
        written = self.count + self.head_len  # tokens in the history, as a (1,) tensor
        offsets = torch.arange(n - 1, device=history.device)
        prefix = history.index_select(1, (written - (n - 1) + offsets).clamp_(min=0))
        windows = (history if source is None else source).unfold(1, n, 1)
        starts = torch.arange(windows.shape[1], device=history.device)
        inside = written >= n - 1 if source is not None else starts <= written - n
        matches = (windows[..., :-1] == prefix.unsqueeze(1)).all(dim=-1) & inside
        banned = torch.zeros((history.shape[0], width + 1), dtype=torch.bool,
                             device=history.device)
        banned.scatter_(1, torch.where(matches, windows[..., -1], width), True)
        return banned[:, :width]

    def _completing(self, width: int) -> torch.Tensor:
        """generate's SequenceBiasLogitsProcessor for banned words of several tokens, with the
        length on the device: a word of k tokens bans its last where the last k - 1 written
        are its first, once k tokens are written ((rows, width) booleans)."""
        history = self.history
        written = self.count + self.head_len
        banned = torch.zeros((history.shape[0], width + 1), dtype=torch.bool,
                             device=history.device)
        for k, (prefixes, lasts) in self.bad_sequences.items():
            offsets = torch.arange(k - 1, device=history.device)
            prefix = history.index_select(1, (written - (k - 1) + offsets).clamp_(min=0))
            matches = (prefix.unsqueeze(1) == prefixes.unsqueeze(0)).all(dim=-1) & (
                written >= k)
            banned.scatter_(1, torch.where(matches, lasts, width), True)
        return banned[:, :width]

    def _tail(self, n: int, made: bool = False) -> torch.Tensor:
        """Each row's last ``n`` tokens as generate's sequences end, from the history: before
        this step's token (``made``: with it, once written). Where a row holds fewer, the
        columns before its first token hold an id past any vocabulary, which matches nothing
        (StopStringCriteria clamps it to its no-match entry)."""
        end = self.count + self.head_len + int(made)
        at = end - n + torch.arange(n, device=self.count.device)
        tail = self.history.gather(1, at.clamp(min=0).expand(self.rows, n))
        return torch.where(at >= 0, tail, torch.iinfo(torch.int32).max)

    def _biased(self, scores: torch.Tensor) -> torch.Tensor:
        """generate's SequenceBiasLogitsProcessor, its operations in its order: each
        one-token sequence's bias, then each longer one's where the row's last tokens are its
        prefix, added to its last token's score (the tables made with the first logits)."""
        if self._bias is None:
            self._bias = SequenceBiasLogitsProcessor([[list(ids), value] for ids, value
                                                      in self.options.sequence_bias])
            try:  # eagerly: the vocabulary's width
                self._bias._prepare_bias_variables(scores)
            except ValueError as e:  # a token past it
                raise GrapeError(f"expected sequence_bias over token ids below the logits' "
                                 f"width, found: {str(e).splitlines()[0]}") from None
            device = scores.device
            self._longer = [(torch.tensor(ids[:-1], dtype=torch.long, device=device), ids[-1],
                             torch.tensor(value, device=device)) for ids, value
                            in self._bias.sequence_bias.items() if len(ids) > 1]
            self._no_bias = torch.tensor(0.0, device=device)
        bias = torch.zeros_like(scores)
        bias += self._bias.length_1_bias
        for prefix, last, value in self._longer:
            matching = torch.eq(self._tail(len(prefix)), prefix).prod(dim=1)
            bias[:, last] += torch.where(matching.bool(), value, self._no_bias)
        return scores + bias

    def _renormalized(self, scores: torch.Tensor) -> torch.Tensor:
        """generate's last processor, where renormalize_logits asks for it: log-softmax."""
        return scores.log_softmax(dim=-1) if self.options.renormalize else scores

    def _mask(self, name: str, scores: torch.Tensor) -> torch.Tensor:
        """Which of the vocabulary's tokens ``Options.<name>`` lists, as (width,) booleans."""
        mask = self._masks.get(name)
        if mask is None or mask.shape[-1] != scores.shape[-1]:
            ids = torch.tensor(getattr(self.options, name), dtype=torch.long,
                               device=scores.device)
            mask = self._masks[name] = torch.isin(
                torch.arange(scores.shape[-1], device=scores.device), ids)
        return mask

    def _remember(self, ids: torch.Tensor, width: int, mask: torch.Tensor | None = None) -> None:
        """The tokens before the new ones, as each row's history (no_repeat_ngram_size) and
        seen set (repetition_penalty). Where ``generate`` leaves a prompt's left padding out of
        the penalty (transformers 5.2x: ``PENALTY_SKIPS_PADDING``), the padding's tokens land
        in a column past the vocabulary, which the penalty never reads."""
        if self.history is not None:
            self.history[:, :ids.shape[1]].copy_(ids)
        if self.options.repetition_penalty == 1.0:
            return
        if self.seen is None or self.seen.shape[-1] != width + 1:
            self.seen = torch.zeros((self.rows, width + 1), dtype=torch.bool, device=ids.device)
        self.seen.zero_()
        if mask is not None and PENALTY_SKIPS_PADDING:
            first = (mask != 0).int().argmax(dim=1, keepdim=True)  # generate's padding length
            positions = torch.arange(ids.shape[1], device=ids.device)
            ids = ids.masked_fill(positions < first, width)
        self.seen.scatter_(1, ids, True)

    def head(self, input_ids: torch.Tensor, decoder_ids: torch.Tensor | None = None
             ) -> torch.Tensor:
        """What ``generate``'s sequences hold before the new tokens: the prompt, or for an
        encoder-decoder model the decoder's prompt (``decoder_ids``, else its start token)."""
        if not self.seq2seq:
            return input_ids
        if decoder_ids is not None:
            return decoder_ids
        return torch.full((input_ids.shape[0], 1), self.options.start, dtype=torch.long,
                          device=input_ids.device)

    @torch.no_grad()
    def step(self) -> None:
        """The next token for every row, at fixed shapes, with no host sync."""
        # The new token's column of the mask: where the cache writes it (its device length).
        self.mask.index_fill_(1, self.written, 1)
        if self.lengths is not None:
            self.lengths.before_step(self.written)
        logits = self._logits(self.next_ids, self.mask, self.position, first=False)
        self._move_on(self._choose(logits))
        self._agree()

    def _choose(self, logits: torch.Tensor) -> Any:
        """What a step's logits decide, handed to :meth:`_record` (by default the logits:
        the whole of ``_emit``)."""
        return logits

    def _record(self, chosen: Any) -> Any:
        """The bookkeeping of what was chosen; returns what :meth:`_recorded` takes."""
        self._emit(chosen)

    def _recorded(self, recorded: Any) -> None:
        """Work after the bookkeeping that stays out of its compiled form (none by
        default)."""

    def _moved_on(self, chosen: Any) -> Any:
        """After the forward: the lengths move on and what was chosen is recorded."""
        self.written.add_(1)
        self.position.add_(1)
        return self._record(chosen)

    def _move_on(self, chosen: Any) -> None:
        """:meth:`_moved_on`, compiled as one graph where the step model compiles
        (``CompiledStep.tail``) and the subclass asks for it (``records_compiled``): a dozen
        one-element kernels of bookkeeping become a few of Inductor's. The choice stays
        outside (eager, or in the compiled forward), so the tokens are those of the steps
        without it: the bookkeeping is selection and elementwise work, exact either way
        (where it divides floats, Inductor is asked to round as eager: ``records_divide``).
        What :meth:`_recorded` does with its result stays out too (a beam search's cache
        gather, bandwidth-bound, in the form measured fastest). Compiled on the first step,
        which the build runs eagerly; where compiling fails the work runs eagerly from then
        on, said on the ``grape`` logger."""
        compiled = self._compiled_moved_on
        if compiled is None:
            tail = getattr(self.step_model, "tail", None)
            if tail is not None and self.records_compiled:
                compiled = tail(self._moved_on, divides=self.records_divide)
            self._compiled_moved_on = compiled = compiled or False
        if compiled is not False:
            try:
                self._recorded(compiled(chosen))
                return
            except COMPILE_ERRORS as e:  # (raised while compiling, before anything ran)
                self._compiled_moved_on = False
                _LOG.info("grape.generate(compile=True): the step's bookkeeping did not "
                          "compile (%s); it runs eagerly",
                          str(e).splitlines()[0] if str(e) else type(e).__name__)
        self._recorded(self._moved_on(chosen))

    def _keep(self, name: str, values: torch.Tensor) -> None:
        """Writes this token's ``values`` (rows, vocabulary) where the return dict keeps
        ``name`` ("scores" or "logits"), if it keeps it."""
        if name not in self.kept:
            return
        if (held := self.kept[name]) is None:
            held = self.kept[name] = values.new_empty((self.options.room, *values.shape))
        held.index_copy_(0, self.count, values.unsqueeze(0))

    def _kept(self, steps: int) -> dict[str, tuple[torch.Tensor, ...] | None]:
        """The first ``steps`` tokens' kept values, as generate's tuples (copies: the buffers
        are the next call's); None for what is not kept."""
        return {name: None if held is None else tuple(held[:steps].clone().unbind(0))
                for name, held in self.kept.items()}

    def _agree(self) -> None:
        """On a model split over ranks, go on while any rank goes on (a maximum, all-reduced on
        the device): every rank leaves a device loop on the same token, and none is left
        waiting in a collective the others have stopped calling."""
        if self.group is None:
            return
        import torch.distributed as dist

        self._agreed.copy_(self.running)
        dist.all_reduce(self._agreed, op=dist.ReduceOp.MAX, group=self.group)
        torch.ne(self._agreed[0], 0, out=self.running)

    @torch.no_grad()
    def check_written_only(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                           decoder_ids: torch.Tensor | None = None,
                           decoder_mask: torch.Tensor | None = None,
                           embeds: torch.Tensor | None = None,
                           model_inputs: dict[str, torch.Tensor] | None = None) -> None:
        """Refuse a model whose prompt or step reads cache positions it has not written.

        The prompt and a step run over a cache of zeros twice, and once with the values at its
        unwritten positions set to ``POISON``. Masked positions weigh exactly nothing, so a
        model that masks them makes the same logits, up to the run-to-run noise of kernels
        that accumulate in no fixed order (the first two runs measure it); one that reads them
        (its attention does not mask a static cache's unused tail, as FSMT's and LED's do not)
        moves its logits by about as much as it weighs the poison, and would make tokens that
        depend on what the cache held, which ``generate`` with its default cache does not make.

        Raises
        ------
        NotGraphable
            The poison moved the logits by more than a thousandth of their scale and ten
            times the noise.
        """
        runs = []
        try:
            for poison in (None, None, POISON):  # the first run also makes the cache's tensors
                self._poison, self._audit = poison, []
                self.prefill(input_ids, attention_mask, decoder_ids, decoder_mask, embeds,
                             model_inputs)
                self.step()
                runs.append(self._audit)
        finally:
            self._poison = self._audit = None
        for forward, (clean, again, poisoned) in enumerate(zip(*runs, strict=True)):
            noise = (again - clean).abs().nan_to_num(posinf=0.0).max().item()
            moved = (poisoned - clean).abs().nan_to_num(posinf=0.0).max().item()
            scale = clean.abs().nan_to_num(posinf=0.0).max().item()
            if moved > max(1e-3 * max(scale, 1.0), 10 * noise):
                raise NotGraphable(
                    f"{type(self.model).__name__} reads cache positions it has not written "
                    f"({'the prompt' if forward == 0 else 'a step'}'s logits moved by "
                    f"{moved:.3g} with other values there): its attention does not mask the "
                    f"static cache's unused tail")

    def generate_on_host(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                         decoder_ids: torch.Tensor | None = None,
                         decoder_mask: torch.Tensor | None = None,
                         embeds: torch.Tensor | None = None,
                         model_inputs: dict[str, torch.Tensor] | None = None,
                         feed: Any = None) -> Any:
        """The whole generation with the host deciding each step (one read-back per token):
        the reference a device loop of the same step is held to. ``feed``: a
        ``grape.torch.streaming.TokenFeed``, handed each token as it is made (token decoders
        only)."""
        self.prefill(input_ids, attention_mask, decoder_ids, decoder_mask, embeds,
                     model_inputs)
        head = self.sequence_head(input_ids, decoder_ids) if feed is not None else None
        while True:
            if feed is not None:
                feed.deliver(head, self.tokens.cpu(), int(self.count[0]))
            if not bool(self.running):
                break
            self.step()
        result = self.result(input_ids, decoder_ids)
        if feed is not None:  # (every token handed on in the loop)
            feed.end()
        return result

    def sequence_head(self, input_ids: torch.Tensor, decoder_ids: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """The sequences' first columns, one row per sequence: :meth:`head`'s rows."""
        return self._rows(self.head(input_ids, decoder_ids))

    def _check_lengths(self) -> None:
        """After a generation (its result read back): the model's deferred checks held
        (``grape.torch.deferred_checks``), and exact lengths had a left-padded prompt."""
        self.checks.raise_failed()
        if self.lengths is not None and not bool(self.lengths.ok):
            raise NotLeftPadded("exact lengths need left-padded prompts (each row's ones in one "
                                "run at the end), and this attention mask has a zero after a one")

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """The prompt's tensors as the decoder's rows (one per prompt here)."""
        return t

    def _reset(self) -> None:
        raise NotImplementedError

    def _emit(self, logits: torch.Tensor) -> None:
        raise NotImplementedError

    def result(self, input_ids: torch.Tensor, decoder_ids: torch.Tensor | None = None) -> Any:
        """What ``generate`` returns: the prompt (or the decoder's, ``head``) and the new
        tokens (reads back once)."""
        raise NotImplementedError


class TokenDecoder(Decoder):
    """Greedy decoding or sampling, as ``generate``'s ``_sample``: a finished row produces the
    pad token; the loop stops when every row is finished or ``max_new_tokens`` are made.

    Sampling draws one uniform number per row and token before the loop, from a CUDA
    generator seeded per call (``set_seed``), and picks the token whose cumulative probability
    first passes it: exact sampling from the processed distribution, and the same tokens for
    the same seed whether the loop runs eagerly, step by step, or on the device. It is not
    ``torch.multinomial``'s random stream, so its tokens are not ``generate``'s for the same
    seed. Where ``Options.samples_candidates``, temperature, top-k, top-p and the draw run
    over top-k's candidates (``grape.torch.sampling``: ``generate``'s survivors, fewer
    kernels); :meth:`result` raises ``CandidatesOverflowed`` where tokens tied with the k-th
    score outnumbered them, and the generation must be made again with
    ``Options.whole_vocabulary``.
    """

    records_compiled = True

    def __init__(self, model: torch.nn.Module, rows: int, prompt_len: int,
                 options: Options, step_model: Any = None, exact: bool = False) -> None:
        # num_return_sequences: each prompt's rows adjacent, as generate expands them.
        self.copies = options.num_return
        super().__init__(model, rows * self.copies, prompt_len, options, step_model, exact)
        device, rows = self.mask.device, self.rows  # (every copy's)
        self.tokens = torch.full((rows, options.room), options.pad, dtype=torch.long,
                                 device=device)
        self.done = torch.zeros((rows,), dtype=torch.bool, device=device)
        self.warpers = sampling_warpers(options, device)  # generate's, in its order
        if options.strategy == "sample":
            self.uniforms = torch.zeros((options.room, rows), dtype=torch.float32,
                                        device=device)
            self.generator = torch.Generator(device=device)
        self.seed: int | None = None
        self.sampler: CandidateSampler | None = None
        self.overflowed: torch.Tensor | None = None  # the candidates missed a tie, some token
        if options.samples_candidates:
            top_p = next((w for w in self.warpers if isinstance(w, DeviceTopP)), None)
            self.sampler = CandidateSampler(self.warpers[0], options.top_k, top_p)
            self.overflowed = torch.zeros((), dtype=torch.bool, device=device)

    def set_sampling(self, options: Options) -> None:
        """This call's temperature and top-p (sampling only; an executable captured for
        another call's reads them where the warpers keep them: ``grape.torch.warpers``)."""
        for warper in self.warpers:
            if isinstance(warper, DeviceTemperature):
                warper.set(options.temperature)
            elif isinstance(warper, DeviceTopP):
                warper.set(options.top_p)

    def set_seed(self, seed: int) -> None:
        """Draw this call's random numbers (sampling only): one kernel, before the loop."""
        self.seed = seed
        self.generator.manual_seed(seed)
        torch.rand(self.uniforms.shape, generator=self.generator, device=self.uniforms.device,
                   out=self.uniforms)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.copies == 1 else t.repeat_interleave(self.copies, dim=0)

    def _reset(self) -> None:
        self.done.zero_()
        self.tokens.fill_(self.options.pad)
        if self.overflowed is not None:
            self.overflowed.zero_()

    def _processed(self, logits: torch.Tensor) -> torch.Tensor:
        logits = self._process(logits)
        # (eta_cutoff's entropy comes from a torch.distributions.Categorical, whose argument
        # check reads the logits back: a host sync no capture takes. Left out: a NaN among the
        # scores, which that check would raise on in generate's eager loop, is not raised on
        # here.)
        with _unvalidated():
            for warper in self.warpers:
                logits = warper(None, logits)
        return self._renormalized(logits)

    def _emit(self, logits: torch.Tensor) -> None:
        self._record(self._choose(logits))

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's next token (and the scores or logits the return dict keeps)."""
        if self.sampler is not None:  # (the processed scores are nobody's: not kept)
            self._keep("logits", logits)
            token, overflowed = self.sampler.draw(
                self._process(logits), self.uniforms.index_select(0, self.count).view(-1, 1))
            self.overflowed.logical_or_(overflowed.any())
            return token
        scores = self._processed(logits)
        self._keep("scores", scores)  # as generate keeps them: processed, every row
        self._keep("logits", logits)
        if self.options.strategy == "sample":
            return sample(scores, self.uniforms.index_select(0, self.count).view(-1, 1))
        return torch.argmax(scores, dim=-1)

    def _record(self, token: torch.Tensor) -> None:
        """The token written where generate's sequences hold it, and the rows' state moved on:
        finished rows, the stop criteria, whether the loop runs on."""
        if self.options.eos:
            token = torch.where(self.done, self.options.pad, token)
        self.tokens.index_copy_(1, self.count, token.unsqueeze(1))
        if self.options.eos:
            self.done.logical_or_(torch.isin(token, self.eos))
        if self.seen is not None:
            self.seen.scatter_(1, token.unsqueeze(1), True)
        if self.history is not None:
            self.history.index_copy_(1, self.count + self.head_len, token.unsqueeze(1))
        if self.stops is not None:
            self.done.logical_or_(self.stops(self._tail(self.stops.maximum_token_len, True),
                                             None))
        self.next_ids.copy_(token.unsqueeze(1))
        self.count.add_(1)
        torch.logical_and(~self.done.all(), self.count[0] < self.options.max_new_tokens,
                          out=self.running)

    def result(self, input_ids: torch.Tensor, decoder_ids: torch.Tensor | None = None
               ) -> torch.Tensor | GenerateDecoderOnlyOutput:
        if self.overflowed is None:
            made = int(self.count.item())
        else:  # (read with the count: still one read-back)
            made, overflowed = torch.stack([self.count[0], self.overflowed.long()]).tolist()
            if overflowed:
                raise CandidatesOverflowed(self.seed)
        self._check_lengths()
        sequences = torch.cat([self.sequence_head(input_ids, decoder_ids),
                               self.tokens[:, :made]], dim=1)
        if not self.options.return_dict:
            return sequences
        # past_key_values is None, not grape's static cache, which the next call overwrites.
        kept = self._kept(made)
        output = GenerateEncoderDecoderOutput if self.seq2seq else GenerateDecoderOnlyOutput
        return output(sequences=sequences, scores=kept.get("scores"), logits=kept.get("logits"),
                      past_key_values=None)


def _stops(options: Options, device: torch.device) -> StopStringCriteria | None:
    """generate's StopStringCriteria for ``options.stop_strings`` (None without), its tables
    moved to ``device`` now: it moves them on its first call, which a capture would hold as a
    copy from pageable memory."""
    if not options.stop_strings:
        return None
    stops = StopStringCriteria(options.tokenizer, list(options.stop_strings))
    stops.embedding_vec = stops.embedding_vec.to(device)
    stops.target_lens = stops.target_lens.to(device)
    return stops


_REMOVE_INVALID = InfNanRemoveLogitsProcessor()  # stateless: NaN to 0, +-inf to the finite ends


@contextlib.contextmanager
def _unvalidated() -> Iterator[None]:
    """torch.distributions without argument checks, while inside."""
    was = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(was)


def sample(scores: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row from ``softmax(scores)``, by inverse transform of ``uniform`` (one
    number in [0, 1) per row): the first token whose cumulative probability exceeds it. Tokens
    of probability 0 (filtered to -inf) are never picked. Cumulated in float64, so that 150,000
    small probabilities still add up to 1.

    The weights are left unnormalised, ``exp(score - max)``, and the target scaled by their
    total instead: the same draw as normalising first, in elementwise kernels spread over the
    GPU, where a float64 softmax is one block per row (37 us of a 0.98 ms GPT-2 token on the
    H200, ``benchmarks/step_profile.py --cases bench:gpt2:sample`` at 1cfa163)."""
    wide = scores.to(torch.float64)
    cdf = (wide - wide.amax(dim=-1, keepdim=True)).exp_().cumsum_(dim=-1)
    target = uniform.to(torch.float64) * cdf[:, -1:]
    token = torch.searchsorted(cdf, target, right=True)
    return token.clamp_(max=scores.shape[-1] - 1).squeeze(1)
