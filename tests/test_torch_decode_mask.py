"""grape.torch.decode_mask without a GPU: with a capture simulated, every decode step's causal
mask over grape's padded cache is the running 2D mask's view, equal element for element to the
mask transformers builds, across architectures and strategies, and the tokens stay
generate's; masks it must not replace (sliding windows, several queries, another shape) are
transformers' own."""

from __future__ import annotations

from unittest import mock

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import grape.torch.decode_mask as decode_mask  # noqa: E402
from grape.errors import GrapeError  # noqa: E402
from grape.torch.beam import BeamDecoder  # noqa: E402
from grape.torch.decoding import TokenDecoder  # noqa: E402
from grape.torch.options import resolve  # noqa: E402
from tests.test_torch_generation import CONFIGS, _built, _prompt, _same_layout  # noqa: E402


def _generate(model, ids, mask, seen, **kwargs):
    """The host loop's tokens, every decode mask held to transformers' (decode_mask.checked):
    ``seen`` gets the counts of views and of masks left to transformers."""
    options, m = resolve(model, ids, mask, kwargs)
    cls = BeamDecoder if options.strategy == "beam" else TokenDecoder
    decoder = cls(model, ids.shape[0], ids.shape[1], options)
    with decode_mask.checked() as counts:
        out = decoder.generate_on_host(ids, m)
    seen.update(counts)
    return out


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("kwargs", [{}, {"num_beams": 3}], ids=["greedy", "beam 3"])
def test_each_step_s_mask_is_the_running_mask_and_the_tokens_generate_s(arch, kwargs):
    model = _built(arch, CONFIGS[arch])
    ids, mask = _prompt()  # left padding
    seen = {"viewed": 0, "built": 0}
    got = _generate(model, ids, mask, seen, max_new_tokens=8, **kwargs)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                               **_same_layout(model, ids, 8), **kwargs)
    assert torch.equal(got, reference)
    if arch == "mistral":  # its sliding window's mask function is not the causal one
        assert seen["viewed"] == 0 and seen["built"] > 0
    elif seen["viewed"] == 0:
        # Models that build their masks by their own code never ask transformers for one.
        assert seen["built"] == 0, arch


def test_gpt2_and_llama_take_the_view_at_every_step():
    for arch in ("gpt2", "llama"):
        seen = {"viewed": 0, "built": 0}
        ids, mask = _prompt()
        _generate(_built(arch, CONFIGS[arch]), ids, mask, seen, max_new_tokens=6)
        assert seen == {"viewed": 5, "built": 0}, arch  # the first token is the prompt's


def test_outside_a_capture_and_outside_the_block_transformers_builds_its_own():
    from transformers import masking_utils as masking
    from transformers.masking_utils import AttentionMaskInterface
    before = masking.sdpa_mask, AttentionMaskInterface._global_mapping["sdpa"]
    padding = torch.ones(2, 5, dtype=torch.bool)
    with decode_mask.running_mask((2, 5)):
        assert masking.sdpa_mask is not before[0]
        # No capture: transformers' own answer (here: no mask at all, its causal skip).
        assert masking.sdpa_mask(2, 1, 5, q_offset=4, attention_mask=padding) is None
        with decode_mask.checked() as counts:  # the view, held to the mask built
            masking.sdpa_mask(2, 1, 5, q_offset=4, attention_mask=padding)
        assert counts == {"viewed": 1}
        # A mask with a one past the query's position (not grape's): the check catches it.
        past = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.bool)
        with decode_mask.checked(), pytest.raises(GrapeError, match="1 of 10 elements"):
            masking.sdpa_mask(2, 1, 5, q_offset=3, attention_mask=past)
        with mock.patch.object(decode_mask, "capturing", lambda: True):
            view = masking.sdpa_mask(2, 1, 5, q_offset=4, attention_mask=padding)
            assert view.shape == (2, 1, 1, 5) and view.data_ptr() == padding.data_ptr()
            # Two queries, another width, a sliding window: built by transformers (its skip
            # off, as under a capture).
            built = dict(allow_is_causal_skip=False)
            assert masking.sdpa_mask(2, 2, 5, q_offset=3, attention_mask=padding, **built) \
                .data_ptr() != padding.data_ptr()
            wider = torch.ones(2, 6, dtype=torch.bool)
            assert masking.sdpa_mask(2, 1, 6, q_offset=5, attention_mask=wider, **built) \
                .data_ptr() != wider.data_ptr()
            window = masking.sliding_window_causal_mask_function(3)
            assert masking.sdpa_mask(2, 1, 5, q_offset=4, mask_function=window,
                                     attention_mask=padding, **built).data_ptr() \
                != padding.data_ptr()
    assert (masking.sdpa_mask, AttentionMaskInterface._global_mapping["sdpa"]) == before
