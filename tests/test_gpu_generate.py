"""grape.generate and grape.graphed on a real GPU."""

from __future__ import annotations

import warnings

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from grape.errors import GrapeError  # noqa: E402
from tests.benchrun import run_benchmark, run_sweep  # noqa: E402
from tests.ties import parted_beyond_a_tie  # noqa: E402

# Every architecture of benchmarks/generate.py (Mixtral in bf16 there: see its DTYPES).
ARCHS = "gpt2,gptj,gpt_neox,opt,bloom,falcon,llama,mistral,qwen2,mixtral"


def _small_llama():
    """A 2-layer Llama of width 64 with a 500-token vocabulary, on the GPU (seeded)."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=500)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).cuda().eval()


def _small_gpt2():
    """A 2-layer GPT-2 of width 128 with a 500-token vocabulary, on the GPU (seeded)."""
    config = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=500)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).cuda().eval()


def _static_reference(model, *args, **kwargs):
    """``generate`` with a static cache and its own forward, uncompiled: on CUDA a static
    cache makes ``generate`` compile the forward (CUDA graphs, ``reduce-overhead``), and what
    that forward computes depends on what the process compiled before (Whisper's long form
    parted from grape's tokens after twenty other tests had run, and equalled them in three
    runs alone, on an H100). grape runs the eager kernels; the benchmarks compare likewise."""
    if "past_key_values" not in kwargs:
        kwargs["cache_implementation"] = "static"
    return model.generate(*args, disable_compile=True, **kwargs)


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")


def test_with_deterministic_kernels_every_architecture_and_strategy_makes_generates_tokens(
        cuda, tmp_path):
    # A fresh process (cuBLAS reads its workspace setting once). Small configs of ten
    # architectures, greedy / sampling / 5 beams, batch 1 and 4 (left-padded), with and without
    # an EOS that occurs: every call graphed, prompt included (one read-back per call), greedy
    # and beam tokens equal to generate's with a static cache, sampling repeating itself for a
    # seed and equal to its own host loop (the prompt run under capture there too: Hugging
    # Face picks the prompt's attention kernel by whether a capture is under way).
    doc = run_benchmark("generate.py", tmp_path, "--small", "--deterministic", "--new", "48",
                        "--batches", "1,4", "--later-batch-strategies", "greedy,sample,beam5",
                        "--ways", "hf_static,grape", "--repeats", "1", "--eos-runs",
                        "--archs", ARCHS)
    rows = doc["results"]
    assert not [r for r in rows if "failed" in r]
    grape_rows = [r for r in rows if r["way"] == "grape"]
    assert len(grape_rows) == 10 * 3 * 2 * 2
    fell_back = [(r["arch"], r["strategy"], r["fallback"]) for r in grape_rows if r["fallback"]]
    assert not fell_back
    assert all(r["prefill_graphed"] for r in grape_rows)
    wrong = [(r["arch"], r["strategy"], r["batch"], r["run"]) for r in grape_rows
             if r["strategy"] != "sample" and not r["tokens_identical"]]
    assert not wrong
    unrepeatable = [(r["arch"], r["batch"], r["run"]) for r in grape_rows
                    if r["strategy"] == "sample"
                    and not (r["same_seed_same_tokens"] and r["host_loop_tokens_identical"])]
    assert not unrepeatable
    syncing = [(r["arch"], r["strategy"], r["host_syncs_per_token"] * r["new_tokens"])
               for r in grape_rows if r["host_syncs_per_token"] * r["new_tokens"] > 1]
    assert not syncing


def test_a_concurrent_step_makes_the_chains_tokens_across_architectures(cuda, tmp_path):
    # grape.passes.concurrency reorders the step's kernels by what they read and write: the
    # same kernels on the same memory, so the same bits, for every strategy (sampling's random
    # offsets are fixed at capture). And it must have found something to run side by side.
    # (grape's own tokens against generate's: the every-architecture test above.) Five of
    # the ten architectures: the ten ran past four minutes on the H200.
    archs = "gpt2,llama,bloom,gptj,opt"
    doc = run_benchmark("generate.py", tmp_path, "--small", "--deterministic", "--new", "48",
                        "--batches", "1,4", "--later-batch-strategies", "greedy,sample,beam5",
                        "--ways", "grape,grape_concurrent", "--repeats", "1", "--archs", archs)
    assert not [r for r in doc["results"] if "failed" in r]
    rows = [r for r in doc["results"] if r["way"] == "grape_concurrent"]
    assert len(rows) == 5 * 3 * 2
    assert not [(r["arch"], r["fallback"]) for r in rows if not r["graphed"] or r["fallback"]]
    wrong = [(r["arch"], r["strategy"], r["batch"]) for r in rows if not r["tokens_equal_to_grape"]]
    assert not wrong
    chained = [(r["arch"], r["strategy"], r["batch"], r["step_depth"], r["step_nodes"])
               for r in rows if r["step_depth"] >= r["step_nodes"]]
    assert not chained


def test_a_graphed_prompt_attends_as_generate_does_for_its_mask(cuda, tmp_path):
    # Eagerly, Hugging Face reads an unpadded prompt's mask and runs SDPA's causal kernels;
    # under a capture it cannot read, and built the mask (SDPA's masked kernels): these four
    # decoders at batch 1 then made other greedy tokens than generate (bf16, arch_sweep.py's
    # small config, in every sweep before the prompt branched on the device). Now the captured
    # prompt takes, per launch, the kernels generate takes for its mask (grape.torch.hfmasks).
    # Built without is_decoder they attend both ways, and at batch 1 (no padding) over the
    # static cache's unused tail too: Decoder.check_written_only may refuse them there (on the
    # CPU it refuses all four, in bf16 as in fp32; on the H200 in bf16 it refused BERT alone,
    # 2026-12-05, not explained), the documented fallback. With padding (batch 2) each
    # graphs, prompt included.
    rows = run_sweep(tmp_path, "--archs", "bert,ernie,roc_bert,xlm-roberta-xl")
    assert len(rows) == 4 * 2

    def fine(r):
        return ((r["graphed"] and r["prefill_graphed"] and r["tokens_identical"])
                or (r["batch"] == 1 and "reads cache positions it has not written"
                    in (r.get("fallback") or "")))

    wrong = [(r["arch"], r["batch"], r.get("fallback")) for r in rows if not fine(r)]
    assert not wrong
    assert all(r["graphed"] for r in rows if r["batch"] == 2)


def test_a_moe_model_in_fp16_is_captured_with_experts_that_read_nothing_back(cuda, monkeypatch):
    # PyTorch's grouped GEMM runs on the device alone only in bf16; in fp16 it reads the expert
    # offsets back to the host, which no graph holds (grape fell back to generate here). While
    # grape captures, the experts run on the device (grape.torch.experts): the steps' rows and
    # the prompt's 16 tokens pick more than a third of the 4 experts, densely (the CPU tests
    # hold batched_mm's calls). So the prompt runs inside the launch too. Over the dense
    # bound (made 8 tokens here) the prompt keeps grouped_mm and runs eagerly before the
    # launch, with a warning. The caller's model keeps grouped_mm. The experts' sums round
    # otherwise, so the tokens are generate's up to a near-tie.
    import grape
    from grape.torch import experts
    from grape.torch.api import clear_cache, last_stats

    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, vocab_size=500)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).cuda().half().eval()
    ids = torch.randint(3, 500, (2, 8), device="cuda")
    for dense_tokens, beams, inside in ((experts.DENSE_TOKENS, 1, True),
                                        (experts.DENSE_TOKENS, 3, True), (8, 1, False)):
        monkeypatch.setattr(experts, "DENSE_TOKENS", dense_tokens)
        clear_cache(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = grape.generate(model, ids, max_new_tokens=6, num_beams=beams,
                                 return_dict_in_generate=beams > 1, output_scores=beams > 1)
        stats = last_stats()
        assert stats.graphed and stats.prefill_graphed is inside, (beams, stats)
        assert stats.experts_switched_from == "grouped_mm in float16"
        said = [str(w.message) for w in caught]
        assert any("runs the prompt eagerly" in m for m in said) is not inside, said
        assert model.get_experts_implementation()[""] in (None, "grouped_mm")
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, num_beams=beams,
                             output_scores=True, return_dict_in_generate=True)
        if beams == 1:
            assert parted_beyond_a_tie(out, ref, 8, tie=0.02) is None
        else:  # the best beams score as generate's do, whichever a near-tie picked
            torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=0,
                                       atol=0.02)
    clear_cache(model)


def test_switch_experts_runs_bf16_experts_by_grapes_implementations(cuda):
    # bf16's grouped GEMM reads nothing back, so by default grape captures it as it is;
    # switch_experts=True runs it by grape's implementations too,
    # in an executable of its own, and False leaves fp16's reading experts as they are, so
    # that the model falls back to generate with the reason.
    import grape
    from grape.torch.api import clear_cache, last_stats

    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=8,
                                        num_experts_per_tok=2, vocab_size=500)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(3, 500, (2, 8), device="cuda")
    kw = dict(max_new_tokens=6, do_sample=False)
    ref = model.generate(ids, output_scores=True, return_dict_in_generate=True, **kw)
    as_given = grape.generate(model, ids, **kw)
    assert last_stats().graphed and last_stats().experts_switched_from is None
    assert parted_beyond_a_tie(as_given, ref, 8, tie=0.05) is None
    switched = grape.generate(model, ids, switch_experts=True, **kw)
    stats = last_stats()
    assert stats.graphed and stats.captured and stats.prefill_graphed, stats
    assert stats.experts_switched_from == "grouped_mm in bfloat16"
    assert model.get_experts_implementation()[""] in (None, "grouped_mm")
    assert parted_beyond_a_tie(switched, ref, 8, tie=0.05) is None
    model.half()
    clear_cache(model)
    with pytest.warns(UserWarning, match="grape.generate runs model.generate instead"):
        grape.generate(model, ids, switch_experts=False, **kw)
    assert not last_stats().graphed
    clear_cache(model)

def test_the_prompt_is_read_where_it_lies_and_re_pointed_only_when_it_moves(cuda):
    import grape
    from grape.torch.api import clear_cache, last_stats

    model = _small_llama()
    g = torch.Generator(device="cuda").manual_seed(0)
    prompts = [torch.randint(3, 500, (2, 8), device="cuda", generator=g) for _ in range(3)]
    mask = torch.ones_like(prompts[0])
    mask[0, :3] = 0
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    expected = [model.generate(p, attention_mask=mask, **kw) for p in prompts]
    updates = []
    for i, (ids, want) in enumerate(zip([*prompts, prompts[1]], [*expected, expected[1]],
                                        strict=True)):
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = grape.generate(model, ids, mask, **kw)
        torch.cuda.set_sync_debug_mode("default")
        stats = last_stats()
        assert stats.graphed and stats.prefill_graphed and stats.launches == 1
        assert torch.equal(out, want), i
        if i:  # the first call captures; later ones make one read-back, the result's length
            assert sum("synchronizing" in str(w.message) for w in caught) == 1
        updates.append(stats.pointer_updates)
    # Three prompts alive at once lie at three addresses: the second and third calls re-point
    # the nodes reading the ids; the fourth finds the second's ids where they were last.
    assert updates[0] == 0 and updates[1] > 0 and updates[2] > 0 and updates[3] > 0
    again = grape.generate(model, prompts[1], mask, **kw)
    assert torch.equal(again, expected[1]) and last_stats().pointer_updates == 0
    assert last_stats().copy_bytes == mask.numel() * mask.element_size()
    clear_cache(model)


@pytest.mark.parametrize("beams", [1, 3])
def test_the_return_dict_holds_generates_scores_from_one_launch(cuda, beams):
    # return_dict_in_generate with scores and logits: written on the device at each token's
    # count inside the one launch, copied out after its one read-back (grape.generate's
    # results against generate's given the same cache layout; bit for bit on the CPU).
    import grape
    from grape.torch.api import clear_cache, last_stats

    model = _small_llama()
    ids = torch.randint(3, 500, (2, 8), device="cuda")
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
              output_scores=True, output_logits=True, num_beams=beams)
    cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + 10)
    want = _static_reference(model, ids, past_key_values=cache, **kw)
    got = grape.generate(model, ids, **kw)
    assert last_stats().graphed and last_stats().prefill_graphed
    assert torch.equal(got.sequences, want.sequences)
    if beams > 1:
        assert torch.equal(got.beam_indices, want.beam_indices)
        torch.testing.assert_close(got.sequences_scores, want.sequences_scores, rtol=1e-3,
                                   atol=1e-3)
    for name in ("scores", "logits"):
        ours, theirs = getattr(got, name), getattr(want, name)
        assert len(ours) == len(theirs) > 0
        for a, b in zip(ours, theirs, strict=True):  # captured kernels: close, not bitwise
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    kept = [t.clone() for t in got.scores]
    grape.generate(model, torch.randint(3, 500, (2, 8), device="cuda"), **kw)
    assert all(torch.equal(a, b) for a, b in zip(kept, got.scores, strict=True))
    clear_cache(model)


def test_captures_are_reported_on_the_grape_logger(cuda, caplog):
    import logging
    import re

    import grape
    from grape.torch.api import clear_cache, last_stats

    model = _small_llama()
    ids = torch.randint(3, 500, (1, 5), device="cuda")
    with caplog.at_level(logging.INFO, logger="grape"):
        grape.generate(model, ids, max_new_tokens=4, do_sample=False)
        stats = last_stats()
        grape.generate(model, ids, max_new_tokens=4, do_sample=False)  # kept: no capture
    lines = [r.getMessage() for r in caplog.records if r.name == "grape"]
    assert len(lines) == 2, lines
    assert lines[0] == ("grape.generate: capturing LlamaForCausalLM's generation: greedy, "
                        "batch 1, prompt 5, 4 new tokens")
    found = re.fullmatch(r"grape\.generate: captured in (\d+\.\d\d) s: a step of (\d+) "
                         r"nodes, (\d+) on its longest path; the prompt inside the launch",
                         lines[1])
    assert found, lines[1]
    assert (int(found[2]), int(found[3])) == (stats.step_nodes, stats.step_depth)
    clear_cache(model)


def test_a_compiled_step_builds_its_mask_inside_the_compiled_function(cuda, caplog):
    # grape.torch.compiled_step: transformers' input preparation compiled with the forward, so
    # that the step holds none of the eager kernels that build its mask (torch.arange's among
    # them), and no decoder fell back to compiling the forward alone.
    import logging

    import grape
    from grape.ir import Kernel
    from grape.torch.api import _CACHES, clear_cache, last_stats

    model = _small_llama()
    ids = torch.randint(3, 500, (1, 5), generator=torch.Generator().manual_seed(0)).cuda()
    eager = grape.generate(model, ids, max_new_tokens=8, do_sample=False)
    eager_nodes = last_stats().step_nodes
    with caplog.at_level(logging.INFO, logger="grape"):
        compiled = grape.generate(model, ids, max_new_tokens=8, do_sample=False, compile=True)
    stats = last_stats()
    assert stats.graphed and stats.compiled and stats.step_nodes < eager_nodes
    assert "compiled alone" not in caplog.text
    entry = next(e for key, e in _CACHES[model].entries.items() if key[2])
    assert not entry.decoder._unprepared
    names = [op.name for _, op in entry.loop.capture.ir.ops() if isinstance(op, Kernel)]
    # (Inductor names its kernels after what they fuse, arange included: PyTorch's own only)
    assert not [n for n in names if "arange" in n and not n.startswith("triton")], names
    # its kernels differ from the eager ones by design: most tokens agree on this model
    assert (compiled[:, 5:] == eager[:, 5:]).float().mean() >= 0.75
    clear_cache(model)


def test_a_compiled_step_makes_its_one_row_biased_products_fused_reductions(cuda):
    # grape.torch.thin_matmuls: a decode step's one-row products with a bias (addmm, which
    # Inductor's own one-row decomposition leaves to GEMM templates) become Inductor
    # reductions fused with their neighbours. Side by side with the step compiled without
    # it, on an OPT (biased Linears): no GEMM left, fewer nodes, tokens that mostly agree
    # (the products add in another order, by design).
    import transformers

    import grape
    from grape.ir import Kernel
    from grape.torch.api import _CACHES, clear_cache, last_stats
    from grape.torch.compiled_step import CompiledStep

    config = transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                    num_attention_heads=4, vocab_size=500,
                                    word_embed_proj_dim=64)
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(config).cuda().eval()
    ids = torch.randint(3, 500, (1, 5), generator=torch.Generator().manual_seed(0)).cuda()
    built = {}
    for thin in (False, True):
        CompiledStep.thin_matmuls = thin
        try:
            out = grape.generate(model, ids, max_new_tokens=16, do_sample=False, compile=True)
        finally:
            CompiledStep.thin_matmuls = True
        stats = last_stats()
        assert stats.graphed and stats.compiled
        entry = next(e for key, e in _CACHES[model].entries.items() if key[2])
        names = [op.name for _, op in entry.loop.capture.ir.ops() if isinstance(op, Kernel)]
        gemms = [n for n in names if n.startswith(("triton_tem", "triton_mm")) or (any(
            s in n for s in ("gemm", "gemv", "nvjet")) and "fmha" not in n)]
        built[thin] = (stats.step_nodes, gemms, out)
        clear_cache(model)
    assert built[False][1] and built[True][1] == [], built
    assert built[True][0] < built[False][0], built
    assert (built[True][2][:, 5:] == built[False][2][:, 5:]).float().mean() >= 0.75


@pytest.mark.parametrize("beams", [1, 3])
def test_a_compiled_step_compiles_its_bookkeeping_into_fewer_kernels(cuda, caplog, beams):
    # CompiledStep.tail: the decoder's work after the forward (lengths, the token written,
    # finished rows or hypotheses, the beams' cache order, the running flag) under one
    # torch.compile. The same generation built with that work eager, side by side: fewer
    # nodes, the same tokens (the choice is outside the compiled bookkeeping).
    import logging

    import grape
    from grape.torch.api import clear_cache, last_stats
    from grape.torch.beam import BeamDecoder
    from grape.torch.compiled_step import divides_as_eager
    from grape.torch.decoding import TokenDecoder

    model = _small_llama()
    ids = torch.randint(3, 500, (2, 5), generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(max_new_tokens=8, do_sample=False, num_beams=beams, eos_token_id=7,
              pad_token_id=0, compile=True)
    built = {}
    for records_compiled in (False, True):
        for kind in (TokenDecoder, BeamDecoder):
            kind.records_compiled = records_compiled
        try:
            with caplog.at_level(logging.INFO, logger="grape"):
                out = grape.generate(model, ids, **kw)
        finally:
            for kind in (TokenDecoder, BeamDecoder):
                kind.records_compiled = True
        stats = last_stats()
        assert stats.graphed and stats.compiled
        built[records_compiled] = (stats.step_nodes, out)
        clear_cache(model)
    assert "bookkeeping did not compile" not in caplog.text
    if beams == 1 or divides_as_eager():
        assert built[True][0] < built[False][0], built
    else:  # (a torch whose Inductor divides otherwise keeps the beams' bookkeeping eager)
        assert built[True][0] == built[False][0], built
    assert torch.equal(built[True][1], built[False][1])


@pytest.mark.parametrize("new", [1, 2])
def test_one_or_two_new_tokens_are_graphed_as_generate_makes_them(cuda, new):
    # The build steps twice before its capture: buffers max_new_tokens long were indexed past
    # there (Options.room since 426690b; found on the CPU, where it raised IndexError).
    import grape
    from grape.torch.api import clear_cache, last_stats

    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=500)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).cuda().eval()
    ids = torch.randint(3, 500, (2, 8), device="cuda")
    for beams in (1, 3):
        kw = dict(max_new_tokens=new, do_sample=False, num_beams=beams, pad_token_id=0)
        got = grape.generate(model, ids, **kw)
        assert last_stats().graphed
        assert torch.equal(got, _static_reference(model, ids, **kw))
    torch.cuda.synchronize()  # the context is sound: no device-side assert was raised
    clear_cache(model)


def test_prompts_of_one_bucket_share_an_executable(cuda):
    # prompt_bucket=8: prompts of 13 and 15 tokens are both left-padded to 16 and run one
    # executable; each result starts with the caller's own prompt, and its tokens are
    # generate's for the padded prompt.
    import grape
    from grape.torch.api import bucketed, clear_cache, last_stats

    model = _small_llama()
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    captured = []
    for length in (13, 15):
        ids = torch.randint(3, 500, (2, length), device="cuda")
        out = grape.generate(model, ids, prompt_bucket=8, **kw)
        stats = last_stats()
        assert stats.graphed and stats.copy_bytes >= ids.numel() * 8
        captured.append(stats.captured)
        padded_ids, padded_mask, _ = bucketed(ids, None, 8, 0)
        want = model.generate(padded_ids, attention_mask=padded_mask, **kw)
        assert out.shape == (2, length + 6) and torch.equal(out[:, :length], ids)
        assert torch.equal(out[:, length:], want[:, 16:])
    assert captured == [True, False]
    clear_cache(model)


def test_a_forward_that_syncs_falls_back_to_generate_and_leaves_the_process_usable(cuda):
    import grape
    from grape.torch.api import last_stats

    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=500)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).cuda().eval()
    forward = model.forward

    def syncing(*args, **kwargs):  # reads a value back each step, as some forwards do
        out = forward(*args, **kwargs)
        if out.logits.sum().item() == float("inf"):
            raise AssertionError("unreachable")
        return out

    model.forward = syncing
    ids = torch.randint(3, 500, (1, 8), device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = grape.generate(model, ids, max_new_tokens=8)
    message = [str(w.message) for w in caught if "runs model.generate" in str(w.message)]
    assert len(message) == 1 and "synchronises with the host" in message[0]
    assert not last_stats().graphed and out.shape == (1, 16)
    assert not torch.cuda.is_current_stream_capturing()
    torch.randint(0, 10, (4,), device="cuda")  # the generator is out of capture mode


def test_a_model_that_adds_tokens_of_its_own_falls_back_and_leaves_the_context_usable(cuda):
    # CPM-Ant prepends a prompt of its own: written into grape's cache it landed past its
    # end, a device-side assert that ended the process's CUDA context (every H200 sweep's
    # cpmant row). Refused before the write now: the documented fallback, the GPU usable.
    import grape

    config = transformers.AutoConfig.for_model(
        "cpmant", hidden_size=64, num_hidden_layers=2, num_attention_heads=2, dim_head=32,
        dim_ff=128, prompt_length=32, vocab_size=300)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).cuda().eval()
    ids = torch.randint(3, 300, (1, 16), device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            grape.generate(model, ids, max_new_tokens=8)
        except Exception as e:  # generate's own refusal of this model is not grape's concern
            assert "CUDA" not in str(e), e
    message = [str(w.message) for w in caught if "runs model.generate" in str(w.message)]
    assert len(message) == 1 and "wrote 48 tokens to the cache for the 16" in message[0]
    torch.cuda.synchronize()  # no device-side assert pending
    assert torch.arange(4, device="cuda").sum().item() == 6


def _small_seq2seq(model_type, **sizes):
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=300, bos_token_id=1, eos_token_id=2, pad_token_id=0, **sizes)
    torch.manual_seed(0)
    return transformers.AutoModelForSeq2SeqLM.from_config(config).cuda().eval()


def _one_launch_per_call(model, sources, mask, per_call=None, **kwargs):
    """Each source (of one shape) generated as one launch with generate's tokens (static
    cache), the first call capturing, the later ones re-pointed, with no fallback;
    ``per_call``: each call's own further arguments (of one shape too). Returns each call's
    ``last_stats()``."""
    import grape
    from grape.torch.api import last_stats

    stats = []
    for call, (source, own) in enumerate(zip(sources, per_call or [{}] * len(sources),
                                             strict=True)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            out = grape.generate(model, source, mask, **own, **kwargs)
        stats.append(last_stats())
        assert stats[-1].graphed and stats[-1].launches == 1 and stats[-1].prefill_graphed
        assert stats[-1].captured == (call == 0)
        reference = _static_reference(model, source, attention_mask=mask, **own, **kwargs)
        assert torch.equal(out, reference), call
    return stats


@pytest.mark.parametrize("beams", [1, 4])
def test_an_encoder_decoder_generation_is_one_launch_with_generates_tokens(cuda, beams):
    # T5 (relative position bias, a cross-attention cache written once by the prompt): the
    # encoder and the decoder's first token inside the launch, then the device loop; a second
    # source of the same shape re-points the launch and pays no capture. fp32, so that the
    # comparison with generate's static cache does not hang on fp16 near-ties. Between the
    # calls generate compiles its step with CUDA graphs, which clear cuBLAS's workspaces: the
    # second launch crashed on the H200 until grape kept its own (grape.torch.workspace).
    model = _small_seq2seq("t5", d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                           decoder_start_token_id=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (3, 12), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    _one_launch_per_call(model, [ids, ids.roll(1, dims=1)], mask, max_new_tokens=16,
                         num_beams=beams)


@pytest.mark.parametrize("beams", [1, 4])
def test_a_speech_model_generation_is_one_launch_with_generates_tokens(cuda, beams):
    # Speech2Text: the encoder over filterbank features (its convolutions shorten them 4x,
    # which sizes the cross-attention cache) inside the launch, a clip padded at its end.
    config = transformers.AutoConfig.for_model(
        "speech_to_text", vocab_size=300, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        input_feat_per_channel=16, max_source_positions=200, max_target_positions=64,
        conv_channels=32, decoder_start_token_id=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForSpeechSeq2Seq.from_config(config).cuda().eval()
    features = torch.randn(3, 40, 16, generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones(features.shape[:2], dtype=torch.long, device="cuda")
    mask[1, 30:] = 0
    _one_launch_per_call(model, [features, features.roll(1, dims=1)], mask,
                         max_new_tokens=16, num_beams=beams)


@pytest.mark.parametrize("beams", [1, 4])
def test_a_prompt_of_embeddings_is_read_where_it_lies_inside_the_launch(cuda, beams):
    # generate(inputs_embeds=...): the cache's prompt is the embeddings (cloned by the model's
    # input preparation, a kernel inside the launch), the result the new tokens alone; a
    # second call's embeddings, elsewhere, re-point the launch. fp32, as for T5 above.
    model = _small_llama().float()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (3, 12), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    calls = [{"inputs_embeds": embeds}, {"inputs_embeds": embeds.flip(0) * 1.5}]
    stats = _one_launch_per_call(model, [None, None], mask, calls, max_new_tokens=16,
                                 num_beams=beams)
    assert stats[1].pointer_updates > 0


@pytest.mark.parametrize("beams", [1, 4])
def test_a_vision_language_models_images_are_read_where_they_lie_by_the_prompt(cuda, beams):
    # LLaVA: pixel_values go to the prompt alone (the vision tower and the projector inside
    # the launch's prefill); a second call's images, elsewhere, re-point it. fp32.
    from tests.test_torch_generation import _llava

    model, ids, mask, pixels = _llava()
    model, ids, mask, pixels = model.cuda(), ids.cuda(), mask.cuda(), pixels.cuda()
    stats = _one_launch_per_call(model, [ids, ids], mask,
                                 [{"pixel_values": pixels}, {"pixel_values": pixels.flip(0)}],
                                 max_new_tokens=16, num_beams=beams)
    assert stats[1].pointer_updates > 0


@pytest.mark.parametrize("beams", [1, 3])
def test_token_types_are_extended_inside_the_launch(cuda, beams):
    # generate gives each new token the prompt's last token type (GPT-2 embeds the types with
    # its token table): a column on the device the captured steps read. fp32.
    from tests.test_torch_generation import CONFIGS, _built, _prompt

    model = _built("gpt2", CONFIGS["gpt2"]).cuda()
    ids, mask = (t.cuda() for t in _prompt())
    types = torch.zeros_like(ids)
    types[0, -3:] = 5
    types[2, -1] = 9
    _one_launch_per_call(model, [ids, ids], mask,
                         [{"token_type_ids": types}, {"token_type_ids": types.flip(0)}],
                         max_new_tokens=12, num_beams=beams)


@pytest.mark.parametrize("beams", [1, 4])
def test_whispers_own_generate_runs_its_generic_loop_as_one_launch(cuda, beams):
    # Whisper's generate builds the decoder's prompt (start, language, task, no-timestamps
    # tokens), passes its token suppression as processor objects, and strips the prompt from
    # what it returns; its call of GenerationMixin.generate is grape's launch
    # (grape.torch.own_generate). A second clip re-points the launch; a clip whose language
    # Whisper detects (an eager forward of its own) gets a prompt of another length.
    from tests.test_torch_own_generate import _whisper

    model, features = _whisper()
    model = model.cuda()
    features = features.cuda()
    stats = _one_launch_per_call(model, [features, features.roll(1, dims=2)], None,
                                 max_new_tokens=12, num_beams=beams, language="en")
    # grape's result read back, the decoder prompt's start checked, the two suppression
    # objects' token lists read
    assert [s.host_syncs for s in stats] == [4, 4]
    assert stats[1].pointer_updates > 0 and stats[1].copy_bytes == 0
    _one_launch_per_call(model, [features.flip(0)], None, max_new_tokens=12, num_beams=beams)


def test_whispers_timestamped_long_form_is_a_launch_per_window(cuda):
    # return_timestamps=True over three windows of audio: Whisper's timestamp rules inside
    # each launch (grape.torch.decoding's, held bit for bit to its processor on the CPU), a
    # launch per window Whisper decides on, each window's whole-audio mask taken as it is;
    # audio of two lengths (the longer row's last window decoded alone, beside the batch's
    # mask); no-speech detection skipping every window (its probabilities recorded beside the
    # launch by the model's own forward, as its processor records them).
    import grape
    from grape.torch.api import last_stats
    from tests.test_torch_own_generate import _whisper

    model, features = _whisper(boost=(320,))
    model, features = model.cuda(), features.cuda()
    audio = torch.cat([features, features.flip(2), features.roll(7, dims=2)], dim=2)
    mask = torch.ones(2, 300, dtype=torch.long, device="cuda")
    short = mask.clone()
    short[1, 60:] = 0
    silence = dict(no_speech_threshold=0.0, logprob_threshold=0.0, temperature=0.0)
    kwargs = dict(language="en", return_timestamps=True, max_new_tokens=10)
    for source, extra in ((features, {}), (audio, {"attention_mask": mask}),
                          (audio, {"attention_mask": short}),
                          (audio, {"attention_mask": mask, **silence})):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            out = grape.generate(model, source, **extra, **kwargs)
        stats = last_stats()
        reference = _static_reference(model, source, **extra, **kwargs)
        assert torch.equal(out, reference)
        # (a window is at most 100 frames of the 300: two calls at least, as on the CPU)
        assert stats.graphed and (stats.launches >= 2 if source is audio
                                  else stats.launches == 1)
        if "no_speech_threshold" in extra:
            assert out.shape[1] == 0  # every window skipped, as under generate


@pytest.mark.parametrize("beams", [1, 4])
def test_a_decoder_prompt_is_read_where_it_lies_inside_the_launch(cuda, beams):
    # BART (learned positions, decoder start token 2) continuing decoder prompts of 3 tokens:
    # with its start token (read where it lies), without it (generate's rule puts it before
    # them: a copy, after one read-back), left-padded under a decoder mask. One executable for
    # the three calls, its prefill re-pointed at each call's tensors.
    model = _small_seq2seq("bart", d_model=64, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=128, decoder_ffn_dim=128, decoder_start_token_id=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (3, 12), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    bare = torch.randint(3, 300, (3, 3), generator=g).cuda()
    started = torch.cat([torch.full((3, 1), 2, device="cuda"), bare.flip(1)], dim=1)
    padded = torch.ones((3, 4), dtype=torch.long, device="cuda")
    padded[1, 1] = 0
    calls = [{"decoder_input_ids": started.flip(0)},
             {"decoder_input_ids": bare},
             {"decoder_input_ids": started, "decoder_attention_mask": padded}]
    # The third call's prompt gives a mask: another executable (its tensors are other ones).
    stats = _one_launch_per_call(model, [ids, ids.roll(1, dims=1)], mask, calls[:2],
                                 max_new_tokens=16, num_beams=beams)
    # (both copy the source's mask into the running one)
    assert stats[1].copy_bytes - stats[0].copy_bytes == bare.numel() * 8
    assert [s.host_syncs for s in stats] == [2, 2]
    _one_launch_per_call(model, [ids], mask, calls[2:], max_new_tokens=16, num_beams=beams)


_PROCESSORS = dict(eos_token_id=[5, 7, 11], sequence_bias=[[[40], 1.5], [[41, 42], -2.0]],
                   encoder_repetition_penalty=1.3, remove_invalid_values=True,
                   exponential_decay_length_penalty=(4, 1.5), renormalize_logits=True)


def _left_padded_pair():
    """Two 9-token prompts over a 300-token vocabulary on the GPU, the first left-padded by 3."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (2, 9), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask


