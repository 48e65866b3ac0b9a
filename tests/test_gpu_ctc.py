"""grape.torch.ctc on a real GPU: PyTorch's CTC values and gradients, the same bits every run,
and a capture with the lengths on the device."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="torch is not installed")


@pytest.fixture(scope="module")
def problem():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    g = torch.Generator().manual_seed(0)
    frames, batch, classes, width = 499, 8, 32, 64  # ten seconds of Wav2Vec2 frames
    logits = torch.randn(frames, batch, classes, generator=g)
    input_lengths = torch.tensor([499, 499, 400, 320, 499, 50, 499, 200])
    target_lengths = torch.tensor([64, 5, 30, 17, 1, 40, 0, 64])
    targets = torch.randint(1, classes, (batch, width), generator=g)
    return logits, targets, input_lengths, target_lengths


def _run(problem, ours: bool):
    from grape.torch.ctc import ctc_loss

    logits, targets, il, tl = (t.cuda() for t in problem)
    logits = logits.clone().requires_grad_()
    lp = logits.log_softmax(-1)
    if ours:
        loss = ctc_loss(lp, targets, il, tl, reduction="mean")
    else:
        loss = torch.nn.functional.ctc_loss(lp, targets, il.tolist(), tl.tolist(),
                                            reduction="mean")
    loss.backward()
    return loss.detach(), logits.grad


def test_values_and_gradients_are_pytorchs_and_the_same_bits_every_run(problem):
    loss, grad = _run(problem, ours=True)
    ref_loss, ref_grad = _run(problem, ours=False)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    # Sums in another order than PyTorch's (which adds with atomics): equal to float32's
    # rounding over a few hundred frames, not bitwise.
    torch.testing.assert_close(grad, ref_grad, rtol=1e-3, atol=1e-6)
    again_loss, again_grad = _run(problem, ours=True)
    assert torch.equal(again_loss, loss) and torch.equal(again_grad, grad)


def test_a_step_with_the_loss_is_captured_and_replays_other_lengths(problem):
    # Lengths are device data: a graph captured once serves other lengths and targets, which
    # PyTorch's CTC (host lengths) could not.
    from grape.torch.ctc import ctc_loss

    logits, targets, il, tl = (t.cuda() for t in problem)
    logits.requires_grad_()
    _run(problem, ours=True)  # compile and warm up outside the capture

    def step():
        logits.grad = None
        loss = ctc_loss(logits.log_softmax(-1), targets, il, tl)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        loss = step()
    il.copy_(torch.tensor([100, 200, 300, 400, 499, 60, 70, 80]))
    tl.copy_(torch.tensor([3, 4, 5, 6, 7, 8, 9, 10]))
    g.replay()
    got = loss.clone()
    eager = torch.nn.functional.ctc_loss(logits.detach().log_softmax(-1), targets, il.tolist(),
                                         tl.tolist())
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
