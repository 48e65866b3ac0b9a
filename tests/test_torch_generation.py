"""grape.generate's decoders on the CPU: the host loop of the very step a device loop captures,
held token for token to Hugging Face generate with the same (static) cache, across
architectures and strategies; sampling, options, fallbacks and bad input."""

from __future__ import annotations

import dataclasses
import shutil
import warnings

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from grape.errors import GrapeError  # noqa: E402
from grape.torch.beam import BeamDecoder  # noqa: E402
from grape.torch.decoding import ExactRefused, TokenDecoder, sample, static_cache  # noqa: E402
from grape.torch.host_loop import generate_on_host  # noqa: E402
from grape.torch.options import NotGraphable, resolve  # noqa: E402

# Inductor's CPU kernels are C++: the compiled-step tests need a compiler.
_NEEDS_CXX = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                reason="Inductor on the CPU needs a C++ compiler")
VOCAB = 300
COMMON = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
CONFIGS = {
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 128},
    "llama": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2},
    "opt": {"hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "word_embed_proj_dim": 64},
    "mistral": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 64},
    "gptj": {"n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8, "n_positions": 128},
    "falcon": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
    "bloom": {"hidden_size": 64, "n_layer": 2, "n_head": 4},
    "mixtral": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
                "num_experts_per_tok": 2},
}
EOS = [5, 7, 11, 13, 17, 19, 23]  # several, so that some sequences end early
STRATEGIES = {
    "greedy": {},
    "greedy, EOS and min_new_tokens": {"eos_token_id": EOS, "min_new_tokens": 4},
    "beam 5": {"num_beams": 5},
    "beam 4, EOS": {"num_beams": 4, "eos_token_id": EOS},
    "beam 3, length penalty, early stopping": {"num_beams": 3, "length_penalty": 0.5,
                                               "early_stopping": True, "eos_token_id": EOS},
}


def _built(model_type, sizes):
    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(model_type, **sizes, **COMMON)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    return _built(request.param, CONFIGS[request.param])


def _prompt(batch=3, length=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(30, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding: prompts of different lengths
    mask[1:2, :1] = 0
    return ids, mask


def _host(model, ids, mask, seed=1, **kwargs):
    return generate_on_host(model, ids, mask, seed=seed, **kwargs)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_host_loop_makes_generates_tokens(model, strategy):
    ids, mask = _prompt()
    kwargs = dict(STRATEGIES[strategy], max_new_tokens=12)
    reference = model.generate(ids, attention_mask=mask, cache_implementation="static",
                               **kwargs)
    assert torch.equal(_host(model, ids, mask, **kwargs), reference)


@pytest.mark.parametrize("strategy", ["greedy", "beam 4, EOS"])
def test_a_cache_longer_than_the_generation_makes_the_same_tokens(strategy):
    # A server's cache, sized once: the masked columns past the generation change nothing.
    config = transformers.AutoConfig.for_model("llama", **CONFIGS["llama"], **COMMON)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids, mask = _prompt()
    kwargs = dict(STRATEGIES[strategy], max_new_tokens=10)
    options, m_mask = resolve(m, ids, mask, dict(kwargs))
    longer = dataclasses.replace(options, cache_length=40)
    assert longer.cache_tokens(ids.shape[1]) == 40 and options.cache_tokens(7) == 17
    assert longer.key != options.key  # another executable
    cls = BeamDecoder if options.strategy == "beam" else TokenDecoder
    decoder = cls(m, ids.shape[0], ids.shape[1], longer)
    assert decoder.cache.layers[0].max_cache_len == 40
    assert torch.equal(decoder.generate_on_host(ids, m_mask), _host(m, ids, mask, **kwargs))


def test_the_comparisons_see_sequences_end_early():
    # The EOS strategies above are only a test of stopping if some sequence stops: check one.
    config = transformers.AutoConfig.for_model("llama", **CONFIGS["llama"], **COMMON)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids, mask = _prompt()
    out = _host(m, ids, mask, max_new_tokens=12, eos_token_id=EOS, num_beams=4)
    new = out[:, ids.shape[1]:]
    assert torch.isin(new, torch.tensor(EOS)).any() or out.shape[1] < ids.shape[1] + 12


def test_sampling_repeats_itself_for_a_seed_and_not_across_seeds(model):
    ids, mask = _prompt()
    kwargs = {"do_sample": True, "max_new_tokens": 16, "top_k": 0, "temperature": 1.5}
    a = _host(model, ids, mask, seed=3, **kwargs)
    assert torch.equal(a, _host(model, ids, mask, seed=3, **kwargs))
    assert not torch.equal(a, _host(model, ids, mask, seed=4, **kwargs))


def test_sampling_draws_from_the_processed_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -float("inf")]])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, torch.rand((1, 1), generator=g))
                         for _ in range(20000)]).flatten()
    freq = torch.bincount(draws, minlength=5).double() / len(draws)
    expected = torch.softmax(logits[0].double(), dim=0)
    assert freq[4] == 0  # a filtered token is never drawn
    assert torch.allclose(freq, expected, atol=0.012), (freq, expected)
    # The ends of [0, 1): the first token with probability, and the last.
    assert sample(logits, torch.zeros((1, 1))).item() == 0
    assert sample(logits, torch.full((1, 1), 1 - 2**-24)).item() == 3


def test_top_k_and_top_p_keep_the_draws_inside_their_set():
    config = transformers.AutoConfig.for_model("gpt2", **CONFIGS["gpt2"], **COMMON)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids, _ = _prompt(batch=1)
    options, _ = resolve(m, ids, None, {"do_sample": True, "top_k": 3, "max_new_tokens": 4})
    decoder = TokenDecoder(m, 1, ids.shape[1], options)
    logits = torch.randn(1, VOCAB)
    allowed = set(torch.topk(logits, 3).indices[0].tolist())
    for i in range(200):
        token = sample(decoder._processed(logits), torch.rand((1, 1)))
        assert token.item() in allowed, i


def test_a_sliding_window_that_holds_the_generation_is_a_static_layer_else_a_counted_window():
    config = transformers.AutoConfig.for_model("mistral", **CONFIGS["mistral"], **COMMON)
    m = transformers.AutoModelForCausalLM.from_config(config)
    from grape.torch.exact import TokenMajorLayer
    from grape.torch.static_layers import CountedLayer, CountedSlidingLayer

    count = torch.zeros(1, dtype=torch.long)
    assert all(type(layer) is CountedLayer for layer in static_cache(m, 64, count).layers)
    # Shorter than the generation: held on the device (tests/test_torch_sliding_window.py),
    # the same under exact lengths (whose kernel serves the full layers: Mistral has none,
    # and exact lengths are refused with the reason), refused by compiled steps.
    shorter = static_cache(m, 65, count).layers
    assert all(type(layer) is CountedSlidingLayer and layer.window == 64 for layer in shorter)
    with pytest.raises(ExactRefused, match="no cache layer of MistralForCausalLM holds it "
                                           "\\(its layers: CountedSlidingLayer\\)"):
        static_cache(m, 65, count, TokenMajorLayer)
    with pytest.raises(NotGraphable, match="whose mask offset a compiled step would read back"):
        static_cache(m, 65, count, ranged=False)


@pytest.mark.parametrize("kwargs, reason", [
    ({"guidance_scale": 1.5}, "guidance_scale="),
    ({"num_beams": 2, "do_sample": True}, "beam search with sampling"),
    ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions=True"),
    ({"no_such_option": 3}, "arguments grape does not pass on: \\['no_such_option'\\]"),
])
def test_options_grape_does_not_reproduce_are_named(kwargs, reason):
    config = transformers.AutoConfig.for_model("gpt2", **CONFIGS["gpt2"], **COMMON)
    m = transformers.AutoModelForCausalLM.from_config(config)
    ids, _ = _prompt()
    with pytest.raises(NotGraphable, match=reason):
        resolve(m, ids, None, {**kwargs, "max_new_tokens": 4})


@pytest.mark.parametrize("args, message", [
    ((torch.zeros(3, dtype=torch.long), None, 4), "expected input_ids of shape \\(batch, "
                                                  "length >= 1\\) and dtype long, found shape"),
    ((torch.zeros((1, 3)), None, 4), "found shape \\(1, 3\\) and torch.float32"),
    ((torch.zeros((1, 3), dtype=torch.long), torch.ones((1, 4)), 4),
     "expected an attention_mask of shape \\(1, 3\\) on cpu, found shape \\(1, 4\\)"),
    ((torch.zeros((1, 3), dtype=torch.long), None, 0),
     "expected max_new_tokens to be an integer of at least 1, found 0"),
    ((torch.zeros((1, 3), dtype=torch.long), None, "8"),
     "expected max_new_tokens to be an integer of at least 1, found '8'"),
    ((torch.zeros((1, 3), dtype=torch.long), None, 4, 6),
     "expected cache_length to be an integer of at least the prompt's length plus "
     "max_new_tokens \\(7\\), found 6"),
    ((torch.zeros((1, 3), dtype=torch.long), None, 4, 8.0),
     "expected cache_length to be an integer .*, found 8.0"),
])
def test_bad_input_is_one_line(args, message):
    import grape

    config = transformers.AutoConfig.for_model("gpt2", **CONFIGS["gpt2"], **COMMON)
    m = transformers.AutoModelForCausalLM.from_config(config)
    ids, mask, new, *cache = args
    with pytest.raises(GrapeError, match=message) as info:
        grape.generate(m, ids, mask, max_new_tokens=new, cache_length=(cache or [None])[0])
    assert "\n" not in str(info.value)


def test_bad_sampling_values_are_refused():
    config = transformers.AutoConfig.for_model("gpt2", **CONFIGS["gpt2"], **COMMON)
    m = transformers.AutoModelForCausalLM.from_config(config)
    ids, _ = _prompt()
    with pytest.raises(GrapeError, match="expected temperature > 0"):
        resolve(m, ids, None, {"do_sample": True, "temperature": 0.0, "max_new_tokens": 4})
    with pytest.raises(GrapeError, match="expected eos_token_id to be a token id"):
        resolve(m, ids, None, {"eos_token_id": [-3], "max_new_tokens": 4})


@pytest.mark.parametrize("kwargs, message", [
    ({"num_beams": 0}, "expected num_beams to be an integer of at least 1, found 0"),
    ({"num_beams": 2.5}, "expected num_beams to be an integer of at least 1, found 2.5"),
    ({"num_beams": 2, "length_penalty": "x"}, "expected length_penalty to be a number, found 'x'"),
    ({"do_sample": True, "temperature": "hot"}, "expected temperature to be a number"),
    ({"do_sample": True, "top_k": 1.5}, "expected top_k to be an integer, found 1.5"),
    ({"min_new_tokens": -1}, "expected min_new_tokens to be an integer of at least 0, found -1"),
    ({"num_beams": 2, "early_stopping": "sometimes"}, "expected .*early_stopping.*sometimes"),
    ({"do_sample": True, "min_p": 1.5}, "min_p.*1.5"),
    ({"exponential_decay_length_penalty": (2, 1.5), "eos_token_id": None},
     "expected an EOS token with exponential_decay_length_penalty"),
    ({"exponential_decay_length_penalty": 3, "eos_token_id": 2},
     "expected exponential_decay_length_penalty to be"),
    ({"do_sample": True, "typical_p": "x"}, "expected typical_p to be a number, found 'x'|"
                                            "typical_p"),
])
def test_option_values_generate_would_refuse_or_misread_are_one_line_errors(kwargs, message):
    # num_beams=0 ran as greedy decoding here, and crashed generate with a ZeroDivisionError.
    config = transformers.AutoConfig.for_model("gpt2", **CONFIGS["gpt2"], **COMMON)
    m = transformers.AutoModelForCausalLM.from_config(config)
    ids, _ = _prompt()
    with pytest.raises(GrapeError, match=message) as info:
        resolve(m, ids, None, {**kwargs, "max_new_tokens": 4})
    assert "\n" not in str(info.value)


