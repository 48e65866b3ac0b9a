"""Running a benchmark script in a fresh process, for GPU tests that check its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _run(script: str, out: Path, args: tuple[str, ...]) -> None:
    """``benchmarks/<script> ARGS --out OUT`` in a fresh process (cuBLAS and PyTorch's
    determinism settings take effect only before the first GPU work)."""
    path = Path(__file__).parent.parent / "benchmarks" / script
    done = subprocess.run([sys.executable, str(path), *args, "--out", str(out)],
                          capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(path.parent.parent)})
    assert done.returncode == 0, done.stderr[-2000:]


def run_benchmark(script: str, tmp_path: Path, *args: str) -> dict:
    """What ``benchmarks/<script> ARGS --out FILE`` wrote (one JSON document)."""
    out = tmp_path / "result.json"
    _run(script, out, args)
    return json.loads(out.read_text())


def run_sweep(tmp_path: Path, *args: str) -> list[dict]:
    """The rows ``benchmarks/arch_sweep.py ARGS --out FILE`` wrote (JSON lines)."""
    out = tmp_path / "sweep.jsonl"
    _run("arch_sweep.py", out, args)
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
