"""Kernels whose launch attributes change with the shape, in one executable per topology
(grape.passes.variants' alternates), on a real GPU: a feed-forward block over the first n rows
of a buffer, whose GEMMs the H200's cuBLAS picks by n with other cluster shapes (as it does
Wav2Vec2's, which needed 45 executables for 7 topologies before alternates)."""

from __future__ import annotations

import warnings

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="torch is not installed")

from tests.family_process import graph_of  # noqa: E402

ROWS = list(range(520, 16, -24))  # largest first, as a family is captured


@pytest.fixture(scope="module")
def block():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(768, 3072), torch.nn.GELU(),
                                 torch.nn.Linear(3072, 768)).cuda().half()
    x = torch.randn(max(ROWS), 768, device="cuda", dtype=torch.float16)
    out = torch.zeros_like(x)

    def step(n: int) -> None:
        with torch.no_grad():
            out[:n].copy_(layers(x[:n]))

    return layers, step, out


@pytest.fixture(scope="module", params=["nodes", "device"])
def family(block, request):
    from grape.torch.family import capture_family

    layers, step, _ = block
    fam = capture_family(step, ROWS, params=dict(layers.named_parameters()),
                         update=request.param)
    if not any(v.alternates for v in fam.variants.values()):
        fam.close()
        pytest.skip(f"no kernel changed its launch attributes over {len(ROWS)} row counts on "
                    f"{torch.cuda.get_device_name()}")
    yield fam
    fam.close()


def test_a_topology_whose_kernels_change_attributes_keeps_one_executable(family):
    from grape.ir import fingerprint

    topologies = {fingerprint(v.template, launch=False) for v in family.variants.values()}
    assert len(family.groups) == len(topologies)
    assert all("#" not in key for key in family.groups)
    v = next(v for v in family.variants.values() if v.alternates)
    # the shapes that run an alternate run it with the attributes of their own capture
    assert v.chosen and all(k >= 1 for chosen in v.chosen.values() for k in chosen.values())


def test_every_shape_computes_bitwise_what_its_own_graph_computes(block, family):
    _, step, out = block
    v = next(v for v in family.variants.values() if v.alternates)
    runs_one = [n for n in ROWS if n in v.chosen]
    runs_none = [n for n in ROWS if n in v.shapes and n not in v.chosen]
    assert runs_one and runs_none
    # back and forth between shapes that run alternates and shapes that run the template's
    order = [runs_one[0], runs_none[0], runs_one[-1], runs_none[-1], *ROWS, runs_one[0]]
    graphs = {n: graph_of(step, n) for n in set(order)}
    for n in order:
        assert same_rows_as_graph(graphs[n], family, n, out), f"{n} rows"
    family.check()


def same_rows_as_graph(graph, family, n: int, out) -> bool:
    """Whether the family at ``n`` rows writes bitwise what PyTorch's graph of it writes, and
    nothing past its ``n`` rows (a step leaves the rest of ``out`` as it was)."""
    graph.replay()
    torch.cuda.synchronize()
    expected = out[:n].clone()
    out.zero_()
    family.run(n)
    torch.cuda.synchronize()
    return torch.equal(out[:n], expected) and not out[n:].any()


def test_a_saved_family_with_alternates_reloads_and_computes_what_its_graphs_compute(
        block, family, tmp_path):
    """A warm start: alternates whose kernels the template here runs move from the file;
    shapes running another function's are captured here (counted)."""
    from grape.torch.family import load_family

    layers, step, out = block
    path = family.save(tmp_path / "alternates.family.json.gz",
                       dict(layers.named_parameters()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_family(step, path, dict(layers.named_parameters()),
                             update=family.update)
    try:
        # one capture a template at least; more are said in one warning, never silently
        assert loaded.captured_here >= len(loaded.groups)
        said = [str(w.message) for w in caught if "captured here" in str(w.message)]
        assert (loaded.captured_here > len(loaded.groups)) == bool(said), said
        assert set(loaded.group_of) == set(family.group_of)
        assert len(loaded.groups) == len(family.groups)
        graphs = {n: graph_of(step, n) for n in ROWS}
        for n in [*ROWS, ROWS[1], ROWS[-1]]:
            assert same_rows_as_graph(graphs[n], loaded, n, out), f"{n} rows, loaded"
    finally:
        loaded.close()