@pytest.mark.parametrize("kwargs", [
    {"num_beams": 4, "num_return_sequences": 3, "eos_token_id": [5, 7, 11]},
    {"do_sample": True, "top_k": 1, "num_return_sequences": 2, "eos_token_id": [5, 7, 11]},
    {"do_sample": True, "top_k": 1, "min_p": 0.5, "typical_p": 0.9, "epsilon_cutoff": 1e-4,
     "eta_cutoff": 0.5, "eos_token_id": [5, 7, 11]},
    dict(_PROCESSORS, num_beams=1), dict(_PROCESSORS, num_beams=3)])
def test_generates_options_run_inside_the_launch(cuda, kwargs):
    # num_return_sequences: a beam search's three best beams of four; two samples per prompt
    # (top_k=1: one token to draw, so generate's tokens), each prompt's rows expanded inside
    # the launch. Sampling's other cutoffs (eta_cutoff's entropy without torch.distributions'
    # check, which reads back). Sequence biases (one token, and two after their prefix), the
    # prompt's tokens favoured, invalid values removed, EOS raised by a decaying length
    # penalty, scores renormalised. Each captured, generate's tokens.
    model = _small_llama()
    ids, mask = _left_padded_pair()
    _one_launch_per_call(model, [ids, ids.roll(1, dims=1)], mask, max_new_tokens=12, **kwargs)


