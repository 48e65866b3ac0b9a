"""Real parameter deltas of a graph family: GPT-2 small decode over many KV lengths (GPU).

Captures the decode step at each length, largest first into one shared memory pool, reads each
graph into the IR, groups the lengths by structure, and measures against each group's template
(its largest length): how many nodes differ, how many argument bytes a shape keeps under each
coding (raw XOR, zero coding, run-length coding, the best per node), and how many nodes an
executable must update between consecutive lengths. Prints a summary; writes
benchmarks/results/family_deltas.json.

Run on a GPU: python benchmarks/family_deltas.py [--lengths 64:192]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from grape.passes.compress import CODECS, decode, encode
from grape.passes.delta import changed_nodes, delta
from grape.passes.families import group
from grape.torch.capture import capture
from grape.torch.workloads import parse_spec


def _coded_sizes(d) -> dict[str, int]:
    """Argument bytes the shape keeps under each coding (fields changed whole not counted)."""
    sizes = dict.fromkeys([*CODECS, "best"], 0)
    for nd in d.nodes:
        k = nd.kernel
        if k is None or k.args_codec is None:
            continue
        x = decode(k.args, k.args_codec, k.args_length)
        for name in CODECS:
            sizes[name] += len(encode(x, name))
        sizes["best"] += len(k.args)
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64:192", help="first:last KV length (inclusive)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the results as JSON here (nothing is written without it)")
    args = parser.parse_args()
    first, last = (int(x) for x in args.lengths.split(":"))
    lengths = list(range(last, first - 1, -1))  # largest first, into one pool
    pool = torch.cuda.graph_pool_handle()
    graphs, keep = {}, []
    for kv in lengths:
        w = parse_spec(f"gpt2-small:b1:kv{kv}")
        cap = capture(w.step, *w.inputs, params=w.params, pool=pool)
        graphs[kv] = cap.ir
        keep.append(cap)
    groups = group(graphs)
    per_length, steps = {}, []
    for members in groups.values():
        template = graphs[max(members)]
        deltas = {kv: delta(template, graphs[kv]) for kv in members}
        for kv in members:
            d = deltas[kv]
            per_length[kv] = {"group_nodes": len(template), "nodes_changed": len(d.nodes),
                              "args_bytes_template": sum(len(k.args) for _, k in
                                                         template.kernels()),
                              "coded": _coded_sizes(d)}
        for kv in sorted(members)[1:]:
            steps.append(len(changed_nodes(template, deltas[kv - 1], deltas[kv]))
                         if kv - 1 in deltas else None)
    result = {"lengths": [first, last], "groups": [sorted(m) for m in groups.values()],
              "per_length": per_length,
              "nodes_updated_between_consecutive_lengths": [s for s in steps if s is not None]}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(f"{len(lengths)} lengths in {len(groups)} structure groups: "
          f"{[(min(m), max(m), len(graphs[max(m)])) for m in groups.values()]}")
    coded = {name: statistics.mean(v["coded"][name] for v in per_length.values())
             for name in [*CODECS, "best"]}
    template_bytes = statistics.mean(v["args_bytes_template"] for v in per_length.values())
    print(f"argument bytes per graph {template_bytes:,.0f}; kept per shape on average: "
          + ", ".join(f"{n} {b:,.0f}" for n, b in coded.items()))
    changed = [v["nodes_changed"] for v in per_length.values()]
    updates = result["nodes_updated_between_consecutive_lengths"]
    print(f"nodes differing from the template: median {statistics.median(changed)}, "
          f"max {max(changed)}; nodes to update between consecutive lengths: median "
          f"{statistics.median(updates) if updates else 'n/a'}, max "
          f"{max(updates) if updates else 'n/a'}")


if __name__ == "__main__":
    main()
