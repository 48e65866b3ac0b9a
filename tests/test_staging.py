"""grape.torch.staging off the GPU: which host-to-device copies a capture would see staged.

The meta device stands in for the GPU (a device whose tensors are not on the host); the copy a
capture would record is a recorder here. What is checked: every way a forward moves host values
to the device goes through the stage (including the two that PyTorch performs below its
dispatcher), with the staged bytes kept, and nothing else does.
"""

from __future__ import annotations

import traceback

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from grape.errors import UnsupportedError  # noqa: E402
from grape.torch.staging import HostConstants, PinnedArena  # noqa: E402


class Recorder:
    def __init__(self) -> None:
        self.copies: list[int] = []

    def __call__(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.copies.append(nbytes)


@pytest.fixture
def staging():
    recorder = Recorder()
    return HostConstants(PinnedArena(1024, pin=False), "meta", copy=recorder), recorder


def test_torch_tensor_on_the_device_is_staged_with_its_value(staging):
    stage, recorder = staging
    with stage:
        t = torch.tensor(0.0, device="meta", dtype=torch.float16)
        u = torch.tensor([1, 2, 3], device=torch.device("meta"))
    assert (t.device.type, t.dtype, t.shape) == ("meta", torch.float16, ())
    assert (u.device.type, u.dtype, u.shape) == ("meta", torch.int64, (3,))
    assert recorder.copies == [2, 24]
    assert stage.values == [torch.tensor(0.0, dtype=torch.float16).numpy().tobytes(),
                            torch.tensor([1, 2, 3]).numpy().tobytes()]


def test_as_tensor_and_asarray_are_staged(staging):
    stage, recorder = staging
    with stage:
        a = torch.as_tensor([1.5, 2.5], dtype=torch.float32, device="meta")
        b = torch.asarray([7], device="meta")
    assert a.device.type == b.device.type == "meta"
    assert recorder.copies == [8, 8]


def test_a_list_used_as_an_index_is_staged_as_an_index_tensor(staging):
    stage, recorder = staging
    x = torch.empty(2, 5, 4, device="meta")
    with stage:
        y = x[..., [-2], :]
        z = x[[0, 1]]
        x[:, [0, 2]] = 1.0
    assert y.shape == (2, 1, 4) and z.shape == (2, 5, 4)
    assert recorder.copies == [8, 16, 16]
    assert stage.values[0] == torch.tensor([-2]).numpy().tobytes()


def test_moves_and_mixed_ops_are_staged_and_device_work_is_not(staging):
    stage, recorder = staging
    x = torch.empty(4, device="meta")
    host = torch.arange(4.0)
    with stage:
        host.to("meta")
        x.copy_(host)
        torch.ones(3, device="meta") + torch.arange(3, device="meta")
        torch.tensor([1.0, 2.0])  # stays on the host
        x * 2.0
        x[1:3]
        torch.where(x > 0, x, torch.tensor(0.0))  # a 0-dim host tensor is a kernel's scalar
    assert recorder.copies == [16, 16]


def test_a_host_scalar_written_through_an_index_is_staged(staging):
    # x[index] = 1 on a CUDA tensor hands index_put_ the 1 as a host scalar tensor, which it
    # copies to the device itself (Speech2Text's encoder mask fell back on the H200 there); on
    # the meta device PyTorch makes the value on meta, so the call is made as CUDA's is.
    stage, recorder = staging
    x = torch.zeros(2, 5, device="meta")
    rows = torch.arange(2, device="meta")
    with stage:
        x.index_put_((rows, rows), torch.tensor(1.0))
        x.index_put_((rows, rows), torch.ones(2, device="meta"))  # on the device: not staged
    assert recorder.copies == [4] and stage.values == [torch.tensor(1.0).numpy().tobytes()]


def test_a_host_number_written_through_one_mask_is_left_to_pytorch_s_masked_fill(staging):
    # x[mask] = 0 on a CUDA tensor: PyTorch runs masked_fill_ with the number as a kernel's
    # argument, copying nothing. Staged, the value would sit on the device and the write
    # would read the mask's count back (Gemma 3's capture broke there on an H100).
    stage, recorder = staging
    x = torch.zeros(2, 5, device="meta")
    mask = torch.zeros(2, 5, dtype=torch.bool, device="meta")
    rows = torch.arange(2, device="meta")
    with stage:
        x.index_put_((mask,), torch.tensor(0.0))
        x.index_put_((mask[:, 0],), torch.tensor(0.0))  # over the leading dimension
        torch.ops.aten.index_put_(x, [None, mask[0]], torch.tensor(0.0))  # after a full slice
        x.index_put(indices=(mask,), values=torch.tensor(2.0))  # out of place, by name
        assert recorder.copies == [] and stage.values == []
        # What PyTorch does not make a masked_fill_ copies the value: staged.
        x.index_put_((mask,), torch.tensor(1.0), accumulate=True)
        x.index_put_((mask[:, 0], rows), torch.tensor(3.0))  # a mask beside positions
    assert recorder.copies == [4, 4]


def test_the_stage_can_be_entered_again_and_keeps_its_values(staging):
    stage, recorder = staging
    for _ in range(2):
        with stage:
            torch.tensor([3], device="meta")
    assert len(stage.values) == 2 and stage.values[0] == stage.values[1]
    torch.tensor([3], device="meta")  # outside: not staged
    assert len(recorder.copies) == 2


def test_an_arena_too_small_for_the_step_says_so():
    stage = HostConstants(PinnedArena(16, pin=False), "meta", copy=Recorder())
    with pytest.raises(UnsupportedError, match="at most 16 bytes per step, found more"), stage:
        torch.tensor(list(range(4)), device="meta")
        torch.tensor(list(range(4)), device="meta")


def test_a_failure_inside_the_staging_modes_names_the_line_that_issued_the_operation():
    # The modes pass every operation through; a capture's error used to name their line
    # (staging.py) as the culprit, which tells the user nothing (benchmarks/arch_sweep.py).
    from grape.torch.capture import culprit

    stage = HostConstants(PinnedArena(16, pin=False), "meta", copy=Recorder())
    x = torch.zeros(4, device="meta")
    with stage, pytest.raises(RuntimeError) as info:
        x.view(3)  # fails inside the modes' dispatch
    assert "staging.py" in "".join(traceback.format_tb(info.value.__traceback__))
    place = culprit(info.value)
    assert place.startswith(f"{__file__}:") and "x.view(3)" in place


def test_a_call_that_fails_after_staging_changed_it_says_so_beside_the_model_s_line():
    # A capture's error names the model's line; where staging had put that call's host
    # tensors on the device, the call that failed is not the one the model made, and the
    # error says so (staging's part in Gemma 3's broken capture went unseen for a session).
    from grape.torch.capture import _failure

    stage = HostConstants(PinnedArena(256, pin=False), "meta", copy=Recorder())
    a = torch.zeros(2, 3, device="meta")
    with stage, pytest.raises(RuntimeError) as staged:
        torch.mm(a, torch.zeros(4, 5))  # the host tensor staged, then the shapes refused
    with stage, pytest.raises(RuntimeError) as untouched:
        a.view(4)  # nothing staged: nothing said
    assert staged.value.__notes__ == [
        "grape.torch.staging had put the host tensors given to mm.default on the device"]
    assert not hasattr(untouched.value, "__notes__")
    message = _failure(staged.value)
    assert message.startswith("expected work that can be captured, found ")
    assert f"issued at {__file__}:" in message and "torch.mm(a, torch.zeros(4, 5))" in message
    assert message.endswith("(grape.torch.staging had put the host tensors given to mm.default "
                            "on the device)")
    assert "(grape.torch.staging" not in _failure(untouched.value)


def test_a_capture_that_ran_out_of_memory_says_so_and_not_that_it_synchronised():
    # A 12-process sweep on an 80 GB H100 ran Zamba2's capture out of memory, and the
    # fallback blamed "an operation that synchronises with the host": a conditional's body,
    # captured inside the step, had failed and said why, and the step's capture wrapped that
    # message (which names "capture") a second time, as a sync.
    from grape.errors import CaptureError
    from grape.torch.capture import _failure

    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 384.00 MiB")
    except torch.OutOfMemoryError as e:
        inner = _failure(e)
    assert inner.startswith("expected work that can be captured, found the device out of "
                            "memory (CUDA out of memory. Tried to allocate 384.00 MiB) issued at ")
    assert "synchronises" not in inner
    try:
        try:
            raise CaptureError(inner)
        except CaptureError:  # chained implicitly, as capture_end's error is
            raise RuntimeError("failed due to a previous error during capture")  # noqa: B904
    except RuntimeError as outer:  # the enclosing capture's end, broken by the inner failure
        assert _failure(outer) == inner
    assert _failure(CaptureError(inner)) == inner
