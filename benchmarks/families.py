"""Graph families against per-shape graphs: GPT-2 small decode over KV lengths and
Wav2Vec2-base over audio lengths (GPU).

For each workload, in one process, side by side: one ``torch.cuda.CUDAGraph`` per shape (the
naive way, each with its own pool), and one ``grape.torch.family`` over the same shapes (one
executable per topology, per-shape node versions, one shared pool, captured largest first).
Both run the same step. GPT-2: a ``PrefixCache`` preallocated to 1024 tokens, set to the length, one
decode step, logits copied into a static tensor. Wav2Vec2: the first n samples of a buffer
preallocated to the longest audio, encoded, the hidden states copied into the prefix of a
static tensor. Measured:

- device memory: executables (free memory's drop beyond the pools' growth) and pools;
- capture time for all lengths (naive: capture and instantiate; family: capture, read into the
  IR, place it among the versions, instantiate one executable per topology);
- step time over the lengths in generation order, back to back (one sync at the end) and with
  a sync after each step, and the family's host time per step for bringing its executable to
  the shape (``--update nodes``: prepared per-node updates, cached after the first pass, both
  passes reported; ``--update graph``: one ``cuGraphExecUpdate`` from the shape's graph);
- bitwise equality of the logits, family against per-shape graph, on a sample of lengths;
- the issue's summary keys: ``eager_step_ms`` (the step run eagerly over the lengths, back to
  back), ``capture_s_per_shape_naive``/``_family``, ``first_pass_step_ms`` (the family's first
  pass over the lengths, before anything else ran it) and ``steady_step_ms`` (its second),
  ``update_fraction_of_synced_step``, and device bytes: ``device_bytes_family`` and
  ``device_bytes_naive_private`` (free device memory's drop across capturing every shape, in
  this process, where no executable has been destroyed yet), ``device_bytes_naive_shared_pool``
  (per-shape graphs sharing one pool, captured largest first as serving engines do, in a fresh
  process of its own) and ``warm_start_s`` (the family saved here and loaded in a fresh process
  by ``grape.torch.family.load_family``, checked bitwise against per-shape graphs captured
  there; ``warm_start_captured_here`` counts the shapes it captured rather than moved from the
  file, ``warm_start_not_moved`` says why the first few did not move). Before each
  measurement every length has run eagerly and PyTorch's unused cached blocks are handed back,
  so neither the eager steps' memory nor ``torch.cuda.graph``'s own emptying of that cache is
  counted for or against the graphs; and each process has made one CUDA graph of one kernel
  first (``device_bytes_first_graph``: what the driver sets aside once a process uses graphs,
  72 MiB on the H200, which runs up to 15 charged to the family and the shared-pool baseline).
  Each way warms up and captures on one side stream, on which one eager step ran before the
  way was measured (``device_bytes_stream_state*``: cuBLAS's workspaces for that stream, 33 MiB
  on the H200, which runs up to 17 charged once to the family and twice to the baselines).
  A deriving family captures a length or two again on another thread; that thread's cuBLAS
  handles and their state, made once a process, are made before the family by one step on
  another thread and reported apart (``device_bytes_thread_state``).
  Per-shape graphs' first pass over the lengths (``step_ms_naive_first_pass``: each graph's
  first launch uploads it; the family's executables are uploaded when instantiated) is timed
  apart from their second (``step_ms_naive``).

With --out FILE, writes the results there (committed: benchmarks/results/families_h200.json;
with --append, entries of other workloads already there are kept). Run on a GPU, one workload
per process (executable memory is measured before any executable is destroyed):
python benchmarks/families.py [--lengths 1:1023] [--batches 1]
python benchmarks/families.py --audio 16000:160000:1440
``--decoder ARCH[:SIZE]`` decodes with another of ``benchmarks/generate.py``'s architectures
(for instance ``llama``: rotary positions, grouped-query attention, RMSNorm) at its ``bench``
size or another, built from a config with random weights, in place of GPT-2 small;
``--max-len N`` sizes the cache (the issue's Llama shape over 1..2047 sampled every 4th length:
``--decoder llama:llama2048x22 --max-len 2048 --lengths 1:2047:4``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from sampling_replay import recording
from torch.nn.attention import SDPBackend, sdpa_kernel

from grape.cuda.build import Graph
from grape.errors import GrapeError
from grape.torch.cache import PrefixCache
from grape.torch.capture import capture_stream, on_another_thread
from grape.torch.family import capture_family, load_family
from grape.torch.workloads import _gpt2, _wav2vec2

MAX_LEN = 1024
ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _device_bytes() -> tuple[int, int]:
    """Free device memory and PyTorch's reserved bytes, with PyTorch's unused cached blocks
    handed back first: ``torch.cuda.graph`` empties that cache as it begins a capture, so
    without this the baselines' captures were credited with the eager steps' cache (on the
    H200, per-shape graphs sharing one pool measured 218 MB for 255 GPT-2 lengths that way)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    return free, torch.cuda.memory_reserved()


