"""The workloads grape records and measures: Hugging Face models built from configs.

Weights are random (seeded); nothing is downloaded. A workload is a model plus one step
function over static inputs, so that the same step runs eagerly and captured.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from grape.errors import GrapeError

__all__ = ["DEFAULT_SUITE", "Workload", "parse_spec"]

GPT2 = {"gpt2-small": {}, "gpt2-medium": {"n_embd": 1024, "n_layer": 24, "n_head": 16}}
WAV2VEC2 = {"wav2vec2-base": {}}
# Workloads outside the ones the simulator's constants were read from: an encoder, a
# convolutional network, and a model whose step forks its work onto two streams.
BERT = {"bert-base": {}}
RESNET = {"resnet-50": {}}  # ResNetConfig's defaults: ResNet-50
# Training workloads draw nothing at random on the host or the device: SpecAugment's masks and
# LayerDrop's choices come from the host each step (nothing a graph can hold), and dropout's
# draws, which graphed steps take from the generator at other offsets than eager steps
# (grape.torch.rng), would make graphed and eager steps incomparable.
NO_RANDOMNESS = dict(hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                     feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0)

DEFAULT_SUITE = (
    [f"{m}:b{b}:kv{kv}" for m in GPT2 for b in (1, 8) for kv in (32, 128, 512, 1000)]
    + [f"wav2vec2-base:{n}" for n in (16000, 64000, 160000)]
)


@dataclass
class Workload:
    name: str  # file-name friendly: gpt2_small_decode_b1_kv32
    spec: str
    step: Callable[..., Any]  # step(*inputs) -> output tensor
    inputs: tuple[torch.Tensor, ...]
    params: dict[str, torch.Tensor]
    refresh: Callable[[], None]  # fresh random values into the static inputs


@cache
def _gpt2(model: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(**GPT2[model])
    return transformers.GPT2LMHeadModel(config).cuda().half().eval()


@cache
def _wav2vec2(model: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(**WAV2VEC2[model])
    return transformers.Wav2Vec2Model(config).cuda().half().eval()


def _decode(model_name: str, batch: int, kv: int) -> Workload:
    model = _gpt2(model_name)
    vocab = model.config.vocab_size
    with torch.no_grad():
        prompt = torch.randint(0, vocab, (batch, kv), device="cuda")
        cache_ = model(prompt, use_cache=True).past_key_values
    ids = torch.randint(0, vocab, (batch, 1), device="cuda")

    def step(ids: torch.Tensor) -> torch.Tensor:
        # Back to kv cached tokens first (a view, no GPU work), so every call, eager or captured,
        # decodes one token against the same KV length.
        if (extra := cache_.get_seq_length() - kv) > 0:
            cache_.crop(-extra)
        with torch.no_grad():
            return model(ids, past_key_values=cache_, use_cache=True).logits

    def refresh() -> None:
        ids.copy_(torch.randint(0, vocab, (batch, 1), device="cuda"))

    name = f"{model_name.replace('-', '_')}_decode_b{batch}_kv{kv}"
    return Workload(name, f"{model_name}:b{batch}:kv{kv}", step, (ids,),
                    dict(model.named_parameters()), refresh)


def _audio(model_name: str, samples: int) -> Workload:
    model = _wav2vec2(model_name)
    audio = torch.randn((1, samples), device="cuda", dtype=torch.float16)

    def step(audio: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(audio).last_hidden_state

    def refresh() -> None:
        audio.copy_(torch.randn_like(audio))

    name = f"{model_name.replace('-', '_')}_forward_{samples}"
    return Workload(name, f"{model_name}:{samples}", step, (audio,),
                    dict(model.named_parameters()), refresh)


def _train(model_name: str, batch: int, samples: int) -> Workload:
    """One Wav2Vec2 CTC fine-tuning step (forward, backward, loss scaling with its IF node,
    clipping, AdamW) at one audio length, as ``benchmarks/training.py`` runs it: the step
    ``GraphedTraining`` captures, here run eagerly or captured whole. It trains the model
    further at every call (timing, not numerics, is what a recording keeps)."""
    import transformers

    from grape.torch.ctc import hf_ctc_loss
    from grape.torch.training import GraphedTraining, LossScaler

    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(**WAV2VEC2[model_name], vocab_size=32,
                                         ctc_loss_reduction="mean", **NO_RANDOMNESS)
    model = transformers.Wav2Vec2ForCTC(config).cuda().train()
    model.freeze_feature_encoder()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                            lr=torch.tensor(1e-5, device="cuda"), capturable=True, foreach=True)
    trainer = GraphedTraining(model, hf_ctc_loss, opt, lengths=[samples],
                              input_shape=(batch, samples), target_shape=(batch, 64),
                              amp=torch.float16, scaler=LossScaler("cuda"), clip_norm=1.0,
                              graphs=False)

    def refresh() -> None:
        trainer.inputs.normal_()
        trainer.targets.copy_(torch.randint(1, 32, trainer.targets.shape, device="cuda"))

    def step(audio: torch.Tensor) -> torch.Tensor:
        trainer.step_at(samples)  # reads ``audio``: the trainer's own input buffer
        return trainer.loss

    # The optimizer's state must exist before any capture (its first real step creates it;
    # a step the loss scaler skips on overflow does not): eager steps until it has stepped.
    for _ in range(64):
        refresh()
        step(trainer.inputs)
        if trainer.ready_to_capture:
            break
    else:
        raise GrapeError("expected the optimizer to step within 64 eager training steps, "
                         "found every one skipped on overflow")
    name = f"{model_name.replace('-', '_')}_train_b{batch}_{samples}"
    return Workload(name, f"{model_name}:train:b{batch}:{samples}", step, (trainer.inputs,),
                    dict(model.named_parameters()), refresh)


@cache
def _bert(model: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(**BERT[model])).cuda().half().eval()


@cache
def _resnet(model: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.ResNetConfig(**RESNET[model])
    return transformers.ResNetModel(config).cuda().half().eval()


def _encode(model_name: str, batch: int, tokens: int) -> Workload:
    model = _bert(model_name)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, tokens), device="cuda")

    def step(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids).last_hidden_state

    def refresh() -> None:
        ids.copy_(torch.randint(0, vocab, ids.shape, device="cuda"))

    name = f"{model_name.replace('-', '_')}_encode_b{batch}_s{tokens}"
    return Workload(name, f"{model_name}:b{batch}:s{tokens}", step, (ids,),
                    dict(model.named_parameters()), refresh)


def _image(model_name: str, batch: int, side: int) -> Workload:
    model = _resnet(model_name)
    images = torch.randn((batch, 3, side, side), device="cuda", dtype=torch.float16)

    def step(images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(images).pooler_output

    def refresh() -> None:
        images.copy_(torch.randn_like(images))

    name = f"{model_name.replace('-', '_')}_images_b{batch}_{side}"
    return Workload(name, f"{model_name}:b{batch}:{side}px", step, (images,),
                    dict(model.named_parameters()), refresh)


class _TwoStreams(torch.nn.Module):
    """Two towers of linear layers run side by side on two streams, joined by events: the
    shape of a model that forks independent work (a two-tower encoder, a speech model's
    parallel branches) onto streams of its own, which capture keeps as parallel branches."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.towers = torch.nn.ModuleList(
            torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width),
                                                      torch.nn.GELU()) for _ in range(depth)])
            for _ in range(2))
        self.side = None  # made on first use, on the current device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        main = torch.cuda.current_stream()
        if self.side is None:
            self.side = torch.cuda.Stream()
        self.side.wait_stream(main)  # the side tower reads x after it is written
        with torch.cuda.stream(self.side):
            b = self.towers[1](x)
        a = self.towers[0](x)
        main.wait_stream(self.side)  # the join: main waits for the side tower
        b.record_stream(main)
        return a + b


