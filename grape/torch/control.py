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
keep and relaunch); see also ``grape.torch.generate``.

Where PyTorch has no ``begin_capture_to_if_node`` (2.11 has none), grape adds the IF node itself
(``grape.cuda.regions``) and points PyTorch's allocator at the capture's memory pool while the
body is captured; that needs the pool, which a capture through :func:`graph` (a
``torch.cuda.graph`` that remembers it) or through ``grape.torch.capture`` provides. After a
body, the capture's allocations go to the pool from the capturing stream alone (PyTorch's own
rule also follows streams joined into the capture).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from grape.errors import GrapeError, UnsupportedError
from grape.passes.loops import check_bound

__all__ = ["can_branch", "capturing", "cond", "graph", "predicate", "while_loop"]

# The memory pool of the capture under way, where it went through :func:`graph`.
_POOL: ContextVar[Any] = ContextVar("grape_capture_pool", default=None)

_PREDICATE_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _check(pred: Any) -> torch.Tensor:
    if not isinstance(pred, torch.Tensor) or pred.numel() != 1 \
            or pred.dtype not in _PREDICATE_DTYPES:
        found = (f"a {pred.dtype} tensor of shape {tuple(pred.shape)}"
                 if isinstance(pred, torch.Tensor) else type(pred).__name__)
        raise GrapeError(f"expected a predicate that is a boolean or integer scalar tensor, "
                         f"found {found}")
    return pred


def capturing() -> bool:
    """Whether a CUDA stream capture is under way on the current stream (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def can_branch() -> bool:
    """Whether :func:`cond` and :func:`predicate` work here: outside a capture always (they
    read the predicate back); inside one where PyTorch captures IF nodes itself or the
    capture's memory pool is known (:func:`graph`, ``grape.torch.capture``)."""
    return not capturing() or _torch_if_capture() is not None or _POOL.get() is not None


@contextmanager
def graph(cuda_graph: torch.cuda.CUDAGraph, **kwargs: Any) -> Iterator[None]:
    """``torch.cuda.graph(cuda_graph, **kwargs)``, remembering the capture's memory pool, so
    that :func:`cond` and :func:`predicate` capture IF nodes on any PyTorch; a capture that
    fails leaves the process as it found it (:func:`_recover`)."""
    # A pool named up front: PyTorch 2.11 refuses CUDAGraph.pool() until the capture ends.
    pool = kwargs.pop("pool", None) or torch.cuda.graph_pool_handle()
    caller = torch.cuda.current_stream()
    began = False
    try:
        with torch.cuda.graph(cuda_graph, pool=pool, **kwargs):
            began = True
            token = _POOL.set(pool)
            try:
                yield
            finally:
                _POOL.reset(token)
    except BaseException:
        if began and not _ended(cuda_graph):
            _recover(pool, caller)
        raise


def _ended(cuda_graph: torch.cuda.CUDAGraph) -> bool:
    """Whether the capture ended (PyTorch answers ``pool()`` only after a successful end)."""
    try:
        cuda_graph.pool()
    except RuntimeError:
        return False
    return True


def _recover(pool: Any, caller: torch.cuda.Stream) -> None:
    """Undo what a capture that ended in an error left behind.

    When a capture breaks (a host sync, a copy from pageable memory), PyTorch's
    ``capture_end`` raises before it finishes, and leaves: the capturing stream current (and,
    where the error came before the driver's end of capture, still capturing); the allocator
    sending allocations to the capture's pool and holding a reference to that pool, which then
    never goes; and the CUDA random generator in capture mode, so that the next random op
    outside any capture fails ("Offset increment outside graph capture"). Each is undone here,
    in that order; the generator by a capture that ends cleanly, which takes it out of capture
    mode without moving its offset: the random stream goes on where it was.
    """
    from grape.cuda.capture import abandon_capture

    device = torch.cuda.current_device()
    abandon_capture(torch.cuda.current_stream().cuda_stream)
    torch.cuda.set_stream(caller)
    end = _allocator("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool")
    with contextlib.suppress(RuntimeError):  # where the failed capture_end got that far
        end(device, pool)
    _allocator("_cuda_releasePool")(device, pool)
    scratch = torch.empty(1, device=device)
    clean = torch.cuda.CUDAGraph()
    with torch.cuda.graph(clean):
        scratch.zero_()
    del clean  # its pool goes with it