def first_graph_bytes() -> tuple[int, int]:
    """Device memory the driver sets aside for a process's first CUDA graph (one kernel), while
    the graph lives and after it is destroyed; taken first in each process so that no way
    measured after it is charged with it: 72 MiB on the H200, 70 kept (``family_memory.py``).
    Runs 12 to 15 charged it to the family, measured first in its process; the shared-pool
    baseline measured the same to the byte with it taken first (run 16: its executables fill
    what the driver set aside)."""
    before, _ = _device_bytes()
    x = torch.zeros(1, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)
    g.replay()
    kept, _ = _device_bytes()
    del g, x
    return before - kept, before - _device_bytes()[0]


def stream_state_bytes(step: Callable[[int], None], n: int, stream: torch.cuda.Stream) -> int:
    """Device bytes that libraries keep for a stream once a step has run on it (cuBLAS: a
    workspace for each handle and stream, 32 MiB and 1 MiB on the H200), made before a way is
    measured and reported apart (``device_bytes_stream_state``): every way warms up and
    captures on one side stream and needs this once, whatever it captures. Runs up to 17
    charged it to the family (33 of its 36 MiB of pool growth: ``family_memory.py``'s segment
    listing, 90646dc) and twice to the baselines (warm-up and capture on two streams)."""
    before, _ = _device_bytes()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(n)
    torch.cuda.current_stream().wait_stream(stream)
    return before - _device_bytes()[0]


def thread_state_bytes(step: Callable[[int], None], n: int, stream: torch.cuda.Stream) -> int:
    """Device bytes a second thread's libraries keep once a step has run on it, on ``stream``,
    made before a deriving family is measured and reported apart
    (``device_bytes_thread_state``): derivation captures a length or two again on another
    thread (``grape.torch.capture.on_another_thread``), and PyTorch gives that thread cuBLAS
    handles of its own, which keep a workspace per stream and state of their own for the life
    of the process; later threads take the same handles back from PyTorch's pool, so this is
    paid once a process, not once a family. Run 18 (GPT-2 small, H200) found 33 MiB of
    workspace in the family's pool and 64 MiB outside PyTorch's allocator that way."""
    before, _ = _device_bytes()

    def run() -> None:
        with torch.cuda.stream(stream):
            step(n)
        torch.cuda.synchronize()

    on_another_thread(run)
    return before - _device_bytes()[0]


def _steps(run, lengths, sync_each: bool) -> float:
    """ms per step over ``lengths`` in order."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for n in lengths:
        run(n)
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / len(lengths)


def _synced_us(run, lengths) -> list[float]:
    """Each step's wall time, synchronised on both sides (us)."""
    times = []
    for n in lengths:
        torch.cuda.synchronize()
        t = time.perf_counter()
        run(n)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e6)
    return times


def _record(out_dir: Path, w: Workload, window: list[int], naive: dict, family,
            counters: dict) -> None:
    """Traces over ``window`` (CUDA activity only), with each step's wall time measured first,
    without the profiler, both ways: the per-shape graphs as a grape trace, whose counters take
    the family's figures over the same window, and the family as torch.profiler exported it
    (``*.family.gpu_only.json.gz``): the driver calls cuda-python makes (``cuGraphLaunch``, the
    updates) are not among what the profiler records, so its kernels come with no host call
    and grape does not read that file; open it in Perfetto.
    """
    import gzip
    import tempfile

    from grape.torch.record import machine_meta, profile_steps
    from grape.trace import write_trace

    out_dir.mkdir(parents=True, exist_ok=True)
    walls = _synced_us(lambda n: naive[n].replay(), window)
    family.run(window[0])  # the executable holds the window's first shape
    family.update_s, family.updated_nodes = 0.0, 0
    family_walls = _synced_us(family.run, window[1:])
    counters = counters | {
        "family_step_synced_us": statistics.median(family_walls),
        "family_update_us_per_step": family.update_s * 1e6 / (len(window) - 1),
        "window_changed_nodes_per_step": family.updated_nodes / (len(window) - 1),
        "whole_graph_update": float(family.update == "graph")}
    shapes = iter([window[0], *window])  # the profiler's warm-up step, then the window
    trace = profile_steps(lambda: naive[next(shapes)].replay(), len(window))
    meta = machine_meta(w.slug, "graph", walls,
                        f"{w.notes}, {w.shape_name} {window[0]}..{window[-1]}, one step per "
                        f"shape; one torch.cuda.CUDAGraph per {w.shape_name}; the family's "
                        f"figures over the same window in the counters",
                        len(trace.iterations), counters)
    write_trace(out_dir / f"{w.slug}.graph.json.gz", trace, meta)
    family.run(window[0])
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for n in window[1:]:
                family.run(n)
                torch.cuda.synchronize()
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as f, gzip.open(out_dir / f"{w.slug}.family.gpu_only.json.gz",
                                            "wb") as g:
            g.write(f.read())


