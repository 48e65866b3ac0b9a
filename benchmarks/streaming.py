"""Tokens handed to a streamer as they are made: generate against grape's followed launch (GPU).

``generate(..., streamer=s)`` reads each token back and calls ``s.put`` with it; ``grape.generate``
runs the whole generation as one launch and the host follows it from a side stream
(``grape.torch.streaming``). For each model (``benchmarks/generate.py``'s architectures and
sizes), batch 1, a 32-token prompt, greedy, no EOS, side by side in one process:

- ``hf_generate``: ``model.generate`` with its default cache and a streamer;
- ``grape_streamed``: ``grape.generate`` with a streamer (the first call captures; timed on the
  later ones);
- ``grape``: ``grape.generate`` without one (what following the launch costs).

Each entry: ``first_token_ms`` (from the call to the put of the first new token),
``gap_ms_median`` and ``gap_ms_p90`` (between consecutive puts of new tokens), ``total_ms`` (the
call), ``ms_per_token``, and for grape ``streamed_while_running`` (puts made before the launch
ended) and ``host_syncs``; medians over ``--repeats`` calls.

Run on a GPU: python benchmarks/streaming.py [--archs gpt2,llama] [--size gpt2small]
[--new 256] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate import SIZES, build


class Timed:
    """A streamer that notes when each put arrives (perf_counter seconds)."""

    def __init__(self) -> None:
        self.puts: list[float] = []
        self.ended = False

    def put(self, value: Any) -> None:
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        self.ended = True


def _once(call: Any, streaming: bool) -> dict[str, float]:
    import torch

    streamer = Timed() if streaming else None
    torch.cuda.synchronize()
    began = time.perf_counter()
    out = call(streamer)
    total = time.perf_counter() - began
    row = {"total_ms": total * 1e3, "new_tokens": out.shape[1] - 32}
    if streamer is not None:
        assert streamer.ended and len(streamer.puts) == row["new_tokens"] + 1, len(streamer.puts)
        new = streamer.puts[1:]  # (the first put is the prompt)
        gaps = [b - a for a, b in itertools.pairwise(new)]
        row.update(first_token_ms=(new[0] - began) * 1e3,
                   gap_ms_median=statistics.median(gaps) * 1e3,
                   gap_ms_p90=statistics.quantiles(gaps, n=10)[-1] * 1e3)
    return row


def _measure(arch: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    import grape
    from grape.torch.api import clear_cache, last_stats

    model = build(arch, SIZES[args.size])
    ids = torch.randint(3, 1000, (1, 32), generator=torch.Generator().manual_seed(0)).cuda()
    kwargs = dict(max_new_tokens=args.new, eos_token_id=None, pad_token_id=0)
    ways = {
        "hf_generate": (lambda s: model.generate(ids, streamer=s, **kwargs), True),
        "grape_streamed": (lambda s: grape.generate(model, ids, streamer=s, **kwargs), True),
        "grape": (lambda s: grape.generate(model, ids, **kwargs), False),
    }
    rows = []
    for way, (call, streaming) in ways.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _once(call, streaming)  # the first call (grape captures)
        runs = [_once(call, streaming) for _ in range(args.repeats)]
        row = {"arch": arch, "size": args.size, "batch": 1, "way": way,
               "new_tokens": runs[0]["new_tokens"], "repeats": args.repeats}
        for key in runs[0]:
            if key != "new_tokens":
                row[key] = round(statistics.median(r[key] for r in runs), 4)
        row["ms_per_token"] = round(row["total_ms"] / row["new_tokens"], 4)
        if way.startswith("grape"):
            stats = last_stats()
            row.update(graphed=stats.graphed, host_syncs=stats.host_syncs,
                       streamed_while_running=stats.streamed_while_running,
                       fallback=stats.reason or None,
                       warnings=sorted({str(w.message) for w in caught}))
        rows.append(row)
        print(json.dumps(row), flush=True)
    clear_cache(model)  # (its loops hold the model)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="gpt2,llama")
    parser.add_argument("--size", default="gpt2small", choices=sorted(SIZES))
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    rows = []
    for arch in args.archs.split(","):
        rows += _measure(arch, args)
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{'arch':8} {'way':15} {'first ms':>9} {'gap ms':>8} {'gap p90':>8} "
          f"{'ms/token':>9} {'while running':>14}")
    for r in rows:
        print(f"{r['arch']:8} {r['way']:15} {r.get('first_token_ms', float('nan')):9.3f} "
              f"{r.get('gap_ms_median', float('nan')):8.3f} "
              f"{r.get('gap_ms_p90', float('nan')):8.3f} {r['ms_per_token']:9.4f} "
              f"{r.get('streamed_while_running', ''):>14}")


if __name__ == "__main__":
    main()
