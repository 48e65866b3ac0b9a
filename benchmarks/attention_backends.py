"""Decode attention at a compiled step's shape (one query a row, a 160-key cache): which kernel.

One query over a cache of 160 keys (100 used) for the Llama shape's heads (32 over 4 key heads,
the query heads a key head serves as rows, as ``grape.torch.grouped_queries`` gives them) and
GPT-2 small's (12 over 12), then 1,024 keys: SDPA masked by cuDNN, the memory-efficient kernel
and the math path; FlashAttention over exactly the used keys (the length on the host); and
FlashAttention's variable-length forward with ``seqused_k`` on the device (what
``grape.torch.exact`` runs). Each in a CUDA graph of 20 calls (``decode_attention._per_call_us``),
us a call, with its largest difference from float32's; then a profile of one call of three of
them (their kernels by name).

Run on a GPU: python benchmarks/attention_backends.py
"""

from __future__ import annotations

import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from decode_attention import _per_call_us

# (query heads, key heads, cache, used keys)
SHAPES = ((32, 4, 160, 100), (12, 12, 160, 100), (32, 4, 1024, 600))
F16 = dict(device="cuda", dtype=torch.float16)


def ways(hq: int, hk: int, cache: int, used: int):
    """(reference, {way: call}) for one shape."""
    g = hq // hk
    torch.manual_seed(0)
    # grouped queries as rows: (1, hk, g, d) against (1, hk, cache, d)
    q = torch.randn(1, hk, g, 64, **F16)
    k = torch.randn(1, hk, cache, 64, **F16)
    v = torch.randn(1, hk, cache, 64, **F16)
    mask = (torch.arange(cache, device="cuda") < used)[None, None, None, :]
    reference = sdpa(q.float(), k[:, :, :used].float(), v[:, :, :used].float())
    out = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("math", SDPBackend.MATH)):
        def masked(backend=backend):
            with sdpa_kernel(backend):
                return sdpa(q, k, v, attn_mask=mask.expand(1, hk, g, cache))
        out[name + "_masked"] = masked

    def flash_used():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q, k[:, :, :used], v[:, :, :used])
    out["flash_exact_len_host"] = flash_used
    # token-major keys, the length on the device (grape.torch.exact's call)
    kt = k[0].transpose(0, 1).contiguous()  # (cache, hk, d)
    vt = v[0].transpose(0, 1).contiguous()
    qt = q[0].reshape(hq, 64).unsqueeze(0).contiguous()  # (1 token, hq, d)
    i32 = dict(device="cuda", dtype=torch.int32)
    cu_q, cu_k = torch.tensor([0, 1], **i32), torch.tensor([0, cache], **i32)
    seq = torch.tensor([used], **i32)
    out["flash_varlen_seqused"] = lambda: torch.ops.aten._flash_attention_forward(
        qt, kt, vt, cu_q, cu_k, 1, cache, 0.0, False, False, seqused_k=seq)[0]
    return reference, out


def main() -> None:
    calls = {}
    for hq, hk, cache, used in SHAPES:
        reference, calls = ways(hq, hk, cache, used)
        line = []
        for name, fn in calls.items():
            try:
                out = fn()
                err = float((out.float().reshape(-1) - reference.reshape(-1)).abs().max())
                line.append(f"{name} {_per_call_us(fn):.2f}us err{err:.1e}")
            except Exception as e:  # a kernel refusing these arguments: say so, go on
                line.append(f"{name} refused: {str(e).splitlines()[0][:80]}")
        print(f"hq {hq} hk {hk} cache {cache} used {used}: " + " | ".join(line), flush=True)
    # which kernels run (the last shape's calls)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for name in ("cudnn_masked", "efficient_masked", "flash_varlen_seqused"):
            calls[name]()
            torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
