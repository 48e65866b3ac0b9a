"""What a sampled token's warpers and draw cost inside a CUDA graph, three ways, side by side.

``chain``: ``generate``'s warpers bit for bit (temperature, top-k with ``TopKLogitsWarper``,
top-p with its sort over the whole vocabulary), then ``grape.torch.decoding.sample``'s float64
inverse transform over the whole vocabulary: what ``grape.generate`` runs where the processed
scores are kept or other cutoffs apply. ``candidates``: ``grape.torch.sampling``'s
``CandidateSampler``, what it runs otherwise: top-p over top-k's ``k + SPARE`` candidates
(``generate``'s survivors), then the draw over them. ``two_stage``: the same with its
``torch.topk`` taken over slices of ``--slice`` scores first, then over their candidates (fewer
kernels than PyTorch's multi-block top-k of one long row). For each vocabulary size and row
count: microseconds per call (median of 5 timings of 200 replays of one graph), kernels per
call (one replay profiled), and on random bfloat16-rounded logits how often each way keeps
``chain``'s survivors and whether each draw is a survivor.

Run on a GPU: python benchmarks/sampling_ways.py [--vocab 32000,50257] [--rows 1,8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile
from transformers.generation.logits_process import TopKLogitsWarper

from grape.torch.decoding import sample
from grape.torch.sampling import SPARE, CandidateSampler
from grape.torch.warpers import DeviceTemperature, DeviceTopP

TOP_K, TOP_P, TEMPERATURE = 50, 0.9, 0.8


def chain_way(vocab: int, rows: int, device: torch.device):
    temperature = DeviceTemperature(TEMPERATURE, device)
    top_k, top_p = TopKLogitsWarper(TOP_K), DeviceTopP(TOP_P, device)

    def run(logits: torch.Tensor, uniform: torch.Tensor, check: bool = False):
        scores = top_p(None, top_k(None, temperature(None, logits)))
        token = sample(scores, uniform)
        return (token, torch.isfinite(scores)) if check else token
    return run


class TwoStageTopK:
    """``torch.topk(scores, width)`` as a top-k of each of ``blocks`` slices, then of theirs:
    each stage many small slices, which PyTorch selects in one kernel each, where one slice of
    a vocabulary's width takes its multi-block radix select (about 30 kernels). The scores are
    written into ``self.scores``, padded with -inf to a multiple of the slices."""

    def __init__(self, rows: int, vocab: int, width: int, slice_len: int,
                 device: torch.device) -> None:
        self.blocks = -(-vocab // slice_len)
        self.width, self.vocab = width, vocab
        padded = torch.full((rows, self.blocks * slice_len), -float("inf"), device=device)
        self.padded, self.scores = padded, padded[:, :vocab]
        self.offsets = (torch.arange(self.blocks, device=device) * slice_len)[:, None]

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.padded.shape[0]
        values, index = self.padded.view(rows, self.blocks, -1).topk(self.width, dim=-1)
        values, at = values.view(rows, -1).topk(self.width, dim=-1)
        return values, (index + self.offsets).view(rows, -1).gather(1, at)


def candidates_way(vocab: int, rows: int, device: torch.device, slice_len: int = 0):
    """``grape.torch.sampling.CandidateSampler``; with ``slice_len``, its ``torch.topk`` taken
    in two stages (:class:`TwoStageTopK`) instead."""
    sampler = CandidateSampler(DeviceTemperature(TEMPERATURE, device), TOP_K,
                               DeviceTopP(TOP_P, device))
    if slice_len:
        two_stage = TwoStageTopK(rows, vocab, TOP_K + SPARE, slice_len, device)

        def topk(scores: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
            two_stage.scores.copy_(scores)
            return two_stage()

    def run(logits: torch.Tensor, uniform: torch.Tensor, check: bool = False):
        if slice_len:
            with _replaced(torch, "topk", topk):
                return run_sampler(logits, uniform, check)
        return run_sampler(logits, uniform, check)

    def run_sampler(logits: torch.Tensor, uniform: torch.Tensor, check: bool):
        token, _ = sampler.draw(logits, uniform)
        if not check:
            return token
        _, index, kept, _ = sampler.candidates(logits)
        survivors = torch.zeros((rows, vocab), dtype=torch.bool, device=device)
        return token, survivors.scatter_(1, index, kept)
    return run


@contextlib.contextmanager
def _replaced(module, name: str, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def timed(fn, logits, uniform) -> tuple[float, int, list[tuple[str, float]]]:
    """(us per call, kernels per call, each kernel's name and us) of ``fn`` captured into one
    CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(logits, uniform)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(logits, uniform)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 200)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
    listed = [(e.name[:80], round((e.time_range.end - e.time_range.start) / 1e3, 2))
              for e in kernels]
    return statistics.median(times), len(kernels), listed


