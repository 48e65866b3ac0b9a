"""Which causal-LM types grape finds a learned position table in (CPU, no GPU needed).

``grape.torch.options.check_positions`` refuses a generation that would index past a model's
learned position table (an embedding other than the token table, as long as the config's
``max_position_embeddings``, ``n_positions`` or ``max_target_positions``). This builds every
model type of ``arch_sweep.py`` at its one small config (512 positions) and asks for 16 + 600
tokens, which outgrows any such table: the types named are those with a table (and the table's
name, to read), the others have computed positions (rotary, sinusoidal, ALiBi) or refuse
for another reason (the line says which).

Run: python benchmarks/position_tables.py [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import warnings
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="one JSON line per model type")
    args = parser.parse_args()
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    import arch_sweep

    from grape.errors import GrapeError
    from grape.torch.options import NotGraphable, check_positions, resolve

    warnings.simplefilter("ignore")
    rows = []
    for arch in arch_sweep.architectures():
        row = {"arch": arch}
        try:
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(
                    io.StringIO()):
                model = arch_sweep.build(arch, "cpu", torch.float32)
        except Exception as e:  # the config or the model refusing the small size
            row.update(found="not built", reason=str(e).splitlines()[0][:200] if str(e) else "")
            rows.append(row)
            continue
        ids = torch.ones(1, 16, dtype=torch.long)
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                options, _ = resolve(model, ids, None, {"max_new_tokens": 600})
            check_positions(model, options, ids.shape[1])
            row["found"] = "no table"
        except GrapeError as e:
            row.update(found="table", reason=str(e))
        except NotGraphable as e:
            row.update(found="refused otherwise", reason=str(e))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts: dict[str, list[str]] = {}
    for r in rows:
        counts.setdefault(r["found"], []).append(r["arch"])
    for found, archs in sorted(counts.items()):
        print(f"{found}: {len(archs)}: {' '.join(archs)}")


if __name__ == "__main__":
    main()
