from __future__ import annotations

import json

import pytest

from grape.cli import main
from grape.errors import ProfileError, SchemaVersionError
from grape.profile import load_profile


def _write(tmp_path, doc) -> str:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("doc, error, message", [
    ({"schema": "other"}, ProfileError, "expected a grape.device document, found 'other'"),
    ({"schema": "grape.device", "version": 3}, SchemaVersionError,
     "expected grape.device schema version 1, found 3"),
    ({"schema": "grape.device", "version": 1}, ProfileError, "expected a device name"),
])
def test_bad_profiles(tmp_path, doc, error, message):
    with pytest.raises(error, match=message):
        load_profile(_write(tmp_path, doc))


def test_a_constant_that_was_not_measured_is_named(tmp_path):
    p = load_profile(_write(tmp_path, {"schema": "grape.device", "version": 1, "device": "X"}))
    with pytest.raises(ProfileError, match=r"expected graph_launch.fit.host_fixed_us "
                                           r"\(graph_launch_fixed\), found no such entry"):
        p.get("graph_launch_fixed")


def test_info_prints_a_profile(capsys, tmp_path):
    assert main(["info", "grape/profiles/h200.json"]) == 0
    out = capsys.readouterr().out
    assert "grape device profile: NVIDIA H200" in out
    assert "WHILE node overhead per iteration" in out
    path = _write(tmp_path, {"schema": "grape.device", "version": 1, "device": "X"})
    assert main(["info", path]) == 0
    assert "not measured" in capsys.readouterr().out
