"""Capturing PyTorch work into the IR.

``torch.cuda.graph`` does the capture (PyTorch keeps its allocator consistent with the graph);
``CUDAGraph(keep_graph=True)`` keeps the raw ``cudaGraph_t``, which grape walks with
cuda.bindings. Tensors the caller names (inputs, parameters, outputs) become buffers with those
roles; every other address the kernels use becomes an internal buffer.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import linecache
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grape.cuda.buffers import BufferMap
from grape.cuda.build import Graph
from grape.cuda.capture import captured_nodes
from grape.cuda.walk import kernel_functions
from grape.errors import CaptureError
from grape.ir import BufferRole, KernelGraph
from grape.passes.concurrency import Allocations, OpAccess
from grape.passes.places import MARKER_BYTES, History, Mark
from grape.torch.control import graph
from grape.torch.workspace import seat_workspace

__all__ = ["TorchCapture", "capture", "collector_paused", "frozen_heap", "functions_run",
           "live_blocks", "on_another_thread", "pool_segments"]

_TORCH_DIR = str(Path(torch.__file__).parent)


@dataclass
class TorchCapture:
    graph: Graph  # wraps PyTorch's raw graph, which PyTorch owns
    torch_graph: torch.cuda.CUDAGraph  # keeps the raw graph and its memory pool alive
    outputs: Any
    pool_bytes: int  # device memory PyTorch reserved for the capture's pool
    blocks: list[tuple[int, int]] = field(default_factory=list)  # live blocks named (capture)
    marks: list[Mark] = field(default_factory=list)  # where its operations started (marks=True)
    # marks=True: the allocator's acts in the graph's pool during the capture (None where the
    # process records the allocator's history itself)
    history: History | None = None
    # accesses=True: what each operation read and wrote, and what the allocator held during
    # the capture (None where the process records the allocator's history itself), for
    # grape.passes.concurrency
    accesses: list[OpAccess] = field(default_factory=list)
    allocations: Allocations | None = None

    @property
    def ir(self) -> KernelGraph:
        return self.graph.ir

    def replay(self) -> None:
        """Replay through PyTorch (the reference the IR is checked against)."""
        self.torch_graph.replay()


def _tensors(value: Any) -> Sequence[torch.Tensor]:
    """The tensors in ``value``, through lists, tuples and mappings, in order. A plain
    function, not a generator: a concurrent capture asks it of every operation's arguments
    and results, and nested generators were a third of its notes' host time."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, Mapping):
        value = tuple(value.values())
    elif not isinstance(value, (list, tuple)):
        return ()
    found: list[torch.Tensor] = []
    for v in value:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple, Mapping)):
            found.extend(_tensors(v))
    return found


def _name(buffers: BufferMap, prefix: str, tensors: Iterable[tuple[str, torch.Tensor]],
          role: BufferRole) -> None:
    for name, t in tensors:
        if t.is_cuda:
            storage = t.untyped_storage()
            buffers.name(f"{prefix}{name}", storage.data_ptr(), storage.nbytes(), role)


# grape's modules that run inside the user's operations (this one, and the dispatch modes that
# stage host constants): a failure there was issued by the line that called the operation.
_PASSING_THROUGH = (__file__, *(str(Path(__file__).with_name(name)) for name in (
    "staging.py", "readback.py", "cache_length.py", "masked_writes.py")))


