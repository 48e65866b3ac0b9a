"""Exact lengths inside one launch against attention over the whole cache (GPU).

``grape.generate`` runs a whole generation as one graph launch; its step is captured once, so
by default every token's attention reads the whole preallocated cache (prompt + max new
tokens), masked. ``exact_lengths=True`` runs FlashAttention's variable-length kernel with each
row's key count read from the device (``grape.torch.exact``): each token reads only the keys
that exist. Side by side in one process, for each (batch, new tokens): both ways' ms per token
(median of ``--repeats`` calls after the capturing one), capture time, how the step's attention
calls ran, and whether the tokens are what greedy decoding makes: the whole sequence run again
through the model in one forward (SDPA, no cache), each generated token's logit against that
forward's best at its position. A generated token below the best by more than the tolerance is
a wrong token; below it by less is a near-tie that fp16 arithmetic decides either way.

With ``--cache-length`` the cache is sized once, longer than the generation, as a server sizes
it; with ``--buckets``, per-shape graphs (one per length bucket) against the exact loop, bucket
by bucket (see ``by_bucket``).

With ``--arch gemma3`` or ``qwen3_next`` (``BESIDE``), the full-attention layers run by exact
lengths beside sliding windows or recurrent states, which both ways keep alike. The forward
judges a recurrent model's decoding badly: Qwen3-Next's runs the chunked delta rule, which in
bf16 parts from the recurrent step by logits, and ``generate``'s own tokens are "off" by it as
much as grape's (``decode_vs_forward.py``); there the gaps say nothing about grape.

python benchmarks/exact_lengths.py [--arch llama] [--size llama2048x22] [--batches 1,8]
    [--new 256,1024,4000] [--cache-length N] [--buckets 128,256,512]
    [--out benchmarks/results/exact_lengths_h200.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import ARCHS, SIZES, build

# The issue's names: the loop padded to the whole cache, and exact lengths. (The committed
# results/exact_lengths_h200.json was written before, as grape_whole_cache and grape_exact.)
WAYS = {"padded_device_loop": False, "exact_device_loop": True}
# Models whose full-attention layers run by exact lengths beside layers that keep a state of
# their own, which the padded loop and the exact one run alike: Gemma 3's sliding windows (five
# layers in six; a window shorter than the generations measured) and Qwen3-Next's recurrent
# states (three layers in four; few experts, so that the model fits beside long caches).
BESIDE = {"gemma3": ("gemma3_text", {"head_dim": 64, "query_pre_attn_scalar": 64,
                                     "sliding_window": 512, "intermediate_size": "4h"}),
          "qwen3_next": ("qwen3_next", {"head_dim": 64, "num_experts": 8,
                                        "num_experts_per_tok": 2, "moe_intermediate_size": "h",
                                        "shared_expert_intermediate_size": "h",
                                        "linear_num_key_heads": 8, "linear_num_value_heads": 16,
                                        "linear_key_head_dim": 64, "linear_value_head_dim": 64})}


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def greedy_gaps(model, out, mask, prompt: int, chunk: int = 256):
    """Per generated token: the best logit at its position minus its own, from one forward
    over the whole sequence (0 where the token is the forward's argmax). Positions count each
    row's tokens from its first unmasked one, as ``generate`` gives them: a model with
    absolute position embeddings sees a left-padded row as generate showed it."""
    import torch

    full_mask = torch.cat([mask, torch.ones_like(out[:, prompt:])], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp_(min=0)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=out, attention_mask=full_mask,
                                     position_ids=positions).last_hidden_state
        head = model.get_output_embeddings()
        gaps = []
        for start in range(prompt - 1, out.shape[1] - 1, chunk):
            end = min(start + chunk, out.shape[1] - 1)
            logits = head(hidden[:, start:end]).float()
            chosen = logits.gather(-1, out[:, start + 1:end + 1, None]).squeeze(-1)
            gaps.append(logits.max(-1).values - chosen)
    return torch.cat(gaps, dim=1)


def _prompt(model, batch: int, prompt: int):
    import torch

    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(1000 + batch)
    ids = torch.randint(3, vocab, (batch, prompt), generator=g).cuda()
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding of different widths
        for r in range(1, batch, 2):
            mask[r, : (r * prompt) // (2 * batch)] = 0
    return ids, mask


def _timed(model, ids, mask, *, exact: bool, new: int, cache_length: int | None,
           repeats: int) -> dict[str, Any]:
    """One way's generation: the capturing call, then ``repeats`` timed calls."""
    import torch

    import grape
    from grape.torch.api import last_stats

    kw = dict(max_new_tokens=new, eos_token_id=None, pad_token_id=0, exact_lengths=exact,
              cache_length=cache_length)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        began = time.perf_counter()
        grape.generate(model, ids, mask, **kw)
        first_s = time.perf_counter() - began
        first = last_stats()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = grape.generate(model, ids, mask, **kw)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return {"out": out, "times": times, "first_s": first_s, "first": first,
            "stats": last_stats(), "warnings": [str(w.message).splitlines()[0] for w in caught]}


def measure(model, batch: int, new: int, args) -> list[dict[str, Any]]:
    ids, mask = _prompt(model, batch, args.prompt)
    max_len = args.cache_length or args.prompt + new
    rows, outputs = [], {}
    for way, exact in WAYS.items():
        run = _timed(model, ids, mask, exact=exact, new=new, cache_length=args.cache_length,
                     repeats=args.repeats)
        out, times, stats, first = run["out"], run["times"], run["stats"], run["first"]
        outputs[way] = out
        gaps = greedy_gaps(model, out, mask, args.prompt)
        made = out.shape[1] - args.prompt
        rows.append({"model": f"{args.arch} {args.size}", "batch": batch, "new_tokens": made,
                     "max_len": max_len, "way": way,
                     "ms_per_token": 1000 * statistics.median(times) / made,
                     "host_syncs_per_token": stats.host_syncs / made,
                     "ms_per_token_all": [1000 * s / made for s in times],
                     "capture_s": first.capture_s, "first_call_s": run["first_s"],
                     "graphed": stats.graphed, "captured_again": stats.captured,
                     "host_syncs": stats.host_syncs, "attention_calls": first.attention,
                     "warnings": run["warnings"],
                     "greedy_max_gap": float(gaps.max()),
                     "greedy_tokens_off_by_more_than_tol": int((gaps > args.tol).sum()),
                     "tokens": int(gaps.numel())})
        _log(f"  batch {batch} new {new} {way}: {rows[-1]['ms_per_token']:.3f} ms/token, "
             f"max gap {rows[-1]['greedy_max_gap']:.4f}")
    a, b = outputs["exact_device_loop"], outputs["padded_device_loop"]
    agree = float((a[:, args.prompt:] == b[:, args.prompt:]).float().mean())
    first_diff = (a != b).any(0).nonzero()
    for row in rows:
        row["tokens_agree_between_ways"] = agree
        row["first_difference"] = (int(first_diff[0]) - args.prompt if len(first_diff)
                                   else None)
    whole = rows[0]["ms_per_token"]
    rows[1]["speedup_vs_padded"] = whole / rows[1]["ms_per_token"]
    if args.buckets:
        rows.extend(by_bucket(model, ids, mask, new, args))
    return rows


def by_bucket(model, ids, mask, new: int, args) -> list[dict[str, Any]]:
    """Per length bucket (ending at each of ``--buckets``, and at the generation's end):
    per-shape graphs, whose step for the bucket attends over the bucket's length (stood in
    for by grape's loop over a cache of exactly that length: the same kernels, without a
    host launch per token, so a lower bound on their time), against the exact loop's own
    time per token over the bucket's positions (the difference of two generations over the
    full-length cache, ending at the bucket's two ends)."""
    import torch

    from grape.torch.api import clear_cache

    batch, prompt = ids.shape
    ends = sorted({b for b in args.buckets if prompt < b < prompt + new} | {prompt + new})
    rows, previous = [], (prompt, 0.0)
    for end in ends:
        made = end - prompt
        per_shape = _timed(model, ids, mask, exact=False, new=made, cache_length=end,
                           repeats=args.repeats)
        exact = _timed(model, ids, mask, exact=True, new=made, cache_length=args.cache_length,
                       repeats=args.repeats)
        exact_s = statistics.median(exact["times"])
        segment = 1000 * (exact_s - previous[1]) / (end - previous[0])
        shape_ms = 1000 * statistics.median(per_shape["times"]) / made
        base = {"model": f"{args.arch} {args.size}", "batch": batch, "bucket": [previous[0], end],
                "max_len": args.cache_length or prompt + new}
        rows.append({**base, "way": "per_shape_graphs", "ms_per_token": shape_ms,
                     "stand_in": "padded_device_loop with cache_length = bucket end",
                     "capture_s": per_shape["first"].capture_s})
        rows.append({**base, "way": "exact_device_loop", "ms_per_token": segment,
                     "vs_per_shape_graphs": segment / shape_ms,
                     "generation_s_to_bucket_end": exact_s})
        _log(f"  batch {batch} bucket {previous[0]}..{end}: per-shape {shape_ms:.3f}, exact "
             f"{segment:.3f} ms/token ({segment / shape_ms:.2f}x)")
        previous = (end, exact_s)
        clear_cache(model)  # each executable holds its own cache: keep one at a time
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--size", default="llama2048x22", choices=sorted(SIZES))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new", default="256,1024,4000", help="new tokens, comma-separated")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--cache-length", type=int, default=None,
                        help="the static cache's length (default: prompt + new tokens)")
    parser.add_argument("--buckets", type=lambda v: [int(b) for b in v.split(",")],
                        default=None, help="length buckets' ends, for per-shape graphs "
                                           "against the exact loop bucket by bucket")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tol", type=float, default=0.05,
                        help="logit gap below which a different token is a near-tie")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE")
    args = parser.parse_args()
    import torch

    from grape.torch.api import clear_cache

    if args.arch not in ARCHS and args.arch not in BESIDE:
        raise SystemExit(f"expected --arch among {', '.join([*ARCHS, *BESIDE])}, "
                         f"found {args.arch!r}")
    model = build(args.arch, SIZES[args.size], ARCHS if args.arch in ARCHS else BESIDE)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for new in (int(n) for n in args.new.split(",")):
            rows.extend(measure(model, batch, new, args))
            clear_cache(model)
            torch.cuda.empty_cache()
            _write(args, rows, done=False)  # a run cut short keeps what it measured
    print(f"{'batch':>5} {'new':>5} {'way':<18} {'ms/token':>9} {'speed-up':>8} "
          f"{'max gap':>8} {'off':>4} {'agree':>6}")
    for r in (r for r in rows if "bucket" not in r):
        print(f"{r['batch']:>5} {r['new_tokens']:>5} {r['way']:<18} {r['ms_per_token']:>9.3f} "
              f"{r.get('speedup_vs_padded', 1.0):>8.2f} {r['greedy_max_gap']:>8.4f} "
              f"{r['greedy_tokens_off_by_more_than_tol']:>4} "
              f"{r['tokens_agree_between_ways']:>6.3f}")
    buckets = [r for r in rows if "bucket" in r]
    if buckets:
        print(f"{'batch':>5} {'bucket':>11} {'way':<18} {'ms/token':>9} {'x per-shape':>11}")
    for r in buckets:
        span = f"{r['bucket'][0]}..{r['bucket'][1]}"
        print(f"{r['batch']:>5} {span:>11} {r['way']:<18} {r['ms_per_token']:>9.3f} "
              f"{r.get('vs_per_shape_graphs', 1.0):>11.2f}")
    _write(args, rows, done=True)


def _write(args, rows: list[dict[str, Any]], done: bool) -> None:
    """The results so far to ``--out`` (none without it), ``complete`` once every (batch, new
    tokens) pair has run."""
    if not args.out:
        return
    import torch

    import grape

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "grape": grape.__version__, "python": platform.python_version(),
              "command": " ".join(sys.argv), "arch": args.arch, "size": args.size,
              "prompt": args.prompt, "cache_length": args.cache_length, "tol": args.tol,
              "complete": done, "results": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
