"""Graph families on disk (grape.familyio) and ``grape simulate`` running a saved one."""

from __future__ import annotations

import base64
import dataclasses
import gzip
import json
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from grape.cli import main
from grape.errors import GrapeError
from grape.familyio import SavedFamily, load_family, save_family
from grape.ir import BufferRole, Kernel, KernelGraph, Memory
from grape.irjson import graph_to_json
from grape.passes.delta import delta, join

TWIN = Path(__file__).parent.parent / "traces" / "h200_ir"


def _variant(template: KernelGraph, changed: int) -> KernelGraph:
    """``template`` with the last argument byte of its first ``changed`` kernels flipped: a
    shape whose kernels are the template's, at other parameters."""
    g = KernelGraph()
    for b in template.buffers.values():
        g.add_buffer(b)
    touched = 0
    for node in nx.topological_sort(template.dag):
        op = template.op(node)
        if isinstance(op, Kernel) and op.args and touched < changed:
            op = dataclasses.replace(op, args=op.args[:-1] + bytes([op.args[-1] ^ 1]))
            touched += 1
        g.add(node, op, after=list(template.dag.predecessors(node)))
    return g


@pytest.fixture(scope="module")
def family():
    template = KernelGraph.load(TWIN / "twin_step.ir.json.gz")
    members = {1: template, 2: _variant(template, 1), 3: _variant(template, 5)}
    placed = {1: ("t", delta(template, template))}
    placed.update({s: ("t", join(template, g)) for s, g in members.items() if s != 1})
    saved = SavedFamily.of({"t": template}, placed, {"gpu": "NVIDIA H200", "driver": "13000"})
    return saved, members


def test_a_saved_family_reloads_every_shape_as_it_was(family, tmp_path):
    saved, members = family
    path = save_family(tmp_path / "f.family.json.gz", saved)
    loaded = load_family(path)
    assert loaded.environment == saved.environment
    assert [len(changes) for _, changes in loaded.members.values()] == [0, 1, 5]
    for shape, graph in members.items():
        assert loaded.graph(shape) == graph, shape
    # Only what a shape changes is kept: the three shapes cost little more than one graph.
    one = save_family(tmp_path / "one.family.json.gz",
                      SavedFamily.from_members({"t": members[1]}, {1: ("t", {})}))
    assert path.stat().st_size < 1.1 * one.stat().st_size


def test_a_family_from_another_environment_is_refused_naming_what_differs(family):
    saved, _ = family
    saved.check({"gpu": "NVIDIA H200", "driver": "13000"})
    with pytest.raises(GrapeError, match="f.family.json.gz: expected driver '13000' as it was "
                                         "captured with, found '12080' here: capture the "
                                         "family again"):
        saved.check({"gpu": "NVIDIA H200", "driver": "12080"}, "f.family.json.gz")
    with pytest.raises(GrapeError, match="expected parameters None"):
        saved.check({"gpu": "NVIDIA H200", "driver": "13000", "parameters": "ab12"})


def test_bad_family_files_and_shapes_are_one_line_errors(family, tmp_path):
    saved, members = family
    with pytest.raises(GrapeError, match="expected shapes that are integers, strings or tuples"):
        save_family(tmp_path / "x.family.json",
                    SavedFamily.from_members({"t": members[1]}, {1.5: ("t", {})}))
    bad = tmp_path / "bad.family.json"
    bad.write_text('{"schema": "grape.ir", "version": 1}')
    with pytest.raises(GrapeError, match="bad.family.json: expected a grape.family document, "
                                         "found 'grape.ir'"):
        load_family(bad)
    _, op = next(iter(members[1].ops()))
    with pytest.raises(GrapeError, match="shape 1 of template 't': expected changes to the "
                                         "template's nodes, found 'nowhere'"):
        SavedFamily.from_members({"t": members[1]}, {1: ("t", {"nowhere": op})})
    doc = json.loads(gzip.decompress(save_family(tmp_path / "g.family.json.gz",
                                                 saved).read_bytes()))
    stray = tmp_path / "stray.family.json"
    stray.write_text(json.dumps({**doc, "executables": {"t": {
        **doc["executables"]["t"], "nodes": ["nowhere"]}}}))
    with pytest.raises(GrapeError, match="stray.family.json, executable 't': expected changes "
                                         "to nodes of template 't', found node 'nowhere'"):
        load_family(stray)
    with pytest.raises(GrapeError, match="expected a shape of the family, found 7"):
        saved.graph(7)


def test_scratch_names_travel_with_the_family_and_must_name_internal_device_buffers(
        family, tmp_path):
    saved, _ = family
    template = saved.templates["t"]
    internal = sorted(b.id for b in template.buffers.values()
                      if b.role == BufferRole.INTERNAL and b.memory == Memory.DEVICE)
    named = next(b.id for b in template.buffers.values() if b.role != BufferRole.INTERNAL)
    kept = dataclasses.replace(saved, scratch=frozenset(internal[:1]))
    loaded = load_family(save_family(tmp_path / "s.family.json.gz", kept))
    assert loaded.scratch == frozenset(internal[:1])
    assert set(loaded.scratch_buffers()) == set(internal[:1])
    old = dataclasses.replace(saved, scratch=frozenset())  # a file from before: none named
    assert load_family(save_family(tmp_path / "o.family.json.gz", old)).scratch == frozenset()
    wrong = dataclasses.replace(saved, scratch=frozenset([named]))
    with pytest.raises(GrapeError, match=f"w.family.json.gz: expected scratch to name internal "
                                         f"device buffers of the templates, found '{named}' "):
        load_family(save_family(tmp_path / "w.family.json.gz", wrong))
    bad = tmp_path / "b.family.json"
    doc = json.loads(gzip.decompress((tmp_path / "s.family.json.gz").read_bytes()))
    bad.write_text(json.dumps({**doc, "scratch": [1, 2]}))
    with pytest.raises(GrapeError, match="b.family.json: expected scratch to be a list of buffer "
                                         "ids, found \\[1, 2\\]"):
        load_family(bad)


