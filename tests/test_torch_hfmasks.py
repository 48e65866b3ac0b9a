"""grape.torch.hfmasks without a GPU: under a (simulated) CUDA capture, a model given no padding
mask passes SDPA no mask, as it does eagerly; a padding mask is still built into one; outside
the block, and after it, transformers behaves as it does."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from grape.torch.hfmasks import no_padding_shortcut  # noqa: E402


@pytest.fixture(scope="module")
def model():
    transformers.logging.set_verbosity_error()
    config = transformers.Wav2Vec2Config(hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=128,
                                         conv_dim=(32, 32), conv_stride=(5, 2),
                                         conv_kernel=(10, 3), num_feat_extract_layers=2,
                                         vocab_size=32)
    return transformers.Wav2Vec2ForCTC(config).eval()


def _masks(model, capturing: bool, shortcut: bool, **kwargs):
    """The attn_mask each SDPA call got (None, or its shape)."""
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(None if attn_mask is None else tuple(attn_mask.shape))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", spy), \
            mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: capturing), \
            (no_padding_shortcut() if shortcut else mock.MagicMock()), torch.no_grad():
        model(torch.randn(2, 4000), **kwargs)
    return seen


def test_under_a_capture_no_padding_mask_means_no_mask_as_eagerly(model):
    assert _masks(model, capturing=False, shortcut=False) == [None, None]
    assert _masks(model, capturing=True, shortcut=True) == [None, None]
    # transformers 5.17 (the GPU machine's) builds the full mask under a capture by itself;
    # 5.24 no longer does, and the block then changes nothing.
    assert _masks(model, capturing=True, shortcut=False) in ([None, None],
                                                             [(2, 1, 399, 399)] * 2)


def test_a_padding_mask_is_still_built_under_a_capture(model):
    padding = torch.ones(2, 4000, dtype=torch.long)
    padding[1, 3000:] = 0
    masks = _masks(model, capturing=True, shortcut=True, attention_mask=padding)
    assert masks == [(2, 1, 399, 399)] * 2


def test_the_block_restores_transformers_as_it_was(model):
    from transformers import masking_utils

    own = _masks(model, capturing=True, shortcut=False)
    before = masking_utils._ignore_bidirectional_mask_sdpa
    with no_padding_shortcut(), no_padding_shortcut():  # nested: wrapped once
        assert masking_utils._ignore_bidirectional_mask_sdpa.grape_original is before
    assert masking_utils._ignore_bidirectional_mask_sdpa is before
    assert _masks(model, capturing=True, shortcut=False) == own


# --- prompt_padding_on_device -----------------------------------------------------------------

@pytest.fixture(scope="module")
def decoder():
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=100, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _prompt(model, mask, block):
    """The prompt's logits over an empty static cache, each SDPA call's (mask given, causal),
    and the branches taken on the device's decision."""
    from grape.torch import hfmasks

    ids = torch.arange(2 * 6).view(2, 6) % 100
    cache = transformers.StaticCache(config=model.config, max_cache_len=12)
    seen, branches, sdpa, cond = [], [], torch.nn.functional.scaled_dot_product_attention, \
        hfmasks.cond

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        seen.append((attn_mask is not None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    def counted(pred, *args):
        branches.append(bool(pred))
        return cond(pred, *args)

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", spy), \
            mock.patch.object(hfmasks, "cond", counted), block, torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache,
                       use_cache=True).logits
    return logits, seen, branches


@pytest.mark.parametrize("padded", [False, True], ids=["no padding", "left padding"])
def test_a_prompt_decided_on_the_device_runs_what_eager_code_runs(decoder, padded):
    from grape.torch.hfmasks import prompt_padding_on_device

    mask = torch.ones(2, 6, dtype=torch.long)
    if padded:
        mask[1, :2] = 0
    eager, eager_calls, none = _prompt(decoder, mask, contextlib.nullcontext())
    assert none == [] and eager_calls == [(padded, not padded)] * 3
    # Deciding as under a capture: the mask is built, and each layer branches on whether it
    # has padding, to SDPA without it (causal) or with it: the calls and bits of eager code.
    decided, calls, branches = _prompt(decoder, mask, prompt_padding_on_device(eagerly=True))
    assert branches == [not padded] * 3
    assert calls == eager_calls
    assert torch.equal(decided, eager)


def test_a_prompt_given_no_mask_decides_on_the_host_as_eagerly(decoder):
    from grape.torch.hfmasks import prompt_padding_on_device

    eager, eager_calls, _ = _prompt(decoder, None, contextlib.nullcontext())
    # Nothing to ask of a mask that is not there: no branch, SDPA's causal kernels, as eagerly
    # (no_padding_shortcut's case, which the block covers too).
    decided, calls, branches = _prompt(decoder, None, prompt_padding_on_device(eagerly=True))
    assert branches == [] and calls == eager_calls == [(False, True)] * 3
    assert torch.equal(decided, eager)


def test_a_deferred_test_leaves_transformers_own_functions_in_place(decoder):
    # While the block evaluates a shortcut test with its questions answered otherwise, another
    # thread running transformers must still see transformers' fast_all and is_tracing: the
    # test runs with its own globals, the module's are never swapped.
    from transformers import masking_utils as masking

    from grape.torch import hfmasks

    real = masking.fast_all, masking.is_tracing
    during = []

    def not_tracing(*args, **kwargs):  # called from inside the test, in place of is_tracing
        during.append((masking.fast_all, masking.is_tracing) == real)
        return False

    mask = torch.ones(2, 6, dtype=torch.long)
    with mock.patch.object(hfmasks, "_not_tracing", not_tracing):
        _, _, branches = _prompt(decoder, mask, hfmasks.prompt_padding_on_device(eagerly=True))
    assert branches == [True] * 3 and during and all(during)


def test_the_prompt_block_restores_transformers_as_it_was():
    from transformers import AttentionInterface
    from transformers import masking_utils as masking
    from transformers.masking_utils import AttentionMaskInterface

    from grape.torch.hfmasks import prompt_padding_on_device

    def state():
        return (masking.sdpa_mask, masking._ignore_causal_mask_sdpa,
                AttentionMaskInterface._global_mapping["sdpa"],
                AttentionInterface._global_mapping["sdpa"], masking.fast_all, masking.is_tracing)

    before = state()
    with prompt_padding_on_device(), prompt_padding_on_device():  # nested: wrapped once
        inside = state()
        assert inside[0].grape_original is before[0] and inside[3].grape_original is before[3]
        assert inside[1].grape_original is before[1] and inside[4:] == before[4:]
    assert state() == before


@pytest.mark.parametrize("padded", [False, True], ids=["no padding", "left padding"])
def test_an_encoders_bidirectional_mask_is_decided_on_the_device_too(padded):
    # transformers' bidirectional test asks the mask's values through padding_mask.all(), not
    # fast_all: under a capture that read broke the captured prompt of every encoder-decoder
    # model on the H200. Its question is now deferred to the device as the causal test's is.
    from grape.torch import hfmasks

    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, vocab_size=100,
                                     attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = torch.arange(2 * 6).view(2, 6) % 100
    mask = torch.ones(2, 6, dtype=torch.long)
    if padded:
        mask[1, :2] = 0
    branches, cond = [], hfmasks.cond

    def counted(pred, *args):
        branches.append(bool(pred))
        return cond(pred, *args)

    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask).last_hidden_state
        with mock.patch.object(hfmasks, "cond", counted), \
                hfmasks.prompt_padding_on_device(eagerly=True):
            decided = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert branches == [not padded] * 2
    assert torch.equal(decided, eager)
