"""The ``grape`` command.

Every error grape raises on purpose becomes one line on stderr and exit status 2; a traceback
means a bug in grape.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from grape import __version__
from grape.errors import GrapeError, TraceFormatError
from grape.ir import SCHEMA, KernelGraph
from grape.jsonio import load_json
from grape.summary import graph_summary, trace_summary
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grape",
        description="CUDA graphs for dynamic DNNs: inspect traces and kernel graphs.")
    parser.add_argument("--version", action="version", version=f"grape {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = sub.add_parser(
        "info", help="what a trace or a kernel-graph file holds",
        description="Summarise torch.profiler / grape traces (iterations, kernels, GPU busy "
                    "time, host launch time, graph launches, streams) or grape IR files. "
                    "Given an eager and a graphed trace of one workload, compares their "
                    "kernel counts.")
    info.add_argument("files", nargs="+", type=Path, metavar="FILE",
                      help="a .json or .json.gz trace, or a grape IR file")
    info.add_argument("--iterations", type=_positive, metavar="N",
                      help="split each trace into N equal iterations instead of detecting them")
    info.add_argument("--json", action="store_true", help="print one JSON object per file")
    info.set_defaults(run=_info)
    return parser


def _info(args: argparse.Namespace) -> None:
    traces: list[Trace] = []
    for path in args.files:
        doc = load_json(path, TraceFormatError)
        if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
            summary = graph_summary(_graph(doc, path), path)
        else:
            trace = trace_from_json(doc, path, args.iterations)
            traces.append(trace)
            summary = trace_summary(trace)
        if args.json:
            print(json.dumps(summary.data))
        else:
            print(summary.text)
    if not args.json:
        for line in _compare(traces + _eager_siblings(traces, args.iterations)):
            print(line)


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
