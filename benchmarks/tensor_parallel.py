"""Tensor-parallel greedy generation on two GPUs: a Llama-shaped model split by its config's own
plan (``grape.torch.parallel``), four ways side by side, and the same model on one GPU.

One process per GPU (``torchrun --nproc-per-node 2``). Every rank builds the same model from
the config with the same seed, on its GPU, in fp16 (random weights; nothing is downloaded), and
no EOS: every way makes ``--new`` tokens. First rank 0 alone runs the whole model (TP=1) while
the other waits; then both ranks split it and run it at TP=2. Ways:

- ``hf_generate``: ``model.generate`` (dynamic cache, one host sync per token for stopping);
- ``eager_tp``: grape's fixed-shape decoder, stepped eagerly from the host (static cache, one
  read-back per token);
- ``graph_per_step_tp``: that step captured as one PyTorch CUDA graph, replayed once per token
  from the host (one read-back per token);
- ``grape_device_loop_tp``: ``grape.generate``: the whole generation one graph launch per rank,
  the loop condition all-reduced on the device each token, NCCL's kernels inside the WHILE
  node's body.

Written (rank 0, ``--out``): per way and TP, ``ms_per_token`` (median of ``--repeats`` whole
generations, after one untimed call that captures), ``host_syncs_per_token``,
``tokens_identical_to_tp1`` (against the same way at TP=1), and whether both ranks made the same
tokens. ``simulated_ms_per_token`` is null: the simulator's prediction from eager TP traces is
not built yet (docs/scaling.md says what it needs).

Run on 2 GPUs: NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py
[--small] [--new 128] [--batch 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WAYS = ("hf_generate", "eager_tp", "graph_per_step_tp", "grape_device_loop_tp")


def _log(line: str) -> None:
    if dist.get_rank() == 0:
        print(line, file=sys.stderr, flush=True)


def _model(small: bool):
    import transformers

    transformers.logging.set_verbosity_error()
    sizes = (dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4) if small else
             dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8))
    config = transformers.LlamaConfig(vocab_size=32000, bos_token_id=1, eos_token_id=None,
                                      pad_token_id=0, **sizes)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.float16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _decoder(model, ids, new: int):
    from grape.torch.decoding import TokenDecoder
    from grape.torch.options import resolve

    options, mask = resolve(model, ids, None, {"max_new_tokens": new})
    return TokenDecoder(model, ids.shape[0], ids.shape[1], options), mask


def _step_graph(decoder, ids, mask) -> torch.cuda.CUDAGraph:
    """The decoder's step as one PyTorch CUDA graph, after a prefill and warm-up steps (on a
    side stream, as PyTorch's capture wants them; every rank captures together)."""
    decoder.prefill(ids, mask)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decoder.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.step()
    return graph


def _ways(model, ids, new: int) -> dict[str, Any]:
    """Each way as (a call that makes the tokens, host syncs per generation)."""
    import grape

    eager, mask = _decoder(model, ids, new)

    graphed, gmask = _decoder(model, ids, new)
    graph = _step_graph(graphed, ids, gmask)

    def per_step():
        graphed.prefill(ids, gmask)
        while bool(graphed.running):
            graph.replay()
        return graphed.result(ids)

    return {
        "hf_generate": (lambda: model.generate(ids, max_new_tokens=new, do_sample=False), new),
        "eager_tp": (lambda: eager.generate_on_host(ids, mask), new),
        "graph_per_step_tp": (per_step, new),
        "grape_device_loop_tp": (lambda: grape.generate(model, ids, max_new_tokens=new), 1),
    }


def _measure(model, ids, tp: int, args: Any) -> list[dict[str, Any]]:
    rows = []
    for way, (run, syncs) in _ways(model, ids, args.new).items():
        tokens = run()  # captures where the way captures; untimed
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            tokens = run()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        new = tokens.shape[1] - ids.shape[1]
        rows.append({"way": way, "tp": tp, "batch": ids.shape[0], "new_tokens": new,
                     "ms_per_token": round(statistics.median(times) * 1e3 / new, 4),
                     "host_syncs_per_token": round(syncs / new, 4),
                     "tokens": tokens[:, ids.shape[1]:].tolist()})
        _log(f"tp={tp} {way}: {rows[-1]['ms_per_token']} ms/token")
    return rows