def test_grape_simulate_runs_a_saved_family_over_a_sequence(family, tmp_path, capsys):
    saved, _ = family
    path = save_family(tmp_path / "twin.family.json.gz", saved)
    durations = str(TWIN / "twin_step.kineto.json.gz")
    code = main(["simulate", str(path), "--durations", durations, "--sequence", "1,2,3,1"])
    out = capsys.readouterr().out
    assert code == 0 and "1 executables, 3 shapes; 4 steps" in out
    # The first step holds its shape; 1 to 2: one node; 2 to 3: four (the first kernel is
    # changed alike in both); 3 to 1: five.
    assert float(out.split("nodes updated per step")[1].split("(")[0]) == (0 + 1 + 4 + 5) / 4
    code = main(["simulate", str(path), "--durations", durations, "--update-whole"])
    assert code == 0 and "whole-graph updates" in capsys.readouterr().out
    code = main(["simulate", str(path), "--durations", durations, "--update-device"])
    out = capsys.readouterr().out
    assert code == 0 and "a switch kernel on the device" in out
    assert "approximated: a device switch costs" in out
    # the switch's tables, counted by the plan the CUDA backend copies to the device
    from grape.passes.switch_plan import plan

    tables = sum(plan(v).device_bytes() for v in saved.variants.values())
    assert f"device switch tables           {tables / 2**20:10.3f} MiB" in out
    # The family's device memory from the file: its executables at the profile's bytes a
    # node, its scratch and the tables; per-shape graphs an executable each, the same scratch.
    from grape.profile import DEFAULT_PROFILE, load_profile

    per_node = load_profile(DEFAULT_PROFILE).get("executable_bytes_per_node")
    nodes = [len(v.template) for v in saved.variants.values()]
    shapes = [len(v.shapes) for v in saved.variants.values()]
    scratch = sum(b.size for b in saved.scratch_buffers().values())
    family = round(sum(nodes) * per_node) + scratch + tables
    per_shape = round(sum(n * k for n, k in zip(nodes, shapes, strict=True)) * per_node) + scratch
    assert f"family device memory           {family / 2**20:10.3f} MiB" in out
    assert f"per-shape graphs, one pool     {per_shape / 2**20:10.3f} MiB" in out
    assert f"{per_shape / family:.1f}x the family" in out
    assert main(["simulate", str(path), "--durations", durations, "--update-device",
                 "--update-whole"]) != 0
    assert "expected --update-whole or --update-device, found both" in capsys.readouterr().err
    assert main(["simulate", durations, "--update-device"]) != 0
    assert ("expected a saved graph family (*.family.json.gz) with --update-device"
            in capsys.readouterr().err)
    assert main(["simulate", str(path), "--durations", durations, "--sequence", "9"]) != 0
    assert "expected shapes of the family in --sequence, found 9" in capsys.readouterr().err
    assert main(["simulate", str(path), "--durations", durations, "--graph"]) != 0
    assert "expected a trace with --graph, found the graph family" in capsys.readouterr().err


def test_a_version_1_file_reads_as_the_same_family(family, tmp_path):
    # Families saved before versions (each member's changed operations in full) still load.
    saved, members = family
    template = saved.templates["t"]
    old = {"schema": "grape.family", "version": 1, "environment": saved.environment,
           "templates": {"t": graph_to_json(template)}, "members": []}
    for shape, (_, changes) in saved.members.items():
        sub = KernelGraph()
        for node, op in changes.items():
            sub.add(node, op)
        doc = graph_to_json(sub)
        del doc["buffers"]
        old["members"].append({"shape": shape, "template": "t", "changes": doc})
    path = tmp_path / "v1.family.json"
    path.write_text(json.dumps(old))
    loaded = load_family(path)
    assert list(loaded.shapes) == [1, 2, 3]
    for shape, graph in members.items():
        assert loaded.graph(shape) == graph, shape


def test_version_arrays_that_do_not_fit_their_node_are_one_line_errors(family, tmp_path):
    saved, _ = family
    doc = json.loads(gzip.decompress(save_family(tmp_path / "f.family.json.gz",
                                                 saved).read_bytes()))
    executable = doc["executables"]["t"]
    node = next(iter(executable["rows"]))

    def broken(name: str, **changed) -> Path:
        bad = json.loads(json.dumps(doc))
        bad["executables"]["t"]["rows"][node].update(changed)
        path = tmp_path / name
        path.write_text(json.dumps(bad))
        return path

    with pytest.raises(GrapeError, match=f"short.family.json, executable 't', node '{node}': "
                                         f"expected 56 bytes for a <i8 array of shape"):
        load_family(broken("short.family.json", dims="AAAA"))
    with pytest.raises(GrapeError, match="not64.family.json, executable 't', node .*: expected "
                                         "base64 array bytes"):
        load_family(broken("not64.family.json", values="%%%"))
    bad = json.loads(json.dumps(doc))
    bad["executables"]["t"]["versions"] = base64.b64encode(
        np.full(len(executable["nodes"]) * 3, 9, dtype="<i4").tobytes()).decode()
    path = tmp_path / "numbers.family.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(GrapeError, match="expected version numbers below each node's count"):
        load_family(path)
    path.write_text(json.dumps({**doc, "shapes": [[1]]}))
    with pytest.raises(GrapeError, match="numbers.family.json: expected a grape.family "
                                         "document, found a field of another form"):
        load_family(path)
