"""grape.torch.capture's host-side choices that need no GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from grape.torch import capture  # noqa: E402


def test_every_capture_warms_up_on_one_stream_per_device(monkeypatch):
    # cuBLAS keeps a 33 MiB workspace for each stream it ran on until the process ends: a new
    # warm-up stream per capture held 1.1 GB under a 255-shape family on the H200.
    made, device = [], [0]
    monkeypatch.setattr(torch.cuda, "Stream", lambda: made.append(object()) or made[-1])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[0])
    monkeypatch.setattr(capture, "_CAPTURE_STREAMS", {})
    first = capture.capture_stream()
    assert all(capture.capture_stream() is first for _ in range(300))
    device[0] = 1
    second = capture.capture_stream()
    assert second is not first and capture.capture_stream() is second
    assert len(made) == 2


def test_the_collector_waits_for_the_capture_and_then_frees_what_it_left_in_cycles():
    # A collection frees the blocks of tensors that cycles hold wherever it runs; a capture's
    # layout must not depend on when (grape/torch/capture.py).
    import gc
    import weakref

    class Node:
        pass

    assert gc.isenabled()
    with capture.collector_paused():
        assert not gc.isenabled()
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle only the collector frees
        alive = weakref.ref(a)
        del a, b
        # enough new objects that an enabled collector would have run several times
        kept = [Node() for _ in range(20 * gc.get_threshold()[0])]
        assert alive() is not None
        del kept
    assert gc.isenabled() and alive() is None


def test_a_collector_the_caller_turned_off_stays_off():
    import gc

    gc.disable()
    try:
        with capture.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_frozen_heap_leaves_old_objects_out_of_collections_until_the_outermost_ends():
    import gc

    before = gc.get_freeze_count()
    with capture.frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > before
        with capture.frozen_heap():  # nested: a family inside a family's step
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen  # the inner one did not unfreeze
    assert gc.get_freeze_count() == before == 0


def test_a_full_collection_inside_a_frozen_heap_freezes_its_survivors():
    # A family keeps what it captures; collections that walked all it kept grew with every
    # shape (8.5 ms to 210 ms a capture over 400 shapes on the H200).
    import gc
    import weakref

    class Node:
        pass

    with capture.frozen_heap():
        frozen = gc.get_freeze_count()
        kept = [[] for _ in range(100)]  # a shape's IR: alive, tracked, made inside
        cycle = Node()
        cycle.me = cycle  # garbage the collection must still free
        dead = weakref.ref(cycle)
        del cycle
        capture.full_collection()
        assert dead() is None
        assert gc.get_freeze_count() >= frozen + len(kept) + 1  # the lists and their list
    assert gc.get_freeze_count() == 0
    capture.full_collection()  # outside one: nothing frozen
    assert gc.get_freeze_count() == 0


def test_a_settled_frozen_heap_ends_with_a_full_collection_of_what_it_unfroze():
    # Unfrozen objects join the oldest generation uncounted: without this the next full
    # collection comes at a family's first pass and walks the whole family
    # (benchmarks/gc_after_unfreeze.py).
    import gc

    seen = []

    def watch(phase, info):
        if phase == "stop":
            seen.append((info["generation"], gc.get_freeze_count()))

    gc.callbacks.append(watch)
    try:
        with capture.frozen_heap(settle=True):
            with capture.frozen_heap(settle=True):  # inner: settles nothing
                seen.clear()
            assert seen == []
        assert seen and seen[-1] == (2, 0)  # after unfreezing: nothing left out of it
        with capture.frozen_heap():
            seen.clear()
        assert all(generation != 2 for generation, _ in seen)  # unsettled: none at the end
    finally:
        gc.callbacks.remove(watch)


def test_a_heap_the_caller_froze_is_frozen_further_and_unfrozen_at_the_end():
    # Python cannot unfreeze some objects alone; leaving the caller's frozen heap as it was
    # made every capture pay a full collection instead.
    import gc

    gc.freeze()
    try:
        theirs = gc.get_freeze_count()
        kept = [object() for _ in range(8)]  # noqa: F841 - alive on entry, so frozen
        with capture.frozen_heap():
            assert gc.get_freeze_count() > theirs
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_a_family_captures_under_a_frozen_heap_and_unfreezes_it_even_when_capture_fails(
        monkeypatch):
    import gc

    from grape.torch import family

    seen = []

    class Stop(Exception):
        pass

    def fake_capture(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        raise Stop

    monkeypatch.setattr(family, "capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 0)
    with pytest.raises(Stop):
        family.capture_family(lambda shape: None, [3, 2, 1])
    assert seen and seen[0] > 0
    assert gc.get_freeze_count() == 0


def test_a_family_without_a_cuda_device_is_one_clear_error(monkeypatch):
    from grape.errors import GrapeError
    from grape.torch import family

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(GrapeError, match=r"^expected a CUDA device for capture_family, found "
                                         r"none \(torch.cuda.is_available\(\) is False\)$"):
        family.capture_family(lambda shape: None, [2, 1])
    with pytest.raises(GrapeError, match="expected a CUDA device for load_family"):
        family.load_family(lambda shape: None, "any.family.json.gz")


def test_work_on_another_thread_keeps_the_callers_modes_and_raises_its_errors_here():
    import threading

    here = threading.current_thread()
    with torch.no_grad():
        grad, thread = capture.on_another_thread(
            lambda: (torch.is_grad_enabled(), threading.current_thread()))
    assert grad is False and thread is not here  # another stack, the same autograd mode
    with torch.inference_mode():
        assert capture.on_another_thread(torch.is_inference_mode_enabled) is True
    assert capture.on_another_thread(torch.is_grad_enabled) is True
    with pytest.raises(ZeroDivisionError):
        capture.on_another_thread(lambda: 1 / 0)