def _torch_if_capture() -> Any:
    """PyTorch's capturing graph where PyTorch captures IF nodes itself, else None."""
    current = getattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", None)
    if current is None or not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        return None
    return current()


def _allocator(*names: str) -> Callable[..., None]:
    """PyTorch's allocator hook by the first of ``names`` (newer first) this PyTorch has."""
    for name in names:
        fn = getattr(torch._C, name, None)
        if fn is not None:
            return fn
    raise UnsupportedError(f"expected PyTorch's allocator to take {names[0]} (to place an IF "
                           f"body's memory in the capture's pool), found {torch.__version__} "
                           f"without it")


@contextmanager
def _if_body(pred: torch.Tensor) -> Iterator[None]:
    """Work issued inside goes into an IF node on ``pred``, in the capture under way."""
    if not pred.is_cuda:
        raise GrapeError(f"expected a CUDA predicate inside a graph capture (the GPU decides "
                         f"the branch), found one on {pred.device}")
    flag = pred.reshape(()) if pred.dtype == torch.bool else (pred.reshape(()) != 0)
    capturing = _torch_if_capture()
    if capturing is not None:
        capturing.begin_capture_to_if_node(flag)
        try:
            yield
        finally:
            capturing.end_capture_to_conditional_node()
        return
    pool = _POOL.get()
    if pool is None:
        raise UnsupportedError(f"expected a capture through grape.torch.control.graph or "
                               f"grape.torch.capture (which know the capture's memory pool) on "
                               f"PyTorch {torch.__version__}, which cannot capture IF nodes "
                               f"itself; found a plain torch.cuda.graph capture")
    from grape.cuda import regions

    # Allocations from the current stream to the pool; where a PyTorch lacks that, from every
    # stream (broader, and still right while one thread captures, as torch.cuda.graph's does).
    begin = _allocator("_cuda_beginAllocateCurrentStreamToPool", "_cuda_beginAllocateToPool")
    end = _allocator("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool")
    device, outer = torch.cuda.current_device(), torch.cuda.current_stream()
    body = torch.cuda.Stream()  # from PyTorch's pool, made before the capture began
    if body.cuda_stream == outer.cuda_stream:
        body = torch.cuda.Stream()
    region = regions.begin_if(outer.cuda_stream, flag.data_ptr(), body.cuda_stream)
    # The body's stream is another capture (its own id), which the pool's rule for the outer
    # capture does not cover: send what the body allocates from its stream to the same pool.
    end(device, pool)
    try:
        with torch.cuda.stream(body):
            begin(device, pool)
            try:
                yield
            finally:
                end(device, pool)
    finally:
        regions.end_region(region)
        begin(device, pool)  # on the outer stream again


def cond(pred: torch.Tensor, true_fn: Callable[..., Any], false_fn: Callable[..., Any],
         *operands: Any) -> Any:
    """``true_fn(*operands)`` where ``pred`` is non-zero, else ``false_fn(*operands)``.

    Under capture both branches are captured, each in an IF node (on ``pred`` and on its
    negation), and the false branch's outputs are copied into the true branch's, so what
    follows reads one set of tensors: the branches must return tensors of the same shapes and
    dtypes, in the same structure.
    """
    _check(pred)
    if not capturing():
        return true_fn(*operands) if bool(pred) else false_fn(*operands)
    with _if_body(pred):
        taken = true_fn(*operands)
    with _if_body(torch.logical_not(pred)):
        other = false_fn(*operands)
        for a, b in _pairs(taken, other):
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
    if not capturing():
        yield bool(pred)
        return
    with _if_body(pred):
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
