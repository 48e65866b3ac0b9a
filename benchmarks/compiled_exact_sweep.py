"""Every causal-LM type transformers ships through a compiled step with exact lengths (CPU).

Before ``compile=True`` takes exact lengths by default, each architecture's compiled forward
must trace whole with ``grape.torch.exact``'s attention in it. For each model type of
``arch_sweep.py`` (its small config, fp32 on the CPU, where exact attention runs its reference
traced into the step): a batch of two 7-token prompts, one left-padded, 4 new tokens, greedy,
by grape's decoder with exact lengths, uncompiled and with its step compiled (``CompiledStep``,
Inductor's C++ kernels), each after ``grape.generate``'s eager first runs. One JSON line each:
how each attention call ran (``served_uncompiled``, ``served_compiled``: "exact", or "sdpa:
<why not>"), the graphs Dynamo made and the graph breaks it took (``graphs``, ``breaks``, the
first reasons), whether the two made the same infinite scores and the largest difference of the
finite ones (``max_gap``), or where it failed, the error's first line (``ExactRefused``: a
documented refusal; ``grape.generate`` then attends over the whole cache). ``--no-exact`` runs
the same without exact lengths, to tell which breaks exact lengths bring.

Run (CPU; a first version without the eager first runs took about 25 minutes for every type,
this one takes longer: each compiled step compiles in them): python
benchmarks/compiled_exact_sweep.py [--archs a,b] [--no-exact] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from arch_sweep import architectures, build, each_type, two_prompts
from exact_sweep import _unbuilt


def one(arch: str, row: dict[str, Any], exact: bool) -> None:
    import torch
    from torch._dynamo.utils import counters

    from grape.torch.api import _Prompt, _warm_up
    from grape.torch.compiled_step import CompiledStep
    from grape.torch.decoding import TokenDecoder
    from grape.torch.options import resolve

    row["exact"] = exact
    model = build(arch, "cpu", torch.float32)
    ids, mask = two_prompts(model)
    scores = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        options, m = resolve(model, ids, mask, {"max_new_tokens": 4, "output_scores": True,
                                                "return_dict_in_generate": True})
        step = CompiledStep(model, dynamic=False) if compiled else None
        decoder = TokenDecoder(model, 2, 7, options, step_model=step, exact=exact)
        # (grape.generate's eager first runs, which refuse exact lengths where the model
        # fails on their cache)
        _warm_up(model, decoder, _Prompt(ids, m, None, None, None, ()), step, exact)
        scores[compiled] = torch.stack(decoder.generate_on_host(ids, m).scores)
        served = dict(decoder.lengths.served) if decoder.lengths else None
        row["served_compiled" if compiled else "served_uncompiled"] = served
    row.update(graphs=counters["stats"]["unique_graphs"],
               breaks=sum(counters["graph_break"].values()),
               break_reasons=[str(k).splitlines()[0][:160]
                              for k in counters["graph_break"]][:3])
    finite = torch.isfinite(scores[False])
    row["same_infinities"] = bool(torch.equal(finite, torch.isfinite(scores[True])))
    row["max_gap"] = float((scores[True] - scores[False])[finite].abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=None, help="model types (default: every one)")
    parser.add_argument("--no-exact", action="store_true",
                        help="without exact lengths: which breaks exact lengths bring")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the rows as JSON lines here (nothing is written without it)")
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    archs = args.archs.split(",") if args.archs else architectures()
    rows = each_type(archs, lambda arch, row: one(arch, row, exact=not args.no_exact), args.out)
    ran = [r for r in rows if "error" not in r]
    clean = [r for r in ran if not r["breaks"] and r["same_infinities"] and r["max_gap"] < 1e-3
             and r["served_compiled"] == r["served_uncompiled"]]
    refused = [r for r in rows if r.get("error", "").startswith("ExactRefused")]
    print(f"{len(rows)} types: {len(ran)} ran, {len(clean)} of them whole (no graph break, "
          f"scores as uncompiled), {len(refused)} refused exact lengths, "
          f"{len(rows) - len(ran) - len(refused)} failed otherwise{_unbuilt(rows)}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
