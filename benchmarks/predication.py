"""Greedy generation three ways, side by side: ms per token and host syncs per token (GPU).

GPT-2 small (fp16, random weights, built from its config), a prompt of 32 random tokens, up to
--new tokens, at each batch size:

- ``generate``: Hugging Face's eager greedy generation (its default, growing cache), and
  ``generate static``: the same with its preallocated cache (``cache_implementation="static"``),
  the layout grape's step uses, so the same attention shapes and kernels;
- ``host loop``: ``grape.torch.generate.GreedyDecoder.step`` captured once as a
  ``torch.cuda.CUDAGraph`` and replayed, the host reading ``running`` back after each token;
- ``device loop``: the same step inside a WHILE conditional node (``grape.torch.loop``): one
  launch for the whole decode, after the prompt's eager prefill;
- ``one launch``: the prefill captured too, ahead of the loop in the same graph: one launch
  for the whole generation. Under capture Hugging Face materialises the prompt's causal mask
  (it cannot check on the host that the cache starts empty) where it passes ``is_causal``
  eagerly, so this prefill runs other attention kernels and its cache differs in the last bits
  (H200: up to 3e-3 in fp16 keys); after a near tie its tokens can part from ``generate``'s.
  It is also held to its own reference: the same captured prefill replayed by PyTorch, then the
  host loop (``tokens_identical_captured_prefill``).

Host syncs are counted with PyTorch's sync debug mode (a warning per synchronising call, the
read-back of the tokens included). Tokens are compared with ``generate``'s, on a run without EOS
and one where EOS occurs, and ``generate``'s with its own on a second call. PyTorch's default
kernels do not repeat their results bitwise (on the H200 two eager decoders of one prompt parted
after 33-58 steps, with cuBLAS's workspace fixed too), so over many tokens a near tie can send any
two runs, eager or graphed, different ways; ``--deterministic``
(``torch.use_deterministic_algorithms`` and cuBLAS's ``:4096:8`` workspace) makes every kernel
repeat itself, at nearly three times the kernels per step: for comparing tokens, not for timing.
Times are end to end (prefill included, as ``generate``'s are) and, for the two graphed ways, of
the decode alone, against the GPU time of the step's kernels: the per-step graph replayed back to
back, by CUDA events.

With --out FILE, writes the results there (committed: benchmarks/results/predication_h200.json).
Run on a GPU:
python benchmarks/predication.py [--new 128] [--batches 1,8] [--deterministic]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def _timed(fn, before=None, reps: int = 3) -> tuple[object, float]:
    """fn's result and its best wall time over ``reps`` runs, each after ``before()`` (not
    timed) and a sync."""
    best, out = float("inf"), None
    for _ in range(reps):
        if before is not None:
            before()
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return out, best


class Ways:
    """The three ways of generating for one model, prompt and EOS id, built once."""

    def __init__(self, model, prompt: torch.Tensor, new: int, eos: int | None) -> None:
        self.model, self.prompt, self.new, self.eos = model, prompt, new, eos
        decoder = self.decoder = GreedyDecoder(model, prompt, new, eos, 0)
        decoder.prefill()
        decoder.step()  # warm-up outside capture: nothing may initialise lazily inside one
        decoder.prefill()
        self.step_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.step_graph):
            decoder.step()
        self.loop = DeviceLoop(decoder.step, decoder.running, new,
                               params=dict(model.named_parameters()))
        self.whole = DeviceLoop(decoder.step, decoder.running, new,
                                params=dict(model.named_parameters()), prologue=decoder.prefill)

    def generate(self) -> torch.Tensor:
        with torch.no_grad():
            return self.model.generate(self.prompt, max_new_tokens=self.new, do_sample=False,
                                       eos_token_id=self.eos, pad_token_id=0)[:, PROMPT:]

    def generate_static(self) -> torch.Tensor:
        """``generate`` with Hugging Face's own preallocated cache, the layout grape's step
        uses: the same attention shapes, so the same kernels and sums as grape's ways."""
        with torch.no_grad():
            return self.model.generate(self.prompt, max_new_tokens=self.new, do_sample=False,
                                       eos_token_id=self.eos, pad_token_id=0,
                                       cache_implementation="static",
                                       # eager: with a static cache on a GPU, generate would
                                       # otherwise torch.compile the model's forward
                                       disable_compile=True)[:, PROMPT:]

    def host_decode(self) -> torch.Tensor:
        while bool(self.decoder.running):
            self.step_graph.replay()
        return self.decoder.generated()

    def device_decode(self) -> torch.Tensor:
        self.loop.launch()
        return self.decoder.generated()

    def host_loop(self) -> torch.Tensor:
        self.decoder.prefill()
        return self.host_decode()

    def device_loop(self) -> torch.Tensor:
        self.decoder.prefill()
        return self.device_decode()

    def one_launch(self) -> torch.Tensor:
        self.whole.launch()
        return self.decoder.generated()

    def captured_prefill_host_loop(self) -> torch.Tensor:
        """One launch's reference: its prefill as PyTorch captured it, then the host loop."""
        self.whole.prologue.replay()
        return self.host_decode()

    def close(self) -> None:
        self.loop.close()
        self.whole.close()

    def floor_ms(self, steps: int) -> float:
        """The step's kernels' GPU time: ``steps`` step replays back to back, by CUDA events
        (the GPU never waits on the host between them)."""
        self.decoder.prefill()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(steps):
            self.step_graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps


