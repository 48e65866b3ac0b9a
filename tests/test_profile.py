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


def _measured(device="NVIDIA H200"):
    """What characterize(only=["graph_copy_nodes"]) returns, without a GPU."""
    return {"schema": "grape.device", "version": 1, "device": device, "driver_version": 13001,
            "measured": "2026-12-01T06:20:00Z", "repetitions": 50,
            "graph_copy_nodes": {"copy_fit": {"latency_us": 0.9, "us_per_byte": 3e-7},
                                 "memset_fit": {"latency_us": 1.5, "us_per_byte": 5e-8}}}


def test_characterize_only_merges_its_steps_into_the_profile(monkeypatch, tmp_path):
    import shutil

    pytest.importorskip("cuda.bindings", reason="cuda-bindings is not installed")
    import grape.cuda.characterize as char

    asked = []
    monkeypatch.setattr(char, "characterize",
                        lambda reps, progress, only=(): asked.append(only) or _measured())
    path = tmp_path / "h200.json"
    shutil.copy("grape/profiles/h200.json", path)
    before = json.loads(path.read_text())
    assert main(["characterize", "--only", "graph_copy_nodes", "--out", str(path)]) == 0
    after = json.loads(path.read_text())
    assert asked == [["graph_copy_nodes"]]
    # The rest of the profile is as it was measured, header included; the step is dated.
    assert {k: v for k, v in after.items() if k not in ("graph_copy_nodes", "remeasured")} \
        == {k: v for k, v in before.items() if k not in ("graph_copy_nodes", "remeasured")}
    assert after["graph_copy_nodes"] == _measured()["graph_copy_nodes"]
    assert after["remeasured"]["graph_copy_nodes"] == {
        "measured": "2026-12-01T06:20:00Z", "driver_version": 13001, "repetitions": 50}
    assert load_profile(path).get("graph_copy_latency") == 0.9
    # Another GPU's measurement never lands in this profile.
    monkeypatch.setattr(char, "characterize", lambda reps, progress, only=(): _measured("A100"))
    assert main(["characterize", "--only", "graph_copy_nodes", "--out", str(path)]) == 2
    assert json.loads(path.read_text()) == after


def test_a_trace_from_another_gpu_than_the_profile_s_is_said_to_be(tmp_path, capsys):
    # The profile's launch and per-node costs are its GPU's: a trace recorded on a GPU no shipped
    # profile describes, simulated with the default (the H200's), says so; a trace of a GPU
    # grape ships a profile for (the H200, the H100) says nothing.
    import gzip
    import json
    from pathlib import Path

    from grape.profile import DEFAULT_PROFILE, other_device

    profile = load_profile(DEFAULT_PROFILE)
    assert other_device(profile, profile.device, "t") is None
    assert other_device(profile, None, "t") is None
    source = (Path(__file__).parent.parent / "traces" / "h200"
              / "gpt2_small_decode_b1_kv32.graph.json.gz")
    with gzip.open(source, "rt") as f:
        doc = json.load(f)
    assert main(["simulate", str(source)]) == 0
    assert "warning" not in capsys.readouterr().err
    for gpu, warned in (("NVIDIA H100 80GB HBM3", False), ("NVIDIA A100-SXM4-80GB", True)):
        doc["deviceProperties"][0]["name"] = gpu
        moved = tmp_path / f"{gpu.split()[1]}.graph.json.gz"
        with gzip.open(moved, "wt") as f:
            json.dump(doc, f)
        assert main(["simulate", str(moved)]) == 0
        err = capsys.readouterr().err
        said = (f"grape: warning: {moved} ran on {gpu}, and the device profile h200.json "
                f"describes NVIDIA H200")
        assert (said in err) == warned, err


def test_a_trace_is_priced_with_the_profile_shipped_for_its_gpu(tmp_path):
    # grape's profiles folder holds one profile a GPU; a trace of a GPU none describes gets
    # the default (the H200's), and says so (above).
    from grape.profile import DEFAULT_PROFILE, profile_for

    h200 = json.loads(DEFAULT_PROFILE.read_text())
    (tmp_path / "h200.json").write_text(json.dumps(h200))
    (tmp_path / "h100.json").write_text(json.dumps({**h200, "device": "NVIDIA H100 80GB HBM3"}))
    assert profile_for("NVIDIA H100 80GB HBM3", tmp_path).path == str(tmp_path / "h100.json")
    assert profile_for("NVIDIA H200", tmp_path).path == str(tmp_path / "h200.json")
    for other in ("NVIDIA B200", None):
        assert profile_for(other, tmp_path).path == str(DEFAULT_PROFILE)
    assert profile_for("NVIDIA H200").device == "NVIDIA H200"  # the folder grape ships
    assert profile_for("NVIDIA H100 80GB HBM3").device == "NVIDIA H100 80GB HBM3"