def test_a_model_grape_cannot_graph_runs_through_generate_with_one_warning():
    import grape

    config = transformers.AutoConfig.for_model("gpt2", **CONFIGS["gpt2"], **COMMON)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids, mask = _prompt()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = grape.generate(m, ids, mask, max_new_tokens=6)
    ours = [w for w in caught if "grape.generate runs model.generate instead" in str(w.message)]
    assert len(ours) == 1 and "graphs need a CUDA device" in str(ours[0].message)
    assert torch.equal(out, m.generate(ids, attention_mask=mask, max_new_tokens=6))
    from grape.torch.api import last_stats

    assert not last_stats().graphed and "CUDA" in last_stats().reason


SEQ2SEQ_SMALL = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
                 "encoder_attention_heads": 2, "decoder_attention_heads": 2,
                 "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}
SEQ2SEQ = {
    "t5": {"d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 2, "d_kv": 16,
           "decoder_start_token_id": 0},
    # BART's default config forces EOS as the last token, and starts from the EOS token.
    "bart": dict(SEQ2SEQ_SMALL, decoder_start_token_id=2),
    "marian": dict(SEQ2SEQ_SMALL, decoder_start_token_id=0),
    "pegasus": dict(SEQ2SEQ_SMALL, decoder_start_token_id=0),
}


def _seq2seq(model_type, **extra):
    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(model_type, **SEQ2SEQ.get(model_type, {}),
                                               **extra, **COMMON)
    torch.manual_seed(0)
    return transformers.AutoModelForSeq2SeqLM.from_config(config).eval()


@pytest.fixture(scope="module", params=list(SEQ2SEQ))
def seq2seq(request):
    return _seq2seq(request.param)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_an_encoder_decoder_host_loop_makes_generates_tokens(seq2seq, strategy):
    # The encoder over the prompt, the decoder from its start token over a static cache of
    # the new tokens, cross-attention read from a cache written once: generate's tokens,
    # starting with the start token, for prompts of different lengths.
    ids, mask = _prompt()
    kwargs = dict(STRATEGIES[strategy], max_new_tokens=12)
    reference = seq2seq.generate(ids, attention_mask=mask, cache_implementation="static",
                                 **kwargs)
    out = _host(seq2seq, ids, mask, **kwargs)
    assert torch.equal(out, reference)
    assert bool((out[:, 0] == resolve(seq2seq, ids, mask, {"max_new_tokens": 1})[0].start).all())
    # And with the default cache, as grape.generate's users compare: the same tokens.
    assert torch.equal(out, seq2seq.generate(ids, attention_mask=mask, **kwargs))


def test_an_encoder_decoder_decoder_runs_again_on_another_source():
    # The second prompt's cross-attention keys are its own: transformers' is_updated flags
    # turn back with the cache's reset, and the encoder's output lands at the same address.
    m = _seq2seq("t5")
    ids, mask = _prompt()
    options, m_mask = resolve(m, ids, mask, {"max_new_tokens": 8, "num_beams": 3})
    decoder = BeamDecoder(m, ids.shape[0], ids.shape[1], options)
    first = decoder.generate_on_host(ids, m_mask)
    held = decoder.encoded.data_ptr()
    other = ids.flip(1)
    again = decoder.generate_on_host(other, None)
    assert decoder.encoded.data_ptr() == held
    assert torch.equal(again, m.generate(other, max_new_tokens=8, num_beams=3))
    assert torch.equal(decoder.generate_on_host(ids, m_mask), first)


@pytest.mark.parametrize("strategy", ["greedy", "beam 3, length penalty, early stopping"])
def test_an_encoder_decoder_returns_generates_dict(strategy):
    m = _seq2seq("bart")
    ids, mask = _prompt()
    kwargs = dict(STRATEGIES[strategy], max_new_tokens=6, return_dict_in_generate=True,
                  output_scores=True, output_logits=True)
    reference = m.generate(ids, attention_mask=mask, cache_implementation="static", **kwargs)
    out = _host(m, ids, mask, **kwargs)
    assert type(out) is type(reference)
    assert torch.equal(out.sequences, reference.sequences)
    for mine, theirs in ((out.scores, reference.scores), (out.logits, reference.logits)):
        assert len(mine) == len(theirs)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


@pytest.mark.parametrize("num_beams", [1, 3])
def test_forced_first_and_last_tokens_are_generates(num_beams):
    # ForcedBOSTokenLogitsProcessor (an encoder-decoder's first token) and
    # ForcedEOSTokenLogitsProcessor (the last token allowed), with the count on the device.
    m = _seq2seq("mbart", **SEQ2SEQ_SMALL, decoder_start_token_id=2)
    ids, mask = _prompt()
    kwargs = dict(max_new_tokens=7, num_beams=num_beams, forced_bos_token_id=42,
                  forced_eos_token_id=[43, 44], eos_token_id=None)
    out = _host(m, ids, mask, **kwargs)
    assert torch.equal(out, m.generate(ids, attention_mask=mask, **kwargs))
    assert bool((out[:, 1] == 42).all()) and set(out[:, -1].tolist()) <= {43, 44}
    # A decoder-only model: forced EOS at the last token, no forced BOS after a long prompt.
    gpt2 = _built("gpt2", CONFIGS["gpt2"])
    out = _host(gpt2, ids, mask, **kwargs)
    assert torch.equal(out, gpt2.generate(ids, attention_mask=mask, **kwargs))
    assert set(out[:, -1].tolist()) <= {43, 44} and not bool((out[:, 7] == 42).all())