def _run(ways: Ways) -> dict[str, object]:
    """Every way's tokens, end-to-end time, decode time (after the prefill) and host syncs."""
    expected, hf_s = _timed(ways.generate)
    again, hf_syncs = _syncs(ways.generate)
    static, static_s = _timed(ways.generate_static, reps=2)
    _, static_syncs = _syncs(ways.generate_static)
    host_tokens, host_s = _timed(ways.host_loop)
    _, host_syncs = _syncs(ways.host_loop)
    device_tokens, device_s = _timed(ways.device_loop)
    whole_tokens, whole_s = _timed(ways.one_launch)
    _, whole_syncs = _syncs(ways.one_launch)
    same_prefill = ways.captured_prefill_host_loop()
    _, host_decode_s = _timed(ways.host_decode, before=ways.decoder.prefill)
    _, device_decode_s = _timed(ways.device_decode, before=ways.decoder.prefill)
    ways.decoder.prefill()
    _, device_syncs = _syncs(ways.device_decode)
    n = expected.shape[1]
    return {"tokens": n, "expected": expected, "expected_static": static,
            "same_prefill": same_prefill,
            "floor_ms": ways.floor_ms(max(n - 1, 1)),
            # generate against itself: whether the eager kernels repeat their results at all
            "generate_repeats": bool(torch.equal(expected, again)),
            "ways": [("generate", expected, hf_s, hf_syncs, None),
                     ("generate static", static, static_s, static_syncs, None),
                     ("host loop", host_tokens, host_s, host_syncs, host_decode_s),
                     ("device loop", device_tokens, device_s, device_syncs, device_decode_s),
                     ("one launch", whole_tokens, whole_s, whole_syncs, None)]}


