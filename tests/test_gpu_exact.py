"""Exact-length attention on a real GPU: the varlen kernel over grape's token-major cache
computes masked attention over the whole cache, to fp16 tolerance; grape.generate with
exact_lengths=True is one launch whose tokens greedy decoding would make."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from grape.torch.exact import Lengths, active, attention  # noqa: E402
from tests.ties import parted_beyond_a_tie  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")


@pytest.mark.parametrize("groups", [1, 4])
def test_the_varlen_kernel_over_the_cache_is_masked_attention_over_the_whole_cache(cuda, groups):
    torch.manual_seed(0)
    rows, heads, dim, max_len = 4, 8, 64, 600
    kv_heads = heads // groups
    buffer = torch.randn(2, rows, max_len, kv_heads, dim, device="cuda", dtype=torch.float16)
    keys, values = buffer[0].transpose(1, 2), buffer[1].transpose(1, 2)  # as grape's cache
    query = torch.randn(rows, heads, 1, dim, device="cuda", dtype=torch.float16)
    lengths = Lengths(rows, max_len, torch.device("cuda"))
    prompt = 40
    mask = torch.ones(rows, prompt, dtype=torch.long, device="cuda")
    mask[1, :5], mask[3, :39] = 0, 0
    lengths.set_prompt(mask, prompt)
    module = torch.nn.Module()
    for cached in (prompt, 41, 300, max_len - 1):
        lengths.before_step(torch.tensor(cached, device="cuda"))
        with active(lengths, _Config()):
            out, _ = attention(module, query, keys, values, None, scaling=dim ** -0.5)
        columns = torch.arange(max_len, device="cuda")
        valid = (columns <= cached) & (columns >= lengths.pad[:, None])
        reference = torch.nn.functional.scaled_dot_product_attention(
            query, keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1),
            attn_mask=valid[:, None, None, :])
        assert lengths.served == {"exact": 1}
        torch.testing.assert_close(out, reference.transpose(1, 2), atol=2e-3, rtol=2e-3)


class _Config:
    """What ``active`` switches: a model's config and its attention implementation."""

    def __init__(self) -> None:
        self.config = type("C", (), {"_attn_implementation": "sdpa"})()


def _llama():
    """A 3-layer fp16 Llama with grouped keys (8 query heads over 2), random weights, on the
    GPU."""
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=3, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=4000, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    return model.cuda().eval()


