"""Can one forward over the whole sequence judge a model's own decoding? (GPU)

``exact_lengths.py`` holds each generated token to one forward over the whole sequence
(``greedy_gaps``): the best logit at its position minus the token's own. That forward is a
fair judge only where the model's step-by-step decoding computes what its forward computes.
A recurrent layer's forward can take another algorithm (Qwen3-Next's chunked delta rule
against its recurrent step), which rounds otherwise. Here both are judged: ``generate``'s own
tokens (the model's step, its dynamic cache) and ``grape.generate``'s (the whole cache), for
each number of new tokens: the largest gap, how many tokens fall below the forward's best by
more than ``--tol``, the first of them, and where grape's tokens part from generate's.

python benchmarks/decode_vs_forward.py [--arch qwen3_next] [--size llama2048x22] [--new 64,256]
    [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exact_lengths import BESIDE, _prompt, greedy_gaps
from generate import ARCHS, SIZES, build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_next", choices=[*ARCHS, *BESIDE])
    parser.add_argument("--size", default="llama2048x22", choices=sorted(SIZES))
    parser.add_argument("--new", default="64,256", help="new tokens, comma-separated")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tol", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the rows here as JSON (nothing is written without it)")
    args = parser.parse_args()
    import torch

    import grape
    from grape.torch.api import last_stats

    model = build(args.arch, SIZES[args.size], ARCHS if args.arch in ARCHS else BESIDE)
    ids, mask = _prompt(model, 1, args.prompt)
    kw = dict(pad_token_id=0, eos_token_id=None)
    rows = []
    for new in (int(n) for n in args.new.split(",")):
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kw)
        ours = grape.generate(model, ids, mask, max_new_tokens=new, exact_lengths=False, **kw)
        stats = last_stats()
        parted = (ref != ours).any(0).nonzero()
        row = {"new_tokens": new, "grape_graphed": stats.graphed, "grape_reason": stats.reason,
               "agree": float((ref == ours).float().mean()),
               "first_difference": int(parted[0]) - args.prompt if len(parted) else None}
        for name, out in (("hf_generate", ref), ("grape", ours)):
            gaps = greedy_gaps(model, out, mask, args.prompt)
            off = gaps[0] > args.tol
            row[name] = {"max_gap": float(gaps.max()), "off": int(off.sum()),
                         "first_off": off.nonzero()[:1].flatten().tolist()}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"{'new':>5} {'way':<12} {'max gap':>8} {'off':>5} {'first off':>9} {'agree':>6} "
          f"{'parted at':>9}")
    for row in rows:
        for name in ("hf_generate", "grape"):
            r = row[name]
            first = r["first_off"][0] if r["first_off"] else "-"
            print(f"{row['new_tokens']:>5} {name:<12} {r['max_gap']:>8.3f} {r['off']:>5} "
                  f"{first!s:>9} {row['agree']:>6.3f} {row['first_difference']!s:>9}")
    if args.out:
        args.out.write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "grape": grape.__version__, "python": platform.python_version(),
             "command": " ".join(sys.argv), "arch": args.arch, "size": args.size,
             "prompt": args.prompt, "tol": args.tol, "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