def culprit(error: BaseException) -> str:
    """The user's line that issued the failing operation: the last frame outside PyTorch and
    grape's pass-through layers."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(_TORCH_DIR) and f.filename not in _PASSING_THROUGH]
    if not frames:
        return "a line inside PyTorch"
    f = frames[-1]
    code = (f.line or linecache.getline(f.filename, f.lineno)).strip()
    return f"{f.filename}:{f.lineno} ({code})"


def _why(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, torch.OutOfMemoryError):
        # (its text can mention the capture too: no sync to blame)
        return f"the device out of memory ({text})"
    if "capturing" in text or "capture" in text:
        return (f"an operation that synchronises with the host or copies from CPU memory "
                f"({text})")
    return text


def _failure(error: BaseException) -> str:
    first = error.__context__ or error  # capture_end's error hides the one that broke capture
    if isinstance(first, CaptureError):
        # A capture inside this one (a conditional's body) failed and said why; its message
        # names "capture" and would read as a sync if wrapped again.
        return str(first)
    # (what grape's pass-through layers changed in the failing call, where they say so)
    notes = "; ".join(getattr(first, "__notes__", ()))
    return (f"expected work that can be captured, found {_why(first)} issued at "
            f"{culprit(first)}" + (f" ({notes})" if notes else ""))


# One side stream per device for every capture's warm-up and capture. cuBLAS keeps a workspace
# for each (handle, stream) it has run on until the process ends (32 MiB and 1 MiB on the
# H200): a new stream per capture left one behind for each of PyTorch's 32 pooled streams,
# 1.1 GB in all under a 255-shape GPT-2 family (torch.cuda.memory._snapshot named
# setWorkspaceForHandle).
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def on_another_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on a new thread, under this thread's autograd and autocast modes, CUDA
    device and current stream, and its value or exception handed back here.

    For captures that must see other host leftovers: PyTorch leaves some words of a kernel's
    argument structs unfilled, and they carry what the launching thread's stack held there.
    Two captures of one length on one thread often hold the same bytes in them (the same
    calls ran before), so a second capture there does not show them to be leftovers; a new
    thread's stack has its own history. Its cost: PyTorch gives each thread cuBLAS handles of
    its own, and cuBLAS keeps a workspace for each handle and stream it ran on (33 MiB on the
    H200); handles go back to PyTorch's pool when their thread ends, and later threads take
    them again. Measured on the H200 (run 18, GPT-2 small over 1..1023): a family whose
    derivation captured four lengths this way took 104.9 MB against 2.1 MB without, a
    workspace of 33 MiB in its pool and 64 MiB outside PyTorch's allocator; with one step run
    on another thread first (runs 54 and 55: 102.8 and 100.7 MB), the family's own captures on
    new threads added nothing more (6.6 MB for GPT-2, 37.7 for a Llama shape): once a process.
    """
    state = {"grad": torch.is_grad_enabled(),
             "inference": torch.is_inference_mode_enabled(),
             "autocast": (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))}
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        state["device"], state["stream"] = (torch.cuda.current_device(),
                                            torch.cuda.current_stream())
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            with contextlib.ExitStack() as stack:
                if cuda:
                    torch.cuda.set_device(state["device"])
                    stack.enter_context(torch.cuda.stream(state["stream"]))
                # a new thread starts with grad on, inference mode and autocast off
                if state["inference"]:
                    stack.enter_context(torch.inference_mode())
                stack.enter_context(torch.set_grad_enabled(state["grad"]))
                enabled, dtype = state["autocast"]
                if enabled:
                    stack.enter_context(torch.autocast("cuda", dtype=dtype))
                out["value"] = fn()
        except BaseException as e:  # raised again in the caller's thread
            out["error"] = e

    thread = threading.Thread(target=run, name="grape-capture-elsewhere")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def capture_stream() -> torch.cuda.Stream:
    """The side stream every grape capture on the current device warms up and captures on:
    one per device, so that cuBLAS's per-stream workspace is made once (benchmarks make it
    before measuring a family's memory, as they do for the baselines' streams)."""
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream()
    return _CAPTURE_STREAMS[device]


# A capture's memory layout should repeat, so that a family's shapes place their temporaries
# alike (smaller deltas). A collection by Python's cycle collector frees the tensors that
# reference cycles hold, wherever it happens to run, and the allocator hands their blocks to
# others; so capture() collects before each capture and pauses the collector during it, and
# frozen_heap() keeps the collection before each capture cheap. Measured on the H200 (GPT-2
# small decode; benchmarks/capture_layout.py, benchmarks/README.md): two captures of one shape,
# neither a process's first, each after a full collection, made the same allocator events at
# the same offsets, in one process and across two. Across processes that was not enough for a
# saved family to move: its warm start no longer depends on the layout (the graphs' scratch
# moves whole, the caller's tensors pair block by block: grape.torch.family.load_family).


