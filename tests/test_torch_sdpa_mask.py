"""grape.torch.sdpa_mask without a GPU: in the block a forward converts its boolean mask for
SDPA once, every layer gets the converted mask, and the logits are what they are without it;
outside the block, and after it, transformers' SDPA attention is its own."""

from __future__ import annotations

from unittest import mock

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import grape.torch.sdpa_mask as sdpa_mask  # noqa: E402
from grape.torch.sdpa_mask import convert_once  # noqa: E402

LAYERS = 3


@pytest.fixture(scope="module")
def model():
    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config,
                                                         attn_implementation="sdpa").eval()


def _run(model, convert: bool, devices=("cpu",)):
    """The logits of a left-padded batch, the dtype of each mask SDPA got, and how many
    conversions were made."""
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # padding: transformers builds a boolean mask
    seen, made, sdpa = [], [], torch.nn.functional.scaled_dot_product_attention
    additive = sdpa_mask.additive

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(None if attn_mask is None else attn_mask.dtype)
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    def counted(m, dtype):
        made.append(dtype)
        return additive(m, dtype)

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", spy), \
            mock.patch.object(sdpa_mask, "DEVICES", set(devices)), \
            mock.patch.object(sdpa_mask, "additive", counted), torch.no_grad():
        if convert:
            with convert_once():
                logits = model(ids, attention_mask=mask).logits
        else:
            logits = model(ids, attention_mask=mask).logits
    return logits, seen, made


def test_a_forward_converts_its_boolean_mask_once_for_every_layer(model):
    plain, seen, made = _run(model, convert=False)
    assert seen == [torch.bool] * LAYERS and made == []
    once, seen, made = _run(model, convert=True)
    assert seen == [torch.float32] * LAYERS  # each layer got the additive mask
    assert made == [torch.float32]  # made once
    torch.testing.assert_close(once, plain, rtol=0, atol=1e-6)


def test_only_where_the_conversion_was_checked(model):
    _, seen, made = _run(model, convert=True, devices=("cuda",))  # a CPU model: as it is
    assert seen == [torch.bool] * LAYERS and made == []


def test_a_position_bias_keeps_the_boolean_mask():
    """transformers merges a boolean mask with a position bias otherwise than a float one."""
    got = []

    def sdpa(module, q, k, v, attention_mask, *args, **kwargs):
        got.append(attention_mask.dtype)
        return q, None

    wrapped = sdpa_mask._converting(sdpa)
    q = torch.zeros(1, 1, 1, 4)
    m = torch.ones(1, 1, 1, 4, dtype=torch.bool)
    with mock.patch.object(sdpa_mask, "DEVICES", {"cpu"}):
        token = sdpa_mask._CONVERTED.set({})
        try:
            wrapped(None, q, q, q, m, position_bias=torch.zeros(1, 1, 1, 4))
            wrapped(None, q, q, q, m)
        finally:
            sdpa_mask._CONVERTED.reset(token)
    assert got == [torch.bool, torch.float32]


def test_the_block_restores_transformers_attention_and_nests():
    from transformers import AttentionInterface
    entries = AttentionInterface._global_mapping
    before = entries["sdpa"]
    with convert_once():
        inside = entries["sdpa"]
        assert inside is not before and inside.grape_original is before
        with convert_once():
            assert entries["sdpa"] is inside  # not wrapped twice
        assert entries["sdpa"] is inside
    assert entries["sdpa"] is before


def test_the_additive_form_is_zero_where_attended_and_minus_infinity_elsewhere():
    m = torch.tensor([[True, False, True]])
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        a = sdpa_mask.additive(m, dtype)
        assert a.dtype == dtype
        assert a.tolist() == [[0.0, float("-inf"), 0.0]]
