"""Driver handles that free themselves: ``close()``, ``with``, and a finaliser as safety net."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any, Self

__all__ = ["Resource"]


def _release(destroy: Callable[[Any], Any], handle: Any) -> None:
    with contextlib.suppress(Exception):  # the driver may already be gone at interpreter exit
        destroy(handle)


class Resource:
    """Base of objects that own one driver handle, released exactly once."""

    def _own(self, handle: Any, destroy: Callable[[Any], Any] | None) -> None:
        """Release ``handle`` with ``destroy`` on close or collection (None: someone else owns
        it, and it is never destroyed here)."""
        self._finalizer = weakref.finalize(self, _release, destroy or (lambda h: None), handle)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
