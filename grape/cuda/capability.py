"""What the driver in use can do, checked before grape relies on it."""

from __future__ import annotations

from cuda.bindings import driver

from grape.cuda.check import call
from grape.errors import UnsupportedError
from grape.ir import ConditionalKind

__all__ = ["NEEDS", "driver_version", "require"]

# The driver version (CUDA 12.4 = 12040) from which each kind of conditional node exists.
NEEDS = {ConditionalKind.IF: 12040, ConditionalKind.WHILE: 12040,
         ConditionalKind.IF_ELSE: 12080, ConditionalKind.SWITCH: 12080}


def driver_version() -> int:
    """The CUDA version the driver supports, as the driver codes it (12.4 = 12040)."""
    return call(driver.cuDriverGetVersion, doing="reading the driver version")


def require(kind: ConditionalKind) -> None:
    """Refuse clearly where the driver lacks ``kind`` conditional nodes."""
    version = driver_version()
    if version < NEEDS[kind]:
        need = NEEDS[kind]
        raise UnsupportedError(f"driver {version // 1000}.{version % 1000 // 10} does not "
                               f"support {kind.value.upper()} conditional nodes; needs CUDA "
                               f"{need // 1000}.{need % 1000 // 10}")
