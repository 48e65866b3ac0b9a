"""The layering the design promises, read from the sources: one IR that both backends import
and that imports neither, and the driver reached only through ``grape/cuda/``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GRAPE = Path(__file__).resolve().parent.parent / "grape"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (inside functions too), absolute names."""
    package = ".".join(path.relative_to(GRAPE.parent).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upward
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
    return found


def _modules(under: str = "") -> list[Path]:
    return sorted((GRAPE / under).rglob("*.py"))


def _offenders(paths: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for path in paths:
        hits = sorted(m for m in _imports(path)
                      if any(m == f or m.startswith(f + ".") for f in forbidden))
        if hits:
            bad[str(path.relative_to(GRAPE.parent))] = hits
    return bad


def test_only_the_cuda_backend_imports_the_driver_bindings():
    outside = [p for p in _modules() if GRAPE / "cuda" not in p.parents]
    assert _offenders(outside, ("cuda",)) == {}


@pytest.mark.parametrize("module", ["ir.py", "irjson.py"])
def test_the_ir_imports_neither_backend(module):
    assert _offenders([GRAPE / module], ("grape.cuda", "grape.sim", "grape.torch", "torch",
                                         "simpy", "cuda")) == {}


def test_the_simulator_imports_neither_the_cuda_backend_nor_pytorch():
    assert _offenders(_modules("sim"), ("grape.cuda", "grape.torch", "torch", "cuda")) == {}


def test_passes_are_backend_free():
    assert _offenders(_modules("passes"), ("grape.cuda", "grape.sim", "grape.torch", "torch",
                                           "cuda")) == {}
