"""Graphed training's pieces that need no GPU: the loss scaler against PyTorch's GradScaler,
the step run eagerly, and what bad input gets (grape.torch.training)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from grape.errors import GrapeError  # noqa: E402
from grape.torch.training import GraphedTraining, LossScaler, pad_batch  # noqa: E402


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batches(steps=12, overflow=(3, 7)):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(steps):
        x = torch.randn(5, 4, generator=g)
        if i in overflow:
            x[0, 0] = float("inf")  # the loss, and so every gradient, overflows
        out.append((x, torch.randn(5, 1, generator=g)))
    return out


def _scaled_step(model, opt, scaler, loss):
    """The mixed-precision recipe, clipping included, with either scaler."""
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=False)


def test_the_loss_scaler_scales_skips_and_grows_bitwise_as_grad_scaler_does():
    ours, theirs = _model(), _model()
    opt_a = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    a = LossScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    b = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    scales = []
    for x, y in _batches():
        for model, opt, scaler in ((ours, opt_a, a), (theirs, opt_b, b)):
            _scaled_step(model, opt, scaler, torch.nn.functional.mse_loss(model(x), y))
        assert a.get_scale() == b.get_scale()
        scales.append(a.get_scale())
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(p, q)
    # Both overflows halved the scale and skipped their step; three clean steps doubled it.
    assert scales[3] == scales[2] / 2 and scales[7] == scales[6] / 2
    assert max(scales) > 2.0 ** 10
    assert all(torch.isfinite(p).all() for p in ours.parameters())


def test_the_loss_scaler_refuses_bad_settings_and_a_second_unscale():
    with pytest.raises(GrapeError, match="expected growth_factor > 1"):
        LossScaler("cpu", growth_factor=1.0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = LossScaler("cpu")
    s.scale(model(torch.ones(1, 4)).sum()).backward()
    s.unscale_(opt)
    with pytest.raises(GrapeError, match="expected unscale_ once per step"):
        s.unscale_(opt)


def _sequence_loss(model, inputs, targets):
    # A model over (batch, length, 4): the mean over the length, whatever it is.
    return torch.nn.functional.mse_loss(model(inputs).mean(1), targets)


def _trainer(model, **kw):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return GraphedTraining(model, _sequence_loss, opt, lengths=[6, 4, 2], input_shape=(3, 6, 4),
                           target_shape=(3, 1), target_dtype=torch.float32, graphs=False, **kw)


def test_the_step_run_eagerly_trains_as_a_plain_loop_does():
    model, reference = _model(), _model()
    trainer = _trainer(model, scaler=LossScaler("cpu", init_scale=8.0), clip_norm=1.0)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    g = torch.Generator().manual_seed(2)
    for length in (6, 2, 4, 6, 2):
        x, y = torch.randn(3, length, 4, generator=g), torch.randn(3, 1, generator=g)
        loss = trainer(x, y)
        expected = _sequence_loss(reference, x, y)
        _scaled_step(reference, opt, scaler, expected)
        assert torch.equal(loss, expected.detach())
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    assert trainer.stats.steps == 5 and trainer.stats.eager_steps == 5


def test_a_batch_longer_than_the_family_runs_eagerly_with_one_warning():
    trainer = _trainer(_model())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            trainer(torch.ones(3, 9, 4), torch.ones(3, 1))
    assert [str(w.message) for w in caught] == [
        "a batch of length 9 is longer than the family's largest (6): it runs eagerly, on its "
        "own tensors"]
    assert trainer.stats.eager_steps == 2 and trainer.inputs.shape == (3, 6, 4)


def test_bad_input_is_refused_with_what_was_expected():
    model = _model()
    trainer = _trainer(model)
    with pytest.raises(GrapeError, match=r"expected inputs of shape \(3, length, 4\), found "
                                         r"\(2, 6, 4\)"):
        trainer(torch.ones(2, 6, 4), torch.ones(3, 1))
    with pytest.raises(GrapeError, match=r"expected targets of shape \(3, 1\) \(pad them\)"):
        trainer(torch.ones(3, 6, 4), torch.ones(3, 2))
    with pytest.raises(GrapeError, match="expected inputs of torch.float32 and targets of "
                                         "torch.float32, found torch.float64"):
        trainer(torch.ones(3, 6, 4, dtype=torch.float64), torch.ones(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(GrapeError, match="expected a model on a CUDA device to graph"):
        GraphedTraining(model, _sequence_loss, opt, [6], (3, 6, 4), (3, 1))
    with pytest.raises(GrapeError, match="the largest equal to input_shape\\[1\\] \\(6\\)"):
        GraphedTraining(model, _sequence_loss, opt, [5], (3, 6, 4), (3, 1), graphs=False)
    with pytest.raises(GrapeError, match="expected a LossScaler with fp16 autocast"):
        GraphedTraining(model, _sequence_loss, opt, [6], (3, 6, 4), (3, 1), graphs=False,
                        amp=torch.float16)
    with pytest.raises(GrapeError, match="expected inputs_by 'copy' or 'alias', found 'move'"):
        GraphedTraining(model, _sequence_loss, opt, [6], (3, 6, 4), (3, 1), graphs=False,
                        inputs_by="move")
    with pytest.raises(GrapeError, match="learning rate is a tensor"):
        GraphedTraining(model, _sequence_loss, opt, [6], (3, 6, 4), (3, 1), graphs=False,
                        schedule=lambda step: step)


def test_pad_batch_pads_and_never_truncates():
    out = pad_batch([torch.ones(2), torch.ones(4)], 5)
    assert out.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]
    with pytest.raises(GrapeError, match="expected samples of at most 3 along their first "
                                         "dimension, found one of 4"):
        pad_batch([torch.ones(4)], 3)


def test_a_trainer_is_ready_to_capture_only_once_the_optimizer_has_stepped():
    # The first step overflows (an inf in the batch): the scaler skips it, the optimizer creates
    # no state, and a capture now would hold that creation. The next, clean step makes it.
    model = _model()
    trainer = _trainer(model, scaler=LossScaler("cpu", init_scale=8.0))
    x = torch.ones(3, 6, 4)
    x[0, 0, 0] = float("inf")
    trainer(x, torch.ones(3, 1))
    assert not trainer.ready_to_capture and not trainer.optimizer.state
    assert trainer.stats.optimizer_steps == 0 and trainer.stats.steps == 1
    trainer(torch.ones(3, 4, 4), torch.ones(3, 1))
    assert trainer.ready_to_capture and trainer.stats.optimizer_steps == 1
    assert len(trainer.optimizer.state) == len(list(model.parameters()))
