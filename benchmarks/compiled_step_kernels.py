"""Which kernels a GPT-2 small step holds, uncompiled and with ``compile=True`` (GPU).

Greedy, batch 1, a 32-token prompt, 128 new tokens: for each way the step's node count and
longest path, its kernels by origin (Inductor's Triton kernels, GEMM libraries', attention's,
PyTorch's eager kernels, copies), the eager kernels by name, and the mean ms a token of three
calls after two warm ones. Written to see what a compiled step leaves eager
(``grape.torch.compiled_step``).

Run on a GPU: python benchmarks/compiled_step_kernels.py
"""

import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from generate import SIZES, build

import grape
from grape.ir import Kernel
from grape.torch.api import _CACHES, last_stats

NEW = 128


def origin(name: str) -> str:
    if name.startswith("triton"):
        return "inductor"
    if any(s in name for s in ("gemm", "nvjet", "cutlass", "sm90")):
        return "gemm"
    if any(s in name for s in ("flash", "fmha", "sdpa", "attention")):
        return "attention"
    return "eager"


def main() -> None:
    model = build("gpt2", SIZES["gpt2small"])
    ids = torch.randint(3, 1000, (1, 32), device="cuda")
    for compile in (False, True):
        def call(compile=compile):
            return grape.generate(model, ids, max_new_tokens=NEW, compile=compile,
                                  do_sample=False)
        began = time.perf_counter()
        call()
        s = last_stats()
        print("compile", compile, "graphed", s.graphed, "compiled", s.compiled, "nodes",
              s.step_nodes, "depth", s.step_depth, "s", round(time.perf_counter() - began, 1),
              flush=True)
        entry = next(e for key, e in _CACHES[model].entries.items() if key[2] == compile)
        kinds: collections.Counter[str] = collections.Counter()
        eager: collections.Counter[str] = collections.Counter()
        for _, op in entry.loop.capture.ir.ops():
            if isinstance(op, Kernel):
                kinds[origin(op.name)] += 1
                if origin(op.name) == "eager":
                    eager[op.name[:110]] += 1
            else:
                kinds[type(op).__name__] += 1
        print(dict(kinds))
        for name, count in eager.most_common(40):
            print(f"   {count:3d} {name}")
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        print("ms/token", round((time.perf_counter() - began) / 3 / NEW * 1e3, 3), flush=True)


if __name__ == "__main__":
    main()