@contextlib.contextmanager
def collector_paused():
    """Python's cycle collector off while a capture runs, and the capture's own cyclic
    garbage collected as it ends (the youngest generation holds all the capture made, nothing
    having been collected during it): at one fixed point, not at the next collection's whim."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect(0)
        if enabled:
            gc.enable()


_FROZEN = [0]  # frozen_heap's nesting depth


def full_collection() -> None:
    """Collect every generation; inside ``frozen_heap``, freeze what survived too. A family
    keeps each shape it captures (its IR, its deltas: about 1,200 objects a GPT-2 shape), and
    a collection that walked all it kept cost each capture more than the one before: 8.5 ms a
    shape at the first 50 shapes, 210 ms at shapes 350..399 (H200,
    ``benchmarks/family_capture_phases.py 400``). Survivors of a full collection are alive;
    frozen, the next collection walks only what was made since. Cycles among them that die
    later wait for the unfreeze at the outermost ``frozen_heap``'s end."""
    gc.collect()
    if _FROZEN[0]:
        gc.freeze()


@contextlib.contextmanager
def frozen_heap(settle: bool = False):
    """Many captures in a row (a family): the objects alive on entry, and those that survive
    each full collection inside (``full_collection``), are left out of every collection until
    the end (``gc.freeze``), so that the full collection before each capture costs what was
    made since, not the whole heap (0.16 to 0.29 s with transformers loaded,
    against tens of microseconds frozen). Nests; the heap is unfrozen when the outermost one
    ends. Python cannot unfreeze some objects and not others: objects the caller froze itself
    (a server before forking) are unfrozen too, and stay collectable as any other. Leaving
    such a heap alone cost more than it saved: the H200 machine's Python starts with 375
    objects frozen, and every capture of a 255-shape GPT-2 family then paid a full collection
    (0.33 s per shape against 0.064).

    ``settle``: end (where this one is the outermost) with a full collection of the heap, for
    whoever made much that will live on (a family's shapes). Unfrozen, those objects join the
    oldest generation uncounted, and the next full collection comes as soon as the program
    allocates a little, on the family's first pass, and walks all of it there
    (``benchmarks/gc_after_unfreeze.py``, CPU: a 0.19 s collection inside a 1,023-step pass).
    Paid here, it counts as the capture's. On the H200 a 1,023-length GPT-2 family's
    first-pass updates took 890 us a step before, 815 after (later passes 223 and 286; two
    runs on two machines), so this was not all of that pass's extra cost."""
    if _FROZEN[0] == 0:
        full_collection()
        gc.freeze()
    _FROZEN[0] += 1
    try:
        yield
    finally:
        _FROZEN[0] -= 1
        if _FROZEN[0] == 0:
            gc.unfreeze()
            if settle:
                gc.collect()


def _segments(pool: Any = None) -> Iterator[dict]:
    """The caching allocator's segments on this device (``torch.cuda.memory._snapshot``'s),
    those of graph pool ``pool`` alone where one is given."""
    device = torch.cuda.current_device()
    for segment in torch.cuda.memory._snapshot()["segments"]:
        if segment["device"] == device and (pool is None or tuple(segment["segment_pool_id"])
                                            == tuple(pool)):
            yield segment


def _blocks(segment: dict) -> Iterator[tuple[int, int, str]]:
    """A segment's blocks as (address, size, state), in address order."""
    address = segment["address"]
    for block in segment["blocks"]:
        address = block.get("address", address)
        yield address, block["size"], block["state"]
        address += block["size"]


def pool_segments(pool: Any, idle: bool = False) -> list[tuple[int, int]]:
    """Graph pool ``pool``'s segments, as (address, size); with ``idle``, only those in which
    no tensor lives (every block free)."""
    return [(s["address"], s["total_size"]) for s in _segments(pool)
            if not (idle and any(state != "inactive" for *_, state in _blocks(s)))]