def agreement(ways, vocab: int, rows: int, device: torch.device, trials: int) -> dict:
    """On ``trials`` random draws of logits (rounded to bfloat16, as a bf16 model's come, so that
    ties are common): rows whose survivors agree, and rows whose token (each way's own draw,
    from the same uniform number) is one of its survivors. The two draws walk the survivors in
    different orders (by index, by score), so their tokens are not compared."""
    g = torch.Generator(device=device).manual_seed(0)
    same = drawn = 0
    for _ in range(trials):
        logits = torch.randn((rows, vocab), generator=g, device=device).bfloat16().float()
        uniform = torch.rand((rows, 1), generator=g, device=device)
        (ta, sa), (tb, sb) = (way(logits, uniform, check=True) for way in ways)
        same += int((sa == sb).all(-1).sum())
        drawn += int((sa.gather(1, ta[:, None]) & sb.gather(1, tb[:, None])).sum())
    return dict(rows_checked=trials * rows, survivors_equal=same, tokens_are_survivors=drawn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", default="32000,50257,151936")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--kernels", action="store_true", help="list each way's kernels")
    parser.add_argument("--slice", type=int, default=1024,
                        help="the two-stage top-k's first slices")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.profiler.profile(activities=[ProfilerActivity.CUDA]).__enter__().__exit__(
        None, None, None)  # CUPTI started before any graph: its kernels are then reported
    out = os.environ.get("OUT", "/tmp")
    results = []
    for vocab in map(int, args.vocab.split(",")):
        for rows in map(int, args.rows.split(",")):
            logits = (torch.randn((rows, vocab), device=device) * 3).half().float()
            uniform = torch.rand((rows, 1), device=device)
            ways = {"chain": chain_way(vocab, rows, device),
                    "candidates": candidates_way(vocab, rows, device),
                    "two_stage": candidates_way(vocab, rows, device, args.slice)}
            row = dict(vocab=vocab, rows=rows, **agreement(
                [ways["chain"], ways["candidates"]], vocab, rows, device, args.trials))
            row.update({f"two_stage_{key}": value for key, value in agreement(
                [ways["chain"], ways["two_stage"]], vocab, rows, device, args.trials).items()})
            for name, way in ways.items():
                us, kernels, listed = timed(way, logits, uniform)
                row[f"{name}_us"], row[f"{name}_kernels"] = round(us, 2), kernels
                row[f"{name}_listed"] = listed
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_listed")}),
                  flush=True)
            if args.kernels:
                for name in ways:
                    print(f"  {name}:")
                    for kernel, us in row[f"{name}_listed"]:
                        print(f"    {us:7.2f}  {kernel}")
    with open(f"{out}/sampling_ways.json", "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       top_k=TOP_K, top_p=TOP_P, temperature=TEMPERATURE, results=results),
                  f, indent=1)
    print(f"{'vocab':>7} {'rows':>4} {'way':>10} {'us':>8} {'kernels':>7} {'vs chain':>8} "
          f"{'survivors equal':>16} {'drawn ok':>9}")
    for r in results:
        for way, prefix in (("chain", ""), ("candidates", ""), ("two_stage", "two_stage_")):
            print(f"{r['vocab']:>7} {r['rows']:>4} {way:>10} {r[f'{way}_us']:>8.2f} "
                  f"{r[f'{way}_kernels']:>7} {r['chain_us'] / r[f'{way}_us']:>7.2f}x "
                  f"{r[prefix + 'survivors_equal']:>10}/{r['rows_checked']:<5} "
                  f"{r[prefix + 'tokens_are_survivors']:>9}")


if __name__ == "__main__":
    main()
