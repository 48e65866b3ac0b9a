"""Every causal-LM architecture transformers ships, through ``grape.generate`` (GPU).

grape was built and measured on ten architectures (``generate.py``); users bring others. This
builds each model type in ``transformers``' causal-LM mapping from a small config with random
weights (bf16 by default), runs ``generate`` with a static cache (the reference,
deterministic kernels where PyTorch has them) and ``grape.generate`` on the same prompts,
greedy, batch 1 and batch 2 with left padding, and says for each: whether grape graphed it
(and the fallback's one-line reason where not), whether its tokens equal the reference's
(and where not, which side grape's own step run eagerly agrees with), and where anything
failed, the stage and the error's first line. Nothing is tuned per architecture: the small
config is the same for all, and a model type whose config or ``generate`` refuses it is
reported as such (``stage``), not patched.

One JSON line per (architecture, batch) on stdout and in ``--out`` as it completes, so a run
cut by its time limit keeps what it measured; ``--workers N`` splits the architectures over
N processes on the one GPU (the models are small: correctness, not speed, is measured).

Run on a GPU: python benchmarks/arch_sweep.py --out FILE [--archs a,b] [--workers N]
[--strategies greedy,beam3]. ``--host-loop`` runs grape's step (the one it captures) driven by
the host instead of ``grape.generate``: its tokens against ``generate``'s on any device, the CPU
included, where ``grape.generate`` itself would only fall back; with ``--check-decode-masks``
every decode step's mask is also taken as under a capture and held to ``transformers``'
(``grape.torch.decode_mask.checked``); with ``--check-read-backs`` one decode step also runs as
a capture would see it (``grape.torch.readback.as_captured``), and the row says whether it reads
a value back to the host, which a capture refuses, and at which line of the model: the CPU's
forecast of a capture that breaks. Without ``--concurrent`` the sweep runs
``grape.generate(concurrent=False)``; with it, ``concurrent=True``, ``grape.generate``'s default
(the step's independent operations side by side, ``grape.passes.concurrency``): its tokens
against ``generate``'s say whether the reordering kept every dependency, and each row gives the
step's ``step_nodes`` and ``step_depth`` (nodes on its longest path). ``--seq2seq`` sweeps the
encoder-decoder models of ``transformers``' sequence-to-sequence mapping instead (T5, BART,
Marian...), at the same small size with the encoder's and decoder's own fields set alike;
``--speech`` those of its speech-to-text mapping (Speech2Text, SpeechT5, Whisper...), whose
source is random samples or features of the size their config names, laid out as their encoder
takes them (``speech_source``), the second row a shorter clip padded at its end (token ids, as
for the others, where that is what the model's main input is). ``--strategies sample`` (with
``--host-loop``) samples with temperature, top-k and top-p: ``generate``'s draws are
``torch.multinomial``'s, so no reference; the row counts every draw whose survivors differ
from ``generate``'s warpers over the same scores (``survivors_differ``; their top-p sort made
stable, as a GPU's is), and its "tokens equal" means none did and the same seed made the same
tokens again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# One small size for every architecture: the fields most configs share, by their common names
# (configs map them onto their own through attribute_map where they call them otherwise).
SMALL = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 4000,
         "head_dim": 64, "max_position_embeddings": 512}
# Mixture-of-experts configs' names for their experts' count and sizes: left at their
# defaults (up to 256 experts) a dozen MoE models exceed the CPU's bound below, and on a GPU
# they spend the sweep's time on parameters rather than on routing, which 8 experts with 2
# chosen per token exercise as well. (A config that refuses 2 per token, Zaya's, keeps its
# own count.)
SMALL |= {"num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8,
          "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 256,
          "shared_expert_intermediate_size": 256}
# Latent attention's own sizes (DeepSeek's defaults: ranks of 512 and 1,536).
MLA_SMALL = {"kv_lora_rank": 64, "q_lora_rank": 128, "qk_rope_head_dim": 32, "head_dim": 32,
             "qk_nope_head_dim": 32, "v_head_dim": 64}
# Dynamic sparse attention's keys per query (2,048 by default): fewer than a sweep's sequence
# holds, so that which keys its indexer picks matters (its keys' cache read, reordered by beam).
SMALL |= {"index_topk": 8}
# Sliding windows shorter than the sweep's prompt and generation (16 + 24 tokens), so that a
# window's roll and mask offset are exercised (Mistral's default window is 4,096 tokens,
# Gemma 3's 512 to 1,024, GPT-OSS's 128); per-layer embeddings' sizes (Gemma 3n's and 4's
# 262,144 x 256 a layer otherwise); one layer reading an earlier one's keys (Gemma 3n's 15 of 35
# by default, more than two layers hold).
# Given only to configs that define them: transformers reads some of them on any config (a
# static cache makes every layer a sliding one where a config has a window and no layer types,
# and drops the last num_kv_shared_layers layers' caches).
DEFINED_SMALL = {"sliding_window": 8, "vocab_size_per_layer_input": 4000,
                 "hidden_size_per_layer_input": 64, "num_kv_shared_layers": 1,
                 # Mamba-2's chunked scan in PyTorch holds (rows, chunk, chunk, heads, state)
                 # floats: 8 GiB a row at Bamba's, Falcon-H1's and Granite-MoE-Hybrid's
                 # defaults, which ran generate's 3-beam references out of memory (48 GiB
                 # asked on an 80 GB H100)
                 "mamba_d_state": 16, "mamba_chunk_size": 64}
# Configs that name their sizes otherwise keep their defaults: up to hundreds of millions of
# parameters are still quick on a GPU; past these bounds each integer field is shrunk by its
# name (shrunk_by_name), and what still exceeds them is refused (two ended the first CPU sweep).
MAX_PARAMETERS = {"cuda": 1_000_000_000, "cpu": 100_000_000}
# Encoder-decoder configs' own names for the same sizes (each config keeps those it knows).
SEQ2SEQ_SMALL = {"encoder_layers": 2, "decoder_layers": 2, "num_layers": 2,
                 "num_decoder_layers": 2, "encoder_attention_heads": 4,
                 "decoder_attention_heads": 4, "encoder_ffn_dim": 512, "decoder_ffn_dim": 512,
                 "d_model": 256, "d_ff": 512, "d_kv": 64, "num_heads": 4}
STRATEGIES = {"greedy": {}, "beam3": {"num_beams": 3},
              # (host loop only: grape's draws are its own, so generate is no reference)
              "sample": {"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9}}
CONTEXT_LOST = 3  # a worker's exit status after a CUDA error
NEW_TOKENS = [24]  # --new-tokens: fewer for a quick scan of what each step reads back
PROMPT = 16


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


SEQ2SEQ = [False]  # --seq2seq: encoder-decoder models
SPEECH = [False]  # --speech: speech-to-text encoder-decoder models


def architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    )

    return sorted(MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES if SPEECH[0]
                  else MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES if SEQ2SEQ[0]
                  else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _auto() -> Any:
    """The Auto class that builds the swept kind of model."""
    import transformers

    return (transformers.AutoModelForSpeechSeq2Seq if SPEECH[0]
            else transformers.AutoModelForSeq2SeqLM if SEQ2SEQ[0]
            else transformers.AutoModelForCausalLM)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _layer_kinds(config: Any) -> list[str] | None:
    """Each layer's kind, where the config lists them (hybrids of attention and recurrence;
    a composite config's in its text part)."""
    for part in (config, config.get_text_config()):
        for name in ("layer_types", "layers_block_type"):
            kinds = getattr(part, name, None)
            if isinstance(kinds, list | tuple) and kinds and all(isinstance(k, str)
                                                                  for k in kinds):
                return list(kinds)
    return None