def live_blocks(pool: Any = None) -> list[tuple[int, int]]:
    """Every live block (a tensor's storage) outside graph pool ``pool``, as (address, size):
    for ``capture(blocks=...)``. One snapshot of the allocator (1 ms for GPT-2 small's 177 live
    blocks on the H200); families take it once, so that every shape names the same blocks."""
    found = []
    for segment in _segments():
        if pool is not None and tuple(segment["segment_pool_id"]) == tuple(pool):
            continue  # the pool's blocks are captures' temporaries: left in their segments
        found += [(address, size) for address, size, state in _blocks(segment)
                  if state == "active_allocated"]
    return found


class _Marks(TorchDispatchMode):
    """Where each operation of a capture starts (``grape.passes.places.Mark``): the graph's
    node count, and a marker of ``MARKER_BYTES`` allocated and freed at once, so that the
    allocator's history holds the moment: what a family moving its captures' temporaries
    needs to tell which block a reused place meant. The marker takes a free small block and
    gives it back, where it merges as it was. Its host cost was not measured apart (an
    earlier form, noting each operation's outputs, and the history together doubled a GPT-2
    shape's capture on the H200: benchmarks/README.md, run 24). With ``accesses``, also the
    memory each operation's tensors span, read or written (:func:`_accessed`)."""

    def __init__(self, stream: int, device: torch.device, accesses: bool = False) -> None:
        super().__init__()
        self.stream, self.device = stream, device
        self.marks: list[Mark] = []
        self.accesses: list[tuple[str, list, list]] | None = [] if accesses else None
        self.ends: list[int] = []  # with accesses: the graph's node count as each returned
        # with accesses: where each operation's fresh results' storages begin (blocks the
        # allocator must have made while it ran: a check of the history's attribution)
        self.fresh: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        marker = _unfilled(MARKER_BYTES, self.device)
        self.marks.append(Mark(captured_nodes(self.stream), marker.data_ptr()))
        del marker
        out = func(*args, **(kwargs or {}))
        if self.accesses is not None:
            self.ends.append(captured_nodes(self.stream))
            self.accesses.append(_accessed(func, args, kwargs or {}, out))
            self.fresh.append(_fresh_storages(func, args, kwargs or {}, out))
        return out


def _unfilled(size: int, device: torch.device) -> torch.Tensor:
    """``size`` bytes that no kernel writes. Under ``torch.use_deterministic_algorithms`` a new
    tensor is filled (``torch.utils.deterministic.fill_uninitialized_memory``): a marker made
    so put a fill kernel into the graph before every operation, outside any dispatch, which
    widened to the tensor its block had held and left a concurrent step one chain (H100: a
    small GPT-2's step, 362 of its 363 nodes on the longest path, and 145 kernels more)."""
    fills = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        return torch.empty(size, dtype=torch.uint8, device=device)
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fills


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes a tensor's elements span, as (address, size); None for no elements."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), (last + 1) * t.element_size()


@functools.cache
def _schema_plan(func: Any) -> tuple[str, tuple[tuple[str, bool], ...], tuple[bool, ...]]:
    """What the notes read of an operator's schema, read once per operator: its name, its
    arguments as (name, written: marked mutable, ``Tensor(a!)``), and whether each of its
    returns is fresh (no alias: not a view, nor an argument handed back)."""
    schema = func._schema
    arguments = tuple((a.name, a.alias_info is not None and a.alias_info.is_write)
                      for a in schema.arguments)
    return str(func), arguments, tuple(r.alias_info is None for r in schema.returns)


def _returned(out: Any, fresh: tuple[bool, ...]) -> Iterable[Any]:
    """An operation's fresh results, one value per return its schema marks fresh."""
    returns = out if isinstance(out, tuple) and len(fresh) > 1 else (out,)
    return (value for value, new in zip(returns, fresh, strict=False) if new)


