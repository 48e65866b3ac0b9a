"""Decode attention (one query per row) over a long static cache: which kernel pays for the keys
that exist (GPU).

A device loop captures its step once, so its attention either reads the whole preallocated
cache, masked (what ``grape.generate`` runs by default), or takes each row's key count from
device memory (``grape.torch.exact``). This measures, for one layer's attention at each used
length, in a CUDA graph of 20 calls (us per call):

- ``flash_varlen``: FlashAttention's variable-length forward with ``seqused_k`` over the
  token-major cache (what ``grape.torch.exact`` runs);
- ``efficient_varlen``: the memory-efficient kernel's variable-length form (``cu_seqlens_k``
  and ``seqlen_k``), the other kernel PyTorch has that reads lengths on the device (same
  heads for queries and keys only);
- ``sdpa_masked_used``: SDPA over exactly the used length, masked for left padding: what a
  per-shape graph at that length runs (a lower bound for a bucket that ends there);
- ``sdpa_masked_cache``: SDPA over the whole cache, masked: what the padded loop runs;
- where PyTorch's FlashAttention takes them (2.13; not 2.11, which the H200 machine has):
  ``flash_varlen_s{2,4,8}`` with ``num_splits`` and ``flash_paged_s{0,2,4,8}`` over the cache
  as 256-token pages (timing only: padding counted as keys).

Each kernel's largest difference from an fp32 reference over the used keys is recorded beside
its time.

python benchmarks/decode_attention.py [--out benchmarks/results/decode_attention_h200.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

# (rows, query heads, key heads, head dim): GPT-2 small at batch 32 (as exact_lengths.py's
# issue shape), and the Llama shape (hidden 2048, 32 heads, 8 key heads) at batch 8 and 1.
SHAPES = [(32, 12, 12, 64), (8, 32, 8, 64), (1, 32, 8, 64)]
USED = [128, 512, 1088, 4096]
SPLITS = (2, 4, 8)  # FlashAttention's num_splits tried beside its own choice
PAGE = 256  # tokens a block, for the paged ways (FlashAttention's paged keys need 256k)


def _per_call_us(fn, calls: int = 20, replays: int = 10) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / (calls * replays)


def _takes_splits() -> bool:
    """Whether this PyTorch's FlashAttention forward takes ``num_splits`` and ``block_table``
    (2.13 does; 2.11, on the H200 machine, refused both: ``decode_attention_splits_5af24e7``)."""
    import torch

    names = {a.name for a in torch.ops.aten._flash_attention_forward.default._schema.arguments}
    return {"num_splits", "block_table"} <= names


def _paged(q, cu_q, paged, cache: int, total, splits: int):
    """FlashAttention over paged keys (``paged``: keys, values, whole rows' starts, block
    table), ``total`` keys of each row from its start, ``num_splits=splits``."""
    import torch

    kp, vp, whole, pages = paged
    return lambda: torch.ops.aten._flash_attention_forward(
        q, kp, vp, cu_q, whole, 1, cache, 0.0, False, False, seqused_k=total,
        block_table=pages, num_splits=splits)[0]


def measure(rows: int, hq: int, hk: int, dim: int, cache: int) -> list[dict[str, Any]]:
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    torch.manual_seed(0)
    f16 = dict(device="cuda", dtype=torch.float16)
    q = torch.randn(rows, hq, dim, **f16)
    keys = torch.randn(rows, cache, hk, dim, **f16)  # token-major, as grape's exact cache
    values = torch.randn(rows, cache, hk, dim, **f16)
    k, v = keys.view(rows * cache, hk, dim), values.view(rows * cache, hk, dim)
    i32 = dict(device="cuda", dtype=torch.int32)
    efficient = torch.ops.aten._efficient_attention_forward
    cu_q = torch.arange(rows + 1, **i32)
    pad = torch.randint(0, 16, (rows,), **i32)  # left padding
    starts = torch.arange(rows + 1, **i32) * cache
    starts[:-1] += pad
    group = hq // hk
    paged = None
    if cache % PAGE == 0 and _takes_splits():
        # Paged (a block table over the same cache, PAGE tokens a block): FlashAttention splits
        # the keys across blocks only with paged keys, it seems. Keys counted from each row's
        # start, padding included (timing only: the error is against the unpadded reference).
        pages = (torch.arange(rows, **i32)[:, None] * (cache // PAGE)
                 + torch.arange(cache // PAGE, **i32))
        paged = (keys.view(rows * cache // PAGE, PAGE, hk, dim),
                 values.view(rows * cache // PAGE, PAGE, hk, dim),
                 torch.arange(rows + 1, **i32) * cache, pages)
    rows_out = []
    for used_len in USED:
        used = (used_len - pad).clamp(min=1).to(torch.int32)
        reference = torch.stack([sdpa(
            q[r].unsqueeze(1).float(),
            k[int(starts[r]):int(starts[r]) + int(used[r])].transpose(0, 1)
            .repeat_interleave(group, 0).float(),
            v[int(starts[r]):int(starts[r]) + int(used[r])].transpose(0, 1)
            .repeat_interleave(group, 0).float()).squeeze(1) for r in range(rows)])
        # (Defaults bind this length's tensors: the calls run within the iteration anyway.)
        ways = {"flash_varlen": lambda used=used: torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, starts, 1, cache, 0.0, False, False, seqused_k=used)[0]}
        for splits in SPLITS if _takes_splits() else ():  # split-KV, where PyTorch has it
            ways[f"flash_varlen_s{splits}"] = (
                lambda used=used, splits=splits: torch.ops.aten._flash_attention_forward(
                    q, k, v, cu_q, starts, 1, cache, 0.0, False, False, seqused_k=used,
                    num_splits=splits)[0])
        if paged is not None:
            total = (used + pad).to(torch.int32)
            for splits in (0, *SPLITS):
                ways[f"flash_paged_s{splits}"] = _paged(q, cu_q, paged, cache, total, splits)
        if group == 1:
            ways["efficient_varlen"] = lambda used=used: efficient(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, cu_q, starts, 1, cache,
                0.0, 0, False, seqlen_k=used)[0].squeeze(0)
        query = q.unsqueeze(2)
        columns = torch.arange(cache, device="cuda")
        for name, length in (("sdpa_masked_used", used_len), ("sdpa_masked_cache", cache)):
            kk = keys[:, :length].transpose(1, 2).repeat_interleave(group, 1)
            vv = values[:, :length].transpose(1, 2).repeat_interleave(group, 1)
            mask = ((columns[:length] >= pad[:, None])
                    & (columns[:length] < (pad + used)[:, None]))[:, None, None, :]
            ways[name] = (lambda kk=kk, vv=vv, mask=mask, query=query:
                          sdpa(query, kk, vv, attn_mask=mask).squeeze(2))
        row: dict[str, Any] = {"rows": rows, "query_heads": hq, "key_heads": hk, "dim": dim,
                               "cache": cache, "used": used_len}
        for name, fn in ways.items():
            try:
                error = float((fn().float() - reference).abs().max())
                row[name] = {"us": _per_call_us(fn), "max_abs_error": error}
            except RuntimeError as e:  # a kernel refusing these arguments: say so, go on
                row[name] = {"us": float("nan"), "refused": str(e).splitlines()[0][:200]}
        rows_out.append(row)
        print("  " + ", ".join(f"{n} {row[n]['us']:.1f}" for n in ways) + f" us ({rows} rows, "
              f"{hq}/{hk} heads, used {used_len})", file=sys.stderr, flush=True)
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=None, metavar="FILE")
    args = parser.parse_args()
    import torch

    results = [r for shape in SHAPES for r in measure(*shape, args.cache)]
    names = list(dict.fromkeys(n for r in results for n in r if isinstance(r[n], dict)))
    print(f"{'rows':>4} {'heads':>6} {'used':>5} " + " ".join(f"{n:>18}" for n in names))
    for r in results:
        cells = [f"{r[n]['us']:>18.1f}" if n in r else f"{'-':>18}" for n in names]
        print(f"{r['rows']:>4} {r['query_heads']:>3}/{r['key_heads']:<2} {r['used']:>5} "
              + " ".join(cells))
    if args.out:
        args.out.write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "python": platform.python_version(), "command": " ".join(sys.argv),
            "unit": "us per call, in a CUDA graph of 20 calls", "results": results},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
