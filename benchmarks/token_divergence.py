"""Where grape's greedy tokens leave ``generate``'s static-cache tokens, and why (a diagnostic).

For one architecture and batch (``generate.py``'s small size, deterministic kernels, a 32-token
prompt left-padded on odd rows, 256 new tokens, no EOS): ``model.generate`` with a static cache
keeping its logits, and grape's step driven by the host (``TokenDecoder.generate_on_host``,
whose tokens equalled grape's device loop in ``generate.py``) keeping its own. Prints the
first new token where any row differs, the largest logit difference between the two at each
step up to it, and at it, for each differing row, the three highest logits of each.

Run on a GPU: python benchmarks/token_divergence.py [ARCH] [BATCH]   (default: gptj 8)

Measured on the H200 for GPT-J, batch 8 (2026-12-01, this script as it ran from a scratch
file): the first difference at new token 72, in row 6 only; the logits differ by at most
0.00098 (one fp16 step at their magnitude) from the third token on, 0.0 before; at token 72
``generate``'s two highest logits are an exact tie (tokens 3051 and 2893 at 1.14844; argmax
takes 2893), and grape's logit for 3051 is one step higher (1.14941), so it takes 3051.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before the first cuBLAS handle

import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from generate import SIZES, build

from grape.torch.decoding import TokenDecoder
from grape.torch.options import resolve

PROMPT, NEW = 32, 256


def main() -> None:
    arch = sys.argv[1] if len(sys.argv) > 1 else "gptj"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    transformers.logging.set_verbosity_error()
    torch.use_deterministic_algorithms(True)
    model = build(arch, SIZES["small"])
    g = torch.Generator().manual_seed(1000 + batch)  # generate.py's prompts
    ids = torch.randint(3, model.config.get_text_config().vocab_size, (batch, PROMPT),
                        generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1::2, : PROMPT // 4] = 0
    kw = dict(do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    hf = model.generate(ids, attention_mask=mask, cache_implementation="static",
                        disable_compile=True, output_logits=True, return_dict_in_generate=True,
                        **kw)
    theirs = torch.stack([step.float() for step in hf.logits], 1)  # rows, steps, vocab
    options, m = resolve(model, ids, mask, kw)
    decoder = TokenDecoder(model, batch, PROMPT, options)
    seen: list[torch.Tensor] = []
    emit = decoder._emit
    decoder._emit = lambda logits: (seen.append(logits.clone()), emit(logits))[1]
    out = decoder.generate_on_host(ids, m)
    ours = torch.stack(seen, 1)
    a, b = out[:, PROMPT:], hf.sequences[:, PROMPT:]
    n = min(a.shape[1], b.shape[1])
    differ = a[:, :n] != b[:, :n]
    first = int(differ.any(0).nonzero()[0]) if differ.any() else None
    steps = min(ours.shape[1], theirs.shape[1])
    gap = (ours[:, :steps] - theirs[:, :steps]).abs().amax(-1).amax(0)
    report = {"arch": arch, "batch": batch, "first_difference": first,
              "largest_logit_difference_by_step": [round(float(x), 5)
                                                   for x in gap[: (first or steps) + 1]]}
    if first is not None:
        for row in differ[:, first].nonzero().flatten().tolist():
            for name, logits in (("generate", theirs[row, first]), ("grape", ours[row, first])):
                top = torch.topk(logits, 3)
                report[f"row{row}_{name}_top3"] = [(int(i), round(float(v), 5))
                                                   for v, i in zip(top.values, top.indices,
                                                                   strict=True)]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
