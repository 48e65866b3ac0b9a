"""``grape.graphed`` over variable shapes against eager and PyTorch's per-shape graphs (GPU).

One process, side by side, for an encoder (BERT-base, fp16, token ids of varying length) and a
speech model (Wav2Vec2-base, fp16, audio of varying length), each called on a fixed shuffled
sequence of lengths (every length six times), a new input tensor per call as a data loader would
hand it over. Ways:

- ``eager``: the callable itself;
- ``torch_graphs``: one ``torch.cuda.CUDAGraph`` per length in one shared pool, as
  ``make_graphed_callables`` builds them: each call copies its input into the graph's static
  placeholder, then replays;
- ``grape_per_shape``: ``grape.graphed(share=False)``: inputs re-pointed, not copied, one
  executable per length;
- ``grape``: ``grape.graphed``: inputs re-pointed, lengths of one topology sharing an
  executable, brought to each length by node updates (or one whole-graph update);
- ``grape_concurrent``: ``grape.graphed(concurrent=True)``: as ``grape``, each length's graph
  the DAG its memory demands (independent operations side by side); its outputs are also
  compared with ``grape``'s, bit for bit.

Measured per way: ms per call over the sequence (one sync at the end) and over its last pass
over the lengths (most one-time preparation behind it), input bytes copied per call,
executables, their device memory (free memory's drop over the captures beyond the pool's
growth, the same measure for every way), capture time, and whether every output is bitwise
equal to eager's and to the per-shape PyTorch graph's for the same input (eager's kernels
differ from those captured: PyTorch's graphs are not bitwise equal to eager either), with
the largest difference from eager's.

Run on a GPU: python benchmarks/graphed.py [--out FILE] [--bert 8:256:8] [--audio 16000:160000:9000]
[--ways eager,torch_graphs,grape_per_shape,grape,grape_concurrent]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import grape
from grape.torch.workloads import _wav2vec2


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _span(text: str) -> list[int]:
    first, last, *stride = (int(x) for x in text.split(":"))
    return list(range(first, last + 1, stride[0] if stride else 1))


def _memory() -> tuple[int, int]:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()


class _TorchGraphs:
    """Per-shape PyTorch graphs with static input placeholders (the copy grape avoids)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fn, self.pool, self.graphs = fn, torch.cuda.graph_pool_handle(), {}
        self.copy_bytes = 0

    def prepare(self, x: torch.Tensor) -> None:
        static = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn(static)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self.fn(static)
        self.graphs[tuple(x.shape)] = (g, static, out)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g, static, out = self.graphs[tuple(x.shape)]
        static.copy_(x)
        self.copy_bytes += x.nbytes
        g.replay()
        return out


def _workloads(args) -> list[tuple[str, Callable, Callable[[int], torch.Tensor], list[int]]]:
    import transformers

    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig()).cuda().half().eval()
    vocab = bert.config.vocab_size

    @torch.no_grad()
    def encode(ids):
        return bert(ids).last_hidden_state

    speech = _wav2vec2("wav2vec2-base")

    @torch.no_grad()
    def hear(audio):
        return speech(audio).last_hidden_state

    return [("bert-base", encode, lambda n: torch.randint(0, vocab, (1, n), device="cuda"),
             _span(args.bert)),
            ("wav2vec2-base", hear,
             lambda n: torch.randn(1, n, device="cuda", dtype=torch.half), _span(args.audio))]


WAYS = ("eager", "torch_graphs", "grape_per_shape", "grape", "grape_concurrent")


