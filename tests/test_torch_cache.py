"""PrefixCache against Hugging Face's DynamicCache, on the CPU (where torch is installed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from grape.errors import GrapeError  # noqa: E402
from grape.torch.cache import PrefixCache  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture
def one_thread():
    """One CPU thread while a test compares two computations bit for bit. The test below
    failed once in CI (2026-12-02, other work running on the machine) and passed every time
    alone, in 200 prompts and under load; the likely cause, not shown, is a BLAS that takes
    fewer threads on a busy machine (MKL's dynamic threads), which sums in another order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_decoding_matches_the_dynamic_cache_exactly(model, one_thread):
    prompt = torch.randint(0, 100, (2, 10))
    dynamic, prefix = transformers.DynamicCache(), PrefixCache(2, 32)
    with torch.no_grad():
        a = model(prompt, past_key_values=dynamic).logits
        b = model(prompt, past_key_values=prefix).logits
        assert torch.equal(a, b)
        ids = torch.randint(0, 100, (2, 1))
        for _ in range(4):
            assert torch.equal(model(ids, past_key_values=dynamic).logits,
                               model(ids, past_key_values=prefix).logits)
        assert prefix.get_seq_length() == dynamic.get_seq_length() == 14
        # Going back to a length decodes as a cache cropped to it does.
        prefix.set_length(12)
        dynamic.crop(-2)
        assert torch.equal(model(ids, past_key_values=dynamic).logits,
                           model(ids, past_key_values=prefix).logits)


def test_the_buffers_never_move(model):
    cache = PrefixCache(2, 32)
    with torch.no_grad():
        model(torch.randint(0, 100, (1, 5)), past_key_values=cache)
        before = [layer.key_buffer.data_ptr() for layer in cache.layers]
        for n in (3, 7, 20):
            cache.set_length(n)
            model(torch.randint(0, 100, (1, 1)), past_key_values=cache)
    assert [layer.key_buffer.data_ptr() for layer in cache.layers] == before
    assert cache.layers[0].keys.data_ptr() == before[0]


def test_overflow_and_bad_lengths_are_refused(model):
    cache = PrefixCache(2, 8)
    with torch.no_grad(), pytest.raises(GrapeError, match="at most 8 cached tokens"):
        model(torch.randint(0, 100, (1, 9)), past_key_values=cache)
    with pytest.raises(GrapeError, match="cache length in 0..8"):
        cache.set_length(9)
