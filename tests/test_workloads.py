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
    ("bert-base:b8:s128", ("encode", "bert-base", "8", "128")),
    ("resnet-50:b32:224px", ("image", "resnet-50", "32", "224")),
    ("two-streams:b64:w4096:d8", ("streams", "64", "4096", "8")),
])
def test_specs_name_their_workload(spec, parts):
    assert check_spec(spec) == parts


@pytest.mark.parametrize(("spec", "message"), [
    ("wav2vec2-base:train:b0:16000", "a batch of at least 1 and at least 400 audio samples"),
    ("wav2vec2-large:train:b8:16000", "expected a Wav2Vec2 model among ['wav2vec2-base']"),
    ("bert:b1", "expected a workload like gpt2-small:b1:kv32, wav2vec2-base:16000, "
                "wav2vec2-base:train:b8:16000, bert-base:b8:s128, resnet-50:b32:224px or "
                "two-streams:b64:w4096:d8, found 'bert:b1'"),
    ("bert-base:b8:s1024", "a batch of at least 1 and 1..512 tokens"),
    ("resnet-50:b8:16px", "images of at least 32 pixels a side"),
    ("two-streams:b0:w64:d2", "expected a batch, width and depth of at least 1"),
])
def test_bad_specs_say_what_a_spec_looks_like(spec, message):
    with pytest.raises(GrapeError) as e:
        check_spec(spec)
    assert message in str(e.value)
