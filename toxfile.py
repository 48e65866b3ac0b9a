"""tox's inline plugin: find the Pythons pyenv installed but does not put on PATH.

pyenv machines (CI's among them) carry 3.12 beside the selected 3.11; tox skips an interpreter
it cannot find, so without this plain ``tox`` would never test 3.12. An explicit ``--discover``
wins; without pyenv this does nothing.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from tox.plugin import impl


def pyenv_pythons() -> list[str]:
    """The newest ``pythonX.Y`` of each minor version under pyenv's ``versions``."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    newest: dict[str, tuple[tuple[int, ...], Path]] = {}
    for version in root.glob("3.*"):
        match = re.fullmatch(r"3\.(\d+)\.(\d+)", version.name)
        exe = version / "bin" / f"python3.{match.group(1)}" if match else None
        if exe is not None and exe.is_file():
            key = (int(match.group(1)), int(match.group(2)))
            if match.group(1) not in newest or newest[match.group(1)][0] < key:
                newest[match.group(1)] = (key, exe)
    return [str(exe) for _, exe in sorted(newest.values())]


@impl
def tox_add_core_config(core_conf: Any, state: Any) -> None:
    options = state.conf.options
    if not options.discover:
        options.discover = pyenv_pythons()
