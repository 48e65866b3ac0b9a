"""cuBLAS's workspace, kept where grape's graphs can rely on it.

A captured GEMM holds the raw address of the workspace cuBLAS had on the capturing stream.
PyTorch owns that workspace (one per cuBLAS handle and stream) and frees it whenever anything
calls ``torch._C._cuda_clearCublasWorkspaces()``: ``torch.compile``'s CUDA graphs do, before
and after each recording, and so does Hugging Face's ``generate`` with a static cache, which
compiles its step that way. The block then goes back to whichever pool it came from: an
eager warm-up's goes to the allocator's common pool, where other tensors take it or
``empty_cache`` unmaps it. A graph still pointing there computes garbage or stops with an
illegal memory access: on the H200, T5's graphed generation ran once, then crashed on the
launch after a ``model.generate`` call (2026-12-05, ``benchmarks/results/generate_h200_runs``).

:func:`seat_workspace` makes the workspace a capture will use a block of a memory pool grape
keeps for the whole process and allocates nothing else from (one per device). Whoever clears
the workspace afterwards only returns the block to that pool: it stays mapped and nobody else
can take it, so every executable captured on it stays valid, and seating it again takes a block
of that pool back (the same one, where one thread seats). It clears (so that the next GEMM
allocates anew, inside grape's pool) only where the workspace is not already seated there: on a
process's first capture, and after someone else cleared it.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["seat_workspace", "workspace_pool"]

_POOLS: dict[int, torch.cuda.MemPool] = {}
# What each thread's last seat allocated in a device's pool: (the thread, the addresses of the
# blocks, the clears grape had made by then). Each thread has cuBLAS handles of its own, so each
# seats its own workspace; none, with a cuBLAS that takes no workspace
# (CUBLAS_WORKSPACE_CONFIG=:0:0), leaves nothing to keep. A seat stands while its blocks stay
# allocated and grape has cleared nothing since: another thread's seat clears this one's
# workspace too, and may take back the very block it freed.
_SEATED: dict[tuple[int, int], tuple[threading.Thread, frozenset[int], int]] = {}
_CLEARS = [0]
_LOCK = threading.Lock()


def workspace_pool(device: int) -> torch.cuda.MemPool:
    """grape's pool for cuBLAS workspaces on ``device`` (made on first use, kept for good)."""
    with _LOCK:
        if device not in _POOLS:
            _POOLS[device] = torch.cuda.MemPool()
        return _POOLS[device]


def _active(pool: torch.cuda.MemPool) -> set[int]:
    """The addresses of the blocks allocated in ``pool``."""
    found = set()
    for segment in pool.snapshot():
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                found.add(address)
            address += block["size"]
    return found


def seat_workspace(stream: torch.cuda.Stream) -> None:
    """Before a capture on ``stream``: the workspace the current thread's cuBLAS handle uses
    there lies in :func:`workspace_pool` (see the module). Cheap where it already does (one
    snapshot of a pool of a few blocks)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:  # pragma: no cover - a PyTorch without cuBLAS workspaces (ROCm builds)
        return
    device = stream.device.index if stream.device.index is not None \
        else torch.cuda.current_device()
    pool, thread = workspace_pool(device), threading.current_thread()
    key = (device, threading.get_ident())
    seated = _SEATED.get(key)
    if seated is not None and seated[0] is thread and seated[2] == _CLEARS[0] \
            and seated[1] <= _active(pool):
        return  # seated, and nobody cleared it since
    # Every handle's workspace goes (PyTorch offers no narrower clear), as it does each time
    # torch.compile records a CUDA graph; eager GEMMs allocate theirs again on their next call.
    with _LOCK:
        torch.cuda.synchronize(device)
        clear()
        _CLEARS[0] += 1
        before = _active(pool)
        with torch.cuda.use_mem_pool(pool, device), torch.cuda.stream(stream):
            _gemms(device)  # the handle's setup on this stream allocates its workspace, here
        stream.synchronize()
        _SEATED[key] = (thread, frozenset(_active(pool) - before), _CLEARS[0])


def _gemms(device: int) -> None:
    """A GEMM through cuBLAS and one through cuBLASLt (a bias added: PyTorch's addmm takes
    cuBLASLt there), so that both workspaces are made where they share none; their operands
    are freed on return, leaving the workspaces alone allocated in the pool."""
    a = torch.ones((8, 8), device=f"cuda:{device}")
    torch.mm(a, a)
    torch.addmm(a[0], a, a)
