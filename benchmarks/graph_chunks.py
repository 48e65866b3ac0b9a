"""Where a graph's GPU time goes beyond its kernels' CUPTI durations, chunk by chunk (GPU).

The IR twin (``ir_twin.py``) predicts a greedy decode step within 0.1% from the durations
CUPTI gives its kernels, but a 5-beam step 24% short. This cuts a step's graph into
consecutive chunks of ``--nodes`` nodes (topological order, each chunk the nodes and the edges
among them), builds each chunk as an executable of its own, and times it alone with CUDA
events, each launch after a prefill and the chunks before it (so that the chunk finds what it
finds inside the step: a beam step reads its state at the token count it has not yet
advanced); then records profiled launches of the whole step for the kernels' CUPTI durations.
``--out`` writes both, per chunk, with the chunk's kernels by name, for the simulator's
per-chunk prediction (``grape.sim.graph.run_graph``) to be set beside.

python benchmarks/graph_chunks.py --out DIR [--decoder beam|greedy] [--nodes 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import networkx as nx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ir_twin import _profiled, _timed, twin_decoder, twin_model

from grape.cuda.build import Graph
from grape.ir import KernelGraph
from grape.torch.capture import capture


def chunks(graph: KernelGraph, size: int) -> list[KernelGraph]:
    """Consecutive pieces of ``size`` nodes in topological order, each with the whole table."""
    order = list(nx.topological_sort(graph.dag))
    pieces = []
    for start in range(0, len(order), size):
        nodes = set(order[start:start + size])
        piece = KernelGraph()
        for buffer in graph.buffers.values():
            piece.add_buffer(buffer)
        for node in order[start:start + size]:
            piece.add(node, graph.op(node),
                      after=[p for p in graph.dag.predecessors(node) if p in nodes])
        pieces.append(piece)
    return pieces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.add_argument("--decoder", choices=["beam", "greedy"], default="beam")
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--timed", type=int, default=30)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, ids = twin_model()
    decoder, mask = twin_decoder(model, ids, args.decoder, 64)
    params = dict(model.named_parameters())
    decoder.prefill(ids, mask)
    decoder.step()
    step = capture(decoder.step, params=params, warmup=0, instantiate=False)
    stream = torch.cuda.current_stream().cuda_stream
    whole = Graph.build(step.ir)
    whole_exe = whole.instantiate()

    def fresh() -> None:  # the step's inputs as a step finds them: after a prefill
        decoder.prefill(ids, mask)

    whole_us = statistics.median(_timed(lambda: whole_exe.launch(stream), args.timed, fresh))
    pieces = chunks(step.ir, args.nodes)
    built = [Graph.build(piece) for piece in pieces]
    exes = [graph.instantiate() for graph in built]
    rows = []
    for i, (piece, exe) in enumerate(zip(pieces, exes, strict=True)):
        def before(i=i) -> None:  # the state the chunk finds inside the step
            fresh()
            for earlier in exes[:i]:
                earlier.launch(stream)

        us = statistics.median(_timed(lambda exe=exe: exe.launch(stream), args.timed, before))
        # Mangled, as the IR holds them (demangling needs cxxfilt, which the GPU host lacks).
        names = [op.name if op.kind == "kernel" else op.kind for _, op in piece.ops()]
        rows.append({"chunk": i, "nodes": list(piece.dag.nodes), "gpu_us": us,
                     "kinds": names})
        print(f"chunk {i}: {piece.dag.number_of_nodes()} nodes, {us:.1f} us", flush=True)
    for exe, graph in zip(exes, built, strict=True):
        exe.close()
        graph.close()
    step.ir.save(args.out / f"{args.decoder}_step.ir.json.gz")
    _profiled(lambda: whole_exe.launch(stream), 5, args.out / f"{args.decoder}_step.kineto.json.gz",
              fresh)
    (args.out / f"{args.decoder}_chunks.json").write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "command": " ".join(sys.argv), "whole_step_gpu_us": whole_us, "chunks": rows},
        indent=1) + "\n")
    print(f"whole step {whole_us:.1f} us; chunks add up to "
          f"{sum(r['gpu_us'] for r in rows):.1f} us")
    whole_exe.close()
    whole.close()


if __name__ == "__main__":
    main()
