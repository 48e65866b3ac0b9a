"""Device-profile constants measured through PyTorch: launch, replay and profiler costs.

Measurements that run torch.profiler each need a fresh process (it slows a process for good once
it ran): ``python -m grape.torch.characterize NAME`` runs one of :data:`MEASUREMENTS` and prints
its JSON, which is how ``grape characterize`` calls them.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from grape.records import top_level
from grape.torch.record import profile_steps, timed_calls

if TYPE_CHECKING:
    from grape.trace import Trace

__all__ = ["MEASUREMENTS", "graph_node_overhead_us", "profiler_overhead_us", "replay_us",
           "torch_launch_us"]


def torch_launch_us(reps: int = 2000) -> dict[str, float]:
    """Host microseconds of one tiny in-place op (one kernel launch) through PyTorch."""
    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps // 200):
        for _ in range(200):  # the launch queue never fills, so this is the host's own cost
            t = time.perf_counter()
            x.add_(1)
            samples.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
    q = np.percentile(samples, [10, 50, 90])
    return {"median": float(q[1]), "p10": float(q[0]), "p90": float(q[2]),
            "samples": len(samples)}


def _bert(layers: int = 4) -> tuple[torch.nn.Module, torch.Tensor]:
    """A small BERT from a config (random weights, fp16): a model the simulator is not
    validated on, so constants measured on it are not fitted to the validation traces."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=256, num_hidden_layers=layers,
                                     num_attention_heads=4, intermediate_size=1024)
    model = transformers.BertModel(config).cuda().half().eval()
    return model, torch.randint(0, config.vocab_size, (1, 64), device="cuda")


def _top_level_calls(trace: Trace) -> int:
    """API calls on the issuing thread not nested in another (driver under runtime)."""
    tid = max({c.tid for c in trace.calls}, key=[c.tid for c in trace.calls].count)
    return len(top_level(sorted((c for c in trace.calls if c.tid == tid),
                                key=lambda c: (c.ts, -c.dur))))


def _profiled(run: Callable[[], object], steps: int, cpu_ops: bool) -> tuple[Trace, list[float]]:
    """A trace of ``steps`` calls of ``run``, and each call's wall time under the profiler."""
    times: list[float] = []

    def timed() -> None:
        times.extend(timed_calls(run, 1))

    trace = profile_steps(timed, steps, cpu_ops)
    return trace, times[1:]  # the first call is the profiler's warm-up, not in the trace


def profiler_overhead_us(steps: int = 30, cpu_ops: bool = True) -> dict[str, float | str]:
    """Host microseconds torch.profiler adds per event it records, on a small BERT.

    With ``cpu_ops`` the events are operators and CUDA API calls (the cost per event of a full
    PyTorch trace); without, only the API calls CUPTI records (grape's validation traces).
    Every plain step runs first: once the profiler has run, the process stays slower, and that
    is part of what a profiled trace shows. Call in a fresh process.
    """
    model, ids = _bert()

    def step() -> None:
        with torch.no_grad():
            model(ids)

    timed_calls(step, 10)
    plain = timed_calls(step, steps)
    trace, profiled = _profiled(step, steps, cpu_ops)
    events = (len(trace.ops) + len(trace.calls)) if cpu_ops else _top_level_calls(trace)
    per_step = events / steps
    added = float(np.median(profiled) - np.median(plain))
    return {"per_event": added / per_step, "events_per_step": per_step,
            "plain_step_us": float(np.median(plain)),
            "profiled_step_us": float(np.median(profiled)),
            "model": "bert 4x256", "events": "operators and API calls" if cpu_ops else "API calls"}


def _decoder(family: str, layers: int) -> tuple[Callable[[], object], tuple[object, ...]]:
    """A decode step of an OPT- or Llama-style model from a config (random weights, fp16) at 64
    cached tokens; the step crops the cache back first, so every call decodes the same length."""
    import transformers

    torch.manual_seed(0)
    if family == "opt":
        config = transformers.OPTConfig(hidden_size=512, num_hidden_layers=layers,
                                        num_attention_heads=8, ffn_dim=2048,
                                        word_embed_proj_dim=512)
        model = transformers.OPTForCausalLM(config)
    else:
        config = transformers.LlamaConfig(hidden_size=512, num_hidden_layers=layers,
                                          num_attention_heads=8, num_key_value_heads=4,
                                          intermediate_size=1408, vocab_size=32000)
        model = transformers.LlamaForCausalLM(config)
    model = model.cuda().half().eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 1000, (1, 64), device="cuda"), use_cache=True
                      ).past_key_values
    ids = torch.randint(0, 1000, (1, 1), device="cuda")

    def step() -> object:
        if (extra := cache.get_seq_length() - 64) > 0:
            cache.crop(-extra)
        with torch.no_grad():
            return model(ids, past_key_values=cache, use_cache=True).logits

    return step, (model, cache, ids)