def _attends(kinds: list[str]) -> bool:
    return any(("attention" in k and "linear" not in k) or k == "hybrid" for k in kinds)


# Windows by other names, which a sequence as short as the sweep's never reaches (GPT-Neo's
# local layers' 256 tokens, Llama 4's chunks of 8,192): they test nothing, and are given the
# sliding window's size where a config's exceeds the sweep's prompt and generation (Granite
# Speech's projector window of 15 stays). Not Doge's keep_window_size (2,048): past it, its
# top-k over every cache position makes its logits depend on the static cache's length, so
# that no two cache sizes (generate's static, its dynamic, grape's) give the same tokens.
WINDOWS = ("window_size", "attention_chunk_size")


def _defined(default: Any) -> dict[str, Any]:
    """The DEFINED_SMALL sizes a config defines (and not as 0 or None). An encoder-decoder's
    window lies between its source (PROMPT tokens) and its decoder's generation: transformers'
    static cross-attention cache would cut a shorter one's source keys to the window, which
    grape refuses (T5Gemma's)."""
    sizes = {k: v for k, v in DEFINED_SMALL.items() if getattr(default, k, None)}
    sizes |= {k: DEFINED_SMALL["sliding_window"] for k in WINDOWS
              if isinstance(v := getattr(default, k, None), int) and v > PROMPT + NEW_TOKENS[0]}
    if "sliding_window" in sizes and (SEQ2SEQ[0] or SPEECH[0]):
        sizes["sliding_window"] = PROMPT + 4
    if hasattr(default, "decoder_layers") and not (SEQ2SEQ[0] or SPEECH[0]):
        # The causal-LM head of an encoder-decoder family (BartForCausalLM) runs its decoder's
        # layers, while transformers sizes a static cache by num_hidden_layers, which such a
        # config maps to its encoder's: the two kept equal, as the seq2seq sizes have them
        # (else generate itself fails, on a cache layer that does not exist).
        sizes |= {k: v for k, v in SEQ2SEQ_SMALL.items() if hasattr(default, k)}
    if hasattr(default, "is_decoder") and not (SEQ2SEQ[0] or SPEECH[0]):
        # An encoder's causal-LM head (BERT's family) is a decoder only when its config says
        # so ("add is_decoder=True", as transformers warns); left False it attends both ways,
        # over a static cache's unwritten tail too, and grape refuses it for that.
        sizes["is_decoder"] = True
    return sizes


