"""The ``grape`` command.

Every error grape raises on purpose becomes one line on stderr and exit status 2; a traceback
means a bug in grape.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grape import __version__
from grape.errors import GrapeError, SimulationError, TraceFormatError
from grape.familyio import SCHEMA as FAMILY_SCHEMA
from grape.familyio import SavedFamily, family_from_json
from grape.ir import SCHEMA, KernelGraph
from grape.jsonio import dump_json, leading_schema, load_json
from grape.profile import DEFAULT_PROFILE, PROFILE_SCHEMA, DeviceProfile, profile_from_json
from grape.summary import family_summary, graph_summary, profile_summary, trace_summary
from grape.trace import Trace, read_trace, trace_from_json

__all__ = ["main"]



def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}")
    return value


def _amount(text: str) -> float:
    """A finite, non-negative number (argparse's float takes 'nan' and 'inf')."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite, non-negative number, found "
                                         f"{text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grape",
        description="CUDA graphs for dynamic DNNs: inspect traces, kernel graphs and device "
                    "profiles; measure a GPU; record workloads.")
    parser.add_argument("--version", action="version", version=f"grape {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = sub.add_parser(
        "info", help="what a trace, a kernel-graph file or a saved graph family holds",
        description="Summarise torch.profiler / grape traces (iterations, kernels, GPU busy "
                    "time, host launch time, graph launches, streams), grape IR files or saved "
                    "graph families. "
                    "Given an eager and a graphed trace of one workload, compares their "
                    "kernel counts.")
    info.add_argument("files", nargs="+", type=Path, metavar="FILE",
                      help="a .json or .json.gz trace, a grape IR file or a saved family")
    info.add_argument("--iterations", type=_positive, metavar="N",
                      help="split each trace into N equal iterations instead of detecting them")
    info.add_argument("--json", action="store_true", help="print one JSON object per file")
    info.set_defaults(run=_info)
    char = sub.add_parser(
        "characterize", help="measure this GPU's device profile (needs a GPU)",
        description="Measure, on the current GPU, the constants the simulator needs (launch, "
                    "instantiate, update, conditional-node, copy and memory costs, each "
                    "against what it depends on) and write them as a JSON device profile.")
    char.add_argument("--out", type=Path, required=True, metavar="FILE",
                      help="where to write the profile (the simulator's default is the package's "
                           "grape/profiles/h200.json)")
    char.add_argument("--reps", type=_positive, default=50, metavar="N",
                      help="repetitions per measured point (default 50)")
    char.add_argument("--only", default=None, metavar="STEP[,STEP]",
                      help="measure these steps of the driver-level profile only, and merge "
                           "them into the profile --out names where it exists (the rest of it "
                           "kept, each merged step dated in its 'remeasured' block); steps: "
                           "eager_launch, graph_launch, graph_gap, instantiate, update, "
                           "conditional, copies, graph_copy_nodes, memory")
    char.set_defaults(run=_characterize)
    rec = sub.add_parser(
        "record", help="record workloads eagerly and graphed as grape traces (needs a GPU)",
        description="Run workloads built from Hugging Face configs (random weights, fp16) "
                    "eagerly and captured in a CUDA graph; for each, measure wall time per "
                    "step without the profiler and write a torch.profiler trace of a few steps "
                    "with the measurement in its grape block.")
    rec.add_argument("specs", nargs="*", metavar="SPEC",
                     help="gpt2-small:b1:kv32, gpt2-medium:b8:kv1000, wav2vec2-base:16000, ...")
    rec.add_argument("--suite", action="store_true",
                     help="the committed set: GPT-2 small and medium decode (batch 1 and 8, "
                          "KV 32, 128, 512, 1000) and Wav2Vec2-base at three audio lengths")
    rec.add_argument("--out", type=Path, required=True, metavar="DIR")
    rec.add_argument("--modes", default="eager,graph",
                     help="comma-separated, among eager, graph (PyTorch's replay of the "
                          "capture) and grape (the capture rebuilt and launched by grape's "
                          "CUDA backend)")
    rec.add_argument("--timed", type=_positive, default=30, metavar="N",
                     help="timed steps per recording (median reported; default 30)")
    rec.add_argument("--profiled", type=_positive, default=3, metavar="N",
                     help="steps in each trace (default 3)")
    rec.add_argument("--cpu-ops", action="store_true",
                     help="profile PyTorch operators too (readable traces; their host cost varies "
                          "by model, so validation traces leave them out)")
    rec.add_argument("--calibration-rounds", type=int, default=5, metavar="N",
                     help="rounds measuring, in each recording's process, the profiler's host "
                          "cost per event and the host's pace after profiling, stored in the "
                          "trace for its eager replay (grape.torch.profiler_cost; 0: none)")
    rec.set_defaults(run=_record)
    sim = sub.add_parser(
        "simulate", help="predict a trace's wall time and what-ifs, with no GPU",
        description="Turn a trace into a program, replay it in the SimPy model with a device "
                    "profile's costs, and print measured, predicted and what-if figures side "
                    "by side.")
    sim.add_argument("trace", type=Path, metavar="TRACE",
                     help="a torch.profiler or grape trace, a kernel graph (*.ir.json, "
                          "*.ir.json.gz) to run on the simulated GPU, or a saved graph family "
                          "(*.family.json.gz) to run over a sequence of its shapes")
    sim.add_argument("--durations", type=Path, action="append", default=[], metavar="TRACE",
                     help="kernel graphs: a trace of the same kernels (their durations by name "
                          "and launch configuration); several merge, the first one's figure "
                          "winning")
    sim.add_argument("--while", dest="while_counts", action="append", default=[],
                     metavar="NODE=N", help="kernel graphs: WHILE node NODE iterates N times "
                                            "(default: as the first --durations trace shows, "
                                            "where it holds every operation of the loop)")
    sim.add_argument("--if", dest="if_taken", action="append", default=[],
                     metavar="NODE=taken|skipped",
                     help="kernel graphs: whether IF node NODE runs (default: as the first "
                          "--durations trace shows, by the streams the bodies ran on)")
    sim.add_argument("--switch", dest="switch_branches", action="append", default=[],
                     metavar="NODE=I", help="kernel graphs: the branch SWITCH node NODE takes "
                                            "(default: as for --if)")
    sim.add_argument("--durations-ir", type=Path, metavar="IR",
                     help="kernel graphs: the graph the first --durations trace launched, "
                          "where not this one (the chain a concurrent step was made from): "
                          "its nodes' durations, paired with the trace by position, carry over "
                          "to this graph's nodes of the same names")
    sim.add_argument("--timed", type=_amount, metavar="US",
                     help="kernel graphs: the GPU time of one launch of the graph the "
                          "durations trace launched (this one, or --durations-ir), measured "
                          "without the profiler (us): the time a node waits beyond the ones "
                          "before it is calibrated to it, which a profiled trace cannot say "
                          "(grape.sim.graph.calibrated_gap)")
    sim.add_argument("--sequence", metavar="SHAPES",
                     help="graph families: the shapes to run, in order, as A,B,... or "
                          "FIRST:LAST[:STRIDE] (default: every saved shape, as saved)")
    sim.add_argument("--launches", type=_positive, default=1, metavar="N",
                     help="kernel graphs: launches, each waited for (default 1)")
    sim.add_argument("--profile", type=Path, metavar="FILE",
                     help=f"device profile (default: the one shipped for the trace's GPU, "
                          f"else {DEFAULT_PROFILE})")
    sim.add_argument("--iterations", type=_positive, metavar="N",
                     help="split the trace into N equal iterations instead of detecting them")
    sim.add_argument("--graph", action="store_true",
                     help="what if each iteration were captured and replayed as one graph")
    sim.add_argument("--graph-region", metavar="A:B",
                     help="what if eager launches A to B of each iteration (from 0, inclusive) "
                          "were captured as one graph")
    sim.add_argument("--host-scale", type=_amount, metavar="F",
                     help="what if every host cost were F times what the trace shows")
    sim.add_argument("--launch-cost", type=_amount, metavar="US",
                     help="what if each eager launch cost US microseconds of host time")
    sim.add_argument("--node-overhead", type=_amount, metavar="US",
                     help="what if graphs took US microseconds of GPU time per node beyond "
                          "their kernels (the profile's figure by default; H200 machines showed "
                          "0.35 and none)")
    sim.add_argument("--update-nodes", type=_amount, metavar="N",
                     help="what if one executable served every shape, updating N nodes before "
                          "each graph launch (a graph family; see the trace's counters)")
    sim.add_argument("--update-whole", action="store_true",
                     help="what if one executable served every shape, brought to each by one "
                          "cuGraphExecUpdate from the shape's graph before each launch (for a "
                          "saved family: price its updates that way)")
    sim.add_argument("--update-device", action="store_true",
                     help="for a saved family: price its updates as update=\"device\" makes "
                          "them, the kernel nodes a kernel on the GPU can switch by one switch "
                          "kernel before each launch, the others from the host")
    sim.add_argument("--placeholder-copies", type=_amount, metavar="BYTES",
                     help="what if BYTES of inputs were copied into the graph's placeholder "
                          "tensors before each graph launch (a plain capture's static inputs; "
                          "grape captures in place and copies nothing)")
    sim.add_argument("--device-loop", action="store_true",
                     help="what if every iteration ran inside one WHILE node on the device: one "
                          "launch and one sync for the whole run (needs graphed iterations: a "
                          "graphed trace, or --graph)")
    sim.add_argument("--rank", dest="ranks", type=Path, action="append", default=[],
                     metavar="TRACE",
                     help="another rank's trace of the same step (tensor parallelism): TRACE "
                          "is rank 0 and each --rank the next; the ranks run together, their "
                          "NCCL collectives meeting, each priced at its shortest recorded time "
                          "across the ranks (with --graph: each rank's iteration one graph)")
    sim.add_argument("--chrome", type=Path, metavar="FILE",
                     help="write the simulated run (of the what-if, if any) as a grape trace: "
                          "grape info reads it, Perfetto opens it")
    sim.add_argument("--plot", type=Path, metavar="FILE",
                     help="write a PNG: the simulated timeline, and predicted time per "
                          "iteration against host cost (eager and graphed)")
    sim.set_defaults(run=_simulate)
    val = sub.add_parser(
        "validate", help="predict every recorded trace and compare with the GPU's measurement",
        description="For every grape trace given, or under the directories given: predict "
                    "its own wall "
                    "time from the trace alone, and for workloads recorded eagerly and graphed, "
                    "the graphed time from the eager trace and the device profile. Prints each "
                    "error and the median; exits 1 past the bounds.")
    val.add_argument("dirs", nargs="+", type=Path, metavar="PATH",
                     help="a directory (its traces, recursively) or a trace file")
    val.add_argument("--profile", type=Path, metavar="FILE",
                     help="device profile (default: the one shipped for each trace's GPU, "
                          "else the H200's)")
    val.add_argument("--median-bound", type=_amount, default=5.0, metavar="PCT")
    val.add_argument("--max-bound", type=_amount, default=15.0, metavar="PCT")
    val.set_defaults(run=_validate)
    return parser