@cache
def _two_streams(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return _TwoStreams(width, depth).cuda().half().eval()


def _forked(batch: int, width: int, depth: int) -> Workload:
    model = _two_streams(width, depth)
    x = torch.randn((batch, width), device="cuda", dtype=torch.float16)

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    def refresh() -> None:
        x.copy_(torch.randn_like(x))

    name = f"two_streams_b{batch}_w{width}_d{depth}"
    return Workload(name, f"two-streams:b{batch}:w{width}:d{depth}", step, (x,),
                    dict(model.named_parameters()), refresh)


def check_spec(spec: str) -> tuple[str, ...]:
    """The parts of a workload spec, or a GrapeError saying what a spec looks like."""
    if m := re.fullmatch(r"(gpt2-\w+):b(\d+):kv(\d+)", spec):
        model, batch, kv = m.group(1), int(m.group(2)), int(m.group(3))
        if model not in GPT2 or not 1 <= kv <= 1022 or batch < 1:
            raise GrapeError(f"expected a GPT-2 model among {sorted(GPT2)}, a batch of at "
                             f"least 1 and a KV length in 1..1022, found {spec!r}")
        return ("decode", model, str(batch), str(kv))
    if m := re.fullmatch(r"(wav2vec2-\w+):train:b(\d+):(\d+)", spec):
        if m.group(1) not in WAV2VEC2 or int(m.group(2)) < 1 or int(m.group(3)) < 400:
            raise GrapeError(f"expected a Wav2Vec2 model among {sorted(WAV2VEC2)}, a batch of "
                             f"at least 1 and at least 400 audio samples, found {spec!r}")
        return ("train", m.group(1), m.group(2), m.group(3))
    if m := re.fullmatch(r"(wav2vec2-\w+):(\d+)", spec):
        if m.group(1) not in WAV2VEC2 or int(m.group(2)) < 400:
            raise GrapeError(f"expected a Wav2Vec2 model among {sorted(WAV2VEC2)} and at least "
                             f"400 audio samples, found {spec!r}")
        return ("audio", m.group(1), m.group(2))
    if m := re.fullmatch(r"(bert-\w+):b(\d+):s(\d+)", spec):
        if m.group(1) not in BERT or int(m.group(2)) < 1 or not 1 <= int(m.group(3)) <= 512:
            raise GrapeError(f"expected a BERT model among {sorted(BERT)}, a batch of at least 1 "
                             f"and 1..512 tokens, found {spec!r}")
        return ("encode", m.group(1), m.group(2), m.group(3))
    if m := re.fullmatch(r"(resnet-\w+):b(\d+):(\d+)px", spec):
        if m.group(1) not in RESNET or int(m.group(2)) < 1 or int(m.group(3)) < 32:
            raise GrapeError(f"expected a ResNet among {sorted(RESNET)}, a batch of at least 1 "
                             f"and images of at least 32 pixels a side, found {spec!r}")
        return ("image", m.group(1), m.group(2), m.group(3))
    if m := re.fullmatch(r"two-streams:b(\d+):w(\d+):d(\d+)", spec):
        if min(int(g) for g in m.groups()) < 1:
            raise GrapeError(f"expected a batch, width and depth of at least 1, found {spec!r}")
        return ("streams", *m.groups())
    raise GrapeError(f"expected a workload like gpt2-small:b1:kv32, wav2vec2-base:16000, "
                     f"wav2vec2-base:train:b8:16000, bert-base:b8:s128, resnet-50:b32:224px or "
                     f"two-streams:b64:w4096:d8, found {spec!r}")


def parse_spec(spec: str) -> Workload:
    """``gpt2-small:b1:kv32`` (decode step), ``wav2vec2-base:16000`` (audio samples),
    ``wav2vec2-base:train:b8:16000`` (a CTC training step at batch 8), ``bert-base:b8:s128``
    (an encoder's forward), ``resnet-50:b32:224px`` (a convolutional network's forward) or
    ``two-streams:b64:w4096:d8`` (two towers of linear layers on two streams)."""
    kind, *parts = check_spec(spec)
    if kind == "decode":
        return _decode(parts[0], int(parts[1]), int(parts[2]))
    if kind == "train":
        return _train(parts[0], int(parts[1]), int(parts[2]))
    if kind == "encode":
        return _encode(parts[0], int(parts[1]), int(parts[2]))
    if kind == "image":
        return _image(parts[0], int(parts[1]), int(parts[2]))
    if kind == "streams":
        return _forked(*(int(p) for p in parts))
    return _audio(parts[0], int(parts[1]))
