"""Which kernels a decoding step holds, uncompiled and with ``compile=True`` (GPU).

A batch (``--batch``, 1 unless said) of 32-token prompts, 128 new tokens, for each strategy asked
and the ways asked (``--ways``, all unless said):

- ``eager``: ``grape.generate(compile=False)``;
- ``compiled_gemms``: ``compile=True`` with the step's one-row biased products left to
  Inductor's GEMMs (``CompiledStep.thin_matmuls`` off: the step as it was before
  ``grape.torch.thin_matmuls``);
- ``compiled_repeat_kv``: ``compile=True`` with grouped-query attention's keys and values
  repeated per query head, as transformers does (``CompiledStep.grouped_queries`` off: the
  step as it was before ``grape.torch.grouped_queries``);
- ``compiled_in_out``: ``compile=True`` with one-row products by weights stored (in, out)
  (GPT-2's ``Conv1D``) reading those weights as they lie (``CompiledStep.weight_rows`` off:
  the step as it was before ``grape.torch.weight_rows``);
- ``compiled_row_kernels``: ``compile=True`` with the step's one-row products run by
  grape's Triton GEMV (``CompiledStep.row_kernels`` on: ``grape.torch.triton_gemv``, an
  experiment, off by default);
- ``compiled_plain``: ``compile=True`` with Inductor's Triton kernels launched plainly
  (``CompiledStep.dependent_launch`` off: the step as it was before);
- ``compiled_pdl``: ``compile=True`` with Inductor's Triton kernels launched dependently
  (``CompiledStep.dependent_launch`` on: programmatic dependent launch, Hopper and later),
  each kernel's launch overlapping the tail of the one before, programmatic edges kept only
  out of kernels launched dependently (``grape.passes.dependent_launch``);
- ``compiled_pdl_captured``: the same kernels (Inductor's cache serves ``compiled_pdl``'s
  where it ran first in the process), the loop built with every edge as captured;
- ``compiled_pdl_full``: the same kernels, the loop built with every edge a full
  dependency, so that a kernel waits for the whole of the one before as it would launched
  plainly: against ``compiled_pdl``, what the programmatic edges do; against ``compiled``,
  what the kernels compiled for PDL do;
- ``compiled_no_cd``: ``compile=True`` with Inductor's options as ``max-autotune`` gives
  them less coordinate-descent tuning (each kernel's configuration from Inductor's own
  candidates), to see whether the tuning's choices are what makes two compilations of one
  step run at different speeds;
- ``compiled_row_statistics``: ``compile=True`` with each one-row product whose row a norm
  made reducing the norm's statistic again per output, in its own kernel
  (``CompiledStep.row_statistics`` on: ``grape.torch.row_statistics``, an experiment, off by
  default), where the other ways read the row a kernel of one block normalised first;
- ``compiled_factored_statistics``: ``compile=True`` with each such product, where its row is
  a sum of a few rows scaled by the statistics, reducing those rows and the statistics in
  one loop and scaling after (``CompiledStep.factored_statistics`` on:
  ``grape.torch.row_statistics.factor_statistics``, an experiment, off by default);
- ``compiled_sibling_products``: ``compile=True`` with the products that share their rows and
  differ in size (a layer's query, key and value where keys have fewer heads) as one
  product by a copy of their weights stacked (``CompiledStep.sibling_products`` on:
  ``grape.torch.sibling_products``; the default since 93b9b87, so ``compiled`` is the same);
- ``compiled_unstacked``: ``compile=True`` with ``CompiledStep.sibling_products`` off (the
  step as it was before 93b9b87);
- ``compiled_exact``: ``compile=True, exact_lengths=True``: each token's attention over the
  keys that exist, by FlashAttention's variable-length kernel reading the lengths on the
  device (``grape.torch.exact``), where the other ways attend over the whole cache, masked;
- ``compiled``: ``compile=True`` as a user calls it.

For each: the step's node count and longest path, its kernels by origin (Inductor's Triton
kernels, GEMM libraries', attention's, PyTorch's eager kernels, copies), the eager kernels by
name, Inductor's by kind and what they fuse, and ms a token: ``--rounds`` rounds, each
timing every way in turn (three calls after one untimed), the median round kept, so that
the ways are measured side by side. The compiled ways compile the step apart; their
kernels add in other orders, so the table gives, for each other compiled way, how many of
its tokens agree with ``compiled``'s (the first difference ends the comparison: after it,
the two continue different texts) and the largest difference of the scores of their first
step.

Run on a GPU: python benchmarks/compiled_step_kernels.py [--size gpt2small] [--arch gpt2]
[--strategies greedy,sample] [--ways eager,compiled] [--rounds 5] [--batch 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))
from generate import SIZES, STRATEGIES, build

import grape
from grape.ir import Kernel, KernelGraph
from grape.torch.api import _CACHES, last_stats
from grape.torch.compiled_step import CompiledStep

NEW = 128
# way -> (compile=, CompiledStep's switches set otherwise than by default, grape.generate's
# other arguments)
WAYS = {"eager": (False, {}, {}), "compiled_gemms": (True, {"thin_matmuls": False}, {}),
        "compiled_repeat_kv": (True, {"grouped_queries": False}, {}),
        "compiled_in_out": (True, {"weight_rows": False}, {}),
        "compiled_row_kernels": (True, {"row_kernels": True}, {}),
        "compiled_plain": (True, {"dependent_launch": False}, {}),
        "compiled_pdl": (True, {"dependent_launch": True}, {}),
        "compiled_pdl_full": (True, {"dependent_launch": True}, {}),
        "compiled_pdl_captured": (True, {"dependent_launch": True}, {}),
        "compiled_no_cd": (True, {}, {}),
        "compiled_row_statistics": (True, {"row_statistics": True}, {}),
        "compiled_factored_statistics": (True, {"factored_statistics": True}, {}),
        "compiled_sibling_products": (True, {"sibling_products": True}, {}),
        "compiled_unstacked": (True, {"sibling_products": False}, {}),
        "compiled_exact": (True, {}, {"exact_lengths": True}), "compiled": (True, {}, {})}



def _rewrites() -> dict[str, int]:
    """Dynamo's counts of grape's graph rewrites so far in this process (``grape_*``: the
    thin-matmul pass's, the statistics forms', grape's GEMV's)."""
    from torch._dynamo.utils import counters

    return {k: v for k, v in counters["inductor"].items() if k.startswith("grape_")}


def _blocks(op: Any) -> int:
    return op.grid[0] * op.grid[1] * op.grid[2] if isinstance(op, Kernel) else 0


# ways whose loops are built otherwise than grape builds them: the patch that does it
class _NoCoordinateDescent(CompiledStep):
    """A compiled step whose Inductor options are ``max-autotune-no-cudagraphs``'s without
    coordinate-descent tuning."""

    def __init__(self, model: torch.nn.Module, **options: Any) -> None:
        options.pop("mode", None)
        super().__init__(model, options={"max_autotune": True,
                                         "coordinate_descent_tuning": False}, **options)


BUILDS = {
    "compiled_no_cd": lambda: mock.patch("grape.torch.api.CompiledStep", _NoCoordinateDescent),
    "compiled_pdl_captured": lambda: mock.patch("grape.torch.loop.dependent_edges",
                                                lambda graph: graph),
    "compiled_pdl_full": lambda: mock.patch.object(KernelGraph, "kinds_into",
                                                   lambda self, node: {}),
}
# CompiledStep's switches and their defaults, put back after each way
SWITCHES = {name: getattr(CompiledStep, name)
            for name in ("thin_matmuls", "grouped_queries", "row_kernels", "weight_rows",
                          "dependent_launch", "row_statistics", "factored_statistics",
                          "sibling_products")}


def origin(name: str) -> str:
    if name.startswith("triton"):
        return "inductor"
    # (attention first: cuDNN's Hopper attention kernels are named sm90_flash_..._wgmma)
    if any(s in name for s in ("flash", "fmha", "sdpa", "attention")):
        return "attention"
    if any(s in name for s in ("gemm", "nvjet", "cutlass", "sm90")):
        return "gemm"
    return "eager"


def kernels(entry: Any) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """The step's nodes by origin, its eager kernels by (shortened) name, and Inductor's by
    kind (``triton_per``sistent reduction, ``triton_red``uction, ``triton_poi``ntwise,
    ``triton_tem``plate) and what they fuse, their index dropped."""
    kinds: collections.Counter[str] = collections.Counter()
    eager: collections.Counter[str] = collections.Counter()
    inductor: collections.Counter[str] = collections.Counter()
    for _, op in entry.loop.capture.ir.ops():
        if isinstance(op, Kernel):
            kinds[origin(op.name)] += 1
            if origin(op.name) == "eager":
                eager[op.name[:110]] += 1
            elif origin(op.name) == "inductor":
                inductor[op.name.rstrip("0123456789").rstrip("_")] += 1
        else:
            kinds[type(op).__name__] += 1
    for *_, kind in entry.loop.capture.ir.edges():  # (PDL's, where launched dependently)
        if kind is not None:
            kinds[f"{kind}_edges"] += 1
    return dict(kinds), dict(eager.most_common()), dict(inductor.most_common())


def step_ops(entry: Any) -> list[list[Any]]:
    """The step's nodes in order: name (shortened), blocks, threads a block, and the kinds of
    the edges into it other than full ones."""
    ir = entry.loop.capture.ir
    return [[getattr(op, "name", type(op).__name__)[:80], _blocks(op),
             op.block[0] * op.block[1] * op.block[2] if isinstance(op, Kernel) else 0,
             sorted(set(ir.kinds_into(node).values()))] for node, op in ir.ops()]


def agreement(ours: torch.Tensor, theirs: torch.Tensor, our_scores: tuple[torch.Tensor, ...],
              their_scores: tuple[torch.Tensor, ...], prompt: int) -> dict[str, Any]:
    """How far two ways' generations agree: the tokens they return before their first
    difference (every token where none), and the largest difference of the scores of their
    first step after the prompt, the one step certain to run on the same inputs in both
    (finite scores only: a beam's -inf agrees). The first scores come from the prefill."""
    ours, theirs = ours[:, prompt:], theirs[:, prompt:]
    n = min(ours.shape[1], theirs.shape[1])
    differ = (ours[:, :n] != theirs[:, :n]).any(dim=0).nonzero()
    a, b = our_scores[1], their_scores[1]
    gap = (a - b)[torch.isfinite(a) & torch.isfinite(b)].abs().max()
    return {"tokens_before_first_difference": int(differ[0]) if len(differ) else n,
            "tokens_compared": n, "step_scores_max_abs_diff": float(gap),
            "step_scores_max_abs": float(b[torch.isfinite(b)].abs().max())}


def measure(model: torch.nn.Module, strategy: str, rounds: int, batch: int,
            ways: list[str]) -> list[dict[str, Any]]:
    ids = torch.randint(3, 1000, (batch, 32), device="cuda")
    kw = dict(STRATEGIES[strategy], max_new_tokens=NEW, pad_token_id=0)
    built: dict[str, tuple[Any, Any]] = {}  # way -> (its cache key, its entry)
    rows: dict[str, dict[str, Any]] = {}
    tokens: dict[str, torch.Tensor] = {}
    scores: dict[str, tuple[torch.Tensor, ...]] = {}
    for way in ways:
        compile, switches, given = WAYS[way]
        for switch, value in switches.items():
            setattr(CompiledStep, switch, value)
        try:
            if compile and model in _CACHES:  # (a compiled step of this way's own)
                _CACHES[model].compiled = None
            began, before = time.perf_counter(), _rewrites()
            with BUILDS[way]() if way in BUILDS else contextlib.nullcontext():
                grape.generate(model, ids, compile=compile, seed=7, **given, **kw)
            seconds = time.perf_counter() - began
            # (what grape's passes rewrote while this way compiled: 0 where Inductor's cache
            # served a graph compiled before, whose passes did not run again)
            rewrites = {k: v - before.get(k, 0) for k, v in _rewrites().items()
                        if v != before.get(k, 0)}
            s = last_stats()
            entries = _CACHES[model].entries
            key = next(iter(entries))  # (each way's entry is taken out once built and timed)
            # (the compiled ways have one key: each keeps its own entry, put back to be timed)
            built[way] = (key, entries.pop(key))
            if compile:  # each step's scores through this way's compiled step
                out = grape.generate(model, ids, compile=True, seed=7, output_scores=True,
                                     return_dict_in_generate=True, **given, **kw)
                scores[way] = out.scores
                kept = _CACHES[model].entries
                kept.pop(next(iter(kept))).loop.close()
        finally:
            for switch, value in SWITCHES.items():
                setattr(CompiledStep, switch, value)
        kinds, eager, inductor = kernels(built[way][1])
        rows[way] = {"strategy": strategy, "way": way, "graphed": s.graphed,
                     "compiled": s.compiled, "step_nodes": s.step_nodes,
                     "built_otherwise": way in BUILDS, "dependent_edges": s.dependent_edges,
                     "step_ops": step_ops(built[way][1]),
                     "step_depth": s.step_depth, "build_s": round(seconds, 1),
                     "weight_copy_bytes": s.weight_copy_bytes,
                     "kinds": kinds, "eager_kernels": eager, "rewrites": rewrites,
                     "inductor_kernels": inductor, "rounds_ms": []}
        print(f"{strategy} {way}: graphed {s.graphed} compiled {s.compiled} nodes "
              f"{s.step_nodes} depth {s.step_depth} built in {seconds:.1f} s {kinds} "
              f"rewrites {rewrites} weight copies {s.weight_copy_bytes / 1e6:.1f} MB",
              flush=True)
    for _ in range(rounds):
        for way in ways:
            key, entry = built[way]
            _CACHES[model].entries[key] = entry
            compile, _, given = WAYS[way]
            tokens[way] = grape.generate(model, ids, seed=7, compile=compile, **given, **kw)
            torch.cuda.synchronize()
            began = time.perf_counter()
            for _ in range(3):
                grape.generate(model, ids, seed=7, compile=compile, **given, **kw)
            torch.cuda.synchronize()
            new = tokens[way].shape[1] - ids.shape[1]
            rows[way]["rounds_ms"].append((time.perf_counter() - began) / 3 / new * 1e3)
            del _CACHES[model].entries[key]
    for way in ways:
        rows[way]["ms_per_token"] = statistics.median(rows[way]["rounds_ms"])
        if way in scores and way != "compiled" and "compiled" in scores:
            rows[way].update(agreement(tokens[way], tokens["compiled"], scores[way],
                                       scores["compiled"], ids.shape[1]))
    for _, entry in built.values():  # (grape.clear_cache would close the last only)
        entry.loop.close()
    return list(rows.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="gpt2small", choices=sorted(SIZES))
    parser.add_argument("--arch", default="gpt2")
    parser.add_argument("--strategies", default="greedy")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ways", default=",".join(WAYS),
                        help=f"comma-separated, of {', '.join(WAYS)}")
    parser.add_argument("--out", help="write every row here as JSON")
    args = parser.parse_args()
    ways = args.ways.split(",")
    if unknown := [w for w in ways if w not in WAYS]:
        parser.error(f"expected ways among {', '.join(WAYS)}, found {', '.join(unknown)}")
    model = build(args.arch, SIZES[args.size])
    rows = []
    for strategy in args.strategies.split(","):
        rows += measure(model, strategy, args.rounds, args.batch, ways)
    for row in rows:
        for origin_, names in (("eager", row["eager_kernels"]),
                               ("Inductor's", row["inductor_kernels"])):
            print(f"{row['strategy']} {row['way']} {origin_} kernels:")
            for name, count in names.items():
                print(f"   {count:3d} {name}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "command": " ".join(sys.argv), "batch": args.batch, "rows": rows},
                      f, indent=1)
    print(f"\n{args.arch} {args.size}, batch {args.batch}, {NEW} new tokens, median of "
          f"{args.rounds} rounds")
    print(f"{'strategy':<9} {'way':<18} {'nodes':>5} {'eager':>5} {'ms/token':>9}  "
          f"agreement with compiled")
    for row in rows:
        same = ("" if "tokens_compared" not in row else
                f"{row['tokens_before_first_difference']}/{row['tokens_compared']} tokens, "
                f"step's scores within {row['step_scores_max_abs_diff']:.3g} "
                f"(of {row['step_scores_max_abs']:.3g})")
        print(f"{row['strategy']:<9} {row['way']:<18} {row['step_nodes']:>5} "
              f"{row['kinds'].get('eager', 0):>5} {row['ms_per_token']:>9.3f}  {same}")


if __name__ == "__main__":
    main()
