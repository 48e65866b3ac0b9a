"""A concurrent capture's notes of what each operation touched, timed per operation (CPU).

``grape.generate(concurrent=True)`` notes, for every operation a capture dispatches, the
extents it read and wrote (``grape.torch.capture._accessed``) and where its fresh results'
storages begin (``_fresh_storages``). This records the operations of one forward of a small
model on the CPU, then times those two functions over them, here and, with ``--against REV``,
as ``grape/torch/capture.py`` stood at git revision REV, alternating, and checks that both
give the same notes for every operation.

    python benchmarks/capture_notes_cost.py --against HEAD~1

Prints, per model, the operations, microseconds per operation (the fastest of ``--repeats``
passes) and the median ratio of the paired passes.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _models() -> dict[str, Any]:
    import transformers

    return {
        "llama": transformers.LlamaConfig(hidden_size=256, num_hidden_layers=12,
                                          num_attention_heads=4, num_key_value_heads=1,
                                          intermediate_size=1024, vocab_size=1000),
        "gpt2": transformers.GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=1000,
                                        bos_token_id=1, eos_token_id=2),
        "mixtral": transformers.MixtralConfig(hidden_size=256, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=1,
                                              intermediate_size=512, vocab_size=1000,
                                              num_local_experts=4),
    }


def _module_at(revision: str) -> Any:
    """grape/torch/capture.py as it stood at ``revision``, imported under another name."""
    source = subprocess.run(["git", "show", f"{revision}:grape/torch/capture.py"], cwd=ROOT,
                            capture_output=True, text=True, check=False)
    if source.returncode != 0:
        sys.exit(f"expected a git revision holding grape/torch/capture.py, found {revision!r}: "
                 f"{source.stderr.strip()}")
    path = Path(tempfile.mkdtemp()) / "capture_then.py"
    path.write_text(source.stdout)
    spec = importlib.util.spec_from_file_location("capture_then", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["capture_then"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _recorded(config: Any) -> list[tuple]:
    """(func, args, kwargs, out) of every operation one forward dispatches."""
    import torch
    import transformers
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, config.vocab_size, (1, 16))
    ops = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ops.append((func, args, kwargs or {}, out))
            return out

    with torch.no_grad(), Record():
        model(ids)
    return ops


def _seconds(module: Any, ops: list[tuple]) -> float:
    start = time.perf_counter()
    for func, args, kwargs, out in ops:
        module._accessed(func, args, kwargs, out)
        module._fresh_storages(func, args, kwargs, out)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,gpt2,mixtral")
    parser.add_argument("--against", default=None, help="a git revision to compare with")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    known = _models()
    models = args.models.split(",")
    if unknown := [m for m in models if m not in known]:
        parser.error(f"expected models of {', '.join(known)}, found {unknown}")

    from grape.torch import capture as here
    then = _module_at(args.against) if args.against else None
    print(f"{'model':8} {'ops':>5} {'us/op here':>11}"
          + (f" {'us/op ' + args.against:>16} {'ratio':>6}" if then else ""))
    for name in models:
        ops = _recorded(known[name])
        if then is not None:
            for op in ops:
                if (here._accessed(*op), here._fresh_storages(*op)) != (
                        then._accessed(*op), then._fresh_storages(*op)):
                    sys.exit(f"{name}: the notes of {op[0]} differ from {args.against}'s")
        pairs = [(_seconds(here, ops), _seconds(then, ops) if then else 0.0)
                 for _ in range(args.repeats)]
        line = f"{name:8} {len(ops):5} {min(h for h, _ in pairs) / len(ops) * 1e6:11.1f}"
        if then is not None:
            line += (f" {min(t for _, t in pairs) / len(ops) * 1e6:16.1f}"
                     f" {statistics.median(t / h for h, t in pairs):5.2f}x")
        print(line)


if __name__ == "__main__":
    main()
