"""Where a captured greedy step first differs from the eager one, step by step (GPU).

On the H200 the captured ``GreedyDecoder.step`` chose another token than the eager step at token
93 of 256 (GPT-2 small, batch 1, seed 1) while the eager step matched ``generate``. This runs both
in lockstep from one prompt: the eager step, and the same step captured once as a
``torch.cuda.CUDAGraph`` on a second decoder, each keeping its logits. Per step it records whether
the logits are bitwise equal, their largest difference, and the eager logits' margin between the
best and second-best token. The first step with different logits says which it is: step 1 means
the captured kernels compute differently from the eager ones (a numerical difference that waits
for a near tie), a later step with equal logits before it means something fixed at capture.

Writes benchmarks/results/capture_numerics_h200.json (or --out). Run on a GPU:
python benchmarks/capture_numerics.py [--new 256] [--batch 1] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from grape.torch.generate import GreedyDecoder
from grape.torch.workloads import _gpt2

PROMPT = 32


def lockstep(new: int, batch: int, seed: int) -> list[dict[str, object]]:
    model = _gpt2("gpt2-small")
    torch.manual_seed(seed)
    prompt = torch.randint(0, 50257, (batch, PROMPT), device="cuda")
    eager = GreedyDecoder(model, prompt, new, None, 0, keep_logits=True)
    graphed = GreedyDecoder(model, prompt, new, None, 0, keep_logits=True)
    graphed.prefill()
    graphed.step()  # warm-up outside capture
    step = torch.cuda.CUDAGraph()
    with torch.cuda.graph(step):
        graphed.step()
    eager.prefill()
    graphed.prefill()
    rows = []
    for token in range(1, new):
        same_tokens = torch.equal(eager.tokens[:, :token], graphed.tokens[:, :token])
        if not same_tokens:
            break  # from here on the two decode different sequences
        eager.step()
        step.replay()
        top = eager.logits.float().topk(2, dim=-1).values
        diff = (eager.logits.float() - graphed.logits.float()).abs().max().item()
        rows.append({"token": token, "logits_equal": bool(torch.equal(eager.logits,
                                                                      graphed.logits)),
                     "max_abs_diff": diff,
                     "smallest_margin": (top[:, 0] - top[:, 1]).min().item(),
                     "tokens_equal": bool(torch.equal(eager.tokens[:, token],
                                                      graphed.tokens[:, token]))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results"
                        / "capture_numerics_h200.json")
    args = parser.parse_args()
    rows = lockstep(args.new, args.batch, args.seed)
    first_logits = next((r["token"] for r in rows if not r["logits_equal"]), None)
    first_token = next((r["token"] for r in rows if not r["tokens_equal"]), None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                    "command": " ".join(sys.argv),
                                    "first_logits_difference": first_logits,
                                    "first_token_difference": first_token,
                                    "steps": rows}, indent=1) + "\n")
    print(f"steps compared: {len(rows)}; first step with different logits: {first_logits}; "
          f"first different token: {first_token}")
    for r in rows[:3] + [r for r in rows if not r["logits_equal"]][:3]:
        print(f"  token {r['token']:4d}: logits equal {r['logits_equal']!s:5}, "
              f"max |diff| {r['max_abs_diff']:.3g}, smallest margin {r['smallest_margin']:.3g}")


if __name__ == "__main__":
    main()
