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
