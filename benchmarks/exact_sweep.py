"""Every causal-LM type through exact lengths against the whole cache (CPU).

Exact lengths (``grape.torch.exact``) serve the attention layers whose cache spans the whole
generation; sliding windows shorter than it and recurrent states stay as the whole-cache loop
keeps them. For each model type of ``arch_sweep.py`` (its small config, fp32 on the CPU, where
exact attention runs its reference, a mask over what the GPU's kernel is given): a batch of
two 7-token prompts, one left-padded, 12 new tokens (past the small configs' windows of 8),
greedy and a 3-beam search, by grape's decoder with exact lengths and over the whole cache,
each after ``grape.generate``'s eager first runs (``api._warm_up``: where they refuse exact
lengths, ``grape.generate``'s default runs the whole cache). One JSON line each: whether the
tokens are the same (``same_greedy``, ``same_beam``) and the largest difference of the greedy
scores (``max_gap``), how the last step's attention calls ran (``served``: "exact", or
"sdpa: <why not>"), the cache's layer kinds, or the refusal or failure's first line.

Run (CPU, about 10 minutes): python benchmarks/exact_sweep.py [--archs a,b] [--out FILE];
``--summarize FILE`` prints the summary of rows written before.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from arch_sweep import architectures, build, each_type, two_prompts

NEW = 12


def one(arch: str, row: dict[str, Any]) -> None:
    import torch

    from grape.torch.api import _Prompt, _warm_up
    from grape.torch.beam import BeamDecoder
    from grape.torch.decoding import TokenDecoder
    from grape.torch.options import resolve

    model = build(arch, "cpu", torch.float32)
    ids, mask = two_prompts(model)
    for strategy, kwargs in (("greedy", {}), ("beam", {"num_beams": 3})):
        made = {}
        for exact in (True, False):
            options, m = resolve(model, ids, mask, dict(
                kwargs, max_new_tokens=NEW, output_scores=True, return_dict_in_generate=True))
            kind = BeamDecoder if options.strategy == "beam" else TokenDecoder
            decoder = kind(model, 2, 7, options, exact=exact)
            _warm_up(model, decoder, _Prompt(ids, m, None, None, None, ()), None, exact)
            made[exact] = decoder.generate_on_host(ids, m)
            if exact and strategy == "greedy":
                row["served"] = dict(decoder.lengths.served)
                row["layers"] = dict(Counter(type(layer).__name__
                                             for layer in decoder.cache.layers))
        row[f"same_{strategy}"] = bool(torch.equal(made[True].sequences, made[False].sequences))
        if strategy == "greedy":
            exact_scores, whole = (torch.stack(made[e].scores) for e in (True, False))
            finite = torch.isfinite(whole)
            row["max_gap"] = float((exact_scores - whole)[finite].abs().max())


def _unbuilt(rows: list[dict[str, Any]]) -> str:
    """How many of the failures were the sweep's: a model transformers could not make from its
    small config (``arch_sweep.NotBuilt``), before grape ran. (Rows written before the sweeps
    said so name transformers' own error.)"""
    n = sum(r.get("error", "").startswith("NotBuilt") for r in rows)
    return f" ({n} of them building the model from its small config, before grape ran)" if n \
        else ""


def summary(rows: list[dict[str, Any]]) -> str:
    """The sweep's last lines: types that ran, gave the whole cache's tokens, kept layers
    beside the token-major ones, were refused (by reason) or failed."""
    ran = [r for r in rows if "error" not in r]
    same = [r for r in ran if r["same_greedy"] and r["same_beam"]]
    served = [r for r in ran if r["served"].get("exact")]
    beside = [r for r in served if set(r["layers"]) - {"TokenMajorLayer"}]
    # (grouped by reason, the model's class named alike)
    refused = Counter(re.sub(r"\b[A-Z]\w*(For|Model|LMHead)\w*", "M", r["error"])[14:90]
                      for r in rows if r.get("error", "").startswith("ExactRefused"))
    failed = len(rows) - len(ran) - sum(refused.values())
    lines = [f"{len(rows)} types: {len(ran)} ran with exact lengths, {len(same)} of them with "
             f"the whole cache's tokens (greedy and 3 beams), {len(beside)} with cache layers "
             f"beside the token-major ones; {sum(refused.values())} refused exact lengths, "
             f"{failed} failed otherwise{_unbuilt(rows)}"]
    lines += [f"  refused {n:3d}: {reason}" for reason, n in refused.most_common()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=None, help="model types (default: every one)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the rows as JSON lines here (nothing is written without it)")
    parser.add_argument("--summarize", type=Path, default=None, metavar="FILE",
                        help="print the summary of rows written before (--out), running nothing")
    args = parser.parse_args()
    if args.summarize:
        try:
            rows = [json.loads(line) for line in args.summarize.read_text().splitlines()
                    if line.strip()]
        except (OSError, ValueError) as e:
            parser.error(f"expected --summarize FILE of this sweep's JSON lines, found {e}")
        print(summary(rows))
        return
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    archs = args.archs.split(",") if args.archs else architectures()
    print(summary(each_type(archs, one, args.out)))


if __name__ == "__main__":
    main()
