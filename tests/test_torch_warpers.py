"""Sampling's temperature and top-p read from the device (grape.torch.warpers): generate's
warpers bit for bit, and one executable's worth of decoder serving any of their values. On the
CPU here; on a GPU, tests/test_gpu_generate.py -k temperatures."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from transformers.generation.logits_process import (  # noqa: E402
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from grape.torch.decoding import TokenDecoder  # noqa: E402
from grape.torch.host_loop import generate_on_host  # noqa: E402
from grape.torch.options import resolve  # noqa: E402
from grape.torch.warpers import DeviceTemperature, DeviceTopP  # noqa: E402
from tests.test_torch_generation import CONFIGS, _built, _prompt  # noqa: E402


def _scores(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(4, 3000, generator=g) * 4
    scores[0, :50] = -float("inf")  # suppressed tokens, as processors leave them
    scores[1, 7] = 30.0  # one token holding nearly all the mass
    return scores


def test_the_device_warpers_are_generates_bit_for_bit():
    temperature, top_p = DeviceTemperature(1.0, "cpu"), DeviceTopP(0.5, "cpu")
    for seed in range(5):
        scores = _scores(seed)
        for t in (0.05, 0.2, 0.7, 1.0, 1.3, 3.7):
            temperature.set(t)
            assert torch.equal(temperature(None, scores),
                               TemperatureLogitsWarper(t)(None, scores)), t
        for p in (0.01, 0.3, 0.5, 0.9, 0.95, 0.999):
            top_p.set(p)
            assert torch.equal(top_p(None, scores), TopPLogitsWarper(p)(None, scores)), p


def test_temperature_and_top_p_are_not_the_graphs_whether_top_p_applies_is():
    model = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()

    def key(**kwargs):
        options, _ = resolve(model, ids, mask, dict(max_new_tokens=4, do_sample=True, **kwargs))
        return options.key
    assert key(temperature=0.5, top_p=0.9) == key(temperature=1.7, top_p=0.3)
    assert key(temperature=0.5, top_p=0.9) != key(temperature=0.5, top_p=1.0)
    assert key(top_k=5) != key(top_k=6)  # top-k's kernels are sized by it


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_decoder_made_for_one_temperature_samples_another_once_set(kind):
    # What a captured executable does at a later call: the decoder made for the first call's
    # values, set to the next call's before it runs, makes what a decoder made for those does.
    model = _built(kind, CONFIGS[kind])
    ids, mask = _prompt()
    first = dict(max_new_tokens=10, do_sample=True, temperature=0.6, top_p=0.8, top_k=0)
    later = dict(first, temperature=1.9, top_p=0.4)
    made_for_later = generate_on_host(model, ids, mask, seed=5, **later)
    assert not torch.equal(made_for_later, generate_on_host(model, ids, mask, seed=5, **first))
    options, resolved_mask = resolve(model, ids, mask, first)
    decoder = TokenDecoder(model, ids.shape[0], ids.shape[1], options)
    decoder.set_seed(5)
    decoder.set_sampling(resolve(model, ids, mask, later)[0])
    assert torch.equal(decoder.generate_on_host(ids, resolved_mask), made_for_later)