def _accessed(func: Any, args: tuple, kwargs: Mapping, out: Any) -> tuple[str, list, list]:
    """An operation's name and the extents it read and wrote: its tensor arguments (written
    where the schema marks them mutable, ``Tensor(a!)``), and the tensors it returned that
    are not views of its arguments (written)."""
    name, arguments, fresh = _schema_plan(func)
    reads, writes = [], []
    for i, (argument, written) in enumerate(arguments):
        if i < len(args):
            value = args[i]
        elif argument in kwargs:
            value = kwargs[argument]
        else:
            continue
        (writes if written else reads).extend(
            e for t in _tensors(value) if (e := _extent(t)) is not None)
    for value in _returned(out, fresh):  # an alias is a view, or an argument counted above
        writes.extend(e for t in _tensors(value) if (e := _extent(t)) is not None)
    return name, reads, writes


def _allocations(trace: Iterable[Mapping], segments: Iterable[Mapping]) -> Allocations:
    """The allocator's segments on this device and every block a tensor held during a capture:
    those its trace allocated or freed, and those alive when it ended (which include every
    block alive when it began and not freed since)."""
    segments = list(segments)
    held = {(e["addr"], e["size"]) for e in trace
            if e["action"] in ("alloc", "free_requested", "free_completed")}
    held.update((address, size) for s in segments for address, size, state in _blocks(s)
                if state != "inactive")
    return Allocations(tuple((s["address"], s["total_size"]) for s in segments),
                       tuple(sorted(held)))


def _fresh_storages(func: Any, args: tuple, kwargs: Mapping, out: Any) -> list[int]:
    """Where the storages of an operation's fresh results begin, for those with elements:
    results its schema does not mark as aliases, less those on an argument's storage
    (``_unsafe_view`` returns a view its schema does not mark)."""
    starts = [t.untyped_storage().data_ptr() for value in _returned(out, _schema_plan(func)[2])
              for t in _tensors(value) if t.device.type != "meta" and t.numel()]
    if not starts:
        return starts
    given = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
    return [start for start in starts if start not in given]


def _op_accesses(noted: _Marks, history: History | None) -> list[OpAccess]:
    """Each operation's accesses, its temporaries (the pool blocks the allocator made while
    it ran, where the capture recorded the allocator's history) among its writes, and where
    its dispatch ended (only with its temporaries known: ``OpAccess.end`` says why).

    The temporaries are known where the history holds a marker for every operation, and
    every fresh result an operation returned in the pool lies in a block the history says it
    made: a block given to the wrong operation would make a temporary's word in its own
    kernels look like a stale pointer to another operation's tensor, which the concurrency
    pass leaves out."""
    made: list[list[tuple[int, int]]] = [[] for _ in noted.marks]
    known = history is not None and len(history.marks) == len(noted.marks)
    if known:
        at = list(history.marks)
        for b, when in enumerate(history.made):
            i = bisect.bisect_right(at, when) - 1
            if i >= 0:
                made[i].append((history.address[b], history.size[b]))
        known = _attributed(made, noted.fresh, history.segments)
        if not known:
            made = [[] for _ in noted.marks]
    ends = noted.ends if known and len(noted.ends) == len(noted.marks) else [None] * len(made)
    return [OpAccess(m.nodes, tuple(reads), tuple(writes + made[i]), name, ends[i])
            for i, (m, (name, reads, writes)) in enumerate(
                zip(noted.marks, noted.accesses, strict=True))]


def _attributed(made: Sequence[Sequence[tuple[int, int]]], fresh: Sequence[Sequence[int]],
                segments: Sequence[tuple[int, int]]) -> bool:
    """Whether each operation's fresh results that lie in the pool's ``segments`` begin
    blocks ``made`` gives that operation."""
    if len(fresh) != len(made):
        return False
    for blocks, starts in zip(made, fresh, strict=True):
        own = {address for address, _ in blocks}
        for start in starts:
            if start not in own and any(lo <= start < lo + n for lo, n in segments):
                return False
    return True