def _record(ways: Ways, out_dir: Path, name: str, counters: dict[str, float],
            steps: int = 32, rounds: int = 5) -> None:
    """Traces, recorded after every timing (the profiler slows a process's host side for
    good): the host loop token by token (a grape trace, CUDA activity only), and one
    device-loop generation as torch.profiler exported it (its launch is a cuda-python driver
    call the profiler does not record, so only its kernels are there: open it in Perfetto).

    Right before the profiler starts, ``rounds`` times in turn: the host loop's tokens one by
    one and the device loop's decode, so that the trace's wall times and the device loop's
    figure (a counter, which ``grape validate`` predicts from the trace) come from one window:
    the GPU's own pace drifted by up to 17% over one process (H200, step graph replayed back to
    back: 0.71 ms early, 0.83 ms later)."""
    import gzip
    import tempfile

    from grape.torch.record import machine_meta, profile_steps
    from grape.trace import write_trace

    def token() -> None:
        ways.step_graph.replay()
        bool(ways.decoder.running)

    walls, device, floor = [], [], []
    for _ in range(rounds):
        ways.decoder.prefill()
        torch.cuda.synchronize()
        for _ in range(steps):
            t = time.perf_counter()
            token()
            walls.append((time.perf_counter() - t) * 1e6)
        ways.decoder.prefill()
        tokens, seconds = _timed(ways.device_decode, reps=1)
        device.append(seconds * 1e3 / (tokens.shape[1] - 1))
        floor.append(ways.floor_ms(steps))
    counters = counters | {"device_loop_decode_ms_per_token": statistics.median(device),
                           "step_gpu_ms": statistics.median(floor),
                           "device_loop_decode_ms_per_token_spread": max(device) - min(device)}
    ways.decoder.prefill()
    trace = profile_steps(token, steps)
    meta = machine_meta(name, "graph", walls,
                        "greedy decoding, one token per iteration: a torch.cuda.CUDAGraph of "
                        "GreedyDecoder.step replayed, then its running flag read back",
                        len(trace.iterations), counters)
    write_trace(out_dir / f"{name}.graph.json.gz", trace, meta)
    ways.decoder.prefill()
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            ways.device_decode()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(raw))
        doc = first_iterations(json.loads(raw.read_text()), steps)
    with gzip.open(out_dir / f"{name}.device_loop.gpu_only.json.gz", "wt") as f:
        json.dump(doc, f)


def first_iterations(doc: dict, iterations: int) -> dict:
    """A Kineto trace of a device loop cut after its first ``iterations`` iterations (each ends
    with grape's ``grape_while_bounded`` setter kernel), so that the committed file stays small;
    the cut is said in the trace's ``grape_note``. Keeps the whole trace where it holds fewer."""
    gpu = ("kernel", "gpu_memcpy", "gpu_memset")
    ends = sorted(e["ts"] + e["dur"] for e in doc["traceEvents"]
                  if e.get("cat") == "kernel" and e.get("name") == "grape_while_bounded")
    if len(ends) <= iterations:
        return doc
    cut = ends[iterations - 1]
    kept = [e for e in doc["traceEvents"] if e.get("cat") not in gpu or e["ts"] < cut]
    return doc | {"traceEvents": kept,
                  "grape_note": f"GPU activity of the first {iterations} of {len(ends)} loop "
                                f"iterations; the rest cut to keep the file small"}


def _first_difference(tokens: torch.Tensor, expected: torch.Tensor) -> int | None:
    """The first token index where two generations differ (a shorter one differs where it
    stops), or None where they are equal."""
    n = min(tokens.shape[1], expected.shape[1])
    differ = (tokens[:, :n] != expected[:, :n]).any(dim=0).nonzero()
    if differ.numel():
        return int(differ[0, 0])
    return None if tokens.shape[1] == expected.shape[1] else n


