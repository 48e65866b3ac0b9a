"""Inductor's decompositions as a GPU's compilation applies them, on a machine without one.

Some of Inductor's decompositions branch on the device. The one that matters to grape's
passes is ``torch._inductor.decomposition.mm``: under coordinate-descent tuning (which
``max-autotune`` modes, and so ``compile=True``, set) it rewrites a one-row ``mm`` on any
device but the CPU (and MPS) as a multiply and a sum over float32 casts, while the graph is
traced, before any post-grad pass. A CPU's compilation keeps the ``mm``. So a pass checked on a
CPU sees a graph a GPU's never shows it (a bias-free one-row product as ``mm``): a rewrite of
``mm`` that a GPU never reaches passes every CPU test (as ``thin_matmuls``' statistics forms
did on a Llama, until an H100's step was found unchanged by them).

:func:`one_row_mm_as_on_a_gpu` makes a CPU's compilation decompose one-row products as a GPU's
does, so that CPU tests and ``benchmarks/triton_schedule.py`` see the GPU's graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

__all__ = ["one_row_mm_as_on_a_gpu"]


@contextlib.contextmanager
def one_row_mm_as_on_a_gpu() -> Iterator[None]:
    """Within: Inductor decomposes a ``mm`` of one row (or one column) on the CPU as it does on
    a GPU under coordinate-descent tuning, ``(a.unsqueeze(2) * b.unsqueeze(0)).sum(dim=1)``
    computed in float32 (whatever the tuning switch says: the graph a GPU's ``compile=True``
    traces). Other products decompose as before."""
    from torch._inductor import decomposition
    from torch._inductor.decomposition import pw_cast_for_opmath
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    mm = torch.ops.aten.mm.default
    given = decomposition.decompositions[mm]

    @pw_cast_for_opmath
    def as_on_a_gpu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if statically_known_true(a.shape[0] == 1) or statically_known_true(b.shape[1] == 1):
            return (a.unsqueeze(2) * b.unsqueeze(0)).sum(dim=1)
        return given(a, b)

    # (select_decomp_table serves a cached copy of the table: cleared on the way in and out)
    decomposition.fast_random_decomps.cache_clear()
    try:
        with mock.patch.dict(decomposition.decompositions, {mm: as_on_a_gpu}):
            yield
    finally:
        decomposition.fast_random_decomps.cache_clear()
