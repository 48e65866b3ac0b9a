"""grape.torch.hfmasks without a GPU: under a (simulated) CUDA capture, a model given no padding
mask passes SDPA no mask, as it does eagerly; a padding mask is still built into one; outside
the block, and after it, transformers behaves as it does."""

from __future__ import annotations

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