def _layer_pattern(default: Any, layers: int) -> dict[str, Any]:
    """A layer pattern a config keeps as (kinds, repeats) pairs (GPT-Neo's attention_types,
    whose expansion must have one kind a layer): its first kinds over ``layers``."""
    pattern = getattr(default, "attention_types", None)
    if (isinstance(pattern, list) and pattern and isinstance(pattern[0], list | tuple)
            and len(pattern[0]) == 2 and isinstance(pattern[0][0], list)):
        kinds = pattern[0][0]
        if layers % len(kinds) == 0:
            return {"attention_types": [[kinds, layers // len(kinds)]]}
        return {"attention_types": [[kinds[:1], layers]]}
    return {}


# Fields that keep a model's first layers dense (DeepSeek-V3's first three), make every k-th
# layer sparse (NLLB-MoE's fourth) or count the sparse layers among the rest (Switch
# Transformers' 3 of 12, one every 12 // 3): past the small depth, no layer routes and the
# experts never run. Each is made the small depth less one where it reaches that depth.
SPARSE_PLACEMENT = re.compile(r"^(first_k_dense_replace|num_dense_layers|moe_layer_start_index"
                              r"|\w*sparse_step|num_sparse_\w*layers)$")


def _experts_placed(default: Any, layers: int) -> dict[str, Any]:
    """A mixture of experts' placement at the small sizes: the dense prefix ending before the
    last layer, or the sparse layers' period within the small depth, so that a layer routes;
    expert groups of two experts at least, half of the groups chosen (DeepSeek-V3's routing
    takes each group's best two: its 8 groups of the small 8 experts hold one each, and
    AXK1's routing failed there)."""
    fields = default.to_dict()
    out = {name: layers - 1 for name, value in fields.items()
           if SPARSE_PLACEMENT.match(name) and isinstance(value, int) and value >= layers}
    groups, experts = getattr(default, "n_group", None), SMALL["n_routed_experts"]
    if isinstance(groups, int) and groups > 1 and experts // groups < 2:
        out["n_group"] = experts // 2
        out["topk_group"] = max(1, min(getattr(default, "topk_group", None) or 1,
                                       out["n_group"] // 2))
    return out


def _ids_in_vocabulary(config: Any) -> Any:
    """``config`` with every token id it names inside its vocabulary: the small vocabulary
    leaves ids a checkpoint's vocabulary held (Whisper's decoder start 50257, Marian's 58100)
    pointing past the embedding, and generate then indexes out of range (a device-side assert
    on a GPU, which ends the worker's CUDA context). Each such id becomes the next id above
    the sweep's bos, eos and pad (1, 2, 0) not taken yet; ids in lists (tokens to suppress)
    past the vocabulary are dropped. Sub-configs (a text config) are treated the same."""
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int):
        spare = iter(range(3, vocab))
        for name, value in list(vars(config).items()):
            if name.endswith("_token_id") and isinstance(value, int) and value >= vocab:
                setattr(config, name, next(spare))
            elif (name.endswith("_tokens") and isinstance(value, list | tuple)
                  and all(isinstance(v, int) for v in value)):
                setattr(config, name, type(value)(v for v in value if v < vocab))
    for value in vars(config).values():
        if hasattr(value, "to_dict") and hasattr(value, "vocab_size"):
            _ids_in_vocabulary(value)
    return config


MOST_LAYERS = 12  # the deepest a small hybrid is grown to find an attention layer


def small_configs(model_type: str, seq2seq_sizes: bool = False) -> list[Any]:
    """The small config, and before it, for a hybrid whose layer pattern puts its first
    attention layer past the second (Jamba's at the fifth, Qwen3-Next's at the fourth), the
    same with the fewest layers, up to ``MOST_LAYERS``, that hold one, then the next deeper
    (or with one placed in the last layer, where the defaults hold none at any depth): with
    linear layers alone Hugging Face's static cache refuses most such models, so two layers
    would test neither their attention nor grape's on it. The first that builds is used."""
    import transformers

    # A composite config (a vision-language model's text and vision configs, Mllama's,
    # Llama 4's, Qwen3.5's) takes its sizes in its parts: each part is given the small sizes
    # too, where the config accepts them so (billions of parameters otherwise).
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    parts = [name for name, value in vars(transformers.AutoConfig.for_model(model_type)).items()
             if isinstance(value, transformers.PretrainedConfig)]

    default = transformers.AutoConfig.for_model(model_type)

    def config(layers: int, **extra: Any) -> Any:
        sizes = {**SMALL, **(SEQ2SEQ_SMALL if SEQ2SEQ[0] or SPEECH[0] or seq2seq_sizes else {}),
                 **_defined(default), **_experts_placed(default, layers),
                 "num_hidden_layers": layers, **_layer_pattern(default, layers), **extra}
        if parts:
            try:
                made = transformers.AutoConfig.for_model(
                    model_type, **sizes,
                    **{p: {**SMALL, **_defined(getattr(default, p)),
                           **_experts_placed(getattr(default, p), layers),
                           "num_hidden_layers": layers,
                           **ids} for p in parts}, **ids)
            except Exception:
                pass  # the parts keep their defaults
            else:
                sizes.update({p: getattr(made, p).to_dict() for p in parts})
        while True:
            try:
                made = transformers.AutoConfig.for_model(model_type, **sizes, bos_token_id=1,
                                                         eos_token_id=2, pad_token_id=0)
                break
            except AttributeError as e:
                # A size the config derives itself (Falcon's head_dim, a property without a
                # setter): left to the config.
                derived = re.match(r"property '(\w+)' of", str(e))
                if not derived or derived[1] not in sizes:
                    raise
                del sizes[derived[1]]
            except NotImplementedError as e:
                # A config that refuses num_hidden_layers (ProphetNet's) and names the
                # fields it takes instead: each given the count.
                named = re.findall(r"`(num_\w+layers)`", str(e))
                if "num_hidden_layers" not in sizes or not named:
                    raise
                layers = sizes.pop("num_hidden_layers")
                sizes.update({name: layers for name in named if name != "num_hidden_layers"})
            except Exception as e:
                # Mamba-2's heads: as many as its inner width holds at the small head size.
                heads = re.search(r"hidden_size \* expand \((\d+)\) must equal num_heads \* "
                                  r"head_dim", str(e))
                if heads and "num_heads" not in sizes:
                    sizes["num_heads"] = int(heads[1]) // sizes["head_dim"]
                    continue
                # A layer pattern the config lists in full, whatever the count (Zamba's):
                # its first layers.
                kinds = _layer_kinds(default)
                if "layer_types" in str(e) and kinds and "layer_types" not in sizes:
                    sizes["layer_types"] = kinds[:layers]
                    continue
                if sizes.pop("num_experts_per_tok", None) is None:
                    raise
        if getattr(made, "kv_lora_rank", None):
            # Latent attention (DeepSeek's MLA) makes keys and values for every query head,
            # yet its attention repeats them by the config's groups: its configs keep as
            # many key-value heads as query heads.
            made = transformers.AutoConfig.for_model(
                model_type, **{**sizes, **MLA_SMALL,
                               "num_key_value_heads": made.num_attention_heads},
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
        return made

    n = SMALL["num_hidden_layers"]
    small = _ids_in_vocabulary(config(n))
    kinds = _layer_kinds(small)
    if kinds is None or _attends(kinds):
        return [small]
    # Every depth up to MOST_LAYERS whose pattern holds attention, shallowest first: a model
    # may refuse the first (Zamba's shared attention block is tied across its hybrid layers,
    # and transformers refuses a tie with one such layer alone: eight layers hold two).
    grown = [c for c in (_ids_in_vocabulary(config(layers))
                         for layers in range(n + 1, MOST_LAYERS + 1))
             if _attends(_layer_kinds(c) or [])]
    # Defaults that place no attention layer at any depth (Bamba's, Granite-MoE-Hybrid's):
    # their checkpoints name where it goes. The last of the small config's layers, by the
    # field the config takes.
    for extra in ({"attn_layer_indices": [n - 1]},
                  {"layer_types": [*kinds[:n - 1], "full_attention"]}):
        if grown or next(iter(extra)) not in default.to_dict():  # (a field it takes)
            continue
        try:
            placed = _ids_in_vocabulary(config(n, **extra))
        except Exception:  # (the config names its kinds otherwise)
            continue
        if _attends(_layer_kinds(placed) or []):
            grown.append(placed)
            break
    return [*grown, small]


# Fields shrunk by their names alone, in a config and every config inside it, where the small
# config leaves too many parameters (the config names its sizes its own way, or keeps them in
# parts of its parts: an encoder's text config): a name's last words say what it counts.
LAYERS = re.compile(r"(^|_)(layers|layer_num|num_layers|depth)$|^num_\w*layers$")
BY_NAME = (
    (LAYERS, 2),
    (re.compile(r"expert\w*(ffn|intermediate|hidden)\w*(size|dim)$"), 256),
    (re.compile(r"(ffn|intermediate|mlp)\w*(size|dim)$"), 512),
    (re.compile(r"vocab(_size)?$|^vocab_\w+|_vocab$"), 4000),
    (re.compile(r"(^|_)(num_\w*experts|experts?_num|n_\w*experts)$"), 8),
    (re.compile(r"^hidden_size(_\w+)?$|^(d_model|embed_dim|hidden_dim|n_embd)$"), 256),
    (re.compile(r"(^|_)(num_attention_heads|num_heads|n_heads|attention_heads)$"), 4),
)
KV_HEADS = ("num_key_value_heads", "num_kv_heads")


def _every_kind(kinds: list[Any], n: int) -> list[Any]:
    """The first ``n`` of a per-layer list, with each kind it holds kept where ``n`` allows (a
    Gemma-like pattern of five sliding layers to one full: sliding, full), as a real config of
    any depth has them all (transformers' masks for the kinds present, and a model that reads
    one of each)."""
    missing = [k for k in dict.fromkeys(kinds) if k not in kinds[:n]]
    if len(dict.fromkeys(kinds)) > n:
        return kinds[:n]  # more kinds than layers: the first layers
    return kinds[:n - len(missing)] + missing


def shrunk_by_name(config: Any) -> Any:
    """``config`` with each integer field whose name matches ``BY_NAME`` at most that size, in
    it and in every config it holds, recursively (a composite config's text config inside its
    encoder's): a fallback for configs the common names do not reach. Heads' sizes follow the
    hidden size where the config derives them (a ``head_dim`` it keeps is left); a list with
    one entry per layer (``layer_types``) is cut to the new count with a layer of each kind
    kept (``_every_kind``)."""
    def shrink(fields: dict[str, Any]) -> dict[str, Any]:
        out, layers = {}, {}
        for name, value in fields.items():
            if isinstance(value, dict):
                out[name] = shrink(value)
                continue
            out[name] = value
            if isinstance(value, int) and not isinstance(value, bool):
                for pattern, most in BY_NAME:
                    if pattern.search(name):
                        out[name] = min(value, most)
                        if pattern is LAYERS and value > most:
                            layers[value] = most  # lists of that many entries: one a layer
                        break
        for name, value in out.items():
            if isinstance(value, list) and len(value) in layers and name.startswith("layer"):
                out[name] = _every_kind(value, layers[len(value)])
        heads = next((out[h] for h in ("num_attention_heads", "num_heads") if h in out), None)
        for name in KV_HEADS:
            if isinstance(heads, int) and isinstance(out.get(name), int):
                out[name] = min(out[name], heads)  # as many as the query heads at most
        return out

    return type(config).from_dict(shrink(config.to_dict()))


class NotBuilt(Exception):
    """transformers could not make a model type's model from the sweep's small config: a limit
    of the sweep's configs (or a model needing a library not installed), before grape runs."""


def build(model_type: str, device: str, dtype: Any):
    import torch

    try:
        config = sized_config(model_type, device)
        torch.manual_seed(0)
        with torch.device(device):  # made where it runs: a large one initialises fast there
            model = _auto().from_config(config,
                                        dtype=dtype if device == "cuda" else torch.float32)
    except Exception as e:
        raise NotBuilt(_first_line(e)) from e
    # (a parameter made by the legacy torch.Tensor constructor, SpeechT5's masked_spec_embed,
    # ignores the device context: moved as a user's .to(device) moves it)
    return model.to(device).eval()


def sized_config(model_type: str, device: str) -> Any:
    """The config ``build`` makes ``model_type``'s model from on ``device`` ("cpu", "cuda")."""
    import torch

    *grown, config = small_configs(model_type)
    # Counted on the meta device first: a config that names its sizes otherwise keeps its
    # full defaults (billions of parameters: two such ended the first sweep out of memory).
    # (A grown hybrid whose attention layer cannot be built at the small size, Qwen4-exp's
    # sparse attention, is left at two layers.)
    for candidate in grown:
        try:
            with torch.device("meta"):
                _auto().from_config(candidate)
        except Exception:
            continue
        config = candidate
        break
    try:
        with torch.device("meta"):
            count = sum(p.numel() for p in _auto().from_config(config).parameters())
    except Exception:
        # An encoder-decoder's decoder built alone (Whisper's, PLBart's) takes its sizes by
        # the encoder-decoder names.
        config = small_configs(model_type, seq2seq_sizes=True)[-1]
        with torch.device("meta"):
            count = sum(p.numel() for p in _auto().from_config(config).parameters())
    if count > MAX_PARAMETERS["cpu"]:
        # Sizes named otherwise, or in parts of parts: every part shrunk by its fields' names.
        # Against the CPU's bound on every device, so that a GPU builds the model the CPU
        # checked (BLT, 779 million parameters at the common sizes, with parts left at their
        # defaults that do not fit each other: generate itself failed on the H100); a config
        # that does not shrink so stays as it is where the device's bound allows it.
        try:
            nested = shrunk_by_name(config)
            with torch.device("meta"):
                smaller = sum(p.numel() for p in _auto().from_config(nested).parameters())
        except Exception:
            smaller = count
        most = MAX_PARAMETERS[device]
        if smaller <= MAX_PARAMETERS["cpu"] or (most < count and smaller <= most):
            config = nested
        elif count > most:
            raise ValueError(f"expected at most {most:,} parameters at the small size, found "
                             f"{count:,} (the config names its sizes otherwise; "
                             f"{smaller:,} with its fields shrunk by name)")
    return config


def one(model_type: str, device: str, dtype: Any, strategies: list[str],
        host_loop: bool) -> list[dict[str, Any]]:
    """The rows of one architecture: one per batch and strategy, or one saying which stage
    failed."""
    import torch

    began = time.perf_counter()
    try:
        model = build(model_type, device, dtype)
    except Exception as e:  # the config or model refusing a small size is a row
        return [{"arch": model_type, "stage": "build", "error": _first_line(e)}]
    rows = []
    vocab = model.config.get_text_config().vocab_size
    for strategy in strategies:
        for batch in (1, 2):
            row: dict[str, Any] = {"arch": model_type, "batch": batch, "strategy": strategy,
                                   "way": "host_loop" if host_loop else
                                   "grape_concurrent" if CONCURRENT[0] else "grape",
                                   "model_class": type(model).__name__}
            g = torch.Generator().manual_seed(100 + batch)
            if SPEECH[0] and model.main_input_name != "input_ids":  # (Pop2Piano's is ids)
                try:
                    ids, mask = speech_source(model, batch, g, device)
                except ValueError as e:
                    row.update(stage="source", error=_first_line(e))
                    rows.append(row)
                    continue
                ids, mask = ids.to(device, model.dtype), mask if mask is None else mask.to(device)
            else:
                ids = torch.randint(3, vocab, (batch, PROMPT), generator=g).to(device)
                mask = torch.ones_like(ids)
                mask[1:, : PROMPT // 4] = 0  # left padding, as generate takes unequal prompts
            kw = dict({"do_sample": False}, max_new_tokens=NEW_TOKENS[0], eos_token_id=None,
                      pad_token_id=0, **STRATEGIES[strategy])
            if strategy == "sample":
                _sampled_row(model, ids, mask, kw, row)
                rows.append(row)
                continue
            reference = _reference(model, ids, mask, kw, row)
            if reference is not None:
                (_host_loop_row if host_loop else _graphed_row)(model, ids, mask, kw, reference,
                                                                 row)
            rows.append(row)
    for row in rows:
        row["seconds"] = round(time.perf_counter() - began, 2)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


# Config fields that name a speech encoder's feature size, and how long a random clip is.
FEATURE_FIELDS = ("input_feat_per_channel", "num_mel_bins", "feature_size",
                  "feature_projection_input_dim")
SAMPLES, FRAMES = 4000, 64


def speech_source(model, batch: int, generator, device: Any) -> tuple[Any, Any]:
    """What a speech model's encoder takes, at random: raw samples (``input_values``), or
    features (``input_features``) of the size its config names, as (batch, frames, features)
    or (batch, features, frames), whichever the encoder runs on (at ``FRAMES`` frames, or the
    length its config fixes: twice its ``max_source_positions``); with a mask over samples or
    frames where they come first, the second row a shorter clip padded at its end (None
    otherwise: a mask over the last dimension is not what generate takes there)."""
    import torch

    name, config = model.main_input_name, model.config
    if name == "input_values":
        layouts = [(batch, SAMPLES)]
    elif name == "input_features":
        # (a composite config names it in its encoder's part: Canary's, Cohere-ASR's)
        parts = [config, *(v for v in vars(config).values()
                           if hasattr(v, "to_dict") and hasattr(v, "model_type"))]
        size = next((getattr(p, f) for p in parts for f in FEATURE_FIELDS
                     if isinstance(getattr(p, f, None), int)), None)
        if size is None:
            raise ValueError(f"expected the config to name its feature size by one of "
                             f"{FEATURE_FIELDS}, found none")
        frames = dict.fromkeys((FRAMES, 2 * getattr(config, "max_source_positions", FRAMES)))
        layouts = [(batch, t, size) for t in frames] + [(batch, size, t) for t in frames]
    else:
        raise ValueError(f"expected input_values or input_features as the main input, found "
                         f"{name}")
    errors = []  # (probed on the device the model was built on: some keep a table on the CPU)
    for shape in layouts:
        source = torch.randn(shape, generator=generator)
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.get_encoder()(**{name: source.to(device, model.dtype)})
        except Exception as e:
            errors.append(f"{shape}: {_first_line(e)}")
            continue
        if len(shape) == 3 and shape[2] != size and shape[1] == size:  # (batch, features, frames)
            return source, None
        mask = torch.ones(shape[:2], dtype=torch.long)
        mask[1:, shape[1] * 3 // 4:] = 0
        return source, mask
    raise ValueError(f"expected the encoder to run on one of {layouts}, found: {errors[0]}")


def _reference(model, ids, mask, kw, row: dict[str, Any]):
    """generate with a static cache (grape's layout, so the same kernels), else with the
    model's own cache, said in the row (its tokens may then differ by the last bit of an
    attention kernel, not by a wrong step); None, with the row saying why, where neither ran."""
    errors = []
    for cache in ("static", None):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                extra = {"cache_implementation": cache} if cache else {}
                reference = model.generate(ids, attention_mask=mask, disable_compile=True,
                                           **extra, **kw)
            row["reference_cache"] = cache or "default"
            if errors:
                row["static_cache_error"] = errors[0]
            return reference
        except Exception as e:
            errors.append(_first_line(e))
    row.update(stage="reference", error=" / ".join(errors))
    return None


def _fell_back(message: str) -> bool:
    return "runs model.generate" in message or "GenerationMixin.generate as it is" in message


def _graphed_row(model, ids, mask, kw, reference, row: dict[str, Any]) -> None:
    import grape
    from grape.torch.api import last_stats

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = grape.generate(model, ids, mask, concurrent=CONCURRENT[0], **kw)
            stats = last_stats()
    except Exception as e:  # grape promises a fallback, never a traceback
        row.update(stage="grape", error=_first_line(e),
                   where=traceback.format_exc().strip().splitlines()[-3:])
        return
    # (a model with a generate of its own falls back call by call: "runs X.generate's call of
    # GenerationMixin.generate as it is: why")
    fell = [str(w.message).splitlines()[0] for w in caught if _fell_back(str(w.message))]
    row.update(stage="done", graphed=bool(stats and stats.graphed),
               prefill_graphed=bool(stats and stats.prefill_graphed),
               fallback=fell[0][:900] if fell else None,
               other_warnings=sorted({str(w.message).splitlines()[0][:400] for w in caught
                                      if not _fell_back(str(w.message))})[:3])
    if CONCURRENT[0] and stats is not None and stats.graphed:
        row.update(step_nodes=stats.step_nodes, step_depth=stats.step_depth)
    _compare(out, reference, row)
    if not row["tokens_identical"] and out.shape == reference.shape and row["graphed"]:
        # a fallback's tokens are generate's own, with its cache: only graphed rows differ
        row.update(_which_side(model, ids, mask, kw, out, reference))


def _host_loop_row(model, ids, mask, kw, reference, row: dict[str, Any]) -> None:
    """grape's own step, the one it captures, driven by the host (any device, the CPU
    included; grape.torch.host_loop): its tokens against generate's, or the reason grape
    refuses the model. A model whose class has its own generate runs it, its calls of the
    generic loop driven so (grape.torch.own_generate), as grape.generate runs it."""
    from grape.torch import decode_mask
    from grape.torch.host_loop import generate_on_host
    from grape.torch.options import NotGraphable
    from grape.torch.own_generate import owns_generate

    calls = []
    try:
        with warnings.catch_warnings(), (decode_mask.checked() if CHECK_MASKS[0]
                                         else contextlib.nullcontext()) as counts:
            warnings.simplefilter("ignore")
            # (check_written: as grape.generate checks before capture)
            out = generate_on_host(model, ids, mask, check_written=True, calls=calls, **kw)
        if owns_generate(model):
            row["own_generate_calls"] = len(calls)
        if counts is not None:
            row.update(decode_masks_viewed=counts["viewed"], decode_masks_built=counts["built"])
    except NotGraphable as e:
        row.update(stage="done", graphed=False, fallback=str(e)[:900])
        return
    except Exception as e:  # in grape.generate, caught only around the model's own code
        row.update(stage="grape", error=_first_line(e),
                   where=traceback.format_exc().strip().splitlines()[-3:])
        return
    row.update(stage="done", graphed=True)  # would be captured: the host loop ran it
    _compare(out, reference, row)
    if CHECK_REORDERING[0]:
        row.update(_reordering(calls[-1]))
    if CHECK_READ_BACKS[0]:
        row.update(_read_backs(calls[-1]))


def _sampled_row(model, ids, mask, kw, row: dict[str, Any]) -> None:
    """Sampling through grape's step driven by the host: every draw's survivors against
    generate's warpers over the same processed scores (its top-p sort made stable, as a GPU's
    is), where the candidates' sampler serves (``grape.torch.sampling``), and the tokens made
    again for the same seed. generate's own draws are torch.multinomial's, so its tokens are
    no reference here."""
    import torch
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from grape.torch.host_loop import generate_on_host
    from grape.torch.options import NotGraphable
    from grape.torch.sampling import CandidateSampler

    draw, unstable = CandidateSampler.draw, torch.sort
    counts = {"draws": 0, "rows_compared": 0, "survivors_differ": 0, "rows_overflowed": 0}

    def stable(input, dim=-1, descending=False, stable=False, **rest):
        return unstable(input, dim=dim, descending=descending, stable=True, **rest)

    def checked(self, scores, uniform):
        _, index, kept, overflowed = self.candidates(scores)
        ours = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, index, kept)
        torch.sort = stable
        try:
            theirs = TemperatureLogitsWarper(kw["temperature"])(None, scores)
            theirs = TopKLogitsWarper(kw["top_k"])(None, theirs)
            theirs = torch.isfinite(TopPLogitsWarper(kw["top_p"])(None, theirs))
        finally:
            torch.sort = unstable
        fits = ~overflowed
        counts["draws"] += 1
        counts["rows_compared"] += int(fits.sum())
        counts["rows_overflowed"] += int(overflowed.sum())
        counts["survivors_differ"] += int((ours[fits] != theirs[fits]).any(-1).sum())
        return draw(self, scores, uniform)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            CandidateSampler.draw = checked
            try:
                out = generate_on_host(model, ids, mask, seed=3, check_written=True, **kw)
            finally:
                CandidateSampler.draw = draw
            again = generate_on_host(model, ids, mask, seed=3, **kw)
    except NotGraphable as e:
        row.update(stage="done", graphed=False, fallback=str(e)[:900])
        return
    except Exception as e:
        row.update(stage="grape", error=_first_line(e),
                   where=traceback.format_exc().strip().splitlines()[-3:])
        return
    row.update(stage="done", graphed=True, candidates=counts["draws"] > 0,
               same_seed_same_tokens=bool(torch.equal(out, again)), **counts)
    # (the counts say whether the candidates' survivors were generate's at every draw)
    row["tokens_identical"] = row["same_seed_same_tokens"] and not counts["survivors_differ"]


def _read_backs(call) -> dict[str, Any]:
    """One decode step, and then the prompt, run as a capture would see them
    (grape.torch.readback): whether each reads a value back to the host, which a capture
    refuses, and at which line of the model."""
    from grape.torch.capture import culprit
    from grape.torch.readback import ReadBack, as_captured

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            decoder = call.again()
            with as_captured() as rewritten:
                decoder.step()
    except ReadBack as e:
        return {"step_reads_back": True, "read_back_at": culprit(e)[-300:]}
    except Exception as e:
        return {"read_back_error": _first_line(e)}
    # (the mask writes grape.torch.masked_writes ran as torch.where: on a GPU an index_put
    # through a mask reads its count back without it, a masked_fill its value where that
    # value is on the device, which on a CPU run is not told from the host)
    found: dict[str, Any] = {"step_reads_back": False,
                             **({"step_writes_rewritten": dict(rewritten)} if rewritten else {})}
    try:  # the prompt, as the launch captures it with the steps
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            decoder = call.again()
            with as_captured() as rewritten:
                decoder.prefill(call.ids, call.mask, call.decoder_ids, call.decoder_mask,
                                call.embeds, call.model_inputs)
    except ReadBack as e:
        found.update(prompt_reads_back=True, prompt_read_back_at=culprit(e)[-300:])
    except Exception as e:
        found.update(prompt_read_back_error=_first_line(e))
    else:
        found.update(prompt_reads_back=False)
        if rewritten:
            found.update(prompt_writes_rewritten=dict(rewritten))
    return found


def _reordering(call) -> dict[str, Any]:
    """One decode step replayed in the order grape.passes.concurrency allows furthest from
    its own (grape.torch.reordering): whether every byte it touched ends the same."""
    from grape.torch.reordering import check_reordering

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            decoder = call.again()
            decoder.step()
            found = check_reordering(decoder.step)
    except Exception as e:
        return {"reordering_error": _first_line(e)}
    return {"reordering_held": found.held, "reordering_operations": found.operations,
            "reordering_moved": found.moved, "reordering_depth": found.depth,
            "reordering_differing": found.differing,
            **({"reordering_error": found.error[:400]} if found.error else {})}


def _compare(out, reference, row: dict[str, Any]) -> None:
    from generate import _same

    row["tokens_identical"] = _same(out, reference)
    if not row["tokens_identical"] and out.shape == reference.shape:
        row["token_agreement"] = float((out[:, PROMPT:] == reference[:, PROMPT:])
                                       .float().mean())


def _which_side(model, ids, mask, kw, graphed, reference) -> dict[str, Any]:
    """Where graphed tokens differ from the reference: grape's own step driven by the host
    against both, its prompt run eagerly and then under PyTorch's capture (as in grape's
    launch), and the reference's margin where the tokens first part (0.0: an exact tie, which
    a difference in the last bit breaks either way). Equal to the reference eagerly and to the
    launch under capture: the capture changed the prompt's kernels (Hugging Face picks them by
    the mask's values, which it cannot read while a capture is under way)."""
    from generate import _first_difference, _host_loop, _margin, _same

    from grape.torch.decoding import TokenDecoder
    from grape.torch.options import resolve

    found: dict[str, Any] = {}
    try:
        options, m = resolve(model, ids, mask, dict(kw))
        for name, captured in (("host_loop", False), ("captured_prompt_host_loop", True)):
            decoder = TokenDecoder(model, ids.shape[0], ids.shape[1], options)
            host = _host_loop(decoder, ids, m, captured)
            found[f"{name}_equals_reference"] = _same(host, reference)
            found[f"{name}_equals_graphed"] = _same(host, graphed)
        step = _first_difference(graphed, reference, PROMPT)
        found["first_difference"] = step

        def again(**extra):
            return model.generate(ids, attention_mask=mask, cache_implementation="static",
                                  disable_compile=True, **kw, **extra)

        found["reference_margin_at_first_difference"] = _margin(again, graphed, reference,
                                                                PROMPT, step)
    except Exception as e:
        found["diagnosis_error"] = _first_line(e)
    return found


# --check-decode-masks: the host loop acts as under a capture for grape.torch.decode_mask
# and holds every decode step's mask view to the one transformers builds.
CHECK_MASKS = [False]
CONCURRENT = [False]  # --concurrent: grape.generate(concurrent=True)
# --check-reordering: each host-loop row also replays a decode step reordered as the
# concurrency pass allows (grape.torch.reordering).
CHECK_REORDERING = [False]
# --check-read-backs: each host-loop row also runs a decode step as a capture would see it
# (grape.torch.readback), and says whether it reads a value back and where.
CHECK_READ_BACKS = [False]


def each_type(archs: list[str], fill: Any, out: Path | None, device: str = "cpu") -> list[dict]:
    """A row per model type, ``{"arch": ...}`` filled by ``fill(arch, row)`` (where it raises,
    the error's first line as ``error``), its ``seconds``, the machine and commit
    (:func:`machine`): printed as a JSON line and, with ``out``, appended there as it is made
    (a long sweep that stops keeps what it made), the progress on stderr."""
    ran_on = machine(device)
    rows = []
    for i, arch in enumerate(archs, 1):
        row: dict[str, Any] = {"arch": arch}
        began = time.perf_counter()
        try:
            fill(arch, row)
        except Exception as e:  # a row per architecture, whatever fails
            row["error"] = _first_line(e)
        row["seconds"] = round(time.perf_counter() - began, 1)
        row |= ran_on
        rows.append(row)
        print(json.dumps(row), flush=True)
        print(f"[{i}/{len(archs)}] {arch}: {row.get('error', 'ran')}", file=sys.stderr,
              flush=True)
        if out:
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


def two_prompts(model: Any) -> tuple[Any, Any]:
    """The CPU sweeps' batch: two 7-token prompts of ids every small config knows, the first
    left-padded by two."""
    import torch

    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(5, min(vocab, 200), (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return ids, mask


def machine(device: str) -> dict[str, Any]:
    """What each row ran on and at which commit, so that a row names its machine without a
    note beside it: the device's name, torch's and transformers' versions, and grape's commit
    (None outside a git checkout; with ``+`` where the checkout had changes)."""
    import platform

    import torch
    import transformers

    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                                capture_output=True, text=True, timeout=10)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                 cwd=here, capture_output=True, text=True, timeout=10)
        made = (commit.stdout.strip() + ("+" if changed.stdout.strip() else "")
                if commit.returncode == 0 else None)
    except OSError:  # (no git)
        made = None
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    return {"device": name, "torch": torch.__version__,
            "transformers": transformers.__version__, "grape_commit": made}


def worker(archs: list[str], out: Path | None, dtype: str, strategies: list[str],
           host_loop: bool) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":  # generate's reference and grape's capture with the same kernels
        torch.use_deterministic_algorithms(True, warn_only=True)
    ran_on = machine(device)
    for arch in archs:
        _log(f"{arch} ...")
        try:
            rows = one(arch, device, getattr(torch, dtype), strategies, host_loop)
        except Exception as e:
            rows = [{"arch": arch, "stage": "sweep", "error": _first_line(e)}]
        for row in rows:
            line = json.dumps(row | ran_on)
            print(line, flush=True)
            if out is not None:
                with out.open("a") as f:
                    f.write(line + "\n")
        if any("CUDA error" in r.get("error", "") for r in rows):
            # A device-side assert leaves the context unusable: every later architecture in
            # this process would fail for it (17 did in the first sweep). A new process goes on.
            sys.exit(CONTEXT_LOST)


def _share(archs: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One worker's architectures, in as many processes as lost CUDA contexts need."""
    rows: list[dict[str, Any]] = []
    while archs:
        p = subprocess.run([sys.executable, __file__, "--worker", "--archs", ",".join(archs),
                            "--dtype", args.dtype, "--strategies", args.strategies,
                            "--new-tokens", str(args.new_tokens),
                            *(["--host-loop"] if args.host_loop else []),
                            *(["--check-decode-masks"] if args.check_decode_masks else []),
                            *(["--check-reordering"] if args.check_reordering else []),
                            *(["--check-read-backs"] if args.check_read_backs else []),
                            *(["--concurrent"] if args.concurrent else []),
                            *(["--seq2seq"] if args.seq2seq else []),
                            *(["--speech"] if args.speech else []),
                            *(["--out", str(args.out)] if args.out else [])],
                           stdout=subprocess.PIPE, text=True)
        mine = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
        rows += mine
        reported = {r["arch"] for r in mine}
        left = [a for a in archs if a not in reported]
        if p.returncode not in (0, CONTEXT_LOST):
            _log(f"a worker ended with status {p.returncode} at {left[:1]}")
            if left:  # the architecture it died in, said as a row; the others go on
                row = {"arch": left[0], "stage": "sweep",
                       "error": f"the process ended with status {p.returncode}"}
                rows.append(row)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                left = left[1:]
        archs = left
    return rows


def summary(rows: list[dict[str, Any]]) -> str:
    """A short table: each outcome, with the architectures in it."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        ran = "host loop" if r.get("way") == "host_loop" else "graphed"
        if r.get("stage") != "done":
            key = f"failed at {r.get('stage')}"
        elif not r["graphed"]:
            key = "refused (grape.generate falls back)" if ran == "host loop" else \
                "fell back to generate"
        else:
            key = f"{ran}, tokens {'equal' if r['tokens_identical'] else 'differ'}"
        label = r["arch"] + (f"/b{r['batch']}" if "batch" in r else "")
        if r.get("strategy", "greedy") != "greedy":
            label += f"/{r['strategy']}"
        groups.setdefault(key, []).append(label)
    lines = [f"{k}: {len(v)}: {' '.join(sorted(v))}" for k, v in sorted(groups.items())]
    checked = [r for r in rows if "decode_masks_viewed" in r]
    if checked:
        viewed = [r for r in checked if r["decode_masks_viewed"]]
        lines.append(f"decode masks checked in {len(checked)} rows: "
                     f"{sum(r['decode_masks_viewed'] for r in checked)} views equal to "
                     f"transformers' masks in {len(viewed)} rows, "
                     f"{sum(r['decode_masks_built'] for r in checked)} masks left to it")
    reordered = [r for r in rows if "reordering_held" in r or "reordering_error" in r]
    if reordered:
        held = [r for r in reordered if r.get("reordering_held")]
        lines.append(f"decode steps reordered as the concurrency DAG allows in "
                     f"{len(reordered)} rows: the state held in {len(held)}, moving a median "
                     f"{_median([r['reordering_moved'] for r in held])} operations of "
                     f"{_median([r['reordering_operations'] for r in held])}")
        for r in reordered:
            if not r.get("reordering_held"):
                lines.append(f"  not held: {r['arch']}/b{r['batch']}/{r['strategy']}: "
                             f"{r.get('reordering_differing', '')} storages differ; "
                             f"{r.get('reordering_error', '')}")
    probed = [r for r in rows if "step_reads_back" in r or "read_back_error" in r]
    if probed:
        reading = sorted({(r["arch"], r.get("read_back_at", r.get("read_back_error", "")))
                          for r in probed if r.get("step_reads_back") is not False})
        clean = sum(1 for r in probed if r.get("step_reads_back") is False)
        lines.append(f"decode steps run as a capture sees them in {len(probed)} rows: {clean} "
                     f"read nothing back; {len({a for a, _ in reading})} types do:")
        lines += [f"  {arch}: {where}" for arch, where in reading]
    prompts = [r for r in probed if "prompt_reads_back" in r or "prompt_read_back_error" in r]
    if prompts:
        reading = sorted({(r["arch"], r.get("prompt_read_back_at",
                                            r.get("prompt_read_back_error", "")))
                          for r in prompts if r.get("prompt_reads_back") is not False})
        clean = sum(1 for r in prompts if r.get("prompt_reads_back") is False)
        lines.append(f"prompts run as a capture sees them in {len(prompts)} rows: {clean} "
                     f"read nothing back; {len({a for a, _ in reading})} types do:")
        lines += [f"  {arch}: {where}" for arch, where in reading]
    for part in ("step", "prompt"):
        rewriting = sorted({r["arch"] for r in probed if r.get(f"{part}_writes_rewritten")})
        if rewriting:
            lines.append(f"{part}s with mask writes grape runs as torch.where under a "
                         f"capture (grape.torch.masked_writes): {', '.join(rewriting)}")
    return "\n".join(lines)


def _median(values: list[int]) -> str:
    import statistics

    return f"{statistics.median(values):g}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=None, help="model types, comma-separated "
                        "(default: every causal-LM model type transformers ships)")
    parser.add_argument("--skip", default="", help="model types to leave out")
    parser.add_argument("--out", type=Path, default=None, help="JSON lines, appended")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                        help="on a GPU (the CPU runs float32); bf16 by default, as models "
                        "of these kinds ship")
    parser.add_argument("--strategies", default="greedy",
                        help="among: greedy, beam3, sample (with --host-loop)")
    parser.add_argument("--host-loop", action="store_true",
                        help="grape's step driven by the host instead of grape.generate: "
                        "its semantics on any device, the CPU included")
    parser.add_argument("--check-decode-masks", action="store_true",
                        help="with --host-loop: every decode step's causal mask taken as the "
                        "running 2D mask's view, as under a capture, and held element for "
                        "element to the one transformers builds (grape.torch.decode_mask)")
    parser.add_argument("--check-reordering", action="store_true",
                        help="with --host-loop: each row also replays one decode step in the "
                        "order grape.passes.concurrency allows furthest from its own, and says "
                        "whether every byte it touched ends the same (grape.torch.reordering)")
    parser.add_argument("--check-read-backs", action="store_true",
                        help="with --host-loop: each row also runs one decode step as a CUDA "
                        "capture would see it, and says whether it reads a value back to the "
                        "host (which a capture refuses) and at which line "
                        "(grape.torch.readback)")
    parser.add_argument("--concurrent", action="store_true",
                        help="grape.generate(concurrent=True), its default: the step's "
                        "independent operations side by side (grape.passes.concurrency); "
                        "without it, concurrent=False: the chain")
    parser.add_argument("--seq2seq", action="store_true",
                        help="the encoder-decoder models of transformers' sequence-to-sequence "
                        "mapping, instead of its causal LMs")
    parser.add_argument("--speech", action="store_true",
                        help="the encoder-decoder models of transformers' speech-to-text "
                        "mapping, from random samples or features")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS[0], metavar="N",
                        help=f"tokens generated a row (default {NEW_TOKENS[0]}; a few serve a "
                             f"scan with --check-read-backs, whose probe runs one step)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.new_tokens < 1:
        parser.error(f"expected --new-tokens of at least 1, found {args.new_tokens}")
    if args.check_decode_masks and not args.host_loop:
        parser.error("expected --check-decode-masks with --host-loop, found it alone")
    if args.concurrent and args.host_loop:
        parser.error("expected --concurrent or --host-loop, found both: the host loop captures "
                     "nothing to reorder")
    if args.check_reordering and not args.host_loop:
        parser.error("expected --check-reordering with --host-loop, found it alone")
    if args.check_read_backs and not args.host_loop:
        parser.error("expected --check-read-backs with --host-loop, found it alone")
    if "sample" in args.strategies.split(",") and not args.host_loop:
        parser.error("expected --strategies sample with --host-loop (grape's draws are its "
                     "own: generate's tokens are no reference), found it without")
    NEW_TOKENS[0] = args.new_tokens
    CHECK_MASKS[0] = args.check_decode_masks
    CHECK_REORDERING[0] = args.check_reordering
    CHECK_READ_BACKS[0] = args.check_read_backs
    CONCURRENT[0] = args.concurrent
    SEQ2SEQ[0] = args.seq2seq
    SPEECH[0] = args.speech
    archs = args.archs.split(",") if args.archs else architectures()
    archs = [a for a in archs if a not in set(args.skip.split(","))]
    strategies = args.strategies.split(",")
    if unknown := [st for st in strategies if st not in STRATEGIES]:
        parser.error(f"expected strategies among {', '.join(STRATEGIES)}, found {unknown}")
    if args.worker:
        worker(archs, args.out, args.dtype, strategies, args.host_loop)
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    if args.out is not None and args.out.exists():
        args.out.unlink()
    shares = [s for s in (archs[i::args.workers] for i in range(args.workers)) if s]
    _log(f"{len(archs)} architectures over {len(shares)} processes")
    with ThreadPoolExecutor(len(shares)) as pool:
        rows = [r for share in pool.map(lambda s: _share(s, args), shares) for r in share]
    print(summary(rows))


if __name__ == "__main__":
    main()
