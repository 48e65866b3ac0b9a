from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grape.cli import main
from grape.ir import Buffer, BufferRole, Empty, Kernel, KernelGraph

TRACES = Path(__file__).resolve().parent.parent / "traces"
EAGER = TRACES / "gpt2_small_decode_b1_past64.eager.kineto.json.gz"
GRAPH = TRACES / "gpt2_small_decode_b1_past64.graph.kineto.json.gz"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_info_on_the_eager_sample(capsys):
    code, out, err = run(capsys, "info", EAGER)
    assert code == 0 and not err
    assert "NVIDIA H200 (CUDA driver 13.0, runtime 13.0)" in out
    assert "iterations: 3 (repeating launch sequence: 3 iterations of 247 launches)" in out
    assert "streams: 1: stream 7 (741 kernels)" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])]
    assert [row[2] for row in rows] == ["247"] * 3  # kernels column
    assert "graph launches" not in out


def test_info_on_the_graph_sample_says_the_graph_runs_more_kernels(capsys):
    code, out, _ = run(capsys, "info", GRAPH)
    assert code == 0
    assert "graph launches: 3, each running 290 kernels" in out
    # The eager trace beside it is found and compared, so the difference is not hidden.
    assert ("gpt2_small_decode_b1_past64: the graphed iteration runs 290 kernels, the eager one "
            "247 (+43, from gpt2_small_decode_b1_past64.eager.kineto.json.gz): capture changed "
            "which kernels run") in out


def test_info_without_a_sibling_still_reports_the_graph(capsys, tmp_path):
    lone = tmp_path / GRAPH.name
    shutil.copy(GRAPH, lone)
    code, out, _ = run(capsys, "info", lone)
    assert code == 0 and "each running 290 kernels" in out and "eager one" not in out


def test_info_json(capsys):
    _code, out, _ = run(capsys, "info", "--json", EAGER, GRAPH)
    eager, graph = (json.loads(line) for line in out.splitlines())
    assert [it["kernels"] for it in eager["iterations"]] == [247] * 3
    assert [it["kernels_per_graph_launch"] for it in graph["iterations"]] == [[290]] * 3
    assert eager["device"] == "NVIDIA H200"


def test_info_with_explicit_iterations(capsys):
    code, out, _ = run(capsys, "info", "--iterations", "1", EAGER)
    assert code == 0 and "explicit count: 1 iterations of 741 launches" in out


def test_info_on_a_graph_file(capsys, tmp_path):
    g = KernelGraph()
    g.add_buffer(Buffer("x", 1024, BufferRole.INPUT))
    g.add("a", Kernel("f", "k", (1, 1, 1), (32, 1, 1)))
    g.add("b", Empty(), after=["a"])
    g.save(tmp_path / "g.json")
    code, out, _ = run(capsys, "info", tmp_path / "g.json")
    assert code == 0
    assert "grape kernel graph: 2 nodes (1 kernel, 1 empty), 1 edges" in out
    assert "buffers: 1 input (1,024 bytes)" in out
    assert f"fingerprint: {g.fingerprint()}" in out
    g.add("c", Kernel("f", "k", (1, 1, 1), (32, 1, 1)), after=["a"],
          kinds={"a": "programmatic"})
    g.save(tmp_path / "g.json")
    code, out, _ = run(capsys, "info", tmp_path / "g.json")
    assert "grape kernel graph: 3 nodes (2 kernel, 1 empty), 2 edges (1 programmatic)" in out


def test_info_on_a_saved_family(capsys):
    family = TRACES / "h200_families" / "gpt2_small_decode_b1_kv240_255.family.json.gz"
    code, out, err = run(capsys, "info", family)
    assert code == 0 and not err
    assert ("grape graph family: 16 shapes (240..255), 2 executables (292 nodes for 2 shapes, "
            "316 nodes for 14 shapes)") in out
    assert "captured on NVIDIA H200, driver 13000, torch 2.11.0+cu130" in out
    text = out
    code, out, _ = run(capsys, "info", "--json", family)
    data = json.loads(out)
    assert data["kind"] == "family" and data["shapes"] == 16
    assert data["changed_nodes_per_shape"]["max"] >= data["changed_nodes_per_shape"]["median"]
    # what update="device" would put on the GPU: every node with versions a kernel can switch
    from grape.familyio import load_family
    from grape.passes.variants import device_switchable

    saved = load_family(family)
    switchable = [nv for v in saved.variants.values() for nv in v.nodes.values()
                  if device_switchable(nv)]
    switch = data["device_switch"]
    assert switch["nodes"] == len(switchable) > 0
    assert switch["versions"] == sum(map(len, switchable))
    assert (f'with update="device": {switch["nodes"]} nodes switched on the GPU '
            f'({switch["versions"]} versions), tables of {switch["table_bytes"]:,} bytes') in text
    assert 0 < switch["table_bytes"] < switch["versions"] * 1480


@pytest.mark.parametrize("content, message", [
    (b'{"traceEvents": [', "expected JSON, found .*the file looks truncated"),
    (b'{"schema": "grape.family", "version": 9}', "expected grape.family schema version 1 or 2, "
                                                   "found 9"),
    (b'{"schema": "grape.family", "version": 1, "templates": {}}',
     "expected a grape.family document, found one without 'members'"),
    (b'{"schema": "grape.ir", "version": 1, "buffers": [], "nodes": '
     b'[{"id": "a", "kind": "empty"}], "edges": [["a", "a"]]}',
     "expected an acyclic graph, found the cycle a -> a"),
    (b'{"schema": "grape.ir", "version": 3}', "expected grape.ir schema version 1, found 3"),
    (b'{"traceEvents": []}', "expected GPU work launched from the host, found none"),
])
def test_bad_input_is_one_line_and_exit_code_2(capsys, tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    code, out, err = run(capsys, "info", path)
    assert code == 2 and not out
    assert err.count("\n") == 1
    assert err.startswith(f"grape info: error: {path}: ")
    assert __import__("re").search(message, err)


def test_bad_iteration_count_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as info:
        main(["info", "--iterations", "0", str(EAGER)])
    assert info.value.code == 2
    assert "expected a positive integer, found '0'" in capsys.readouterr().err


def test_console_script_help():
    """The installed entry point runs and documents its subcommands."""
    out = subprocess.run([sys.executable, "-m", "grape.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "info" in out and "usage: grape" in out
    out = subprocess.run([sys.executable, "-m", "grape.cli", "info", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--iterations" in out
