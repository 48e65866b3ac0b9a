"""grape.generate against Hugging Face generate, across architectures and strategies.

For each architecture (a model built from its config with random weights, fp16, on the GPU),
strategy (greedy, sampling, 5-beam search) and batch, side by side in one process:

- ``hf_generate``: ``model.generate`` as users call it (its default, growing cache);
- ``hf_static``: ``model.generate`` with a static cache and no compilation: the same cache
  layout and attention shapes as grape's, the reference for ``tokens_identical``;
- ``hf_static_compiled``: ``model.generate`` with a static cache and its own compilation
  (transformers compiles the decoding forward itself for a static cache);
- ``grape``: ``grape.generate(concurrent=False)``, the step's kernels in the order the forward
  issued them (the first call of a shape captures; timed on later calls);
- ``grape_compiled``: ``grape.generate(compile=True, concurrent=False)``: Inductor's kernels in
  grape's loop (``compiled`` false, with the reason in ``fallback``, where a compiled step
  could not serve and the model's own kernels ran);
- ``grape_compiled_exact``: ``grape_compiled`` with ``exact_lengths=True``: each token's
  attention over the keys that exist, by a kernel that reads the lengths on the device
  (``grape.torch.exact``), inside the compiled step;
- ``grape_concurrent``: ``grape.generate(concurrent=True)``, its default uncompiled: grape's
  loop with the step's independent operations side by side (``grape.passes.concurrency``);
  its rows add ``step_nodes`` and ``step_depth`` (nodes on the step's longest path) and
  ``tokens_equal_to_grape``;
- ``grape_compiled_concurrent``: ``grape.generate(compile=True)`` as a user calls it, concurrent
  by default: Inductor's kernels, independent ones side by side; its rows add
  ``tokens_equal_to_grape_compiled`` where that way ran too;
- ``grape_concurrent_vocabulary`` (sampling only): ``grape_concurrent`` with ``generate``'s
  warpers over the whole vocabulary, as ``grape.generate`` samples where its candidates'
  sampler cannot serve (``grape.torch.sampling``), to measure that sampler side by side;
- ``grape_switched_experts``: ``grape`` with ``switch_experts=True``: a mixture of experts'
  layers run by grape's implementations in bf16 too (``grape.torch.experts``), with
  ``token_agreement``, as their sums round otherwise.

Each entry: ``ms_per_token`` (a whole call's wall time over the new tokens, median of
``--repeats`` calls), ``host_syncs_per_token`` (synchronising PyTorch operations the call made,
counted with ``torch.cuda.set_sync_debug_mode``, over the new tokens), ``copy_bytes_per_call``
(grape: caller bytes copied into the loop's tensors: the prompt's mask into the full-length
one), ``prefill_graphed`` and ``pointer_updates_per_call`` (grape: the prompt ran inside the
launch; nodes re-pointed at caller tensors that moved, on the last call), ``weight_copy_bytes``
(grape: the copies of weights its compiled step reads, ``grape.torch.weight_rows`` and
``grape.torch.sibling_products``),
``tokens_identical`` (grape and ``hf_static`` against ``hf_static``'s tokens; null for
sampling, whose random stream is grape's own by design: there ``same_seed_same_tokens`` and
``host_loop_tokens_identical`` say whether grape repeats itself and equals its own host loop,
the prompt run under capture as in grape's launch, and ``eager_host_loop_tokens_identical``
whether it equals the host loop with an eager prompt, whose attention kernels Hugging Face may
pick differently; null for the compiled ways, whose kernels differ by design: there
``token_agreement`` is the fraction of new tokens equal to ``hf_static``'s) and ``capture_s``
(for ``grape_compiled`` it includes compilation). A grape row whose tokens differ says how
much (``token_agreement``), from which new token (``first_difference``) and, for greedy,
whether they equal grape's own step driven by the host (``host_loop_tokens_identical``) and
how far the reference's logit for its token stood above its logit for grape's there
(``reference_margin_at_first_difference``; 0.0 is an exact tie).

With ``--deterministic`` (deterministic kernels, cuBLAS workspace :4096:8) token comparisons
mean something: without it the eager kernels do not repeat their own results bitwise on the
H200, and random weights give near ties. Each run is made twice per strategy: with no EOS (all
tokens), and with an EOS that occurs mid-way (the token the first run made most often).

Run on a GPU: python benchmarks/generate.py [--small] [--deterministic] [--out FILE] [--plot PNG]
(committed: benchmarks/results/generate_h200_runs/, one file per call, and generate_h200.png;
``--plot-only JSON [JSON ...]`` draws the plot from results files)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# Architectures by Hugging Face model type, with what their configs need beyond the common size.
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("gpt2", {}),
    "gptj": ("gptj", {"rotary_dim": "head/2"}),
    "gpt_neox": ("gpt_neox", {"intermediate_size": "4h"}),
    "opt": ("opt", {"ffn_dim": "4h", "word_embed_proj_dim": "h"}),
    "bloom": ("bloom", {}),
    "falcon": ("falcon", {}),
    "llama": ("llama", {"intermediate_size": "4h", "num_key_value_heads": "heads/4"}),
    "mistral": ("mistral", {"intermediate_size": "4h", "num_key_value_heads": "heads/4"}),
    "qwen2": ("qwen2", {"intermediate_size": "4h", "num_key_value_heads": "heads/4"}),
    "mixtral": ("mixtral", {"intermediate_size": "2h", "num_key_value_heads": "heads/4",
                            "num_local_experts": 8, "num_experts_per_tok": 2}),
}
# MoE architectures run in bf16, as models of this kind ship: PyTorch's grouped GEMM for
# experts runs on the device alone only in bf16 (in fp16 it loops over the experts with offsets
# read back to the host, which no graph can hold; grape then captures a step's experts by its
# own implementations, grape.torch.experts: --dtype float16 measures them).
DTYPES = {"mixtral": "bfloat16",
          # (exact_lengths.py's models beside full attention: a mixture of experts, and a
          # family that ships in bf16)
          "qwen3_next": "bfloat16", "gemma3": "bfloat16"}
SIZES = {"small": {"hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
                   "vocab_size": 4000},
         "bench": {"hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16,
                   "vocab_size": 32000},
         # The shapes the issue names: a TinyLlama-like model and GPT-2 small (a size's
         # entries override an architecture's, so they are meant for that architecture).
         "llama2048x22": {"hidden_size": 2048, "num_hidden_layers": 22,
                          "num_attention_heads": 32, "num_key_value_heads": 4,
                          "intermediate_size": 5632, "vocab_size": 32000},
         "gpt2small": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                       "vocab_size": 50257},
         # GPT-2 small with 4,096 positions: the families issue's exact-lengths shape.
         "gpt2small4096": {"hidden_size": 768, "num_hidden_layers": 12,
                           "num_attention_heads": 12, "vocab_size": 50257,
                           "n_positions": 4096}}
STRATEGIES = {"greedy": {}, "sample": {"do_sample": True, "temperature": 0.8, "top_k": 50,
                                       "top_p": 0.9},
              "beam5": {"num_beams": 5}}
# the grape ways that run with compile=True
COMPILED_WAYS = ("grape_compiled", "grape_compiled_concurrent", "grape_compiled_exact")


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _value(spec: Any, size: dict[str, int]) -> Any:
    h, heads = size["hidden_size"], size["num_attention_heads"]
    return {"4h": 4 * h, "2h": 2 * h, "h": h, "heads/4": max(heads // 4, 1),
            "head/2": h // heads // 2}.get(spec, spec) if isinstance(spec, str) else spec


def build(arch: str, size: dict[str, int], archs: dict[str, tuple[str, dict[str, Any]]] = ARCHS,
          dtype: str | None = None, device: str = "cuda"):
    """``arch`` from its config with random weights, on ``device`` (the GPU unless said), in
    ``dtype`` (default: the architecture's entry in DTYPES, else float16)."""
    import torch
    import transformers

    model_type, extra = archs[arch]
    config = transformers.AutoConfig.for_model(
        model_type, **{**{k: _value(v, size) for k, v in extra.items()}, **size},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=getattr(torch, dtype or DTYPES.get(arch, "float16")))
    return model.to(device).eval()


@contextlib.contextmanager
def _whole_vocabulary(on: bool):
    """While ``on``: grape samples with generate's warpers over the whole vocabulary
    (``Options.samples_candidates`` false, which the executables' key holds)."""
    if not on:
        yield
        return
    from grape.torch.options import Options

    saved = Options.samples_candidates
    Options.samples_candidates = property(lambda self: False)
    try:
        yield
    finally:
        Options.samples_candidates = saved


def _timed(call, repeats: int) -> tuple[float, Any, int]:
    """Median seconds of ``repeats`` calls, the last result, and the syncs one call made."""
    import torch

    times, result, syncs = [], None, 0
    for i in range(repeats):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if i == repeats - 1:
                torch.cuda.set_sync_debug_mode("warn")
            t = time.perf_counter()
            result = call()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            torch.cuda.set_sync_debug_mode("default")
        if i == repeats - 1:
            syncs = sum("synchronizing" in str(w.message) for w in caught)
    return statistics.median(times), result, syncs


def measure(model, arch: str, strategy: str, batch: int, args, eos: int | None,
            run: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of one (architecture, strategy, batch, run), and each way's tokens."""
    import torch

    import grape
    from grape.torch.api import last_stats
    from grape.torch.decoding import TokenDecoder

    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(1000 + batch)
    ids = torch.randint(3, vocab, (batch, args.prompt), generator=g).cuda()
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding, as generate takes prompts of different lengths
        mask[1::2, : args.prompt // 4] = 0
    kw = dict(STRATEGIES[strategy], max_new_tokens=args.new, eos_token_id=eos, pad_token_id=0)
    hf = {"hf_generate": lambda: model.generate(ids, attention_mask=mask, **kw),
          "hf_static": lambda **extra: model.generate(ids, attention_mask=mask,
                                                      cache_implementation="static",
                                                      disable_compile=True, **kw, **extra),
          "hf_static_compiled": lambda: model.generate(ids, attention_mask=mask,
                                                       cache_implementation="static", **kw)}
    rows, tokens = [], {}
    base = {"arch": arch, "strategy": strategy, "batch": batch, "run": run}
    for way in args.ways:
        if way in hf:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hf[way]()  # warm-up
                seconds, out, syncs = _timed(hf[way], args.repeats)
            stats = None
        elif way == "grape_concurrent_vocabulary" and strategy != "sample":
            continue
        else:
            call = dict(kw, compile=way in COMPILED_WAYS,
                        concurrent=way in ("grape_concurrent", "grape_compiled_concurrent",
                                           "grape_concurrent_vocabulary"))
            if way == "grape_compiled_exact":
                call["exact_lengths"] = True
            if way == "grape_switched_experts":  # (bf16's grouped GEMM too: grape.torch.experts)
                call["switch_experts"] = True
            with _whole_vocabulary(way == "grape_concurrent_vocabulary"):
                with warnings.catch_warnings(record=True) as fell:
                    warnings.simplefilter("always")
                    grape.generate(model, ids, mask, seed=7, **call)  # captures
                    first = last_stats()
                # (a compiled step that could not serve runs the model's own kernels: said)
                fallback = [str(w.message) for w in fell
                            if "runs model.generate" in str(w.message)
                            or "runs the model's own kernels" in str(w.message)]
                seconds, out, syncs = _timed(
                    lambda c=call: grape.generate(model, ids, mask, seed=7, **c), args.repeats)
                stats = last_stats()
        new = out.shape[1] - args.prompt
        tokens[way] = out
        row = {**base, "way": way, "ms_per_token": 1000 * seconds / new, "new_tokens": new,
               "host_syncs_per_token": syncs / new, "copy_bytes_per_call": None,
               "tokens_identical": None, "capture_s": None}
        if stats is not None:
            row.update(copy_bytes_per_call=stats.copy_bytes, capture_s=first.capture_s,
                       graphed=stats.graphed, fallback=fallback[0] if fallback else None,
                       prefill_graphed=stats.prefill_graphed,
                       pointer_updates_per_call=stats.pointer_updates,
                       step_nodes=stats.step_nodes, step_depth=stats.step_depth,
                       compiled=stats.compiled, weight_copy_bytes=stats.weight_copy_bytes)
        rows.append(row)
    if "hf_static" in tokens and strategy != "sample":
        for row in rows:
            if row["way"] in ("grape", "grape_concurrent", "hf_static"):
                row["tokens_identical"] = _same(tokens[row["way"]], tokens["hf_static"])
                if not row["tokens_identical"]:  # where, and how much, for the note
                    row["token_agreement"] = _agreement(tokens[row["way"]],
                                                        tokens["hf_static"], args.prompt)
                    row["first_difference"] = _first_difference(
                        tokens[row["way"]], tokens["hf_static"], args.prompt)
                    if strategy == "greedy":
                        row["reference_margin_at_first_difference"] = _margin(
                            hf["hf_static"], tokens[row["way"]], tokens["hf_static"],
                            args.prompt, row["first_difference"])
            elif row["way"] in (*COMPILED_WAYS, "hf_static_compiled", "grape_switched_experts"):
                row["token_agreement"] = _agreement(tokens[row["way"]], tokens["hf_static"],
                                                    args.prompt)
    if "grape" in tokens and "grape_concurrent" in tokens:
        row = next(r for r in rows if r["way"] == "grape_concurrent")
        row["tokens_equal_to_grape"] = _same(tokens["grape_concurrent"], tokens["grape"])
    if "grape_compiled" in tokens and "grape_compiled_concurrent" in tokens:
        row = next(r for r in rows if r["way"] == "grape_compiled_concurrent")
        row["tokens_equal_to_grape_compiled"] = _same(tokens["grape_compiled_concurrent"],
                                                      tokens["grape_compiled"])
    if strategy == "greedy" and "grape" in tokens:
        row = next(r for r in rows if r["way"] == "grape")
        if row["tokens_identical"] is False:  # grape's own step on the host, prompt captured
            from grape.torch.options import resolve

            options, m = resolve(model, ids, mask, kw)
            decoder = TokenDecoder(model, batch, args.prompt, options)
            row["host_loop_tokens_identical"] = _same(
                _host_loop(decoder, ids, m, row["prefill_graphed"]), tokens["grape"])
    if strategy == "sample" and "grape" in tokens:
        row = next(r for r in rows if r["way"] == "grape")
        again = grape.generate(model, ids, mask, seed=7, **kw)
        row["same_seed_same_tokens"] = _same(again, tokens["grape"])
        from grape.torch.options import resolve

        options, m = resolve(model, ids, mask, kw)
        for name, captured in (("host_loop_tokens_identical", True),
                               ("eager_host_loop_tokens_identical", False)):
            decoder = TokenDecoder(model, batch, args.prompt, options)
            decoder.set_seed(7)
            row[name] = _same(_host_loop(decoder, ids, m, captured), tokens["grape"])
    return rows, tokens


def _host_loop(decoder, ids, mask, captured_prompt: bool):
    """The generation with the host deciding each step. With ``captured_prompt`` the prompt
    runs from PyTorch's own capture of the prefill, as inside grape's launch: Hugging Face's
    mask code picks its attention kernels by whether a capture is under way (outside one it
    drops an all-ones mask and runs the causal kernel), so only then are the prompt's kernels
    the ones grape's launch runs."""
    from grape.torch.experts import experts_on_device

    with experts_on_device(decoder.model):  # (a mixture of experts' as in grape's launch)
        if not captured_prompt:  # (as grape's launch ran a prompt it could not capture)
            return decoder.generate_on_host(ids, mask)
        return _captured_prompt_loop(decoder, ids, mask)


def _captured_prompt_loop(decoder, ids, mask):
    import torch

    from grape.torch.control import graph as recovering_graph
    from grape.torch.staging import HostConstants, PinnedArena

    decoder.prefill(ids, mask)  # warm-up, outside the capture
    graph, arena = torch.cuda.CUDAGraph(), PinnedArena()
    # grape's form of torch.cuda.graph: a prompt that cannot be captured leaves the process
    # usable (PyTorch's own left the CUDA generator in capture mode, and every later random
    # op failing: arch_sweep.py's models built after one such prompt on the H200).
    with recovering_graph(graph), HostConstants(arena, ids.device):
        decoder.prefill(ids, mask)
    graph.replay()
    while bool(decoder.running):
        decoder.step()
    return decoder.result(ids)


def _same(a, b) -> bool:
    return tuple(a.shape) == tuple(b.shape) and bool((a == b).all())


def _agreement(a, b, prompt: int) -> float:
    """The fraction of new tokens equal, position by position (a shorter output's missing
    tokens count as different)."""
    new = max(a.shape[1], b.shape[1]) - prompt
    n = min(a.shape[1], b.shape[1])
    equal = int((a[:, prompt:n] == b[:, prompt:n]).sum())
    return equal / (a.shape[0] * new) if new else 1.0


def _first_difference(a, b, prompt: int) -> int:
    """The first new-token position where any row differs (or where one output ends)."""
    n = min(a.shape[1], b.shape[1])
    differs = (a[:, prompt:n] != b[:, prompt:n]).any(0).nonzero()
    return int(differs[0]) if len(differs) else n - prompt


def _margin(reference, ours, theirs, prompt: int, step: int) -> float | None:
    """Where greedy tokens part: the reference's logit for its own token less its logit for
    ours, smallest over the rows that part there (0.0: an exact tie, which any difference in
    the last bit breaks either way). The reference runs again, untimed, keeping its logits."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = reference(output_logits=True, return_dict_in_generate=True)
    if step >= len(out.logits) or step + prompt >= min(ours.shape[1], theirs.shape[1]):
        return None  # one output ended first: no logits to compare there
    logits = out.logits[step].float()
    rows = (ours[:, prompt + step] != theirs[:, prompt + step]).nonzero().flatten()
    return min(float(logits[r, theirs[r, prompt + step]] - logits[r, ours[r, prompt + step]])
               for r in rows.tolist())


def _most_common_new_token(out, prompt: int) -> int:
    values, counts = out[:, prompt:].flatten().unique(return_counts=True)
    return int(values[counts.argmax()])


def plot(rows: list[dict[str, Any]], path: Path, device: str) -> None:
    """``device``: the GPU the rows ran on, as the titles name it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(r: dict[str, Any]) -> str:  # bench-size models by name, other sizes after
        return r["arch"] if r.get("size", "bench") == "bench" else f"{r['arch']}:{r['size']}"

    order = list(ARCHS)
    chosen = sorted((dict(r, arch=label(r)) for r in rows
                     if r["batch"] == 1 and r["run"] == "no EOS"),
                    key=lambda r: (r.get("size", "bench") != "bench",
                                   order.index(r["arch"].split(":")[0])))
    strategies = list(dict.fromkeys(r["strategy"] for r in chosen))
    fig, axes = plt.subplots(len(strategies), 1, figsize=(11, 3.2 * len(strategies)),
                             squeeze=False)
    for ax, strategy in zip(axes[:, 0], strategies, strict=True):
        these = [r for r in chosen if r["strategy"] == strategy]
        archs = list(dict.fromkeys(r["arch"] for r in these))
        ways = list(dict.fromkeys(r["way"] for r in these))
        width = 0.8 / len(ways)
        for i, way in enumerate(ways):
            values = [next((r["ms_per_token"] for r in these if r["arch"] == a
                            and r["way"] == way), 0) for a in archs]
            ax.bar([x + i * width for x in range(len(archs))], values, width, label=way)
        ax.set_xticks([x + width * (len(ways) - 1) / 2 for x in range(len(archs))],
                      [a.split(":")[-1] for a in archs], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("ms per token")
        ax.set_title(f"{strategy}, batch 1, {these[0]['new_tokens']} new tokens ({device})")
        ax.legend(fontsize=7, ncol=len(ways), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--later-batch-strategies", default="greedy",
                        help="strategies also measured at the batches after the first")
    parser.add_argument("--ways", default="hf_generate,hf_static,grape")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="small configs (for tests)")
    parser.add_argument("--size", choices=list(SIZES), default=None,
                        help="model size (default: bench, or small with --small)")
    parser.add_argument("--eos-runs", action="store_true",
                        help="also run each with an EOS that occurs mid-way")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None,
                        help="every model in this dtype (default: DTYPES, else float16)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the results as JSON here (nothing is written without it)")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG")
    parser.add_argument("--plot-only", type=Path, nargs="+", default=None, metavar="JSON",
                        help="draw --plot from these results files and measure nothing")
    args = parser.parse_args()
    if args.plot_only:
        if not args.plot:
            parser.error("--plot-only needs --plot PNG")
        rows, devices = [], []
        for path in args.plot_only:
            doc = json.loads(path.read_text())
            devices.append(doc.get("device", "GPU not recorded"))
            size = doc.get("size") or ("small" if "--small" in doc["command"] else "bench")
            rows += [{"size": size, **r} for r in doc["results"] if "failed" not in r]
        plot(rows, args.plot, " / ".join(dict.fromkeys(devices)))
        return
    if args.deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before the first cuBLAS handle
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    args.ways = args.ways.split(",")
    size = SIZES[args.size or ("small" if args.small else "bench")]
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict[str, Any]] = []
    for arch in args.archs.split(","):
        _log(f"[+] {arch}")
        try:
            model = build(arch, size, dtype=args.dtype)
        except Exception as e:  # an architecture this transformers lacks: say so, go on
            rows.append({"arch": arch, "failed": f"{type(e).__name__}: {e}"[:300]})
            continue
        for strategy in args.strategies.split(","):
            for batch in batches:
                if batch != batches[0] and strategy not in args.later_batch_strategies.split(","):
                    continue
                try:
                    found, tokens = measure(model, arch, strategy, batch, args, None, "no EOS")
                    if args.eos_runs:  # an EOS that occurs: the token made most often
                        eos = _most_common_new_token(next(iter(tokens.values())), args.prompt)
                        found += measure(model, arch, strategy, batch, args, eos, "EOS")[0]
                except Exception as e:  # one way that breaks: record it, measure the rest
                    found = [{"arch": arch, "strategy": strategy, "batch": batch,
                              "failed": f"{type(e).__name__}: {e}"[:400]}]
                rows += found
                for r in found:
                    _log(json.dumps(r))
        del model
        torch.cuda.empty_cache()
        from grape.torch.api import clear_cache

        clear_cache()
        if args.out:
            _write(args, rows)
    _write(args, rows)
    if args.plot:
        plot([r for r in rows if "failed" not in r], args.plot, torch.cuda.get_device_name())
    print(f"{'arch':<10} {'strategy':<7} {'b':>2} {'run':<7} {'way':<12} {'ms/tok':>8} "
          f"{'syncs/tok':>9} {'copy B':>7} {'same':>5} {'capture s':>9}")
    for r in rows:
        if "failed" in r:
            print(f"{r['arch']:<10} {r.get('strategy', '')} {r.get('batch', '')} failed: "
                  f"{r['failed'][:200]}")
            continue
        copy = "" if r["copy_bytes_per_call"] is None else r["copy_bytes_per_call"]
        same = r["tokens_identical"] if r["tokens_identical"] is not None else (
            r.get("same_seed_same_tokens", ""))
        capture = "" if r["capture_s"] is None else f"{r['capture_s']:.2f}"
        extra = f"  fell back: {r['fallback'][:80]}" if r.get("fallback") else ""
        print(f"{r['arch']:<10} {r['strategy']:<7} {r['batch']:>2} {r['run']:<7} "
              f"{r['way']:<12} {r['ms_per_token']:8.3f} {r['host_syncs_per_token']:9.3f} "
              f"{copy!s:>7} {same!s:>5} {capture:>9}{extra}")


def _write(args, rows: list[dict[str, Any]]) -> None:
    if not args.out:
        return
    import torch

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                    "torch": torch.__version__,
                                    "command": " ".join(sys.argv),
                                    "deterministic": args.deterministic,
                                    "size": args.size or ("small" if args.small else "bench"),
                                    "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