def test_generate_with_exact_lengths_is_one_launch_of_greedy_tokens(cuda):
    from exact_lengths import greedy_gaps

    import grape
    from grape.torch.api import clear_cache, last_stats

    model = _llama()
    ids = torch.randint(3, 4000, (3, 24), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    kw = dict(max_new_tokens=200, eos_token_id=None, pad_token_id=0, exact_lengths=True)
    out = grape.generate(model, ids, mask, **kw)
    stats = last_stats()
    assert stats.graphed and stats.prefill_graphed and stats.host_syncs == 1
    assert stats.attention == {"exact": 3}
    other = torch.randint(3, 4000, (3, 24), device="cuda")
    again = grape.generate(model, other, mask, **kw)
    assert not last_stats().captured and not torch.equal(again, out)
    for tokens, prompt in ((out, ids), (again, other)):
        assert torch.equal(tokens[:, :24], prompt)
        gaps = greedy_gaps(model, tokens, mask, 24)
        assert gaps.shape == (3, 200)
        # every token greedy decoding would make, up to fp16 near-ties
        assert float(gaps.max()) < 0.05, float(gaps.max())
    clear_cache(model)


def test_a_cache_longer_than_the_generation_changes_what_is_read_not_the_tokens(cuda):
    # cache_length sizes the cache as a server does, once: exact lengths never read the keys
    # past the generation, so their tokens are the short cache's bit for bit; the loop over
    # the whole cache reads them all, masked, so its tokens are greedy decoding's.
    from exact_lengths import greedy_gaps

    import grape
    from grape.torch.api import clear_cache, last_stats

    config = transformers.GPT2Config(n_embd=256, n_layer=3, n_head=4, vocab_size=4000,
                                     n_positions=1024, bos_token_id=1, eos_token_id=2,
                                     pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    model = model.cuda().eval()
    ids = torch.randint(3, 4000, (4, 16), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(max_new_tokens=64, eos_token_id=None, pad_token_id=0)
    short = grape.generate(model, ids, mask, exact_lengths=True, **kw)
    long = grape.generate(model, ids, mask, exact_lengths=True, cache_length=1024, **kw)
    stats = last_stats()
    assert stats.graphed and stats.captured and stats.attention == {"exact": 3}
    assert torch.equal(long, short)
    padded = grape.generate(model, ids, mask, exact_lengths=False, cache_length=1024, **kw)
    assert last_stats().graphed and padded.shape == short.shape
    assert float(greedy_gaps(model, padded, mask, 16).max()) < 0.05
    clear_cache(model)


def test_a_compiled_step_attends_over_exact_lengths_in_one_launch(cuda):
    # compile=True with exact lengths: the varlen kernel inside the compiled step (Inductor
    # calls it as an extern kernel), every layer exact, one launch and one read-back, and
    # tokens greedy decoding would make up to fp16 near-ties (compiled kernels round their
    # own way); a second prompt of the same shape captures nothing.
    from exact_lengths import greedy_gaps

    import grape
    from grape.torch.api import clear_cache, last_stats

    model = _llama()
    ids = torch.randint(3, 4000, (2, 24), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    kw = dict(max_new_tokens=64, eos_token_id=None, pad_token_id=0, exact_lengths=True,
              compile=True)
    out = grape.generate(model, ids, mask, **kw)
    stats = last_stats()
    assert stats.graphed and stats.compiled and stats.host_syncs == 1, stats
    assert stats.attention == {"exact": 3}
    other = torch.randint(3, 4000, (2, 24), device="cuda")
    again = grape.generate(model, other, mask, **kw)
    assert not last_stats().captured
    for tokens, prompt in ((out, ids), (again, other)):
        assert torch.equal(tokens[:, :24], prompt)
        assert float(greedy_gaps(model, tokens, mask, 24).max()) < 0.05
    clear_cache(model)


def test_full_layers_run_exactly_beside_sliding_windows_in_one_launch(cuda):
    # Gemma 3's layers: sliding windows shorter than the generation, and a full-attention
    # layer, which alone grows with the length: the varlen kernel serves it, each window runs
    # SDPA over its own keys and mask, and the tokens are greedy decoding's up to fp16 ties.
    from exact_lengths import greedy_gaps

    import grape
    from grape.torch.api import clear_cache, last_stats

    config = transformers.Gemma3TextConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, sliding_window=32, vocab_size=4000,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    model = model.cuda().eval()
    ids = torch.randint(3, 4000, (2, 24), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    out = grape.generate(model, ids, mask, max_new_tokens=96, eos_token_id=None,
                         pad_token_id=0, exact_lengths=True)
    stats = last_stats()
    assert stats.graphed and stats.host_syncs == 1, stats
    assert stats.attention == {"exact": 1, "sdpa: a sliding window's own keys": 2}
    assert torch.equal(out[:, :24], ids)
    assert float(greedy_gaps(model, out, mask, 24).max()) < 0.05
    clear_cache(model)


@pytest.mark.parametrize("arch", ["falcon_h1", "qwen3_next"])
def test_full_layers_run_exactly_beside_recurrent_states_in_one_launch(cuda, arch):
    # Falcon-H1 keeps a recurrent state and attention keys in one layer (grape lays the keys
    # out by tokens: TokenMajorHybridLayer), Qwen3-Next linear-attention layers beside full
    # ones: the varlen kernel serves every layer that attends over the cache (arch_sweep's
    # GPU-sized config, random weights). bf16, as these models ship: Qwen3-Next's experts run
    # PyTorch's grouped GEMM, which in fp16 reads the experts' offsets back to the host.
    # The reference is generate, the model's own recurrent step: one forward over the whole
    # sequence is not, since Qwen3-Next's chunked delta rule parts from its recurrent step by
    # up to 2 logits over 64 tokens in bf16 (measured on an H100 with generate's own tokens).
    from arch_sweep import build

    import grape
    from grape.torch.api import clear_cache, last_stats

    model = build(arch, "cuda", torch.bfloat16)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (2, 24), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    kw = dict(max_new_tokens=64, eos_token_id=None, pad_token_id=0)
    out = grape.generate(model, ids, mask, exact_lengths=True, **kw)
    stats = last_stats()
    assert stats.graphed and stats.host_syncs == 1, stats
    assert set(stats.attention) == {"exact"}, stats.attention
    ref = model.generate(ids, attention_mask=mask, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, **kw)
    assert parted_beyond_a_tie(out, ref, 24, tie=0.1) is None
    clear_cache(model)

