"""Driver handles that free themselves: ``close()``, ``with``, and a finaliser as safety net.

:func:`open_resources` counts what is open by kind, so that a soak or a test can show nothing
leaks (every executable and graph grape made is released again).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, Self

__all__ = ["Resource", "open_resources"]

_open: Counter[str] = Counter()


def _release(destroy: Callable[[Any], Any], handle: Any, kind: str) -> None:
    _open[kind] -= 1
    with contextlib.suppress(Exception):  # the driver may already be gone at interpreter exit
        destroy(handle)


def open_resources() -> dict[str, int]:
    """Resources not yet released, by class name (``{"Executable": 2, "Graph": 3}``)."""
    return {kind: n for kind, n in _open.items() if n}


class Resource:
    """Base of objects that own one driver handle, released exactly once."""

    def _own(self, handle: Any, destroy: Callable[[Any], Any] | None) -> None:
        """Release ``handle`` with ``destroy`` on close or collection (None: someone else owns
        it, and it is never destroyed here)."""
        kind = type(self).__name__
        _open[kind] += 1
        self._finalizer = weakref.finalize(self, _release, destroy or (lambda h: None), handle,
                                           kind)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
