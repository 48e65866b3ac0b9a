"""Ways to reorder a cache's rows by beam, inside a CUDA graph (why grape.torch.rows stacks).

Beam search moves every keys and values tensor of the cache with the beams each token. For
three caches (the ``bench`` GPT-2 of ``benchmarks/generate.py`` at 5 beams, 24 tensors of
(5, 16, 160, 64); the Llama 2048 x 22 shape's 44 tensors of (5, 4, 160, 64); the GPT-2 one at
batch 8, 40 rows), fp16, each way is captured ten times over in one CUDA graph and replayed;
printed and written (``$OUT/row_reorder.json``, or ``--out``) in microseconds per reorder:

- ``per_tensor``: ``t.copy_(t.index_select(0, order))`` for each tensor (grape before e7fb4e5)
- ``per_tensor_foreach_copy``: gathers into temporaries, one ``_foreach_copy_`` back
- ``per_tensor_advanced``: ``t.copy_(t[order])``
- ``rows_outer_index_select`` / ``rows_outer_advanced``: one (rows, tensors x elements) buffer
  (each tensor's rows strided apart), gathered along its first dimension
- ``stacked_dim1_index_select`` / ``stacked_dim1_advanced``: one (tensors, rows, elements)
  buffer, each tensor contiguous, gathered along its second dimension
- ``stacked_as_matrix_index_select`` / ``stacked_as_matrix_advanced``: that buffer as a
  (tensors x rows, elements) matrix, its rows gathered by ``firsts + order``
  (``grape.torch.rows.RowReorder``)

Run on a GPU: python benchmarks/row_reorder.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

CASES = (("gpt2 bench, 5 beams", (5, 16, 160, 64), 24),
         ("llama2048x22, 5 beams", (5, 4, 160, 64), 44),
         ("gpt2 bench, batch 8 x 5 beams", (40, 16, 160, 64), 24))


def graph_us(fn: Callable[[], None], replays: int = 20, per_graph: int = 10) -> float:
    """Microseconds per call of ``fn``, captured ``per_graph`` times in one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / (replays * per_graph) * 1e6


def ways(shape: tuple[int, ...], n: int) -> dict[str, Callable[[], None]]:
    rows = shape[0]
    order = (torch.tensor([1, 1, 0, 3, 2], device="cuda").repeat(rows // 5)
             + torch.arange(rows, device="cuda") // 5 * 5)
    per = torch.Size(shape[1:]).numel()
    separate = [torch.randn(shape, device="cuda", dtype=torch.half) for _ in range(n)]
    temporaries = [torch.empty_like(t) for t in separate]
    outer = torch.randn(rows, n * per, device="cuda", dtype=torch.half)
    stacked = torch.randn(n, rows, per, device="cuda", dtype=torch.half)
    matrix = stacked.view(n * rows, per)
    firsts = torch.arange(0, n * rows, rows, device="cuda").view(-1, 1)

    def per_tensor():
        for t in separate:
            t.copy_(t.index_select(0, order))

    def per_tensor_foreach_copy():
        for t, u in zip(separate, temporaries, strict=True):
            torch.index_select(t, 0, order, out=u)
        torch._foreach_copy_(separate, temporaries)

    def per_tensor_advanced():
        for t in separate:
            t.copy_(t[order])

    def rows_outer_index_select():
        outer.copy_(outer.index_select(0, order))

    def rows_outer_advanced():
        outer.copy_(outer[order])

    def stacked_dim1_index_select():
        stacked.copy_(stacked.index_select(1, order))

    def stacked_dim1_advanced():
        stacked.copy_(stacked[:, order])

    def stacked_as_matrix_index_select():
        matrix.copy_(matrix.index_select(0, (firsts + order.view(1, -1)).view(-1)))

    def stacked_as_matrix_advanced():
        matrix.copy_(matrix[(firsts + order.view(1, -1)).view(-1)])

    return {f.__name__: f for f in (
        per_tensor, per_tensor_foreach_copy, per_tensor_advanced, rows_outer_index_select,
        rows_outer_advanced, stacked_dim1_index_select, stacked_dim1_advanced,
        stacked_as_matrix_index_select, stacked_as_matrix_advanced)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ.get("OUT", "/tmp")) / "row_reorder.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    for name, shape, n in CASES:
        row = {"case": name, "shape": list(shape), "tensors": n,
               "MB": round(n * torch.Size(shape).numel() * 2 / 1e6, 1)}
        row.update({way: round(graph_us(fn), 1) for way, fn in ways(shape, n).items()})
        results.append(row)
        print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(results, indent=1))
    names = [key for key in results[0] if key not in ("case", "shape", "tensors", "MB")]
    print(f"\n{'us per reorder':32}" + "".join(f"{r['case'][:14]:>16}" for r in results))
    for way in names:
        print(f"{way:32}" + "".join(f"{r[way]:16.1f}" for r in results))


if __name__ == "__main__":
    main()