def _changed(family, a: int, b: int) -> dict[str, object]:
    """Which nodes differ between two lengths, and how (for people reading the result)."""
    from grape.ir import Kernel

    key = family.group_of[a]
    if family.group_of[b] != key:
        return {"lengths": [a, b], "note": "different topologies"}
    variants = family.variants[key]
    before = {**dict(variants.template.ops()), **variants.ops(a)}
    rows = []
    for n, version in variants.switch(a, b):
        # an alternate's (node~k) before: what the shape ran at its template node
        op, old = variants.nodes[n].op(version), before[variants.of(n)[0]]
        if isinstance(op, Kernel) and isinstance(old, Kernel):
            fields = [f for f in ("function", "grid", "block", "shared_mem") if
                      getattr(op, f) != getattr(old, f)]
            diff = sum(x != y for x, y in zip(op.args, old.args, strict=False))
            rows.append(f"{op.name[:60]} fields={fields} arg_bytes={diff}")
        else:
            rows.append(f"{op.kind}")
    return {"lengths": [a, b], "nodes": len(rows), "which": sorted(rows)}


@dataclass
class Workload:
    """One step over a set of shapes, writing into ``out``, which the checks compare."""

    name: str  # in the results: "gpt2-small decode b1"
    slug: str  # trace file names: "gpt2_small_family_b1"
    shape_name: str  # "KV length", "audio samples"
    shapes: list[int]
    step: Callable[[int], None]
    out: torch.Tensor
    params: dict[str, torch.Tensor]
    notes: str
    extra: dict[str, object] = field(default_factory=dict)  # copied into the results


def gpt2_decode(batch: int, lengths: list[int]) -> Workload:
    return decode(batch, lengths)


def decode(batch: int, lengths: list[int], decoder: str | None = None,
           max_len: int = MAX_LEN) -> Workload:
    """One decode step over a ``PrefixCache`` of ``max_len`` positions: GPT-2 small, or
    ``decoder`` (``ARCH[:SIZE]``, an architecture and size of ``benchmarks/generate.py``,
    built from a config with random weights), for trying families on models they were not
    tuned on."""
    if decoder is None:
        model, name, slug = _gpt2("gpt2-small"), "gpt2-small", "gpt2_small"
    else:
        from generate import ARCHS, SIZES, build

        arch, _, size = decoder.partition(":")
        if arch not in ARCHS or (size or "bench") not in SIZES:
            raise SystemExit(f"expected --decoder ARCH[:SIZE] with ARCH among {', '.join(ARCHS)} "
                             f"and SIZE among {', '.join(SIZES)}, found {decoder!r}")
        model = build(arch, SIZES[size or "bench"])
        name = slug = f"{arch}-{size or 'bench'}"
    vocab = model.config.vocab_size
    # None where positions are unbounded (ALiBi: Bloom's config names none)
    positions = getattr(model.config, "max_position_embeddings", None) or max_len
    if not max(lengths) < max_len <= positions:
        raise SystemExit(f"expected KV lengths below --max-len {max_len}, itself at most the "
                         f"model's {positions} positions, found lengths up to {max(lengths)}")
    cache = PrefixCache(model.config.num_hidden_layers, max_len)
    torch.manual_seed(batch)
    with torch.no_grad():
        model(torch.randint(0, vocab, (batch, max_len - 1), device="cuda"),
              past_key_values=cache, use_cache=True)  # every position holds real keys/values
    ids = torch.randint(0, vocab, (batch, 1), device="cuda")
    out = torch.empty(batch, 1, vocab, device="cuda", dtype=model.dtype)

    def step(n: int) -> None:
        cache.set_length(n)
        # Attention that reads the cache's strided prefix in place (on the GPU, Hugging Face
        # passes GPT-2 a mask, so memory-efficient attention). The cuDNN backend, which PyTorch
        # otherwise picked here, switched generated kernels between lengths, and 71 nodes of
        # 302 differed between KV 513 and 577 with it.
        with torch.no_grad(), sdpa_kernel(ATTENTION):
            out.copy_(model(ids, past_key_values=cache, use_cache=True).logits)

    return Workload(f"{name} decode b{batch}", f"{slug}_family_b{batch}", "KV length",
                    lengths, step, out, dict(model.named_parameters()),
                    f"{name} decode, batch {batch}, PrefixCache of {max_len}",
                    {"batch": batch, "kv_lengths": [lengths[0], lengths[-1]], "max_len": max_len})


def wav2vec2_audio(lengths: list[int]) -> Workload:
    model = _wav2vec2("wav2vec2-base")
    longest = max(lengths)
    torch.manual_seed(0)
    audio = torch.randn(1, longest, device="cuda", dtype=torch.float16)
    frames = int(model._get_feat_extract_output_lengths(longest))
    out = torch.zeros(1, frames, model.config.hidden_size, device="cuda", dtype=torch.float16)

    def step(n: int) -> None:
        # The first n samples of one preallocated buffer: a view, so no copy into a placeholder.
        # PyTorch's own choice of attention: flash and memory-efficient attention alone found
        # no kernel for this encoder on the H200 (CaptureError at Hugging Face's sdpa call).
        with torch.no_grad():
            hidden = model(audio[:, :n]).last_hidden_state
        out[:, :hidden.shape[1]].copy_(hidden)

    return Workload("wav2vec2-base audio", "wav2vec2_base_family", "audio samples", lengths,
                    step, out, dict(model.named_parameters()),
                    f"wav2vec2-base encoder, batch 1, audio buffer of {longest} samples",
                    {"batch": 1, "audio_samples": [lengths[0], lengths[-1]]})