_SEQ2SEQ_SIZES = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                     decoder_start_token_id=2)


@pytest.mark.parametrize("model_type", ["roformer", "xglm", "mvp", "m2m_100"])
def test_positions_made_from_the_cache_length_are_captured(cuda, model_type):
    # Their positions are torch.arange over the cache's length, or a sinusoidal table's size
    # test of it: read back to the host until grape.torch.cache_length; they fell back on the
    # H200 (arch_sweep, 2026-12-05). Now one launch a call, generate's tokens.
    if model_type in ("mvp", "m2m_100"):
        model = _small_seq2seq(model_type, **_SEQ2SEQ_SIZES)
    else:
        sizes = ({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "is_decoder": True} if model_type == "roformer"
                 else {"d_model": 64, "ffn_dim": 128, "num_layers": 2, "attention_heads": 4})
        config = transformers.AutoConfig.for_model(model_type, vocab_size=300,
                                                   bos_token_id=1, eos_token_id=2,
                                                   pad_token_id=0, **sizes)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).cuda().eval()
    ids, mask = _left_padded_pair()
    _one_launch_per_call(model, [ids, ids.roll(1, dims=1)], mask, max_new_tokens=12)


@pytest.mark.parametrize("model_type", ["mistral", "gemma2", "gemma3_text"])
@pytest.mark.parametrize("beams", [1, 3])
def test_a_sliding_window_shorter_than_the_generation_is_one_launch(cuda, model_type, beams):
    # A window of 6 tokens under a 9-token prompt and 12 new ones: transformers rolls it by a
    # count on the host, which a capture would freeze, so grape fell back to generate until
    # grape.torch.static_layers.CountedSlidingLayer decided the roll and the mask's offset on
    # the device. (Gemma 2's own window is 4,096 tokens, Gemma 3's 512 to 1,024, GPT-OSS's 128,
    # which its experts' grouped GEMM runs in bf16 alone: in benchmarks/arch_sweep.py.)
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=300, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).cuda().eval()
    ids, mask = _left_padded_pair()
    _one_launch_per_call(model, [ids, ids.roll(1, dims=1)], mask, max_new_tokens=12,
                         num_beams=beams, do_sample=False)

