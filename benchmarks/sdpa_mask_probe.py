"""SDPA given a boolean mask against SDPA given that mask converted once to 0/-inf: the same
attention kernel and the same bits? (What grape.torch.sdpa_mask relies on.)

For each dtype and shape (decode with one query, grouped queries, a short prompt, head size
128) it prints whether the outputs are bitwise equal, how many kernels each call launched, and
whether the last (the attention kernel) is the same. Needs a CUDA device.

    python benchmarks/sdpa_mask_probe.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

SHAPES = ((1, 16, 16, 1, 136, 64), (5, 32, 4, 1, 300, 64), (2, 12, 12, 9, 9, 64),
          (1, 16, 16, 1, 136, 128))  # batch, query heads, key heads, queries, keys, head size


def _kernels(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for b, hq, hk, q, k, d in SHAPES:
            query = torch.randn(b, hq, q, d, device="cuda", dtype=dtype)
            key = torch.randn(b, hk, k, d, device="cuda", dtype=dtype)
            value = torch.randn(b, hk, k, d, device="cuda", dtype=dtype)
            mask = torch.rand(b, 1, q, k, device="cuda") > 0.3
            mask[..., 0] = True
            additive = torch.full_like(mask, float("-inf"), dtype=dtype).masked_fill_(mask, 0)

            def call(m, query=query, key=key, value=value, gqa=hq != hk):
                return F.scaled_dot_product_attention(query, key, value, attn_mask=m,
                                                      enable_gqa=gqa)

            with_bool = _kernels(functools.partial(call, mask))
            with_float = _kernels(functools.partial(call, additive))
            rows.append({"dtype": str(dtype), "shape": [b, hq, hk, q, k, d],
                         "bitwise_equal": torch.equal(call(mask), call(additive)),
                         "kernels_bool_mask": len(with_bool),
                         "kernels_float_mask": len(with_float),
                         "same_attention_kernel": with_bool[-1] == with_float[-1],
                         "attention_kernel": with_float[-1]})
    for r in rows:
        print(f"{r['dtype']:15s} {r['shape']!s:26s} bitwise {r['bitwise_equal']!s:5s} "
              f"kernels {r['kernels_bool_mask']:2d} -> {r['kernels_float_mask']:2d} same kernel "
              f"{r['same_attention_kernel']!s:5s} {r['attention_kernel'][:50]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
