"""cond and predicate captured into IF nodes: the GPU picks the branch on every replay."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="torch is not installed")

from grape.torch.control import cond, predicate  # noqa: E402


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")


def test_a_captured_cond_follows_the_predicate_on_each_replay(cuda):
    x = torch.ones(4, device="cuda")
    flag = torch.ones((), dtype=torch.bool, device="cuda")
    cond(flag, lambda t: t * 3, lambda t: t - 2, x)  # eager warm-up of both sides
    cond(~flag, lambda t: t * 3, lambda t: t - 2, x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cond(flag, lambda t: t * 3, lambda t: t - 2, x)
    for value, expected in ((True, 3.0), (False, -1.0), (True, 3.0)):
        flag.fill_(value)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full((4,), expected, device="cuda"))


def test_captured_regions_nest(cuda):
    x = torch.zeros(1, device="cuda")
    a = torch.zeros((), dtype=torch.bool, device="cuda")
    b = torch.zeros((), dtype=torch.bool, device="cuda")
    x.add_(1)  # warm-up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), predicate(a) as outer:
        if outer:
            x.add_(1)
            with predicate(b) as inner:
                if inner:
                    x.add_(10)
    for va in (True, False):
        for vb in (True, False):
            x.zero_()
            a.fill_(va)
            b.fill_(vb)
            g.replay()
            torch.cuda.synchronize()
            assert x.item() == (1 if va else 0) + (10 if va and vb else 0)
