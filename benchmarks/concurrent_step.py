"""What ``grape.generate(concurrent=True)`` buys, why, and whether the simulator foresaw it.

For each architecture (``generate.py``'s models, built from configs with random weights) and
strategy, side by side in one process: grape's generation as one launch whose step is the
captured chain (``chain``) and the same with the step remade as the DAG its memory demands
(``dag``, ``grape.passes.concurrency``). Each entry has:

- ``gpu_us_per_token``: the launch's GPU time (CUDA events, the stream spinning before the
  first so that the launch call's host time stays outside) over the new tokens, median of
  ``--repeats`` launches, the two ways alternating;
- ``tokens_equal``: the DAG's generation against the chain's, token for token;
- the step's ``nodes``, ``depth`` (nodes on its longest path), ``groups``, and which operations
  were ``barriers`` or ``widened`` (pointers outside what the dispatcher declared), counted by
  name: why a step stayed serial; and whose own kernels held ``stale`` words (another
  operation's tensor, left out);
- with ``--traces DIR``: each launch's IR (``<arch>_<strategy>_<way>.ir.json.gz``) and a
  torch.profiler trace of one launch (``.kineto.json.gz``, open it in Perfetto), the kernels'
  overlap in it (``kernel_busy_us`` summed against ``kernel_span_us`` covered, over the kernels
  the trace holds: CUPTI recorded 3,470 of a GPT-2 loop's 107,730 in
  ``traces/h200_ir/twin_loop.kineto.json.gz``, so a ratio, not a total), and the
  simulator's prediction of both launches from the chain's trace alone (``predicted_us``:
  ``grape.sim.graph.run_graph`` over each IR with the chain's kernel durations): the what-if a
  user would run before trying ``concurrent=True``.

Run on a GPU: python benchmarks/concurrent_step.py [--archs gpt2,llama] [--strategies
greedy,beam5] [--size bench] [--new 64] [--traces DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from generate import SIZES, STRATEGIES, build
from ir_twin import _profiled, _timed

WAYS = {"chain": False, "dag": True}


def _overlap(path: Path) -> dict[str, float]:
    """Kernel time summed, and the time some kernel ran, in a torch.profiler trace."""
    import gzip

    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") == "kernel")
    busy = sum(b - a for a, b in spans)
    covered, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            covered += b - max(a, end)
            end = b
    return {"kernel_busy_us": busy, "kernel_span_us": covered,
            "overlap": busy / covered if covered else None}


def _predicted(irs: dict[str, Any], chain_trace: Path, iterations: int) -> dict[str, float]:
    """Each way's launch on the simulated GPU, with the chain's kernel durations and the
    choices its trace shows the prompt's attention IF nodes making (the streams their bodies
    ran on: ``grape.sim.traced_choices``)."""
    import dataclasses

    from grape.profile import DEFAULT_PROFILE, load_profile
    from grape.sim.graph import Choices, Durations, run_graph
    from grape.sim.traced_choices import choices_in_trace
    from grape.sim.whatif import costs_from_profile
    from grape.trace import read_trace

    costs = costs_from_profile(load_profile(DEFAULT_PROFILE))
    trace = read_trace(chain_trace)
    durations = Durations.from_ops(trace.gpu_ops, chain_trace.name)
    loop = Choices(iterations={"grape:while": iterations})
    predicted = {}
    for way, ir in irs.items():
        seen = choices_in_trace(ir, trace.launches, chain_trace.name)
        choices = dataclasses.replace(loop, taken=seen.taken, branch=seen.branch)
        predicted[way] = run_graph(ir, durations, costs, choices).gpu_time
    return predicted


def measure(model, arch: str, strategy: str, args) -> dict[str, Any]:
    import torch

    import grape
    from grape.torch.api import _CACHES, clear_cache

    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (1, args.prompt),
                        generator=torch.Generator().manual_seed(1)).cuda()
    kw = dict(STRATEGIES[strategy], max_new_tokens=args.new, eos_token_id=None, pad_token_id=0)
    loops, tokens = {}, {}
    for way, concurrent in WAYS.items():
        tokens[way] = grape.generate(model, ids, seed=7, concurrent=concurrent, **kw)
        entry = list(_CACHES[model].entries.values())[-1]  # the one this call built
        loops[way] = entry
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way, entry in loops.items():
            times[way] += _timed(entry.loop.launch, 1)
    row: dict[str, Any] = {"arch": arch, "strategy": strategy, "new_tokens": args.new,
                           "tokens_equal": bool(torch.equal(tokens["chain"], tokens["dag"]))}
    for way in loops:
        row[f"{way}_gpu_us_per_token"] = statistics.median(times[way]) / args.new
    dag = loops["dag"].loop.concurrency["body"]
    row.update(ratio=row["chain_gpu_us_per_token"] / row["dag_gpu_us_per_token"],
               nodes=dag.nodes, depth=dag.depth, groups=dag.groups, edges=dag.edges,
               barriers=dict(collections.Counter(dag.barriers).most_common()),
               widened=dict(collections.Counter(dag.widened).most_common()),
               stale=dict(collections.Counter(dag.stale).most_common()))
    if args.traces:
        args.traces.mkdir(parents=True, exist_ok=True)
        irs = {}
        for way, entry in loops.items():
            stem = f"{arch}_{strategy}_{way}"
            entry.loop.ir.save(args.traces / f"{stem}.ir.json.gz")
            _profiled(entry.loop.launch, 1, args.traces / f"{stem}.kineto.json.gz")
            row[f"{way}_trace"] = _overlap(args.traces / f"{stem}.kineto.json.gz")
            irs[way] = entry.loop.ir
        iterations = int(loops["chain"].decoder.count.item()) - 1  # the prompt made one
        try:
            predicted = _predicted(irs, args.traces / f"{arch}_{strategy}_chain.kineto.json.gz",
                                   iterations)
            row["predicted_us_per_token"] = {w: t / args.new for w, t in predicted.items()}
        except Exception as e:  # the what-if failing is a finding, not the end of the run
            row["predicted_us_per_token"] = f"{type(e).__name__}: {e}"[:300]
    clear_cache(model)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="gpt2,llama")
    parser.add_argument("--strategies", default="greedy,beam5")
    parser.add_argument("--size", choices=list(SIZES), default="bench")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--traces", type=Path, default=None, metavar="DIR")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the results as JSON here (nothing is written without it)")
    args = parser.parse_args()
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    rows = []
    for arch in args.archs.split(","):
        model = build(arch, SIZES[args.size])
        for strategy in args.strategies.split(","):
            try:
                row = measure(model, arch, strategy, args)
            except Exception as e:  # one that breaks: record it, measure the rest
                row = {"arch": arch, "strategy": strategy,
                       "failed": f"{type(e).__name__}: {e}"[:400]}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del model
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "torch": torch.__version__,
                                        "command": " ".join(sys.argv), "size": args.size,
                                        "results": rows}, indent=1) + "\n")
    print(f"{'arch':<10} {'strategy':<8} {'nodes':>6} {'depth':>6} {'chain us/tok':>12} "
          f"{'dag us/tok':>10} {'ratio':>6} {'equal':>6}")
    for r in rows:
        if "failed" in r:
            print(f"{r['arch']:<10} {r['strategy']:<8} failed: {r['failed'][:60]}")
            continue
        print(f"{r['arch']:<10} {r['strategy']:<8} {r['nodes']:>6} {r['depth']:>6} "
              f"{r['chain_gpu_us_per_token']:>12.1f} {r['dag_gpu_us_per_token']:>10.1f} "
              f"{r['ratio']:>6.3f} {r['tokens_equal']!s:>6}")


if __name__ == "__main__":
    main()
