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


def _prompt_choices(ir: Any) -> dict[str, bool]:
    """The prompt's attention IF pairs as this script's prompt makes them: no padding, so the
    first of each pair (the unmasked kernels) runs and the second does not."""
    import networkx as nx

    from grape.ir import Conditional, ConditionalKind

    pairs = [n for n in nx.topological_sort(ir.dag) if isinstance(ir.op(n), Conditional)
             and ir.op(n).type is ConditionalKind.IF]
    return {n: i % 2 == 0 for i, n in enumerate(pairs)}


def _predicted(irs: dict[str, Any], chain_trace: Path, iterations: int,
               chain_measured_us: float) -> dict[str, Any]:
    """Each way's launch on the simulated GPU from the chain's trace alone (``standalone``: its
    kernels' durations, the gap between them as the trace shows it), and the DAG's from the
    chain's trace and its timed launch (``from_timed_chain``: the gap a node adds calibrated so
    that the chain's launch takes what it measured, ``grape.sim.graph.calibrated_gap``). The
    prompt's IF choices are read from the trace where its streams or its operation count tell
    them (``grape.sim.traced_choices``), else taken from the prompt; durations are paired with the
    chain's nodes by position where the trace's operations number its node executions
    (``grape.sim.traced_durations``), else by kernel name."""
    import dataclasses

    from grape.errors import SimulationError
    from grape.profile import other_device, profile_for
    from grape.sim.graph import Choices, Durations, calibrated_gap, run_graph
    from grape.sim.traced_choices import choices_in_trace
    from grape.sim.traced_durations import node_durations
    from grape.sim.whatif import costs_from_profile
    from grape.trace import read_trace

    trace = read_trace(chain_trace)
    profile = profile_for(trace.gpu)  # the shipped profile of the trace's GPU, else the H200's
    costs = costs_from_profile(profile)
    chain = irs["chain"]
    out: dict[str, Any] = {"profile": profile.device}
    if why := other_device(profile, trace.gpu, chain_trace.name):
        out["profile_note"] = why
    try:
        taken = choices_in_trace(chain, trace.launches, chain_trace.name).taken
        out["choices"] = "read from the trace"
    except SimulationError as e:
        taken = _prompt_choices(chain)
        out["choices"] = f"the prompt's (the trace's: {e})"[:300]
    choices = Choices(iterations={"grape:while": iterations}, taken=taken)
    durations = Durations.from_trace(trace, chain_trace.name)
    launches = [launch for launch in trace.launches if launch.is_graph]
    try:
        paired = node_durations(chain, launches[-1].ops if launches else (), choices,
                                chain_trace.name)
        durations = dataclasses.replace(durations, nodes=paired.table)
        out["durations"] = (f"by position ({paired.renamed} of the trace's kernel records "
                            f"named otherwise)")
    except SimulationError as e:
        out["durations"] = f"by name (by position: {e})"[:300]
    out["standalone"] = {way: run_graph(ir, durations, costs, choices).gpu_time
                         for way, ir in irs.items()}
    timed = calibrated_gap(chain, durations, costs, choices, chain_measured_us)
    out["from_timed_chain"] = {"dag": run_graph(irs["dag"], timed, costs, choices).gpu_time,
                               "node_gap_us": timed.node_gap}
    return out


def _prediction_row(row: dict[str, Any], irs: dict[str, Any], traces: Path,
                    iterations: int) -> None:
    """``row`` with the simulator's predictions per token (see _predicted), or why none."""
    stem = f"{row['arch']}_{row['strategy']}"
    try:
        p = _predicted(irs, traces / f"{stem}_chain.kineto.json.gz", iterations,
                       row["chain_gpu_us_per_token"] * row["new_tokens"])
    except Exception as e:  # the what-if failing is a finding, not the end of the run
        row["predicted_us_per_token"] = f"{type(e).__name__}: {e}"[:300]
        return
    per = row["new_tokens"]
    row["predicted_us_per_token"] = {w: t / per for w, t in p["standalone"].items()}
    row["predicted_dag_from_timed_chain_us_per_token"] = p["from_timed_chain"]["dag"] / per
    row["prediction"] = {"choices": p["choices"], "durations": p["durations"],
                         "calibrated_node_gap_us": p["from_timed_chain"]["node_gap_us"],
                         "profile": p["profile"], **({"profile_note": p["profile_note"]}
                                                     if "profile_note" in p else {})}


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
        row["while_iterations"] = int(loops["chain"].decoder.count.item()) - 1  # prompt: one
        _prediction_row(row, irs, args.traces, row["while_iterations"])
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
    parser.add_argument("--predict-from", type=Path, default=None, metavar="RESULTS",
                        help="no GPU: the predictions again, for the rows of RESULTS (this "
                             "script's --out) from the IR and trace files it wrote in --traces")
    args = parser.parse_args()
    if args.predict_from is not None:
        _predict_again(args)
        return
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
    _table(rows)


def _table(rows: list[dict[str, Any]]) -> None:
    def miss(r: dict[str, Any], predicted: float | None, way: str) -> str:
        if predicted is None:
            return f"{'-':>8}"
        return f"{(predicted / r[f'{way}_gpu_us_per_token'] - 1) * 100:>+7.1f}%"

    print(f"{'arch':<10} {'strategy':<8} {'nodes':>6} {'depth':>6} {'chain us/tok':>12} "
          f"{'dag us/tok':>10} {'ratio':>6} {'equal':>6}  predicted against measured: "
          f"chain, DAG (from the chain's trace), DAG (and its timed launch)")
    for r in rows:
        if "failed" in r:
            print(f"{r['arch']:<10} {r['strategy']:<8} failed: {r['failed'][:60]}")
            continue
        p = r.get("predicted_us_per_token")
        p = p if isinstance(p, dict) else {}
        print(f"{r['arch']:<10} {r['strategy']:<8} {r['nodes']:>6} {r['depth']:>6} "
              f"{r['chain_gpu_us_per_token']:>12.1f} {r['dag_gpu_us_per_token']:>10.1f} "
              f"{r['ratio']:>6.3f} {r['tokens_equal']!s:>6}  {miss(r, p.get('chain'), 'chain')} "
              f"{miss(r, p.get('dag'), 'dag')} "
              f"{miss(r, r.get('predicted_dag_from_timed_chain_us_per_token'), 'dag')}")


def _predict_again(args: argparse.Namespace) -> None:
    from grape.ir import KernelGraph

    if args.traces is None:
        raise SystemExit("expected --traces DIR (the run's IR and trace files) with "
                         "--predict-from, found none")
    run = json.loads(args.predict_from.read_text())
    for row in run["results"]:
        if "failed" in row:
            continue
        irs = {way: KernelGraph.load(args.traces / f"{row['arch']}_{row['strategy']}_{way}"
                                                   f".ir.json.gz") for way in WAYS}
        iterations = row.get("while_iterations", row["new_tokens"] - 1)
        _prediction_row(row, irs, args.traces, iterations)
        print(json.dumps(row), flush=True)
    run["predicted_again"] = {"command": " ".join(sys.argv),
                              "from": str(args.predict_from)}
    if args.out:
        args.out.write_text(json.dumps(run, indent=1) + "\n")
    _table(run["results"])


if __name__ == "__main__":
    main()
