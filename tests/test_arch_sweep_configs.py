"""The sweep harness's small configs (benchmarks/arch_sweep.py): faults of the harness that
read as the models' until found (a config's own token ids past the small vocabulary, an
encoder's causal head left bidirectional, a causal head whose decoder outgrows the cache)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import arch_sweep  # noqa: E402


def _ids(config):
    return {k: v for k, v in vars(config).items() if k.endswith("_token_id")}


@pytest.mark.parametrize("model_type", ["whisper", "marian"])
def test_every_token_id_a_config_names_lies_inside_the_small_vocabulary(model_type):
    config = arch_sweep.small_configs(model_type, seq2seq_sizes=True)[-1]
    ids = _ids(config)
    assert ids and all(v is None or (isinstance(v, int) and 0 <= v < config.vocab_size)
                       or isinstance(v, list) for v in ids.values())
    assert all(v < config.vocab_size for v in getattr(config, "begin_suppress_tokens", None)
               or [])


def test_an_encoder_s_causal_head_is_built_as_a_decoder():
    assert arch_sweep.small_configs("bert")[-1].is_decoder is True
    assert not hasattr(arch_sweep.small_configs("llama")[-1], "is_decoder")  # none invented


def test_an_encoder_decoder_family_s_causal_head_keeps_its_decoder_as_deep_as_the_cache():
    config = arch_sweep.small_configs("bart")[-1]
    assert config.decoder_layers == config.encoder_layers == config.num_hidden_layers == 2


def _known(model_type):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"this transformers has no {model_type}")


def _parameters(config, auto):
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in auto.from_config(config).parameters())


def test_a_config_that_names_its_sizes_its_own_way_is_shrunk_by_the_names():
    # LongCat-Flash's experts (ffn_hidden_size, expert_ffn_hidden_size, zero_expert_num) kept
    # 7.9 billion parameters at the common small sizes under transformers 5.17 (5.25's config
    # maps them onto the common names); by name, under ten million.
    _known("longcat_flash")
    config = arch_sweep.small_configs("longcat_flash")[-1]
    small = arch_sweep.shrunk_by_name(config)
    assert (_parameters(small, transformers.AutoModelForCausalLM)
            <= min(2 * 10**7, _parameters(config, transformers.AutoModelForCausalLM)))
    # latent attention's key-value heads stay as many as its query heads
    assert small.num_key_value_heads == small.num_attention_heads


def test_shrinking_a_part_of_a_part_keeps_one_layer_of_each_kind():
    # T5Gemma 2 keeps its text config inside its encoder's config (4.7 billion parameters left
    # at the small sizes); its layer pattern of five sliding layers to one full shrinks to one
    # of each, as transformers' masks and the model's decoder expect both.
    _known("t5gemma2")
    arch_sweep.SEQ2SEQ[0] = True
    try:
        config = arch_sweep.small_configs("t5gemma2")[-1]
        small = arch_sweep.shrunk_by_name(config)
        assert _parameters(small, transformers.AutoModelForSeq2SeqLM) < 2 * 10**7
    finally:
        arch_sweep.SEQ2SEQ[0] = False
    assert small.decoder.layer_types == ["sliding_attention", "full_attention"]
    assert small.encoder.text_config.num_hidden_layers == 2


@pytest.mark.parametrize("kinds, n, kept", [
    (["s", "s", "s", "s", "s", "f"], 2, ["s", "f"]),
    (["s", "f", "s", "f"], 2, ["s", "f"]),
    (["a", "b", "c", "a"], 2, ["a", "b"]),  # more kinds than layers: the first layers
    (["s", "s", "s"], 2, ["s", "s"]),
])
def test_a_per_layer_list_keeps_each_kind_where_the_layers_allow(kinds, n, kept):
    assert arch_sweep._every_kind(kinds, n) == kept


def test_a_config_that_refuses_num_hidden_layers_takes_the_counts_it_names():
    # ProphetNet: "Please set `num_encoder_layers` and `num_decoder_layers`".
    _known("prophetnet")
    config = arch_sweep.small_configs("prophetnet")[-1]
    assert config.num_encoder_layers == config.num_decoder_layers == 2


def test_a_gpu_builds_the_model_the_cpu_checked_where_the_config_shrinks():
    # BLT at the common small sizes: 779 million parameters, parts at defaults that do not fit
    # each other; under the GPU's bound alone it went unshrunk, and generate itself failed
    # there (an H100, 1719e30) while the CPU's shrunk one ran.
    _known("blt")
    on_cpu, on_gpu = (arch_sweep.sized_config("blt", device) for device in ("cpu", "cuda"))
    assert on_gpu.to_dict() == on_cpu.to_dict()
    assert _parameters(on_gpu, transformers.AutoModelForCausalLM) <= arch_sweep.MAX_PARAMETERS[
        "cpu"]
    # a config within the CPU's bound is what the small sizes made, on both
    assert (arch_sweep.sized_config("llama", "cuda").to_dict()
            == arch_sweep.small_configs("llama")[-1].to_dict())


def test_every_row_names_the_machine_and_the_commit_it_ran_at(tmp_path, monkeypatch):
    import re

    import torch

    ran_on = arch_sweep.machine("cpu")
    assert set(ran_on) == {"device", "torch", "transformers", "grape_commit"}
    assert ran_on["torch"] == torch.__version__
    assert ran_on["transformers"] == transformers.__version__
    # In a git checkout, its commit (with "+" where it had changes); elsewhere, None.
    assert ran_on["grape_commit"] is None or re.fullmatch(r"[0-9a-f]{7,}\+?",
                                                          ran_on["grape_commit"])
    monkeypatch.setattr(arch_sweep, "__file__", str(tmp_path / "arch_sweep.py"))
    assert arch_sweep.machine("cpu")["grape_commit"] is None


@pytest.mark.parametrize("model_type", ["zamba", "granitemoehybrid", "bamba", "jamba"])
def test_a_hybrid_is_built_with_an_attention_layer(model_type):
    # With recurrent layers alone transformers' static cache refuses the model and generate
    # fails, so the sweep tested nothing of it: Zamba's first depth holding its shared
    # attention block is refused (the block is tied across two such layers at least), and
    # Granite-MoE-Hybrid's defaults place attention nowhere.
    _known(model_type)
    config = arch_sweep.sized_config(model_type, "cpu")
    assert arch_sweep._attends(arch_sweep._layer_kinds(config))


@pytest.mark.parametrize("model_type", ["bamba", "granitemoehybrid", "falcon_h1"])
def test_a_mamba_2_scan_is_sized_to_hold_its_rows_in_memory(model_type):
    # PyTorch's chunked scan holds (rows, chunk, chunk, heads, state) floats: at these
    # configs' defaults 8 GiB a row, and generate's 3-beam references ran out of memory.
    _known(model_type)
    config = arch_sweep.sized_config(model_type, "cpu")
    rows, chunk = 6, config.mamba_chunk_size
    assert rows * chunk * chunk * config.mamba_n_heads * config.mamba_d_state * 4 < 2**30


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v32", "glm_moe_dsa", "axk1"])
def test_a_mixture_of_experts_routes_in_a_layer_of_the_small_config(model_type):
    # DeepSeek-V3's first three layers are dense: at two layers the sweep ran none of its
    # experts. Its groups of experts hold two at least, as its routing takes each group's
    # best two (AXK1's failed on eight groups of the small eight experts).
    import torch

    _known(model_type)
    config = arch_sweep.sized_config(model_type, "cpu")
    with torch.device("meta"):
        model = arch_sweep._auto().from_config(config)
    assert any(name.endswith(".experts") for name, _ in model.named_modules())
    text = config.get_text_config()
    assert text.n_routed_experts // text.n_group >= 2
    assert 1 <= text.topk_group <= text.n_group


def test_the_small_axk1_routes_a_prompt():
    import torch

    _known("axk1")
    model = arch_sweep.build("axk1", "cpu", torch.float32)
    with torch.no_grad():
        logits = model(torch.arange(3, 11)[None]).logits
    assert logits.shape == (1, 8, model.config.vocab_size) and bool(logits.isfinite().all())


@pytest.mark.parametrize("model_type", ["nllb-moe", "switch_transformers"])
def test_an_encoder_decoder_s_sparse_layers_fall_within_the_small_depth(model_type,
                                                                       monkeypatch):
    # NLLB-MoE's every fourth layer and Switch Transformers' 3 sparse layers of 12 placed no
    # sparse layer in two: the sweep's rows of both ran no expert.
    import torch

    _known(model_type)
    monkeypatch.setattr(arch_sweep, "SEQ2SEQ", [True])
    config = arch_sweep.sized_config(model_type, "cpu")
    with torch.device("meta"):
        model = arch_sweep._auto().from_config(config)
    assert any(name.endswith(".experts") for name, _ in model.named_modules())


@pytest.mark.parametrize(("model_type", "field"), [("gpt_neo", "window_size"),
                                                   ("llama4_text", "attention_chunk_size")])
def test_a_window_by_another_name_is_reached_by_the_sweep_s_sequence(model_type, field):
    # GPT-Neo's local layers' 256 tokens and Llama 4's chunks of 8,192 were never reached by
    # 16 + 24 tokens; at 8, GPT-Neo's static-cache generation reads its cache's unwritten tail
    # (its local mask is sliced as if the cache held only the tokens seen) and falls back.
    _known(model_type)
    config = arch_sweep.sized_config(model_type, "cpu").get_text_config()
    assert getattr(config, field) < arch_sweep.PROMPT + arch_sweep.NEW_TOKENS[0]
