"""Where a captured greedy step first differs from the eager one, step by step (GPU).

On the H200 the captured ``GreedyDecoder.step`` chose another token than the eager step at token
93 of 256 (GPT-2 small, batch 1, seed 1) while the eager step matched ``generate``. This runs both
in lockstep from one prompt: the eager step, and the same step captured once as a
``torch.cuda.CUDAGraph`` on another decoder, each keeping its logits, beside a second eager
decoder. Per step it records whether the logits are bitwise equal (and whether the second eager
decoder repeats the first), their largest difference, and the eager logits' margin between the
best and second-best token; then which kernels differ by name between an eager step and a replay.
Eager and captured parting where two eager decoders also part means the kernels do not repeat
their own results; parting where the eager decoders agree means the capture computes something
else (a kernel chosen differently, or a value fixed at capture).

With --out FILE, writes the comparison there; benchmarks/results/capture_numerics_h200.json sums up
nine runs on the H200. Run on a GPU:
python benchmarks/capture_numerics.py [--new 256] [--batch 1] [--seed 1] [--deterministic]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch

from grape.torch.generate import GreedyDecoder
from grape.torch.workloads import _gpt2

PROMPT = 32


def _kernels(run) -> Counter:
    """Kernel names one call of ``run`` puts on the GPU, by count (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return Counter(e.name for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)


def _decoders(new: int, batch: int, seed: int, eager: int, keep_logits: bool):
    """``eager`` decoders of one prompt, and one more whose step is captured as a graph (after
    a warm-up step outside capture), every one back at its first step."""
    model = _gpt2("gpt2-small")
    torch.manual_seed(seed)
    prompt = torch.randint(0, 50257, (batch, PROMPT), device="cuda")
    decoders = [GreedyDecoder(model, prompt, new, None, 0, keep_logits=keep_logits)
                for _ in range(eager + 1)]
    graphed = decoders[-1]
    graphed.prefill()
    graphed.step()  # warm-up outside capture
    step = torch.cuda.CUDAGraph()
    with torch.cuda.graph(step):
        graphed.step()
    for d in decoders:
        d.prefill()  # at the first step again: no write past the preallocated cache
    return decoders, step


def lockstep(new: int, batch: int, seed: int) -> list[dict[str, object]]:
    # A second eager decoder, ``control``: whether the eager step repeats itself bitwise at all.
    (eager, control, graphed), step = _decoders(new, batch, seed, 2, keep_logits=True)
    rows = []
    for token in range(1, new):
        same_tokens = torch.equal(eager.tokens[:, :token], graphed.tokens[:, :token])
        if not same_tokens:
            break  # from here on the two decode different sequences
        eager.step()
        control.step()
        step.replay()
        top = eager.logits.float().topk(2, dim=-1).values
        diff = (eager.logits.float() - graphed.logits.float()).abs().max().item()
        rows.append({"token": token, "logits_equal": bool(torch.equal(eager.logits,
                                                                      graphed.logits)),
                     "eager_repeats": bool(torch.equal(eager.logits, control.logits)),
                     "max_abs_diff": diff,
                     "smallest_margin": (top[:, 0] - top[:, 1]).min().item(),
                     "tokens_equal": bool(torch.equal(eager.tokens[:, token],
                                                      graphed.tokens[:, token]))})
    return rows


def kernel_difference(new: int, batch: int, seed: int) -> dict[str, object]:
    """Which kernels differ between one eager step and one replay (names, by count)."""
    (eager, _), step = _decoders(new, batch, seed, 1, keep_logits=False)
    eager_k, graph_k = _kernels(eager.step), _kernels(step.replay)
    return {"eager": sum(eager_k.values()), "graph": sum(graph_k.values()),
            "only_eager": dict(eager_k - graph_k), "only_graph": dict(graph_k - eager_k)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms, cuBLAS workspace :4096:8")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the results as JSON here (nothing is written without it)")
    args = parser.parse_args()
    if args.deterministic:
        # Before the first cuBLAS handle: cuBLAS reads its workspace setting once.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
    rows = lockstep(args.new, args.batch, args.seed)
    first_logits = next((r["token"] for r in rows if not r["logits_equal"]), None)
    first_eager = next((r["token"] for r in rows if not r["eager_repeats"]), None)
    first_token = next((r["token"] for r in rows if not r["tokens_equal"]), None)
    doc = {"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
           "deterministic": args.deterministic,
           "first_logits_difference": first_logits, "first_token_difference": first_token,
           "first_eager_repeat_difference": first_eager, "steps": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")  # before anything else can fail
    print(f"steps compared: {len(rows)}; first step with different logits: {first_logits}; "
          f"first different token: {first_token}; eager against eager first differs at: "
          f"{first_eager}")
    for r in rows[:3] + [r for r in rows if not r["logits_equal"]][:3]:
        print(f"  token {r['token']:4d}: logits equal {r['logits_equal']!s:5}, "
              f"max |diff| {r['max_abs_diff']:.3g}, smallest margin {r['smallest_margin']:.3g}")
    kernels = kernel_difference(args.new, args.batch, args.seed)
    if args.out:
        args.out.write_text(json.dumps({**doc, "kernels": kernels}, indent=1) + "\n")
    print(f"kernels per step: eager {kernels['eager']}, replay {kernels['graph']}")
    for side in ("only_eager", "only_graph"):
        for name, n in sorted(kernels[side].items(), key=lambda kv: -kv[1])[:8]:
            print(f"  {side}: {n} x {name[:110]}")


if __name__ == "__main__":
    main()
