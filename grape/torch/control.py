"""Data-dependent control flow in one form for eager runs and CUDA graph captures.

``cond(pred, true_fn, false_fn, *operands)`` and ``predicate(pred)`` branch on a GPU value.
Run eagerly they read the predicate back (one host sync) and run the branch it picks. Inside a
``torch.cuda.graph`` capture they read nothing: each branch is captured into a CUDA IF node
(through PyTorch's ``CUDAGraph.begin_capture_to_if_node``), and the GPU picks the branch on
every replay. Nested regions nest their nodes.

``predicate`` is a region, not a function, so the code it guards stays inline::

    with predicate(flag) as taken:
        if taken:          # eagerly: flag's value; under capture: True, into the IF body
            x.add_(1)

``while_loop(cond_fn, body_fn, state, max_iterations)`` loops over a tuple of tensors: eagerly
with one sync per iteration, or, with ``on_device=True``, as one graph launch whose WHILE node
decides on the GPU (``grape.torch.loop.DeviceLoop``, which callers that loop many times should
keep and relaunch); see also ``grape.torch.generate``. Graphs holding IF nodes replay through
PyTorch; grape cannot read them into its IR on drivers without ``cuGraphNodeGetParams`` (driver
580 among them).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from grape.errors import GrapeError, UnsupportedError
from grape.passes.loops import check_bound

__all__ = ["cond", "predicate", "while_loop"]

_PREDICATE_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _check(pred: Any) -> torch.Tensor:
    if not isinstance(pred, torch.Tensor) or pred.numel() != 1 \
            or pred.dtype not in _PREDICATE_DTYPES:
        found = (f"a {pred.dtype} tensor of shape {tuple(pred.shape)}"
                 if isinstance(pred, torch.Tensor) else type(pred).__name__)
        raise GrapeError(f"expected a predicate that is a boolean or integer scalar tensor, "
                         f"found {found}")
    return pred


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _graph(pred: torch.Tensor) -> Any:
    if not pred.is_cuda:
        raise GrapeError(f"expected a CUDA predicate inside a graph capture (the GPU decides "
                         f"the branch), found one on {pred.device}")
    capturing = getattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", None)
    graph = capturing() if capturing is not None else None
    if graph is None or not hasattr(graph, "begin_capture_to_if_node"):
        raise UnsupportedError(f"expected a PyTorch that captures IF nodes "
                               f"(CUDAGraph.begin_capture_to_if_node), found {torch.__version__}"
                               f" without it")
    return graph


@contextmanager
def _if_body(graph: Any, pred: torch.Tensor) -> Iterator[None]:
    graph.begin_capture_to_if_node(pred.bool() if pred.dtype != torch.bool else pred)
    try:
        yield
    finally:
        graph.end_capture_to_conditional_node()


def cond(pred: torch.Tensor, true_fn: Callable[..., Any], false_fn: Callable[..., Any],
         *operands: Any) -> Any:
    """``true_fn(*operands)`` where ``pred`` is non-zero, else ``false_fn(*operands)``.

    Under capture both branches are captured, each in an IF node (on ``pred`` and on its
    negation), and the false branch's outputs are copied into the true branch's, so what
    follows reads one set of tensors: the branches must return tensors of the same shapes and
    dtypes, in the same structure.
    """
    _check(pred)
    if not _capturing():
        return true_fn(*operands) if bool(pred) else false_fn(*operands)
    graph = _graph(pred)
    with _if_body(graph, pred):
        taken = true_fn(*operands)
    negated = torch.logical_not(pred)
    with _if_body(graph, negated):
        other = false_fn(*operands)
        pairs = _pairs(taken, other)
        for a, b in pairs:
            a.copy_(b)
    return taken


def _pairs(a: Any, b: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    flat_a, spec_a = torch.utils._pytree.tree_flatten(a)
    flat_b, spec_b = torch.utils._pytree.tree_flatten(b)
    if spec_a != spec_b:
        raise GrapeError(f"expected both branches to return the same structure, found "
                         f"{spec_a} and {spec_b}")
    for x, y in zip(flat_a, flat_b, strict=True):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) \
                or x.shape != y.shape or x.dtype != y.dtype:
            describe = [f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor)
                        else type(t).__name__ for t in (x, y)]
            raise GrapeError(f"expected both branches to return tensors of one shape and "
                             f"dtype, found {describe[0]} and {describe[1]}")
    return list(zip(flat_a, flat_b, strict=True))


@contextmanager
def predicate(pred: torch.Tensor) -> Generator[bool, None, None]:
    """A region that runs only where ``pred`` is non-zero; yields whether to run its code.

    Eagerly the value is ``pred``'s (one host sync); under capture it is True, and what the
    region launches goes into an IF node on ``pred``.
    """
    _check(pred)
    if not _capturing():
        yield bool(pred)
        return
    with _if_body(_graph(pred), pred):
        yield True


def _same_layout(state: tuple[torch.Tensor, ...], new: Any) -> tuple[torch.Tensor, ...]:
    new = tuple(new) if isinstance(new, (tuple, list)) else (new,)
    if len(new) != len(state):
        raise GrapeError(f"expected the loop body to return {len(state)} tensors, as many as "
                         f"the state, found {len(new)}")
    for i, (old, got) in enumerate(zip(state, new, strict=True)):
        if not isinstance(got, torch.Tensor) or got.shape != old.shape \
                or got.dtype != old.dtype:
            found = (f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor)
                     else type(got).__name__)
            raise GrapeError(f"expected the loop body to keep state {i} at "
                             f"{tuple(old.shape)} {old.dtype}, found {found}")
    return new


def while_loop(cond_fn: Callable[..., torch.Tensor], body_fn: Callable[..., Any],
               state: tuple[torch.Tensor, ...], max_iterations: int, *,
               on_device: bool = False) -> tuple[torch.Tensor, ...]:
    """``while cond_fn(*state): state = body_fn(*state)``, at most ``max_iterations`` times.

    The body must keep every state tensor's shape and dtype (it is refused otherwise), and a
    loop needs its bound. With ``on_device`` the state tensors are updated in place by one
    graph launch (``DeviceLoop``) and returned; the body must have run eagerly before, so that
    nothing initialises lazily inside the capture.
    """
    state = tuple(state)
    if not state or not all(isinstance(t, torch.Tensor) for t in state):
        raise GrapeError(f"expected the loop state to be a non-empty tuple of tensors, found "
                         f"{[type(t).__name__ for t in state]}")
    check_bound(max_iterations)
    if on_device:
        return _device_while(cond_fn, body_fn, state, max_iterations)
    for _ in range(max_iterations):
        if not bool(_check(cond_fn(*state))):
            break
        state = _same_layout(state, body_fn(*state))
    return state


def _device_while(cond_fn: Callable[..., torch.Tensor], body_fn: Callable[..., Any],
                  state: tuple[torch.Tensor, ...], max_iterations: int
                  ) -> tuple[torch.Tensor, ...]:
    from grape.torch.loop import DeviceLoop

    running = torch.zeros((), dtype=torch.bool, device=state[0].device)

    def body() -> None:
        for old, new in zip(state, _same_layout(state, body_fn(*state)), strict=True):
            old.copy_(new)
        running.copy_(_check(cond_fn(*state)).bool().reshape(()))

    running.copy_(_check(cond_fn(*state)).bool().reshape(()))
    loop = DeviceLoop(body, running, max_iterations)
    try:
        loop.launch()
    finally:
        torch.cuda.synchronize()
        loop.close()
    return state
