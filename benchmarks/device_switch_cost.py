"""Where a device switch's GPU time goes (issue 15), GPT-2 small decode's family over KV lengths.

Run 15 (``benchmarks/README.md``) put a family switched on the device at 1.204 ms a step
against 1.112 for per-shape graphs and 1.115 with host updates, back to back: about 90 us more
GPU time a step, where ``benchmarks/device_updates.py`` had found a switch of 84 nodes costing
a few microseconds. This splits the step, each way in its own family captured in this process,
side by side:

- ``step_ms``: the family over the lengths in generation order, back to back (one sync at the
  end): switch or host updates, then the executable;
- ``same_ms``: the executable at one length, launched again and again (nothing to switch):
  whether device-updatable nodes slow the graph itself;
- ``switch_us`` (device way): the switch kernels alone over the same lengths, no executable,
  timed with CUDA events, per step, and the nodes they update per step;
- ``graph_ms``: PyTorch's own graph of that one length, replayed, for reference.

Run on a GPU: ``python benchmarks/device_switch_cost.py [--lengths 1:255] [--out F]``.
Written after the session's device time ran out: not yet run.
"""

from __future__ import annotations

import argparse
import json
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
    graph_ms = _steps(lambda n: g.replay(), repeat, sync_each=False)
    rows = []
    for update in ("nodes", "device"):
        family = capture_family(w.step, sorted(lengths, reverse=True), params=w.params,
                                update=update,
                                progress=lambda line, u=update: _log(f"  {u}: {line}"))
        family.run(one)
        row = {"update": update, "shapes": len(lengths),
               "step_ms": _steps(family.run, order, sync_each=False),
               "same_ms": _steps(family.run, repeat, sync_each=False),
               "graph_ms": graph_ms}
        if update == "device":
            row["switch_us"], row["switched_nodes_per_step"] = _switches_alone(family, order)
            row["switch_bytes"] = family.switch_bytes
            family.check()
        rows.append(row)
        _log(json.dumps(row))
        family.close()
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": " ".join(sys.argv), "results": rows}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'update':<8} {'step ms':>8} {'same ms':>8} {'graph ms':>9} {'switch us':>10}")
    for r in rows:
        print(f"{r['update']:<8} {r['step_ms']:>8.3f} {r['same_ms']:>8.3f} {r['graph_ms']:>9.3f} "
              f"{r.get('switch_us', float('nan')):>10.1f}")


if __name__ == "__main__":
    main()
