"""Greedy generation three ways, side by side: ms per token and host syncs per token (GPU).

GPT-2 small (fp16, random weights, built from its config), a prompt of 32 random tokens, up to
--new tokens, at each batch size:

- ``generate``: Hugging Face's eager greedy generation;
- ``host loop``: ``grape.torch.generate.GreedyDecoder.step`` captured once as a
  ``torch.cuda.CUDAGraph`` and replayed, the host reading ``running`` back after each token;
- ``device loop``: the same step inside a WHILE conditional node (``grape.torch.loop``): one
  launch for the whole generation.

Host syncs are counted with PyTorch's sync debug mode (a warning per synchronising call) for
``generate`` and the host loop; the device loop makes one launch and one read-back. Tokens are
compared with ``generate``'s, on a run without EOS and one where EOS occurs. The GPU time of
the kernels is the per-step graph's, by CUDA events over back-to-back replays.

Writes benchmarks/results/predication_h200.json (or --out). Run on a GPU:
python benchmarks/predication.py [--new 128] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from grape.torch.generate import GreedyDecoder, generate_host_loop
from grape.torch.loop import DeviceLoop
from grape.torch.workloads import _gpt2

PROMPT = 32


def _syncs(fn) -> tuple[object, int]:
    """fn's result and how many synchronising calls PyTorch warned about."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return out, sum("synchroniz" in str(w.message) for w in seen)


def _timed(fn, reps: int = 3) -> tuple[object, float]:
    best, out = float("inf"), None
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return out, best


def _run(model, prompt: torch.Tensor, new: int, eos: int | None) -> list[tuple]:
    """(way, tokens, seconds, syncs) for each way, and the step's GPU time (ms)."""
    def hf():
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=new, do_sample=False,
                                  eos_token_id=eos, pad_token_id=0)[:, PROMPT:]

    expected, hf_s = _timed(hf)
    _, hf_syncs = _syncs(hf)
    decoder = GreedyDecoder(model, prompt, new, eos, 0)
    decoder.prefill()
    decoder.step()  # warm-up outside capture
    decoder.prefill()
    step_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(step_graph):
        decoder.step()
    loop = DeviceLoop(decoder.step, decoder.running, new, params=dict(model.named_parameters()))

    def host_loop():
        decoder.prefill()
        while bool(decoder.running):
            step_graph.replay()
        return decoder.generated()

    def device_loop():
        decoder.prefill()
        loop.launch()
        return decoder.generated()

    host_tokens, host_s = _timed(host_loop)
    _, host_syncs = _syncs(host_loop)
    device_tokens, device_s = _timed(device_loop)
    n = expected.shape[1]
    # The kernels' own time: n - 1 step replays back to back, by CUDA events.
    decoder.prefill()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n - 1):
        step_graph.replay()
    end.record()
    torch.cuda.synchronize()
    floor_ms = start.elapsed_time(end) / max(n - 1, 1)
    loop.close()
    return [("generate", expected, hf_s, hf_syncs, expected, floor_ms),
            ("host loop", host_tokens, host_s, host_syncs, expected, floor_ms),
            ("device loop", device_tokens, device_s, 1, expected, floor_ms)]


def measure(batch: int, new: int) -> list[dict[str, object]]:
    model = _gpt2("gpt2-small")
    torch.manual_seed(batch)
    prompt = torch.randint(0, 50257, (batch, PROMPT), device="cuda")
    free_run = generate_host_loop(GreedyDecoder(model, prompt, new, None, 0))
    rows = []
    for label, eos in (("no EOS", None), ("EOS", int(free_run[0, new // 2]))):
        for way, tokens, seconds, syncs, expected, floor_ms in _run(model, prompt, new, eos):
            n = expected.shape[1]
            rows.append({"batch": batch, "run": label, "way": way, "tokens": n,
                         "ms_per_token": seconds * 1e3 / n,
                         "host_syncs_per_token": syncs / n,
                         "tokens_identical": bool(torch.equal(tokens, expected)),
                         "step_gpu_ms": floor_ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "predication_h200.json")
    args = parser.parse_args()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        print(f"[+] batch {batch}", file=sys.stderr, flush=True)
        rows.extend(measure(batch, args.new))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                    "command": " ".join(sys.argv), "results": rows},
                                   indent=1) + "\n")
    print(f"{'batch':>5} {'run':<7} {'way':<12} {'ms/token':>9} {'syncs/token':>11} "
          f"{'same':>5} {'x floor':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['run']:<7} {r['way']:<12} {r['ms_per_token']:9.3f} "
              f"{r['host_syncs_per_token']:11.2f} {r['tokens_identical']!s:>5} "
              f"{r['ms_per_token'] / r['step_gpu_ms']:8.2f}")


if __name__ == "__main__":
    main()
