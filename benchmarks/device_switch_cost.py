"""Where a device switch's GPU time goes (issue 15), GPT-2 small decode's family over KV lengths.

Run 15 (``benchmarks/README.md``) put a family switched on the device at 1.204 ms a step
against 1.112 for per-shape graphs and 1.115 with host updates, back to back: about 90 us more
GPU time a step, where ``benchmarks/device_updates.py`` had found a switch of 84 nodes costing
a few microseconds. This splits the step, each way in its own family captured in this process, the
ways taking turns over several rounds (medians reported):

- ``step_ms``: the family over the lengths in generation order, back to back (one sync at the
  end): switch or host updates, then the executable;
- ``same_ms``: the executable at one length, launched again and again (nothing to switch):
  whether device-updatable nodes slow the graph itself;
- ``switch_us`` (device way): the switch kernels alone over the same lengths, no executable,
  timed with CUDA events, per step, and the nodes they update per step;
- ``graph_ms``: PyTorch's own graph of that one length, replayed, for reference.

Run on a GPU: ``python benchmarks/device_switch_cost.py [--lengths 1:255] [--out F]``.
Its first form, each way timed once, one after another (H200, 1..255,
``results/families_warm_start_h200/switch_cost_0a38ce3.json``), put PyTorch's graph at 0.751 ms
and both families' executables at one length at 0.857-0.866, where
``rebuilt_graph_speed.py`` found grape's rebuilt executable and PyTorch's graph within 0.4% of
each other with the ways taking turns: hence the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from grape.torch.family import capture_family

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import MAX_LEN, _log, _range, _steps, gpt2_decode


def _switches_alone(family, order: list[int]) -> tuple[float, float]:
    """The device switches alone over ``order`` (us a step, by CUDA events) and the nodes they
    update a step: the executables are left as the last switch leaves them, then brought back
    to the shapes they held, so the family runs on as before."""
    held = {name: g.holds for name, g in family.groups.items()}
    stream = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    nodes = 0
    torch.cuda.synchronize()
    start.record(stream)
    for shape in order:
        name = family.group_of[shape]
        group = family.groups[name]
        if group.holds != shape:
            nodes += len(family.variants[name].switch(group.holds, shape))
            family._device[name].launch(family._row[shape], stream.cuda_stream,
                                        family._row[group.holds])
            group.holds = shape
    end.record(stream)
    torch.cuda.synchronize()
    for name, shape in held.items():  # back to what the executables held
        group = family.groups[name]
        if group.holds != shape:
            family._device[name].launch(family._row[shape], stream.cuda_stream,
                                        family._row[group.holds])
            group.holds = shape
    torch.cuda.synchronize()
    family.check()
    return start.elapsed_time(end) * 1e3 / len(order), nodes / len(order)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1:255", help="first:last[:stride] KV lengths")
    parser.add_argument("--rounds", type=int, default=5,
                        help="each way timed this many times, the ways taking turns")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE")
    args = parser.parse_args()
    lengths = _range(args.lengths, "KV lengths", 1, MAX_LEN - 1)
    order = sorted(lengths)
    w = gpt2_decode(1, lengths)
    _steps(w.step, order, sync_each=False)  # every length's eager work once
    one = order[len(order) // 2]
    repeat = [one] * len(order)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.step(one)
    families = {update: capture_family(w.step, sorted(lengths, reverse=True), params=w.params,
                                       update=update,
                                       progress=lambda line, u=update: _log(f"  {u}: {line}"))
                for update in ("nodes", "device")}
    for family in families.values():
        _steps(family.run, order, sync_each=False)  # first pass, untimed
    g.replay()
    # The ways take turns, round after round: run 15's 90 us and this script's first run
    # (each way timed once, one after another) could not tell a way's cost from the GPU's
    # drift over the minutes between them.
    ways = {"graph_ms": lambda: _steps(lambda n: g.replay(), repeat, sync_each=False)}
    for update, family in families.items():
        ways[f"{update}_step_ms"] = lambda f=family: _steps(f.run, order, sync_each=False)
        ways[f"{update}_same_ms"] = lambda f=family: _steps(f.run, repeat, sync_each=False)
    ways["device_switch_us"] = lambda: _switches_alone(families["device"], order)[0]
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            families["device"].run(one)  # every way starts from the same shape
            times[name].append(way())
    families["device"].check()
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": " ".join(sys.argv), "shapes": len(lengths), "length_repeated": one,
           "median": {k: statistics.median(v) for k, v in times.items()}, "rounds": times,
           "switched_nodes_per_step": _switches_alone(families["device"], order)[1],
           "switch_bytes": families["device"].switch_bytes}
    for family in families.values():
        family.close()
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for name, t in doc["median"].items():
        print(f"{name:<18} {t:>9.4f} (rounds {min(times[name]):.4f}..{max(times[name]):.4f})")
    print(f"switched nodes a step: {doc['switched_nodes_per_step']:.1f}")


if __name__ == "__main__":
    main()
