"""Which library settings keep a kernel's launch attributes fixed across shapes (GPU).

A family's executable takes any shape whose graph has its topology in place, except where a
kernel's launch attributes change (Hopper GEMM and convolution kernels choose their cluster
shape by size): such a shape needs another executable. Wav2Vec2-base over 101 audio lengths
kept 45 executables for 7 topologies on the H200 (``benchmarks/README.md``). This captures the
encoder (fp16, batch 1) at ``--lengths`` audio lengths into the IR under each of a few
library settings, in one process, and counts what a family would need under each: topologies
(structure alone), executables (topology and every kernel's attributes), the kernels whose
attributes change, and the longest length's eager step time (median of ten), so that a setting
that saves executables is weighed against what it costs per step.

Settings: ``default``; ``cublas`` and ``cublaslt`` (``torch.backends.cuda.preferred_blas_library``);
``no_cudnn`` (``torch.backends.cudnn.enabled = False``: convolutions by PyTorch's own kernels).

python benchmarks/launch_attributes.py [--lengths 16000:160000:7200] [--out FILE]

On the H200 (benchmarks/README.md, run 63) no setting helped: 45 executables for 7 topologies
under each BLAS setting, 46 for 22 without cuDNN. Families take such shapes by alternates
instead (``grape.passes.variants``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from grape.ir import Kernel, fingerprint
from grape.torch.capture import capture

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import _range, wav2vec2_audio


@contextlib.contextmanager
def setting(name: str):
    """The process-wide library state ``name`` stands for, restored after."""
    blas = torch.backends.cuda.preferred_blas_library()
    cudnn = torch.backends.cudnn.enabled
    try:
        if name in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(name)
        elif name == "no_cudnn":
            torch.backends.cudnn.enabled = False
        elif name != "default":
            raise SystemExit(f"expected a setting among default, cublas, cublaslt, no_cudnn, "
                             f"found {name!r}")
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(blas)
        torch.backends.cudnn.enabled = cudnn


def attributes_by_node(graph) -> tuple:
    """Every kernel's launch attributes, in node order (what an executable cannot change)."""
    return tuple((node, op.attributes) for node, op in sorted(graph.ops())
                 if isinstance(op, Kernel))


def measure(w, lengths: list[int], name: str) -> dict[str, object]:
    with setting(name):
        graphs = {}
        for n in lengths:
            cap = capture(lambda n=n: w.step(n), params=w.params, instantiate=False)
            graphs[n] = cap.ir
            del cap
        topologies: dict[str, list[int]] = {}
        for n, g in graphs.items():
            topologies.setdefault(fingerprint(g, launch=False), []).append(n)
        executables, changing = 0, Counter()
        for shapes in topologies.values():
            signatures = {attributes_by_node(graphs[n]) for n in shapes}
            executables += len(signatures)
            first = dict(attributes_by_node(graphs[shapes[0]]))
            for n in shapes[1:]:
                for node, attrs in attributes_by_node(graphs[n]):
                    if attrs != first.get(node):
                        changing[graphs[n].op(node).name[:90]] += 1
        times = []
        with torch.no_grad():
            for _ in range(12):
                torch.cuda.synchronize()
                t = time.perf_counter()
                w.step(lengths[-1])
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t) * 1e3)
    return {"setting": name, "lengths": len(lengths), "topologies": len(topologies),
            "executables": executables, "kernels_whose_attributes_change": dict(changing),
            "eager_step_ms_longest": statistics.median(times[2:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="16000:160000:7200", metavar="FIRST:LAST[:STRIDE]")
    parser.add_argument("--settings", default="default,cublas,cublaslt,no_cudnn")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE")
    args = parser.parse_args()
    lengths = _range(args.lengths, "--lengths", 1, 480000)
    w = wav2vec2_audio(lengths)
    rows = []
    for name in args.settings.split(","):
        t = time.perf_counter()
        try:
            rows.append(measure(w, lengths, name))
        except Exception as e:  # a setting whose capture breaks: say so, go on
            rows.append({"setting": name, "failed": f"{type(e).__name__}: "
                                                    f"{str(e).splitlines()[0][:200]}"})
        print(json.dumps(rows[-1]), f"({time.perf_counter() - t:.1f} s)", file=sys.stderr,
              flush=True)
    print(f"{'setting':>10} {'topologies':>10} {'executables':>11} {'eager ms':>9}")
    for r in rows:
        if "failed" in r:
            print(f"{r['setting']:>10} failed: {r['failed']}")
        else:
            print(f"{r['setting']:>10} {r['topologies']:>10} {r['executables']:>11} "
                  f"{r['eager_step_ms_longest']:>9.2f}")
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "torch": torch.__version__, "command": " ".join(sys.argv),
                                        "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