def test_stop_strings_end_rows_inside_the_launch(cuda):
    # A stop string from the first row's own text ends that row inside the one launch (the
    # tokenizer's table of token texts moved to the GPU before the capture).
    import grape
    from grape.torch.api import last_stats
    from tests.word_tokenizer import word_tokenizer

    model = _small_llama()
    tokenizer = word_tokenizer(500)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (2, 9), generator=g).cuda()
    # An EOS id (one the rows do not make here): without one generate leaves a stopped row's
    # later tokens as the model made them, not padded (it pads only beside an EOS criterion).
    ends = dict(eos_token_id=499, pad_token_id=0)
    free = grape.generate(model, ids, max_new_tokens=12, **ends)  # 12 tokens each
    # (the tokens' own strings, as StopStringCriteria matches them)
    text = "".join(tokenizer.convert_ids_to_tokens(free[0, 9 + 4:9 + 6].tolist()))
    kwargs = dict(max_new_tokens=12, **ends, stop_strings=[text[1:]], tokenizer=tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        out = grape.generate(model, ids, **kwargs)
    assert last_stats().graphed and last_stats().launches == 1
    assert torch.equal(out, _static_reference(model, ids, **kwargs))
    assert not torch.equal(out[0], free[0, :out.shape[1]])


@pytest.mark.parametrize("batch", [1, 3])
def test_a_streamer_follows_the_launch_token_by_token(cuda, batch):
    # The streamer is handed what generate hands it (the prompt, each step's tokens, end),
    # while the one launch runs: the host copies the token count and tokens from a side
    # stream (grape.torch.streaming), so the generation still reads back once. A second call
    # streams through the same executable.
    import grape
    from grape.torch.api import last_stats
    from tests.test_torch_streaming import Recording

    model = _small_llama()
    ids = torch.randint(3, 300, (batch, 9), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(max_new_tokens=300, eos_token_id=None)
    theirs = Recording()
    reference = _static_reference(model, ids, attention_mask=mask, streamer=theirs, **kwargs)
    for call in range(2):
        ours = Recording()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            out = grape.generate(model, ids, mask, streamer=ours, **kwargs)
        stats = last_stats()
        assert stats.graphed and stats.launches == 1 and stats.host_syncs == 1
        assert stats.captured == (call == 0)
        assert torch.equal(out, reference)
        assert ours.calls == theirs.calls
        # most tokens reached the streamer before the launch had ended
        assert stats.streamed_while_running > 150, stats.streamed_while_running


def test_a_streamer_hears_only_the_loop_whose_tokens_stand(cuda):
    # Exact lengths (chosen by grape from 1,024 tokens on) over a mask with a zero after a
    # one: the launch is found unusable only after it, and the loop over the whole cache runs
    # instead. The streamer hears each of the second loop's tokens once, nothing of the first.
    import grape
    from tests.test_torch_streaming import Recording

    model = _small_llama().half()
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # right padding
    ours = Recording()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        out = grape.generate(model, ids, mask, streamer=ours, max_new_tokens=1100,
                             eos_token_id=None)
    assert out.shape == (2, 9 + 1100)
    assert ours.calls[0] == ("put", ids.tolist()) and ours.calls[-1] == ("end",)
    streamed = torch.tensor([values for _, values in ours.calls[1:-1]]).T
    assert torch.equal(streamed, out[:, 9:].cpu())


def test_one_executable_samples_at_every_temperature_and_top_p(cuda):
    # Sampling's temperature and top-p are read from the device (grape.torch.warpers): on CUDA
    # generate's warpers bit for bit (PyTorch divides by a host scalar as a multiplication by
    # its float32 reciprocal there, which grape's multiplies by). Calls at three temperatures
    # and top-p values share the first call's executable, and each samples what an executable
    # captured for its own values samples.
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    import grape
    from grape.torch.api import clear_cache, last_stats
    from grape.torch.warpers import DeviceTemperature, DeviceTopP

    scores = torch.randn(4, 3000, generator=torch.Generator().manual_seed(0)).cuda() * 4
    scores[0, :50] = -float("inf")
    for t in (0.05, 0.2, 0.7, 1.0, 1.3, 3.7):
        assert torch.equal(DeviceTemperature(t, scores.device)(None, scores),
                           TemperatureLogitsWarper(t)(None, scores)), t
    for p in (0.01, 0.3, 0.5, 0.9, 0.999):
        assert torch.equal(DeviceTopP(p, scores.device)(None, scores),
                           TopPLogitsWarper(p)(None, scores)), p
    model = _small_llama()
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    values = [(0.6, 0.8), (1.9, 0.4), (1.0, 0.95)]
    shared = []
    for call, (t, p) in enumerate(values):
        out = grape.generate(model, ids, mask, seed=5, max_new_tokens=16, do_sample=True,
                             temperature=t, top_p=p, top_k=0)
        assert last_stats().graphed and last_stats().captured == (call == 0)
        shared.append(out)
    assert len({tuple(o.flatten().tolist()) for o in shared}) == 3
    for (t, p), out in zip(values, shared, strict=True):
        clear_cache(model)
        own = grape.generate(model, ids, mask, seed=5, max_new_tokens=16, do_sample=True,
                             temperature=t, top_p=p, top_k=0)
        assert last_stats().captured and torch.equal(own, out), (t, p)


def test_the_candidates_sampler_keeps_generates_survivors_ties_and_all(cuda):
    # grape.torch.sampling: top-p over top-k's candidates gives generate's survivors, where
    # generate's CUDA sort of the vocabulary orders tied scores by index (a sort of more than
    # 4,096 on CUB's segmented sort, below on a block's radix sort): rows rounded to bfloat16
    # or to a few levels, and ties built to straddle the top-p cut, at both sizes.
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from grape.torch.sampling import CandidateSampler
    from grape.torch.warpers import DeviceTemperature, DeviceTopP

    g = torch.Generator(device="cuda").manual_seed(0)
    compared = straddled = 0
    for vocab in (4000, 32000):
        for top_k, top_p in ((50, 0.9), (5, 0.6), (20, 0.5)):
            sampler = CandidateSampler(DeviceTemperature(1.0, "cuda"), top_k,
                                       DeviceTopP(top_p, "cuda"))
            for levels in (None, 64, 8, 2):
                logits = torch.randn((32, vocab), generator=g, device="cuda")
                logits = (logits.bfloat16().float() if levels is None
                          else torch.round(logits * levels / 4) * 4 / levels)
                _, index, kept, overflowed = sampler.candidates(logits)
                ours = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, index, kept)
                theirs = torch.isfinite(TopPLogitsWarper(top_p)(
                    None, TopKLogitsWarper(top_k)(None, logits)))
                fits = ~overflowed
                assert torch.equal(ours[fits], theirs[fits]), (vocab, top_k, top_p, levels)
                compared += int(fits.sum())
        # four tokens of one score across the cut: generate keeps the higher indices
        logits = torch.full((1, vocab), -5.0, device="cuda")
        logits[0, [10, 400, 1700, 3900]] = 1.0
        logits[0, 5] = 2.0
        sampler = CandidateSampler(DeviceTemperature(1.0, "cuda"), 5, DeviceTopP(0.6, "cuda"))
        _, index, kept, _ = sampler.candidates(logits)
        ours = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, index, kept)
        theirs = torch.isfinite(TopPLogitsWarper(0.6)(None, TopKLogitsWarper(5)(None, logits)))
        assert torch.equal(ours, theirs), vocab
        straddled += 0 < int(theirs[0, [10, 400, 1700, 3900]].sum()) < 4
    assert compared >= 300 and straddled == 2


