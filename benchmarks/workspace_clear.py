"""Whether grape's graphed generation survives a clear of cuBLAS's workspaces between calls.

Hugging Face's ``generate`` with a static cache compiles its step with torch.compile's CUDA
graphs, which clear cuBLAS's workspaces before and after each recording
(``torch._C._cuda_clearCublasWorkspaces``). Before ``grape.torch.workspace``, a graph grape had
captured kept pointing at the freed workspace: T5's graphed generation ran once and then
stopped with an illegal memory access on the H200. This reproduces it: a small T5 (random
weights), ``grape.generate`` called ``--calls`` times on sources of one shape, with between
calls ``model.generate`` (compared token for token), an explicit clear and ``empty_cache``
(then a 256 MiB tensor takes freed memory), or nothing. ``--no-seat`` captures as grape did
before (the workspace wherever cuBLAS left it), to show the failure; ``--eager-prompt`` runs
the prompt before each launch instead of inside it.

Run on a GPU: python benchmarks/workspace_clear.py [--between generate|clear|nothing]
[--beams 1] [--calls 3] [--no-seat] [--eager-prompt]
"""

from __future__ import annotations

import argparse

import torch
import transformers

import grape
import grape.torch.api as api
import grape.torch.capture as capture
from grape.errors import CaptureError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--between", choices=("generate", "clear", "nothing"),
                        default="generate")
    parser.add_argument("--beams", type=int, default=1)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--no-seat", action="store_true")
    parser.add_argument("--eager-prompt", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("expected a CUDA device, found none")
    if args.no_seat:
        capture.seat_workspace = lambda stream: None
    if args.eager_prompt:
        loop = api.DeviceLoop

        def without_prologue(*a, **k):  # grape's own fallback where the prompt won't capture
            if k.get("prologue") is not None:
                raise CaptureError("the prompt runs eagerly (--eager-prompt)")
            return loop(*a, **k)
        api.DeviceLoop = without_prologue

    config = transformers.AutoConfig.for_model(
        "t5", vocab_size=300, bos_token_id=1, eos_token_id=2, pad_token_id=0, d_model=64,
        d_ff=128, num_layers=2, num_heads=4, d_kv=16, decoder_start_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config).cuda().eval()
    ids = torch.randint(3, 300, (3, 12), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    kwargs = dict(max_new_tokens=16, num_beams=args.beams)
    for call in range(args.calls):
        source = ids.roll(call, dims=1)
        out = grape.generate(model, source, mask, **kwargs)
        torch.cuda.synchronize()
        stats = api.last_stats()
        line = (f"call {call}: graphed {stats.graphed}, prompt in the launch "
                f"{stats.prefill_graphed}")
        if args.between == "generate":
            reference = model.generate(source, attention_mask=mask,
                                       cache_implementation="static", **kwargs)
            line += f", tokens equal to generate's {torch.equal(out, reference)}"
        elif args.between == "clear":
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
            taken = torch.full((64 << 20,), 7.0, device="cuda")  # noqa: F841 - holds memory
        print(line, flush=True)


if __name__ == "__main__":
    main()
