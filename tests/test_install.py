"""grape as a user installs it: a wheel in a fresh virtual environment, used away from the checkout.

A checkout (or an editable install) finds files beside the package that an installed wheel does
not carry; this is the test that notices. The fresh environment borrows grape's dependencies from
the one running the test (a ``.pth`` line each), so no network is needed; grape itself comes only
from the wheel, which the test checks.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "traces" / "h200" / "gpt2_small_decode_b1_kv32.eager.json.gz"


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          check=False, env={"PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh environment with grape installed from a wheel built from this checkout."""
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools")
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"  # a copy, so the build leaves nothing in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    shutil.copytree(ROOT / "grape", source / "grape",
                    ignore=shutil.ignore_patterns("__pycache__"))
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "--no-index", "-w", tmp / "wheels", source, cwd=tmp)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp / "wheels").glob("grape-*.whl")
    env = tmp / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                cwd=tmp).stdout.strip()
    done = _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                "--no-index", wheel, cwd=tmp)
    assert done.returncode == 0, done.stderr[-2000:]
    # Only now: pip would take a grape installed where the dependencies lie for this one.
    borrowed = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "borrowed_dependencies.pth").write_text("\n".join(sorted(borrowed)) + "\n")
    return env


def test_the_wheel_holds_the_package_and_its_device_profile(installed):
    where = _run(installed / "bin" / "python", "-c",
                 "import grape, grape.profile as p; print(grape.__file__); "
                 "print(p.DEFAULT_PROFILE.is_file())", cwd=installed)
    module, profile = where.stdout.split()
    assert Path(module).is_relative_to(installed), module  # the wheel's grape, not the checkout's
    assert profile == "True"


def test_the_readme_command_runs_from_an_installed_wheel(installed, tmp_path):
    # README's first command, from outside the checkout: the default device profile included.
    done = _run(installed / "bin" / "grape", "simulate", TRACE, "--graph", "--chrome",
                tmp_path / "sim.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "predicted from the trace" in done.stdout and "what if: graphed" in done.stdout
    assert (tmp_path / "sim.json").stat().st_size > 0
    validated = _run(installed / "bin" / "grape", "validate", TRACE.parent, cwd=tmp_path)
    assert validated.returncode in (0, 1), validated.stderr  # 1: past a bound, not an error
    assert "median absolute error" in validated.stdout
