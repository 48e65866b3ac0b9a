"""Which missing ordering makes a concurrent step's tokens differ from the chain's (GPU).

``grape.generate(concurrent=True)`` runs a step's operations as the DAG their memory demands
(``grape.passes.concurrency``). Where its tokens differ from the chain's, some operation ran
beside one it should have waited for. This finds the pair on the sweep's model
(``arch_sweep.py``'s config, prompts and options) by bisection over the DAG of one part of the
launch (the prompt's ``prologue`` or the decode ``body``; the other part kept a chain):

1. the groups (operations) from k on are made to wait for every group before them, and the
   smallest k whose tokens differ is found: freeing group j = k - 1 breaks them;
2. group j is then made to wait for groups [0, m), and the smallest m whose tokens equal the
   chain's is found: group i = m - 1 is the one it must wait for.

It prints both groups (and their neighbours): what the capture declared they read and wrote,
what the pass widened, and each node's pointers, which is what the pass decided from.

    python benchmarks/concurrency_bisect.py persimmon --batch 2 --part prologue

Each probe captures the generation again (a few seconds on a small config): about twenty.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

NEVER = 10**9  # a k past every group: the part as the pass made it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch", help="a model type, as arch_sweep.py builds it")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--strategy", default="greedy", help="as arch_sweep.py names them")
    parser.add_argument("--part", choices=("prologue", "body"), default="prologue")
    args = parser.parse_args()

    import arch_sweep
    import torch

    import grape
    import grape.torch.loop as loop
    from grape.passes import concurrency
    from grape.torch.api import clear_cache

    setting = {"body": NEVER, "prologue": NEVER, "also": None}
    seen: dict[str, tuple] = {}
    made = loop.concurrent_dag
    calls = [0]

    def serialised(ir, accesses, allocations):
        # DeviceLoop makes the body's DAG first, then the prologue's.
        name = "body" if calls[0] % 2 == 0 else "prologue"
        calls[0] += 1
        dag = made(ir, accesses, allocations)
        groups = concurrency._groups(ir, accesses, allocations)
        seen[name] = (ir, groups)
        g = dag.graph

        def after(i: int, j: int) -> None:  # group j's first node after every node of group i
            for u in groups[i].nodes:
                if not g.dag.has_edge(u, groups[j].nodes[0]):
                    g.dag.add_edge(u, groups[j].nodes[0])

        k = setting[name]
        for j in range(max(k, 1), len(groups)):
            after(j - 1, j)
            if j == k:
                for i in range(j - 1):
                    after(i, j)
        if name == args.part and setting["also"] is not None:
            j, m = setting["also"]
            for i in range(m):
                after(i, j)
        return dag

    loop.concurrent_dag = serialised

    model = arch_sweep.build(args.arch, "cuda", torch.bfloat16)
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(100 + args.batch)  # the sweep's prompts
    ids = torch.randint(3, vocab, (args.batch, arch_sweep.PROMPT), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1:, : arch_sweep.PROMPT // 4] = 0
    kw = dict(arch_sweep.STRATEGIES[args.strategy], max_new_tokens=arch_sweep.NEW_TOKENS[0],
              do_sample=False, eos_token_id=None, pad_token_id=0)
    warnings.simplefilter("ignore")
    chain = grape.generate(model, ids, mask, **kw)

    def differs(**chosen) -> bool:
        setting.update({"body": NEVER, "prologue": NEVER, "also": None}, **chosen)
        clear_cache(model)
        calls[0] = 0
        return not torch.equal(grape.generate(model, ids, mask, concurrent=True, **kw), chain)

    began = time.time()
    print("differs as made:", differs(), "| body a chain:", differs(body=0),
          "| prologue a chain:", differs(prologue=0), flush=True)
    other = {"body" if args.part == "prologue" else "prologue": 0}
    n = len(seen[args.part][1])
    if not differs(**other, **{args.part: n}):
        print(f"the tokens equal the chain's with the {next(iter(other))} a chain: nothing to "
              f"bisect in the {args.part}")
        return
    lo, hi = 0, n  # equal at lo, differ at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if differs(**other, **{args.part: mid}):
            hi = mid
        else:
            lo = mid
    j = hi - 1
    lo, hi = 0, j  # differ with group j waiting for [0, lo), equal for [0, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if differs(**other, **{args.part: j + 1}, also=(j, mid)):
            lo = mid
        else:
            hi = mid
    i = hi - 1
    print(f"{args.part}: groups {n}; breaks when group {j} is free; it must wait for group "
          f"{i}; {time.time() - began:.1f} s", flush=True)
    ir, groups = seen[args.part]
    for k in sorted({j} | set(range(max(0, i - 1), i + 2))):
        if not 0 <= k < n:
            continue
        group = groups[k]
        print(f"--- group {k}: {group.name} barrier={group.barrier} widened={group.widened} "
              f"stale={group.stale} dispatched={group.dispatched}")
        print("  reads", [(hex(a), s) for a, s in group.reads])
        print("  writes", [(hex(a), s) for a, s in group.writes])
        for node in group.nodes:
            op = ir.op(node)
            pointers = [(p.offset, p.target.buffer,
                         hex((ir.buffers[p.target.buffer].address or 0) + p.target.offset))
                        for p in getattr(op, "pointers", ())]
            print("  node", node, type(op).__name__, getattr(op, "name", "")[:90], pointers)


if __name__ == "__main__":
    main()