def _record(model, ids, directory: Path, name: str) -> None:
    """Each rank's TP decode step, eagerly and as PyTorch's graph of it, as grape traces
    (``grape record``'s format: wall time per step measured before the profiler first runs,
    then a torch.profiler trace of a few steps), for the simulator's two-rank model."""
    from grape.torch.record import machine_meta, profile_steps, timed_calls
    from grape.trace import write_trace

    rank = dist.get_rank()
    runs = {}
    for mode in ("eager", "graph"):
        decoder, mask = _decoder(model, ids, 96)  # room for every step below
        if mode == "graph":
            runs[mode] = (decoder, _step_graph(decoder, ids, mask).replay)
        else:
            decoder.prefill(ids, mask)
            runs[mode] = (decoder, decoder.step)
    walls = {}
    for mode, (_, run) in runs.items():
        dist.barrier()
        walls[mode] = timed_calls(run, 30)
    for mode, (_, run) in runs.items():
        dist.barrier()
        trace = profile_steps(run, 4)
        meta = machine_meta(f"{name}-rank{rank}", mode, walls[mode],
                            f"rank {rank} of {dist.get_world_size()}, tensor-parallel decode "
                            f"step, batch {ids.shape[0]}; fp16, random weights; wall time: 30 "
                            f"synchronised steps before the profiler ran",
                            len(trace.iterations))
        write_trace(directory / f"{name}.rank{rank}.{mode}.json.gz", trace, meta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a small Llama (for a smoke run)")
    parser.add_argument("--new", type=int, default=128, help="new tokens per generation")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, metavar="FILE")
    parser.add_argument("--traces", type=Path, default=None, metavar="DIR",
                        help="also record each rank's TP decode step, eager and graphed, as "
                             "grape traces (last: the profiler slows what runs after it)")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        sys.exit("benchmarks/tensor_parallel.py runs under torchrun (one process per GPU)")
    if os.environ.get("NCCL_NVLS_ENABLE") != "0":
        sys.exit("expected NCCL_NVLS_ENABLE=0 (NVLink multicast stays off), found it unset")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    from grape.torch.parallel import shard

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 32000, (args.batch, args.prompt), generator=g).cuda()
    rows: list[dict[str, Any]] = []
    if rank == 0:  # the whole model on one GPU, the others waiting
        rows += _measure(_model(args.small), ids, 1, args)
        torch.cuda.empty_cache()
    dist.barrier()
    model = shard(_model(args.small))
    split = _measure(model, ids, world, args)
    if args.traces:
        args.traces.mkdir(parents=True, exist_ok=True)
        _record(model, ids, args.traces, f"llama-tp{world}")
    mine = [r["tokens"] for r in split]
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        whole = {r["way"]: r["tokens"] for r in rows}
        for r in split:
            r["tokens_identical_to_tp1"] = r["tokens"] == whole.get(r["way"])
            r["ranks_made_the_same_tokens"] = all(e == every[0] for e in every)
            r["simulated_ms_per_token"] = None
        rows += split
        for r in rows:
            r.pop("tokens")
            r.update(model="llama-small" if args.small else "llama-7b-shape")
        if args.out:
            args.out.write_text(json.dumps({
                "device": torch.cuda.get_device_name(), "gpus": world,
                "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "command": " ".join(sys.argv), "results": rows}, indent=1) + "\n")
        print(f"{'way':22} {'tp':>3} {'ms/token':>9} {'syncs/token':>11} =tp1  ranks=")
        for r in rows:
            print(f"{r['way']:22} {r['tp']:>3} {r['ms_per_token']:>9} "
                  f"{r['host_syncs_per_token']:>11} {r.get('tokens_identical_to_tp1', '')!s:5} "
                  f"{r.get('ranks_made_the_same_tokens', '')}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