@contextlib.contextmanager
def _history(found: list, pool: Any) -> Iterator[None]:
    """Record the caching allocator's history while the block runs and append, on leaving,
    its trace and graph pool ``pool``'s segments (which ``capture`` reads, with its markers,
    into a ``grape.passes.places.History``), or None where the process records that history
    itself (``torch.cuda.memory._record_memory_history``: recording here would clear it; told
    where this PyTorch says, ``torch._C._cuda_isHistoryEnabled``)."""
    on = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    if on is not None and on():
        found.append(None)
        yield
        return
    torch.cuda.memory._record_memory_history(context=None, stacks="python", clear_history=True)
    try:
        yield
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()
    segments = [s for s in snapshot["segments"] if s["device"] == device]
    trace = snapshot["device_traces"][device]
    found.append((trace, [(s["address"], s["total_size"]) for s in segments
                          if tuple(s["segment_pool_id"]) == tuple(pool)], segments))


def capture(fn: Callable[..., Any], *args: Any, params: Mapping[str, torch.Tensor] | None = None,
            pool: Any = None, warmup: int = 1, instantiate: bool = True,
            collect: bool = True, staging: Any = None, tag: str = "",
            blocks: Iterable[tuple[int, int]] | bool = False, marks: bool = False,
            accesses: bool = False) -> TorchCapture:
    """Capture ``fn(*args)`` into a CUDA graph and read it into the IR.

    Tensors in ``args`` become input placeholders, ``params`` (for instance
    ``dict(model.named_parameters())``) parameters, and what ``fn`` returns outputs. Without
    ``instantiate`` PyTorch's graph is only captured (``replay`` would instantiate it first):
    for callers that build their own executables from the IR. ``collect`` empties
    the allocator's cache first, so that ``pool_bytes`` is the capture's alone; families,
    capturing many shapes into one pool, skip it (it dominated their capture time). Python's
    garbage is collected before every capture and not during it (``collector_paused``), so
    that a shape's memory layout repeats, in this process and in others: wrap many captures in
    ``frozen_heap`` to keep that cheap.
    ``staging`` (a ``grape.torch.staging.HostConstants``) is active while ``fn`` is captured:
    copies of host constants to the device are staged through pinned memory instead of
    breaking the capture. ``tag`` prefixes the input and output buffers' names
    (``{tag}input0``), for captures whose graphs share one buffer table (``grape.graphed``).
    ``blocks``: live blocks (``live_blocks``; True: found after the warm-up) that become
    buffers of their own rather than parts of their allocator segments, for graphs saved and
    moved to another process: the caller's state (a cache, a static output) is then matched
    tensor by tensor there, where the allocator laid the same tensors out differently within
    its segments. ``marks``: mark where each operation starts (``TorchCapture.marks``) and
    record the allocator's acts in the graph's pool during the capture (``.history``), for
    ``grape.passes.places``. ``accesses`` (implies ``marks``): note what each operation read
    and wrote (``.accesses``), for ``grape.passes.concurrency``.

    Raises
    ------
    CaptureError
        ``fn`` did something that cannot be captured; the message names the operation and
        the line of the caller's code that issued it.
    """
    buffers = BufferMap()
    _name(buffers, "param:", (params or {}).items(), BufferRole.PARAMETER)
    _name(buffers, f"{tag}input", ((str(i), t) for i, t in enumerate(_tensors(args))),
          BufferRole.INPUT)
    side = capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # lazy initialisation (cuBLAS handles, autotuning) stays out
        for _ in range(warmup):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    # The GEMMs' workspace where a later clear of cuBLAS's workspaces (torch.compile's CUDA
    # graphs make one) cannot free it from under the executable (grape.torch.workspace).
    # Seated before the blocks are listed, so that it is always one of them: a family saved
    # in a process whose first capture seated it and loaded in one that had seated it before
    # must name it alike to pair it (grape.passes.relocate).
    seat_workspace(side)
    # torch.cuda.graph empties the allocator's cache on entry; do it first so that the pool's
    # growth is all that the difference below measures.
    torch.cuda.synchronize()
    full_collection()  # always: see collector_paused (cheap under frozen_heap)
    if collect:
        torch.cuda.empty_cache()
    if blocks is True:
        blocks = live_blocks(pool)
    blocks = list(blocks or ())
    for address, size in blocks:
        buffers.block(address, size)
    reserved = torch.cuda.memory_reserved()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    noted = _Marks(side.cuda_stream, side.device, accesses) if marks or accesses else None
    recorded: list = []  # with marks: the allocator's history of the capture (_history)
    if noted is not None and pool is None:
        pool = torch.cuda.graph_pool_handle()  # named here, to find its blocks in the history
    failure = None
    try:
        # Captured on the stream it warmed up on: cuBLAS allocates a workspace for each
        # stream on first use, and one allocated inside the capture lands in the graph's pool.
        # A process's first capture made 1261 allocator events where later captures of the
        # same shape made 1251 (H200). Since this (and, in the same commit, relocation keeping
        # members' own loose words), a family reloaded in the process that saved it moves
        # every shape (tests/test_gpu_family.py); which of the two it needed was not told apart.
        marking = noted is not None
        with (_history(recorded, pool) if marking else contextlib.nullcontext()), \
                collector_paused(), graph(g, pool=pool, stream=side), \
                (staging or contextlib.nullcontext()), \
                (noted if marking else contextlib.nullcontext()):
            outputs = fn(*args)  # graph() remembers the pool, for IF nodes in ``fn``
    except Exception as e:
        failure = _failure(e)
    if failure is not None:
        # Raised outside the handler, so that nothing keeps the failed capture's frames, and
        # with them its tensors, alive in the pool: the error carries only its message. The
        # broken exception's traceback cycles through context managers' frames, which only the
        # collector frees: collect, so the pool's memory goes back now, not at some later GC.
        del g
        gc.collect()
        raise CaptureError(failure)
    if instantiate:
        g.instantiate()
    pool_bytes = torch.cuda.memory_reserved() - reserved
    _name(buffers, f"{tag}output", ((str(i), t) for i, t in enumerate(_tensors(outputs))),
          BufferRole.OUTPUT)
    history, allocations = None, None
    if recorded and recorded[0] is not None:
        trace, segments, every_segment = recorded[0]
        history = History.of_trace(trace, segments, [m.marker for m in noted.marks])
        allocations = _allocations(trace, every_segment)
    return TorchCapture(Graph.borrowed(g.raw_cuda_graph(), buffers), g, outputs, pool_bytes,
                        blocks, noted.marks if noted is not None else [], history,
                        _op_accesses(noted, history) if accesses else [],
                        allocations if accesses else None)


def functions_run(fn: Callable[[], Any], pool: Any = None) -> dict[str, set[str]]:
    """The kernel functions ``fn()`` launches, by mangled name (``grape.cuda.walk.
    kernel_functions``), from a capture of it that is never read into the IR nor kept: what a
    warm start needs to pair a function another process saved with this process's, at a
    fraction of a capture's cost (the walk into the IR is most of it). ``fn`` runs once
    eagerly first, on the stream of every grape capture, as :func:`capture` warms up: a
    library loads the module of a kernel it picks for a size then, outside the capture.
    ``pool``: the memory pool the capture's temporaries come from (a family's).

    Raises
    ------
    CaptureError
        ``fn`` did something that cannot be captured.
    """
    side = capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    seat_workspace(side)  # as capture does: the same kernels, and the same workspace
    g = torch.cuda.CUDAGraph(keep_graph=True)
    failure = None
    try:
        with collector_paused(), graph(g, pool=pool, stream=side):
            fn()
    except Exception as e:
        failure = _failure(e)
    if failure is not None:
        del g
        gc.collect()  # as capture does: the failed capture's frames hold pool memory
        raise CaptureError(failure)
    try:
        return kernel_functions(g.raw_cuda_graph())
    finally:
        del g
