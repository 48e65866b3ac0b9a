"""GreedyDecoder against Hugging Face's greedy generate, on the CPU (where torch is installed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from grape.errors import GrapeError  # noqa: E402
from grape.torch.generate import GreedyDecoder, generate_host_loop  # noqa: E402

NEW = 24


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300,
                                     n_positions=128, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def _hf(model, prompt, eos, **kwargs):
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                             pad_token_id=0, **kwargs)
    return out[:, prompt.shape[1]:]


@pytest.mark.parametrize("cache", [None, "static"], ids=["dynamic cache", "static cache"])
def test_tokens_equal_generate_without_eos(model, cache):
    prompt = torch.randint(1, 300, (3, 7), generator=torch.Generator().manual_seed(1))
    expected = _hf(model, prompt, None, cache_implementation=cache)
    got = generate_host_loop(GreedyDecoder(model, prompt, NEW, None, 0))
    assert got.shape == (3, NEW) and torch.equal(got, expected)


def test_tokens_equal_generate_where_some_sequences_end(model):
    prompt = torch.randint(1, 300, (3, 7), generator=torch.Generator().manual_seed(2))
    eos = int(_hf(model, prompt, None)[1, 3])  # sequence 1 emits it by its fourth token
    expected = _hf(model, prompt, eos)
    got = generate_host_loop(GreedyDecoder(model, prompt, NEW, eos, 0))
    assert torch.equal(got, expected)
    assert (got[1] == eos).any() and (got[1, -1] == 0)  # pad after EOS


def test_generation_stops_when_every_sequence_has_ended(model):
    prompt = torch.randint(1, 300, (1, 5), generator=torch.Generator().manual_seed(3))
    eos = int(_hf(model, prompt, None)[0, 2])
    expected = _hf(model, prompt, eos)
    decoder = GreedyDecoder(model, prompt, NEW, eos, 0)
    got = generate_host_loop(decoder)
    assert got.shape[1] < NEW and torch.equal(got, expected)
    assert not bool(decoder.running)


def test_a_decoder_runs_again_from_its_prompt(model):
    prompt = torch.randint(1, 300, (2, 6), generator=torch.Generator().manual_seed(4))
    decoder = GreedyDecoder(model, prompt, NEW, None, 0)
    assert torch.equal(generate_host_loop(decoder), generate_host_loop(decoder))


def test_bad_prompts_and_unbounded_loops_are_refused(model):
    with pytest.raises(GrapeError, match=r"shape \(batch, length >= 1\) and dtype long"):
        GreedyDecoder(model, torch.zeros(5, dtype=torch.long), NEW, None)
    with pytest.raises(GrapeError, match="a loop needs a bound"):
        GreedyDecoder(model, torch.zeros((1, 3), dtype=torch.long), 0, None)


def test_a_decoder_keeps_the_last_logits_when_asked(model):
    prompt = torch.randint(1, 300, (2, 6), generator=torch.Generator().manual_seed(5))
    assert GreedyDecoder(model, prompt, NEW, None, 0).logits is None
    decoder = GreedyDecoder(model, prompt, NEW, None, 0, keep_logits=True)
    decoder.prefill()
    with torch.no_grad():
        expected = model(prompt).logits[:, -1]
    assert torch.allclose(decoder.logits, expected, atol=1e-5)
    before = decoder.logits.data_ptr()
    decoder.step()  # the same buffer, the next token's logits
    assert decoder.logits.data_ptr() == before
    assert torch.equal(decoder.tokens[:, 1], decoder.logits.argmax(-1))


def test_generated_tokens_do_not_change_when_the_decoder_runs_again(model):
    # A view of the decoder's buffer would: the predication benchmark once compared every way's
    # tokens through such views, and so compared the last run's tokens each time.
    decoder = GreedyDecoder(model, torch.randint(1, 300, (2, 6), generator=torch.Generator()
                                                 .manual_seed(6)), NEW, None, 0)
    first = generate_host_loop(decoder)
    kept = first.clone()
    decoder.prefill()
    decoder.tokens.fill_(7)  # what a later generation, or a graph replay, would write
    assert torch.equal(first, kept)
