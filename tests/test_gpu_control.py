"""cond and predicate captured into IF nodes: the GPU picks the branch on every replay."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="torch is not installed")

from grape.errors import UnsupportedError  # noqa: E402
from grape.torch.control import cond, graph, predicate  # noqa: E402


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")


def _torch_captures_if_nodes() -> bool:
    return hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32], ids=["bool", "int32"])
def test_a_captured_cond_follows_the_predicate_on_each_replay(cuda, dtype):
    x = torch.ones(4, device="cuda")
    flag = torch.ones((), dtype=dtype, device="cuda")
    cond(flag, lambda t: t * 3, lambda t: t - 2, x)  # eager warm-up of both sides
    cond(torch.zeros_like(flag), lambda t: t * 3, lambda t: t - 2, x)
    g = torch.cuda.CUDAGraph()
    with graph(g):
        out = cond(flag, lambda t: t * 3, lambda t: t - 2, x)
    for value, expected in ((1, 3.0), (0, -1.0), (1, 3.0)):
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
    with graph(g), predicate(a) as outer:
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


def test_a_plain_torch_capture_takes_if_nodes_only_where_pytorch_can(cuda):
    x = torch.zeros(1, device="cuda")
    flag = torch.ones((), dtype=torch.bool, device="cuda")
    x.add_(1)
    g = torch.cuda.CUDAGraph()
    if _torch_captures_if_nodes():
        with torch.cuda.graph(g), predicate(flag):
            x.add_(1)
        g.replay()
        torch.cuda.synchronize()
        assert x.item() == 2
    else:
        with pytest.raises(UnsupportedError, match="found a plain torch.cuda.graph capture"), \
                torch.cuda.graph(g), predicate(flag):
            x.add_(1)


def test_a_device_loop_body_may_branch(cuda):
    """An IF node inside a WHILE body: grape reads its own IF nodes back into the IR, on
    drivers without cuGraphNodeGetParams too."""
    from grape.torch.loop import DeviceLoop

    x = torch.zeros(1, device="cuda")
    odd = torch.zeros(1, device="cuda")
    running = torch.ones((), dtype=torch.bool, device="cuda")

    def body():
        x.add_(1)
        with predicate(torch.remainder(x[0], 2) == 1) as taken:
            if taken:
                odd.add_(1)
        torch.lt(x[0], 7, out=running)

    body()  # eager warm-up
    x.zero_()
    odd.zero_()
    loop = DeviceLoop(body, running, 100)
    try:
        loop.launch()
        torch.cuda.synchronize()
    finally:
        loop.close()
    assert (x.item(), odd.item()) == (7, 4)
