"""Workload specs grape record takes (grape.torch.workloads), checked without a GPU."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="torch is not installed")

from grape.errors import GrapeError
from grape.torch.workloads import check_spec


@pytest.mark.parametrize(("spec", "parts"), [
    ("gpt2-small:b8:kv128", ("decode", "gpt2-small", "8", "128")),
    ("wav2vec2-base:16000", ("audio", "wav2vec2-base", "16000")),
    ("wav2vec2-base:train:b8:160000", ("train", "wav2vec2-base", "8", "160000")),
])
def test_specs_name_their_workload(spec, parts):
    assert check_spec(spec) == parts


@pytest.mark.parametrize(("spec", "message"), [
    ("wav2vec2-base:train:b0:16000", "a batch of at least 1 and at least 400 audio samples"),
    ("wav2vec2-large:train:b8:16000", "expected a Wav2Vec2 model among ['wav2vec2-base']"),
    ("bert:b1", "expected a workload like gpt2-small:b1:kv32, wav2vec2-base:16000 or "
                "wav2vec2-base:train:b8:16000, found 'bert:b1'"),
])
def test_bad_specs_say_what_a_spec_looks_like(spec, message):
    with pytest.raises(GrapeError) as e:
        check_spec(spec)
    assert message in str(e.value)