def _encoder(layers: int) -> tuple[Callable[[], object], tuple[object, ...]]:
    model, ids = _bert(layers)

    def step() -> object:
        with torch.no_grad():
            return model(ids)

    return step, (model, ids)


def graph_node_overhead_us(families: tuple[str, ...] = ("bert", "opt", "llama"),
                           layers: tuple[int, ...] = (2, 6, 12), reps: int = 50,
                           profiled: int = 5) -> dict[str, object]:
    """GPU time a graph adds per node beyond its kernels' own, as CUPTI times the kernels.

    For captured models of several depths: the replay's wall time without the profiler (replay
    and sync), less the union of its kernels' intervals in a CUDA-activity trace, against the
    kernel count; the slope per model family. The families disagree (an encoder's small GEMMs
    hide the gap that decode steps show), so the constant is their median, and every family's
    fit is kept beside it. None of these models is among the validation workloads. Every graph
    is timed before the profiler first runs: call in a fresh process.
    """
    from grape.records import union_length

    graphs = []
    for family in families:
        for n in layers:
            step, keep = _encoder(n) if family == "bert" else _decoder(family, n)
            for _ in range(3):
                step()  # warm-up outside capture (cuBLAS handles, lazy init)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            g.replay()
            graphs.append((family, g, keep))  # the graph reads inputs and weights where they are
    walls = [float(np.median(timed_calls(g.replay, reps))) for _, g, _ in graphs]
    fits: dict[str, dict[str, object]] = {}
    for family in families:
        kernels, excess = [], []
        for (f, g, _), wall in zip(graphs, walls, strict=True):
            if f != family:
                continue
            trace = profile_steps(g.replay, profiled)
            per_it = [[op for launch in it.launches for op in launch.ops if op.kind == "kernel"]
                      for it in trace.iterations]
            kernels.append(len(per_it[0]))
            busy = float(np.median([union_length([(op.ts, op.end) for op in ops])
                                    for ops in per_it]))
            excess.append(wall - busy)
        slope, intercept = np.polyfit(kernels, excess, 1)
        fits[family] = {"layers": list(layers), "nodes": kernels, "wall_minus_busy_us": excess,
                        "per_node_us": float(slope), "fixed_us": float(intercept)}
    per_node = float(np.median([f["per_node_us"] for f in fits.values()]))
    return {"families": fits, "fit": {"per_node_us": max(per_node, 0.0)},
            "note": "median over model families of (replay wall - CUPTI kernel union) per node"}


MEASUREMENTS: dict[str, Callable[[], object]] = {
    "profiler_overhead_us": lambda: profiler_overhead_us(cpu_ops=True),
    "profiler_overhead_cuda_us": lambda: profiler_overhead_us(cpu_ops=False),
    "graph_nodes": graph_node_overhead_us,
}


def replay_us(nodes: tuple[int, ...] = (100, 300, 600), reps: int = 50) -> dict[str, object]:
    """Host microseconds of ``CUDAGraph.replay()`` against node count (chains of ``add_``)."""
    x = torch.zeros(1, device="cuda")
    host = []
    for n in nodes:
        g = torch.cuda.CUDAGraph()
        x.add_(1.0)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for _ in range(n):
                x.add_(1.0)
        g.replay()
        samples = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            g.replay()
            samples.append((time.perf_counter() - t) * 1e6)
        host.append(float(np.median(samples)))
    slope, intercept = np.polyfit(nodes, host, 1)
    return {"nodes": list(nodes), "host_us": host,
            "fit": {"fixed_us": float(intercept), "per_node_us": float(slope)}}


def main(argv: list[str] | None = None) -> None:
    """Run one measurement by name in this (fresh) process; print its JSON."""
    names = sys.argv[1:] if argv is None else argv
    if len(names) != 1 or names[0] not in MEASUREMENTS:
        raise SystemExit(f"expected one of {sorted(MEASUREMENTS)}, found {names}")
    print(json.dumps(MEASUREMENTS[names[0]]()))


if __name__ == "__main__":
    main()
