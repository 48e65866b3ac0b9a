"""A sliding window shorter than the generation (grape.torch.static_layers.CountedSlidingLayer):
the buffers and mask sizes transformers' StaticSlidingWindowLayer keeps, with its position on the
device; decode steps that read nothing back; and generations with ``generate``'s tokens on
models whose windows are shorter than the prompt, the generation, or both (Mistral, Gemma 3,
GPT-OSS), where grape fell back to ``generate`` before."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from transformers.cache_utils import StaticSlidingWindowLayer  # noqa: E402

from grape.errors import GrapeError  # noqa: E402
from grape.torch.cache_length import CacheLength  # noqa: E402
from grape.torch.options import NotGraphable  # noqa: E402
from grape.torch.readback import ReadBack, as_captured  # noqa: E402
from grape.torch.static_layers import CountedSlidingLayer, Tokens  # noqa: E402

MAX_LEN = 20


def _states(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, n, 4, generator=g), torch.randn(2, 3, n, 4, generator=g)


@pytest.mark.parametrize("window,prompt", [(8, 5), (8, 8), (8, 13), (4, 1), (19, 3)])
def test_the_window_holds_what_transformers_layer_holds_at_every_token(window, prompt):
    theirs = StaticSlidingWindowLayer(max_cache_len=MAX_LEN, sliding_window=window)
    count, tokens = torch.zeros(1, dtype=torch.long), Tokens()
    ours = CountedSlidingLayer(max_cache_len=MAX_LEN, window=window, count=count, tokens=tokens)
    for step, n in enumerate([prompt] + [1] * (MAX_LEN - prompt)):
        past = int(count)
        tokens.begin(n, (past, past) if step == 0 else (prompt, MAX_LEN - 1))
        expected_sizes = theirs.get_mask_sizes(n)
        length, offset = ours.get_mask_sizes(n)
        assert (length, int(offset)) == expected_sizes, f"token {past}"
        k, v = _states(n, seed=step)
        expected = theirs.update(k, v)
        got = ours.update(k, v)
        for e, g in zip(expected, got, strict=True):
            assert torch.equal(e, g), f"token {past}: attention's keys or values differ"
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        count += n


def test_a_steps_mask_offset_answers_the_padding_question_without_reading_back():
    window = 8
    count, tokens = torch.tensor([11]), Tokens()
    layer = CountedSlidingLayer(max_cache_len=MAX_LEN, window=window, count=count, tokens=tokens)
    layer.lazy_initialization(*_states(1, 0))
    tokens.begin(1, (6, MAX_LEN - 1))
    length, offset = layer.get_mask_sizes(1)
    assert isinstance(offset, CacheLength) and int(offset) == 11 - window + 1
    with as_captured():
        # transformers' prepare_padding_mask: pad the decoder's 2D mask past its end?
        assert not bool(length + offset - MAX_LEN > 0)
        keys = torch.arange(length) + offset  # the window's positions, on the device
    assert keys.tolist() == list(range(4, 12))
    count.fill_(3)  # the next forward, before the window fills: its first slot is position 0
    length, offset = layer.get_mask_sizes(1)
    assert (torch.arange(length) + offset).tolist() == list(range(8))
    with pytest.raises(ReadBack), as_captured():
        bool(offset > 2)  # 0..12: not decided by the range, so read


def test_several_tokens_where_only_the_device_knows_the_length_are_refused():
    count, tokens = torch.tensor([9]), Tokens()
    layer = CountedSlidingLayer(max_cache_len=MAX_LEN, window=8, count=count, tokens=tokens)
    tokens.begin(2, (4, MAX_LEN - 1))
    with pytest.raises(NotGraphable, match="a forward of 2 tokens into a sliding window of 8"):
        layer.update(*_states(2, 0))
    with pytest.raises(GrapeError, match="shorter than the generation's 20 tokens, found 20"):
        CountedSlidingLayer(max_cache_len=MAX_LEN, window=MAX_LEN, count=count)


VOCAB = 300
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": 2,
         "pad_token_id": 0}


def _model(model_type: str, window: int):
    config = transformers.AutoConfig.for_model(model_type, **SMALL, sliding_window=window)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


# A recurrent state and a sliding window in one layer (CountedLinearSlidingLayer): Inkling,
# which transformers 5.17 and 5.25 have.
INKLING = pytest.param("inkling_text", marks=pytest.mark.skipif(
    "inkling_text" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES,
    reason="this transformers has no Inkling"))


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text", "gpt_oss", INKLING])
@pytest.mark.parametrize("window", [6, 20])  # shorter than the prompt; than the generation
@pytest.mark.parametrize("beams", [1, 3])
def test_windows_shorter_than_the_generation_are_graphed_with_generates_tokens(
        model_type, window, beams):
    from grape.torch.host_loop import generate_on_host

    model = _model(model_type, window)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: positions the window holds, then drops
    kw = dict(max_new_tokens=20, do_sample=False, num_beams=beams, eos_token_id=None,
              pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model.generate(ids, attention_mask=mask, cache_implementation="static", **kw)
        calls = []
        got = generate_on_host(model, ids, mask, check_written=True, calls=calls, **kw)
        decoder = calls[-1].again()
        assert any(isinstance(layer, CountedSlidingLayer) for layer in decoder.layers)
        with as_captured():
            decoder.step()  # a decode step as a capture runs it: nothing read back
    assert torch.equal(got, expected)


def test_a_cross_attention_window_shorter_than_the_source_is_refused_with_the_reason():
    # transformers' static cross-attention cache makes a sliding layer of T5Gemma's decoder a
    # window of the source's keys (here the last 6 of 12), which grape does not reproduce.
    from grape.torch.host_loop import generate_on_host

    part = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                sliding_window=6)
    config = transformers.T5GemmaConfig(encoder=part, decoder=part, vocab_size=VOCAB,
                                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5GemmaForConditionalGeneration(config).eval()
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    with pytest.raises(NotGraphable, match="cross-attention cache layer 0 is a sliding window "
                                           "of 6 tokens over a source of 12"):
        generate_on_host(model, ids, max_new_tokens=4, do_sample=False)


def test_the_layers_of_one_forward_share_their_slots_and_the_next_forward_makes_its_own():
    count, tokens = torch.tensor([9]), Tokens()
    layers = [CountedSlidingLayer(max_cache_len=MAX_LEN, window=8, count=count, tokens=tokens)
              for _ in range(2)]
    for layer in layers:
        layer.lazy_initialization(*_states(1, 0))
    tokens.begin(1, (5, MAX_LEN - 1))
    first = layers[0]._where()
    assert layers[1]._where() is first  # computed once a forward
    assert first[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 7] and first[1].tolist() == [7]
    count.fill_(3)
    tokens.begin(1, (2, MAX_LEN - 1))
    assert layers[1]._where()[0].tolist() == list(range(8))  # not full yet: its own slots


def test_a_compiled_step_refuses_a_short_window_as_compilation_alone_cannot_serve(monkeypatch):
    # A compiled step reads the mask's offset as a plain tensor, which transformers' host
    # question about it would read back: refused as CompileRefused, which grape.generate meets
    # by graphing the model's own kernels instead (not by falling back to generate).
    import grape.torch.api as api
    from grape.torch.decoding import CompileRefused, TokenDecoder
    from grape.torch.host_loop import resolve

    model = _model("mistral", 6)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    options, _ = resolve(model, ids, None, {"max_new_tokens": 20, "eos_token_id": None})
    with pytest.raises(CompileRefused, match="sliding window of 6 tokens"):
        TokenDecoder(model, 1, ids.shape[1], options, step_model=model)
    TokenDecoder(model, 1, ids.shape[1], options)  # the model's own kernels take it

    # grape.generate's side: the compiled attempt refused, the uncompiled one run, said once.
    tried = []

    def graphed_generate(model, prompt, options, seed, compiled, exact, **kwargs):
        tried.append(compiled)
        if compiled:
            raise CompileRefused("cache layer 0 is a sliding window of 6 tokens")
        return "graphed"

    monkeypatch.setattr(api, "_graphed_generate", graphed_generate)
    # (tensors said to be on a GPU: the CPU passes grape.generate's device check as one would)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0)))
    try:
        with pytest.warns(UserWarning) as said:
            for _ in range(2):  # the second call does not try to compile again
                out = api.generate(model, ids, max_new_tokens=20, eos_token_id=None,
                                   compile=True)
    finally:
        api.clear_cache(model)
    assert out == "graphed" and tried == [True, False, False]
    assert [str(w.message) for w in said] == [
        "grape.generate(compile=True): cache layer 0 is a sliding window of 6 tokens; the "
        "step runs the model's own kernels instead"] * 2
