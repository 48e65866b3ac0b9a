"""A saved graph family's warm start in a process of its own.

``python -m tests.family_process PATH`` builds the GPT-2 decode step that
``tests/test_gpu_family.py`` captures families of (the same seed, so the same weights), after
holding a few tensors the saving process never made (so that the allocator lays the step's
tensors out at other addresses and other places within its segments), loads the family saved
at PATH (``grape.torch.family.load_family``) and prints one JSON line: the shapes it captured
here, the saved templates, why the first few shapes did not move, and for each length whether
the loaded family computes bitwise what PyTorch's own graph of that length computes.
"""

from __future__ import annotations

import json
import sys
import warnings

LENGTHS = [60, 59, 58, 33, 32, 9, 1]  # largest first, as a family is captured


def decode(positions: int = 64):
    """(model, step, out): a 2-layer GPT-2's decode step over a preallocated cache of
    ``positions`` at a KV length below it, writing its logits into ``out``."""
    import torch
    import transformers

    from grape.torch.cache import PrefixCache

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=256, n_layer=2, n_head=4, n_positions=positions)
    model = transformers.GPT2LMHeadModel(config).cuda().half().eval()
    cache = PrefixCache(config.n_layer, positions)
    with torch.no_grad():
        model(torch.randint(0, 1000, (2, positions - 1), device="cuda"),
              past_key_values=cache)
    ids = torch.randint(0, 1000, (2, 1), device="cuda")
    out = torch.empty(2, 1, config.vocab_size, device="cuda", dtype=torch.float16)

    def step(n):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        cache.set_length(n)
        in_place = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        with torch.no_grad(), sdpa_kernel(in_place):
            out.copy_(model(ids, past_key_values=cache).logits)

    return model, step, out


def graph_of(step, n):
    import torch

    g = torch.cuda.CUDAGraph()
    step(n)  # warm-up
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        step(n)
    return g


def same_as_graph(graph, family, n, out) -> bool:
    """Whether the family at length ``n`` writes bitwise what PyTorch's graph of it writes."""
    import torch

    graph.replay()
    torch.cuda.synchronize()
    expected = out.clone()
    out.zero_()
    family.run(n)
    torch.cuda.synchronize()
    return torch.equal(out, expected)


def main(argv: list[str]) -> int:
    import torch

    from grape.familyio import load_family as read_family
    from grape.torch.family import load_family

    (path,) = argv
    # Held for the whole run: the step's own tensors land elsewhere than where they did.
    held = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (700_000, 3 << 20, 513)]
    model, step, out = decode()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shapes that did not move are reported below
        family = load_family(step, path, dict(model.named_parameters()))
    try:
        bitwise = {n: same_as_graph(graph_of(step, n), family, n, out) for n in LENGTHS}
        print(json.dumps({"captured_here": family.captured_here,
                          "templates": len(read_family(path).templates),
                          "not_moved": family.not_moved, "bitwise": bitwise,
                          "held": len(held)}))
    finally:
        family.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