def measure(batch: int, new: int, trace_dir: Path | None) -> list[dict[str, object]]:
    model = _gpt2("gpt2-small")
    torch.manual_seed(batch)
    prompt = torch.randint(0, 50257, (batch, PROMPT), device="cuda")
    free_run = generate_host_loop(GreedyDecoder(model, prompt, new, None, 0))
    rows, kept = [], None
    for label, eos in (("no EOS", None), ("EOS", int(free_run[0, new // 2]))):
        ways = Ways(model, prompt, new, eos)
        got = _run(ways)
        n, floor = got["tokens"], got["floor_ms"]
        for way, tokens, seconds, syncs, decode_s in got["ways"]:
            made = tokens.shape[1]  # a way whose tokens differ can stop at another length
            row = {"batch": batch, "run": label, "way": way, "tokens": made,
                   "ms_per_token": seconds * 1e3 / made,
                   "host_syncs": syncs, "host_syncs_per_token": syncs / made,
                   "tokens_identical": bool(torch.equal(tokens, got["expected"])),
                   # against generate with a static cache: the same attention shapes
                   "tokens_identical_static": bool(torch.equal(tokens, got["expected_static"])),
                   "first_difference": _first_difference(tokens, got["expected"]),
                   "first_difference_static": _first_difference(tokens,
                                                                got["expected_static"]),
                   "generate_repeats": got["generate_repeats"],
                   "step_gpu_ms": floor}
            if way == "one launch":
                row["tokens_identical_captured_prefill"] = bool(
                    torch.equal(tokens, got["same_prefill"]))
            if not (row["tokens_identical"] or row["tokens_identical_static"]):
                # Equal to neither: kept whole, to tell a loop that did not stop from tokens
                # that parted.
                row["token_ids"] = tokens.tolist()
                row["static_token_ids"] = got["expected_static"].tolist()
            if decode_s is not None and made > 1:
                # Decode alone (the prefill's token excluded) against its kernels' time.
                row["decode_ms_per_token"] = decode_s * 1e3 / (made - 1)
                row["decode_x_floor"] = row["decode_ms_per_token"] / floor
                row["overhead_us_per_token"] = (row["decode_ms_per_token"] - floor) * 1e3
            rows.append(row)
        if eos is None:
            kept = (ways, {f"{r['way'].replace(' ', '_')}_ms_per_token": r["ms_per_token"]
                           for r in rows} | {
                "host_loop_decode_ms_per_token": next(
                    r["decode_ms_per_token"] for r in rows if r["way"] == "host loop"),
                "tokens": float(n), "step_gpu_ms": floor})
        else:
            ways.close()
    ways, counters = kept
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        _record(ways, trace_dir, f"gpt2_small_greedy_b{batch}", counters)
    ways.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the results as JSON here (nothing is written without it)")
    parser.add_argument("--traces", type=Path, default=None, metavar="DIR",
                        help="also record traces of the host loop and the device loop here")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic kernels (torch.use_deterministic_algorithms, cuBLAS "
                             "workspace :4096:8): without them results differ from run to run, "
                             "and so, after a near tie, do the tokens")
    args = parser.parse_args()
    if args.deterministic:
        # Before the first cuBLAS handle: PyTorch reads the workspace setting once.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
    rows = []
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    for batch in (int(b) for b in args.batches.split(",")):
        print(f"[+] batch {batch}", file=sys.stderr, flush=True)
        rows.extend(measure(batch, args.new, args.traces))
        # Written after every batch, so that a run cut short keeps what it measured.
        if args.out:
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                            "command": " ".join(sys.argv),
                                            "deterministic": args.deterministic,
                                            "results": rows}, indent=1) + "\n")
    print(f"{'batch':>5} {'run':<7} {'way':<15} {'ms/token':>9} {'syncs/token':>11} "
          f"{'same':>5} {'static':>6} {'decode ms':>9} {'x floor':>8}  (generate repeats "
          f"itself: {all(r['generate_repeats'] for r in rows)}; same: tokens equal "
          f"generate's, static: generate's with a static cache)")
    for r in rows:
        decode = (f"{r['decode_ms_per_token']:9.3f} {r['decode_x_floor']:8.3f}"
                  if "decode_ms_per_token" in r else f"{'':>9} {'':>8}")
        own = ("" if "tokens_identical_captured_prefill" not in r else
               f"  (its captured prefill + host loop: {r['tokens_identical_captured_prefill']})")
        print(f"{r['batch']:>5} {r['run']:<7} {r['way']:<15} {r['ms_per_token']:9.3f} "
              f"{r['host_syncs_per_token']:11.2f} {r['tokens_identical']!s:>5} "
              f"{r['tokens_identical_static']!s:>6} {decode}{own}")


if __name__ == "__main__":
    main()
