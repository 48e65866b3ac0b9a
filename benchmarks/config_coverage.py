"""Which kinds of module a model type's full-size default has that the sweep's small config
lacks (CPU, meta device): what ``arch_sweep.py``'s rows do not test of that type.

Written when the H100 sweep's rows showed DeepSeek-V3's graphed with ``generate``'s tokens
while its two small layers were both dense (its first three are): no expert had run. Both
models are built on the meta device (no memory, no weights), and each module's class is
counted; a class the default builds and the small model does not is printed by name. A type
whose default config does not build (some ship defaults that do not fit together) says so.

``python benchmarks/config_coverage.py [--seq2seq|--speech] [--archs TYPES] [--out FILE]``
"""

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
import arch_sweep


def kinds(config) -> set[str]:
    with torch.device("meta"):
        model = arch_sweep._auto().from_config(config)
    return {type(m).__name__ for m in model.modules()}


def coverage(model_type: str) -> dict:
    row: dict = {"arch": model_type}
    began = time.perf_counter()
    try:
        small = kinds(arch_sweep.sized_config(model_type, "cpu"))
    except Exception as e:
        return {**row, "stage": "small", "error": arch_sweep._first_line(e)}
    try:
        full = kinds(transformers.AutoConfig.for_model(model_type))
    except Exception as e:
        return {**row, "stage": "default", "error": arch_sweep._first_line(e)}
    return {**row, "stage": "done", "missing": sorted(full - small),
            "seconds": round(time.perf_counter() - began, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", help="model types, comma-separated (default: every type "
                        "of the kind the sweep builds)")
    parser.add_argument("--out", type=Path, help="JSON lines")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--seq2seq", action="store_true",
                      help="transformers' sequence-to-sequence types, as the sweep's --seq2seq")
    kind.add_argument("--speech", action="store_true",
                      help="its speech-to-text types, as the sweep's --speech")
    args = parser.parse_args()
    arch_sweep.SEQ2SEQ[0], arch_sweep.SPEECH[0] = args.seq2seq, args.speech
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    archs = args.archs.split(",") if args.archs else arch_sweep.architectures()
    rows = []
    for model_type in archs:
        row = coverage(model_type)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = [r for r in rows if r["stage"] == "done"]
    short = [r for r in done if r["missing"]]
    print(f"{len(done)} of {len(rows)} types compared; {len(done) - len(short)} build every kind "
          f"of module their default does at the small size; "
          + "; ".join(f"{r['arch']} lacks {', '.join(r['missing'])}" for r in short))
    failed = [r for r in rows if r["stage"] != "done"]
    if failed:
        print(f"not compared ({len(failed)}): "
              + "; ".join(f"{r['arch']} ({r['stage']}: {r['error'][:80]})" for r in failed))


if __name__ == "__main__":
    main()
