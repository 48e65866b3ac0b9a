"""What each operation of a capture reads and writes, as the dispatcher tells it
(grape.torch.capture._accessed, for grape.passes.concurrency), on CPU tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from grape.torch.beam import BeamDecoder  # noqa: E402
from grape.torch.capture import _accessed, _extent  # noqa: E402
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
                            ends=[1, 5, 6],  # the first operation's second node outside it
                            fresh=[[0x100], [], []])  # the result the first one made
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


def test_fresh_storages_are_the_results_an_operation_allocated():
    from grape.torch.capture import _fresh_storages

    a, b = torch.ones(2, 3), torch.ones(3, 4)
    out = torch.ops.aten.mm.default(a, b)
    assert _fresh_storages(torch.ops.aten.mm.default, (a, b), {}, out) == [
        out.untyped_storage().data_ptr()]
    values, indices = torch.ops.aten.topk.default(out, 2)
    assert _fresh_storages(torch.ops.aten.topk.default, (out, 2), {}, (values, indices)) == [
        values.untyped_storage().data_ptr(), indices.untyped_storage().data_ptr()]
    # _unsafe_view's schema marks no alias, but its result lies on its argument's storage
    flat = torch.ops.aten._unsafe_view.default(out, [8])
    assert _fresh_storages(torch.ops.aten._unsafe_view.default, (out, [8]), {}, flat) == []
    view = torch.ops.aten.view.default(out, [8])
    assert _fresh_storages(torch.ops.aten.view.default, (out, [8]), {}, view) == []
    empty = torch.ops.aten.mm.default(torch.ones(0, 3), b)
    assert _fresh_storages(torch.ops.aten.mm.default, (torch.ones(0, 3), b), {}, empty) == []


def test_temporaries_are_dropped_where_the_history_gives_a_result_to_another_operation():
    # On an H100 a marker was once matched to an operation's own small block (fixed in
    # grape.passes.places since): each later operation's blocks then went to the one before.
    # Whatever the cause, a fresh result in the pool that its operation did not make shows the
    # history's attribution is off, and nothing is taken from it.
    from types import SimpleNamespace

    from grape.passes.places import History, Mark
    from grape.torch.capture import _op_accesses

    pool = ((0x100, 0x1000),)
    history = History(address=(0x100, 0x200, 0x300), size=(256, 256, 512), made=(0, 1, 2),
                      freed=(3, 4, 5), acts=(), marks=(0, 1), segments=pool)
    accesses = [("a", [], [(0x100, 256)]), ("b", [(0x100, 256)], [(0x300, 512)])]
    right = SimpleNamespace(marks=[Mark(0, 1), Mark(1, 2)], accesses=accesses, ends=[1, 2],
                            fresh=[[0x100], [0x300]])
    ops = _op_accesses(right, history)  # a made 0x100; b made 0x200 (a temporary) and 0x300
    assert ops[1].writes == ((0x300, 512), (0x200, 256), (0x300, 512))
    assert [op.end for op in ops] == [1, 2]
    wrong = SimpleNamespace(marks=right.marks, accesses=accesses, ends=[1, 2],
                            fresh=[[0x100, 0x200], [0x300]])  # a's second result, given to b
    ops = _op_accesses(wrong, history)
    assert [op.writes for op in ops] == [((0x100, 256),), ((0x300, 512),)]
    assert [op.end for op in ops] == [None, None]
    # A result outside the pool (a generator's state, a host tensor) says nothing.
    outside = SimpleNamespace(marks=right.marks, accesses=accesses, ends=[1, 2],
                              fresh=[[0x100, 0x9000], [0x300]])
    assert [op.end for op in _op_accesses(outside, history)] == [1, 2]


# --- A real decode step reordered as the pass allows (grape.torch.reordering) ----------------


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bloom", "opt", "gptj", "falcon",
                                  "mixtral"])
@pytest.mark.parametrize("kwargs", [{}, {"do_sample": True, "top_k": 5, "top_p": 0.9},
                                    {"num_beams": 3}], ids=["greedy", "sample", "beam 3"])
@pytest.mark.parametrize("block", ["prefill", "step"])
def test_a_decode_step_reordered_as_the_dag_allows_leaves_the_same_state(arch, kwargs, block):
    """What the dispatcher says each operation of a real step touched (cache writes, masks,
    beam bookkeeping, the selected tokens) is all the ordering the step needs: replayed
    latest-ready-first, as far from the capture's order as the DAG lets it, the step (and the
    prompt's pass, the device loop's prologue) leaves every byte of the decoder's state as it
    did in capture order."""
    from grape.torch.options import resolve
    from grape.torch.reordering import check_reordering
    from tests.test_torch_generation import CONFIGS, _built, _prompt

    model = _built(arch, CONFIGS[arch])
    ids, mask = _prompt()
    options, m = resolve(model, ids, mask, dict(kwargs, max_new_tokens=6))
    decoder = (BeamDecoder if options.strategy == "beam" else TokenDecoder)(
        model, ids.shape[0], ids.shape[1], options)
    decoder.prefill(ids, m)
    decoder.step()
    found = (check_reordering(decoder.prefill, ids, m) if block == "prefill"
             else check_reordering(decoder.step))
    assert found.held, found
    assert found.moved > found.operations // 2 and found.depth < found.operations
    assert found.storages > 10  # the cache, the mask, positions, tokens, beam state


def test_an_encoder_and_a_speech_model_reordered_hold_their_results():
    """grape.graphed's workloads: BERT over a padded batch, Wav2Vec2 over raw audio
    (convolutions, group norm, positional convolution)."""
    transformers = pytest.importorskip("transformers")
    from grape.torch.reordering import check_reordering

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        vocab_size=300)).eval()
    ids = torch.randint(3, 300, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    speech = transformers.Wav2Vec2Model(transformers.Wav2Vec2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4)).eval()
    audio = torch.randn(1, 4000)
    for name, block in (("bert", lambda: bert(ids, attention_mask=mask)),
                        ("wav2vec2", lambda: speech(audio))):
        found = check_reordering(block)
        assert found.held and found.moved > found.operations // 2, (name, found)


def test_a_mutation_the_schema_does_not_declare_is_caught():
    """An operator whose schema omits that it writes its argument (a custom operator's
    mistake): moved ahead of a reader of what it writes, the replay leaves other bytes."""
    from grape.torch.reordering import check_reordering

    lib = torch.library.Library("grape_test_reordering", "FRAGMENT")
    lib.define("bump(Tensor x) -> Tensor")  # says nothing of writing x, and does

    def bump(x):
        x.add_(1)
        return x.clone()

    lib.impl("bump", bump, "CompositeExplicitAutograd")
    a = torch.zeros(4)

    def block():
        b = a * 2  # reads a before the bump writes it
        c = torch.ops.grape_test_reordering.bump(a)
        return b + c

    found = check_reordering(block)
    assert found.moved and not found.held and found.differing >= 1
    assert torch.equal(a, torch.full((4,), 1.0))  # left as the block left it: bumped once

    def honest():
        b = a * 2
        c = a.add_(1).clone()
        return b + c

    assert check_reordering(honest).held


def test_operations_of_every_kind_of_result_replay():
    # In place with no result (_foreach_add_), several results (topk), a list of fresh
    # results (_foreach_mul), views (split), an out= argument.
    from grape.torch.reordering import check_reordering

    a, b = torch.arange(6.0), torch.ones(4)
    out = torch.empty(4)

    def block():
        torch._foreach_add_([a, b], 1.0)
        values, indices = torch.topk(a, 2)
        doubled = torch._foreach_mul([a, b], 2.0)
        left, _ = torch.split(a, 3)
        torch.add(b, 1.0, out=out)
        return values + indices + doubled[0][:2] + left[:2] + out[:2]

    found = check_reordering(block)
    assert found.held and found.moved, found


def test_a_block_with_state_outside_its_tensors_is_not_judged():
    from grape.torch.reordering import check_reordering

    lib = torch.library.Library("grape_test_ticks", "FRAGMENT")
    lib.define("tick(Tensor x) -> Tensor")
    ticks = [0]

    def tick(x):  # a count kept in Python: every run returns another value
        ticks[0] += 1
        return x + ticks[0]

    lib.impl("tick", tick, "CompositeExplicitAutograd")
    found = check_reordering(lambda: torch.ops.grape_test_ticks.tick(torch.zeros(3)) * 2)
    assert not found.held and "not deterministic" in found.error, found


def test_random_operations_draw_the_same_numbers_in_every_replay():
    from grape.torch.reordering import check_reordering

    x = torch.zeros(8)

    def block():
        a = torch.rand(8)
        b = x + 1
        c = torch.randn(8)
        return a * b + c

    torch.manual_seed(3)
    block()
    next_after_one_run = torch.rand(8)
    torch.manual_seed(3)
    found = check_reordering(block)
    assert found.held and found.moved, found
    # The generator is left as one run of the block leaves it.
    assert torch.equal(torch.rand(8), next_after_one_run)


def test_a_marker_is_made_without_the_fill_deterministic_algorithms_add(monkeypatch):
    # Under torch.use_deterministic_algorithms every new tensor is filled by a kernel; a
    # capture's marker made so put a kernel before each operation of the graph, outside any
    # dispatch (H100: 145 more kernels in a small GPT-2 step, and its concurrent DAG a chain).
    from grape.torch.capture import _unfilled

    asked = []
    empty = torch.empty

    def recording(*args, **kwargs):
        asked.append(torch.utils.deterministic.fill_uninitialized_memory)
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", recording)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory
        marker = _unfilled(509, torch.device("cpu"))
        assert marker.numel() == 509 and marker.dtype == torch.uint8
        assert asked == [False]
        assert torch.utils.deterministic.fill_uninitialized_memory  # as it was
    finally:
        torch.use_deterministic_algorithms(before)
