"""What each operation of a capture reads and writes, as the dispatcher tells it
(grape.torch.capture._accessed, for grape.passes.concurrency), on CPU tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from grape.torch.capture import _accessed, _extent  # noqa: E402


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
                                      ("c", [(0x300, 4)], [])])
    ops = _op_accesses(noted, history)
    assert [op.start for op in ops] == [0, 2, 5]
    assert ops[0].writes == ((0x100, 512), (0x100, 512), (0x200, 512))
    assert ops[1].writes == ((0x300, 1024),) and ops[2].writes == ()
    assert ops[0].reads == ((0x900, 8),) and ops[2].name == "c"
    # A history whose markers do not match the marks adds no temporaries (the pass then widens
    # what the kernels point at by the allocator's blocks instead).
    short = History(address=(0x100,), size=(512,), made=(0,), freed=(1,), acts=(), marks=(0,))
    assert all(op.writes == tuple(w) for op, (_, _, w) in zip(_op_accesses(noted, short),
                                                             noted.accesses, strict=True))