def test_a_generation_whose_ties_outnumber_the_candidates_is_made_again_as_the_host_loop_does(
        cuda):
    import grape
    from grape.torch.api import last_stats
    from grape.torch.host_loop import generate_on_host

    model = _small_llama()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every score alike: all tie with the k-th
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0)).cuda()
    kwargs = dict(max_new_tokens=12, do_sample=True, top_k=10, top_p=0.9)
    out = grape.generate(model, ids, seed=7, **kwargs)
    stats = last_stats()
    assert stats.graphed and stats.resampled and stats.launches == 2 and stats.host_syncs == 2
    assert torch.equal(out, generate_on_host(model, ids, seed=7, **kwargs))
    # a model whose scores do not tie: one launch, over the candidates
    model = _small_llama()
    out = grape.generate(model, ids, seed=7, **kwargs)
    stats = last_stats()
    assert stats.graphed and not stats.resampled and stats.launches == 1
    assert torch.equal(out, generate_on_host(model, ids, seed=7, **kwargs))


def test_threads_generating_with_one_model_each_get_their_own_tokens(cuda):
    # A server's threads share the model, and so its executables and the decoder's buffers:
    # grape runs one generation at a time per model, so that a call of the same shape on
    # another thread cannot overwrite a generation in flight.
    import threading

    import grape
    from grape.torch.api import last_stats

    model = _small_llama()
    prompts = [torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(i)).cuda()
               for i in range(4)]
    kwargs = dict(max_new_tokens=64, eos_token_id=None)
    alone = [grape.generate(model, ids, **kwargs) for ids in prompts]
    found, errors = {}, []

    def worker(i):
        try:
            for _ in range(10):
                out = grape.generate(model, prompts[i], **kwargs)
                assert last_stats().graphed and not last_stats().captured
                found.setdefault(i, []).append(torch.equal(out, alone[i]))
        except Exception as e:  # (a thread's failure, reported below)
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert {i: all(v) for i, v in found.items()} == dict.fromkeys(range(4), True)


