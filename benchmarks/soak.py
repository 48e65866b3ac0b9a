"""A soak on the GPU: grape's graphed paths run thousands of times must hold their memory flat,
release every executable and graph they made, and survive captures that fail half way.

Phases, each on a GPT-2 small-shaped model (fp16, random weights):

- ``family``: one graph family over KV lengths, run ``--family-runs`` times across its shapes;
- ``device_loop``: a whole greedy generation (prefill and a WHILE node) as one launch, launched
  ``--loops`` times;
- ``generate``: ``grape.generate`` called ``--generations`` times with fresh prompts (greedy, 5
  beams and sampling in turn, each strategy's loop captured once and reused);
- ``failed_capture``: ``--failures`` captures broken half way by a host sync (random numbers and
  pool memory taken before the break), through ``grape.torch.capture`` and through a
  ``DeviceLoop``; after each, the process must be as it was: no capture open, the caller's
  stream current, the random generator usable and where it was.

Device memory (free memory as the driver sees it, and PyTorch's reserved and allocated bytes)
is sampled every ``--every`` iterations; growth is the largest sample after the phase's first
sample (its warm-up) minus that first sample. Every grape resource is counted before and after
(``grape.cuda.resource.open_resources``).

Run on a GPU: python benchmarks/soak.py [--out FILE] [--ir-out FILE.json.gz]
(committed: benchmarks/results/soak_h200.json)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from grape.cuda.conditional import condition_kernels
from grape.cuda.resource import open_resources
from grape.errors import CaptureError
from grape.torch.cache import PrefixCache
from grape.torch.capture import capture
from grape.torch.family import capture_family
from grape.torch.generate import GreedyDecoder
from grape.torch.loop import DeviceLoop


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _memory() -> dict[str, int]:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"used": total - free, "reserved": torch.cuda.memory_reserved(),
            "allocated": torch.cuda.memory_allocated()}


def _soak(name: str, iterations: int, every: int, run: Callable[[int], None]) -> dict[str, Any]:
    """``run(i)`` for i in range(iterations), memory sampled before the first and every
    ``every`` after; growth measured from the sample after the first ``every`` (warm-up)."""
    samples = []
    began = time.perf_counter()
    for i in range(iterations):
        run(i)
        if (i + 1) % every == 0 or i + 1 == iterations:
            samples.append(_memory())
    seconds = time.perf_counter() - began
    base = samples[0]
    growth = {k: max(s[k] for s in samples) - base[k] for k in base}
    _log(f"[{name}] {iterations} iterations in {seconds:.1f} s; growth after warm-up: "
         + ", ".join(f"{k} {v:+,d} B" for k, v in growth.items()))
    return {"iterations": iterations, "seconds": seconds, "growth_bytes": growth,
            "samples": samples}


def _model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config()).cuda().half().eval()


def family_phase(model, runs: int, every: int, lengths: list[int],
                 ir_out: Path | None) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cache = PrefixCache(model.config.n_layer, max(lengths) + 1)
    with torch.no_grad():
        model(torch.randint(0, 1000, (1, max(lengths)), device="cuda"), past_key_values=cache)
    ids = torch.randint(0, 1000, (1, 1), device="cuda")
    out = torch.empty(1, 1, model.config.vocab_size, device="cuda", dtype=torch.float16)

    def step(n: int) -> None:
        cache.set_length(n)
        with torch.no_grad(), sdpa_kernel([SDPBackend.FLASH_ATTENTION,
                                           SDPBackend.EFFICIENT_ATTENTION]):
            out.copy_(model(ids, past_key_values=cache).logits)

    step(lengths[0])  # lazy initialisation outside any capture
    family = capture_family(step, lengths, params=dict(model.named_parameters()), progress=_log)
    if ir_out is not None:
        next(iter(family.groups.values())).template.save(ir_out)
    result = _soak("family", runs, every, lambda i: family.run(lengths[i % len(lengths)]))
    result.update(shapes=len(lengths), executables=len(family.groups))
    family.close()
    return result


def device_loop_phase(model, loops: int, every: int, new_tokens: int) -> dict[str, Any]:
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), device="cuda")
    decoder = GreedyDecoder(model, prompt, max_new_tokens=new_tokens, eos_token_id=None)
    decoder.prefill()
    decoder.step()
    decoder.prefill()
    loop = DeviceLoop(decoder.step, decoder.running, new_tokens,
                      params=dict(model.named_parameters()), prologue=decoder.prefill)
    first = None

    def run(i: int) -> None:
        nonlocal first
        loop.launch()
        if i == 0:
            first = decoder.generated()

    result = _soak("device_loop", loops, every, run)
    result["same_tokens_every_launch"] = bool(torch.equal(first, decoder.generated()))
    loop.close()
    return result


def generate_phase(model, calls: int, every: int, new_tokens: int) -> dict[str, Any]:
    """grape.generate called again and again with fresh prompts of one shape: the first call
    captures, the rest reuse its loop; strategies alternate, each with its own loop."""
    import grape
    from grape.torch.api import clear_cache, last_stats

    strategies = [{}, {"num_beams": 5}, {"do_sample": True, "top_k": 50}]

    def run(i: int) -> None:
        prompt = torch.randint(0, model.config.vocab_size, (1, 16), device="cuda")
        out = grape.generate(model, prompt, max_new_tokens=new_tokens, eos_token_id=None,
                             **strategies[i % len(strategies)])
        if out.shape != (1, 16 + new_tokens):
            raise AssertionError(f"expected {new_tokens} new tokens, found {out.shape}")
        if not last_stats().graphed:  # a fallback to generate would soak something else
            raise AssertionError(f"expected a graphed generation, found a fallback: "
                                 f"{last_stats().reason}")

    result = _soak("generate", calls, every, run)
    clear_cache(model)
    return result


def _broken(x: torch.Tensor) -> torch.Tensor:
    y = x * 2 + torch.rand_like(x)  # random numbers and pool memory before the break
    if y.sum().item() > 0:  # a host sync: the capture breaks here
        y = y + 1
    return y


def _recovered(stream: torch.cuda.Stream) -> bool:
    """Whether the process is as a failed capture found it."""
    state = torch.cuda.get_rng_state()
    drawn = torch.randint(0, 1 << 30, (8,), device="cuda")  # failed before the fix
    torch.cuda.set_rng_state(state)
    again = torch.randint(0, 1 << 30, (8,), device="cuda")
    return (not torch.cuda.is_current_stream_capturing()
            and torch.cuda.current_stream() == stream and bool(torch.equal(drawn, again)))


def failed_capture_phase(failures: int, every: int) -> dict[str, Any]:
    x = torch.ones(1 << 20, device="cuda")
    running = torch.ones((), dtype=torch.bool, device="cuda")
    stream = torch.cuda.current_stream()
    _broken(x)
    recovered = 0
    errors: list[str] = []

    def run(i: int) -> None:
        nonlocal recovered
        try:
            if i % 4 == 3:  # a whole device loop whose body breaks the capture
                DeviceLoop(lambda: _broken(x), running, 8)
            else:
                capture(_broken, x, warmup=0)
        except CaptureError as e:
            if len(errors) < 3:
                errors.append(str(e))
            recovered += _recovered(stream)
        else:
            raise AssertionError("the capture was expected to fail, and succeeded")

    result = _soak("failed_capture", failures, every, run)
    result.update(failed_captures_recovered=recovered, errors=errors)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family-runs", type=int, default=10_000)
    parser.add_argument("--loops", type=int, default=1_000)
    parser.add_argument("--failures", type=int, default=200)
    parser.add_argument("--generations", type=int, default=1_000,
                        help="grape.generate calls (greedy, 5 beams and sampling in turn)")
    parser.add_argument("--every", type=int, default=100, help="iterations between samples")
    parser.add_argument("--lengths", default="96:33", help="family KV lengths, first:last")
    parser.add_argument("--new-tokens", type=int, default=16, help="per device-loop launch")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the results as JSON here (nothing is written without it)")
    parser.add_argument("--ir-out", type=Path, default=None, metavar="FILE",
                        help="also save the family's template, a captured GPT-2 decode step, "
                             "as a grape IR file")
    args = parser.parse_args()
    first, last = (int(x) for x in args.lengths.split(":"))
    lengths = list(range(max(first, last), min(first, last) - 1, -1))  # largest first
    model = _model()
    condition_kernels()  # compiled once per process, by design: made before counting
    before = open_resources()
    phases = {"family": family_phase(model, args.family_runs, args.every, lengths, args.ir_out),
              "device_loop": device_loop_phase(model, args.loops, args.every, args.new_tokens),
              "generate": generate_phase(model, args.generations, args.every, args.new_tokens),
              "failed_capture": failed_capture_phase(args.failures, args.every)}
    gc.collect()
    after = open_resources()
    leaked = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": " ".join(sys.argv),
           "iterations": {name: p["iterations"] for name, p in phases.items()},
           "memory_growth_bytes": max(max(p["growth_bytes"].values()) for p in phases.values()),
           "leaked_executables": leaked.get("Executable", 0),
           "leaked_resources": {k: v for k, v in leaked.items() if v},
           "failed_captures_recovered": phases["failed_capture"]["failed_captures_recovered"],
           "phases": phases}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'phase':<16} {'iterations':>10} {'seconds':>8} {'used growth':>12} "
          f"{'reserved growth':>16}")
    for name, p in phases.items():
        g = p["growth_bytes"]
        print(f"{name:<16} {p['iterations']:>10} {p['seconds']:8.1f} {g['used']:>12,d} "
              f"{g['reserved']:>16,d}")
    print(f"memory growth {doc['memory_growth_bytes']:,d} B; leaked executables "
          f"{doc['leaked_executables']} (all resources: {doc['leaked_resources'] or 'none'}); "
          f"failed captures recovered {doc['failed_captures_recovered']} of {args.failures}")


if __name__ == "__main__":
    main()
