"""``grape.generate``: a Hugging Face model's whole generation as one graph launch.

``generate(model, input_ids, attention_mask=None, *, max_new_tokens, ...)`` returns what
``model.generate`` returns for the same arguments (the prompt and the new token ids, finished
rows padded), for greedy decoding, sampling and beam search. The whole generation is one graph
launch (``DeviceLoop``): the prompt's prefill, captured at its shape, then every later token as
one iteration of a WHILE node on the device; one read-back per generation (the result's
length), no host sync per token. The prefill reads the caller's ``input_ids`` and mask where
they lie: a later call whose tensors sit elsewhere re-points the nodes that read them
(``grape.torch.aliasing``), none where they sit where they did. Where the prefill cannot be
captured (the step can), it runs eagerly before the launch, with a warning.

What a generation needs is built on the first call of its shape and kept: the decoder's static
tensors and the captured loop, keyed by model, batch, prompt length, strategy and its options.
A later call of that shape pays no capture. Before a step is trusted in a loop it is captured
at two lengths and the two graphs compared (``grape.passes.audit``): a forward that sizes its
kernels by a length it keeps on the host would be frozen into the graph at one length, and is
refused. (A value read back to the host breaks the capture itself, and is refused as well.)
Small host constants the forward copies to the GPU (``torch.tensor(0.0, device=...)``, a list
used as an index) are staged through pinned memory (``grape.torch.staging``), and refused where
they differ between the two captures.

With ``compile=True`` the step's kernels are Inductor's (``torch.compile`` with
``mode="max-autotune-no-cudagraphs"``: fused Triton kernels, no PyTorch CUDA graphs), still
inside grape's one-launch loop; the prompt, at its own shape, runs the model's own kernels.
The step's input preparation (where transformers builds its mask) is compiled with the forward
as one function, and the decoder's bookkeeping after it as another (the token's choice stays
eager; ``grape.torch.compiled_step``); one-row products with a bias become reductions there
as plain ones do (``grape.torch.thin_matmuls``), and one query's grouped attention reads the
keys where they lie (``grape.torch.grouped_queries``). The step is built once per model and
compiled once per step shape (the first call of a shape pays for it, minutes with
autotuning on large models); its kernels differ from the eager ones by design, so its
tokens are compared with a tolerance, not for equality.

Encoder-decoder speech models generate the same way from what their encoder takes (the
model's ``main_input_name``: Speech2Text's ``input_features``, SpeechT5's ``input_values``),
passed where token ids go, with a mask over its frames or samples. An encoder-decoder model's
decoder may be given a prompt of its own (``decoder_input_ids``, ``decoder_attention_mask``),
read where it lies like the source.

A model whose class has a ``generate`` of its own (Whisper's: language detection, the decoder
prompt of language and task tokens, its token suppression, windows over long audio) runs that
``generate`` as it is, and each call it makes of ``GenerationMixin.generate`` is graphed
(``grape.torch.own_generate``); ``last_stats`` then sums those calls.

Each capture is reported on the ``grape`` logger at INFO (``logging.basicConfig(level=
logging.INFO)`` shows them): what it captures as it starts, since a compiled step's first call
spends a minute or more in Inductor's autotuning, and its seconds and nodes as it ends.

Whatever grape cannot run itself (an option it does not reproduce, a model on the CPU, a
forward that cannot be captured) runs through ``model.generate`` (or, inside a model's own
generate, through ``GenerationMixin.generate``) after one warning saying why; bad input
raises ``GrapeError``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import GenerationMixin

from grape.errors import CaptureError, GrapeError, GraphError, UnsupportedError
from grape.passes.audit import step_dependence
from grape.torch.aliasing import Inputs, signature
from grape.torch.beam import BeamDecoder
from grape.torch.capture import capture, frozen_heap
from grape.torch.compiled_step import CompiledStep
from grape.torch.decoding import CompileRefused, Decoder, ExactRefused, TokenDecoder
from grape.torch.experts import experts_on_device
from grape.torch.loop import DeviceLoop
from grape.torch.model_code import COMPILE_ERRORS, model_code
from grape.torch.options import (
    NotGraphable,
    Options,
    check_positions,
    decoder_prompt,
    resolve,
    sequence_head,
)
from grape.torch.own_generate import inner_arguments, note_no_speech, owns_generate, routed
from grape.torch.parallel import agree, group_of
from grape.torch.sampling import CandidatesOverflowed
from grape.torch.staging import HostConstants, PinnedArena
from grape.torch.streaming import TokenFeed

__all__ = ["EXACT_FROM", "GenerationStats", "clear_cache", "generate", "last_stats"]

# Generations of at least this many tokens (prompt and new) attend over exact lengths by
# default. On the H200 (Llama shape, 2048 x 22, fp16; benchmarks/results/exact_lengths_h200.json)
# exact lengths ran 1.14x faster per token than the whole cache at 1,056 tokens and batch 1,
# 1.54x at batch 8, 1.36x and 2.94x at 4,032 tokens; at 288 tokens 1.05x and 1.15x, where the
# tokens' bitwise equality with generate's (kept below this length) is worth more.
EXACT_FROM = 1024

# generate's arguments for an encoder-decoder model's decoder prompt (grape.torch.options).
_DECODER_PROMPT = ("decoder_input_ids", "decoder_attention_mask")
_LOG = logging.getLogger("grape")


@dataclass
class GenerationStats:
    """What the last ``generate`` call did, for benchmarks and users who want to know."""

    graphed: bool
    reason: str = ""  # why it fell back, where it did
    captured: bool = False  # this call built its loop (the first of its shape)
    capture_s: float = 0.0
    # caller's bytes the generation copies into its own tensors: the prompt's attention mask
    # into the full-length mask the steps extend (input ids are read where they lie)
    copy_bytes: int = 0
    pointer_updates: int = 0  # nodes re-pointed at caller tensors that moved (alias prediction)
    prefill_graphed: bool = False  # the prefill ran inside the launch (else eagerly, before it)
    # read-backs grape makes (the result's length; with a decoder prompt, generate's check of
    # its first tokens too); an eager prefill makes more inside the model (Hugging Face's mask
    # code reads values back: 4 to 10 on the H200)
    host_syncs: int = 0
    launches: int = 0
    # exact_lengths: how the step's attention calls ran ("exact", or "sdpa: <why not>")
    attention: dict[str, int] = field(default_factory=dict)
    # the step's nodes, and how many lie on its longest path: all of them in the captured
    # chain; fewer where concurrent=True let independent operations run side by side
    step_nodes: int = 0
    step_depth: int = 0
    # with a streamer: the tokens handed to it while the launch still ran (the rest after it)
    streamed_while_running: int = 0
    # the step's kernels are Inductor's (compile=True, where a compiled step could serve)
    compiled: bool = False
    # sampled over top-k's candidates, which tokens tied with the k-th score outnumbered: made
    # again over the whole vocabulary (grape.torch.sampling; its launch and read-back counted)
    resampled: bool = False
    # where the model's experts would read back inside a capture (or, with
    # switch_experts=True, ran by the grouped GEMM or the eager loop), what they ran by (e.g.
    # "grouped_mm in float16"): its steps' experts were captured by transformers' batched_mm
    # or densely, within grape.torch.experts' bounds (a prompt over them runs as before, and
    # eagerly before the launch where that reads back)
    experts_switched_from: str | None = None
    # compile=True: device bytes of the weight copies laid (out, in) that the compiled step
    # reads (grape.torch.weight_rows), and how many were made again before this launch
    # because their weights had changed in place
    weight_copy_bytes: int = 0
    weight_copies_refreshed: int = 0
    # the step's programmatic edges as built: each lets a kernel launch while the one before
    # it finishes (compile=True on Hopper and later; grape.passes.dependent_launch)
    dependent_edges: int = 0


@dataclass(frozen=True)
class _Prompt:
    """The caller's tensors a generation's prefill reads where they lie: the prompt (an
    encoder-decoder model's source) and its mask, and an encoder-decoder model's decoder prompt
    and its mask, each None where not given. A captured prefill takes the given ones, in this
    order, as its arguments; an executable serves calls that give the same ones."""

    ids: torch.Tensor
    mask: torch.Tensor | None = None
    decoder_ids: torch.Tensor | None = None
    decoder_mask: torch.Tensor | None = None
    # A decoder-only model's prompt as inputs_embeds; ``ids`` then holds the token ids given
    # beside them, or none ((batch, 0): nothing reads them).
    embeds: torch.Tensor | None = None
    # The call's other tensors for the model (Options.model_inputs), by name.
    model_inputs: tuple[tuple[str, torch.Tensor], ...] = ()

    def _given(self) -> list[tuple[str, torch.Tensor]]:
        fields = [(name, t) for name in ("ids", "mask", "decoder_ids", "decoder_mask", "embeds")
                  if (t := getattr(self, name)) is not None]
        return [(name, t) for name, t in fields + [(f"model:{k}", t)
                                                    for k, t in self.model_inputs] if t.numel()]

    @property
    def length(self) -> int:
        """The prompt's length in the cache: its tokens', or its embeddings'."""
        return (self.ids if self.embeds is None else self.embeds).shape[1]

    def tensors(self) -> list[torch.Tensor]:
        return [t for _, t in self._given()]

    @property
    def key(self) -> tuple:
        """What an executable captured on these tensors assumes of a later call's."""
        return tuple((name, signature(t)) for name, t in self._given())

    def like(self, tensors: tuple[torch.Tensor, ...]) -> _Prompt:
        """These tensors, in the places of the given ones (a captured prefill's arguments)."""
        placed = dict(zip((name for name, _ in self._given()), tensors, strict=True))
        model = {k: placed.pop(f"model:{k}", t) for k, t in self.model_inputs}
        return replace(self, **placed, model_inputs=tuple(model.items()))

    def prefill(self, decoder: Decoder) -> int:
        return decoder.prefill(self.ids, self.mask, self.decoder_ids, self.decoder_mask,
                               self.embeds, dict(self.model_inputs))


@dataclass
class _Entry:
    decoder: Decoder
    loop: DeviceLoop
    capture_s: float
    arena: PinnedArena  # host constants the loop's copies read at every launch
    inputs: Inputs | None  # the caller's tensors the captured prefill reads; None: eager
    copy_bytes: int
    attention: dict[str, int]
    experts_switched_from: str | None = None


@dataclass
class _Cache:
    entries: dict[tuple, _Entry] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    # the model's step under torch.compile (grape.torch.compiled_step), made on first use
    compiled: Any = None
    # (prompt key, options key) -> why a compiled step could not serve that shape
    uncompiled: dict[tuple, str] = field(default_factory=dict)

    def step_model(self, model: torch.nn.Module) -> Any:
        if self.compiled is None:
            # Static shapes: a step's shapes never change, and a dynamic kernel would read
            # sizes the captured graph freezes anyway.
            self.compiled = CompiledStep(model, mode="max-autotune-no-cudagraphs",
                                         dynamic=False)
        return self.compiled


# Per model: its built loops. They hold the model (their decoders call it), so they and it stay
# until clear_cache(model); a weak key would not help, the value keeping the key alive.
_CACHES: dict[torch.nn.Module, _Cache] = {}
# Each thread's last call (threads that generate side by side each read their own).
_STATS = threading.local()
_NO_CALL = GenerationStats(graphed=False, reason="no call yet")


def last_stats() -> GenerationStats:
    """What this thread's last ``generate`` call did."""
    return getattr(_STATS, "last", _NO_CALL)


def _set_last(stats: GenerationStats) -> None:
    _STATS.last = stats


def clear_cache(model: torch.nn.Module | None = None) -> None:
    """Close the loops built for ``model`` (every model's, without one) and let go of it: the
    loops keep their model alive until then."""
    models = [model] if model is not None else list(_CACHES)
    for m in models:
        cache = _CACHES.pop(m, None)
        if cache is None:
            continue
        with cache.lock:  # (after a generation in flight on another thread)
            for entry in cache.entries.values():
                entry.loop.close()


def _decoder(model: torch.nn.Module, batch: int, prompt_len: int, options: Options,
             step_model: Any, exact: bool) -> Decoder:
    if options.strategy == "beam":
        return BeamDecoder(model, batch, prompt_len, options, step_model, exact)
    return TokenDecoder(model, batch, prompt_len, options, step_model, exact)


class _NoStaging:
    """For compiled steps: Inductor has already made host constants into kernel arguments,
    and a Python mode active during capture alone would make Dynamo recompile there."""

    def __init__(self) -> None:
        self.values: list[bytes] = []

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


@frozen_heap()  # three captures: the collection before each costs only what was made since
def _build(model: torch.nn.Module, prompt: _Prompt, options: Options, step_model: Any = None,
           exact: bool = False, warn_whole: bool = False, concurrent: bool = False) -> _Entry:
    """The decoder and its loop for this shape: warmed up eagerly (lazy initialisation, and
    compilation where asked, stay out of the capture), the step audited for host-side state,
    then captured in a loop."""
    began = time.perf_counter()
    input_ids = prompt.ids
    batch, prompt_len = input_ids.shape[0], prompt.length
    _LOG.info("grape.generate: capturing %s's generation: %s, batch %d, prompt %d, %d new "
              "tokens%s", type(model).__name__, options.strategy, batch, prompt_len,
              options.max_new_tokens,
              ", its step compiled by torch.compile (a first compilation autotunes: a minute "
              "or more on large models)" if step_model is not None else "")
    with model_code(model):
        decoder = _decoder(model, batch, prompt_len, options, step_model, exact)
    if isinstance(decoder, TokenDecoder) and options.strategy == "sample":
        decoder.set_seed(0)
    # (asked for exact lengths, a model that runs none of its calls by them is still graphed,
    # with the warning below; chosen by grape, it is refused, and runs the whole cache)
    _warm_up(model, decoder, prompt, step_model, exact, refuse_unserved=not warn_whole)
    params = dict(model.named_parameters())
    arena, device = PinnedArena(), input_ids.device

    def staging() -> Any:
        return _NoStaging() if step_model is not None else HostConstants(arena, device)

    staged = [staging(), staging()]
    if exact and warn_whole and not decoder.lengths.served.get("exact"):
        why = ", ".join(decoder.lengths.served) or (
            "its attention does not dispatch through transformers' AttentionInterface")
        warnings.warn(f"grape.generate attends over the whole cache, not exact lengths, for "
                      f"{type(model).__name__}: {why}", stacklevel=4)
    # The eager steps here, after the prompt's, are options.STEPS_BEFORE_CAPTURE: the
    # decoders' buffers have room for them whatever max_new_tokens is (Options.room).
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
    tensors = prompt.tensors()
    copy_bytes = prompt.prefill(decoder)

    def prefill(*given: torch.Tensor) -> None:
        prompt.like(given).prefill(decoder)

    try:
        inputs = Inputs.of(tensors)
        # The prompt runs the model itself, never the compiled forward: it is staged always.
        loop = DeviceLoop(decoder.step, decoder.running, options.max_new_tokens, params=params,
                          prologue=prefill, prologue_args=tensors, staging=staging(),
                          prologue_staging=HostConstants(arena, device),
                          concurrent=concurrent)
    except GrapeError as e:  # a capture that breaks, views sharing memory: the prompt waits
        warnings.warn(f"grape.generate runs the prompt eagerly, before each launch: "
                      f"{str(e).splitlines()[0]}", stacklevel=4)
        inputs = None
        loop = DeviceLoop(decoder.step, decoder.running, options.max_new_tokens,
                          params=params, staging=staging(), concurrent=concurrent)
    attention = dict(decoder.lengths.served) if exact else {}
    seconds = time.perf_counter() - began
    body = loop.concurrency.get("body")
    _LOG.info("grape.generate: captured in %.2f s: a step of %d nodes, %d on its longest "
              "path; the prompt %s", seconds, len(loop.capture.ir),
              len(loop.capture.ir) if body is None else body.depth,
              "inside the launch" if inputs is not None else "run eagerly before it")
    return _Entry(decoder, loop, seconds, arena, inputs, copy_bytes, attention)


def _warm_up(model: torch.nn.Module, decoder: Decoder, prompt: _Prompt, step_model: Any,
             exact: bool, refuse_unserved: bool = True) -> None:
    """The decoder's first runs, eagerly (nothing is being captured yet): the check that the
    model reads only what it wrote, the prompt's attention paths, and a step.

    Raises
    ------
    ExactRefused
        With exact lengths, the model failed on their cache, laid out by tokens
        (``grape.torch.exact.TokenMajorLayer``): a model whose own attention code views its
        keys as laid out by heads fails there, where the loop over the whole cache may not
        (``grape.generate``'s default then runs the whole cache); or a model whose attention
        never called grape's read positions it had not written; or, with
        ``refuse_unserved``, no attention call of the step ran by exact lengths.
    NotGraphable
        Without, the model failed on grape's static cache and fixed-shape inputs.
    """
    batch, prompt_len = prompt.ids.shape[0], prompt.length
    eagerly = (model_code(model, ExactRefused, "exact lengths' cache, laid out by tokens")
               if exact else model_code(model))
    with eagerly:
        try:
            decoder.check_written_only(prompt.ids, prompt.mask, prompt.decoder_ids,
                                       prompt.decoder_mask, prompt.embeds,
                                       dict(prompt.model_inputs))
        except NotGraphable as e:
            if not exact or decoder.lengths.served.get("exact"):
                raise
            # No layer attended through grape's function: the model masks by its own code,
            # which under exact lengths' attention name takes branches and masks it was not
            # written for (Falcon's and Bloom's read the unused tail then); over the whole
            # cache it runs as generate runs it.
            raise ExactRefused(f"{type(model).__name__}'s attention masks by its own code, "
                               f"not through transformers' AttentionInterface; under exact "
                               f"lengths: {e}") from None
        if decoder.uses_mask and prompt_len > 1:
            # The captured prompt holds both of its attention paths (grape.torch.hfmasks):
            # each runs once here, with no padding and with some, so that neither meets its
            # lazy initialisation (a kernel plan, a workspace) inside the capture.
            padded = torch.ones((batch, prompt_len), dtype=torch.long, device=prompt.ids.device)
            padded[:, 0] = 0
            replace(prompt, mask=None).prefill(decoder)
            replace(prompt, mask=padded).prefill(decoder)
        prompt.prefill(decoder)
        decoder.step()
        served = decoder.lengths.served if exact and refuse_unserved else None
        if served is not None and not served.get("exact"):
            # Exact lengths would only add their bookkeeping: every layer attends over a
            # cache of its own (a window, a recurrent state), by its own code, or with
            # something the kernel does not take.
            calls = ", ".join(f"{n} by {how}" for how, n in served.items())
            raise ExactRefused(f"no attention call of {type(model).__name__}'s step ran over "
                               f"exact lengths ({calls or 'its layers attend by their own code'})")
        if exact and step_model is not None:
            # That step ran the model's own forward (Decoder._logits): once more, from the
            # prompt, so that the step compiles here, not inside the capture.
            prompt.prefill(decoder)
            decoder.step()


def generate(model: torch.nn.Module, input_ids: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None, *, max_new_tokens: int,
             seed: int | None = None, compile: bool = False,
             exact_lengths: bool | None = None, cache_length: int | None = None,
             prompt_bucket: int | None = None, concurrent: bool | None = None,
             switch_experts: bool | None = None, **kwargs: Any) -> Any:
    """``model.generate(input_ids, attention_mask=..., max_new_tokens=..., **kwargs)``, graphed.

    Takes the ``GenerationConfig`` fields users pass most (``do_sample``, ``temperature``,
    ``top_k``, ``top_p``, ``min_p``, ``typical_p``, ``epsilon_cutoff``, ``eta_cutoff``,
    ``num_beams``, ``num_return_sequences``, ``length_penalty``, ``early_stopping``,
    ``stop_strings`` with ``tokenizer``, ``streamer``,
    ``remove_invalid_values``, ``exponential_decay_length_penalty``, ``renormalize_logits``,
    ``sequence_bias``, ``encoder_repetition_penalty``,
    ``eos_token_id`` (one or several), ``pad_token_id``, ``min_new_tokens``, or a
    ``generation_config``); the model's own generation config fills the rest, as in
    ``generate``. ``seed`` seeds sampling (default: drawn from torch's global generator, so
    ``torch.manual_seed`` makes a call repeatable); sampled tokens follow the processed
    distribution exactly but are not ``torch.multinomial``'s, so they differ from
    ``generate``'s for the same seed. With top-k (and temperature and top-p alone, nothing
    keeping the processed scores) the warpers and the draw run over top-k's candidates, with
    ``generate``'s survivors (``grape.torch.sampling``); where more tokens tie with the k-th
    score than the candidates hold, the generation is made again over the whole vocabulary
    from the same seed (``last_stats().resampled``). The temperature and ``top_p`` are read
    from the device
    (``grape.torch.warpers``): calls that differ only in them share one executable. A
    ``streamer`` (as ``generate`` takes one: not with
    beams) is handed what ``generate`` hands it, each token while the launch is still running:
    the host follows the launch from a side stream (``grape.torch.streaming``), and the
    generation still reads back once. ``compile=True`` runs the step's kernels from
    ``torch.compile`` (see the module); a step that does not compile, or that a compiled
    step cannot serve (a sliding window shorter than the generation), runs the model's own
    kernels in the one launch instead, with a warning; one that does not capture either falls
    back to ``model.generate``, as without ``compile``. ``exact_lengths=True``
    makes each token's attention read only the keys that exist
    (``grape.torch.exact``: one kernel that takes each row's length from the device) instead of
    the whole preallocated cache, masked; its kernel differs from SDPA's, so its tokens are
    greedy decoding's to fp16 near-ties, not ``generate``'s bit for bit. Prompts must be left
    padded (a mask with a zero after a one falls back to ``model.generate``, with a warning); a
    model whose attention cannot run it attends over the whole cache, with one warning, but one
    whose own code fails on exact lengths' cache (laid out by tokens), that masks by its own
    code and then reads the cache's unwritten tail, or that does not support SDPA (which runs
    the calls the kernel cannot take, and has no place for terms such as attention sinks),
    falls back to ``model.generate``, with the reason (the default, None, runs such a model
    over the whole cache instead, as it does a model whose step runs no call by exact
    lengths). Layers whose cache does not span the generation keep theirs: a sliding window
    shorter than it attends over its own keys by SDPA, a recurrent state is the model's, and
    exact lengths serve the full-attention layers beside them. With
    ``compile=True`` the kernel runs inside the compiled step (its first decode step runs the
    model's own forward, so that the step compiles once). The
    default, None, turns it on for generations of at least ``EXACT_FROM`` tokens (prompt and
    new) of 16-bit models without ``compile``, where it measured faster on the H200, and off
    below, where grape's tokens are ``generate``'s bit for bit; a mask it cannot take then
    runs the loop over the whole cache (found after the launch, which then runs again).
    ``cache_length`` sizes the static cache (prompt and new tokens; default, their sum) as a
    server sizes it once for generations of any length up to it: the loop over the whole cache
    then attends over all of it every token, exact lengths over the keys that exist. The
    executable is cached per cache length as well. ``prompt_bucket`` (default None: every
    prompt length its own executable) left-pads each prompt, with the pad token and a masked
    column, to the next multiple of that many tokens, so that prompts of lengths within one
    bucket share an executable: the padded prompt is a copy of the caller's tensors (counted
    in ``last_stats().copy_bytes``), and its tokens are ``generate``'s for the padded prompt,
    which can part from the unpadded prompt's where two logits nearly tie (attention then sums
    over the masked columns too, and runs its masked kernels). ``concurrent`` (default None:
    on, unless the step is compiled) lets the step's operations that share no memory run side
    by side
    (``grape.passes.concurrency``: the same kernels, ordered by what they read and write
    rather than by the order the forward issued them); ``last_stats()`` gives the step's nodes
    and its longest path. It measured faster than the chain in every row benchmarked on an
    H100 (1.07x to 1.40x a token, ten architectures, greedy and 5 beams) with the chain's
    tokens over every architecture swept. Its capture takes longer, for noting what each
    operation touched and ordering by it: on the Llama bench shape about 1.1 s against 0.6
    per executable (H100). Where most calls capture (a new shape each), ``concurrent=False``
    captures faster: it runs the step's kernels one after another in the order the forward
    issued them. A compiled step runs as a chain by default: the pass notes what each
    operation touches with a Python dispatch mode, under which Dynamo runs the model eagerly
    rather than its compiled code (``benchmarks/compiled_under_dispatch_mode.py``), so that
    on an H100 GPT-2 small's compiled step captured with ``concurrent=True`` held 307 nodes
    against the chain's 151 and ran 0.765 ms a token against 0.581 (``benchmarks/README.md``).
    ``switch_experts`` (default None) says which mixture-of-experts layers run, while grape
    captures, by grape's implementations that read nothing back (``grape.torch.experts``:
    ``batched_mm`` for calls of few pairs, every token through every expert for the rest):
    None those that would read back (PyTorch's grouped GEMM outside bf16, a model's eager
    loop), without which the model falls back; True every layer transformers runs by the
    grouped GEMM or the eager loop, bf16 too, where they measured faster in graphs
    (``benchmarks/experts_ways.py``), with ``generate``'s tokens up to rounding; False none.

    Encoder-decoder models (T5, BART, Marian, Pegasus...) generate the same way: the prompt is
    the encoder's source, run once per call, and the decoder starts from its start token
    (``grape.torch.decoding``); their outputs start with that token, as ``generate``'s do.
    ``num_return_sequences`` makes several sequences per prompt, adjacent, as ``generate``
    does: sampled apart, or a beam search's best beams, best first (the prompt's rows are
    expanded inside the launch).
    ``decoder_input_ids`` (and ``decoder_attention_mask``) give the decoder a prompt of its
    own, prepared as ``generate`` prepares it (the start token put before a prompt whose rows
    all lack it: a copy, counted in ``copy_bytes``, after one read-back); the outputs then
    start with it, and an executable serves calls whose decoder prompts have its length.
    A speech encoder-decoder model takes its features (or samples) as ``input_ids``, with
    ``attention_mask`` of shape ``input_ids.shape[:2]`` (see the module). A model whose class
    has its own ``generate`` (Whisper: ``language=``, ``task=`` and its other arguments pass
    through) runs it, its calls of ``GenerationMixin.generate`` graphed; ``logits_processor``
    objects of the kinds grape reproduces (token suppression, as Whisper passes it) are taken
    as the options they stand for. A decoder-only model's prompt may be ``inputs_embeds``
    (``input_ids`` then None, or token ids of their length that the result starts with): the
    captured prefill reads them where they lie, and the result holds the new tokens alone, as
    ``generate``'s does. Other tensors ``generate`` would pass to the model (a vision-language
    model's ``pixel_values``) go to the prompt alone, read where they lie; those with a value
    per token (``token_type_ids``, ``mm_token_type_ids``) are extended for each new token as
    ``generate`` extends them; a model whose steps would read others falls back, found before
    any capture.
    A model that attends to cache positions it has not written (its attention does not mask
    the static cache's unused tail, so that its tokens with a static cache are not those of
    its default cache) runs through ``model.generate``, found before anything is captured
    (``Decoder.check_written_only``).

    Returns
    -------
    torch.Tensor or GenerateDecoderOnlyOutput
        (batch, prompt length + new tokens), as ``generate`` returns it (encoder-decoder
        models: (batch, decoder prompt length + new tokens), and ``generate``'s
        encoder-decoder outputs); with
        ``return_dict_in_generate=True``, ``generate``'s ``GenerateDecoderOnlyOutput`` (beam
        search: ``GenerateBeamDecoderOnlyOutput``, with the best beam's ``beam_indices``):
        ``sequences``, and ``scores`` and ``logits`` where ``output_scores`` and
        ``output_logits`` ask for them (one (rows, vocabulary) float32 tensor per step, the
        processed scores, or log-probabilities for beams, and the raw logits: copies the
        caller keeps), with beams ``sequences_scores`` too. ``past_key_values`` is None:
        grape's cache is the next call's.

    Raises
    ------
    GrapeError
        Bad input (ids that are not a (batch, length) long tensor on the model's device, a
        mask of another shape, ``max_new_tokens`` below 1, an option out of range).
    """
    if not (isinstance(model, torch.nn.Module)
            and hasattr(model, "prepare_inputs_for_generation")):
        raise GrapeError(f"expected a Hugging Face generative model, found "
                         f"{type(model).__name__}")
    if not isinstance(compile, bool):
        raise GrapeError(f"expected compile to be True or False, found {compile!r}")
    if concurrent is not None and not isinstance(concurrent, bool):
        raise GrapeError(f"expected concurrent to be True, False or None, found "
                         f"{concurrent!r}")
    if exact_lengths is not None and not isinstance(exact_lengths, bool):
        raise GrapeError(f"expected exact_lengths to be True, False or None, found "
                         f"{exact_lengths!r}")
    if prompt_bucket is not None and (not isinstance(prompt_bucket, int)
                                      or isinstance(prompt_bucket, bool) or prompt_bucket < 1):
        raise GrapeError(f"expected prompt_bucket to be a positive integer or None, found "
                         f"{prompt_bucket!r}")
    if switch_experts is not None and not isinstance(switch_experts, bool):
        raise GrapeError(f"expected switch_experts to be True, False or None, found "
                         f"{switch_experts!r}")
    grape_args = _GrapeArgs(seed, compile, exact_lengths, cache_length, prompt_bucket,
                            concurrent, switch_experts)
    hf_kwargs = dict(kwargs, max_new_tokens=max_new_tokens)
    if owns_generate(model):
        return _through_own_generate(model, input_ids, attention_mask, hf_kwargs, grape_args)

    def fallback() -> Any:
        given = hf_kwargs if attention_mask is None else dict(hf_kwargs,
                                                              attention_mask=attention_mask)
        return model.generate(input_ids, **given)
    return _generate(model, input_ids, attention_mask, hf_kwargs, grape_args, fallback,
                     "grape.generate runs model.generate instead")


def _concurrent(asked: bool | None, compiled: bool) -> bool:
    """Whether a step runs as its DAG: as asked, or by default where its kernels are the
    model's own (a compiled step's are launched where the pass cannot see them)."""
    return not compiled if asked is None else asked


@dataclass(frozen=True)
class _GrapeArgs:
    """grape's own arguments of a generate call (generate's are its keyword arguments)."""

    seed: int | None
    compile: bool
    exact_lengths: bool | None
    cache_length: int | None
    prompt_bucket: int | None
    concurrent: bool | None  # None: as the step is compiled or not
    switch_experts: bool | None = None  # None: the experts that would read back


def _generate(model: torch.nn.Module, input_ids: torch.Tensor,
              attention_mask: torch.Tensor | None, hf_kwargs: dict[str, Any], args: _GrapeArgs,
              fallback: Callable[[], Any], falling_back: str, wrapped: bool = False) -> Any:
    """One generation graphed, or ``fallback()`` after a warning that starts with
    ``falling_back`` and says why. ``wrapped``: a call a model's own generate made of the
    generic loop (``resolve``)."""
    compile, prompt_bucket, exact_lengths = args.compile, args.prompt_bucket, args.exact_lengths
    try:
        options, mask = resolve(model, input_ids, attention_mask,
                                {k: v for k, v in hf_kwargs.items() if k not in _DECODER_PROMPT},
                                wrapped)
        embeds = hf_kwargs.get("inputs_embeds")
        source = input_ids if embeds is None else embeds  # the cache's prompt
        input_ids = sequence_head(input_ids, embeds)
        options, decoder_ids, decoder_mask, decoder_copied = decoder_prompt(
            model, options, input_ids, *(hf_kwargs.get(k) for k in _DECODER_PROMPT))
        # (a bucket's padding is masked: the positions count the caller's tokens)
        check_positions(model, options, source.shape[1])
        if prompt_bucket is not None and (options.source != "input_ids" or embeds is not None):
            raise GrapeError(f"expected prompt_bucket only with token prompts (it pads them), "
                             f"found {'inputs_embeds' if embeds is not None else options.source}")
        if args.cache_length is not None:  # the prompt as bucketed below
            length = source.shape[1]
            options = replace(options, cache_length=_cache_length(
                args.cache_length,
                length + -length % (prompt_bucket or 1) + options.max_new_tokens))
        if source.device.type != "cuda":
            raise NotGraphable(f"the model is on {source.device}, and graphs need a CUDA "
                               f"device")
        ids, mask, padded = bucketed(input_ids, mask, prompt_bucket or 1, options.pad)
        prompt = _Prompt(ids, mask, decoder_ids, decoder_mask, embeds,
                         tuple((k, hf_kwargs[k]) for k in options.model_inputs))
        def graphed(compiled: bool) -> Any:
            exact = exact_lengths if exact_lengths is not None else (
                not compiled and options.start is None  # (an encoder-decoder's are refused)
                and options.cache_tokens(prompt.length) >= EXACT_FROM
                and next(model.parameters()).dtype in (torch.float16, torch.bfloat16))
            once = functools.partial(
                _graphed_generate, model, prompt, caller_ids=input_ids,
                padded_bytes=padded + decoder_copied,
                concurrent=_concurrent(args.concurrent, compiled),
                switch_experts=args.switch_experts,
                syncs_before=int(decoder_ids is not None) + options.read_backs,
                # (one for the call: a loop run again streams what it makes)
                feed=None if options.streamer is None else TokenFeed(options.streamer))

            def run(exact: bool, warn_whole: bool) -> Any:
                try:
                    return once(options, args.seed, compiled, exact, warn_whole=warn_whole)
                except CandidatesOverflowed as e:
                    # Rare (grape.torch.sampling): the same draws over the whole vocabulary.
                    _LOG.info("grape.generate: more tokens tied with top-k's k-th score than "
                              "the sampler's candidates held; made again with generate's "
                              "warpers over the whole vocabulary")
                    out = once(replace(options, whole_vocabulary=True), e.seed, compiled,
                               exact, warn_whole=warn_whole)
                    last = last_stats()
                    _set_last(replace(last, launches=last.launches + 1,
                                      host_syncs=last.host_syncs + 1, resampled=True))
                    return out
            try:
                return run(exact, warn_whole=exact_lengths is True)
            except ExactRefused:
                if exact_lengths is not None:  # asked for: say so (below), and run generate
                    raise
                # Chosen by grape: the loop over the whole cache takes any mask and any cache.
                return run(False, warn_whole=False)

        if not compile:
            out = graphed(False)
        else:
            # What compilation cannot serve, the model's own kernels can: still one launch.
            # A refusal is kept per shape, so that later calls do not compile again to fail.
            refused = _CACHES.setdefault(model, _Cache()).uncompiled
            shape = (prompt.key, options.key)
            why = refused.get(shape)
            if why is None:
                try:
                    out = graphed(True)
                except (CompileRefused, *COMPILE_ERRORS) as e:
                    why = refused[shape] = (
                        str(e) if isinstance(e, CompileRefused) else
                        f"torch.compile failed on the step: {type(e).__name__}: {e}"
                    ).splitlines()[0]
            if why is not None:
                warnings.warn(f"grape.generate(compile=True): {why}; the step runs the model's "
                              f"own kernels instead", stacklevel=3)
                out = graphed(False)
        note_no_speech(options)  # (after the graphs: a fallback would record it itself)
        return out
    except (NotGraphable, CaptureError, UnsupportedError, GraphError) as e:
        reason = str(e).splitlines()[0]
    except COMPILE_ERRORS as e:  # (compile=True, where the uncompiled step failed too)
        reason = f"torch.compile failed on the step: {type(e).__name__}: {e}".splitlines()[0]
    warnings.warn(f"{falling_back}: {reason}", stacklevel=3)
    _set_last(GenerationStats(graphed=False, reason=reason))
    return fallback()


def _through_own_generate(model: torch.nn.Module, input_ids: Any,
                          attention_mask: torch.Tensor | None, hf_kwargs: dict[str, Any],
                          args: _GrapeArgs) -> Any:
    """The model's own ``generate`` as it is, each call it makes of ``GenerationMixin.generate``
    graphed (``grape.torch.own_generate``); ``last_stats`` sums the calls."""
    name = type(model).__name__
    calls: list[GenerationStats] = []

    def inner(model: torch.nn.Module, call_args: tuple, call_kwargs: dict) -> Any:

        def fallback() -> Any:
            return GenerationMixin.generate(model, *call_args, **call_kwargs)
        falling_back = (f"grape.generate runs {name}.generate's call of "
                        f"GenerationMixin.generate as it is")
        try:
            inputs, mask, kwargs = inner_arguments(model, call_args, call_kwargs)
            out = _generate(model, inputs, mask, kwargs, args, fallback, falling_back,
                            wrapped=True)
        except (NotGraphable, GrapeError) as e:
            # Inside the model's own generate grape is a guest: a call it cannot take as the
            # wrapper made it (Whisper's long-form windows pass the whole audio's mask beside
            # one window's features) runs as made, and an error of the caller's surfaces
            # there, as generate's own.
            reason = str(e).splitlines()[0]
            warnings.warn(f"{falling_back}: {reason}", stacklevel=2)
            _set_last(GenerationStats(graphed=False, reason=reason))
            out = fallback()
        calls.append(last_stats())
        return out

    given = hf_kwargs if attention_mask is None else dict(hf_kwargs, attention_mask=attention_mask)
    try:
        with routed(model, inner):
            result = model.generate(input_ids, **given)
    except NotGraphable as e:  # the class cannot be routed: its generate runs as it is
        reason = str(e).splitlines()[0]
        warnings.warn(f"grape.generate runs model.generate instead: {reason}", stacklevel=3)
        _set_last(GenerationStats(graphed=False, reason=reason))
        return model.generate(input_ids, **given)
    if not calls:
        reason = (f"{name}'s own generate never called GenerationMixin.generate, the part "
                  f"grape graphs")
        warnings.warn(f"grape.generate ran model.generate as it is: {reason}", stacklevel=3)
        _set_last(GenerationStats(graphed=False, reason=reason))
    else:
        _set_last(_summed(calls))
    return result


def _summed(calls: list[GenerationStats]) -> GenerationStats:
    """Several generations' stats as one call's: counts added, the last step's shape."""
    last = calls[-1]
    return replace(
        last, graphed=all(c.graphed for c in calls),
        reason=next((c.reason for c in calls if c.reason), ""),
        captured=any(c.captured for c in calls), capture_s=sum(c.capture_s for c in calls),
        copy_bytes=sum(c.copy_bytes for c in calls),
        pointer_updates=sum(c.pointer_updates for c in calls),
        prefill_graphed=all(c.prefill_graphed for c in calls),
        host_syncs=sum(c.host_syncs for c in calls), launches=sum(c.launches for c in calls),
        streamed_while_running=sum(c.streamed_while_running for c in calls))


def _cache_length(value: Any, least: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise GrapeError(f"expected cache_length to be an integer of at least the prompt's "
                         f"length plus max_new_tokens ({least}), found {value!r}")
    return value


def bucketed(input_ids: torch.Tensor, mask: torch.Tensor | None, bucket: int,
             pad: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``input_ids`` and ``mask`` (None: all ones) left-padded with ``pad`` and masked columns
    to a multiple of ``bucket`` tokens, and the bytes of the caller's tensors copied into the
    padded ones (0, and the caller's own tensors, where the length is a multiple already)."""
    rows, length = input_ids.shape[:2]  # (a speech source has a third dimension)
    extra = -length % bucket
    if not extra:
        return input_ids, mask, 0
    ones = torch.ones_like(input_ids) if mask is None else mask
    ids = torch.cat([input_ids.new_full((rows, extra), pad), input_ids], dim=1)
    padded = torch.cat([ones.new_zeros((rows, extra)), ones], dim=1)
    copied = input_ids.numel() * input_ids.element_size() + (
        0 if mask is None else mask.numel() * mask.element_size())
    return ids, padded, copied


def _graphed_generate(model: torch.nn.Module, prompt: _Prompt, options: Options,
                      seed: int | None, compiled: bool, exact: bool,
                      warn_whole: bool, caller_ids: torch.Tensor | None = None,
                      padded_bytes: int = 0, concurrent: bool = False,
                      switch_experts: bool | None = None, syncs_before: int = 0,
                      feed: TokenFeed | None = None) -> Any:
    """``caller_ids``: the prompt as the caller gave it, before ``bucketed`` padded it
    (``prompt.ids``); the result starts with it. ``padded_bytes``: what making ``prompt`` from
    the caller's tensors copied (bucketing, a decoder prompt's start token put before it);
    ``syncs_before``: the read-backs that took (a decoder prompt's check for its start
    token). ``feed``: the call's streamer, handed each token while the launch runs
    (``grape.torch.streaming``). ``switch_experts``: as ``generate`` takes it."""
    cache = _CACHES.setdefault(model, _Cache())
    # One generation at a time per model: its executables share the decoder's buffers (a
    # second thread's call of the same shape would overwrite them mid-generation).
    with cache.lock:
        key = (prompt.key, options.key, compiled, exact, concurrent, switch_experts)
        entry = cache.entries.get(key)
        captured = entry is None
        if entry is None:
            step_model = cache.step_model(model) if compiled else None
            group = group_of(model)
            try:
                with (experts_on_device(model, every=switch_experts is True)
                      if switch_experts is not False else contextlib.nullcontext()) \
                        as switched_from:
                    built, failure = _build(model, prompt, options, step_model, exact,
                                            warn_whole, concurrent), None
                built.experts_switched_from = switched_from
            except (NotGraphable, CaptureError, UnsupportedError, GraphError) as e:
                built, failure = None, e
            # Split over ranks: every rank graphs, or every rank falls back together (a rank
            # that fell back alone would leave the others waiting in their first all-reduce).
            if group is not None and not agree(failure is None, group):
                raise failure or NotGraphable("another rank could not graph its step")
            if failure is not None:
                raise failure
            entry = cache.entries[key] = built
        decoder = entry.decoder
        if isinstance(decoder, TokenDecoder) and options.strategy == "sample":
            decoder.set_seed(int(torch.randint(0, 2**62, ()).item()) if seed is None else seed)
            decoder.set_sampling(options)  # (the executable may be another temperature's)
        updates = 0
        if entry.inputs is None:
            prompt.prefill(decoder)
        else:
            updates = entry.inputs.point(entry.loop.graph, entry.loop.executable, prompt.tensors())
        head_ids = prompt.ids if caller_ids is None else caller_ids
        refreshed = copies = 0
        if compiled and cache.compiled is not None:
            # (copies of weights the compiled step reads laid otherwise, made again where the
            # weights changed in place: grape.torch.weight_rows)
            refreshed, copies = cache.compiled.refresh(), cache.compiled.copied_bytes()
        if feed is None:
            entry.loop.launch()
        else:
            feed.follow(decoder, decoder.sequence_head(head_ids, prompt.decoder_ids),
                        entry.loop.launch, prompt_inside=entry.inputs is not None)
        result = decoder.result(head_ids, prompt.decoder_ids)
        if feed is not None:
            feed.end()
        _set_last(GenerationStats(
            graphed=True, captured=captured, capture_s=entry.capture_s if captured else 0.0,
            copy_bytes=entry.copy_bytes + padded_bytes, pointer_updates=updates,
            prefill_graphed=entry.inputs is not None, host_syncs=1 + syncs_before,
            launches=1, attention=entry.attention, step_nodes=len(entry.loop.capture.ir),
            step_depth=(entry.loop.concurrency["body"].depth
                        if "body" in entry.loop.concurrency else len(entry.loop.capture.ir)),
            streamed_while_running=0 if feed is None else feed.while_running,
            compiled=compiled, experts_switched_from=entry.experts_switched_from,
            weight_copy_bytes=copies, weight_copies_refreshed=refreshed,
            dependent_edges=entry.loop.programmatic_edges.get("body", 0)))
        return result
