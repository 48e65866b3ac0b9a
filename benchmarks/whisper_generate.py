"""Whisper through grape.generate against its own generate (GPU).

Whisper's ``generate`` is its own (language, task and timestamp tokens, suppression, windows over
long audio); ``grape.generate`` runs it as it is and graphs each call it makes of the generic
loop (``grape.torch.own_generate``). This times, side by side in one process, a Whisper of
whisper-tiny's shape (d_model 384, 4 encoder and 4 decoder layers, 6 heads, 80 mel bins,
51,865 tokens; random weights, fp16) with a multilingual checkpoint's generation config (its
special token ids), English transcription of random 30-second features, greedy and 5 beams,
without and with timestamps, 90 s of audio in windows (long form, with timestamps), and the
same with Hugging Face's recommended long-form settings (``long_form_fallback``: a window
decoded again by sampling at rising temperatures where its tokens fail the log-probability or
compression thresholds, skipped where no-speech detection says silence; a sampled window's
tokens are grape's draws, not torch.multinomial's, so ``tokens_identical`` holds only where no
window fell back):

- ``hf_generate``: ``model.generate`` as users call it;
- ``hf_static``: ``model.generate`` with a static cache (the reference for ``tokens_identical``);
- ``grape``: ``grape.generate`` (the first call of a shape captures; timed on later calls).

Each entry: ``ms_per_call`` (median of ``--repeats`` calls after one untimed),
``tokens_returned`` (the width of what Whisper returns, its prompt stripped, all windows'
tokens for long form), ``ms_per_token`` (per token returned), ``host_syncs_per_call``
(synchronising PyTorch operations, counted with ``torch.cuda.set_sync_debug_mode``:
Whisper's own wrapper makes some), ``launches`` and
``graphed`` (grape: its launches, one per call of the loop), ``tokens_identical`` (against
``hf_static``; random weights give near ties, so ``--deterministic`` is the mode to read it in).

Run on a GPU: python benchmarks/whisper_generate.py [--deterministic] [--batches 1,8]
[--repeats 5] [--out FILE]; ``--device cpu`` runs the same flow on a CPU (grape falls back
there: a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# whisper-tiny's multilingual special tokens (its generation_config.json)
SOT, EOT, NO_TIMESTAMPS = 50258, 50257, 50363
LANGUAGES = {"<|en|>": 50259, "<|de|>": 50261, "<|fr|>": 50265}
TASKS = {"transcribe": 50359, "translate": 50358}
SUPPRESSED = [1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60, 61, 62, 63, 90, 91, 92,
              93, 359, 503, 522, 542, 873, 893, 902, 918, 922, 931, 1350, 1853, 1982, 2460,
              2627, 3246, 3253, 3268, 3536, 3846, 3961, 4183, 4667, 6585, 6647, 7273, 9061,
              9383, 10428, 10929, 11938, 12033, 12331, 12562, 13793, 14157, 14635, 15265,
              15618, 16553, 16604, 18362, 18956, 20075, 21675, 22520, 26130, 26161, 26435,
              28279, 29464, 31650, 32302, 32470, 36865, 42863, 47425, 49870, 50254, 50258,
              50358, 50359, 50360, 50361, 50362]
CASES = {
    "greedy": {},
    "beam5": {"num_beams": 5},
    "greedy_timestamps": {"return_timestamps": True},
    "long_form_timestamps": {"return_timestamps": True, "seconds": 90},
    # Hugging Face's recommended long-form settings: a window whose tokens fail the thresholds
    # is decoded again, sampling at the next temperature, or skipped as silence
    "long_form_fallback": {"return_timestamps": True, "seconds": 90,
                           "temperature": (0.0, 0.2, 0.4, 0.6, 0.8, 1.0),
                           "no_speech_threshold": 0.6, "logprob_threshold": -1.0,
                           "compression_ratio_threshold": 1.35},
}


def build(dtype: Any, device: str) -> Any:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.WhisperConfig(
        d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
        decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536,
        num_mel_bins=80, vocab_size=51865, max_source_positions=1500,
        max_target_positions=448, decoder_start_token_id=SOT, pad_token_id=EOT,
        bos_token_id=EOT, eos_token_id=EOT)
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).to(device, dtype).eval()
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=SOT, bos_token_id=EOT, eos_token_id=EOT, pad_token_id=EOT,
        begin_suppress_tokens=[220, EOT], suppress_tokens=SUPPRESSED, is_multilingual=True,
        lang_to_id=LANGUAGES, task_to_id=TASKS, no_timestamps_token_id=NO_TIMESTAMPS,
        prev_sot_token_id=50361, max_initial_timestamp_index=50, return_timestamps=False,
        max_length=448)
    return model


def _timed(call: Any, repeats: int, device: str) -> tuple[float, Any, int]:
    """Median seconds of ``repeats`` calls, the last result, and the syncs the last made
    (counted on a GPU only)."""
    import torch

    cuda = device == "cuda"
    times, result, syncs = [], None, 0
    for i in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda and i == repeats - 1:
                torch.cuda.set_sync_debug_mode("warn")
            began = time.perf_counter()
            result = call()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("default")
            times.append(time.perf_counter() - began)
        if i == repeats - 1:
            syncs = sum("synchronizing" in str(w.message) for w in caught)
    return statistics.median(times), result, syncs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new", type=int, default=128, help="max_new_tokens a call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    import grape
    from grape.torch.api import last_stats

    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    model = build(dtype, args.device)
    rows = []
    for case in args.cases.split(","):
        options = dict(CASES[case])
        seconds = options.pop("seconds", 30)
        for batch in map(int, args.batches.split(",")):
            g = torch.Generator().manual_seed(batch)
            frames = 100 * seconds
            features = torch.randn(batch, 80, frames, generator=g).to(args.device, dtype)
            kwargs = dict(options, language="en", max_new_tokens=args.new)
            if seconds > 30:  # long form: Whisper asks for the frames' mask
                kwargs["attention_mask"] = torch.ones(batch, frames, dtype=torch.long,
                                                      device=args.device)
            ways = {  # (each bound to this case's features and arguments)
                "hf_generate": lambda f=features, kw=kwargs: model.generate(f, **kw),
                "hf_static": lambda f=features, kw=kwargs: model.generate(
                    f, cache_implementation="static", disable_compile=True, **kw),
                "grape": lambda f=features, kw=kwargs: grape.generate(model, f, **kw),
            }
            made: dict[str, Any] = {}
            for way, call in ways.items():
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    call()  # the first call of a shape (grape captures)
                    ran = sorted({str(w.message) for w in caught if "grape.generate" in
                                  str(w.message)})
                seconds_per_call, out, syncs = _timed(call, args.repeats, args.device)
                sequences = out["sequences"] if isinstance(out, dict) else out
                made[way] = sequences
                row = {"case": case, "batch": batch, "way": way,
                       "ms_per_call": round(seconds_per_call * 1e3, 3),
                       "tokens_returned": int(sequences.shape[-1]),
                       "ms_per_token": round(seconds_per_call * 1e3 / sequences.shape[-1], 4),
                       "host_syncs_per_call": syncs}
                if way == "grape":
                    stats = last_stats()
                    row.update(graphed=stats.graphed, launches=stats.launches,
                               fallback=stats.reason or None, warnings=ran)
                rows.append(row)
                # as each way ends (a long-form case's ways take minutes each): a call cut
                # short keeps the times it measured
                print(f"{case} batch {batch} {way}: {row['ms_per_call']:.1f} ms a call",
                      file=sys.stderr, flush=True)
            for row in rows[-len(ways):]:
                row["tokens_identical"] = (tuple(made[row["way"]].shape)
                                           == tuple(made["hf_static"].shape)
                                           and bool((made[row["way"]]
                                                     == made["hf_static"]).all()))
            for row in rows[-len(ways):]:
                print(json.dumps(row), flush=True)
            if args.out:  # after every case, so that an interrupted run keeps those done
                args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{'case':22} {'batch':>5} {'way':12} {'ms/call':>9} {'ms/token':>9} {'same':>5}")
    for r in rows:
        print(f"{r['case']:22} {r['batch']:5} {r['way']:12} {r['ms_per_call']:9.2f} "
              f"{r['ms_per_token']:9.3f} {r['tokens_identical']!s:>5}")


if __name__ == "__main__":
    main()