def _run(name: str, fn: Callable, make: Callable[[int], torch.Tensor], lengths: list[int],
         chosen: tuple[str, ...] = WAYS) -> list[dict]:
    order = lengths * 6
    random.Random(0).shuffle(order)
    torch.manual_seed(1)
    inputs = {n: make(n) for n in lengths}  # one input per length: eager's reference outputs
    expected = {n: fn(inputs[n]).clone() for n in lengths}
    largest_first = sorted(lengths, reverse=True)
    made = {"eager": lambda: None,
            "torch_graphs": lambda: _TorchGraphs(fn),
            "grape_per_shape": lambda: grape.graphed(fn, share=False),
            "grape": lambda: grape.graphed(fn),
            "grape_concurrent": lambda: grape.graphed(fn, concurrent=True)}
    rows = []
    graphs_out = grape_out = None
    for way in ("eager", *(w for w in chosen if w != "eager")):  # eager: the ratios' base
        runner = made[way]()
        free, reserved = _memory()
        t = time.perf_counter()
        if runner is not None:
            for n in largest_first:
                runner.prepare(inputs[n].clone())
        capture_s = time.perf_counter() - t
        free_after, reserved_after = _memory()
        call = fn if runner is None else runner
        outputs = {n: call(inputs[n]).clone() for n in lengths}
        if way == "torch_graphs":
            graphs_out = outputs
        if way == "grape":
            grape_out = outputs
        if isinstance(runner, _TorchGraphs):
            runner.copy_bytes = 0
        calls = 0
        torch.cuda.synchronize()
        t = time.perf_counter()
        last_pass = len(order) - len(lengths)
        for n in order:
            if calls == last_pass:
                torch.cuda.synchronize()
                t_last = time.perf_counter()
            call(make(n))
            calls += 1
        torch.cuda.synchronize()
        end = time.perf_counter()
        ms = (end - t) * 1e3 / calls
        row = {"model": name, "way": way, "lengths": len(lengths),
               "min_length": min(lengths), "max_length": max(lengths),
               "ms_per_call": round(ms, 4),
               "ms_per_call_last_pass": round((end - t_last) * 1e3 / len(lengths), 4),
               "outputs_bitwise_equal_to_eager": all(
                   torch.equal(outputs[n], expected[n]) for n in lengths),
               "outputs_bitwise_equal_to_torch_graphs":
                   None if runner is None or graphs_out is None else all(
                       torch.equal(outputs[n], graphs_out[n]) for n in lengths),
               "max_abs_diff_to_eager": max(
                   (outputs[n].float() - expected[n].float()).abs().max().item()
                   for n in lengths),
               "capture_s": round(capture_s, 3) if runner is not None else None,
               "executables": None, "executable_bytes": None, "copy_bytes_per_call": 0}
        if runner is not None:
            row["executable_bytes"] = (free - free_after) - (reserved_after - reserved)
        if isinstance(runner, _TorchGraphs):
            row["executables"] = len(runner.graphs)
            row["copy_bytes_per_call"] = runner.copy_bytes // calls
        elif runner is not None:
            row["executables"] = runner.executables
            row["switches_per_call"] = round(runner.stats.switches / runner.stats.calls, 3)
            row["whole_graph_switches"] = runner.stats.whole_updates
            row["nodes_updated_per_call"] = round(
                (runner.stats.switch_updates + runner.stats.pointer_updates)
                / runner.stats.calls, 2)
            row["copy_bytes_per_call"] = runner.stats.copy_bytes // runner.stats.calls
            paths = runner.paths  # (nodes, longest path) per length
            row["nodes_median"] = sorted(n for n, _ in paths)[len(paths) // 2]
            row["longest_path_median"] = sorted(d for _, d in paths)[len(paths) // 2]
            if way == "grape_concurrent" and grape_out is not None:
                row["outputs_bitwise_equal_to_grape"] = all(
                    torch.equal(outputs[n], grape_out[n]) for n in lengths)
        rows.append(row)
        _log(json.dumps(row))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bert", default="8:256:8", help="first:last[:stride] token lengths")
    parser.add_argument("--audio", default="16000:160000:9000",
                        help="first:last[:stride] audio samples (16 kHz)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE")
    parser.add_argument("--ways", default=",".join(WAYS),
                        help=f"comma-separated, of {', '.join(WAYS)} (eager always runs)")
    parser.add_argument("--models", default="bert-base,wav2vec2-base",
                        help="comma-separated, of bert-base, wav2vec2-base")
    args = parser.parse_args()
    ways = tuple(args.ways.split(","))
    if unknown := [w for w in ways if w not in WAYS]:
        sys.exit(f"expected ways among {', '.join(WAYS)}, found {', '.join(unknown)}")
    if not torch.cuda.is_available():
        sys.exit("benchmarks/graphed.py needs a CUDA device; torch sees none")
    rows = []
    models = args.models.split(",")
    if unknown := [m for m in models if m not in ("bert-base", "wav2vec2-base")]:
        sys.exit(f"expected models among bert-base, wav2vec2-base, found {', '.join(unknown)}")
    for workload in _workloads(args):
        if workload[0] in models:
            rows.extend(_run(*workload, chosen=ways))
        torch.cuda.empty_cache()
    if args.out:
        doc = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__,
               "command": " ".join(sys.argv), "entries": rows}
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'model':14} {'way':16} {'ms/call':>8} {'vs eager':>8} {'last pass':>9} {'execs':>6} "
          f"{'exec MB':>8} {'copy B':>7} {'capture s':>9} {'=graphs':>7} {'path/nodes':>10} "
          f"max|d eager|")
    for r in rows:
        eager = next(e for e in rows if e["model"] == r["model"] and e["way"] == "eager")
        mb = "" if r["executable_bytes"] is None else f"{r['executable_bytes'] / 2**20:.1f}"
        path = (f"{r['longest_path_median']}/{r['nodes_median']}" if "nodes_median" in r
                else "")
        print(f"{r['model']:14} {r['way']:16} {r['ms_per_call']:8.3f} "
              f"{eager['ms_per_call'] / r['ms_per_call']:7.2f}x {r['ms_per_call_last_pass']:9.3f} "
              f"{r['executables'] or '':>6} "
              f"{mb:>8} {r['copy_bytes_per_call']:>7} {r['capture_s'] or '':>9} "
              f"{r['outputs_bitwise_equal_to_torch_graphs']!s:>7} "
              f"{path:>10} {r['max_abs_diff_to_eager']:.2g}")


if __name__ == "__main__":
    main()
