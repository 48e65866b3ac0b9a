"""Test-wide set-up: the ``gpu`` marker's skip, and modules that need optional extras."""

from __future__ import annotations

import importlib.util

import pytest


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


# Doctests import every module; those of optional extras are skipped where the extra is missing.
collect_ignore_glob = [f"grape/{pkg}/*" for pkg, module in (("cuda", "cuda.bindings"),
                                                            ("torch", "torch"))
                       if not _installed(module)]


def _gpu_skip_reason() -> str | None:
    if not _installed("cuda.bindings"):
        return "no CUDA device: cuda-bindings is not installed (pip install 'grape[cuda]')"
    from grape.cuda.check import device_status

    ok, why = device_status()
    return None if ok else f"no CUDA device: {why}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and (reason := _gpu_skip_reason()):
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))