def _info(args: argparse.Namespace) -> None:
    traces: list[Trace] = []
    for path in args.files:
        doc = load_json(path, TraceFormatError)
        if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
            summary = graph_summary(_graph(doc, path), path)
        elif isinstance(doc, dict) and doc.get("schema") == PROFILE_SCHEMA:
            summary = profile_summary(profile_from_json(doc, path))
        elif isinstance(doc, dict) and doc.get("schema") == FAMILY_SCHEMA:
            summary = family_summary(family_from_json(doc, path), path)
        else:
            trace = trace_from_json(doc, path, args.iterations)
            _warn_split(trace)
            traces.append(trace)
            summary = trace_summary(trace)
        if args.json:
            print(json.dumps(summary.data))
        else:
            print(summary.text)
    if not args.json:
        for line in _compare(traces + _eager_siblings(traces, args.iterations)):
            print(line)


def _characterize(args: argparse.Namespace) -> None:
    try:
        from grape.cuda.characterize import characterize
    except ModuleNotFoundError as e:
        raise GrapeError(f"expected cuda-bindings for grape characterize, found {e}") from None

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.only is not None:
        from grape.profile import load_profile

        only = [name for name in args.only.split(",") if name]
        measured = characterize(args.reps, progress, only)
        profile = measured
        if args.out.exists():  # merge: the rest of the profile stays as it was measured
            profile = dict(load_profile(args.out).doc)
            if profile["device"] != measured["device"]:
                raise GrapeError(f"expected {args.out} to profile this GPU "
                                 f"({measured['device']}), found {profile['device']!r}: "
                                 f"merge into a profile of the same GPU, or write a new file")
            header = ("schema", "version", "device", "driver_version", "measured", "repetitions")
            profile.update({k: v for k, v in measured.items() if k not in header})
            profile["remeasured"] = {**profile.get("remeasured", {}), **{
                name: {k: measured[k] for k in ("measured", "driver_version", "repetitions")}
                for name in only}}
        dump_json(args.out, profile, indent=1)
        print(profile_summary(profile_from_json(profile, args.out)).text)
        return
    profile = characterize(args.reps, progress)
    try:
        from grape.torch.characterize import torch_launch_us
    except ModuleNotFoundError:
        progress("PyTorch is not installed: the eager launch cost through PyTorch is left out")
    else:
        from grape.torch.characterize import MEASUREMENTS, replay_us

        progress("[+] eager launch through PyTorch")
        profile["eager_launch_us"]["torch"] = torch_launch_us()
        progress("[+] CUDAGraph.replay() host cost against node count")
        profile["torch_replay"] = replay_us()
        for name in MEASUREMENTS:  # each runs the profiler, which slows its process for good
            progress(f"[+] {name} (small BERTs, in a fresh process)")
            profile[name] = _fresh_process_json(["-m", "grape.torch.characterize", name])
    dump_json(args.out, profile, indent=1)
    print(profile_summary(profile_from_json(profile, args.out)).text)