def test_a_model_that_reads_cache_positions_it_never_wrote_falls_back(cuda):
    # FSMT attends over the static cache's unused tail (its causal mask spans the tokens it is
    # given): found before capture, the documented fallback, the GPU usable after.
    import grape

    model = _small_seq2seq("fsmt", d_model=64, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=128, decoder_ffn_dim=128, src_vocab_size=300,
                           tgt_vocab_size=300, langs=["en", "de"], decoder_start_token_id=2)
    ids = torch.randint(3, 300, (2, 10), device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = grape.generate(model, ids, max_new_tokens=6, num_beams=1)
    message = [str(w.message) for w in caught if "runs model.generate" in str(w.message)]
    assert len(message) == 1 and "reads cache positions it has not written" in message[0]
    assert torch.equal(out, model.generate(ids, max_new_tokens=6, num_beams=1))
    torch.cuda.synchronize()
    assert torch.arange(4, device="cuda").sum().item() == 6


def test_a_graphed_callable_reads_its_inputs_where_they_lie(cuda):
    import grape

    table = torch.randn(1000, 64, device="cuda")

    def embed(ids, scale):
        return torch.nn.functional.embedding(ids, table) * scale + 1

    f = grape.graphed(embed)
    scale = torch.tensor(2.0, device="cuda")
    for i in range(6):
        ids = torch.randint(0, 1000, (4, 16), device="cuda")
        if i == 3:  # a tensor at another address: the nodes reading it are re-pointed
            ids = torch.empty(1 << 20, dtype=torch.long, device="cuda")[:64].view(4, 16)
            ids.random_(0, 1000)
        got = f(ids, scale)
        torch.testing.assert_close(got, embed(ids, scale), rtol=0, atol=0)
    assert f.stats.captures == 1 and f.stats.calls == 6 and f.stats.copy_bytes == 0
    assert f.stats.pointer_updates >= 1
    # An output kept from one call is the graph's own: the next call of that shape rewrites it.
    kept = f(ids, scale)
    other = torch.randint(0, 1000, (4, 16), device="cuda")
    f(other, scale)
    torch.testing.assert_close(kept, embed(other, scale), rtol=0, atol=0)
    with pytest.raises(GrapeError, match="expected CUDA tensors"):
        f(ids.cpu(), scale)
    f.close()


def _graph_replay(fn, x):
    """``fn(x)`` as PyTorch's own graph of it computes it, captured as grape.graphed captures:
    a Hugging Face model given no mask attends without one (grape.torch.hfmasks; PyTorch's
    capture alone builds a full mask and runs other kernels, which is why graphs used to differ
    from eager). A graph is compared bitwise with a graph, and with eager within tolerance
    (benchmarks/graphed.py found grape's outputs bitwise equal to eager's since e5a6a78, for
    BERT-base and Wav2Vec2-base at every length; not asserted here yet)."""
    from grape.torch.hfmasks import no_padding_shortcut

    static = x.clone()
    fn(static)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), no_padding_shortcut():
        out = fn(static)
    g.replay()
    return out.clone()


