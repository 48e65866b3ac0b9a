"""Where a concurrent step's extra capture time goes (GPU).

``grape.generate(concurrent=True)`` captured 0.2 to 2 s slower than the chain on an H100
(``benchmarks/generate.py``'s ``capture_s``, ten architectures). This measures, per
architecture and strategy at the bench size, the first call of each way (the capture and one
generation) side by side in one process, after a warm-up of both ways at another prompt length:

- unprofiled, twice, in both orders (chain first at one prompt length, concurrent first at
  another), for the figures;
- once more each under ``cProfile``, for where the host's time goes: the seconds spent inside
  each source file (``tottime`` summed by file), and the top functions by cumulative time.

    python benchmarks/capture_cost.py --archs llama,mixtral --out FILE.json

Each row: ``arch``, ``strategy``, ``prompt``, ``concurrent``, ``profiled``, ``capture_s``
(``last_stats().capture_s``), ``first_call_s``, ``step_nodes``, ``step_depth``; profiled rows
add ``by_file`` (seconds per file, the 15 largest) and ``top`` (the 25 functions with the most
cumulative time). The last table prints the medians of the unprofiled rows and, for each
file, the profiled concurrent capture's seconds less the chain's.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import ARCHS, SIZES, STRATEGIES, build


def _first_call(model, ids, mask, strategy: str, new: int, concurrent: bool,
                profile: bool) -> dict[str, Any]:
    import torch

    import grape
    from grape.torch.api import last_stats

    prof = cProfile.Profile() if profile else None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        if prof:
            prof.enable()
        grape.generate(model, ids, mask, seed=7, max_new_tokens=new, pad_token_id=0,
                       concurrent=concurrent, **STRATEGIES[strategy])
        torch.cuda.synchronize()
        if prof:
            prof.disable()
        seconds = time.perf_counter() - start
    stats = last_stats()
    row = {"concurrent": concurrent, "profiled": profile, "capture_s": stats.capture_s,
           "first_call_s": seconds, "graphed": stats.graphed, "step_nodes": stats.step_nodes,
           "step_depth": stats.step_depth,
           "fallback": next((str(w.message) for w in caught
                             if "runs model.generate" in str(w.message)), None)}
    if prof:
        row.update(_profile_summary(prof))
    return row


def _profile_summary(prof: cProfile.Profile) -> dict[str, Any]:
    stats = pstats.Stats(prof)
    by_file: dict[str, float] = {}
    top = []
    for (file, line, name), (_, _, tottime, cumtime, _) in stats.stats.items():
        by_file[_short(file)] = by_file.get(_short(file), 0.0) + tottime
        top.append((cumtime, f"{_short(file)}:{line}({name})"))
    top.sort(reverse=True)
    largest = sorted(by_file.items(), key=lambda kv: -kv[1])[:15]
    return {"by_file": dict(largest),
            "top": [{"cumulative_s": c, "function": f} for c, f in top[:25]]}


def _short(file: str) -> str:
    """A source file from its package on: networkx/..., torch/..., grape/... (the
    installed packages by what follows site-packages, which an environment's own path, such
    as /opt/torch/.venv, cannot be mistaken for)."""
    if "site-packages/" in file:
        return file.rsplit("site-packages/", 1)[1]
    if "grape/" in file:
        return "grape/" + file.rsplit("grape/", 1)[1]
    return file if file.startswith("~") else Path(file).name


def measure(arch: str, strategy: str, args) -> list[dict[str, Any]]:
    import torch

    model = build(arch, SIZES[args.size])
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(7)

    def prompt(length: int):
        ids = torch.randint(3, vocab, (1, length), generator=g).cuda()
        return ids, torch.ones_like(ids)

    rows = []
    # Both ways once at a prompt length not measured: imports, cuBLAS handles, lazy modules.
    warm = prompt(8)
    for concurrent in (False, True):
        _first_call(model, *warm, strategy, args.new, concurrent, profile=False)
    plan = [(16, (False, True), False), (20, (True, False), False), (24, (False, True), True)]
    for length, order, profile in plan:
        ids, mask = prompt(length)
        for concurrent in order:
            row = _first_call(model, ids, mask, strategy, args.new, concurrent, profile)
            rows.append({"arch": arch, "strategy": strategy, "prompt": length, **row})
            print(f"{arch:8} {strategy:6} prompt {length:2} "
                  f"{'concurrent' if concurrent else 'chain':10} "
                  f"{'profiled' if profile else '':8} capture {row['capture_s']:.2f} s",
                  file=sys.stderr, flush=True)
    del model
    torch.cuda.empty_cache()
    return rows


def table(rows: list[dict[str, Any]]) -> None:
    print(f"{'arch':8} {'strategy':8} {'chain s':>8} {'conc s':>8} {'extra':>6}  "
          f"largest extra, profiled (file: s)")
    keys = sorted({(r["arch"], r["strategy"]) for r in rows})
    for arch, strategy in keys:
        mine = [r for r in rows if (r["arch"], r["strategy"]) == (arch, strategy)]

        chain, conc = (statistics.median(r["capture_s"] for r in mine if not r["profiled"]
                                         and r["concurrent"] == concurrent)
                       for concurrent in (False, True))
        prof = {r["concurrent"]: r.get("by_file", {}) for r in mine if r["profiled"]}
        extra = {f: prof[True].get(f, 0.0) - prof[False].get(f, 0.0)
                 for f in set(prof.get(True, {})) | set(prof.get(False, {}))}
        largest = sorted(extra.items(), key=lambda kv: -kv[1])[:3]
        print(f"{arch:8} {strategy:8} {chain:8.2f} {conc:8.2f} {conc - chain:6.2f}  "
              + ", ".join(f"{f}: {s:+.2f}" for f, s in largest))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="llama,mixtral",
                        help=f"comma-separated, of {', '.join(ARCHS)}")
    parser.add_argument("--strategies", default="greedy,beam5",
                        help=f"comma-separated, of {', '.join(STRATEGIES)}")
    parser.add_argument("--size", choices=list(SIZES), default="bench")
    parser.add_argument("--new", type=int, default=32, help="new tokens per call")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args()
    archs, strategies = args.archs.split(","), args.strategies.split(",")
    for name, given, known in (("architecture", archs, ARCHS), ("strategy", strategies,
                                                                 STRATEGIES)):
        unknown = [x for x in given if x not in known]
        if unknown:
            parser.error(f"expected {name} names of {', '.join(known)}, found {unknown}")

    import torch
    if not torch.cuda.is_available():
        sys.exit("expected a CUDA device, found none: this benchmark captures on a GPU")
    rows = [row for arch in archs for strategy in strategies
            for row in measure(arch, strategy, args)]
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                    "torch": torch.__version__, "results": rows}, indent=1))
    table(rows)


if __name__ == "__main__":
    main()
