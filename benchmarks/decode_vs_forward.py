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
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()

    import grape
    from grape.torch.api import last_stats

    model = build(args.arch, SIZES[args.size], ARCHS if args.arch in ARCHS else BESIDE)
    ids, mask = _prompt(model, 1, args.prompt)
    kw = dict(pad_token_id=0, eos_token_id=None)
    for new in (int(n) for n in args.new.split(",")):
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kw)
        ours = grape.generate(model, ids, mask, max_new_tokens=new, exact_lengths=False, **kw)
        print(new, "grape graphed", last_stats().graphed, last_stats().reason, flush=True)
        for name, out in (("hf_generate", ref), ("grape", ours)):
            gaps = greedy_gaps(model, out, mask, args.prompt)
            off = gaps[0] > args.tol
            print(new, name, "max gap", float(gaps.max()), "off", int(off.sum()),
                  "first off", off.nonzero()[:1].flatten().tolist(), flush=True)
        parted = (ref != ours).any(0).nonzero()
        print(new, "agree", float((ref == ours).float().mean()), "first diff",
              int(parted[0]) - args.prompt if len(parted) else None, flush=True)


if __name__ == "__main__":
    main()