def test_a_graphed_encoder_over_variable_lengths_shares_executables_and_matches_eager(cuda):
    import grape

    config = transformers.BertConfig(hidden_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=256)
    torch.manual_seed(0)
    bert = transformers.BertModel(config).cuda().half().eval()

    @torch.no_grad()
    def encode(ids):
        return bert(ids).last_hidden_state

    def ids_of(length):
        return torch.randint(0, config.vocab_size, (2, length), device="cuda")

    f = grape.graphed(encode, params=dict(bert.named_parameters()), shapes=[(ids_of(48),)])
    assert f.stats.captures == 1 and f.stats.calls == 0
    for length in (16, 48, 16, 33, 48, 33, 16, 48):
        ids = ids_of(length)
        got = f(ids).clone()
        torch.testing.assert_close(got, _graph_replay(encode, ids), rtol=0, atol=0)
        torch.testing.assert_close(got, encode(ids), rtol=2e-3, atol=2e-3)
    # Three signatures of one topology: one executable, brought to each by node updates.
    assert f.stats.captures == 3 and f.signatures == 3
    assert f.executables == 1 and f.stats.switches == 8 and f.stats.copy_bytes == 0
    f.close()


def test_a_graphed_speech_model_over_audio_lengths_matches_eager(cuda):
    import grape

    config = transformers.Wav2Vec2Config(hidden_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=256)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(config).cuda().half().eval()

    @torch.no_grad()
    def hear(audio):
        return model(audio).last_hidden_state

    lengths = (16000, 23999, 16000, 40000, 23999, 40000)
    f = grape.graphed(hear)
    for n in lengths:
        audio = torch.randn(1, n, device="cuda", dtype=torch.half)
        got = f(audio).clone()
        torch.testing.assert_close(got, _graph_replay(hear, audio), rtol=0, atol=0)
        torch.testing.assert_close(got, hear(audio), rtol=2e-3, atol=2e-3)
    assert f.stats.captures == 3 and 1 <= f.executables <= 3
    f.close()


def test_a_concurrent_graphed_encoder_and_speech_model_compute_the_chain_s_bits(cuda, caplog):
    """concurrent=True runs the same kernels in an order their memory allows: the same bits as
    the chain, every signature's longest path shorter than its nodes. Each capture is reported
    on the ``grape`` logger."""
    import logging

    import grape

    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256)).cuda().half().eval()
    speech = transformers.Wav2Vec2Model(transformers.Wav2Vec2Config(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256)).cuda().half().eval()

    @torch.no_grad()
    def encode(ids):
        return bert(ids).last_hidden_state

    @torch.no_grad()
    def hear(audio):
        return speech(audio).last_hidden_state

    cases = [(encode, [torch.randint(0, 30000, (2, n), device="cuda") for n in (48, 16, 33, 16)]),
             (hear, [torch.randn(1, n, device="cuda", dtype=torch.half)
                     for n in (40000, 16000, 23999, 40000)])]
    for fn, inputs in cases:
        chain, dag = grape.graphed(fn), grape.graphed(fn, concurrent=True)
        with caplog.at_level(logging.INFO, logger="grape"):
            for x in inputs:
                torch.testing.assert_close(dag(x).clone(), chain(x).clone(), rtol=0, atol=0)
        lines = [r.getMessage() for r in caplog.records if r.name == "grape"]
        caplog.clear()
        assert len(lines) == 6 and all(
            line.startswith(f"grape.graphed: signature {i // 2 + 1} of {fn.__name__}")
            for i, line in enumerate(lines)), lines  # three signatures, chain and DAG
        assert dag.stats.captures == 3 and dag.stats.copy_bytes == 0
        assert all(depth < nodes for nodes, depth in dag.paths), dag.paths
        assert all(depth == nodes for nodes, depth in chain.paths)
        chain.close()
        dag.close()


