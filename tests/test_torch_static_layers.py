"""grape.torch.static_layers.CountedLayer on the CPU: it writes where the shared count says and
never advances it; transformers reads that count as its length."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")

from grape.errors import GrapeError  # noqa: E402
from grape.torch.static_layers import CountedLayer  # noqa: E402


def _states(tokens: int, fill: float) -> torch.Tensor:
    return torch.full((1, 2, tokens, 4), fill)  # (batch, heads, tokens, head size)


def test_layers_write_at_the_shared_count_and_leave_it_to_their_owner():
    count = torch.zeros(1, dtype=torch.long)
    layers = [CountedLayer(max_cache_len=8, count=count) for _ in range(3)]
    for layer in layers:  # a prompt of three tokens, at positions 0..2
        layer.update(_states(3, 1.0), _states(3, -1.0))
    assert count.item() == 0  # no layer advanced it
    count.fill_(3)
    for step in range(2):  # two decode steps, each token at the count
        for layer in layers:
            keys, _ = layer.update(_states(1, 2.0 + step), _states(1, -2.0 - step))
            assert keys is layer.keys  # the whole cache, as transformers returns it
        count.add_(1)
    for layer in layers:
        assert layer.keys[0, 0, :, 0].tolist() == [1, 1, 1, 2, 3, 0, 0, 0]
        assert layer.values[0, 0, :, 0].tolist() == [-1, -1, -1, -2, -3, 0, 0, 0]
        # transformers' length is the count itself: a 0-dim view, as transformers keeps it
        assert layer.get_seq_length().shape == () and layer.get_seq_length().item() == 5
        assert layer.cumulative_length.data_ptr() == count.data_ptr()


def test_a_reset_clears_the_cache_and_the_count():
    count = torch.zeros(1, dtype=torch.long)
    layer = CountedLayer(max_cache_len=4, count=count)
    layer.update(_states(2, 1.0), _states(2, 1.0))
    count.fill_(2)
    layer.reset()
    assert count.item() == 0 and not layer.keys.any()


def test_the_count_must_be_one_long_element():
    with pytest.raises(GrapeError, match=r"shape \(1,\) and dtype long, found shape \(\) "
                                         r"and torch.int32"):
        CountedLayer(max_cache_len=4, count=torch.zeros((), dtype=torch.int32))


def test_a_write_of_other_than_the_tokens_given_is_refused_before_it_lands():
    # A forward given two tokens that writes three (a prefix of the model's own) would write
    # past what the decoder counts; at the cache's end, past the cache itself (on a GPU, a
    # device-side assert that ends the CUDA context). It is refused, the cache untouched.
    from grape.torch.options import NotGraphable
    from grape.torch.static_layers import Tokens

    given, count = Tokens(), torch.zeros(1, dtype=torch.long)
    layer = CountedLayer(max_cache_len=4, count=count, tokens=given)
    given.n = 2
    layer.update(_states(2, 1.0), _states(2, 1.0))
    with pytest.raises(NotGraphable, match="wrote 3 tokens to the cache for the 2 it was given"):
        layer.update(_states(3, 5.0), _states(3, 5.0))
    assert not (layer.keys == 5.0).any()
    given.n = None  # no forward under way: no check
    layer.update(_states(3, 1.0), _states(3, 1.0))


def test_a_model_that_adds_tokens_of_its_own_is_refused_with_the_reason():
    # CPM-Ant prepends a prompt of its own (config.prompt_length) to every input: 16 tokens
    # given, 48 written, into a cache of 40.
    transformers = pytest.importorskip("transformers")
    from grape.torch.decoding import TokenDecoder
    from grape.torch.options import NotGraphable, resolve

    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(
        "cpmant", hidden_size=64, num_hidden_layers=2, num_attention_heads=2, dim_head=32,
        dim_ff=128, prompt_length=32, vocab_size=300)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 300, (1, 16))
    options, mask = resolve(model, ids, None, dict(max_new_tokens=24, do_sample=False,
                                                   eos_token_id=None, pad_token_id=0))
    decoder = TokenDecoder(model, 1, 16, options)
    with pytest.raises(NotGraphable, match="wrote 48 tokens to the cache for the 16"):
        decoder.prefill(ids, mask)


def test_a_layer_written_twice_in_one_forward_is_refused():
    # transformers' layers append a second write after the first; grape's would write it over
    # the first (a model running its layers more than once a forward, as Dory's small configs).
    from grape.torch.options import NotGraphable
    from grape.torch.static_layers import Tokens

    given, count = Tokens(), torch.zeros(1, dtype=torch.long)
    layer = CountedLayer(max_cache_len=8, count=count, tokens=given)
    given.begin(2)
    layer.update(_states(2, 1.0), _states(2, 1.0))
    with pytest.raises(NotGraphable, match="wrote a cache layer twice"):
        layer.update(_states(2, 2.0), _states(2, 2.0))
    given.begin(2)  # the next forward writes it again, once
    layer.update(_states(2, 3.0), _states(2, 3.0))


def _hf_and_grape_logits(model_type, sizes, **kwargs):
    transformers = pytest.importorskip("transformers")
    from grape.torch.decoding import TokenDecoder
    from grape.torch.options import resolve

    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(model_type, **sizes)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, sizes["vocab_size"], (1, 12),
                        generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0,
              output_logits=True, return_dict_in_generate=True, **kwargs)
    reference = model.generate(ids, cache_implementation="static", **kw)
    options, mask = resolve(model, ids, None, dict(kw))
    ours = TokenDecoder(model, 1, 12, options).generate_on_host(ids, mask)
    return reference.logits, ours.logits


def test_a_sliding_layer_held_whole_keeps_its_flag_for_transformers_mask_sizes():
    # RecurrentGemma: two recurrent layers (their state in the model's modules, the cache
    # layers never written) and a sliding-window attention layer whose window holds the whole
    # generation. transformers takes a sliding mask's sizes from the first layer flagged
    # sliding, else from layer 0: under 5.25 a recurrent layer counting no token, and every
    # decode step attended over one key.
    reference, ours = _hf_and_grape_logits(
        "recurrent_gemma", {"hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 3, "num_attention_heads": 4,
                            "num_key_value_heads": 1, "head_dim": 16, "lru_width": 64,
                            "attention_window_size": 64, "vocab_size": 300})
    assert len(reference) == len(ours) == 5
    # Equal to float32 rounding (the prompt's attention kernel may differ with the mask);
    # attending over one key instead of all moved logits by units.
    assert all(torch.allclose(a, b, rtol=0, atol=1e-4) for a, b in zip(reference, ours,
                                                                        strict=True))


def test_a_cache_layer_that_holds_nothing_is_kept_and_the_logits_are_generates():
    # Nemotron-H: a Mamba layer, an MLP layer and an attention layer. Under transformers 5.2x
    # the MLP layer's cache layer is a DummyLayer, which holds nothing (grape refused it as a
    # kind of layer it did not know, so the model fell back).
    reference, ours = _hf_and_grape_logits(
        "nemotron_h", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                       "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16,
                       "n_groups": 1, "hybrid_override_pattern": "M-*", "vocab_size": 300})
    assert len(reference) == len(ours) == 5
    assert all(torch.allclose(a, b, rtol=0, atol=1e-4) for a, b in zip(reference, ours,
                                                                        strict=True))
