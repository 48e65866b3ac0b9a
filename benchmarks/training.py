"""Wav2Vec2 CTC fine-tuning steps over variable audio lengths: eager, per-shape graphs and a
grape family, side by side (GPU).

A ``Wav2Vec2ForCTC`` built from its config with random weights, fp32 master weights under fp16
autocast with ``grape.torch.training.LossScaler`` (``GradScaler``'s scaling, its skip an IF
node), AdamW with a tensor learning rate on a linear warm-up schedule computed on the device,
gradients clipped to norm 1 on the device, labels padded to a fixed length with -100, the CTC
loss ``grape.torch.ctc.hf_ctc_loss`` (the model's own, with lengths kept on the device), and
no dropout, LayerDrop or SpecAugment (``grape.torch.workloads.NO_RANDOMNESS``). Audio
lengths are drawn like a speech corpus's (uniform over 1 to 10 s at 16 kHz, rounded to 20 ms),
``--lengths`` distinct ones; a fixed shuffled sequence of ``--steps`` batches, each of one of
them. Ways, each on a model built from the same seed:

- ``eager``: ``GraphedTraining(graphs=False)``: the same step code, run eagerly;
- ``per_shape_graphs``: one CUDA graph per length, each with its own memory pool (as PyTorch's
  graphs are made per shape), captured from the same step; device memory is reported, or the
  length at which the GPU ran out of it;
- ``grape_family``: ``GraphedTraining``: eager steps until the optimizer has stepped once (the
  loss scaler skips the first steps on overflow, and the optimizer creates its state on its
  first real step), then one family over every length (largest first, one pool), each later
  step one launch, each batch copied into the family's input buffer;
- ``grape_family_aliased``: the same with ``inputs_by="alias"``: the graphs re-pointed at each
  batch where it lies (``grape.graphed``), nothing copied.

Every way runs the same eager warm-up steps first (``warmup_steps``: as many as the graphed
ways need; the same batches and so the same count in every way). Written per way:
``ms_per_step`` (mean over the rest of the sequence, one sync at the end; the warm-up and the
capture are ``warmup_s``), ``device_bytes_graphs`` (free memory's drop over the captures),
``capture_s``, ``params_bitwise_equal_to_eager`` and
``params_bitwise_equal_to_per_shape_graphs`` (after the whole sequence; meaningful with
``--deterministic``), with the final loss scale and loss.

Run on a GPU: python benchmarks/training.py [--small] [--deterministic] [--lengths 100]
[--steps 20] [--batch 8] [--derive-every N] [--out FILE] [--plot PNG]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

_T0 = time.perf_counter()


def _log(line: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f} s] {line}", file=sys.stderr, flush=True)


LABEL = 64  # label positions per utterance (padded with -100)
VOCAB = 32


def _config(small: bool) -> dict[str, Any]:
    # Off in every way: SpecAugment's masks and LayerDrop's choices are drawn on the host each
    # step (numpy, CPU tensors: nothing a graph can hold), and dropout's draws come at other
    # generator offsets in graphed steps than in eager ones (grape.torch.rng), which would leave
    # the parameters nothing to be compared with.
    from grape.torch.workloads import NO_RANDOMNESS

    if small:
        return dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=256, vocab_size=VOCAB, **NO_RANDOMNESS)
    return dict(vocab_size=VOCAB, **NO_RANDOMNESS)  # Wav2Vec2-base's own sizes


def _ctc_loss(model, inputs, targets):
    # The model's own loss, with grape's CTC: PyTorch's reads the lengths back to the host (no
    # capture) and adds with atomics (not deterministic). Both ways run this same code.
    from grape.torch.ctc import hf_ctc_loss

    return hf_ctc_loss(model, inputs, targets)


def _build(args, graphs: bool, inputs_by: str = "copy"):
    import torch
    import transformers

    from grape.torch.training import GraphedTraining, LossScaler

    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(**_config(args.small), ctc_loss_reduction="mean")
    model = transformers.Wav2Vec2ForCTC(config).cuda().train()
    model.freeze_feature_encoder()  # as fine-tuning recipes do
    lr = torch.tensor(1e-4, device="cuda")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            capturable=True, foreach=True)
    peak, warmup = 1e-4, 10.0

    def schedule(step):  # linear warm-up, on the device
        return torch.clamp(step / warmup, max=1.0) * peak

    trainer = GraphedTraining(model, _ctc_loss, opt, lengths=args.audio_lengths,
                              input_shape=(args.batch, max(args.audio_lengths)),
                              target_shape=(args.batch, LABEL), amp=torch.float16,
                              scaler=LossScaler("cuda", init_scale=2.0 ** 16),
                              clip_norm=1.0, schedule=schedule, graphs=graphs,
                              derive_every=args.derive_every, inputs_by=inputs_by,
                              progress=_log)
    return model, trainer


def _batches(args):
    import torch

    g = torch.Generator().manual_seed(3)
    order = [args.audio_lengths[i % len(args.audio_lengths)] for i in range(args.steps)]
    random.Random(4).shuffle(order)
    out = []
    for n in order:
        audio = torch.randn(args.batch, n, generator=g).pin_memory()
        labels = torch.full((args.batch, LABEL), -100, dtype=torch.long)
        for row in labels:
            k = int(torch.randint(5, LABEL, (1,), generator=g))
            row[:k] = torch.randint(1, VOCAB, (k,), generator=g)
        out.append((audio, labels.pin_memory()))
    return out


def _memory() -> int:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _sequence(step, batches) -> tuple[float, dict[int, float]]:
    """Run ``step(audio, labels)`` over ``batches`` with one sync at the end: ms per step over
    the whole sequence, and each length's mean ms per step from CUDA events around every step
    (stream-ordered: a step's span includes the GPU waiting on the host's launches)."""
    import torch

    marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(batches) + 1)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    marks[0].record()
    for i, (audio, labels) in enumerate(batches):
        step(audio, labels)
        marks[i + 1].record()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3 / len(batches)
    spans: dict[int, list[float]] = {}
    for i, (audio, _) in enumerate(batches):
        spans.setdefault(audio.shape[1], []).append(marks[i].elapsed_time(marks[i + 1]))
    return ms, {n: round(sum(v) / len(v), 3) for n, v in sorted(spans.items())}


def _warm_up(trainer, batches) -> int:
    """Eager steps until the optimizer has stepped once (its state exists; a capture is now
    safe): how many. At least one, and never the whole sequence."""
    done = 0
    while done == 0 or not trainer.ready_to_capture:
        if done == len(batches) - 1:
            sys.exit(f"every one of the first {done} steps overflowed (the loss scaler skipped "
                     f"them all): nothing left to time; give --steps more")
        trainer(batches[done][0].cuda(non_blocking=True),
                batches[done][1].cuda(non_blocking=True))
        done += 1
    return done


def _run_trainer(args, way: str, batches) -> tuple[dict[str, Any], Any]:

    graphs = way != "eager"
    model, trainer = _build(args, graphs, "alias" if way == "grape_family_aliased" else "copy")
    free = _memory()
    t0 = time.perf_counter()
    warm = _warm_up(trainer, batches)
    if graphs:  # the family is captured at the next call: make it now, timed apart
        trainer.capture()
    warm_s = time.perf_counter() - t0
    graph_bytes = free - _memory()
    ms, by_length = _sequence(lambda audio, labels: trainer(
        audio.cuda(non_blocking=True), labels.cuda(non_blocking=True)), batches[warm:])
    row = {"way": way, "ms_per_step": round(ms, 3), "ms_by_length": by_length,
           "device_bytes_graphs": graph_bytes if graphs else None,
           "capture_s": round(trainer.stats.capture_s, 2) if graphs else None,
           "warmup_steps": warm, "warmup_s": round(warm_s, 2),
           "graphed_steps": trainer.stats.graphed_steps,
           "eager_steps": trainer.stats.eager_steps, "fallback": trainer.stats.fallback,
           "executables": trainer.stats.executables if graphs else None,
           "final_loss_scale": trainer.scaler.get_scale(),
           "final_loss": float(trainer.loss)}
    params = [p.detach().clone() for p in model.parameters()]
    trainer.close()
    return row, params


def _per_shape(args, batches) -> tuple[dict[str, Any], Any]:
    """One CUDA graph per length, each with its own pool, from the same step code."""
    import torch

    from grape.torch.control import graph

    model, trainer = _build(args, graphs=False)
    warm = _warm_up(trainer, batches)  # the optimizer's state, as grape's warm-up makes it
    free = _memory()
    graphs: dict[int, Any] = {}
    t = time.perf_counter()
    oom = None
    for n in sorted(args.audio_lengths, reverse=True):
        g = torch.cuda.CUDAGraph()
        try:
            with graph(g):
                trainer.step_at(n)
        except torch.OutOfMemoryError:
            oom = n
            break
        except Exception as e:  # a capture that breaks: say so, keep the other ways' rows
            return {"way": "per_shape_graphs", "failed": f"{type(e).__name__}: {e}"[:300],
                    "device_bytes_graphs": None, "capture_s": None, "ms_per_step": None}, None
        graphs[n] = g
    capture_s = time.perf_counter() - t
    used = free - _memory()
    row = {"way": "per_shape_graphs", "device_bytes_graphs": used,
           "capture_s": round(capture_s, 2), "executables": len(graphs), "warmup_steps": warm,
           "out_of_memory_at_length": oom, "ms_per_step": None}
    if oom is None:
        def replay(audio, labels):
            n = audio.shape[1]
            trainer.inputs[:, :n].copy_(audio.cuda(non_blocking=True), non_blocking=True)
            trainer.targets.copy_(labels.cuda(non_blocking=True), non_blocking=True)
            graphs[n].replay()
        ms, row["ms_by_length"] = _sequence(replay, batches[warm:])
        row["ms_per_step"] = round(ms, 3)
        row["final_loss_scale"] = trainer.scaler.get_scale()
        row["final_loss"] = float(trainer.loss)
    params = [p.detach().clone() for p in model.parameters()] if oom is None else None
    graphs.clear()  # their pools go back before the next way runs
    return row, params


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"eager": ("o", "-"), "grape_family": ("s", "-"),
              "grape_family_aliased": ("^", "--"), "per_shape_graphs": ("x", ":")}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        if r.get("ms_by_length"):  # keys are ints in memory, strings once read from JSON
            by = {int(n): ms for n, ms in r["ms_by_length"].items()}
            marker, line = styles.get(r["way"], (".", "-"))
            ax.plot([n / 16000 for n in sorted(by)], [by[n] for n in sorted(by)],
                    marker=marker, linestyle=line, markersize=4, label=r["way"])
    ax.set_yscale("log")
    ax.set_xlabel("audio length, s (16 kHz)")
    ax.set_ylabel("ms per training step (log scale)")
    ax.set_title(f"{rows[0]['model']}, batch {rows[0]['batch']}: one step per batch, "
                 f"mean per length", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a small config (for tests)")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--lengths", type=int, default=100, help="distinct audio lengths")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ways", default="eager,grape_family,grape_family_aliased,"
                                           "per_shape_graphs")
    parser.add_argument("--derive-every", type=int, default=None, metavar="N")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG",
                        help="ms per step by audio length, one line per way (matplotlib)")
    parser.add_argument("--plot-only", type=Path, default=None, metavar="JSON",
                        help="draw --plot from a results file this script wrote; run nothing")
    args = parser.parse_args()
    if args.plot_only is not None:
        if args.plot is None:
            parser.error("expected --plot PNG with --plot-only")
        _plot(args.plot, json.loads(args.plot_only.read_text())["results"])
        return
    if args.steps < 2 or args.lengths < 1:
        parser.error("expected --steps of at least 2 and --lengths of at least 1")
    if args.deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before the first cuBLAS handle
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/training.py needs a CUDA device; torch sees none")
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    import transformers

    transformers.logging.set_verbosity_error()
    rng = random.Random(5)
    lengths: set[int] = set()
    while len(lengths) < args.lengths:  # 1 to 10 s at 16 kHz, in 20 ms steps
        lengths.add(320 * rng.randint(50, 500))
    args.audio_lengths = sorted(lengths)
    batches = _batches(args)
    ways = args.ways.split(",")
    rows, params = [], {}
    for way in ways:
        _log(f"[+] {way}")
        if way == "per_shape_graphs":
            row, got = _per_shape(args, batches)
            rows.append(row)
            if got is not None:
                params[way] = got
        else:
            row, params[way] = _run_trainer(args, way, batches)
            rows.append(row)
        torch.cuda.empty_cache()
        _log(json.dumps(rows[-1]))
    for row in rows:
        row.update(model="wav2vec2-small" if args.small else "wav2vec2-base",
                   batch=args.batch, lengths=len(args.audio_lengths), steps=args.steps)
        # Against eager, and against PyTorch's own graphs of the same step: where a capture
        # picks other kernels than eager runs (cuDNN, cuBLAS under capture), only the second
        # compares the same kernels.
        for other in ("eager", "per_shape_graphs"):
            if other in params and row["way"] in params and row["way"] != other:
                row[f"params_bitwise_equal_to_{other}"] = all(
                    torch.equal(a, b) for a, b in zip(params[row["way"]], params[other],
                                                      strict=True))
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "torch": torch.__version__,
                                        "command": " ".join(sys.argv), "results": rows},
                                       indent=1) + "\n")
    if args.plot:
        _plot(args.plot, rows)
    print(f"{'way':20} {'ms/step':>8} {'graph MB':>9} {'capture s':>9} {'execs':>6} "
          f"=eager =torch graphs")
    for r in rows:
        mb = "" if r["device_bytes_graphs"] is None else f"{r['device_bytes_graphs'] / 2**20:.0f}"
        print(f"{r['way']:20} {r['ms_per_step'] or '':>8} {mb:>9} {r['capture_s'] or '':>9} "
              f"{r.get('executables') or '':>6} {r.get('params_bitwise_equal_to_eager', '')!s:6} "
              f"{r.get('params_bitwise_equal_to_per_shape_graphs', '')}")


if __name__ == "__main__":
    main()
