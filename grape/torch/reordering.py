"""Whether a block's operations may run in any order their concurrency DAG allows, checked by
running them so, on any device (the CPU included).

``grape.passes.concurrency`` orders a capture's operations by what the dispatcher says each
one read and wrote (``grape.torch.capture(..., accesses=True)``, :func:`_accessed`). Those
declarations come from operator schemas, and a model is free to do what they do not show: a
custom operator whose schema omits a mutation, state kept outside tensors. This runs the block
once under the same notes, holding every tensor (so that no memory is reused and the block can
be replayed over its own storages), then twice more from the state it found, random generators
included: in its own order, which must leave every byte of every storage it touched as the
first run did (else the block is not deterministic and no order can be judged), and in the
order the DAG allows that lies furthest from it (the latest ready operation first). Each replay
fills the storages the block made with 0xff bytes first, so that an operation moved ahead of
the one that writes what it reads reads NaNs and -1s. The last replay leaving a byte otherwise,
in the state the block found or in what it made (its results among them), means a dependency
the declarations missed.

What it does not check: the kernels. On a GPU the pass also reads each kernel's pointer
arguments, which this, running operations rather than a capture, never sees. Random operations
keep their order here, as they share the host's generator state; captured, each kernel's offset
into the random stream is fixed, so the pass need not order them.

    found = check_reordering(decoder.step)
    assert found.held, found.error
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grape.ir import Kernel, KernelGraph
from grape.passes.concurrency import OpAccess, concurrent
from grape.torch.capture import _accessed, _tensors

__all__ = ["Reordering", "check_reordering"]

# Written by every random operation: the host's generator, as one range no tensor can hold.
_GENERATOR = (1, 1)


@dataclass(frozen=True)
class Reordering:
    """What :func:`check_reordering` found: the block's ``operations``, how many the DAG's
    order ``moved`` from their place, its ``depth`` (operations on the longest path), the
    ``storages`` it touched (found made, and made) and how many the reordered replay left
    ``differing``, and the ``error`` (a replay that raised, or a block that is not
    deterministic) where there is one."""

    operations: int
    moved: int
    depth: int
    storages: int
    differing: int
    error: str | None = None

    @property
    def held(self) -> bool:
        return self.error is None and self.differing == 0


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage's bytes, as a tensor over the same memory."""
    return torch.tensor(storage, dtype=torch.uint8)


class _Recorded(TorchDispatchMode):
    """Every operation of a block, with its arguments, its result and what it touched; the
    bytes of each storage the block found made, as it first met them; the storages it made."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any, OpAccess]] = []
        self.found: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}
        self.made: dict[int, torch.UntypedStorage] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _tensors((args, kwargs)):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() and key not in self.made and key not in self.found:
                self.found[key] = storage, _bytes(storage).clone()
        out = func(*args, **kwargs)
        for t in _tensors(out):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.found:
                self.made[storage.data_ptr()] = storage
        name, reads, writes = _accessed(func, args, kwargs, out)
        if torch.Tag.nondeterministic_seeded in func.tags:
            writes.append(_GENERATOR)
        self.ops.append((func, args, kwargs, out,
                         OpAccess(len(self.ops), tuple(reads), tuple(writes), name)))
        return out

    def storages(self) -> list[torch.UntypedStorage]:
        """Those the block found made, then those it made."""
        return [storage for storage, _ in self.found.values()] + list(self.made.values())

    def state(self) -> list[torch.Tensor]:
        return [_bytes(storage).clone() for storage in self.storages()]

    def replay(self, order: Iterable[int]) -> None:
        """From the state the block found, its storages poisoned, each operation again in
        ``order``, its fresh results copied over the recorded ones that later operations read."""
        for storage, before in self.found.values():
            _bytes(storage).copy_(before)
        for storage in self.made.values():
            _bytes(storage).fill_(0xFF)
        for i in order:
            func, args, kwargs, out, _ = self.ops[i]
            again = func(*args, **kwargs)
            returns = func._schema.returns
            if not returns:  # in place alone (the _foreach_*_ operations)
                continue
            olds, news = ((out,), (again,)) if len(returns) == 1 else (out, again)
            for r, old, new in zip(returns, olds, news, strict=True):
                if r.alias_info is None:  # fresh; an alias views memory written in place
                    for o, n in zip(_tensors(old), _tensors(new), strict=True):
                        o.copy_(n)


def _differing(state: list[torch.Tensor], reference: list[torch.Tensor]) -> int:
    return sum(not torch.equal(a, b) for a, b in zip(state, reference, strict=True))


def check_reordering(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Reordering:
    """Run ``fn(*args, **kwargs)`` (without gradients), then replay its operations in the
    order furthest from their own that ``grape.passes.concurrency`` allows, and say whether
    every byte of the state it found made ends as it did (the module says how). ``fn`` runs
    three times over its own state: leave nothing else depending on it."""
    generators = _generators()
    recorded = _Recorded()
    with torch.no_grad(), recorded:
        fn(*args, **kwargs)
    graph, last = KernelGraph(), []
    for i, (*_, access) in enumerate(recorded.ops):
        last = [graph.add(str(i), Kernel(access.name, access.name, (1, 1, 1), (1, 1, 1)),
                          after=last)]
    dag = concurrent(graph, [access for *_, access in recorded.ops])
    order = [int(n) for n in nx.lexicographical_topological_sort(dag.graph.dag,
                                                                 key=lambda n: -int(n))]
    found = dict(operations=len(order), moved=sum(i != n for i, n in enumerate(order)),
                 depth=dag.depth, storages=len(recorded.storages()))
    after, drawn = recorded.state(), _generators()
    try:
        for name, replayed in (("its own order", range(len(order))), ("the DAG's order", order)):
            _set_generators(generators)
            try:
                with torch.no_grad():
                    recorded.replay(replayed)
            except Exception as e:  # an operation refusing what it read: said, with its type
                message = (str(e).strip().splitlines() or [""])[0]
                return Reordering(**found, differing=0, error=(
                    f"replaying in {name} raised {type(e).__name__}: {message}"))
            differing = _differing(recorded.state(), after)
            if name == "its own order" and differing:
                return Reordering(**found, differing=differing, error=(
                    f"replayed in its own order the block left {differing} of {len(after)} "
                    f"storages otherwise: it is not deterministic, so no other order can be "
                    f"judged"))
        return Reordering(**found, differing=differing)
    finally:  # the caller's state, and what the block returned, as the block left them
        for storage, saved in zip(recorded.storages(), after, strict=True):
            _bytes(storage).copy_(saved)
        _set_generators(drawn)


def _generators() -> list[torch.Tensor]:
    """The host's random state, and each GPU's where there are GPUs."""
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state_all()
                                     if torch.cuda.is_available() else ())]


def _set_generators(states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states[1:])
