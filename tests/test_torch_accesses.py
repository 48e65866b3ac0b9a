"""What each operation of a capture reads and writes, as the dispatcher tells it
(grape.torch.capture._accessed, for grape.passes.concurrency), on CPU tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from grape.torch.beam import BeamDecoder  # noqa: E402
from grape.torch.capture import _accessed, _extent, _tensors  # noqa: E402
from grape.torch.decoding import TokenDecoder  # noqa: E402


def _span(t):
    return t.data_ptr(), t.numel() * t.element_size()


def _run(func, *args, **kwargs):
    out = func(*args, **kwargs)
    return _accessed(func, args, kwargs, out), out


def test_an_in_place_operation_writes_its_first_argument_and_reads_the_second():
    a, b = torch.zeros(4, 8), torch.ones(4, 8)
    (name, reads, writes), _ = _run(torch.ops.aten.add_.Tensor, a, b)
    assert name == "aten.add_.Tensor"
    assert reads == [_span(b)] and writes == [_span(a)]


def test_a_fresh_result_is_written_and_a_view_is_not():
    a, b = torch.zeros(3, 4), torch.ones(5, 4)
    (_, reads, writes), out = _run(torch.ops.aten.cat.default, [a, b])
    assert reads == [_span(a), _span(b)] and writes == [_span(out)]
    (_, reads, writes), _ = _run(torch.ops.aten.view.default, a, [12])
    assert reads == [_span(a)] and writes == []
    (_, reads, writes), _ = _run(torch.ops.aten.split.Tensor, b, 2)
    assert reads == [_span(b)] and writes == []


def test_an_out_argument_is_written():
    a, b, out = torch.ones(2, 3), torch.ones(3, 4), torch.empty(2, 4)
    (_, reads, writes), _ = _run(torch.ops.aten.mm.out, a, b, out=out)
    assert reads == [_span(a), _span(b)] and writes == [_span(out)]


def test_several_results_are_each_written():
    x = torch.randn(4, 6)
    (_, reads, writes), (values, indices) = _run(torch.ops.aten.topk.default, x, 2)
    assert reads == [_span(x)] and writes == [_span(values), _span(indices)]


def test_a_views_extent_is_the_bytes_its_elements_span():
    base = torch.zeros(8, 16)
    column = base[2:6, 3]  # four floats, 16 apart, from row 2
    assert _extent(column) == (base.data_ptr() + (2 * 16 + 3) * 4, (3 * 16 + 1) * 4)
    assert _extent(base.t()) == _span(base)
    assert _extent(base[:0]) is None


def test_the_allocators_view_holds_every_block_a_tensor_held_during_the_capture():
    from grape.torch.capture import _allocations

    trace = [{"action": "alloc", "addr": 0x1000, "size": 512},
             {"action": "free_requested", "addr": 0x3000, "size": 1024},  # alive at the start
             {"action": "free_completed", "addr": 0x3000, "size": 1024},
             {"action": "segment_alloc", "addr": 0x8000, "size": 4096}]
    segments = [{"address": 0x1000, "total_size": 0x4000,
                 "blocks": [{"size": 512, "state": "inactive"},
                            {"size": 0x1000 - 512, "state": "active_allocated"},
                            {"size": 0x3000, "state": "inactive"}]}]
    seen = _allocations(trace, segments)
    assert seen.segments == ((0x1000, 0x4000),)
    assert seen.held == ((0x1000, 512), (0x1200, 0x1000 - 512), (0x3000, 1024))


def test_a_foreach_operation_writes_every_tensor_of_its_list():
    a, b = torch.zeros(3), torch.zeros(5)
    (_, reads, writes), _ = _run(torch.ops.aten._foreach_add_.Scalar, [a, b], 1.0)
    assert reads == [] and writes == [_span(a), _span(b)]
    (_, reads, writes), out = _run(torch.ops.aten._foreach_mul.Scalar, [a, b], 2.0)
    assert reads == [_span(a), _span(b)] and writes == [_span(t) for t in out]


def test_temporaries_are_written_by_the_operation_that_made_them():
    # Three operations, marked at acts 0, 2 and 3 of the allocator's history: blocks made at
    # acts 0 and 1 belong to the first, at act 2 to the second, none to the third.
    from types import SimpleNamespace

    from grape.passes.places import History, Mark
    from grape.torch.capture import _op_accesses

    history = History(address=(0x100, 0x200, 0x300), size=(512, 512, 1024), made=(0, 1, 2),
                      freed=(1, 3, 4), acts=(), marks=(0, 2, 3))
    noted = SimpleNamespace(marks=[Mark(0, 1), Mark(2, 2), Mark(5, 3)],
                            accesses=[("a", [(0x900, 8)], [(0x100, 512)]), ("b", [], []),
                                      ("c", [(0x300, 4)], [])],
                            ends=[1, 5, 6])  # the first operation's second node outside it
    ops = _op_accesses(noted, history)
    assert [op.start for op in ops] == [0, 2, 5]
    assert ops[0].writes == ((0x100, 512), (0x100, 512), (0x200, 512))
    assert ops[1].writes == ((0x300, 1024),) and ops[2].writes == ()
    assert ops[0].reads == ((0x900, 8),) and ops[2].name == "c"
    assert [op.end for op in ops] == [1, 5, 6]
    # A history whose markers do not match the marks adds no temporaries (the pass then widens
    # what the kernels point at by the allocator's blocks instead).
    short = History(address=(0x100,), size=(512,), made=(0,), freed=(1,), acts=(), marks=(0,))
    assert all(op.writes == tuple(w) for op, (_, _, w) in zip(_op_accesses(noted, short),
                                                             noted.accesses, strict=True))
    # Nor does it say where dispatches ended: without the temporaries, a stale word inside
    # one cannot be told from a temporary the history would have named.
    assert all(op.end is None for op in _op_accesses(noted, short))


# --- A real decode step reordered as the pass allows --------------------------------------------


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage's bytes, as a tensor over the same memory."""
    return torch.tensor(storage, dtype=torch.uint8)