def measure(w: Workload, trace_dir: Path | None = None, update: str = "nodes",
            derive_every: int | None = None, save_to: Path | None = None,
            derive_period: int = 1, same_places: bool | None = None,
            verify_unread: bool = False, derive_start: int | None = None,
            record_to: Path | None = None) -> dict[str, object]:
    if update == "graph":
        w = replace(w, name=f"{w.name} (whole-graph updates)", slug=f"{w.slug}_whole")
    elif update == "device":
        w = replace(w, name=f"{w.name} (device switch)", slug=f"{w.slug}_device")
    lengths, step, label = w.shapes, w.step, w.name
    order = sorted(lengths)  # generation order, for decode: one more token each step
    eager_ms = _steps(step, order, sync_each=False)  # also: every length's eager memory cached
    _log(f"  {label} eager: {eager_ms:.3f} ms per step")

    # The family first, in a process that has destroyed no executable yet: the driver hands
    # what destroyed executables held to the next ones, which hides their memory.
    first_graph = first_graph_bytes()[1]
    family_stream_state = stream_state_bytes(step, order[-1], capture_stream())
    family_thread_state = (thread_state_bytes(step, order[-1], capture_stream())
                           if derive_every is not None else 0)
    free_before_family, _ = _device_bytes()
    allocated_a = torch.cuda.memory_allocated()
    # What derive_lengths was given, kept by reference while timed and written once the family
    # is made, for a replay of the host's part on any machine (sampling_replay.py).
    with recording() if record_to is not None else contextlib.nullcontext() as sampling:
        family = capture_family(step, sorted(lengths, reverse=True),
                                params=w.params, update=update, derive_every=derive_every,
                                derive_period=derive_period, same_places=same_places,
                                verify_unread=verify_unread, derive_start=derive_start,
                                progress=lambda line: _log(f"  {label} family: {line}"))
    _log(f"  {label} family: {len(family.groups)} executables in {family.capture_s:.1f} s")
    if sampling is not None:  # written now, after the family's time was taken, kept if cut
        for path in sampling.save(record_to / w.slug):
            _log(f"  {label}: sampling recorded in {path}")
    family_device_bytes = free_before_family - _device_bytes()[0]
    reserved_after_family = torch.cuda.memory_reserved()
    # Of the pool's growth, what live tensors hold (the rest: free blocks the pool keeps). The
    # pool grew by about 1 GB for 255 GPT-2 lengths, where per-shape graphs sharing one pool
    # held 0.22 GB all told: this says whether something keeps tensors alive or the pool
    # does not reuse its blocks.
    family_allocated = torch.cuda.memory_allocated() - allocated_a
    # Its first pass over the lengths, before the checks below run any of it.
    family.update_s, family.updated_nodes = 0.0, 0
    family_cold = _steps(family.run, order, sync_each=False)
    cold_update_us = family.update_s * 1e6 / len(order)
    # One or two executables sit below the driver's allocation granularity, so their memory is
    # the drop in free memory over many copies of each topology's executable (kept alive until
    # the naive graphs are measured too).
    copies = 16
    free_a, _ = _device_bytes()
    # (A graph with device-updatable nodes is instantiated once; its copies here are of the
    # template built again, the same kernels without the attribute.)
    extra = [(g.graph if update != "device"
              else Graph.build(family.variants[name].executable_graph())).instantiate()
             for name, g in family.groups.items() for _ in range(copies)]
    free_b, _ = _device_bytes()
    family_graph = (free_a - free_b) / copies
    # The drop in free memory can miss executables placed in device memory the driver had
    # mapped already (run 19, 2b5867d: a drop of 2 MiB, the pool's, for a pool of 2 MiB and
    # 1.7 MB of executables), so the family is charged at least its pool, its executables and
    # its switch tables. The baselines keep the drop: what it misses of theirs counts against
    # the family's ratio, not for it.
    family_counted = family.pool_bytes + family_graph + family.switch_bytes
    mid = lengths[len(lengths) // 2]
    neighbours = _changed(family, mid, lengths[len(lengths) // 2 + 1])

    side = torch.cuda.Stream()  # warm-up and capture, as the family's capture_stream()
    naive_stream_state = stream_state_bytes(step, order[-1], side)
    free0, reserved0 = _device_bytes()
    t = time.perf_counter()
    naive: dict[int, torch.cuda.CUDAGraph] = {}
    for i, n in enumerate(sorted(lengths, reverse=True)):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(n)  # warm-up outside capture, as torch.cuda.graph's users do
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            step(n)
        naive[n] = g
        if (i + 1) % 100 == 0:
            _log(f"  {label} naive: {i + 1}/{len(lengths)}")
    naive_capture_s = time.perf_counter() - t
    _log(f"  {label} naive: {len(lengths)} graphs in {naive_capture_s:.1f} s")
    free1, reserved1 = _device_bytes()
    naive_pool = reserved1 - reserved0
    naive_graph = (free0 - free1) - naive_pool

    sample = _sample(lengths)
    identical = [_same_as(w, naive[n].replay, family.run, n) for n in sample]
    # Per-shape graphs' first pass reported apart: a graph's first launch uploads it, which
    # the family's executables did when they were instantiated. (Run 16, H200: the second
    # pass back to back ran 1.493 ms a step against 1.137 synced, where run 15's, then a
    # first pass, ran 1.112; so both.)
    naive_first = _steps(lambda n: naive[n].replay(), order, sync_each=False)
    family.update_s, family.updated_nodes = 0.0, 0
    family_ms = _steps(family.run, order, sync_each=False)
    update_us = family.update_s * 1e6 / len(order)
    nodes_per_step = family.updated_nodes / len(order)
    naive_ms = _steps(lambda n: naive[n].replay(), order, sync_each=False)
    naive_sync = _steps(lambda n: naive[n].replay(), order, sync_each=True)
    family_sync = _steps(family.run, order, sync_each=True)
    nodes = [len(g.template) for g in family.groups.values()]
    result = {
        "workload": label, **w.extra, "update": update, "shapes": len(lengths),
        # The summary keys (the detailed figures below say how each was reached).
        "eager_step_ms": eager_ms,
        "capture_s_per_shape_naive": naive_capture_s / len(lengths),
        "capture_s_per_shape_family": family.capture_s / len(lengths),
        "first_pass_step_ms": family_cold, "steady_step_ms": family_ms,
        "update_fraction_of_synced_step": update_us / (family_sync * 1e3),
        "device_bytes_family": max(family_device_bytes, family_counted),
        "device_bytes_family_free_drop": family_device_bytes,
        # the driver's for the process's first graph, taken before any way here is measured
        "device_bytes_first_graph": first_graph,
        # libraries' state for each way's one side stream, made before it was measured
        "device_bytes_stream_state": family_stream_state,
        # a second thread's libraries, which deriving needs once a process, made before
        "device_bytes_thread_state": family_thread_state,
        "device_bytes_stream_state_naive_private": naive_stream_state,
        "family_pool_bytes_allocated": family_allocated,
        "device_bytes_naive_private": free0 - free1,
        "naive_graph_bytes": naive_graph, "naive_pool_bytes": naive_pool,
        "family_graph_bytes": family_graph, "family_pool_bytes": family.pool_bytes,
        "family_graph_bytes_first_instantiation": family.graph_bytes,
        "family_switch_bytes": family.switch_bytes,  # inside device_bytes_family
        "memory_ratio": naive_graph / family_graph,
        "pool_ratio": naive_pool / max(family.pool_bytes, 1),
        "naive_capture_s": naive_capture_s, "family_capture_s": family.capture_s,
        # Executables: one per topology, more where a kernel's attributes change with the shape.
        "topologies": len(family.groups), "nodes_per_topology": nodes,
        # kernels beside their node for launch attributes that change (Variants.alternates)
        "alternates": sum(v.alternate_count for v in family.variants.values()),
        "fingerprints": len({k.split("#")[0] for k in family.groups}),
        # the shapes' node versions (grape.passes.variants): argument rows, which prepared
        # updates point into; before versions, "delta_host_bytes" counted coded XOR deltas
        "version_host_bytes": family.host_bytes,
        "changed_nodes_per_step": nodes_per_step,
        "changed_between_neighbours": neighbours,
        "delta_apply_us_per_step": update_us, "delta_apply_us_per_step_first_pass": cold_update_us,
        "step_ms_naive": naive_ms, "step_ms_naive_first_pass": naive_first,
        "step_ms_family": family_ms,
        "step_ms_family_first_pass": family_cold,
        "step_ms_naive_synced": naive_sync, "step_ms_family_synced": family_sync,
        "bitwise_identical": {str(n): same for n, same in zip(sample, identical, strict=True)},
        "reserved_after_family": reserved_after_family,
        "derive_every": derive_every,
        "derive_period": derive_period if derive_every is not None else None,
        "derive_start": derive_start if derive_every is not None else None,
        "same_places": family.places is not None,
    }
    if family.places is not None:  # captures moved to a reference capture's places
        result.update(captures_at_reference_places=family.places.moved,
                      place_references=len(family.places.references),
                      captures_not_moved=len(family.places.refused),
                      first_not_moved=(family.places.refused or [None])[0])
    if family.sampled is not None:  # lengths captured, derived, checked, refused
        result.update(captured_lengths=len(family.sampled.captured),
                      derived_lengths=len(family.sampled.derived),
                      captured_again_for_loose_slots=len(family.sampled.repeated),
                      captured_where_forms_parted=len(family.sampled.tie_breaks),
                      # why neighbouring captures were not one derivation's (a change of
                      # topology, kernel or a pointer's buffer), the commonest first
                      changes_by_reason=Counter(
                          re.sub(r"\d+", "N", why) for *_, why in family.sampled.cuts
                      ).most_common(8),
                      changes_first=[list(c) for c in family.sampled.cuts[:4]],
                      host_words_made_loose=len(family.sampled.host_words),
                      # the numbers that left most lengths inside trusted stretches underived
                      held_back_most=[[kernel[:60], number, count] for (kernel, number), count
                                      in family.sampled.held_back.most_common(6)],
                      runs_to_show_unread=[list(v) for v in family.sampled.verified],
                      slots_shown_unread=sum(len(s) for d in family.sampled.derivations
                                             for s in d.unread.values()),
                      held_out_checks_failed=sum(bool(d) for d in
                                                 family.sampled.checked.values()),
                      stretches_refused=len(family.sampled.refused),
                      # derive_start: runs sampled finer (and whether a check refuted each)
                      stretches_sampled_finer=[[d.lengths[0], d.lengths[-1], was] for d, was
                                               in family.sampled.superseded],
                      # which of the lengths checked bitwise were derived, not captured
                      bitwise_lengths_derived=sorted(set(sample) & set(family.sampled.derived)))
    if trace_dir is not None:
        window = order[len(order) // 2:len(order) // 2 + 32]
        counters = {k: float(result[k]) for k in (
            "shapes", "topologies", "changed_nodes_per_step", "naive_graph_bytes",
            "family_graph_bytes", "naive_pool_bytes", "family_pool_bytes")}
        counters["nodes"] = float(max(nodes))
        try:
            _record(trace_dir, w, window, naive, family, counters)
        except (GrapeError, OSError) as e:  # the measurements above stand without the trace
            _log(f"  {label}: no trace: {e}")
    if save_to is not None:  # the family, for a fresh process to load
        family.save(save_to / "family.json.gz", w.params)
    for e in extra:
        e.close()
    family.close()
    return result


def _same_as(w: Workload, reference: Callable[[], None], run: Callable[[int], None],
             n: int) -> bool:
    """Whether ``run(n)`` writes bitwise what ``reference()`` writes, run back to back (a
    decode step's output depends on the cache, which earlier steps wrote)."""
    written = []
    for call in (reference, lambda: run(n)):
        w.out.zero_()  # a shorter shape writes only a prefix of ``out``
        call()
        torch.cuda.synchronize()
        written.append(w.out.clone())
    return bool(torch.equal(*written))


def shared_pool_baseline(w: Workload) -> dict[str, object]:
    """Per-shape graphs sharing one pool, captured largest first (what serving engines do):
    free device memory's drop across capturing them all, in this (fresh) process."""
    order = sorted(w.shapes)
    _steps(w.step, order, sync_each=False)  # every length's eager memory cached, as in measure
    first_graph = first_graph_bytes()[1]  # as in measure: no way is charged with it
    side = torch.cuda.Stream()  # warm-up and capture, as in measure
    stream_state = stream_state_bytes(w.step, order[-1], side)
    free0, reserved0 = _device_bytes()
    t = time.perf_counter()
    graphs, pool = [], None
    for n in sorted(w.shapes, reverse=True):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            w.step(n)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=side):
            w.step(n)
        pool = g.pool() if pool is None else pool
        graphs.append(g)
        if len(graphs) % 100 == 0:
            _log(f"  {w.name} shared pool: {len(graphs)}/{len(w.shapes)}")
    capture_s = time.perf_counter() - t
    free1, reserved1 = _device_bytes()
    return {"device_bytes_naive_shared_pool": free0 - free1,
            "device_bytes_first_graph_shared_pool_process": first_graph,
            "device_bytes_stream_state_shared_pool": stream_state,
            "naive_shared_pool_bytes": reserved1 - reserved0,
            "naive_shared_capture_s": capture_s}


def warm_start(w: Workload, folder: Path, update: str = "nodes") -> dict[str, object]:
    """Load the family ``measure`` saved into ``folder`` in this (fresh) process, without
    capturing every shape, and check it bitwise against per-shape graphs captured here on a
    sample of lengths. (Not against the saving process's outputs: a decode step writes its
    token's keys into the cache, so the cache, and every later output, depends on the order in
    which lengths ran before.)"""
    _steps(w.step, sorted(w.shapes), sync_each=False)  # the same eager pass as measure's
    # When each progress line came, from the call, and each collection of the cycle collector
    # while it ran (generation, start, seconds): runs 50 and 55 could not place 0.41 and 0.49 s
    # of warm_start_s; runs 59 to 62 found two full collections of the heap there.
    phases: list[tuple[str, float]] = []
    collected: list[list[float]] = []

    def progress(line: str) -> None:
        phases.append((line, time.perf_counter() - t))
        _log(f"  {w.name} warm start: {line}")

    def timed(phase: str, info: dict) -> None:
        now = time.perf_counter() - t
        if phase == "start":
            collected.append([info["generation"], now, 0.0])
        elif collected:
            collected[-1][2] = now - collected[-1][1]

    gc.callbacks.append(timed)
    t = time.perf_counter()
    try:
        family = load_family(w.step, folder / "family.json.gz", w.params, progress=progress,
                             update="device" if update == "device" else "nodes")
        loaded_s = time.perf_counter() - t
    finally:
        gc.callbacks.remove(timed)
    phases.append(("returned", loaded_s))
    same = []
    for n in _sample(w.shapes):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            w.step(n)
        same.append(_same_as(w, g.replay, family.run, n))
    family.close()
    return {"warm_start_s": loaded_s, "warm_start_phases": phases,
            "warm_start_full_collections": sum(c[0] == 2 for c in collected),
            "warm_start_collections": collected,
            "warm_start_lengths_checked": len(same),
            "warm_start_bitwise": all(same), "warm_start_captured_here": family.captured_here,
            "warm_start_not_moved": family.not_moved}


def _sample(lengths: list[int]) -> list[int]:
    """The lengths the bitwise checks run: both ends and about a dozen between."""
    return sorted({lengths[0], lengths[-1], *lengths[:: max(len(lengths) // 12, 1)]})


def _in_fresh_process(part: str, argv: list[str], extra: list[str], timeout_s: float
                      ) -> dict[str, object]:
    """This script's ``--part PART`` in a new process: its one JSON line, or why it failed.
    Its progress goes to this process's stderr as it happens."""
    cmd = [sys.executable, __file__, *argv, "--part", part, *extra]
    _log(f"  {part}: in a fresh process")
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {f"{part}_failed": f"did not finish in {timeout_s:.0f} s (--fresh-timeout)"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {f"{part}_failed": f"exit {done.returncode} with no result (its stderr above)"}
    return json.loads(lines[-1])


def _range(text: str, what: str, lowest: int, highest: int) -> list[int]:
    try:
        first, last, *stride = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"expected {what} as first:last[:stride], found {text!r}") from None
    if not lowest <= first <= last <= highest or (stride and stride[0] < 1):
        raise SystemExit(f"expected {what} within {lowest}..{highest}, found {text!r}")
    return list(range(first, last + 1, stride[0] if stride else 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1:1023", help="first:last[:stride] KV lengths")
    parser.add_argument("--batches", default="1")
    parser.add_argument("--max-len", type=int, default=MAX_LEN, metavar="N",
                        help="the decode cache's positions (KV lengths up to N - 1; at most "
                             "the model's)")
    parser.add_argument("--decoder", default=None, metavar="ARCH[:SIZE]",
                        help="decode with this architecture and size of benchmarks/generate.py "
                             "(random weights; SIZE default: bench) instead of GPT-2 small")
    parser.add_argument("--audio", default=None, metavar="FIRST:LAST[:STRIDE]",
                        help="Wav2Vec2-base over these audio lengths (samples at 16 kHz) "
                             "instead of GPT-2 decode")
    parser.add_argument("--traces", type=Path, default=None, metavar="DIR",
                        help="also write a trace of the per-shape graphs over 32 shapes, with "
                             "the family's figures as counters, into DIR")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the results as JSON here (nothing is written without it)")
    parser.add_argument("--update", choices=("nodes", "device", "graph"), default="nodes",
                        help="bring executables to shapes node by node from their versions "
                             "(from the host, or by one kernel on the device), or whole, from "
                             "each shape's graph kept on the host")
    parser.add_argument("--derive-every", type=int, default=None, metavar="N",
                        help="capture one length in N and derive the others (issue 15)")
    parser.add_argument("--derive-period", type=int, default=1, metavar="P",
                        help="with --derive-every: derive a length only from lengths equal "
                             "to it modulo P (kernels chosen by a length's alignment)")
    parser.add_argument("--derive-start", type=int, default=None, metavar="S",
                        help="with --derive-every: sample one length in S first, and finer, "
                             "down to --derive-every, only where lengths stay underived "
                             "(capture_family's derive_start)")
    parser.add_argument("--same-places", action=argparse.BooleanOptionalAction, default=None,
                        help="move every capture's temporaries to the places of the first "
                             "capture that allocated alike (grape.passes.places); default: "
                             "with --derive-every only, as capture_family does")
    parser.add_argument("--verify-unread", action="store_true",
                        help="with --derive-every: show argument words unread by running "
                             "samples with the template's bytes there (capture_family's "
                             "verify_unread)")
    parser.add_argument("--append", action="store_true",
                        help="keep the entries of other workloads already in --out")
    parser.add_argument("--no-fresh", action="store_true",
                        help="skip the shared-pool baseline and the warm start, each of which "
                             "runs in a fresh process")
    parser.add_argument("--keep-family", type=Path, default=None, metavar="DIR",
                        help="copy each workload's saved family file (the one the warm start "
                             "loads) into DIR, to look into or load elsewhere")
    parser.add_argument("--fresh-timeout", type=float, default=600.0, metavar="S",
                        help="give up on a fresh process's part after S seconds (reported)")
    parser.add_argument("--record-sampling", type=Path, default=None, metavar="DIR",
                        help="record what the family's sampling was given, for "
                             "sampling_replay.py to replay on the host (DIR/<workload>/)")
    # Internal: one fresh process's part, for one workload; prints one JSON line.
    parser.add_argument("--part", choices=("shared_pool", "warm_start"), help=argparse.SUPPRESS)
    parser.add_argument("--from", dest="saved", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.audio is not None:
        # Below 400 samples the feature extractor's convolutions have nothing to slide over.
        audio = _range(args.audio, "audio lengths", 400, 480000)
        loads = [(lambda: wav2vec2_audio(audio), ["--audio", args.audio])]
    else:
        lengths = _range(args.lengths, "KV lengths", 1, args.max_len - 1)
        decoder = ["--decoder", args.decoder] if args.decoder else []
        loads = [(lambda b=int(b): decode(b, lengths, args.decoder, args.max_len),
                  ["--lengths", args.lengths, "--batches", b, "--max-len", str(args.max_len),
                   *decoder])
                 for b in args.batches.split(",")]
    if args.part is not None:
        if len(loads) != 1 or (args.part == "warm_start") != (args.saved is not None):
            raise SystemExit("expected one workload, and --from with --part warm_start only")
        w = loads[0][0]()
        got = (shared_pool_baseline(w) if args.part == "shared_pool"
               else warm_start(w, args.saved, args.update))
        print(json.dumps(got), flush=True)
        return
    old = (json.loads(args.out.read_text()) if args.append and args.out and args.out.exists()
           else {})
    results: list[dict[str, object]] = []

    def write() -> None:  # after every part: a later part that fails loses nothing before it
        if not args.out:
            return
        ours = {r["workload"] for r in results}
        doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "commands": [*old.get("commands", []), " ".join(sys.argv)],
               "results": [r for r in old.get("results", []) if r["workload"] not in ours]
               + results}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")

    for load, workload_args in loads:
        w = load()
        _log(f"[+] {w.name}, {len(w.shapes)} shapes ({w.shape_name} {w.shapes[0]}.."
             f"{w.shapes[-1]})")
        with tempfile.TemporaryDirectory() as saved:
            results.append(measure(w, args.traces, args.update, args.derive_every,
                                   None if args.no_fresh else Path(saved),
                                   args.derive_period, args.same_places,
                                   args.verify_unread, args.derive_start,
                                   args.record_sampling))
            write()
            if not args.no_fresh:
                results[-1].update(_in_fresh_process("shared_pool", workload_args, [],
                                                     args.fresh_timeout))
                if "device_bytes_naive_shared_pool" in results[-1]:
                    r = results[-1]
                    r["memory_ratio_shared_pool"] = (r["device_bytes_naive_shared_pool"]
                                                     / r["device_bytes_family"])
                    # The same with the second thread's state (once a process, made before
                    # the family and reported apart) charged to the family.
                    r["memory_ratio_shared_pool_thread_state_charged"] = (
                        r["device_bytes_naive_shared_pool"]
                        / (r["device_bytes_family"] + r["device_bytes_thread_state"]))
                write()
                results[-1].update(_in_fresh_process(
                    "warm_start", workload_args, ["--from", saved, "--update", args.update],
                    args.fresh_timeout))
                write()
                if args.keep_family:
                    args.keep_family.mkdir(parents=True, exist_ok=True)
                    slug = "_".join(w.name.replace("-", "_").split())
                    shutil.copy(Path(saved) / "family.json.gz",
                                args.keep_family / f"{slug}.family.json.gz")
        _log(json.dumps({k: v for k, v in results[-1].items()
                         if k != "changed_between_neighbours"}))
        _log(json.dumps(results[-1]["changed_between_neighbours"]))
        torch.cuda.empty_cache()
    keys = ("shapes", "topologies", "eager_step_ms", "first_pass_step_ms", "steady_step_ms",
            "step_ms_naive", "update_fraction_of_synced_step", "capture_s_per_shape_naive",
            "capture_s_per_shape_family", "device_bytes_family", "device_bytes_naive_private",
            "device_bytes_naive_shared_pool", "memory_ratio_shared_pool",
            "memory_ratio_shared_pool_thread_state_charged",
            "device_bytes_stream_state", "device_bytes_thread_state", "warm_start_s",
            "warm_start_bitwise")
    for r in results:
        same = statistics.mean(r["bitwise_identical"].values())
        print(r["workload"], " ".join(f"{k}={r[k]:.4g}" if isinstance(r.get(k), float) else
                                      f"{k}={r.get(k, 'n/a')}" for k in keys),
              f"bitwise={same:.0%}", *(f"{k}={v}" for k, v in r.items() if k.endswith("_failed")))


if __name__ == "__main__":
    main()
