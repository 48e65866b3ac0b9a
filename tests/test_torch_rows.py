"""grape.torch.rows: a cache's rows reordered in place, its tensors stacked (on the CPU, where
torch is installed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from grape.torch.rows import RowReorder, state_tensors  # noqa: E402

ROWS = 5
ORDER = torch.tensor([1, 1, 0, 4, 2])


def _layer(heads=2, tokens=6, dim=4, dtype=torch.float32):
    return SimpleNamespace(keys=torch.randn(ROWS, heads, tokens, dim, dtype=dtype),
                           values=torch.randn(ROWS, heads, tokens, dim, dtype=dtype),
                           cumulative_length=torch.tensor([3]))


def _token_major(heads=2, tokens=6, dim=4):
    """A layer keeping (rows, tokens, heads, dim) buffers and (rows, heads, tokens, dim) views
    of them, as grape.torch.exact.TokenMajorLayer does."""
    layer = SimpleNamespace(key_buffer=torch.randn(ROWS, tokens, heads, dim),
                            value_buffer=torch.randn(ROWS, tokens, heads, dim))
    layer.keys = layer.key_buffer.transpose(1, 2)
    layer.values = layer.value_buffer.transpose(1, 2)
    return layer


def _recurrent():
    return SimpleNamespace(conv_states={0: torch.randn(ROWS, 3, 4)},
                           recurrent_states={0: torch.randn(ROWS, 2, 2)})


def _snapshot(layers):
    return [t.clone() for layer in layers for t in state_tensors(layer)]


def test_every_state_tensor_moves_with_its_row_and_keeps_its_contents_and_layout():
    layers = [_layer(), _layer(), _layer(dtype=torch.float16), _token_major(), _recurrent()]
    before = _snapshot(layers)
    layouts = [(t.shape, t.stride()) for layer in layers for t in state_tensors(layer)]
    reorder = RowReorder(layers, ROWS)
    assert [(t.shape, t.stride()) for layer in layers for t in state_tensors(layer)] == layouts
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(layers), before, strict=True))
    reorder(ORDER)
    after = _snapshot(layers)
    assert all(torch.equal(a, b.index_select(0, ORDER)) for a, b in zip(after, before, strict=True))


def test_tensors_of_one_dtype_and_size_share_a_stack_and_are_gathered_together():
    layers = [_layer(), _layer(), _layer(dtype=torch.float16), _recurrent()]
    reorder = RowReorder(layers, ROWS)
    # float32 keys and values (4 tensors), float16 (2), the two recurrent sizes (1 each)
    assert sorted(stack.shape[0] for stack in reorder.stacks) == [1, 1, 2, 4]
    assert reorder.loose == []
    four = next(stack for stack in reorder.stacks if stack.shape[0] == 4)
    assert {t.untyped_storage().data_ptr() for layer in layers[:2]
            for t in (layer.keys, layer.values)} == {four.untyped_storage().data_ptr()}


def test_a_view_and_the_buffer_it_views_are_moved_together():
    layer = _token_major()
    RowReorder([layer], ROWS)(ORDER)
    # the buffer and its view still share one storage, so a write to either is seen by both
    assert layer.keys.untyped_storage().data_ptr() == layer.key_buffer.untyped_storage().data_ptr()
    layer.key_buffer[0, 1, 0, 0] = 123.0
    assert layer.keys[0, 0, 1, 0] == 123.0


def test_a_tensor_that_does_not_own_its_rows_is_gathered_on_its_own():
    storage = torch.randn(2 * ROWS, 3)
    layer = SimpleNamespace(keys=storage[:ROWS], values=torch.randn(ROWS, 3))  # half a storage
    before = layer.keys.clone()
    reorder = RowReorder([layer], ROWS)
    assert [t is layer.keys for t in reorder.loose] == [True]
    reorder(ORDER)
    assert torch.equal(layer.keys, before.index_select(0, ORDER))
    assert torch.equal(storage[:ROWS], layer.keys)  # still the caller's storage


def test_stacks_are_cut_at_the_chunk_size():
    layers = [_layer() for _ in range(3)]
    nbytes = layers[0].keys.untyped_storage().nbytes()
    reorder = RowReorder(layers, ROWS, chunk_bytes=2 * nbytes)
    assert [stack.shape[0] for stack in reorder.stacks] == [2, 2, 2]
    before = _snapshot(layers)
    reorder(ORDER)
    after = _snapshot(layers)
    assert all(torch.equal(a, b.index_select(0, ORDER)) for a, b in zip(after, before, strict=True))


def test_marked_static_tensors_stay_marked():
    layer = _layer()
    torch._dynamo.mark_static_address(layer.keys)
    RowReorder([layer], ROWS)
    assert getattr(layer.keys, "_dynamo_static_input_type", None) is not None
    assert getattr(layer.values, "_dynamo_static_input_type", None) is None


@pytest.mark.parametrize("rows", [ROWS, ROWS + 1])
def test_only_tensors_with_rows_first_are_stacked(rows):
    layer = _layer()
    reorder = RowReorder([layer], rows)
    assert (len(reorder.stacks), len(reorder.loose)) == ((1, 0) if rows == ROWS else (0, 2))


def test_the_old_tensors_are_let_go_as_their_stacks_are_made():
    # A cache near the device's capacity must not need a second copy of itself: each moved
    # tensor is let go once its layer holds the new one, before the next stack is made.
    import gc
    import weakref

    layers = [_layer() for _ in range(3)]
    old = [weakref.ref(t) for layer in layers for t in (layer.keys, layer.values)]
    alive = []

    class Watched(RowReorder):
        def _stack(self, layers, chunk, rows):
            gc.collect()
            alive.append(sum(ref() is not None for ref in old))
            super()._stack(layers, chunk, rows)

    nbytes = layers[0].keys.untyped_storage().nbytes()
    Watched(layers, ROWS, chunk_bytes=nbytes)  # a stack per tensor
    gc.collect()
    assert alive == [6, 5, 4, 3, 2, 1]
    assert all(ref() is None for ref in old)


def test_views_of_part_of_each_row_move_with_their_storage():
    whole = torch.randn(ROWS, 4, 6)
    layer = SimpleNamespace(keys=whole, values=whole[:, 1:3])  # offset into each row
    before = whole.clone()
    reorder = RowReorder([layer], ROWS)
    assert len(reorder.stacks) == 1 and reorder.loose == []
    assert layer.values.untyped_storage().data_ptr() == layer.keys.untyped_storage().data_ptr()
    reorder(ORDER)  # the storage moves once, so each view's rows move once
    assert torch.equal(layer.keys, before.index_select(0, ORDER))
    assert torch.equal(layer.values, before.index_select(0, ORDER)[:, 1:3])


def test_a_storage_that_a_loose_tensor_shares_is_not_moved():
    whole = torch.randn(ROWS, 4, 6)
    # a state tensor whose rows are not the storage's ranges (the first elements of all)
    layer = SimpleNamespace(keys=whole, values=whole.view(-1)[:ROWS])
    reorder = RowReorder([layer], ROWS)
    assert reorder.stacks == [] and len(reorder.loose) == 2
    assert layer.keys is whole


def test_state_is_every_tensor_with_a_row_per_sequence_each_storage_once():
    # Dynamic sparse attention's layers keep an indexer's keys beside keys and values: per-row
    # state too. Counts are not, and a buffer the keys view is the keys' memory: listed twice,
    # a reorder done tensor by tensor (the beam decoder's, before the cache is stacked) would
    # move its rows twice.
    indexed = _layer()
    indexed.indexer_keys = torch.randn(ROWS, 6, 8)
    indexed.indexer_cumulative_length = torch.tensor(3)
    assert [id(t) for t in state_tensors(indexed)] == [
        id(indexed.keys), id(indexed.values), id(indexed.indexer_keys)]
    token_major = _token_major()
    assert [id(t) for t in state_tensors(token_major)] == [id(token_major.keys),
                                                           id(token_major.values)]
    before = token_major.key_buffer.clone()
    for state in state_tensors(token_major):
        state.copy_(state.index_select(0, ORDER))
    assert torch.equal(token_major.key_buffer, before.index_select(0, ORDER))
