"""The cache's length as a forward sees it (grape.torch.cache_length): positions made by
``torch.arange`` over it and questions its range decides, with no read-back, on the CPU; and
decoders whose forwards ask them (RoFormer, TrOCR, XGLM, MVP, M2M-100), whose steps then read
nothing back, with ``generate``'s tokens."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from grape.torch.cache_length import CacheLength, ranged_arange  # noqa: E402
from grape.torch.readback import ReadBack, as_captured  # noqa: E402


def _length(value=5, high=64):
    count = torch.tensor([value])
    return count, CacheLength.of(count.view(()), 0, high)


def test_positions_over_the_length_are_made_without_reading_it():
    count, past = _length()
    with as_captured(), ranged_arange():
        positions = torch.arange(past, past + 3, dtype=torch.long)
        floats = torch.arange(1 + past, past + 4, dtype=torch.float32)
    assert type(positions) is torch.Tensor and positions.tolist() == [5, 6, 7]
    assert floats.dtype == torch.float32 and floats.tolist() == [6.0, 7.0, 8.0]
    count.fill_(40)  # the same tensors read the count where it lies
    with ranged_arange():
        assert torch.arange(past, past + 2).tolist() == [40, 41]


def test_questions_the_range_decides_are_answered_on_the_host_and_others_read_it():
    _, past = _length(high=64)
    max_pos = 1 + 1 + 2 + past  # (a sinusoidal table's test: never past 68 here)
    with as_captured():
        assert not bool(max_pos > 1026) and bool(max_pos >= 4) and not (past - 1 < -1)
        if max_pos > 1026:
            pytest.fail("decided wrongly")
    with pytest.raises(ReadBack), as_captured():
        bool(max_pos > 10)  # 4..68: the range does not decide it
    assert bool(max_pos > 10) is False  # eagerly, read: 9 > 10 is false


def test_everything_else_is_a_plain_tensor():
    _, past = _length()
    for made in (past * 2, torch.arange(3) + past, past.to(torch.float32), past + past):
        assert type(made) is torch.Tensor
    with ranged_arange():
        assert type(torch.arange(4)) is torch.Tensor  # an ordinary arange, as it was
        other = CacheLength.of(torch.tensor(2), 0, 8)
        assert torch.arange(past, other + 9).tolist() == list(range(5, 11))  # read: two counts


VOCAB = 300
COMMON = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
SMALL_SEQ2SEQ = {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
                 "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                 "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "decoder_start_token_id": 2}
MODELS = {  # each asks a question of the cache's length in its positions
    "roformer": (transformers.AutoModelForCausalLM,
                 {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "is_decoder": True}),
    "trocr": (transformers.AutoModelForCausalLM,
              {"d_model": 64, "decoder_ffn_dim": 128, "decoder_layers": 2,
               "decoder_attention_heads": 4}),
    "xglm": (transformers.AutoModelForCausalLM,
             {"d_model": 64, "ffn_dim": 128, "num_layers": 2, "attention_heads": 4}),
    "mvp": (transformers.AutoModelForSeq2SeqLM, SMALL_SEQ2SEQ),
    "m2m_100": (transformers.AutoModelForSeq2SeqLM, SMALL_SEQ2SEQ),
}


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("model_type", list(MODELS))
def test_a_step_over_the_ranged_length_reads_nothing_back_and_makes_generates_tokens(
        model_type, num_beams):
    from grape.torch.beam import BeamDecoder
    from grape.torch.decoding import TokenDecoder
    from grape.torch.options import resolve

    auto, sizes = MODELS[model_type]
    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(model_type, **sizes, **COMMON)
    torch.manual_seed(0)
    model = auto.from_config(config).eval()
    ids = torch.randint(30, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kwargs = {"max_new_tokens": 8, "num_beams": num_beams}
    options, m = resolve(model, ids, mask, dict(kwargs))
    decoder = (BeamDecoder if num_beams > 1 else TokenDecoder)(model, 2, 7, options)
    decoder.prefill(ids, m)
    # A step as a capture sees it: transformers thinks it is tracing (a capture makes it), and
    # no value may be read back.
    with as_captured():
        decoder.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = model.generate(ids, attention_mask=mask, cache_implementation="static",
                                   **kwargs)
    assert torch.equal(decoder.generate_on_host(ids, m), reference)


def test_a_read_back_under_as_captured_names_the_models_line():
    # grape.torch.readback: the CPU's stand-in for a capture's refusal. RoFormer's positions
    # with the count's plain view (as a compiled step keeps it) read it back, at its line.
    from grape.torch.capture import culprit
    from grape.torch.decoding import TokenDecoder
    from grape.torch.options import resolve

    auto, sizes = MODELS["roformer"]
    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model("roformer", **sizes, **COMMON)
    model = auto.from_config(config).eval()
    ids = torch.randint(30, VOCAB, (2, 7))
    options, m = resolve(model, ids, None, {"max_new_tokens": 4})
    for ranged, reads in ((True, False), (False, True)):
        decoder = TokenDecoder(model, 2, 7, options)
        for layer in decoder.cache.layers:
            layer.ranged = ranged
        decoder.prefill(ids, m)
        try:
            with as_captured():
                decoder.step()
            where = None
        except ReadBack as e:
            where = culprit(e)
        assert (where is not None) == reads, where
        if reads:
            assert "modeling_roformer.py" in where and "torch.arange" in where


@pytest.mark.parametrize("read", ["item", "bool", "tolist", "cpu", "numpy"])
def test_every_way_to_take_values_to_the_host_is_refused_as_a_capture_refuses_it(read):
    t = torch.arange(3)
    take = {"item": lambda: t[1].item(), "bool": lambda: bool(t[1] > 0),
            "tolist": t.tolist, "cpu": t.cpu, "numpy": t.numpy}[read]
    with pytest.raises(ReadBack), as_captured():
        take()
    take()  # and outside, as ever
    with as_captured():
        assert type(t + 1) is torch.Tensor  # what stays on the device runs


def test_whether_the_cache_holds_anything_is_known_in_the_prompt_and_in_every_step():
    # GIT (transformers 5.25) widens its mask only `if cache_length > 0`: over the whole cache
    # the range cannot say, but the decoder knows that the prompt meets an empty cache and
    # every step one holding at least the prompt, so neither forward reads the count back.
    from grape.torch.decoding import TokenDecoder
    from grape.torch.options import resolve

    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, **COMMON)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    inner, asked = model.model.forward, []

    def forward(*args, **kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        asked.append(bool(cache.get_seq_length() > 0))  # a host question, as GIT asks it
        return inner(*args, **kwargs)

    model.model.forward = forward
    ids = torch.randint(30, VOCAB, (2, 7))
    options, m = resolve(model, ids, None, {"max_new_tokens": 4})
    decoder = TokenDecoder(model, 2, 7, options)
    decoder.prefill(ids, m)  # eagerly first: the layers' buffers are made lazily
    with as_captured():
        decoder.prefill(ids, m)
        decoder.step()
        decoder.step()
    assert asked == [False, False, True, True]
    assert type(decoder.cache.layers[0].cumulative_length) is CacheLength