def _fresh_process_json(args: list[str]) -> Any:
    """Run ``python ARGS`` and parse the last line it prints as JSON."""
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise GrapeError(f"expected python {' '.join(args)} to print JSON, found exit status "
                         f"{done.returncode}: {last}")
    return json.loads(lines[-1])


def _record(args: argparse.Namespace) -> None:
    try:
        from grape.torch.workloads import DEFAULT_SUITE, check_spec
    except ModuleNotFoundError as e:
        raise GrapeError(f"expected torch, transformers and cuda-bindings for grape record, "
                         f"found {e}") from None
    specs = list(args.specs) + (list(DEFAULT_SUITE) if args.suite else [])
    modes = [m for m in args.modes.split(",") if m]
    if not specs or set(modes) - {"eager", "graph", "grape"} or not modes:
        raise GrapeError(f"expected workload specs (or --suite) and modes among eager,graph,grape, "
                         f"found specs {specs} and modes {modes}")
    if args.calibration_rounds < 0:
        raise GrapeError(f"expected --calibration-rounds of at least 0, found "
                         f"{args.calibration_rounds}")
    for spec in specs:  # refuse a bad spec before any GPU work starts
        check_spec(spec)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, spec in enumerate(specs, 1):
        print(f"[{i}/{len(specs)}] {spec}", file=sys.stderr, flush=True)
        # A fresh process per workload: torch.profiler slows a process for good once it ran.
        done = subprocess.run([sys.executable, "-m", "grape.torch.record", spec, "--modes",
                               ",".join(modes), "--out", str(args.out), "--timed",
                               str(args.timed), "--profiled", str(args.profiled),
                               "--calibration-rounds", str(args.calibration_rounds),
                               *(["--cpu-ops"] if args.cpu_ops else [])],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append(f"{spec:<24} failed: {last}")
            continue
        for line in done.stdout.splitlines():
            r = json.loads(line)
            if "failed" in r:
                rows.append(r["failed"])
                continue
            nodes = ("" if r["graph_nodes"] is None else
                     f" ({r['graph_nodes']} kernel nodes captured)")
            rows.append(f"{spec:<24} {r['mode']:<6} {r['wall_ms']:9.3f} ms/step "
                        f"{r['kernels']:5d} kernels{nodes}  {r['path']}")
    print("\n".join(rows))


def _simulate(args: argparse.Namespace) -> None:
    from grape.program import GraphLaunch
    from grape.sim.engine import simulate
    from grape.sim.memory import executable_bytes
    from grape.sim.tracing import write_simulated_trace
    from grape.sim.whatif import (
        WhatIf,
        apply,
        costs_from_profile,
        graph_iterations,
        scale_host,
        unprofiled_program,
    )

    if args.ranks:
        return _simulate_ranks(args)
    if _is_family_file(args.trace):
        return _simulate_family(args)
    if _is_graph_file(args.trace):
        return _simulate_graph(args)
    if args.sequence or args.update_device:
        flag = "--sequence" if args.sequence else "--update-device"
        raise GrapeError(f"expected a saved graph family (*.family.json.gz) with {flag}, "
                         f"found {args.trace}")
    graph_only = [flag for flag, given in (("--durations", args.durations),
                                           ("--while", args.while_counts),
                                           ("--if", args.if_taken),
                                           ("--switch", args.switch_branches),
                                           ("--timed", args.timed is not None),
                                           ("--durations-ir", args.durations_ir)) if given]
    if graph_only:
        raise GrapeError(f"expected a kernel graph (*.ir.json.gz) with {graph_only[0]}, found "
                         f"the trace {args.trace}")
    trace = read_trace(args.trace, args.iterations)
    _warn_split(trace)
    profile = _profile(args, trace)
    _warn_device(profile, trace, args.trace)
    costs = costs_from_profile(profile)
    program = unprofiled_program(trace, profile)
    base = simulate(program, costs)
    region = None
    if args.graph_region:
        first, _, last = args.graph_region.partition(":")
        if not (first.isdigit() and last.isdigit()):
            raise GrapeError(f"expected --graph-region A:B with launch numbers, found "
                             f"{args.graph_region!r}")
        region = (int(first), int(last))
    applied = apply(trace, profile, WhatIf(
        node_overhead=args.node_overhead, host_scale=args.host_scale,
        launch_cost=args.launch_cost, graph_region=region, graph=args.graph,
        placeholder_copies=args.placeholder_copies, update_nodes=args.update_nodes,
        update_whole=args.update_whole, device_loop=args.device_loop))
    what_if, labels, what_costs, looped = (applied.program, applied.labels, applied.costs,
                                           applied.looped)
    chosen = simulate(what_if, what_costs, timeline=args.plot is not None,
                      record=args.chrome is not None)
    measured = trace.grape.wall_time_median_us if trace.grape else None
    rows = [("measured (no profiler)", measured), ("predicted from the trace",
                                                    base.per_iteration)]
    if labels:
        rows.append((f"what if: {', '.join(labels)}", chosen.per_iteration / looped))
    print(f"{args.trace}: {trace.workload} ({trace.mode}), {len(program.iterations)} iterations")
    for label, value in rows:
        shown = "not recorded" if value is None else f"{value / 1000:10.3f} ms per iteration"
        extra = ""
        if value is not None and measured and label != rows[0][0]:
            extra = f"  ({100 * (value - measured) / measured:+.1f}% against measured)"
        print(f"  {label:<34} {shown}{extra}")
    busy = 100 * chosen.gpu_busy_fraction
    print(f"  critical path: GPU busy {busy:.1f}% of the time, idle waiting on the host "
          f"{100 - busy:.1f}%" + (f"; host stalled {chosen.host_stall:.0f} us on a full launch "
                                   f"queue" if chosen.host_stall else ""))
    nodes = max((s.nodes for s in what_if.steps() if isinstance(s, GraphLaunch)), default=0)
    if nodes:
        per_node = profile.get("executable_bytes_per_node")
        print(f"  graph memory: one executable of {nodes} nodes takes about "
              f"{executable_bytes([nodes], per_node) / 2**20:.2f} MiB of device memory "
              f"({per_node:.0f} B per node by the profile)")
    for note in what_if.approximations:
        print(f"  approximated: {note}")
    for blocker in what_if.blockers:
        print(f"  cannot be captured as recorded: {blocker}")
    if args.chrome:
        write_simulated_trace(args.chrome, chosen, trace.workload, profile.device,
                              f"grape simulate {args.trace}"
                              + (f" ({', '.join(labels)})" if labels else ""))
        print(f"  simulated trace: {args.chrome} (grape info reads it; open it in "
              f"https://ui.perfetto.dev)")
    if args.plot:
        from grape.sim.plot import plot_simulation

        scales = [0.25, 0.5, 0.75, 1.0, 1.5, 2.0]
        curve = [(label, scales, [simulate(make(scale_host(program, f)), costs).per_iteration
                                  / 1000 for f in scales])
                 for label, make in (("as recorded", lambda p: p),
                                     ("graphed", lambda p: graph_iterations(p, costs)))]
        shown = chosen
        plot_simulation(args.plot, shown, trace.workload, curve,
                        "host cost, times what the trace shows")
        print(f"  plot: {args.plot}")


def _simulate_ranks(args: argparse.Namespace) -> None:
    """``--rank``: several ranks' eager traces of one step, run together."""
    from grape.sim.engine import simulate
    from grape.sim.ranks import mark_collectives, predict_ranks
    from grape.sim.whatif import costs_from_profile, unprofiled_program

    others = [flag for flag, given in (
        ("--graph-region", args.graph_region), ("--host-scale", args.host_scale),
        ("--launch-cost", args.launch_cost), ("--node-overhead", args.node_overhead),
        ("--update-nodes", args.update_nodes), ("--update-whole", args.update_whole),
        ("--update-device", args.update_device),
        ("--placeholder-copies", args.placeholder_copies), ("--device-loop", args.device_loop),
        ("--chrome", args.chrome), ("--plot", args.plot), ("--sequence", args.sequence),
        ("--durations", args.durations), ("--timed", args.timed is not None),
        ("--durations-ir", args.durations_ir)) if given]
    if others:
        raise GrapeError(f"expected only --graph, --iterations and --profile with --rank, "
                         f"found {others[0]}")
    paths = [args.trace, *args.ranks]
    if any(_is_graph_file(p) or _is_family_file(p) for p in paths):
        raise GrapeError("expected a trace per rank with --rank, found a kernel graph or a "
                         "family file")
    traces = [read_trace(p, args.iterations) for p in paths]
    for t in traces:
        _warn_split(t)
    profile = _profile(args, traces[0])
    for t, p in zip(traces, paths, strict=True):
        _warn_device(profile, t, p)
    costs = costs_from_profile(profile)
    programs = [mark_collectives(unprofiled_program(t, profile)) for t in traces]
    _, eager = predict_ranks(programs, costs)
    rows = [("predicted, ranks together", [r.per_iteration for r in eager])]
    alone = [simulate(p, costs).per_iteration for p in programs]
    rows.insert(0, ("predicted, each rank alone", alone))
    graphed = None
    if args.graph:
        graphed, results = predict_ranks(programs, costs, graph=True)
        rows.append(("what if: each iteration one graph", [r.per_iteration for r in results]))
    measured = [t.grape.wall_time_median_us if t.grape else None for t in traces]
    print(f"{len(paths)} ranks: {', '.join(str(p) for p in paths)}")
    print(f"  {'':<36}" + "".join(f"{'rank ' + str(r):>12}" for r in range(len(paths))))
    for label, values in [("measured (no profiler)", measured), *rows]:
        cells = "".join(f"{'-' if v is None else f'{v / 1000:.3f} ms':>12}" for v in values)
        print(f"  {label:<36}{cells}")
    collectives = sum(1 for s in programs[0].steps() for w in getattr(s, "work", ())
                      if w.kind == "collective")
    print(f"  collectives in each rank's trace: {collectives} (NCCL kernels), each priced at "
          f"its shortest recorded time across the ranks")
    for note in dict.fromkeys(n for p in graphed or [] for n in p.approximations):
        print(f"  approximated: {note}")
    for blocker in dict.fromkeys(b for p in graphed or [] for b in p.blockers):
        print(f"  cannot be captured as recorded: {blocker}")


def _warn_split(trace: Trace) -> None:
    if trace.split_warning:
        print(f"grape: warning: {trace.split_warning}", file=sys.stderr)


def _profile(args: argparse.Namespace, trace: Trace) -> DeviceProfile:
    """``--profile``, else the profile shipped for the GPU ``trace`` ran on (else the H200's)."""
    from grape.profile import load_profile, profile_for

    return load_profile(args.profile) if args.profile else profile_for(trace.gpu)


def _warn_device(profile: Any, trace: Trace, path: Path) -> None:
    """A trace from another GPU than the profile's: said, since the costs are the profile's."""
    from grape.profile import other_device

    if note := other_device(profile, trace.gpu, str(path)):
        print(f"grape: warning: {note}", file=sys.stderr)


def _is_graph_file(path: Path) -> bool:
    """A kernel graph: by its name, or else by the schema its first bytes name."""
    return (path.name.endswith((".ir.json", ".ir.json.gz"))
            or leading_schema(path) == SCHEMA)


def _is_family_file(path: Path) -> bool:
    return (path.name.endswith((".family.json", ".family.json.gz"))
            or leading_schema(path) == FAMILY_SCHEMA)


def _sequence(text: str | None, shapes: list) -> list:
    """``--sequence``: shapes as saved (integers parsed as such), or every saved shape."""
    if text is None:
        return shapes
    first, sep, rest = text.partition(":")
    try:
        if sep:
            last, _, stride = rest.partition(":")
            return list(range(int(first), int(last) + 1, int(stride or 1)))
        return [int(x) if x.lstrip("-").isdigit() else x for x in text.split(",")]
    except ValueError:
        raise GrapeError(f"expected --sequence as A,B,... or FIRST:LAST[:STRIDE], found "
                         f"{text!r}") from None


def _simulate_family(args: argparse.Namespace) -> None:
    """A saved family run over a sequence of its shapes on the simulated GPU: each step's
    update priced from the nodes whose versions differ (as the CUDA backend updates them), each
    launch from the shape's own graph."""
    from grape.familyio import load_family
    from grape.sim.engine import simulate
    from grape.sim.graph import family_program

    _refuse_trace_flags(args, "graph family", launches=True)
    if given := [f for f, on in (("--timed", args.timed is not None),
                                 ("--durations-ir", args.durations_ir)) if on]:
        raise GrapeError(f"expected a kernel graph (*.ir.json.gz) with {given[0]}, found the "
                         f"graph family {args.trace}")
    if args.update_whole and args.update_device:  # before reading anything
        raise GrapeError("expected --update-whole or --update-device, found both")
    saved = load_family(args.trace)
    sequence = _sequence(args.sequence, list(saved.shapes))
    if missing := [shape for shape in sequence if shape not in saved.shapes]:
        raise GrapeError(f"{args.trace}: expected shapes of the family in --sequence, found "
                         f"{missing[0]!r} (it has {len(saved.shapes)})")
    graphs = {s: saved.graph(s) for s in dict.fromkeys(sequence)}
    durations, profile, costs, _ = _graph_inputs(args)
    program, updated = family_program(graphs, sequence, durations, costs, _choices(args),
                                      whole=args.update_whole, name=args.trace.name,
                                      variants=saved.variants, device=args.update_device)
    result = simulate(program, costs, record=args.chrome is not None)
    print(f"{args.trace}: {len(saved.variants)} executables, {len(saved.shapes)} shapes; "
          f"{len(sequence)} steps (kernel durations from {durations.source})")
    print(f"  per step, launch to sync       {result.per_iteration / 1000:10.3f} ms (median)")
    way = ("whole-graph updates" if args.update_whole else
           "a switch kernel on the device, the rest from the host" if args.update_device
           else "node by node")
    print(f"  nodes updated per step         {sum(updated) / len(updated):10.1f} ({way})")
    tables = 0
    if args.update_device:  # the tables each executable's switch keeps on the device
        from grape.passes.switch_plan import totals

        nodes, versions, tables = totals(saved.variants.values())
        print(f"  device switch tables           {tables / 2**20:10.3f} MiB "
              f"({nodes} nodes switched, {versions} versions)")
    _family_memory_lines(saved, tables, profile)
    _graph_outputs(args, program, result, profile)


def _family_memory_lines(saved: SavedFamily, tables: int, profile: DeviceProfile) -> None:
    """What the family holds on the device against per-shape graphs sharing one pool, priced
    from the file (``grape.sim.memory.saved_family_memory``)."""
    from grape.sim.memory import saved_family_memory

    per_node = profile.get("executable_bytes_per_node")
    family, per_shape = saved_family_memory(
        [(len(v.template), len(v.shapes)) for v in saved.variants.values()],
        sum(b.size for b in saved.scratch_buffers().values()), tables, per_node,
        [v.alternate_count for v in saved.variants.values()])
    mib = 2**20
    print(f"  family device memory           {family.total / mib:10.3f} MiB (executables "
          f"{family.graph_bytes / mib:.3f} at {per_node:.0f} B a node, scratch "
          f"{family.pool_bytes / mib:.3f}"
          + (f", switch tables {family.table_bytes / mib:.3f}" if family.table_bytes else "")
          + ")")
    ratio = f"{per_shape.total / family.total:.1f}x the family" if family.total else "n/a"
    print(f"  per-shape graphs, one pool     {per_shape.total / mib:10.3f} MiB "
          f"({per_shape.executables} executables and the same scratch; {ratio})")


def _refuse_trace_flags(args: argparse.Namespace, what: str, sequence: bool = False,
                        family_updates: bool = False, launches: bool = False) -> None:
    """Kernel graphs and families: refuse the what-if flags that only a trace takes (and
    those of the others that this kind of file does not), and require --durations."""
    given = [flag for flag, on in (
        ("--graph", args.graph), ("--sequence", sequence and args.sequence),
        ("--graph-region", args.graph_region),
        ("--host-scale", args.host_scale is not None),
        ("--launch-cost", args.launch_cost is not None),
        ("--update-nodes", args.update_nodes is not None),
        ("--update-whole", family_updates and args.update_whole),
        ("--update-device", family_updates and args.update_device),
        ("--placeholder-copies", args.placeholder_copies is not None),
        ("--device-loop", args.device_loop), ("--plot", args.plot),
        ("--launches", launches and args.launches != 1)) if on]
    if given:
        raise GrapeError(f"expected a trace with {given[0]}, found the {what} {args.trace}")
    if not args.durations:
        raise GrapeError(f"expected --durations TRACE (a trace of the same kernels) to run the "
                         f"{what} {args.trace}, found none")


def _graph_inputs(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """Kernel graphs and families: the duration table (the ``--durations`` traces merged, the
    first one's figure winning), the device profile and its costs, and the first trace."""
    from grape.sim.graph import Durations
    from grape.sim.whatif import costs_from_profile

    traces = [read_trace(p) for p in args.durations]
    tables = [Durations.from_trace(t, str(p)) for t, p in zip(traces, args.durations,
                                                               strict=True)]
    durations = tables[0]
    for table in tables[1:]:
        durations = durations.merged(table)
    profile = _profile(args, traces[0])
    _warn_device(profile, traces[0], args.durations[0])
    overrides = ({} if args.node_overhead is None
                 else {"graph_node_overhead": args.node_overhead})
    return durations, profile, costs_from_profile(profile, **overrides), traces[0]


def _traced_choices(graph: Any, given: Any, trace: Any, args: argparse.Namespace,
                    traced_graph: Any = None) -> Any:
    """``given``, and where the graph's outer IF or SWITCH nodes have no choice given or its
    WHILE nodes no count, what the first durations trace shows its launches doing
    (grape.sim.traced_choices), read against ``traced_graph`` (the graph it launched, whose
    nodes share the names; ``graph`` where not given)."""
    import dataclasses

    from grape.ir import ConditionalKind
    from grape.sim.graph import conditionals
    from grape.sim.traced_choices import choices_in_trace

    open_nodes = [name for name, kind in conditionals(graph).items() if "/" not in name
                  and kind is not ConditionalKind.WHILE
                  and name not in given.taken and name not in given.branch]
    loops = [name for name, kind in conditionals(graph).items() if "/" not in name
             and kind is ConditionalKind.WHILE and name not in given.iterations]
    if not open_nodes and not loops:
        return given
    try:
        seen = choices_in_trace(graph if traced_graph is None else traced_graph,
                                trace.launches, str(args.durations[0]))
    except SimulationError:
        if open_nodes:
            raise
        return given  # only loops were open: check_choices asks for --while
    counted = {n: seen.iterations[n] for n in loops if n in seen.iterations}
    if counted:
        print(f"  WHILE iterations as {args.durations[0]} shows them (its operations over "
              f"their bodies'): " + ", ".join(f"{n}={c}" for n, c in counted.items()))
    given = dataclasses.replace(given, iterations={**counted, **given.iterations})
    if not open_nodes:
        return given
    taken = {n: seen.taken[n] for n in open_nodes if n in seen.taken}
    branch = {n: seen.branch[n] for n in open_nodes if n in seen.branch}
    ran = sum(t or graph.op(n).type is ConditionalKind.IF_ELSE for n, t in taken.items()) + sum(
        b < len(graph.op(n).bodies) for n, b in branch.items())
    undecided = len(open_nodes) - len(taken) - len(branch)
    print(f"  conditional nodes as {args.durations[0]} shows them: {ran} of "
          f"{len(open_nodes)} ran a body (the streams their bodies ran on, or the launch's "
          f"operation count)"
          + (f"; {undecided} it cannot tell (bodies without kernels)" if undecided else ""))
    return dataclasses.replace(given, taken={**taken, **given.taken},
                               branch={**branch, **given.branch})


def _paired_durations(traced: Any, durations: Any, choices: Any, trace: Any,
                      args: argparse.Namespace) -> Any:
    """``durations`` with each node's own, where a graph launch of the first durations trace
    pairs with the node executions of ``traced`` (the graph it launched) by position
    (grape.sim.traced_durations; the last such launch), and a line saying which way durations
    were read."""
    import dataclasses

    from grape.sim.traced_durations import node_durations

    reasons = []
    for launch in reversed([launch for launch in trace.launches if launch.is_graph]):
        try:
            paired = node_durations(traced, launch.ops, choices, str(args.durations[0]))
        except SimulationError as e:
            reasons.append(str(e))
            continue
        print(f"  node durations by position in a launch of {args.durations[0]} "
              f"({paired.executions} operations; {paired.renamed} kernel records named "
              f"otherwise)" + ("" if args.durations_ir is None
                               else f", of {args.durations_ir}'s nodes"))
        return dataclasses.replace(durations, nodes=paired.table)
    print("  kernel durations by name and launch configuration"
          + (f" (by position: {reasons[0]})" if reasons else ""))
    return durations


def _graph_outputs(args: argparse.Namespace, program: Any, result: Any, profile: Any) -> None:
    """Kernel graphs and families: what the run approximated, and the ``--chrome`` trace."""
    from grape.sim.tracing import write_simulated_trace

    for note in program.approximations:
        print(f"  approximated: {note}")
    if args.chrome:
        write_simulated_trace(args.chrome, result, args.trace.name.split(".")[0],
                              profile.device, f"grape simulate {args.trace}")
        print(f"  simulated trace: {args.chrome} (grape info reads it; open it in "
              f"https://ui.perfetto.dev)")


def _choices(args: argparse.Namespace) -> Any:
    from grape.sim.graph import Choices

    def pairs(values: list[str], flag: str, convert) -> dict[str, Any]:
        out = {}
        for value in values:
            node, sep, raw = value.rpartition("=")
            try:
                if not (sep and node):
                    raise ValueError
                out[node] = convert(raw)
            except ValueError:
                raise GrapeError(f"expected {flag} NODE=VALUE ({flag} {_CHOICE_HELP[flag]}), "
                                 f"found {value!r}") from None
        return out

    def count(raw: str) -> int:
        if not raw.isdigit():
            raise ValueError
        return int(raw)

    def taken(raw: str) -> bool:
        if raw not in ("taken", "skipped"):
            raise ValueError
        return raw == "taken"

    return Choices(iterations=pairs(args.while_counts, "--while", count),
                   taken=pairs(args.if_taken, "--if", taken),
                   branch=pairs(args.switch_branches, "--switch", count))


_CHOICE_HELP = {"--while": "grape:while=63", "--if": "node=taken or node=skipped",
                "--switch": "node=2"}


def _simulate_graph(args: argparse.Namespace) -> None:
    """A kernel graph run on the simulated GPU, with kernel durations from a trace."""
    from grape.sim.engine import simulate
    from grape.sim.graph import calibrated_gap, check_choices, program_from_graph

    _refuse_trace_flags(args, "kernel graph", sequence=True, family_updates=True)
    graph = KernelGraph.load(args.trace)
    choices = _choices(args)
    check_choices(graph, choices, str(args.trace), counts=False)
    durations, profile, costs, traced = _graph_inputs(args)
    # The graph the durations trace launched: its choices and durations are read against it.
    timed_graph = graph if args.durations_ir is None else KernelGraph.load(args.durations_ir)
    choices = _traced_choices(graph, choices, traced, args, timed_graph)
    check_choices(graph, choices, str(args.trace))
    durations = _paired_durations(timed_graph, durations, choices, traced, args)
    if args.timed is not None:
        durations = calibrated_gap(timed_graph, durations, costs, choices, args.timed)
        print(f"  a node waits {durations.node_gap:.3f} us beyond the ones before it, "
              f"calibrated to {args.durations_ir or args.trace}'s launch timed at "
              f"{args.timed:g} us")
    program, run = program_from_graph(graph, durations, costs, choices, args.launches,
                                      name=args.trace.name)
    result = simulate(program, costs, record=args.chrome is not None)
    print(f"{args.trace}: {graph.dag.number_of_nodes()} nodes, {run.nodes_run} node runs per "
          f"launch (kernel durations from {durations.source})")
    print(f"  GPU time per launch            {run.gpu_time / 1000:10.3f} ms"
          + _gap_range(graph, durations, costs, choices, run.gpu_time))
    print(f"  launch to sync, per launch     {result.per_iteration / 1000:10.3f} ms "
          f"({args.launches} launch{'es' if args.launches > 1 else ''})")
    _graph_outputs(args, program, result, profile)


def _gap_range(graph: Any, durations: Any, costs: Any, choices: Any, at: float) -> str:
    """Where no timed launch calibrated the gap a node adds, the GPU time with none (kernels
    back to back): a profiled trace's gap is the profiler's as often as the machine's (six H200
    loops traced 0.42 us apart ran 0.001 to 0.10 us apart unprofiled; an earlier step traced
    so ran 0.32 apart). The unprofiled launch lay between the two on five of those six loops
    and on the earlier step; GPT-2 greedy's, whose trace had lost most of its records, ran
    0.8% past the slower end. A range, not a bound."""
    import dataclasses

    from grape.sim.graph import run_graph

    if durations.node_gap is not None:
        return ""
    alone = run_graph(graph, dataclasses.replace(durations, node_gap=0.0), costs, choices)
    if alone.gpu_time >= at:
        return ""
    return (f" (at the trace's gap; {alone.gpu_time / 1000:.3f} with kernels back to back: "
            f"--timed calibrates it)")


def _validate(args: argparse.Namespace) -> None:
    from grape.profile import load_profile
    from grape.sim.validate import validate

    if missing := [str(d) for d in args.dirs if not d.exists()]:
        raise GrapeError(f"expected directories or trace files, found nothing at {missing}")
    paths = [p for d in args.dirs for p in (sorted(d.rglob("*.json.gz")) if d.is_dir() else [d])]
    failures: list[str] = []

    def failed(path: Path, error: GrapeError) -> None:  # reported at once, counted at the end
        line = str(error) if str(error).startswith(str(path)) else f"{path}: {error}"
        failures.append(line)
        print(f"grape validate: error: {line}", file=sys.stderr)

    predictions = validate(paths, load_profile(args.profile) if args.profile else None,
                           lambda line: print(line, file=sys.stderr), failed)
    if not predictions and not failures:
        raise GrapeError(f"expected grape traces with measured wall times under "
                         f"{[str(d) for d in args.dirs]}, found none")
    if predictions:
        _print_predictions(predictions, args.median_bound, args.max_bound)
    if failures:
        raise GrapeError(f"expected every trace to be read and predicted, found {len(failures)} "
                         f"that could not be (each named above)")
    stated = [p.inside for p in predictions if p.inside is not None]
    if stated:
        print(f"{'intervals':<33} measured inside {sum(stated)} of {len(stated)} stated")
    errors = [abs(p.error) * 100 for p in predictions]
    if statistics.median(errors) > args.median_bound or max(errors) > args.max_bound:
        raise SystemExit(1)


def _print_predictions(predictions: list, median_bound: float, max_bound: float) -> None:
    print(f"{'workload':<32} {'question':<33} {'measured':>11} {'predicted':>11} {'':<3}"
          f"{'error':>7}")
    for p in predictions:
        interval = ("" if p.inside is None else
                    f"  [{p.low:.3f}-{p.high:.3f}{'' if p.inside else ', measured outside'}]")
        print(f"{p.workload:<32} {p.question:<33} {p.measured:11.3f} "
              f"{p.predicted:11.3f} {p.unit:<3}{100 * p.error:+6.1f}%{interval}"
              + (f"  ({p.note})" if p.note else ""))
    for question in dict.fromkeys(p.question for p in predictions):
        errs = [abs(p.error) * 100 for p in predictions if p.question == question]
        print(f"{question:<33} median {statistics.median(errs):5.1f}%  largest {max(errs):5.1f}%"
              f"  ({len(errs)} predictions)")
    stated = [p.inside for p in predictions if p.inside is not None]
    if stated:
        print(f"{'intervals':<33} measured inside {sum(stated)} of {len(stated)} stated")
    errors = [abs(p.error) * 100 for p in predictions]
    print(f"{'all':<33} median absolute error {statistics.median(errors):.1f}% (bound "
          f"{median_bound:g}%), largest {max(errors):.1f}% (bound {max_bound:g}%), "
          f"{len(errors)} predictions")


def _graph(doc: dict, path: Path) -> KernelGraph:
    try:
        graph = KernelGraph.from_json(doc)
        graph.validate()
    except GrapeError as e:
        raise type(e)(f"{path}: {e}") from None
    return graph


def _eager_siblings(traces: list[Trace], iterations: int | None) -> list[Trace]:
    """Eager traces recorded beside graphed ones (``X.graph.*`` next to ``X.eager.*``).

    A graphed iteration can run other kernels than the eager one (the capture changes what
    PyTorch launches), and ``grape info`` says so even when given the graphed trace alone.
    """
    have = {(t.workload, t.mode) for t in traces}
    found = []
    for t in traces:
        sibling = Path(t.source).with_name(Path(t.source).name.replace(".graph.", ".eager."))
        if t.mode == "graph" and (t.workload, "eager") not in have and sibling.is_file():
            found.append(read_trace(sibling, iterations))
            have.add((t.workload, "eager"))
    return found


def _compare(traces: list[Trace]) -> list[str]:
    """Lines comparing eager and graphed traces of the same workload."""
    lines = []
    by_workload: dict[str, dict[str, Trace]] = {}
    for t in traces:
        by_workload.setdefault(t.workload, {})[t.mode] = t
    for workload, modes in by_workload.items():
        eager, graph = modes.get("eager"), modes.get("graph")
        if not (eager and graph):
            continue
        e = Counter(len(it.kernels) for it in eager.iterations).most_common(1)[0][0]
        g = Counter(len(it.kernels) for it in graph.iterations).most_common(1)[0][0]
        if e == g:
            lines.append(f"{workload}: eager and graphed iterations run the same number of "
                         f"kernels ({e})")
        else:
            lines.append(f"{workload}: the graphed iteration runs {g} kernels, the eager one "
                         f"{e} ({g - e:+d}, from {Path(eager.source).name}): capture changed "
                         f"which kernels run")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        args.run(args)
    except GrapeError as e:
        print(f"grape {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `grape info ... | head`
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
