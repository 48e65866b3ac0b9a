"""What a warm start pays per shape to learn the kernel functions it runs: three ways, side by side.

A warm start (``grape.torch.family.load_family``) moves a saved shape to this process unless the
shape runs a kernel function this process has not paired with the saved one (cuBLAS picks its
GEMM kernels by size and loads each one's module when it first picks it). Such a shape used to
be captured whole (``capture``: an eager warm-up, the capture, the walk into the IR); now its
functions are read from a capture that is never walked (``functions_run``: the eager warm-up and
the capture) and paired by name. This script times, in one fresh process, Wav2Vec2-base lengths
that nothing ran before, taking the ways in turn:

- ``full``: ``grape.torch.capture.capture``, as a shape captured in the warm start;
- ``functions_run``: the warm-up and a capture, kernel functions read, nothing walked;
- ``no_warmup``: the capture alone (not what grape does: a library's first call at a size may
  do work a capture cannot hold; measured to say what the warm-up costs).

Also the eager step right after each (a capture with no warm-up leaves the modules' loading and
the library's first-call work to the next eager run). Writes JSON with ``--out``.

Run on a GPU: python benchmarks/warm_start_learning.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers

from grape.cuda.walk import kernel_functions
from grape.torch.capture import capture, capture_stream, collector_paused, functions_run
from grape.torch.control import graph

WAYS = ("full", "functions_run", "no_warmup")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(transformers.Wav2Vec2Config()).cuda().half().eval()
    audio = torch.randn(1, 160000, device="cuda", dtype=torch.half)

    @torch.no_grad()
    def step(n: int) -> torch.Tensor:
        return model(audio[:, :n]).last_hidden_state

    step(16000)  # the model's own lazy initialisation, at a length not measured
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()

    def timed(fn):
        torch.cuda.synchronize()
        began = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - began, out

    def no_warmup(n: int) -> dict[str, set[str]]:
        side = capture_stream()
        side.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with collector_paused(), graph(g, pool=pool, stream=side):
            step(n)
        try:
            return kernel_functions(g.raw_cuda_graph())
        finally:
            del g

    rows = []
    for i, n in enumerate(range(20000, 160000, 1440 * 7)):  # lengths a family would hold
        way = WAYS[i % len(WAYS)]
        if way == "full":
            seconds, cap = timed(lambda n=n: capture(lambda: step(n), pool=pool,
                                                     instantiate=False, collect=False))
            functions = len({k.function for _, k in cap.ir.kernels()})
        elif way == "functions_run":
            seconds, found = timed(lambda n=n: functions_run(lambda: step(n), pool=pool))
            functions = sum(map(len, found.values()))
        else:
            seconds, found = timed(lambda n=n: no_warmup(n))
            functions = sum(map(len, found.values()))
        eager, _ = timed(lambda n=n: step(n))
        rows.append({"way": way, "samples": n, "seconds": seconds, "eager_after_s": eager,
                     "functions": functions})
        print(json.dumps(rows[-1]), flush=True)
    summary = {way: {"median_s": statistics.median(r["seconds"] for r in rows if r["way"] == way),
                     "median_eager_after_s": statistics.median(
                         r["eager_after_s"] for r in rows if r["way"] == way),
                     "shapes": sum(r["way"] == way for r in rows)} for way in WAYS}
    print(f"{'way':<14} {'s a shape':>10} {'eager after s':>14} {'shapes':>7}")
    for way, s in summary.items():
        print(f"{way:<14} {s['median_s']:>10.4f} {s['median_eager_after_s']:>14.4f} "
              f"{s['shapes']:>7}")
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "torch": torch.__version__, "rows": rows,
                                        "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
