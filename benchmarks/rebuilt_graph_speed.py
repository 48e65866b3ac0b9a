"""Is an executable that grape builds from the IR as fast as PyTorch's own graph of the capture?

``device_switch_cost.py`` (H200, GPT-2 small decode, KV 128) ran a family's executable at one
length 0.857 ms a step against 0.751 for PyTorch's graph of that length replayed the same way:
14% slower with nothing switched. This captures one length, then launches, alternating in
rounds: PyTorch's graph (``torch``), the driver's clone of PyTorch's raw graph instantiated here
(``clone``: the same nodes, edges and attributes, instantiated by grape's flags), and the
graph ``Graph.build`` makes from the IR (``grape``), and a family's executable whose template
was captured at twice the length and brought to this one by node updates. It also lists the
raw graph's edge types (programmatic dependent launch shows as programmatic edges) and every
launch attribute set on its kernel nodes, and the same for grape's rebuild.

Run on a GPU: ``python benchmarks/rebuilt_graph_speed.py [--length 128] [--out F]``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch
from cuda.bindings import driver

from grape.cuda.build import Graph
from grape.torch.capture import capture
from grape.torch.family import capture_family

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import MAX_LEN, _range, _steps, gpt2_decode


def _ok(result):
    status, *values = result
    if status != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"driver call failed: {status}")
    return values[0] if len(values) == 1 else values


def _edges(raw: driver.CUgraph) -> Counter:
    """Edge kinds of ``raw``: (type, from port, to port) to their count."""
    _, _, _, count = _ok(driver.cuGraphGetEdges(raw, 0))
    _, _, data, count = _ok(driver.cuGraphGetEdges(raw, count))
    return Counter((int(d.type), int(d.from_port), int(d.to_port)) for d in data[:count])


def _attributes(raw: driver.CUgraph) -> Counter:
    """(attribute, value's first bytes in hex) to the number of kernel nodes that have it set
    to anything but zero."""
    found = Counter()
    for node in _ok(driver.cuGraphGetNodes(raw, _ok(driver.cuGraphGetNodes(raw, 0))[1]))[0]:
        if _ok(driver.cuGraphNodeGetType(node)) != driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        for attr in driver.CUlaunchAttributeID:
            try:
                status, value = driver.cuGraphKernelNodeGetAttribute(node, attr)
            except Exception:  # an identifier this driver's bindings cannot query
                continue
            if status != driver.CUresult.CUDA_SUCCESS:
                continue
            head = ctypes.string_at(int(value.getPtr()), 16)
            if any(head):
                found[(attr.name.removeprefix("CU_LAUNCH_ATTRIBUTE_"), head.hex())] += 1
    return found


def _timed(launch, count: int) -> float:
    """ms a launch, ``count`` launches back to back, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(count):
        launch()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=128, help="KV length")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--launches", type=int, default=200)
    parser.add_argument("--eager-lengths", default=None, metavar="FIRST:LAST",
                        help="run the step eagerly over these KV lengths first, as "
                             "device_switch_cost.py does (whose process ran graphs slower)")
    parser.add_argument("--family-update", default="nodes", choices=("nodes", "device"),
                        help="how the family's executable is switched (device: its nodes "
                             "made device-updatable and a switch kernel loaded)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE")
    args = parser.parse_args()
    n = args.length
    w = gpt2_decode(1, [n, min(2 * n, MAX_LEN - 1)])
    if args.eager_lengths:
        _steps(w.step, _range(args.eager_lengths, "KV lengths", 1, MAX_LEN - 1), False)
    _steps(w.step, [n] * 3, sync_each=False)
    cap = capture(lambda: w.step(n), params=w.params, instantiate=True)
    raw = driver.CUgraph(cap.torch_graph.raw_cuda_graph())
    stream = torch.cuda.current_stream().cuda_stream
    clone = _ok(driver.cuGraphInstantiate(_ok(driver.cuGraphClone(raw)), 0))
    _ok(driver.cuGraphUpload(clone, stream))
    built = Graph.build(cap.ir)
    executable = built.instantiate(stream)
    # and a family's executable at n: the template captured at a longer length, brought to n
    longer = min(2 * n, MAX_LEN - 1)
    w.step(longer)
    family = capture_family(w.step, [longer, n], params=w.params, update=args.family_update)
    family.run(n)
    ways = {"torch": cap.torch_graph.replay,
            "clone": lambda: _ok((*driver.cuGraphLaunch(clone, stream), None)),
            "grape": lambda: executable.launch(stream),
            f"family_from_{longer}": lambda: family.run(n)}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.rounds):
        for name, launch in ways.items():
            times[name].append(_timed(launch, args.launches))
    edges, attributes = _edges(raw), _attributes(raw)
    built_edges, built_attributes = _edges(built.handle), _attributes(built.handle)
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": " ".join(sys.argv), "length": n, "nodes": len(cap.ir),
           "ms": {k: statistics.median(v) for k, v in times.items()}, "rounds": times,
           "edges_torch": {str(k): v for k, v in edges.items()},
           "edges_grape": {str(k): v for k, v in built_edges.items()},
           "attributes_torch": {str(k): v for k, v in attributes.items()},
           "attributes_grape": {str(k): v for k, v in built_attributes.items()}}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(cap.ir)} nodes; edges (type, from port, to port): torch {dict(edges)}, "
          f"grape {dict(built_edges)}")
    print(f"attributes set: torch {dict(attributes)}")
    print(f"                grape {dict(built_attributes)}")
    for name, ms in doc["ms"].items():
        print(f"{name:<6} {ms:.4f} ms a launch (rounds {min(times[name]):.4f}.."
              f"{max(times[name]):.4f})")


if __name__ == "__main__":
    main()