PROCESSORS = {
    "repetition penalty": {"repetition_penalty": 1.3},
    "repetition penalty below 1": {"repetition_penalty": 0.7},
    "no repeated bigrams": {"no_repeat_ngram_size": 2},
    "no repeated trigrams, EOS": {"no_repeat_ngram_size": 3, "eos_token_id": EOS},
    "banned tokens": {"bad_words_ids": [[40], [41], [2]], "suppress_tokens": [42, 43]},
    "minimum length, suppressed at the first token": {
        "min_length": 12, "eos_token_id": EOS, "begin_suppress_tokens": EOS[:3]},
    "the prompt's tokens favoured": {"encoder_repetition_penalty": 1.8},
    "invalid values removed, renormalised": {"remove_invalid_values": True,
                                             "renormalize_logits": True},
    "EOS raised exponentially from the fourth token": {
        "exponential_decay_length_penalty": (3, 1.6), "eos_token_id": EOS},
    "all at once": {"repetition_penalty": 1.2, "no_repeat_ngram_size": 2,
                    "bad_words_ids": [[40]], "min_length": 9,
                    "eos_token_id": EOS, "suppress_tokens": [42], "forced_eos_token_id": 2,
                    "begin_suppress_tokens": [44]},
}


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("processors", list(PROCESSORS))
@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_generates_other_processors_make_its_tokens_and_scores(kind, processors, num_beams):
    # Real checkpoints ship these in their generation configs (Qwen2's chat models a
    # repetition penalty, Marian's a banned pad token, BART's summarisers a minimum length):
    # each was a fallback. Processed scores are held bit for bit where generate keeps them.
    m = _built("llama", CONFIGS["llama"]) if kind == "llama" else _seq2seq("t5")
    ids, mask = _prompt()
    kwargs = dict(PROCESSORS[processors], max_new_tokens=10, num_beams=num_beams,
                  return_dict_in_generate=True, output_scores=True)
    out = _held_to_generate(m, ids, mask, 10, **kwargs)
    for name, off in (("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0),
                      ("exponential_decay_length_penalty", None),
                      ("renormalize_logits", False), ("encoder_repetition_penalty", 1.0)):
        if PROCESSORS[processors].get(name, off) != off and processors != "all at once":
            if name == "renormalize_logits" and num_beams > 1:
                # A beam search processes log-probabilities, which renormalising leaves as
                # they are up to rounding: whether any bit moves in ten tokens is the CPU's
                # BLAS's affair (some did on an AMD EPYC, none on an Intel Xeon). That it is
                # taken, not dropped:
                assert resolve(m, ids, mask, dict(kwargs))[0].renormalize
                continue
            # It must have acted: without it, other scores at some token. (All at once, the
            # penalty can leave no n-gram to repeat.)
            plain = _host(m, ids, mask, **dict(kwargs, **{name: off}))
            pairs = zip(plain.scores, out.scores, strict=False)  # EOS may end one sooner
            assert not all(torch.equal(a, b) for a, b in pairs), name


def _made_freely(kind, num_beams):
    """A Llama or T5, a prompt, and its 10 tokens made with no processor: (model, ids, mask,
    the sequences, the first row's new tokens), for words that bite taken from them."""
    m = _built("llama", CONFIGS["llama"]) if kind == "llama" else _seq2seq("t5")
    ids, mask = _prompt()
    free = _host(m, ids, mask, max_new_tokens=10, num_beams=num_beams)
    return m, ids, mask, free, free[0, -10:].tolist()


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_banned_words_of_several_tokens_are_banned_after_their_prefix(kind, num_beams):
    # Words taken from what the model makes unbanned, so that they bite: a bigram and a
    # trigram of the first row's new tokens.
    m, ids, mask, free, new = _made_freely(kind, num_beams)
    words = [new[2:4], new[4:7], [299]]
    kwargs = dict(max_new_tokens=10, num_beams=num_beams, bad_words_ids=words,
                  return_dict_in_generate=True, output_scores=True)
    out = _held_to_generate(m, ids, mask, 10, **kwargs)
    assert not torch.equal(out.sequences, free)


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_sequence_bias_moves_the_scores_generate_moves(kind, num_beams):
    # Biases on what the model makes unbiased, so that they bite: its third token alone,
    # raised, its fourth after the third, lowered, and a trigram that also ends there.
    m, ids, mask, free, new = _made_freely(kind, num_beams)
    bias = [[[new[2]], 1.5], [new[2:4], -4.0], [new[1:4], 0.5], [[299], -0.25]]
    kwargs = dict(max_new_tokens=10, num_beams=num_beams, sequence_bias=bias,
                  return_dict_in_generate=True, output_scores=True)
    out = _held_to_generate(m, ids, mask, 10, **kwargs)
    assert not torch.equal(out.sequences, free)


def test_a_bad_sequence_bias_is_one_line():
    m = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    with pytest.raises(GrapeError, match="expected sequence_bias as generate takes it"):
        resolve(m, ids, mask, {"max_new_tokens": 4, "sequence_bias": [[[3], 1]]})


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("n", [1, 2, 9])
def test_n_grams_of_the_source_are_not_repeated(n, num_beams):
    # encoder_no_repeat_ngram_size (Blenderbot's configs set 3): the decoder's last n - 1
    # tokens against every window of the source. n = 1 bans every source token, so it bites;
    # 9 is longer than the source: nothing to ban.
    m = _seq2seq("t5")
    ids, mask = _prompt()
    # The start token (0), then tokens near the model's own picks: after the start, n = 2
    # bans the first of them at the first token already.
    ids[:, 0] = 0
    ids[:, 1:] = torch.arange(6)[None, :] + torch.tensor([[225], [65], [223]])
    kwargs = dict(max_new_tokens=8, num_beams=num_beams, encoder_no_repeat_ngram_size=n,
                  return_dict_in_generate=True, output_scores=True)
    out = _held_to_generate(m, ids, mask, 8, **kwargs)
    if n == 1:
        assert not torch.isin(out.sequences[:, 1:], ids).any()


def test_the_source_n_gram_option_means_nothing_to_a_decoder_only_model():
    m = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    options, _ = resolve(m, ids, mask, {"max_new_tokens": 4, "encoder_no_repeat_ngram_size": 2})
    assert options.source_ngram == 0  # generate ignores it there, with a warning


def test_sampling_takes_the_processors_before_its_warpers():
    m = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    kwargs = {"do_sample": True, "max_new_tokens": 12, "repetition_penalty": 1.5,
              "suppress_tokens": list(range(30, 200)), "top_k": 50}
    out = _host(m, ids, mask, seed=5, **kwargs)
    new = out[:, ids.shape[1]:]
    assert not bool(((new >= 30) & (new < 200)).any())
    assert torch.equal(out, _host(m, ids, mask, seed=5, **kwargs))


def test_a_model_that_reads_cache_positions_it_has_not_written_is_refused():
    # FSMT's decoder builds its causal mask over the tokens it is given, not the static
    # cache's length, so it attends over the cache's unused tail (generate with a static cache
    # does too, and parts from its own default cache); T5 masks it.
    fsmt = _seq2seq("fsmt", **SEQ2SEQ_SMALL, decoder_start_token_id=2, src_vocab_size=VOCAB,
                    tgt_vocab_size=VOCAB, langs=["en", "de"])
    ids, mask = _prompt()
    for model, refused in ((fsmt, True), (_seq2seq("t5"), False),
                           (_built("llama", CONFIGS["llama"]), False)):
        options, m_mask = resolve(model, ids, mask, {"max_new_tokens": 4, "num_beams": 1})
        decoder = TokenDecoder(model, ids.shape[0], ids.shape[1], options)
        if refused:
            with pytest.raises(NotGraphable, match="FSMTForConditionalGeneration reads cache "
                                                   "positions it has not written .the "
                                                   "prompt's logits moved by"):
                decoder.check_written_only(ids, m_mask)
        else:
            decoder.check_written_only(ids, m_mask)
        assert decoder._poison is None and decoder._audit is None  # left as it was


def _decoder_prompt(start, kind, batch=3):
    """A decoder prompt of ``kind``: "started" (the start token, then 3 tokens), "bare" (3
    tokens without it: generate puts it before them) or "padded" (bare, its first row's first
    token masked). Returns (ids, mask or None, the prepared prompt's length)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(30, VOCAB, (batch, 3), generator=g)
    if kind == "started":
        return torch.cat([torch.full((batch, 1), start), ids], dim=1), None, 4
    if kind == "bare":
        return ids, None, 4
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    return ids, mask, 4


@pytest.mark.parametrize("kind", ["started", "bare", "padded"])
@pytest.mark.parametrize("strategy", ["greedy", "beam 3, length penalty, early stopping"])
def test_a_decoder_prompt_continues_as_generate_continues_it(seq2seq, strategy, kind):
    # decoder_input_ids (a task prefix, a language code, a conversation's last turn): the
    # decoder reads them in its prompt's forward, and the sequences start with them, as
    # generate prepares them (the start token before a prompt that lacks it).
    ids, mask = _prompt()
    start = resolve(seq2seq, ids, mask, {"max_new_tokens": 1})[0].start
    decoder_ids, decoder_mask, head = _decoder_prompt(start, kind)
    kwargs = dict(STRATEGIES[strategy], max_new_tokens=8, decoder_input_ids=decoder_ids,
                  return_dict_in_generate=True, output_scores=True)
    if decoder_mask is not None:
        kwargs["decoder_attention_mask"] = decoder_mask
    out = _held_to_generate(seq2seq, ids, mask, 8, head=head, **kwargs)
    assert out.sequences.shape[1] <= head + 8
    assert bool((out.sequences[:, 0] == start).all())
    assert torch.equal(out.sequences[:, head - 3:head], decoder_ids[:, -3:])
    # And with generate's default cache: the same tokens.
    plain = seq2seq.generate(ids, attention_mask=mask, **dict(kwargs, output_scores=False))
    assert torch.equal(out.sequences, plain.sequences)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_processors_count_a_decoder_prompt_as_generate_counts_it(num_beams):
    # The minimum length counts the decoder's prompt, n-grams and the repetition penalty see
    # its tokens, and a forced first token acts only after a one-token prompt.
    m = _seq2seq("t5")
    ids, mask = _prompt()
    decoder_ids, decoder_mask, head = _decoder_prompt(0, "padded")
    kwargs = dict(PROCESSORS["all at once"], max_new_tokens=8, num_beams=num_beams,
                  decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask,
                  forced_bos_token_id=45, return_dict_in_generate=True, output_scores=True)
    out = _held_to_generate(m, ids, mask, 8, head=head, **kwargs)
    assert not bool((out.sequences[:, head] == 45).all())


@pytest.mark.parametrize(("args", "message"), [
    ({"decoder_input_ids": [[0, 5]]}, r"decoder_input_ids of shape \(3, length >= 1\)"),
    ({"decoder_input_ids": torch.zeros((2, 2), dtype=torch.long)},
     r"decoder_input_ids of shape \(3, length >= 1\), long, on cpu, found shape \(2, 2\)"),
    ({"decoder_input_ids": torch.zeros((3, 2))}, r"found shape \(3, 2\), torch.float32"),
    ({"decoder_input_ids": torch.zeros((3, 2), dtype=torch.long),
      "decoder_attention_mask": torch.ones((3, 3))},
     r"decoder_attention_mask of shape \(3, 2\) on cpu, found shape \(3, 3\)"),
    ({"decoder_attention_mask": torch.ones((3, 3))}, "decoder_attention_mask only with"),
])
def test_a_bad_decoder_prompt_is_one_line(args, message):
    import grape

    m = _seq2seq("t5")
    ids, mask = _prompt()
    with pytest.raises(GrapeError, match=message) as raised:
        grape.generate(m, ids, mask, max_new_tokens=2, **args)
    assert "\n" not in str(raised.value)


def test_a_decoder_prompt_for_a_decoder_only_model_is_one_line():
    import grape

    m = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    with pytest.raises(GrapeError, match="decoder_input_ids only for an encoder-decoder model, "
                                         "found them for GPT2LMHeadModel"):
        grape.generate(m, ids, mask, max_new_tokens=2, decoder_input_ids=ids)


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_several_sequences_per_prompt_are_a_beam_searchs_best_as_generate_returns_them(kind):
    # num_return_sequences of 4 beams: each prompt's 3 best finished beams, best first, with
    # their scores and beam indices, generate's bit for bit.
    m = _built("llama", CONFIGS["llama"]) if kind == "llama" else _seq2seq("t5")
    ids, mask = _prompt()
    kwargs = dict(max_new_tokens=10, num_beams=4, num_return_sequences=3, eos_token_id=EOS,
                  length_penalty=0.7, return_dict_in_generate=True, output_scores=True)
    out = _held_to_generate(m, ids, mask, 10, **kwargs)
    reference = m.generate(ids, attention_mask=mask, **_same_layout(m, ids, 10), **kwargs)
    assert out.sequences.shape[0] == 3 * ids.shape[0]
    assert torch.equal(out.sequences_scores, reference.sequences_scores)
    assert torch.equal(out.beam_indices, reference.beam_indices)
    assert len(set(map(tuple, out.sequences[:3].tolist()))) == 3  # three different beams
    # Without the return dict: the sequences alone.
    plain = {k: v for k, v in kwargs.items() if k not in ("return_dict_in_generate",
                                                          "output_scores")}
    assert torch.equal(_host(m, ids, mask, **plain), out.sequences)


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_several_samples_per_prompt_are_drawn_apart_and_repeat_for_a_seed(kind):
    # num_return_sequences of sampling: each prompt's rows adjacent, drawn apart; top_k=1
    # leaves one token to draw, generate's greedy tokens for every copy.
    m = _built("llama", CONFIGS["llama"]) if kind == "llama" else _seq2seq("t5")
    ids, mask = _prompt()
    kwargs = dict(max_new_tokens=10, do_sample=True, num_return_sequences=3, temperature=1.5,
                  top_k=0)
    out = _host(m, ids, mask, seed=3, **kwargs)
    assert out.shape[0] == 3 * ids.shape[0]
    assert torch.equal(out, _host(m, ids, mask, seed=3, **kwargs))
    head = ids.shape[1] if kind == "llama" else 1
    assert torch.equal(out[:, :head], (ids if kind == "llama" else out[:, :1][::3])
                       .repeat_interleave(3, dim=0))
    assert not torch.equal(out[0], out[1])  # copies of one prompt drawn apart
    one = dict(kwargs, top_k=1)
    assert torch.equal(_host(m, ids, mask, **one), m.generate(ids, attention_mask=mask, **one))


@pytest.mark.parametrize(("kwargs", "message"), [
    # (transformers' own check of the config says it first, where it makes one)
    ({"num_return_sequences": 2}, "[Gg]reedy.*num_return_sequences.* 1"),
    ({"num_return_sequences": 5, "num_beams": 4}, r"num_return_sequences.*5.*num_beams.*4"
                                                   r"|num_beams \(4\), found 5"),
    ({"num_return_sequences": 0, "do_sample": True}, "expected num_return_sequences to be an "
                                                     "integer of at least 1, found 0"),
])
def test_more_sequences_than_generate_makes_is_one_line(kwargs, message):
    m = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    with pytest.raises(GrapeError, match=message):
        resolve(m, ids, mask, dict(kwargs, max_new_tokens=4))


def _tokenizer():
    from tests.word_tokenizer import word_tokenizer

    return word_tokenizer(VOCAB)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "t5"])
@pytest.mark.parametrize("strategy", ["greedy", "sample", "beam 3"])
def test_stop_strings_end_sequences_where_generate_ends_them(kind, strategy):
    # A stop string taken from the first row's own text, spanning two of its tokens: that row
    # ends there, padded after, the others run on; generate's sequences bit for bit (sampling
    # with top_k=1, one token to draw).
    m = _built(kind, CONFIGS[kind]) if kind != "t5" else _seq2seq("t5")
    ids, mask = _prompt()
    tokenizer = _tokenizer()
    kwargs = dict(max_new_tokens=12, **({"do_sample": True, "top_k": 1} if strategy == "sample"
                                        else {"num_beams": 3} if strategy == "beam 3" else {}))
    free = _host(m, ids, mask, **kwargs)
    new = free[0, free.shape[1] - 12:].tolist()
    text = "".join(tokenizer.convert_ids_to_tokens(new[4:6]))  # (as StopStringCriteria reads)
    stop = dict(kwargs, stop_strings=[text[1:], "jjjjjjjj"], tokenizer=tokenizer)
    out = _host(m, ids, mask, **stop)
    reference = m.generate(ids, attention_mask=mask, **_same_layout(m, ids, 12), **stop)
    assert torch.equal(out, reference)
    head = free.shape[1] - 12
    assert not torch.equal(out[0, head:], free[0, head:out.shape[1]])  # the first row stopped


def test_stop_strings_without_a_tokenizer_are_refused_in_one_line():
    m = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    with pytest.raises(GrapeError, match="expected a tokenizer"):
        resolve(m, ids, mask, {"max_new_tokens": 4, "stop_strings": "ab"})
    with pytest.raises(GrapeError, match="expected stop_strings to be a non-empty string"):
        resolve(m, ids, mask, {"max_new_tokens": 4, "stop_strings": [""],
                               "tokenizer": _tokenizer()})


def test_exact_lengths_are_refused_for_an_encoder_decoder_model():
    # Exact lengths count the decoder's own cache; cross-attention reads the source's.
    from grape.torch.decoding import ExactRefused

    m = _seq2seq("t5")
    ids, mask = _prompt()
    options, _ = resolve(m, ids, mask, {"max_new_tokens": 4})
    with pytest.raises(ExactRefused, match="cross-attention reads the source's"):
        TokenDecoder(m, ids.shape[0], ids.shape[1], options, exact=True)


def test_an_encoder_decoder_with_a_start_token_grape_cannot_take_falls_back():
    m = _seq2seq("t5")
    m.generation_config.decoder_start_token_id = [0, 1]
    ids, mask = _prompt()
    with pytest.raises(NotGraphable, match="decoder starts from one token id"):
        resolve(m, ids, mask, {"max_new_tokens": 4})


def test_the_attention_mask_is_inferred_from_pad_tokens_as_generate_infers_it():
    config = transformers.AutoConfig.for_model("llama", **CONFIGS["llama"], **COMMON)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids, _ = _prompt()
    ids[0, :2] = 0  # the pad token, as a tokenizer pads on the left
    _, mask = resolve(m, ids, None, {"max_new_tokens": 4})
    assert mask is not None and mask[0, :2].tolist() == [0, 0] and bool(mask[1:].all())
    assert torch.equal(_host(m, ids, None, max_new_tokens=8),
                       m.generate(ids, max_new_tokens=8, cache_implementation="static"))


def test_the_steps_call_the_step_model_and_the_prompt_the_model(model):
    # compile=True hands the decoder a compiled forward for its steps: here a wrapper that
    # counts, standing in for it. The prompt is one call of the model itself.
    calls = []

    def step_model(**inputs):
        calls.append(inputs["input_ids"].shape[1])
        return model(**inputs)

    ids, mask = _prompt()
    options, m = resolve(model, ids, mask, {"max_new_tokens": 6})
    decoder = TokenDecoder(model, 3, ids.shape[1], options, step_model=step_model)
    out = decoder.generate_on_host(ids, m)
    assert calls == [1] * 5
    assert torch.equal(out, _host(model, ids, mask, max_new_tokens=6))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_compiled_step_prepares_its_inputs_inside_the_compiled_function(arch, caplog):
    # grape.torch.compiled_step: the input preparation (the step's mask) and the forward under
    # one torch.compile, here Dynamo alone (backend "eager"): the same tokens as the host loop
    # over the model itself, every step through the compiled function, none falling back.
    from grape.torch.compiled_step import CompiledStep

    m = _built(arch, CONFIGS[arch])
    ids, mask = _prompt()
    options, m_mask = resolve(m, ids, mask, {"max_new_tokens": 6})
    step = CompiledStep(m, backend="eager", dynamic=False)
    calls = []
    prepared = step.prepared

    def counted(*args):
        calls.append(args[0].shape)
        return prepared(*args)
    step.prepared = counted
    decoder = TokenDecoder(m, 3, ids.shape[1], options, step_model=step)
    out = decoder.generate_on_host(ids, m_mask)
    assert len(calls) == 5 and not decoder._unprepared and step._forward is None
    assert torch.equal(out, _host(m, ids, mask, max_new_tokens=6))


def test_a_preparation_that_does_not_compile_leaves_the_forward_compiled_alone(caplog):
    import logging

    from torch._dynamo.exc import Unsupported

    from grape.torch.compiled_step import CompiledStep

    m = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    options, m_mask = resolve(m, ids, mask, {"max_new_tokens": 6})
    step = CompiledStep(m, backend="eager", dynamic=False)

    def refused(*args):
        raise Unsupported("a preparation Dynamo cannot trace")
    step.prepared = refused
    decoder = TokenDecoder(m, 3, ids.shape[1], options, step_model=step)
    with caplog.at_level(logging.INFO, logger="grape"):
        out = decoder.generate_on_host(ids, m_mask)
    assert decoder._unprepared and step._forward is not None
    assert "its forward is compiled alone" in caplog.text
    assert torch.equal(out, _host(m, ids, mask, max_new_tokens=6))


TAILS = {
    "greedy": {},
    "greedy, EOS and min_new_tokens": {"eos_token_id": EOS, "min_new_tokens": 4},
    "sampling": {"do_sample": True, "top_k": 20, "top_p": 0.9, "temperature": 0.7},
    "sampling, scores kept": {"do_sample": True, "top_k": 20, "output_scores": True,
                              "return_dict_in_generate": True},
    "penalties": {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "eos_token_id": EOS},
    "beam 4, EOS": {"num_beams": 4, "eos_token_id": EOS},
    "beam 3, length penalty, early stopping": {"num_beams": 3, "length_penalty": 0.5,
                                               "early_stopping": True, "eos_token_id": EOS},
}


@pytest.mark.parametrize("case", list(TAILS))
def test_a_compiled_step_compiles_the_bookkeeping_after_its_forward(case):
    # grape.torch.compiled_step's tail: the lengths moved on, the token written, finished rows
    # (a beam search's: the beams run on, the hypotheses kept, the cache reordered) and the
    # running flag, under one torch.compile (here Dynamo alone, fullgraph) at every step; the
    # choice stays outside it, so the tokens are those of the same step without it.
    from grape.torch.compiled_step import CompiledStep

    m = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    options, m_mask = resolve(m, ids, mask, dict(TAILS[case], max_new_tokens=10))
    graphs, rounding = [], []

    def backend(gm, example_inputs):  # Dynamo's graphs, run as traced
        graphs.append([n.name for n in gm.graph.nodes if n.op == "placeholder"])
        rounding.append(torch._inductor.config.eager_numerics.division_rounding)
        return gm.forward
    step = CompiledStep(m, backend=backend, dynamic=False)
    asked, calls = [], []

    def tail(fn, divides=False):
        asked.append(fn.__name__)
        made = CompiledStep.tail(step, fn, divides)

        def counted(*args):
            calls.append(len(args))
            return made(*args)
        return counted
    step.tail = tail
    outs = []
    kind = BeamDecoder if options.strategy == "beam" else TokenDecoder
    for records_compiled in (False, True):
        decoder = kind(m, 3, ids.shape[1], options, step_model=step)
        decoder.records_compiled = records_compiled
        if options.strategy == "sample":
            decoder.set_seed(1)
        out = decoder.generate_on_host(ids, m_mask)
        outs.append(out if isinstance(out, torch.Tensor) else out.sequences)
    steps = int(decoder.count[0]) - 1  # (the prompt makes the first token)
    assert asked == ["_moved_on"] and len(calls) == steps > 0
    # one graph took the chosen token (Dynamo names placeholders after their sources), and
    # a beam search's (its length penalty divides) was compiled to divide as eager does
    tails = [i for i, g in enumerate(graphs) if any("chosen" in name for name in g)]
    assert len(tails) == 1, graphs
    assert rounding[tails[0]] == (options.strategy == "beam")
    assert decoder._compiled_moved_on is not False
    assert torch.equal(outs[1], outs[0])


@_NEEDS_CXX
@pytest.mark.parametrize("case", ["greedy, EOS and min_new_tokens", "beam 4, EOS"])
def test_inductor_compiles_the_bookkeeping_and_keeps_the_tokens(case):
    # The same tail through Inductor itself (C++ kernels here, Triton's on a GPU): its in-place
    # writes at device indices (the token's column, the hypotheses) land where eager's do.
    from grape.torch.compiled_step import CompiledStep

    m = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    options, m_mask = resolve(m, ids, mask, dict(TAILS[case], max_new_tokens=8))
    kind = BeamDecoder if options.strategy == "beam" else TokenDecoder
    step = CompiledStep(m, dynamic=False)  # Inductor, its default options
    outs = []
    for records_compiled in (False, True):  # (the same compiled forward for both)
        decoder = kind(m, 3, ids.shape[1], options, step_model=step)
        decoder.records_compiled = records_compiled
        outs.append(decoder.generate_on_host(ids, m_mask))
    assert decoder._compiled_moved_on is not False and not decoder._unprepared
    assert torch.equal(outs[1], outs[0])


def test_bookkeeping_that_does_not_compile_runs_eagerly(caplog):
    import logging

    from torch._dynamo.exc import FailOnRecompileLimitHit

    from grape.torch.compiled_step import CompiledStep

    m = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    options, m_mask = resolve(m, ids, mask, {"max_new_tokens": 6, "eos_token_id": EOS})
    step = CompiledStep(m, backend="eager", dynamic=False)

    def refused(*args):  # what a fullgraph function raises past Dynamo's recompile limit
        raise FailOnRecompileLimitHit("Hard failure due to fullgraph=True")
    step.tail = lambda fn, divides=False: refused
    decoder = TokenDecoder(m, 3, ids.shape[1], options, step_model=step)
    with caplog.at_level(logging.INFO, logger="grape"):
        out = decoder.generate_on_host(ids, m_mask)
    assert decoder._compiled_moved_on is False
    assert "the step's bookkeeping did not compile (Hard failure" in caplog.text
    assert torch.equal(out, _host(m, ids, mask, max_new_tokens=6, eos_token_id=EOS))


def test_a_beam_search_keeps_its_bookkeeping_eager_where_inductor_divides_otherwise(
        monkeypatch):
    # A torch whose Inductor cannot round float32 division as eager does: the beams' length
    # penalty could part a tie, so their bookkeeping is not compiled (a token decoder's, which
    # does not divide, still is).
    from grape.torch import compiled_step

    monkeypatch.setattr(compiled_step, "divides_as_eager", lambda: False)
    m = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    step = compiled_step.CompiledStep(m, backend="eager", dynamic=False)
    for kw, kind, compiled in (({"num_beams": 3}, BeamDecoder, False), ({}, TokenDecoder, True)):
        options, m_mask = resolve(m, ids, mask, dict(kw, max_new_tokens=4))
        decoder = kind(m, 3, ids.shape[1], options, step_model=step)
        out = decoder.generate_on_host(ids, m_mask)
        assert (decoder._compiled_moved_on is not False) == compiled
        assert torch.equal(out, _host(m, ids, mask, max_new_tokens=4, **kw))


def test_a_compiled_step_compiles_past_dynamo_s_default_recompile_limit():
    # One executable per shape: a server's ninth (batch 9 here) was past Dynamo's default
    # recompile_limit (8), and its step ran eagerly, captured uncompiled and reported
    # compiled. grape's compiled functions raise the limit while they run.
    import torch._dynamo.config

    from grape.torch.compiled_step import CompiledStep

    m = _built("gpt2", CONFIGS["gpt2"])
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    step = CompiledStep(m, backend=backend, dynamic=False)
    default = torch._dynamo.config.recompile_limit
    for batch in range(1, default + 3):
        ids, mask = _prompt(batch=batch)
        options, m_mask = resolve(m, ids, mask, {"max_new_tokens": 3})
        decoder = TokenDecoder(m, batch, ids.shape[1], options, step_model=step)
        before = len(graphs)
        decoder.generate_on_host(ids, m_mask)
        # the step (preparation and forward) and its bookkeeping, each compiled for this shape
        assert len(graphs) - before == 2, batch
        assert not decoder._unprepared and decoder._compiled_moved_on is not False
    assert torch._dynamo.config.recompile_limit == default  # raised only while they ran


def test_compile_must_be_a_boolean():
    import grape

    config = transformers.AutoConfig.for_model("gpt2", **CONFIGS["gpt2"], **COMMON)
    m = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(GrapeError, match="expected compile to be True or False, found 'yes'"):
        grape.generate(m, torch.zeros((1, 3), dtype=torch.long), max_new_tokens=2,
                       compile="yes")
    with pytest.raises(GrapeError, match="expected concurrent to be True, False or None, "
                                         "found 1"):
        grape.generate(m, torch.zeros((1, 3), dtype=torch.long), max_new_tokens=2,
                       concurrent=1)


def test_a_compiled_step_runs_as_a_chain_unless_asked_otherwise():
    from grape.torch.api import _concurrent

    assert _concurrent(None, compiled=False) and not _concurrent(None, compiled=True)
    assert _concurrent(True, compiled=True) and not _concurrent(False, compiled=False)


@pytest.mark.parametrize("model_type, sizes", [
    ("openai-gpt", {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64}),  # no cache
    ("rwkv", {"hidden_size": 64, "num_hidden_layers": 2, "attention_hidden_size": 64,
              "intermediate_size": 128, "context_length": 64}),  # a recurrent state of its own
])
def test_a_model_that_leaves_the_static_cache_unwritten_is_not_graphable(model_type, sizes):
    # Found by benchmarks/arch_sweep.py on the H200: these took the cache and ignored it, and
    # the first step failed on the cache's unset length (a traceback, not a fallback). Graphed,
    # each step would have run without the tokens before it.
    m = _built(model_type, sizes)
    ids, mask = _prompt()
    options, m_mask = resolve(m, ids, mask, {"max_new_tokens": 4})
    decoder = TokenDecoder(m, ids.shape[0], ids.shape[1], options)
    with pytest.raises(NotGraphable, match="did not write the static cache") as info:
        decoder.prefill(ids, m_mask)
    assert type(m).__name__ in str(info.value) and "\n" not in str(info.value)


def test_a_forward_that_fails_on_grape_s_inputs_is_a_reason_naming_the_model_s_line():
    from grape.torch.model_code import model_code

    model = torch.nn.Linear(2, 2)

    def forward_of_some_model():
        raise TypeError("create_mask() got an unexpected keyword argument 'block_ids'")

    with pytest.raises(NotGraphable) as info, model_code(model):
        forward_of_some_model()
    message = str(info.value)
    assert message.startswith("Linear failed on grape's static cache and fixed-shape inputs: "
                              "TypeError: create_mask() got an unexpected keyword argument")
    assert f"{__file__}:" in message and "forward_of_some_model" not in message  # the line
    assert "raise TypeError" in message and "\n" not in message
    # grape's own refusals pass through as they are
    with pytest.raises(GrapeError, match="as it was"), model_code(model):
        raise GrapeError("as it was")


def test_the_host_loop_refuses_a_forward_that_fails_on_grapes_cache_as_generate_does():
    # MiniMax and xLSTM (transformers 5.25) raise inside their forward when given a static
    # cache: grape.generate falls back naming the line, and the host loop, which stands for it
    # on any device, says the same where grape.generate first runs the model (check_written).
    m = _built("llama", CONFIGS["llama"])
    own = m.model.forward

    def forward(*args, **kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))  # (5.2x calls it cache)
        if isinstance(cache, transformers.StaticCache):
            raise ValueError("Llama uses cache of its own and is not compatible with this one")
        return own(*args, **kwargs)

    m.model.forward = forward
    ids, mask = _prompt()
    with pytest.raises(NotGraphable, match="LlamaForCausalLM failed on grape's static cache "
                                           "and fixed-shape inputs: ValueError: Llama uses "
                                           "cache of its own"):
        _host(m, ids, mask, max_new_tokens=4, check_written=True)


# Models whose cache layers keep a recurrent state (Mamba's convolution and SSM states), alone
# or beside attention: arch_sweep.py found grape refusing every one of them on the H200.
RECURRENT = {
    "mamba": {"hidden_size": 64, "num_hidden_layers": 2, "state_size": 8, "expand": 2},
    "zaya": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "head_dim": 16},
}


@pytest.fixture(scope="module", params=list(RECURRENT))
def recurrent(request):
    return _built(request.param, RECURRENT[request.param])


@pytest.mark.parametrize("strategy", ["greedy", "beam 4, EOS"])
def test_models_with_recurrent_state_make_generates_tokens(recurrent, strategy):
    ids, mask = _prompt(length=9)
    kwargs = dict(STRATEGIES[strategy], max_new_tokens=8)
    reference = recurrent.generate(ids, attention_mask=mask, cache_implementation="static",
                                   **kwargs)
    assert torch.equal(_host(recurrent, ids, mask, **kwargs), reference)


def test_exact_lengths_lay_out_hybrid_layers_by_tokens_and_refuse_states_alone(recurrent):
    # (Recurrent layers beside attention layers of their own: tests/test_torch_exact.py.)
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    from grape.torch.decoding import ExactRefused
    from grape.torch.exact import TokenMajorLayer

    # the layers as made: the states are fixed already
    cache = static_cache(recurrent, 32, torch.zeros(1, dtype=torch.long))
    assert any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)
    if type(recurrent).__name__.startswith("Mamba"):  # no attention at all
        with pytest.raises(ExactRefused, match="holds it \\(its layers: LinearAttentionLayer\\)"):
            static_cache(recurrent, 32, torch.zeros(1, dtype=torch.long), TokenMajorLayer)
    else:  # Zaya: attention keys beside a recurrent state in one layer, laid out by tokens
        from grape.torch.exact import TokenMajorHybridLayer

        exact = static_cache(recurrent, 32, torch.zeros(1, dtype=torch.long), TokenMajorLayer)
        assert any(isinstance(layer, TokenMajorHybridLayer) for layer in exact.layers)


def test_a_cache_layer_of_a_kind_grape_does_not_know_is_refused_by_name(monkeypatch):
    from transformers.cache_utils import StaticLayer

    class IndexedLayer(StaticLayer):  # a static layer with state of its own (an indexer's)
        pass

    config = transformers.AutoConfig.for_model("llama", **CONFIGS["llama"], **COMMON)
    m = transformers.AutoModelForCausalLM.from_config(config)
    made = transformers.StaticCache

    def indexed(**kwargs):
        cache = made(**kwargs)
        cache.layers[1] = IndexedLayer(max_cache_len=kwargs["max_cache_len"])
        return cache

    monkeypatch.setattr("grape.torch.decoding.StaticCache", indexed)
    with pytest.raises(NotGraphable, match="cache layer 1 is a IndexedLayer, a kind of cache "
                                           "layer grape does not hold in a graph"):
        static_cache(m, 16, torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize("num_beams", [1, 3])
def test_dynamic_sparse_attentions_indexer_keys_are_held_and_follow_beams(num_beams):
    # DeepSeek-V3.2's and GLM-MoE-DSA's layers keep an indexer's keys beside the cache, at a
    # length counted on the device: grape writes them as the model does and reorders them by
    # beam. Four keys per query of up to 17: which keys the indexer picks decides the tokens.
    if "glm_moe_dsa" not in transformers.CONFIG_MAPPING:
        pytest.skip("this transformers has no dynamic sparse attention model")
    from grape.torch.static_layers import CountedIndexedLayer

    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(
        "glm_moe_dsa", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, head_dim=8, index_topk=4, index_head_dim=16,
        index_n_heads=2, **COMMON)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert all(type(layer) is CountedIndexedLayer
               for layer in static_cache(m, 17, torch.zeros(1, dtype=torch.long)).layers)
    ids, mask = _prompt()
    _held_to_generate(m, ids, mask, 10, max_new_tokens=10, num_beams=num_beams,
                      return_dict_in_generate=True, output_scores=True)


def test_a_layer_type_the_static_cache_has_no_layer_for_is_not_graphable(monkeypatch):
    # transformers' static cache looks each of the config's layer types up and raises a bare
    # KeyError for one it has no static layer for (DeepSeek-V4's compressed attention).
    config = transformers.AutoConfig.for_model("llama", **CONFIGS["llama"], **COMMON)
    m = transformers.AutoModelForCausalLM.from_config(config)

    def unknown(**kwargs):
        raise KeyError("heavily_compressed_attention")

    monkeypatch.setattr("grape.torch.decoding.StaticCache", unknown)
    with pytest.raises(NotGraphable, match="LlamaForCausalLM's config lists "
                                           "'heavily_compressed_attention' layers, which "
                                           "transformers' static cache has no layer for"):
        static_cache(m, 16, torch.zeros(1, dtype=torch.long))

    def broken(**kwargs):  # a KeyError over a type it does have is not grape's to explain
        raise KeyError("full_attention")

    monkeypatch.setattr("grape.torch.decoding.StaticCache", broken)
    with pytest.raises(KeyError):
        static_cache(m, 16, torch.zeros(1, dtype=torch.long))


def test_a_draw_is_the_inverse_transform_of_the_normalised_distribution():
    # sample() cumulates unnormalised weights and scales its target by their total: the token
    # is the one a normalised cumulative distribution gives, away from its float64 rounding.
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(6, 5000, generator=g) * 4
    scores[:, ::7] = -float("inf")
    uniform = torch.rand((6, 1), generator=g)
    cdf = torch.softmax(scores, dim=-1, dtype=torch.float64).cumsum(dim=-1)
    expected = torch.searchsorted(cdf, uniform.double() * cdf[:, -1:], right=True).squeeze(1)
    assert torch.equal(sample(scores, uniform), expected)


def _held_to_generate(model, ids, mask, new, head=1, **kwargs):
    """grape's host loop, its return dict's sequences and every step's processed scores held
    bit for bit to generate's with the same static cache layout (``_same_layout``; ``head``:
    an encoder-decoder's decoder prompt's length)."""
    reference = model.generate(ids, attention_mask=mask, **_same_layout(model, ids, new, head),
                               **kwargs)
    out = _host(model, ids, mask, **kwargs)
    assert torch.equal(out.sequences, reference.sequences)
    assert len(out.scores) == len(reference.scores)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, reference.scores, strict=True))
    return out


def _same_layout(model, ids, new, head=1):
    """generate's keyword for a static cache as grape's decoders make it, prompt plus new
    tokens long (generate's own holds one token fewer: attention then sums over other
    lengths, to other last bits). transformers 5.2x names it ``cache``."""
    import inspect

    prepare = inspect.signature(model.prepare_inputs_for_generation).parameters
    name = "cache" if "cache" in prepare else "past_key_values"
    if model.config.is_encoder_decoder:  # the decoder's prompt and new tokens; the source
        return {name: transformers.EncoderDecoderCache(
            transformers.StaticCache(config=model.config, max_cache_len=head + new),
            transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1]))}
    return {name: transformers.StaticCache(config=model.config,
                                           max_cache_len=ids.shape[1] + new)}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_return_dict_is_generates_bit_for_bit(model, strategy):
    # Given the same cache layout: every step's scores (processed logits; log-probabilities
    # for beams) and raw logits, and for beams the best beam's score and beam indices. The
    # output layer runs on the last position alone on both sides (logits_to_keep=1).
    ids, mask = _prompt()
    kwargs = dict(STRATEGIES[strategy], max_new_tokens=12, return_dict_in_generate=True,
                  output_scores=True, output_logits=True)
    reference = model.generate(ids, attention_mask=mask,
                               **_same_layout(model, ids, 12), **kwargs)
    got = _host(model, ids, mask, **kwargs)
    assert type(got) is type(reference)
    beams = strategy.startswith("beam")
    for name in ["sequences"] + (["sequences_scores", "beam_indices"] if beams else []):
        assert torch.equal(getattr(got, name), getattr(reference, name)), name
    made = got.sequences.shape[1] - ids.shape[1]  # beams: the best beam's, maybe fewer steps
    for name in ("scores", "logits"):
        ours, theirs = getattr(got, name), getattr(reference, name)
        assert len(ours) == len(theirs) and (len(ours) >= made if beams else len(ours) == made)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), name
    assert got.past_key_values is None  # grape's cache is the next call's


@pytest.mark.parametrize("strategy", ["greedy", "beam 5"])
def test_a_return_dict_without_scores_holds_no_scores(model, strategy):
    ids, mask = _prompt()
    kwargs = dict(STRATEGIES[strategy], max_new_tokens=5)
    got = _host(model, ids, mask, return_dict_in_generate=True, **kwargs)
    assert torch.equal(got.sequences, _host(model, ids, mask, **kwargs))
    assert got.scores is None and got.logits is None
    if strategy.startswith("beam"):
        assert got.sequences_scores is None and got.beam_indices is not None
    # and scores asked for without a return dict are dropped, as generate drops them
    plain = _host(model, ids, mask, output_scores=True, **kwargs)
    assert torch.equal(plain, got.sequences)


CUTOFFS = {
    "top-k, top-p": {"top_k": 20, "top_p": 0.9},
    # (random weights spread the first token's probability thin: cutoffs that bite there)
    "min_p": {"top_k": 0, "min_p": 0.8},
    "typical_p": {"top_k": 0, "typical_p": 0.3},
    "epsilon_cutoff": {"top_k": 0, "epsilon_cutoff": 3.4e-3},
    "eta_cutoff, top-p": {"top_k": 0, "eta_cutoff": 0.5, "top_p": 0.95},
}


@pytest.mark.parametrize("cutoffs", list(CUTOFFS))
def test_sampled_scores_are_the_processed_distribution_the_token_was_drawn_from(model,
                                                                                cutoffs):
    ids, mask = _prompt()
    kwargs = dict(do_sample=True, temperature=0.7, max_new_tokens=8, **CUTOFFS[cutoffs],
                  return_dict_in_generate=True, output_scores=True)
    got = _host(model, ids, mask, seed=5, **kwargs)
    torch.manual_seed(0)
    reference = model.generate(ids, attention_mask=mask,
                               **_same_layout(model, ids, 8), **kwargs)
    # The first token's distribution depends on the prompt alone: generate's, bit for bit.
    assert torch.equal(got.scores[0], reference.scores[0])
    # and the cutoff removed tokens (the top-k and top-p row aside, where top-k does)
    plain = _host(model, ids, mask, seed=5, **dict(kwargs, **{
        k: (0 if k == "top_k" else None) for k in CUTOFFS[cutoffs]}))
    assert torch.isinf(got.scores[0]).sum() > torch.isinf(plain.scores[0]).sum()
    made = got.sequences[:, ids.shape[1]:]
    for step, scores in enumerate(got.scores):
        drawn = scores.gather(1, made[:, step:step + 1])
        assert torch.isfinite(drawn).all(), step  # never a token the warpers removed
    # the buffers are the next call's: what was returned stays as it was
    first = [s.clone() for s in got.scores]
    _host(model, ids, mask, seed=6, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(first, got.scores, strict=True))


@pytest.mark.parametrize("new", [1, 2])
@pytest.mark.parametrize("strategy", ["greedy", "beam 4, EOS"])
def test_one_or_two_new_tokens_leave_room_for_the_steps_before_the_capture(new, strategy):
    # grape.torch.api._build steps twice after the prompt before it captures the loop; the
    # per-token state used to be max_new_tokens long, so a one- or two-token generation
    # indexed past it there (an IndexError here, a device-side assert on a GPU).
    from grape.torch.options import STEPS_BEFORE_CAPTURE

    m = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    kwargs = dict(STRATEGIES[strategy], max_new_tokens=new)
    options, m_mask = resolve(m, ids, mask, kwargs)
    cls = BeamDecoder if options.strategy == "beam" else TokenDecoder
    decoder = cls(m, ids.shape[0], ids.shape[1], options)
    decoder.prefill(ids, m_mask)
    for _ in range(STEPS_BEFORE_CAPTURE):
        decoder.step()
    reference = m.generate(ids, attention_mask=mask, cache_implementation="static", **kwargs)
    assert torch.equal(decoder.generate_on_host(ids, m_mask), reference)


def test_a_prompt_is_left_padded_to_its_bucket_and_copied_only_then():
    from grape.torch.api import bucketed

    ids, mask = _prompt(length=7)
    same = bucketed(ids, mask, 7, pad=0)
    assert same[0] is ids and same[1] is mask and same[2] == 0
    padded_ids, padded_mask, copied = bucketed(ids, mask, 4, pad=9)
    assert padded_ids.shape == padded_mask.shape == (3, 8)
    assert padded_ids[:, 0].tolist() == [9, 9, 9] and padded_mask[:, 0].tolist() == [0, 0, 0]
    assert torch.equal(padded_ids[:, 1:], ids) and torch.equal(padded_mask[:, 1:], mask)
    assert copied == ids.numel() * 8 + mask.numel() * 8
    _, no_mask, copied = bucketed(ids, None, 4, pad=9)
    assert no_mask[:, 1:].all() and copied == ids.numel() * 8  # no caller's mask to copy


@pytest.mark.parametrize("strategy", ["greedy", "beam 4, EOS"])
def test_a_bucketed_prompt_makes_generates_tokens_for_the_padded_prompt(model, strategy):
    from grape.torch.api import bucketed

    ids, mask = _prompt(length=7)
    padded_ids, padded_mask, _ = bucketed(ids, mask, 8, pad=0)
    kwargs = dict(STRATEGIES[strategy], max_new_tokens=8)
    reference = model.generate(padded_ids, attention_mask=padded_mask,
                               cache_implementation="static", **kwargs)
    assert torch.equal(_host(model, padded_ids, padded_mask, **kwargs), reference)


@pytest.mark.parametrize("bucket", [0, -3, 2.5, True])
def test_a_bad_prompt_bucket_is_one_line(bucket):
    import grape

    m = _built("gpt2", CONFIGS["gpt2"])
    with pytest.raises(GrapeError, match="expected prompt_bucket to be a positive integer"):
        grape.generate(m, torch.zeros((1, 3), dtype=torch.long), max_new_tokens=2,
                       prompt_bucket=bucket)


# Speech models whose generate is GenerationMixin's: the source is their features (Speech2Text)
# or samples (SpeechT5), and the encoder's output, shorter than its input, sizes the
# cross-attention cache.
SPEECH = {
    "speech_to_text": dict(d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=2,
                           encoder_ffn_dim=64, decoder_ffn_dim=64, input_feat_per_channel=16,
                           max_source_positions=200, max_target_positions=64, conv_channels=32,
                           decoder_start_token_id=1),
    "speecht5": dict(hidden_size=32, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                     decoder_ffn_dim=64, decoder_start_token_id=1, conv_dim=(16, 16),
                     conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2),
}


def _speech(model_type):
    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(model_type, **SPEECH[model_type], **COMMON)
    torch.manual_seed(0)
    cls = (transformers.SpeechT5ForSpeechToText if model_type == "speecht5"
           else transformers.AutoModelForSpeechSeq2Seq)
    model = (cls(config) if model_type == "speecht5" else cls.from_config(config)).eval()
    g = torch.Generator().manual_seed(0)
    source = (torch.randn(3, 800, generator=g) if model_type == "speecht5"
              else torch.randn(3, 40, 16, generator=g))
    mask = torch.ones(source.shape[:2], dtype=torch.long)
    mask[1, source.shape[1] * 3 // 4:] = 0  # a shorter clip, padded at its end
    return model, source, mask


@pytest.mark.parametrize("strategy", ["greedy", "beam 4, EOS"])
@pytest.mark.parametrize("model_type", list(SPEECH))
def test_a_speech_model_generates_from_its_features_as_generate_does(model_type, strategy):
    model, source, mask = _speech(model_type)
    kwargs = dict(STRATEGIES[strategy], max_new_tokens=10)
    options, _ = resolve(model, source, mask, dict(kwargs))
    assert options.source == model.main_input_name != "input_ids"
    reference = model.generate(source, attention_mask=mask, cache_implementation="static",
                               **kwargs)
    assert torch.equal(_host(model, source, mask, **kwargs), reference)


def test_a_speech_source_that_is_not_what_the_model_takes_is_refused_in_one_line():
    from grape.errors import GrapeError

    model, source, mask = _speech("speech_to_text")
    with pytest.raises(GrapeError, match=r"expected input_features of shape \(batch, length >= "
                                         r"1, \.\.\.\) and a floating dtype, found shape "
                                         r"\(3, 40\) and torch.int64"):
        resolve(model, mask, None, {"max_new_tokens": 4})
    with pytest.raises(GrapeError, match=r"expected an attention_mask of shape \(3, 40\)"):
        resolve(model, source, mask[:, :20], {"max_new_tokens": 4})


def _embedded(model, ids):
    """The prompt's embeddings, moved off the token table's (so that a decoder reading the
    token ids instead would make other tokens)."""
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        return embeds + 0.5 * torch.randn(embeds.shape, generator=torch.Generator()
                                          .manual_seed(9)).to(embeds.dtype)


@pytest.mark.parametrize("with_ids", [False, True])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_prompt_given_as_embeddings_makes_generates_tokens(model, strategy, with_ids):
    # generate's sequences hold the new tokens alone, or the token ids given beside the
    # embeddings first; the cache's prompt is the embeddings either way.
    ids, mask = _prompt()
    embeds = _embedded(model, ids)
    kwargs = dict(STRATEGIES[strategy], max_new_tokens=6, inputs_embeds=embeds)
    given = ids if with_ids else None
    reference = model.generate(given, attention_mask=mask, cache_implementation="static",
                               **kwargs)
    ours = _host(model, given, mask, **kwargs)
    assert torch.equal(ours, reference)
    assert ours.shape[1] == (ids.shape[1] if with_ids else 0) + 6 or "EOS" in strategy
    # The token ids alone make other tokens: the embeddings were read.
    from_ids = _host(model, ids, mask, **dict(kwargs, inputs_embeds=None))
    assert not torch.equal(from_ids[:, ids.shape[1]:], ours[:, ours.shape[1] - 6:]) \
        or "EOS" in strategy


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((None,), {"inputs_embeds": torch.zeros(3, 7)}, GrapeError,
     r"expected inputs_embeds of shape \(batch, length >= 1, hidden\), floating, on cpu, "
     r"found shape \(3, 7\)"),
    ((torch.ones(2, 7, dtype=torch.long),), {"inputs_embeds": torch.zeros(3, 7, 64)},
     GrapeError, r"expected input_ids beside inputs_embeds of shape \(3, length\)"),
    ((torch.ones(3, 5, dtype=torch.long),), {"inputs_embeds": torch.zeros(3, 7, 64)},
     NotGraphable, r"input_ids of another length \(5\) than the inputs_embeds beside them "
                   r"\(7\)"),
    ((None, torch.ones(3, 5, dtype=torch.long)), {"inputs_embeds": torch.zeros(3, 7, 64)},
     GrapeError, r"expected an attention_mask of shape \(3, 7\)"),
    ((None,), {"inputs_embeds": torch.zeros(3, 7, 64), "encoder_repetition_penalty": 1.2},
     NotGraphable, "encoder_repetition_penalty over a prompt given as inputs_embeds"),
])
def test_a_bad_prompt_of_embeddings_is_one_line(args, kwargs, error, message):
    model = _built("llama", CONFIGS["llama"])
    mask = args[1] if len(args) > 1 else None
    with pytest.raises(error, match=message):
        resolve(model, args[0], mask, dict(kwargs, max_new_tokens=3))


def test_embeddings_for_an_encoder_decoder_model_are_not_taken():
    model = _seq2seq("t5")
    ids, _ = _prompt()
    with pytest.raises(NotGraphable, match="inputs_embeds for an encoder-decoder model"):
        resolve(model, ids, None, {"max_new_tokens": 3,
                                   "inputs_embeds": torch.zeros(3, 7, 64)})


def test_grape_generate_takes_embeddings_where_generate_takes_them():
    import grape
    from grape.torch.api import last_stats

    model = _built("llama", CONFIGS["llama"])
    ids, mask = _prompt()
    embeds = _embedded(model, ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = grape.generate(model, attention_mask=mask, inputs_embeds=embeds,
                             max_new_tokens=4)
    assert [str(w.message) for w in caught] == [
        "grape.generate runs model.generate instead: the model is on cpu, and graphs need a "
        "CUDA device"]  # resolved and checked first: only the device is missing
    assert torch.equal(out, model.generate(attention_mask=mask, inputs_embeds=embeds,
                                           max_new_tokens=4))
    assert out.shape == (3, 4) and not last_stats().graphed
    with pytest.raises(GrapeError, match="expected prompt_bucket only with token prompts"):
        grape.generate(model, attention_mask=mask, inputs_embeds=embeds, max_new_tokens=4,
                       prompt_bucket=8)


def test_each_thread_reads_the_stats_of_its_own_last_call():
    # Threads that generate side by side (a server's) each get their own last_stats(): here
    # one thread's call falls back (a CPU model), and another thread has made none.
    import threading

    import grape
    from grape.torch.api import last_stats

    model = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    seen = {}

    def call():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grape.generate(model, ids, mask, max_new_tokens=3)
        seen["caller"] = last_stats()

    def idle():
        seen["idle"] = last_stats()
    for target in (call, idle):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    assert seen["caller"].reason == "the model is on cpu, and graphs need a CUDA device"
    assert seen["idle"].reason == "no call yet"


def _llava():
    """A small LLaVA: a CLIP vision tower of 4x4 patches over 32-pixel images, a Llama."""
    transformers.logging.set_verbosity_error()
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=2,
                                           image_size=32, patch_size=8)
    config = transformers.LlavaConfig(vision_config=vision, text_config=transformers.LlamaConfig(
        **CONFIGS["llama"], **COMMON), image_token_index=VOCAB - 1, vision_feature_layer=-1)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(0)
    image = torch.full((2, 16), VOCAB - 1)  # each image's 16 patch features take 16 places
    ids = torch.cat([torch.ones(2, 1, dtype=torch.long), image,
                     torch.randint(30, VOCAB - 1, (2, 5), generator=g)], dim=1)
    mask = torch.ones_like(ids)
    mask[1, :1] = 0
    return model, ids, mask, torch.randn(2, 3, 32, 32, generator=g)


@pytest.mark.parametrize("strategy", ["greedy", "beam 4, EOS"])
def test_a_vision_language_model_reads_its_images_in_the_prompt_alone(strategy):
    # generate passes pixel_values to every forward's input preparation; LLaVA's takes them
    # for the prompt alone, so grape gives them to the prompt and checks that the steps would
    # take nothing from them.
    model, ids, mask, pixels = _llava()
    kwargs = dict(STRATEGIES[strategy], max_new_tokens=6, pixel_values=pixels)
    reference = model.generate(ids, attention_mask=mask, cache_implementation="static",
                               **kwargs)
    options, _ = resolve(model, ids, mask, dict(kwargs))
    assert options.model_inputs == ("pixel_values",)
    calls = []
    ours = generate_on_host(model, ids, mask, check_written=True, calls=calls, **kwargs)
    assert torch.equal(ours, reference)
    other = generate_on_host(model, ids, mask, **dict(kwargs, pixel_values=pixels.flip(0)))
    assert not torch.equal(other, ours)  # the images were read
    assert calls[0].decoder._prompt_only is None  # checked by the first step


class _StepsReadTheirArgument(transformers.GPT2LMHeadModel):
    def prepare_inputs_for_generation(self, input_ids, extra_bias=None, **kwargs):
        inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
        inputs["extra_bias"] = extra_bias  # every step's forward takes it
        return inputs

    def forward(self, *args, extra_bias=None, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits + extra_bias
        return out


def test_a_model_argument_the_steps_read_is_refused_before_any_capture():
    torch.manual_seed(0)
    model = _StepsReadTheirArgument(transformers.GPT2Config(**CONFIGS["gpt2"], **COMMON)).eval()
    ids, mask = _prompt()
    bias = torch.zeros(VOCAB)
    with pytest.raises(NotGraphable, match="_StepsReadTheirArgument's steps take extra_bias "
                                           "from the arguments extra_bias, which grape gives "
                                           "the prompt alone"):
        generate_on_host(model, ids, mask, max_new_tokens=3, extra_bias=bias)
    with pytest.raises(NotGraphable, match=r"arguments grape does not pass on: \['scale'\]"):
        resolve(model, ids, mask, {"max_new_tokens": 3, "scale": 2.0})
    with pytest.raises(GrapeError, match="expected the model's arguments on its device "
                                         r"\(cpu\), found extra_bias on meta"):
        resolve(model, ids, mask, {"max_new_tokens": 3,
                                   "extra_bias": torch.zeros(VOCAB, device="meta")})


def test_qwen2_vls_steps_take_its_image_grid_and_it_falls_back_before_capture_text_runs():
    # Its steps' positions come from the image grid (multimodal rotary positions), which a
    # step reads again: grape does not give a step the caller's tensors, so it refuses.
    transformers.logging.set_verbosity_error()
    config = transformers.Qwen2VLConfig(
        text_config=dict(CONFIGS["llama"], vocab_size=VOCAB, max_position_embeddings=512,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, mlp_ratio=2),
        image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3,
        vision_end_token_id=VOCAB - 4, **COMMON)
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    grid = torch.tensor([[1, 4, 4]])  # 16 patches, merged 2x2 into 4 image tokens
    ids = torch.tensor([[1, VOCAB - 3] + [VOCAB - 1] * 4 + [VOCAB - 4, 40, 41, 42]])
    pixels = torch.randn(16, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(NotGraphable, match="steps take image_grid_thw from the arguments "
                                           "image_grid_thw, pixel_values"):
        generate_on_host(model, ids, None, max_new_tokens=3, pixel_values=pixels,
                         image_grid_thw=grid)
    # Text alone: its multimodal rotary positions from grape's 2-D ones, generate's tokens.
    ids, mask = _prompt()
    for num_beams in (1, 3):
        reference = model.generate(ids, attention_mask=mask, max_new_tokens=8,
                                   num_beams=num_beams, cache_implementation="static")
        assert torch.equal(generate_on_host(model, ids, mask, max_new_tokens=8,
                                            num_beams=num_beams), reference)


@pytest.mark.parametrize("model_type, sizes, table", [
    ("gpt2", dict(CONFIGS["gpt2"], n_positions=32), "transformer.wpe"),
    ("opt", dict(CONFIGS["opt"], max_position_embeddings=32), "model.decoder.embed_positions"),
    # (a table with a padding index: generate's positions still count from 0)
    ("roberta", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=32, is_decoder=True),
     "roberta.embeddings.position_embeddings"),
])
def test_a_generation_past_a_learned_position_table_is_one_line(model_type, sizes, table):
    # generate itself would index past the table: an IndexError here, a device-side assert
    # that ends the CUDA context on a GPU.
    import grape

    model = _built(model_type, sizes)
    ids, mask = _prompt(length=20)
    with pytest.raises((IndexError, RuntimeError)):
        model.generate(ids, attention_mask=mask, max_new_tokens=14)
    expected = (rf"expected the prompt \(20 tokens\) and the new tokens but the last \(13\) "
                rf"to fit the model's 32 positions \(its table {table}\), found 33")
    with pytest.raises(GrapeError, match=expected):
        grape.generate(model, ids, mask, max_new_tokens=14)
    with pytest.raises(GrapeError, match=expected):
        _host(model, ids, mask, max_new_tokens=14)
    # the last that fits, as generate makes it
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=13,
                               cache_implementation="static")
    assert torch.equal(_host(model, ids, mask, max_new_tokens=13), reference)


def test_computed_positions_are_not_limited_by_the_configs_length():
    # Llama's rotary positions have no table: past max_position_embeddings is generate's
    # business, and grape's tokens are still its.
    model = _built("llama", dict(CONFIGS["llama"], max_position_embeddings=16))
    ids, mask = _prompt(length=12)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=8,
                               cache_implementation="static")
    assert torch.equal(_host(model, ids, mask, max_new_tokens=8), reference)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_token_type_ids_are_extended_as_generate_extends_them(num_beams):
    # generate gives each new token the prompt's last token type (GPT-2 embeds the types with
    # its token table): grape keeps that column on the device for the steps.
    model = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    types = torch.zeros_like(ids)
    types[0, -3:] = 5
    types[2, -1] = 9
    kwargs = dict(max_new_tokens=6, num_beams=num_beams, token_type_ids=types)
    reference = model.generate(ids, attention_mask=mask, cache_implementation="static",
                               **kwargs)
    assert torch.equal(_host(model, ids, mask, **kwargs), reference)
    without = model.generate(ids, attention_mask=mask, cache_implementation="static",
                             max_new_tokens=6, num_beams=num_beams)
    assert not torch.equal(without, reference)  # the types were read


@pytest.mark.parametrize("num_beams", [1, 3])
def test_paligemmas_images_and_token_types_make_its_tokens(num_beams):
    transformers.logging.set_verbosity_error()
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=32, patch_size=8)
    text = transformers.GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    vocab_size=VOCAB, bos_token_id=2, eos_token_id=1,
                                    pad_token_id=0)
    config = transformers.PaliGemmaConfig(vision_config=vision, text_config=text,
                                          image_token_index=VOCAB - 1, projection_dim=64)
    torch.manual_seed(0)
    model = transformers.PaliGemmaForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.full((2, 16), VOCAB - 1), torch.full((2, 1), 2),
                     torch.randint(5, VOCAB - 2, (2, 5), generator=g)], dim=1)
    kwargs = dict(max_new_tokens=6, num_beams=num_beams, token_type_ids=torch.zeros_like(ids),
                  pixel_values=torch.randn(2, 3, 32, 32, generator=g))
    reference = model.generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(generate_on_host(model, ids, check_written=True, **kwargs), reference)


def _compiled_decoder(model, **switches):
    """A one-row prompt of the test prompts, and a decoder for it whose step is a
    ``CompiledStep`` of ``model`` made with the class's switches (``thin_matmuls``,
    ``grouped_queries``, ``row_kernels``) set as given, each restored after: (decoder, ids,
    mask) to pass to ``generate_on_host``, its scores kept."""
    from grape.torch.compiled_step import CompiledStep

    ids, mask = (x[:1] for x in _prompt())  # (one row: thin_matmuls.ROWS)
    options, m_mask = resolve(model, ids, mask, {"max_new_tokens": 4, "output_scores": True,
                                                 "return_dict_in_generate": True})
    saved = {name: getattr(CompiledStep, name) for name in switches}
    for name, on in switches.items():
        setattr(CompiledStep, name, on)
    try:
        step = CompiledStep(model, dynamic=False)
    finally:
        for name, on in saved.items():
            setattr(CompiledStep, name, on)
    return TokenDecoder(model, 1, ids.shape[1], options, step_model=step), ids, m_mask


def _off_and_on(model, switch, counter):
    """({False: scores, True: scores}, {False: count, True: count}): the decode steps' scores
    (not the prefill's) and Dynamo's ``counters["inductor"][counter]`` of ``model``'s step
    compiled with ``CompiledStep``'s ``switch`` off, then on. Inductor's caches are off, so
    that each lowers here; Dynamo's are not, so that a step serving the other's compilation
    (the step guards on its switches) would show as a count of 0."""
    from torch._dynamo.utils import counters

    scores, counted = {}, {}
    for on in (False, True):
        decoder, ids, m_mask = _compiled_decoder(model, **{switch: on})
        counters["inductor"][counter] = 0
        with torch._inductor.config.patch(force_disable_caches=True):
            out = decoder.generate_on_host(ids, m_mask)
        counted[on] = counters["inductor"][counter]
        scores[on] = torch.stack(out.scores[1:])  # (the first: the prefill's)
        assert not decoder._unprepared
    return scores, counted


@_NEEDS_CXX
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_compiled_step_makes_its_one_row_products_reductions(arch):
    # grape.torch.thin_matmuls in a compiled step (Inductor, C++ kernels here): the decode
    # step's every product rewritten (Llama's Linears; GPT-2's head and its Conv1D products,
    # whose weights lie (in, out) and are read from copies laid (out, in):
    # grape.torch.weight_rows), the prefill's many-row ones not, and the logits those of the
    # same step compiled with Inductor's GEMMs, to float32's rounding. Two steps of one model,
    # with and without it, compile apart (Dynamo caches per function; the step guards on
    # which it is).
    from transformers.pytorch_utils import Conv1D

    m = _built(arch, CONFIGS[arch])
    scores, rewritten = _off_and_on(m, "thin_matmuls", "grape_thin_matmuls")
    linears = sum(isinstance(x, torch.nn.Linear) for x in m.modules())
    conv1ds = sum(isinstance(x, Conv1D) for x in m.modules())
    layers = m.config.num_hidden_layers
    assert linears == (1 if arch == "gpt2" else 7 * layers + 1)
    assert conv1ds == (4 * layers if arch == "gpt2" else 0)
    # (a Llama layer's query, key and value, of two sizes, are one stacked product:
    # grape.torch.sibling_products)
    stacked = 2 * layers if arch == "llama" else 0
    assert rewritten == {False: 0, True: linears + conv1ds - stacked}
    torch.testing.assert_close(scores[True], scores[False], rtol=1e-5, atol=1e-5)


@_NEEDS_CXX
@pytest.mark.parametrize("switch", ["row_statistics", "factored_statistics"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "opt"])
def test_a_compiled_step_can_reduce_its_rows_statistics_in_each_product(arch, switch):
    # grape.torch.row_statistics in a compiled step: every one-row product whose row a norm
    # made (Llama's RMSNorm before q, k and v, stacked as one product by
    # grape.torch.sibling_products, and before gate and up; LayerNorm before GPT-2's c_attn and
    # c_fc and OPT's q, k, v and fc1; the final norm before the head) reduces the norm's
    # statistics again per output, and no other product does: with the row remade per output
    # (CompiledStep.row_statistics), or as a sum of scaled dot products, RMSNorm's one,
    # LayerNorm's three (CompiledStep.factored_statistics). The scores are those of the step
    # that reads the normalised row, to float32's rounding.
    m = _built(arch, CONFIGS[arch])
    counter = {"row_statistics": "grape_row_statistics",
               "factored_statistics": "grape_factored_statistics"}[switch]
    scores, rewritten = _off_and_on(m, switch, counter)
    layers = m.config.num_hidden_layers
    normalised = {"gpt2": 2, "llama": 3, "opt": 4}[arch] * layers + 1
    assert rewritten == {False: 0, True: normalised}
    torch.testing.assert_close(scores[True], scores[False], rtol=1e-5, atol=1e-5)


@_NEEDS_CXX
@pytest.mark.parametrize("switch", ["row_statistics", "factored_statistics"])
def test_a_compiled_step_reduces_its_rows_statistics_where_inductor_decomposed_its_products(
        switch):
    # On a GPU, Inductor decomposes a one-row mm into a multiply and a sum while it traces
    # the step, before grape's post-grad pass: a Llama's bias-free products reach the pass in
    # that form, not as mm. Their normalised rows are rewritten there all the same (3 a layer:
    # q, k and v stacked as one, gate, up; and the head), with the scores of the step
    # without, to float32's rounding. (Before this, an H100's Llama step compiled to the same
    # 255 kernels with either switch.)
    from grape.torch.gpu_decompositions import one_row_mm_as_on_a_gpu

    m = _built("llama", CONFIGS["llama"])
    counter = {"row_statistics": "grape_row_statistics",
               "factored_statistics": "grape_factored_statistics"}[switch]
    with one_row_mm_as_on_a_gpu():
        scores, rewritten = _off_and_on(m, switch, counter)
        _, plain = _off_and_on(m, "thin_matmuls", "grape_thin_matmuls")
    assert rewritten == {False: 0, True: 3 * m.config.num_hidden_layers + 1}
    # (the decomposed products are Inductor's reductions already: the plain pass leaves them)
    assert plain == {False: 0, True: 0}
    torch.testing.assert_close(scores[True], scores[False], rtol=1e-5, atol=1e-5)


@_NEEDS_CXX
def test_a_compiled_step_reads_a_layers_query_key_and_value_as_one_stacked_product():
    # grape.torch.sibling_products: a Llama with fewer key heads than query heads multiplies
    # each layer's row by weights of two sizes; stacked, the three are one product (thin
    # matmuls counts a reduction each: two fewer a layer), with the scores of the step that
    # reads them apart, to float32's rounding. The gate and up projection, of one size, stay.
    m = _built("llama", CONFIGS["llama"])
    layers = m.config.num_hidden_layers
    scores, rewritten = _off_and_on(m, "sibling_products", "grape_thin_matmuls")
    assert rewritten == {False: 7 * layers + 1, True: 5 * layers + 1}
    torch.testing.assert_close(scores[True], scores[False], rtol=1e-5, atol=1e-5)

    decoder, ids, m_mask = _compiled_decoder(m, sibling_products=True)
    decoder.generate_on_host(ids, m_mask)
    attention = [layer.self_attn for layer in m.model.layers]
    assert [s.sources for s in decoder.step_model.weights.stacked] == [
        (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight) for a in attention]
    assert decoder.step_model.copied_bytes() == sum(
        p.weight.nbytes for a in attention for p in (a.q_proj, a.k_proj, a.v_proj))


@_NEEDS_CXX
def test_a_compiled_step_reads_weights_stored_in_out_from_copies_it_keeps_up_to_date():
    # grape.torch.weight_rows: GPT-2's Conv1D weights lie (in, out); the compiled one-row
    # step reads copies laid (out, in), which thin_matmuls makes reductions (without them,
    # only the head is rewritten), with the scores of the step that reads the weights, to
    # float32's rounding. A weight changed in place afterwards is copied again before the
    # step runs: the scores follow the model's.
    from transformers.pytorch_utils import Conv1D

    m = _built("gpt2", CONFIGS["gpt2"])
    scores, rewritten = _off_and_on(m, "weight_rows", "grape_thin_matmuls")
    conv1ds = [x for x in m.modules() if isinstance(x, Conv1D)]
    assert rewritten == {False: 1, True: 1 + len(conv1ds)}
    torch.testing.assert_close(scores[True], scores[False], rtol=1e-5, atol=1e-5)

    decoder, ids, m_mask = _compiled_decoder(m)
    decoder.generate_on_host(ids, m_mask)
    relaid = decoder.step_model.weights.relaid
    assert sorted(id(r.source) for r in relaid) == sorted(id(c.weight) for c in conv1ds)
    assert decoder.step_model.copied_bytes() == sum(c.weight.nbytes for c in conv1ds)
    with torch.no_grad():
        conv1ds[0].weight.mul_(3.0)
        conv1ds[-1].weight.add_(0.5)
    followed = torch.stack(decoder.generate_on_host(ids, m_mask).scores[1:])
    eager, *_ = _compiled_decoder(m, thin_matmuls=False)
    changed = torch.stack(eager.generate_on_host(ids, m_mask).scores[1:])
    assert not torch.allclose(changed, scores[False], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(followed, changed, rtol=1e-5, atol=1e-5)


@_NEEDS_CXX
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_compiled_step_can_run_its_one_row_products_through_grapes_operator(arch):
    # grape.torch.triton_gemv's pre-grad pass in a compiled step (CompiledStep.row_kernels):
    # every one-row product of the decode step, Linear's (out, in) weights and GPT-2's Conv1D
    # (in, out) ones alike, becomes grape::one_row_product (float32's product here, the
    # Triton GEMV on a GPU), the prefill's many-row ones not; the logits are those of the
    # step compiled without it, to float32's rounding.
    from transformers.pytorch_utils import Conv1D

    m = _built(arch, CONFIGS[arch])
    scores, rewritten = _off_and_on(m, "row_kernels", "grape_row_kernels")
    products = sum(isinstance(x, (torch.nn.Linear, Conv1D)) for x in m.modules())
    assert products == (4 if arch == "gpt2" else 7) * m.config.num_hidden_layers + 1
    assert rewritten == {False: 0, True: products}
    torch.testing.assert_close(scores[True], scores[False], rtol=1e-5, atol=1e-5)


@_NEEDS_CXX
def test_a_compiled_step_attends_with_grouped_queries_without_repeating_keys():
    # grape.torch.grouped_queries in a compiled step (Inductor, C++ kernels here): the decode
    # step of a model with fewer key heads than query heads copies no key or value head per
    # query head (transformers' repeat_kv: an expand and a clone of each layer's keys and
    # values, in the graph Inductor lowers), and its logits are those of the step compiled
    # with the copies, to float32's rounding.
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Repeats(CustomGraphPass):
        """Counts the clones of 5-D expands (repeat_kv's) in each graph Inductor lowers."""
        def __init__(self):
            self.counts = []

        def __call__(self, graph):
            self.counts.append(sum(
                n.target is torch.ops.aten.clone.default and n.args[0].target is
                torch.ops.aten.expand.default and len(n.meta["val"].shape) == 5
                for n in graph.nodes))

        def uuid(self):
            return None  # (uncacheable: every graph is lowered, and counted, here)

    m = _built("llama", CONFIGS["llama"])
    assert m.config.num_key_value_heads < m.config.num_attention_heads
    scores, repeats = {}, {}
    for grouped in (False, True):
        decoder, ids, m_mask = _compiled_decoder(m, grouped_queries=grouped)
        counted = Repeats()
        # (Dynamo's compilations of a model of these shapes, another test's among them, serve
        # this one: dropped, and no cache, so that the step is lowered and counted here)
        torch._dynamo.reset()
        with torch._inductor.config.patch(post_grad_custom_post_pass=counted,
                                          force_disable_caches=True):
            out = decoder.generate_on_host(ids, m_mask)
        repeats[grouped] = counted.counts[0]  # (the step's graph; the tail's after it)
        scores[grouped] = torch.stack(out.scores[1:])
        assert not decoder._unprepared
    assert repeats == {False: 2 * m.config.num_hidden_layers, True: 0}
    torch.testing.assert_close(scores[True], scores[False], rtol=1e-5, atol=1e-5)


def test_a_compiled_step_asks_inductor_for_dependent_launches_only_when_told(monkeypatch):
    # CompiledStep.dependent_launch: Inductor's configuration, as its backend reads it while
    # compiling the step's forward and its bookkeeping, holds programmatic dependent launch
    # for a step made with the switch on, and as configured otherwise for one made without.
    from grape.torch.compiled_step import CompiledStep, launches_dependently

    if not launches_dependently():
        pytest.skip("this torch's Inductor has no programmatic dependent launch")
    configured = torch._inductor.config.triton.enable_pdl
    seen = []

    def backend(gm, example_inputs):  # (what Inductor would read, recorded; runs eagerly)
        seen.append(torch._inductor.config.triton.enable_pdl)
        return gm.forward

    m = _built("gpt2", CONFIGS["gpt2"])
    ids, _ = _prompt()
    for on in (False, True):
        monkeypatch.setattr(CompiledStep, "dependent_launch", on)
        step = CompiledStep(m, backend=backend, dynamic=False)
        assert step.pdl is on
        torch._dynamo.reset()  # (each step's own compilations, not the last one's)
        step(input_ids=ids)
        step.tail(lambda x: x * 2)(torch.ones(3))
    assert seen == [configured] * 2 + [True] * 2