class _Recorded(TorchDispatchMode):
    """Every operation of a block with its arguments, its result and what ``_accessed`` says
    it touched; the state each storage the block found already made had before the block
    first touched it, and the storages the block made. Holding every tensor keeps the
    allocator from reusing memory, so that the block can be replayed over its own storages."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.before: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}
        self.made: dict[int, torch.UntypedStorage] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _tensors((args, kwargs)):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self.made and key not in self.before and storage.nbytes():
                self.before[key] = storage, _bytes(storage).clone()
        out = func(*args, **kwargs)
        for t in _tensors(out):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.before:
                self.made[storage.data_ptr()] = storage
        self.ops.append((func, args, kwargs, out, _accessed(func, args, kwargs, out)))
        return out

    def state(self) -> list[torch.Tensor]:
        """The bytes, now, of every storage the block found made."""
        return [_bytes(s).clone() for s, _ in self.before.values()]

    def restore(self) -> None:
        """The state the block found, and every storage it made filled with 0xff bytes (NaN,
        -1): an operation run before the one that writes what it reads reads those."""
        for storage, saved in self.before.values():
            _bytes(storage).copy_(saved)
        for storage in self.made.values():
            _bytes(storage).fill_(0xFF)

    def replay(self, order) -> None:
        """Each operation again, in ``order``, its fresh results copied over the recorded ones
        (which later operations read)."""
        for i in order:
            func, args, kwargs, out, _ = self.ops[i]
            again = func(*args, **kwargs)
            schema = func._schema
            olds, news = ((out,), (again,)) if len(schema.returns) == 1 else (out, again)
            for r, old, new in zip(schema.returns, olds, news, strict=True):
                if r.alias_info is None:  # fresh; an alias is a view over memory written above
                    for o, n in zip(_tensors(old), _tensors(new), strict=True):
                        o.copy_(n)


def _dag(recorded: _Recorded):
    """The pass's DAG over the recorded operations, one node each."""
    from grape.ir import Kernel, KernelGraph
    from grape.passes.concurrency import OpAccess, concurrent

    graph, last, ops = KernelGraph(), [], []
    for i, (*_, (name, reads, writes)) in enumerate(recorded.ops):
        ops.append(OpAccess(i, tuple(reads), tuple(writes), name))
        last = [graph.add(str(i), Kernel(name, name, (1, 1, 1), (1, 1, 1)), after=last)]
    return concurrent(graph, ops)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bloom", "opt", "gptj", "falcon",
                                  "mixtral"])
@pytest.mark.parametrize("kwargs", [{}, {"num_beams": 3}], ids=["greedy", "beam 3"])
def test_a_decode_step_reordered_as_the_dag_allows_leaves_the_same_state(arch, kwargs):
    """What the dispatcher says each operation of a real step touched (cache writes, masks,
    beam bookkeeping, the selected tokens) is all the ordering the step needs: replayed
    latest-ready-first, as far from the capture's order as the DAG lets it, the step leaves
    every byte of the decoder's state as it did in capture order."""
    import networkx as nx

    from grape.torch.options import resolve
    from tests.test_torch_generation import CONFIGS, _built, _prompt

    model = _built(arch, CONFIGS[arch])
    ids, mask = _prompt()
    options, m = resolve(model, ids, mask, dict(kwargs, max_new_tokens=6))
    decoder = (BeamDecoder if options.strategy == "beam" else TokenDecoder)(
        model, ids.shape[0], ids.shape[1], options)
    decoder.prefill(ids, m)
    decoder.step()
    recorded = _Recorded()
    with torch.no_grad(), recorded:
        decoder.step()
    after = recorded.state()
    dag = _dag(recorded).graph.dag
    latest = list(nx.lexicographical_topological_sort(dag, key=lambda n: -int(n)))
    assert latest != sorted(latest, key=int)  # the DAG allows another order
    moved = sum(a != b for a, b in zip(latest, sorted(latest, key=int), strict=True))
    with torch.no_grad():
        for order in (range(len(recorded.ops)), [int(n) for n in latest]):
            recorded.restore()
            try:
                recorded.replay(order)
            except (RuntimeError, IndexError) as e:  # read what no operation had written yet
                pytest.fail(f"{arch}: replaying in the DAG's order failed: {e}")
            state = recorded.state()
            assert len(state) == len(after) and all(
                torch.equal(a, b) for a, b in zip(state, after, strict=True)), (
                f"{arch}: {sum(not torch.equal(a, b) for a, b in zip(state, after, strict=True))}"
                f" storages differ after replaying {len(recorded.ops)} operations, {moved} moved")
