"""Answers remembered within a scope, for passes that ask the same question of the same
objects again and again: derivation's rounds, held-out checks and comparisons match the same
samples and fit the same nodes' versions many times over (``grape.passes.lengths``).

Answers are keyed by the identities of the objects asked about, and hold those objects, so
that an id cannot be another object's while its answer is remembered. The objects must not
change inside the scope; the IR's graphs and operations are not changed once made (passes
make new ones, ``KernelGraph.with_ops``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["recall", "remembering"]

T = TypeVar("T")

# The innermost scope's tables: kind -> key -> (the objects, the answer)
_scopes: list[dict[str, dict[tuple, tuple[tuple, Any]]]] = []


@contextlib.contextmanager
def remembering() -> Iterator[None]:
    """A scope (also a decorator) within which :func:`recall` remembers; answers are dropped
    when it ends."""
    _scopes.append({})
    try:
        yield
    finally:
        _scopes.pop()


def recall(kind: str, objects: tuple, extra: tuple, compute: Callable[[], T]) -> T:
    """``compute()``, remembered within the innermost :func:`remembering` scope for
    ``objects`` (by identity) and ``extra`` (by value); outside any scope, computed each time.
    An exception is not remembered."""
    if not _scopes:
        return compute()
    table = _scopes[-1].setdefault(kind, {})
    key = (*map(id, objects), *extra)
    if (hit := table.get(key)) is not None:
        return hit[1]
    answer = compute()
    table[key] = (objects, answer)
    return answer
