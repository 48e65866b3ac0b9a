"""Structural mutations of JSON documents, for fuzzing grape's readers.

A mutation changes one place in a document: a key deleted, a value replaced by one of another
type, a list item duplicated, dropped or moved, or a number made huge, negative, NaN, infinite,
null or a numeric string. A mutant shares every part it did not change with the original (it is
copied only along the path to the change), so thousands of them cost little, and the original is
never touched.

Sample ``i`` of seed ``s`` depends on nothing else, so any failure reruns alone:
``mutant(doc, s, i)``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

__all__ = ["mutant", "paths"]

Path = tuple[str | int, ...]

# Values of every JSON type (and the non-finite numbers Python's json reads), to put anywhere.
OTHER_VALUES = (None, True, False, 0, -1, 1.5, "5", "text", [], [1, 2], [[1]], {}, {"k": 1})


def paths(doc: Any, prefix: Path = ()) -> Iterator[Path]:
    """Every place in ``doc`` below its root: object keys and list indices."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) \
        if isinstance(doc, list) else ()
    for key, value in items:
        yield (*prefix, key)
        yield from paths(value, (*prefix, key))


def _descend(doc: Any, rng: random.Random) -> Path:
    """A place reached by walking down from the root, stopping at each level with odds 1 in 3:
    places near the top (a trace's metadata) are drawn far more often than uniform draws,
    which the thousands of events swamp, would draw them."""
    path: Path = ()
    node = doc
    while isinstance(node, (dict, list)) and node and (not path or rng.random() > 1 / 3):
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path, node = (*path, key), node[key]
    return path


def _number(value: float, rng: random.Random) -> Any:
    return rng.choice([value * 1e12, -value, -abs(value) - 1, math.nan, math.inf, -math.inf,
                       2**63, 1e308, None, str(value), 0])


def _change(parent: dict | list, key: str | int, rng: random.Random) -> str:
    """Mutate ``parent[key]`` in place (``parent`` is already a copy); say what was done."""
    value = parent[key]
    choices = ["delete", "retype"]
    if isinstance(parent, list):
        choices += ["duplicate", "move"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        choices += ["number", "number"]
    if isinstance(value, list) and value:
        choices.append("truncate")
    how = rng.choice(choices)
    if how == "delete":
        del parent[key]
    elif how == "retype":
        parent[key] = rng.choice([v for v in OTHER_VALUES if type(v) is not type(value)])
    elif how == "duplicate":
        parent.insert(key, parent[key])
    elif how == "move":
        parent.insert(rng.randrange(len(parent)), parent.pop(key))
    elif how == "number":
        parent[key] = _number(value, rng)
    else:  # truncate
        parent[key] = value[:rng.randrange(len(value))]
    return how


def mutant(doc: Any, seed: int, index: int, *, places: list[Path] | None = None
           ) -> tuple[Any, str]:
    """Sample ``index`` of ``seed``: ``doc`` with one mutation, and a description of it.

    ``places`` (``list(paths(doc))``, computed once by the caller) lets half the samples draw
    their place uniformly; the other half walk down from the root.
    """
    rng = random.Random(f"{seed}:{index}")
    path = rng.choice(places) if places and rng.random() < 0.5 else _descend(doc, rng)
    if not path:
        return rng.choice(OTHER_VALUES), "root replaced"
    root = copy = _shallow(doc)
    for key in path[:-1]:
        copy[key] = _shallow(copy[key])
        copy = copy[key]
    how = _change(copy, path[-1], rng)
    return root, f"{how} at {'/'.join(map(str, path))}"


def _shallow(node: dict | list) -> dict | list:
    return dict(node) if isinstance(node, dict) else list(node)
