"""Record grape's own executions on the GPU, for the simulator to predict from their IR.

Executions of a GPT-2 small-shaped decoder (fp16, random weights, batch 1, a static cache),
each built by the CUDA backend from its IR (``--runs`` picks among them):

- ``step``: one greedy decode step, captured into the IR and rebuilt as grape's executable;
- ``loop``: the same step in a WHILE node (``DeviceLoop``), ``--new`` tokens per launch;
- ``beam``: a 5-beam search step (``BeamDecoder``: top-k over the beams, the cache reordered
  by beam on the device) in a WHILE node, ``--new`` tokens per launch;
- ``beam_step``: that step alone, as grape's executable (as ``step`` is the loop's).

For each: the IR (``<name>.ir.json.gz``), a torch.profiler trace of ``--profiled`` launches
(``<name>.kineto.json.gz``: the kernels' durations as CUPTI measured them), and, outside the
profiler (CUPTI stretches the gaps between a graph's kernels), the GPU time per launch measured
with CUDA events over ``--timed`` launches, in ``ir_twin.json`` with the loop's iteration count.
``grape simulate <name>.ir.json.gz --durations <name>.kineto.json.gz`` predicts the launch from
the IR; ``tests/test_sim_graph.py`` holds the prediction to the measured figures.

Run on a GPU: python benchmarks/ir_twin.py --out DIR [--runs step,loop,beam,beam_step]
(committed: traces/h200_ir/twin_{step,loop}*, traces/h200_ir_beam/twin_beam*)
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
from pathlib import Path

import torch
import transformers

from grape.cuda.build import Graph
from grape.torch.beam import BeamDecoder
from grape.torch.capture import capture
from grape.torch.decoding import TokenDecoder
from grape.torch.loop import DeviceLoop
from grape.torch.options import resolve


def _timed(launch, repeats: int, before=None) -> list[float]:
    """GPU microseconds of each launch, between CUDA events around it. The stream spins for
    about a millisecond before the first event, so that the launch call's host time (long for
    a graph of hundreds of nodes) passes while the GPU is busy, not inside the measurement: what
    is measured is what the simulator's ``run_graph`` predicts, the graph's time on the GPU."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)  # cycles: about 1 ms on an H200
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(1000 * start.elapsed_time(end))
    return times


def _profiled(launch, repeats: int, path: Path, before=None) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    from grape.cuda.check import observe

    # grape's driver calls marked in the trace (the profiler does not record cuda-python's),
    # so that reading it gives each launch its GPU work (grape.kineto).
    marks = observe(lambda name: record_function(f"grape:{name}"))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, marks:
        for _ in range(repeats):
            if before is not None:
                before()
            torch.cuda.synchronize()
            launch()
            torch.cuda.synchronize()
    raw = path.with_suffix("")
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()


def twin_model() -> tuple[torch.nn.Module, torch.Tensor]:
    """The twins' model (GPT-2 small's shape, fp16, random weights, seeded) and prompt."""
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(torch.float16).cuda().eval()
    return model, torch.randint(3, config.vocab_size, (1, 32), device="cuda")


def twin_decoder(model: torch.nn.Module, ids: torch.Tensor, strategy: str, new: int):
    """A greedy or 5-beam decoder of ``new`` tokens for ``ids``, and its attention mask."""
    extra = {"num_beams": 5} if strategy == "beam" else {}
    options, mask = resolve(model, ids, None, {"max_new_tokens": new, "eos_token_id": None,
                                               **extra})
    cls = BeamDecoder if strategy == "beam" else TokenDecoder
    return cls(model, 1, ids.shape[1], options), mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--timed", type=int, default=50)
    parser.add_argument("--profiled", type=int, default=5)
    parser.add_argument("--runs", default="step,loop,beam,beam_step")
    args = parser.parse_args()
    wanted = args.runs.split(",")
    if unknown := set(wanted) - {"step", "loop", "beam", "beam_step"}:
        parser.error(f"expected runs among step, loop, beam and beam_step, found "
                     f"{sorted(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    model, ids = twin_model()
    params = dict(model.named_parameters())
    stream = torch.cuda.current_stream().cuda_stream
    closing: list = []  # what was built, closed at the end
    runs = {}
    # Only what the chosen runs need is built: every executable alive in the process is one
    # more thing a measurement could be disturbed by.
    for strategy, names in (("greedy", ("step", "loop")), ("beam", ("beam_step", "beam"))):
        if not set(names) & set(wanted):
            continue
        decoder, mask = twin_decoder(model, ids, strategy, args.new)

        def fresh(decoder=decoder, mask=mask) -> None:
            decoder.prefill(ids, mask)

        step_name, loop_name = names
        if loop_name in wanted:
            fresh()
            decoder.step()
            loop = DeviceLoop(decoder.step, decoder.running, args.new, params=params)
            closing.append(loop)
            runs[loop_name] = (loop.ir, loop.launch, fresh, decoder)
        if step_name in wanted:
            fresh()
            decoder.step()
            step = capture(decoder.step, params=params, warmup=0, instantiate=False)
            graph = Graph.build(step.ir)
            executable = graph.instantiate()
            closing.extend([executable, graph])
            runs[step_name] = (step.ir, lambda exe=executable: exe.launch(stream), fresh,
                               decoder)
    # Each launch starts from a fresh prefill (outside the timing): the step's token count
    # must stay within the tokens' table, and the loop must run its full length every time.
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "model": "gpt2 small shape, fp16, batch 1, prompt 32, static cache", "runs": {}}
    for name in wanted:
        ir, launch, before, state = runs[name]
        before()
        for _ in range(3):  # warm-up
            before()
            launch()
        times = _timed(launch, args.timed, before)
        iterations = None
        if name in ("loop", "beam"):
            iterations = int(state.count.item()) - 1  # the prefill made the first token
        ir.save(args.out / f"twin_{name}.ir.json.gz")
        _profiled(launch, args.profiled, args.out / f"twin_{name}.kineto.json.gz", before)
        doc["runs"][name] = {"launch_gpu_us": times, "median_us": statistics.median(times),
                             "nodes": ir.dag.number_of_nodes(), "while_iterations": iterations}
        print(f"{name}: {statistics.median(times):.1f} us per launch (GPU, CUDA events), "
              f"{ir.dag.number_of_nodes()} nodes, iterations {iterations}", flush=True)
    (args.out / "ir_twin.json").write_text(json.dumps(doc, indent=1) + "\n")
    for built in closing:
        built.close()


if __name__ == "__main__":
    main()
