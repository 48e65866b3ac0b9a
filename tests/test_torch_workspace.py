"""grape.torch.workspace's decisions, against a stand-in for PyTorch's cuBLAS workspaces.

What the allocator and cuBLAS do is checked on the GPU (tests/test_gpu_torch.py: a captured
GEMM's workspace lies in grape's pool and survives a clear); here, when grape clears and
re-seats: once per thread, again only after someone else cleared, never where there is no
workspace to keep.
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from grape.torch import workspace  # noqa: E402

SIZE = 32 << 20


class _Cublas:
    """PyTorch's workspace map, one entry per thread's handle (for the side stream), and the
    blocks of grape's pool: a clear frees every entry; a GEMM makes its thread's entry where
    it has none, in grape's pool while allocations go there, else outside it."""

    def __init__(self, uses_workspace: bool = True) -> None:
        self.uses_workspace = uses_workspace
        self.blocks: dict[int, str] = {}  # grape's pool: address -> state
        self.entries: dict[int, int | None] = {}  # thread -> its workspace (None: elsewhere)
        self.clears = 0
        self.into_pool = False

    def clear(self) -> None:
        self.clears += 1
        for address in self.entries.values():
            if address is not None:
                self.blocks[address] = "inactive"
        self.entries.clear()

    def gemm(self, device: int = 0) -> None:
        me = threading.get_ident()
        if me in self.entries or not self.uses_workspace:
            return
        if not self.into_pool:
            self.entries[me] = None
            return
        free = [a for a, state in self.blocks.items() if state == "inactive"]
        address = free[0] if free else 0x7000_0000 + len(self.blocks) * SIZE
        self.blocks[address] = "active_allocated"
        self.entries[me] = address

    def snapshot(self) -> list[dict]:
        return [{"address": a, "total_size": SIZE, "blocks": [{"size": SIZE, "state": s}]}
                for a, s in self.blocks.items()]


@pytest.fixture
def cublas(monkeypatch):
    fake = _Cublas()
    monkeypatch.setattr(workspace, "_POOLS", {})
    monkeypatch.setattr(workspace, "_SEATED", {})
    monkeypatch.setattr(workspace, "_CLEARS", [0])
    monkeypatch.setattr(workspace, "_gemms", fake.gemm)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", fake.clear, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "MemPool", lambda: SimpleNamespace(snapshot=fake.snapshot))

    @contextlib.contextmanager
    def into_pool(pool, device=None):
        fake.into_pool = True
        try:
            yield
        finally:
            fake.into_pool = False

    monkeypatch.setattr(torch.cuda, "use_mem_pool", into_pool)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return fake


STREAM = SimpleNamespace(device=SimpleNamespace(index=0), synchronize=lambda: None)


def test_the_first_capture_seats_the_workspace_in_grapes_pool_and_later_ones_leave_it(cublas):
    cublas.gemm()  # an eager warm-up on the side stream: its workspace lies elsewhere
    workspace.seat_workspace(STREAM)
    me = threading.get_ident()
    assert cublas.clears == 1 and cublas.entries[me] in cublas.blocks
    for _ in range(3):
        cublas.gemm()
        workspace.seat_workspace(STREAM)
    assert cublas.clears == 1  # seated: nothing cleared again


def test_after_someone_else_clears_the_next_capture_takes_the_same_block_back(cublas):
    workspace.seat_workspace(STREAM)
    me = threading.get_ident()
    first = cublas.entries[me]
    cublas.clear()  # torch.compile recording a CUDA graph
    cublas.gemm()  # an eager GEMM on the side stream: a workspace outside the pool
    assert cublas.entries[me] is None
    workspace.seat_workspace(STREAM)
    assert cublas.clears == 3 and cublas.entries[me] == first  # executables' address again


def test_each_thread_seats_its_own_handles_workspace(cublas):
    workspace.seat_workspace(STREAM)
    other = {}

    def elsewhere():
        workspace.seat_workspace(STREAM)
        other["address"] = cublas.entries[threading.get_ident()]

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert cublas.clears == 2 and other["address"] in cublas.blocks
    # That thread's seat cleared this one's: the next capture here seats again, in the pool.
    workspace.seat_workspace(STREAM)
    assert cublas.clears == 3 and cublas.entries[threading.get_ident()] in cublas.blocks


def test_a_cublas_without_a_workspace_is_seated_once(cublas):
    cublas.uses_workspace = False  # CUBLAS_WORKSPACE_CONFIG=:0:0
    for _ in range(3):
        workspace.seat_workspace(STREAM)
    assert cublas.clears == 1 and not cublas.blocks
