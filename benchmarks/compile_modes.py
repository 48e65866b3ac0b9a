"""grape.generate(compile=True) under Inductor's modes, and grape over eager kernels beside it.

One configuration per process (Inductor caches what it compiled): ``SIZE ARCH MODE`` with SIZE
and ARCH as in ``benchmarks/generate.py`` and MODE ``default``, ``max-autotune-no-cudagraphs``
(what ``grape.generate(compile=True)`` uses) or ``max-autotune-aten`` (the latter with GEMMs
from cuBLAS only). Greedy, batch 1, a 32-token prompt, 128 new tokens; the median of five
calls after the capturing one, for the compiled loop and for grape's loop over eager kernels;
``agreement``: the fraction of new tokens the two ways share; ``pdl``: whether Inductor's Triton
kernels (not its GEMM templates) were launched with programmatic dependent launch
(``TORCHINDUCTOR_ENABLE_PDL=1`` in the environment), which a captured graph keeps as
programmatic edges. Prints one JSON line and appends
it to ``$OUT/compile_modes.jsonl`` (``/tmp`` without ``OUT``).

Run on a GPU, once per configuration:
    python benchmarks/compile_modes.py gpt2small gpt2 default
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch._inductor.config as inductor

sys.path.insert(0, os.path.dirname(__file__))
from generate import SIZES, build

import grape
from grape.torch import api

NEW = 128


def _ms_per_token(call) -> float:
    walls = []
    for _ in range(5):
        torch.cuda.synchronize()
        began = time.perf_counter()
        call()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - began) * 1e3 / NEW)
    return statistics.median(walls)


def main() -> None:
    size, arch, mode = sys.argv[1:4]
    model = build(arch, SIZES[size])
    ids = torch.randint(0, 1000, (1, 32), device="cuda")
    options = {} if mode == "default" else {"mode": mode}
    if mode == "max-autotune-aten":
        inductor.max_autotune_gemm_backends = "ATEN"
        options = {"mode": "max-autotune-no-cudagraphs"}
    # The model's compiled forward, made here with the mode asked for, where grape would make
    # its own (grape.torch.api keeps one per model).
    api._CACHES[model] = api._Cache(compiled=torch.compile(model, dynamic=False, **options))
    began = time.perf_counter()
    compiled = grape.generate(model, ids, max_new_tokens=NEW, compile=True)
    capture_s = time.perf_counter() - began
    compiled_ms = _ms_per_token(lambda: grape.generate(model, ids, max_new_tokens=NEW,
                                                       compile=True))
    graphed = api.last_stats().graphed
    eager = grape.generate(model, ids, max_new_tokens=NEW)
    eager_ms = _ms_per_token(lambda: grape.generate(model, ids, max_new_tokens=NEW))
    row = dict(size=size, mode=mode, pdl=bool(inductor.triton.enable_pdl),
               compiled_ms_per_token=round(compiled_ms, 4),
               eager_ms_per_token=round(eager_ms, 4), capture_s=round(capture_s, 1),
               graphed=graphed,
               agreement=float((compiled[:, 32:] == eager[:, 32:]).float().mean()))
    print(json.dumps(row), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "compile_modes.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
