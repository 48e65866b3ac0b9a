"""A family's sampling recorded and replayed on the host (``benchmarks/sampling_replay.py``)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from sampling_replay import Mismatch, Recording, recording, replay

from grape.passes.lengths import derive_lengths
from tests.test_passes_derive import _reads, leftover


def _recorded(tmp_path: Path) -> tuple[Path, object]:
    rec = Recording()
    sampled = rec.wrap(derive_lengths)(leftover, range(1, 257), every=8, checks=2,
                                       again=leftover, verify=_reads)
    (path,) = rec.save(tmp_path)
    return path, sampled


def test_a_replay_comes_to_the_recorded_outcome_with_no_capture(tmp_path):
    path, sampled = _recorded(tmp_path)
    row = replay(path)
    assert row["same_outcome"] is True
    assert (row["captured"], row["derived"]) == (len(sampled.captured), len(sampled.derived))
    assert row["compared"] == len(sampled.verified) > 0  # the leftover needed runs
    assert row["again"] == len(sampled.repeated) > 0
    assert row["host_s"] > 0


def test_a_replay_whose_host_asks_what_was_never_recorded_says_which(tmp_path):
    path, _ = _recorded(tmp_path)
    doc = json.loads(gzip.decompress(path.read_bytes()))
    dropped = doc["captured"].pop()[0]
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    with pytest.raises(Mismatch, match=f"a capture at length {dropped}, which the recording"):
        replay(path)
    doc["captured"].append([dropped, leftover(dropped).to_json()])
    doc["verified"] = [[n, "0" * 32, first, answer] for n, _, first, answer in doc["verified"]]
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    with pytest.raises(Mismatch, match="a comparison at length"):
        replay(path)


def test_recording_sees_the_calls_a_family_makes_and_puts_derive_lengths_back():
    pytest.importorskip("torch", reason="grape.torch needs torch")
    from grape.torch import family

    real = family.derive_lengths
    with recording() as rec:
        family.derive_lengths(leftover, range(1, 65), every=8, checks=1)
    assert family.derive_lengths is real
    (call,) = rec.calls
    assert call.lengths == list(range(1, 65)) and call.keywords == {"every": 8, "checks": 1}
    # Without ``again`` the second captures for loose slots are captures too.
    assert sorted(n for n, _ in call.captured) == sorted(call.outcome["captured"]
                                                         + call.outcome["repeated"])