@pytest.mark.parametrize("concurrent", [False, True])
def test_an_output_passed_back_in_is_read_as_it_was(cuda, concurrent):
    """``fn(x)`` writes its first output while a later kernel still reads ``x``: called on its
    own earlier output, that output's memory is copied first (warned), since the launch
    rewrites it; without the copy the second result would read the first's new values."""
    import grape

    def fn(x):
        return x + 1, x * 2

    f = grape.graphed(fn, concurrent=concurrent)
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    first, _ = f(x)
    passed = first.clone()
    with pytest.warns(UserWarning, match="an argument lies in the memory of an output"):
        plus, times = f(first)
    torch.testing.assert_close(plus, passed + 1, rtol=0, atol=0)
    torch.testing.assert_close(times, passed * 2, rtol=0, atol=0)
    assert f.stats.captures == 1 and f.stats.copy_bytes == first.untyped_storage().nbytes()
    f.close()

    def bump(x):  # in place: its result is its argument, not memory of the graph's
        return x.add_(1)

    g = grape.graphed(bump, warmup=0, concurrent=concurrent)
    x = torch.zeros(8, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            assert g(x) is not None
    assert x.tolist() == [3.0] * 8 and g.stats.copy_bytes == 0
    g.close()


def test_a_graphed_callable_whose_outputs_need_gradients_is_refused(cuda):
    import grape

    w = torch.randn(8, device="cuda", requires_grad=True)
    f = grape.graphed(lambda x: w * x)
    with pytest.raises(GrapeError, match="expected outputs that need no gradient .* found one "
                                         "made by MulBackward0: call it under torch.no_grad"):
        f(torch.randn(8, device="cuda"))
    assert f.signatures == 0 and f.stats.captures == 0
    with torch.no_grad():
        x = torch.randn(8, device="cuda")
        torch.testing.assert_close(f(x), w * x, rtol=0, atol=0)
    f.close()


def test_a_graphed_callable_takes_keyword_and_nested_tensor_arguments(cuda):
    import grape

    def f(x, *, pair, mask=None):
        return x * pair[0] + pair[1] + (0 if mask is None else mask)

    g = grape.graphed(f)
    x = torch.randn(8, device="cuda")
    pair = (torch.randn(8, device="cuda"), torch.randn(8, device="cuda"))
    for _ in range(3):
        torch.testing.assert_close(g(x, pair=pair), f(x, pair=pair), rtol=0, atol=0)
    mask = torch.ones(8, device="cuda")
    torch.testing.assert_close(g(x, pair=pair, mask=mask), f(x, pair=pair, mask=mask), rtol=0,
                               atol=0)
    assert g.stats.captures == 2 and g.stats.copy_bytes == 0
    g.close()


def _compiled_both_ways(model, ids, switch, record):
    """``record(out, stats, entry)`` of ``grape.generate(compile=True)`` over ``ids`` (16 new
    tokens, greedy) with ``CompiledStep``'s ``switch`` off, then on (put back after each),
    each graphed and compiled, ``entry`` its executable, let go after ``record``:
    ``{False: ..., True: ...}``."""
    import grape
    from grape.torch.api import _CACHES, clear_cache, last_stats
    from grape.torch.compiled_step import CompiledStep

    default, built = getattr(CompiledStep, switch), {}
    for on in (False, True):
        setattr(CompiledStep, switch, on)
        try:
            out = grape.generate(model, ids, max_new_tokens=16, do_sample=False, compile=True)
        finally:
            setattr(CompiledStep, switch, default)
        stats = last_stats()
        assert stats.graphed and stats.compiled
        entry = next(e for key, e in _CACHES[model].entries.items() if key[2])
        built[on] = record(out, stats, entry)
        clear_cache(model)
    return built


def test_a_compiled_step_launched_dependently_keeps_its_programmatic_edges(cuda):
    # CompiledStep.dependent_launch: on Hopper and later, Inductor launches its Triton kernels
    # dependently (PDL); captured, those launches are programmatic edges, which grape's IR
    # keeps and its device loop builds. Side by side with the step compiled without: the same
    # nodes, edges made programmatic only with the switch, tokens that mostly agree (each
    # compilation tunes its own kernels).
    from grape.torch.compiled_step import launches_dependently

    if not launches_dependently():
        pytest.skip("this torch's Inductor has no programmatic dependent launch")
    model = _small_llama()
    ids = torch.randint(3, 500, (1, 5), generator=torch.Generator().manual_seed(0)).cuda()

    def record(out, stats, entry):
        edges = [k for *_, k in entry.loop.capture.ir.edges() if k == "programmatic"]
        # (built: those out of kernels launched dependently, grape.passes.dependent_launch)
        assert 0 <= stats.dependent_edges < len(edges) or stats.dependent_edges == len(edges) == 0
        return stats.step_nodes, len(edges), out

    built = _compiled_both_ways(model, ids, "dependent_launch", record)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert built[False][1] == 0 and (built[True][1] > 0) == hopper, built
    assert built[True][0] == built[False][0], built
    assert (built[True][2][:, 5:] == built[False][2][:, 5:]).float().mean() >= 0.75


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("switch", ["row_statistics", "factored_statistics"])
def test_a_compiled_step_reducing_its_rows_statistics_per_product_holds_fewer_kernels(
        cuda, switch, arch):
    # CompiledStep.row_statistics and .factored_statistics (grape.torch.row_statistics): each
    # one-row product whose row a norm made reduces the norm's statistic again per output
    # (before its dot products, or beside them, the statistic factored out as a scale), so
    # that Inductor fuses it into the product's kernel and the norm's kernel of one block
    # goes. Side by side with the step compiled without: fewer nodes in the step, tokens that
    # mostly agree (the statistic summed in another order, by design). A GPT-2's normalised
    # products (Conv1D's, relaid) are addmm, which reach grape's pass on a GPU as they are
    # (GPT-2 small: 130 nodes, 108 factored, H100). A Llama's are bias-free mm, which
    # Inductor decomposes on a GPU before the pass (thin_matmuls._rewrite_decomposed_mm
    # matches that form; before it, a small Llama's step held 28 nodes with either switch).
    model = {"gpt2": _small_gpt2, "llama": _small_llama}[arch]()
    ids = torch.randint(3, 500, (1, 5), generator=torch.Generator().manual_seed(0)).cuda()
    built = _compiled_both_ways(model, ids, switch,
                                lambda out, stats, entry: (stats.step_nodes, out))
    assert built[True][0] < built[False][0], built
    assert (built[True][1][:, 5:] == built[False][1][:, 5:]).float().mean() >= 0.75


def test_a_compiled_step_stacks_a_layers_query_key_and_value_as_one_product(cuda):
    # grape.torch.sibling_products: a model with fewer key heads than query heads multiplies
    # each layer's row by weights of two sizes, which Inductor does not fuse; the step reads
    # them as one product by a copy of the three weights stacked. Side by side with the step
    # compiled without: the copies' bytes counted, no more nodes, tokens that mostly agree
    # (other kernels, by design).
    model = _small_llama()
    attention = [layer.self_attn for layer in model.model.layers]
    ids = torch.randint(3, 500, (1, 5), generator=torch.Generator().manual_seed(0)).cuda()

    def record(out, stats, entry):
        return stats.step_nodes, stats.weight_copy_bytes, out

    built = _compiled_both_ways(model, ids, "sibling_products", record)
    assert built[False][1] == 0, built
    assert built[True][1] == sum(p.weight.nbytes for a in attention
                                 for p in (a.q_proj, a.k_proj, a.v_proj)), built
    assert built[True][0] <= built[False][0], built
    assert (built[True][2][:, 5:] == built[False][2][:, 5:]).float().mean() >= 0.75


def test_a_compiled_step_attends_with_grouped_queries_without_copying_keys(cuda):
    # grape.torch.grouped_queries: a compiled decode step of a model with fewer key heads
    # than query heads reads its keys and values where they lie, the query heads a key head
    # serves as rows, where transformers repeats them per head (a copy of each layer's
    # cache, keys and values: two kernels a layer). Side by side with the step compiled
    # without it: the same attention kernels, two nodes a layer fewer, tokens that mostly
    # agree (other kernels, by design).
    from grape.ir import Kernel

    model = _small_llama()
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 500, (1, 5), generator=torch.Generator().manual_seed(0)).cuda()

    def record(out, stats, entry):
        names = [op.name for _, op in entry.loop.capture.ir.ops() if isinstance(op, Kernel)]
        attention = [n for n in names if not n.startswith("triton") and any(
            s in n for s in ("flash", "fmha", "sdpa", "attention"))]
        return stats.step_nodes, len(attention), out

    built = _compiled_both_ways(model, ids, "grouped_queries", record)
    assert built[True][1] == built[False][1] == layers, built
    assert built[True][0] <= built[False][0] - 2 * layers, built
    assert (built[True][2][:, 5:] == built[False][2][:, 5:]).float().mean() >= 0.75
