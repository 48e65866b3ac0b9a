"""Exact-length attention (grape.torch.exact) on the CPU: the bookkeeping the GPU's varlen kernel
is given (each row's key range in the token-major cache, its padding, its count) computes what
masked attention over the whole cache computes, across architectures and strategies; what the
kernel cannot take falls back by name; masks that are not left padding are caught."""

from __future__ import annotations

import contextlib
import shutil

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from grape.torch.beam import BeamDecoder  # noqa: E402
from grape.torch.decoding import ExactRefused, NotLeftPadded, TokenDecoder  # noqa: E402
from grape.torch.exact import Lengths, TokenMajorHybridLayer, TokenMajorLayer  # noqa: E402
from grape.torch.options import resolve  # noqa: E402

VOCAB = 300
COMMON = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
# Architectures whose attention dispatches through transformers' AttentionInterface, one of them
# with grouped keys (llama: 4 query heads over 2 key heads).
CONFIGS = {
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 128},
    "llama": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2},
    "gpt_neox": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4},
}


def _model(arch, sizes=None):
    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(arch, **(sizes or CONFIGS[arch]), **COMMON)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    return _model(request.param)


def _prompt():
    ids = torch.randint(30, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding of different widths
    mask[1, :1] = 0
    return ids, mask


def _decoder(model, ids, mask, exact, **kwargs):
    options, m = resolve(model, ids, mask, dict(kwargs, max_new_tokens=10))
    cls = BeamDecoder if options.strategy == "beam" else TokenDecoder
    return cls(model, ids.shape[0], ids.shape[1], options, exact=exact), m


@pytest.mark.parametrize("kwargs", [{}, {"num_beams": 3}], ids=["greedy", "beam 3"])
def test_exact_lengths_make_the_tokens_masked_attention_makes(model, kwargs):
    ids, mask = _prompt()
    whole, m = _decoder(model, ids, mask, exact=False, **kwargs)
    exact, _ = _decoder(model, ids, mask, exact=True, **kwargs)
    assert torch.equal(exact.generate_on_host(ids, m), whole.generate_on_host(ids, m))
    layers = model.config.num_hidden_layers
    assert exact.lengths.served == {"exact": layers}  # the last step: every layer exact
    beams = exact.rows // 3  # a prompt's beams are adjacent rows
    assert exact.lengths.pad.tolist() == [p for p in (3, 1, 0) for _ in range(beams)]


def test_each_row_attends_to_its_own_unpadded_keys_and_no_others():
    model = _model("llama")
    ids, mask = _prompt()
    decoder, m = _decoder(model, ids, mask, exact=True)
    decoder.prefill(ids, m)
    decoder.step()
    lengths = decoder.lengths
    # After the prompt (7 tokens) and one step (the 8th): row r attends to 8 - pad[r] keys,
    # starting after its padding in its own stretch of the flattened cache.
    assert lengths.used.tolist() == [5, 7, 8]
    assert lengths.starts.tolist() == [0 + 3, 17 + 1, 34 + 0, 51]
    layer = decoder.cache.layers[0]
    assert isinstance(layer, TokenMajorLayer) and layer.key_buffer.is_contiguous()
    assert layer.keys.shape == (3, 2, 17, 16)  # what the model sees: (batch, heads, tokens, dim)


def test_what_the_kernel_cannot_take_runs_sdpa_and_says_why():
    model = _model("llama")
    ids, mask = _prompt()
    decoder, m = _decoder(model, ids, mask, exact=True)
    decoder.prefill(ids, m)
    attentions = [layer.self_attn for layer in model.model.layers]
    for a in attentions:  # attention dropout, which the varlen call is not given
        a.attention_dropout, a.training = 0.5, True
    try:
        decoder.step()
    finally:
        for a in attentions:
            a.attention_dropout, a.training = 0.0, False
    assert decoder.lengths.served == {"sdpa: attention dropout": 2}


def _masks_built(monkeypatch):
    """(implementation, query length, built) of every mask transformers' mask code asks for."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    import grape.torch.exact as exact_module

    calls = []

    def spying(name, fn):
        def spy(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls.append((name, kwargs["q_length"], out is not None))
            return out
        return spy

    mapping = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    monkeypatch.setitem(mapping, "sdpa", spying("sdpa", mapping["sdpa"]))
    # grape registers its mask function again each step: the module's name is what it takes.
    monkeypatch.setattr(exact_module, "mask", spying(exact_module.NAME, exact_module.mask))
    return calls


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_once_every_layer_attends_exactly_the_decode_mask_is_not_built(arch, monkeypatch):
    model = _model(arch)
    ids, mask = _prompt()
    whole, m = _decoder(model, ids, mask, exact=False)
    expected = whole.generate_on_host(ids, m)
    calls = _masks_built(monkeypatch)
    exact, _ = _decoder(model, ids, mask, exact=True)
    assert torch.equal(exact.generate_on_host(ids, m), expected)
    decode = [c for c in calls if c[1] == 1]
    # The first decode step's mask is built as generate builds it; every later step leaves it.
    assert [c for c in decode if c[2]] == [("sdpa", 1, True)]
    assert len(decode) > 5 and all(c[0] == "grape_exact" for c in decode[1:])
    assert exact.lengths.mask_unread


def test_a_call_that_falls_back_where_the_mask_was_left_unbuilt_builds_it_from_the_lengths(
        monkeypatch):
    import grape.torch.exact as exact_module

    model = _model("llama")
    ids, mask = _prompt()
    whole, m = _decoder(model, ids, mask, exact=False)
    expected = whole.generate_on_host(ids, m)
    calls, rebuilt = [], []
    refusal = exact_module._refusal

    def every_other_call_refused_from_the_third_step(lengths, query, *args):
        calls.append(None)  # two layers a step: calls 5 and on are the third step's
        if len(calls) > 4 and len(calls) % 2:
            return "refused by the test"
        return refusal(lengths, query, *args)

    monkeypatch.setattr(exact_module, "_refusal", every_other_call_refused_from_the_third_step)
    from_lengths = exact_module.Lengths.mask
    monkeypatch.setattr(exact_module.Lengths, "mask",
                        lambda self, keys: rebuilt.append(keys) or from_lengths(self, keys))
    exact, _ = _decoder(model, ids, mask, exact=True)
    assert torch.equal(exact.generate_on_host(ids, m), expected)
    assert exact.lengths.served == {"exact": 1, "sdpa: refused by the test": 1}
    assert rebuilt == [17]  # the third step's refused layer, where the mask was left unbuilt
    assert not exact.lengths.mask_unread  # and built again after it


# Architectures whose attention code has varied between transformers releases (5.17 attends
# by its own code in some of them, never calling grape's attention; later ones dispatch).
OWN_CODE = {
    "gptj": {"n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8, "n_positions": 128},
    "falcon": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "new_decoder_architecture": True, "num_kv_heads": 2},
    "bloom": {"hidden_size": 64, "n_layer": 2, "n_head": 4},
}


@pytest.mark.parametrize("arch", list(OWN_CODE))
def test_models_of_other_attention_code_make_the_whole_cache_s_tokens(arch):
    model = _model(arch, OWN_CODE[arch])
    ids, mask = _prompt()
    whole, m = _decoder(model, ids, mask, exact=False)
    if not model._supports_sdpa:  # (GPT-J and Bloom in 5.17: eager attention alone)
        with pytest.raises(ExactRefused, match=f"{type(model).__name__} does not support SDPA "
                                               f"\\(it attends by 'eager'\\)"):
            _decoder(model, ids, mask, exact=True)
        return
    exact, _ = _decoder(model, ids, mask, exact=True)
    assert torch.equal(exact.generate_on_host(ids, m), whole.generate_on_host(ids, m))
    served = exact.lengths.served
    assert exact.lengths.mask_unread == (set(served) == {"exact"})


# Models whose layers are not all attention over the whole generation: a sliding window shorter
# than it (Gemma 3's five in six layers), a recurrent state (OLMo-hybrid's linear attention),
# or one beside attention keys in one layer (Zaya's, as Zamba's and Falcon-H1's).
# Their full-attention layers are what grows with the length.
MIXED = {
    "gemma3_text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "olmo_hybrid": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "layer_types": ["linear_attention", "full_attention"],
                    "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                    "linear_key_head_dim": 16, "linear_value_head_dim": 32},
    # a recurrent state and attention keys in one layer (LinearAttentionAndStaticFull...)
    "zaya": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "head_dim": 16},
}


@pytest.mark.parametrize("kwargs", [{}, {"num_beams": 3}], ids=["greedy", "beam 3"])
@pytest.mark.parametrize("arch", list(MIXED))
def test_full_attention_runs_exactly_beside_windows_and_recurrent_states(arch, kwargs):
    from grape.torch.static_layers import CountedSlidingLayer

    model = _model(arch, MIXED[arch])
    ids, mask = _prompt()  # 7 tokens and 10 new: past the window of 8
    whole, m = _decoder(model, ids, mask, exact=False, **kwargs)
    exact, _ = _decoder(model, ids, mask, exact=True, **kwargs)
    assert torch.equal(exact.generate_on_host(ids, m), whole.generate_on_host(ids, m))
    layers = exact.cache.layers
    full = sum(isinstance(layer, TokenMajorLayer) for layer in layers)
    assert full == exact.lengths.layers >= 1
    assert any(isinstance(layer, TokenMajorHybridLayer) for layer in layers) == (arch == "zaya")
    windows = sum(type(layer) is CountedSlidingLayer for layer in layers)
    # The last step: the full layers exactly, the window over its own keys and mask (a
    # recurrent state calls no attention), and the full layers' mask left unbuilt.
    assert exact.lengths.served == dict({"exact": full},
                                        **({"sdpa: a sliding window's own keys": windows}
                                           if windows else {}))
    assert bool(windows) == (arch == "gemma3_text") and exact.lengths.mask_unread


def test_a_model_without_sdpa_is_refused_exact_lengths_before_it_runs():
    # GPT-OSS attends by eager code alone: its attention sinks (``s_aux``) are a term SDPA
    # has no place for. Exact lengths run SDPA for every call their kernel cannot take (its
    # sinks among them), which would drop the sinks without a word: refused instead, so that
    # grape.generate's default runs the whole cache through the model's own attention.
    model = _model("gpt_oss", {"hidden_size": 64, "intermediate_size": 64,
                               "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 16,
                               "num_local_experts": 4, "num_experts_per_tok": 2,
                               "sliding_window": 8,
                               "layer_types": ["sliding_attention", "full_attention"]})
    ids, mask = _prompt()
    with pytest.raises(ExactRefused, match="exact lengths run SDPA where their kernel cannot "
                                           "serve a call, and GptOssForCausalLM does not "
                                           "support SDPA \\(it attends by 'eager'\\)"):
        _decoder(model, ids, mask, exact=True)


def test_a_step_that_ran_no_attention_exactly_refuses_exact_lengths(monkeypatch):
    # Every call of the step runs SDPA (as Gemma 2's soft-capped scores do under transformers
    # 5.17, and MLA models' keys expanded after the cache's update, DeepSeek-V3's): exact
    # lengths would add their bookkeeping alone, and grape.generate's default is refused them.
    # Forced here (Gemma 2 is refused for no SDPA in later transformers releases).
    import grape.torch.exact as exact_module
    from grape.torch.api import _Prompt, _warm_up

    monkeypatch.setattr(exact_module, "_refusal", lambda *args: "refused by the test")
    model = _model("llama")
    ids, mask = _prompt()
    exact, m = _decoder(model, ids, mask, exact=True)
    with pytest.raises(ExactRefused, match="^no attention call of LlamaForCausalLM's step ran "
                                           "over exact lengths \\(2 by sdpa: refused by the "
                                           "test\\)$"):
        _warm_up(model, exact, _Prompt(ids, m, None, None, None, ()), None, exact=True)
    # Asked for explicitly, the model is graphed all the same (with a warning, api._build).
    exact, m = _decoder(model, ids, mask, exact=True)
    _warm_up(model, exact, _Prompt(ids, m, None, None, None, ()), None, exact=True,
             refuse_unserved=False)
    assert exact.lengths.served == {"sdpa: refused by the test": 2}


def test_a_model_whose_own_code_fails_on_the_token_major_cache_refuses_exact_lengths(
        monkeypatch):
    # An attention that views its keys as laid out by heads (GPT-NeoX-Japanese's does
    # ``key.view(batch * heads, ...)``) fails on exact lengths' cache, laid out by tokens:
    # grape.generate's eager first runs refuse exact lengths, naming the model's line, so that
    # its default runs the loop over the whole cache, which serves the model, instead of
    # falling back to generate. (A Llama whose attention does so, here: GPT-NeoX-Japanese
    # attends by eager code alone, which exact lengths refuse before any run.)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import grape.torch.exact as exact_module
    from grape.torch.api import _Prompt, _warm_up

    def heads_major(module, query, key, value, mask, **kwargs):
        key.view(-1, key.shape[-1])  # as one (batch * heads * tokens, dim) matrix
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    monkeypatch.setattr(exact_module, "attention", heads_major)
    model = _model("llama")
    ids, mask = _prompt()
    exact, m = _decoder(model, ids, mask, exact=True)
    with pytest.raises(ExactRefused, match=r"LlamaForCausalLM failed on exact lengths' cache, "
                                           r"laid out by tokens: RuntimeError: view size .*"
                                           r"\(at .*test_torch_exact.py:\d+ \(key.view"):
        _warm_up(model, exact, _Prompt(ids, m, None, None, None, ()), None, exact=True)
    whole, _ = _decoder(model, ids, mask, exact=False)
    _warm_up(model, whole, _Prompt(ids, m, None, None, None, ()), None, exact=False)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                               cache_implementation="static", pad_token_id=0)
    assert torch.equal(whole.generate_on_host(ids, m), reference)


@pytest.mark.parametrize("own_code", [True, False], ids=["own code", "through grape"])
def test_a_written_only_refusal_is_exact_lengths_where_no_layer_attended_through_grape(
        own_code, monkeypatch):
    # Falcon's and Bloom's attention can mask by its own code, never calling grape's (which
    # path Falcon takes depends on what earlier code left in transformers: in the whole suite
    # it dispatched), and in benchmarks/compiled_exact_sweep.py's run the written-only check
    # saw their steps read the cache's unwritten tail under exact lengths' attention name, not
    # over the whole cache. Here a Llama's layers attend by SDPA directly where ``own_code``
    # (as such a model does), and the check's refusal is forced: where no layer attended
    # through grape's function it is exact lengths' (grape.generate's default then runs the
    # whole cache), where layers did it stays the model's.
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import grape.torch.exact as exact_module
    from grape.torch.api import _Prompt, _warm_up
    from grape.torch.decoding import Decoder
    from grape.torch.options import NotGraphable

    checked = Decoder.check_written_only

    def refusing(self, *args):
        with contextlib.suppress(NotGraphable):
            checked(self, *args)  # (the check's runs: which layers attended how)
        raise NotGraphable("M reads cache positions it has not written (forced)")

    monkeypatch.setattr(Decoder, "check_written_only", refusing)
    if own_code:
        monkeypatch.setattr(exact_module, "attention", lambda module, query, key, value, mask,
                            **kwargs: sdpa_attention_forward(module, query, key, value, mask,
                                                             **kwargs))
    model = _model("llama")
    ids, mask = _prompt()
    exact, m = _decoder(model, ids, mask, exact=True)
    with pytest.raises(NotGraphable) as refused:
        _warm_up(model, exact, _Prompt(ids, m, None, None, None, ()), None, exact=True)
    assert isinstance(refused.value, ExactRefused) == own_code
    if own_code:
        assert str(refused.value).startswith(
            "LlamaForCausalLM's attention masks by its own code, not through transformers' "
            "AttentionInterface; under exact lengths: M reads cache positions")
    whole, _ = _decoder(model, ids, mask, exact=False)
    with pytest.raises(NotGraphable) as refused:  # without exact lengths: the model's
        _warm_up(model, whole, _Prompt(ids, m, None, None, None, ()), None, exact=False)
    assert not isinstance(refused.value, ExactRefused)


def test_layers_that_never_call_grape_s_attention_keep_their_mask(monkeypatch):
    # As a model that attends by its own code: its layers read the mask generate would build.
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import grape.torch.exact as exact_module

    monkeypatch.setattr(exact_module, "attention", lambda module, query, key, value, mask,
                        **kwargs: sdpa_attention_forward(module, query, key, value, mask,
                                                         **kwargs))
    model = _model("llama")
    ids, mask = _prompt()
    whole, m = _decoder(model, ids, mask, exact=False)
    exact, _ = _decoder(model, ids, mask, exact=True)
    assert torch.equal(exact.generate_on_host(ids, m), whole.generate_on_host(ids, m))
    assert exact.lengths.served == {} and not exact.lengths.mask_unread


def test_a_mask_that_is_not_left_padding_is_caught_when_the_result_is_read():
    model = _model("gpt2")
    ids, mask = _prompt()
    mask[2, 3] = 0  # a hole: row 2's keys are not one range
    decoder, m = _decoder(model, ids, mask, exact=True)
    with pytest.raises(NotLeftPadded, match="left-padded"):
        decoder.generate_on_host(ids, m)


def test_lengths_without_a_mask_have_no_padding():
    lengths = Lengths(rows=2, max_len=5, device=torch.device("cpu"))
    lengths.set_prompt(None, prompt_len=3)
    lengths.before_step(torch.tensor(3))
    assert lengths.starts.tolist() == [0, 5, 10] and lengths.used.tolist() == [4, 4]
    assert bool(lengths.ok)


def test_exact_lengths_arguments_are_checked():
    import grape
    from grape.errors import GrapeError

    with pytest.raises(GrapeError, match="expected exact_lengths to be True, False or None, "
                                         "found 'yes'"):
        grape.generate(_model("gpt2"), torch.zeros((1, 3), dtype=torch.long), max_new_tokens=2,
                       exact_lengths="yes")


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="Inductor on the CPU needs a C++ compiler")
@pytest.mark.parametrize("arch, kwargs", [("gpt2", {}), ("llama", {}),
                                          ("llama", {"num_beams": 3})],
                         ids=["gpt2", "llama", "llama beam 3"])
def test_a_compiled_step_attends_over_exact_lengths_compiled_once(arch, kwargs):
    # compile=True with exact lengths (Inductor's C++ kernels here; the varlen kernel's
    # reference, masked by what the kernel is given, traced into the step): the first decode
    # step runs the model's own forward and learns that no one reads the mask, so the
    # forward compiles once, for the steps after it, with no graph break; every layer
    # attends exactly, and the scores are those of the exact step uncompiled, to float32's
    # rounding (a beam search's too, its cache reordered by beam between steps).
    from torch._dynamo.utils import counters

    from grape.torch.compiled_step import CompiledStep

    model = _model(arch)
    ids, mask = _prompt()
    scores = {}
    for compiled in (False, True):
        options, m = resolve(model, ids, mask, {"max_new_tokens": 6, "output_scores": True,
                                                "return_dict_in_generate": True, **kwargs})
        step = CompiledStep(model, dynamic=False) if compiled else None
        cls = BeamDecoder if options.strategy == "beam" else TokenDecoder
        decoder = cls(model, ids.shape[0], ids.shape[1], options, step_model=step, exact=True)
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        scores[compiled] = torch.stack(decoder.generate_on_host(ids, m).scores)
        assert decoder.lengths.served == {"exact": model.config.num_hidden_layers}
        if compiled:
            # (the forward; the decoder's bookkeeping after it compiles apart, at most once)
            assert counters["stats"]["unique_graphs"] - graphs in (1, 2)
            assert sum(counters["graph_break"].values()) == breaks
    torch.testing.assert_close(scores[True], scores[False], rtol=1e-5, atol=1e-5)
