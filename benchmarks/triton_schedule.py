"""The kernels Inductor's Triton scheduling makes of a compiled decode step, without a GPU.

A session without a GPU cannot compile a step's Triton kernels, but Inductor decides which
operations share a kernel before it writes any: its scheduler fuses nodes by the rules of the
backend that will generate them. With ``torch._inductor.config.cpu_backend = "triton"`` (and
Triton importable: ``pip install --target DIR triton``, then ``PYTHONPATH=DIR``) the scheduler
fuses a CPU model's step by Triton's rules, the ones a GPU's step is fused by. This script
records the scheduled nodes of each graph compiled (``Scheduler.codegen``, replaced: each
graph stops there, and the decoder runs that step eagerly), and prints, for the largest graph
(the step's forward), its kernels by kind and the reductions by size (outputs x reduced
length), for each way asked:

- ``compiled``: ``CompiledStep`` as ``grape.generate(compile=True)`` makes it;
- ``row_statistics``: the same with ``CompiledStep.row_statistics`` on
  (``grape.torch.row_statistics``);
- ``factored_statistics``: the same with ``CompiledStep.factored_statistics`` on
  (``grape.torch.row_statistics.factor_statistics``);
- ``sibling_products``: the same with ``CompiledStep.sibling_products`` on
  (``grape.torch.sibling_products``; the default since 93b9b87, ``compiled`` the same);
- ``unstacked``: the same with it off (the step before 93b9b87).

Inductor decomposes a one-row ``mm`` before grape's passes on a GPU, not on a CPU
(``grape.torch.gpu_decompositions``): the script decomposes it as a GPU does, so that the
passes see the graph they see there. (Its results before that, kept in
``results/triton_schedule_cpu/`` as ``*_mm_kept.json``, showed Llama's statistics rewritten
where an H100's compilation never rewrote them.)

What it cannot show: the grids (they come from autotuning, on the device), split
reductions (Inductor sizes them by the device's multiprocessors; here the CPU's cores), the
kernels' times, and how a GPU's ``cat`` is made: Inductor lowers every ``cat`` on a CPU as a
``ConcatKernel``, one kernel per input, where on a GPU its heuristics may compute it
pointwise, in one (``torch._inductor.lowering.cat``). The pointwise counts overstate a GPU's
where a step concatenates: Llama's rotary embeddings, four kernels a layer here. A GPU
decides those: ``benchmarks/compiled_step_kernels.py``.
Written against torch 2.13's scheduler (``Scheduler.codegen``, ``BaseSchedulerNode.group``).

Run (CPU): PYTHONPATH=DIR python benchmarks/triton_schedule.py [--size llama2048x22]
[--arch llama] [--ways compiled,row_statistics] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import sys
import warnings
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))
from generate import ARCHS, SIZES, build

WAYS = {"compiled": {}, "row_statistics": {"row_statistics": True},
        "factored_statistics": {"factored_statistics": True},
        "sibling_products": {"sibling_products": True},
        "unstacked": {"sibling_products": False}}


class _Scheduled(Exception):
    """Raised where codegen would start: the graph's kernels are recorded."""


def _recording(graphs: list[list[dict[str, Any]]]) -> Any:
    def codegen(self: Any) -> None:
        nodes = []
        for node in self.nodes:
            if not hasattr(node, "group"):  # (a node that launches nothing: a view, a no-op)
                continue
            kind = ("extern" if node.is_extern() else "reduction" if node.is_reduction()
                    else "template" if node.is_template() else "pointwise")
            size = node.group[1] if kind in ("reduction", "pointwise") else ()
            nodes.append({"kind": kind, "size": [str(s) for s in size],
                          "operations": len(node.get_nodes())})
        graphs.append(nodes)
        raise _Scheduled
    return codegen


def schedule(model: torch.nn.Module, switches: dict[str, bool]) -> list[list[dict[str, Any]]]:
    """The scheduled nodes of every graph compiled while ``model`` decodes two tokens of a
    one-row prompt with a ``CompiledStep`` made with ``switches``."""
    from grape.torch.compiled_step import CompiledStep
    from grape.torch.decoding import TokenDecoder
    from grape.torch.gpu_decompositions import one_row_mm_as_on_a_gpu
    from grape.torch.options import resolve

    ids = torch.randint(3, 500, (1, 8), generator=torch.Generator().manual_seed(0))
    options, mask = resolve(model, ids, None, {"max_new_tokens": 2})
    graphs: list[list[dict[str, Any]]] = []
    with contextlib.ExitStack() as stack:
        for name, on in switches.items():
            stack.enter_context(mock.patch.object(CompiledStep, name, on))
        stack.enter_context(torch._inductor.config.patch(cpu_backend="triton",
                                                         force_disable_caches=True))
        stack.enter_context(mock.patch("torch._inductor.scheduler.Scheduler.codegen",
                                       _recording(graphs)))
        # (one-row products decomposed before grape's passes, as a GPU's compilation does)
        stack.enter_context(one_row_mm_as_on_a_gpu())
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        torch._dynamo.reset()
        step = CompiledStep(model, dynamic=False)
        decoder = TokenDecoder(model, 1, ids.shape[1], options, step_model=step)
        # (each compiled graph stops at codegen; where the decoder does not fall back to the
        # eager forward by itself, the first step's recording is all there is)
        with contextlib.suppress(Exception):
            decoder.generate_on_host(ids, mask)
    return graphs


def summary(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    kinds = collections.Counter(n["kind"] for n in nodes)
    reductions = collections.Counter(" x ".join(n["size"]) for n in nodes
                                     if n["kind"] == "reduction")
    one_output = sum(c for s, c in reductions.items() if s.split(" x ")[0] == "1")
    return {"kernels": len(nodes), "by_kind": dict(kinds), "reductions": dict(reductions),
            "reductions_of_one_output": one_output}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="llama2048x22", choices=sorted(SIZES))
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--out", metavar="FILE")
    args = parser.parse_args()
    ways = args.ways.split(",")
    if unknown := [w for w in ways if w not in WAYS]:
        parser.error(f"expected ways among {sorted(WAYS)}, found {unknown}")
    try:
        import triton
    except ImportError:
        parser.error("expected Triton importable (Inductor's Triton scheduling), found none: "
                     "pip install --target DIR triton, then PYTHONPATH=DIR")
    model = build(args.arch, SIZES[args.size], dtype=args.dtype, device="cpu")
    rows = []
    for way in ways:
        print(f"[+] {way}", file=sys.stderr, flush=True)
        graphs = schedule(model, WAYS[way])
        if not graphs:
            raise SystemExit(f"{way}: no graph reached Inductor's scheduler")
        forward = max(graphs, key=len)
        rows.append({"way": way, "graphs": len(graphs), **summary(forward)})
    print(f"{args.arch} {args.size}, {args.dtype}: the step's forward as Inductor's Triton "
          f"scheduling fuses it (no GPU: sizes, not grids)")
    width = max(len(r["way"]) for r in rows) + 2
    print(f"{'way':<{width}}{'kernels':>9}{'reductions':>12}{'of 1 output':>13}{'pointwise':>11}"
          f"{'extern':>8}")
    for r in rows:
        k = r["by_kind"]
        print(f"{r['way']:<{width}}{r['kernels']:>9}{k.get('reduction', 0):>12}"
              f"{r['reductions_of_one_output']:>13}{k.get('pointwise', 0):>11}"
              f"{k.get('extern', 0):>8}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU",
                       "torch": torch.__version__, "triton": triton.__version__,
                       "command": " ".join(sys.argv),
                       "arch": args.arch, "size": args.size, "dtype": args.dtype,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
