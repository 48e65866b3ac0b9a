"""Graphed training on a real GPU: a Wav2Vec2 CTC family's steps against the same steps run
eagerly (benchmarks/training.py, in a fresh process: determinism settings take effect only
before the first GPU work), capture held back until the optimizer has state, and steps that
cannot be captured named in one warning and trained eagerly."""

from __future__ import annotations

import warnings

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")

from tests.benchrun import run_benchmark  # noqa: E402


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")


def test_twenty_graphed_training_steps_leave_the_parameters_eager_training_leaves(
        cuda, tmp_path):
    # Six audio lengths, 20 steps in a shuffled order: eager until the optimizer has stepped
    # (the loss scaler skips the first steps on overflow), then one launch each, fp16 autocast
    # with the loss scaler's skip as an IF node, clipping and the learning-rate schedule on the
    # device; parameters bitwise those of the same steps run eagerly.
    doc = run_benchmark("training.py", tmp_path, "--small", "--deterministic", "--lengths",
                        "6", "--steps", "20", "--batch", "2", "--ways",
                        "eager,grape_family,grape_family_aliased,per_shape_graphs")
    rows = {r["way"]: r for r in doc["results"]}
    warm = rows["eager"]["warmup_steps"]
    assert warm >= 1 and all(r["warmup_steps"] == warm for r in rows.values())
    for way in ("grape_family", "grape_family_aliased"):  # batches copied, or re-pointed at
        grape_row = rows[way]
        assert grape_row["fallback"] is None and grape_row["graphed_steps"] == 20 - warm, way
        assert grape_row["params_bitwise_equal_to_eager"] is True, way
        assert grape_row["params_bitwise_equal_to_per_shape_graphs"] is True, way
        assert grape_row["final_loss_scale"] == rows["eager"]["final_loss_scale"], way
        assert grape_row["final_loss"] == rows["eager"]["final_loss"], way
    assert rows["per_shape_graphs"]["params_bitwise_equal_to_eager"] is True


def test_capture_waits_for_the_optimizers_first_real_step(cuda):
    # A loss scale so large that the first steps overflow and are skipped: the optimizer has no
    # state until one goes through (SGD's momentum buffers are made from the first gradient it
    # applies), so the trainer stays eager until then; the momentum then carries over launches
    # as it does eagerly (a capture before that would hold the buffers' creation, and start
    # them afresh at every launch).
    from grape.torch.training import GraphedTraining, LossScaler

    def build(graphs):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 1)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)

        def loss_fn(m, x, y):
            return torch.nn.functional.mse_loss(m(x).mean(1), y)

        return model, GraphedTraining(
            model, loss_fn, opt, lengths=[3, 2], input_shape=(2, 3, 64), target_shape=(2, 1),
            target_dtype=torch.float32, amp=torch.float16,
            scaler=LossScaler("cuda", init_scale=2.0 ** 30), graphs=graphs)

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, (3, 2)[i % 2], 64, generator=g).cuda(),
                torch.randn(2, 1, generator=g).cuda()) for i in range(40)]
    params = {}
    for graphs in (False, True):
        model, trainer = build(graphs)
        for x, y in batches:
            trainer(x, y)
        params[graphs] = [p.detach().clone() for p in model.parameters()]
        if graphs:
            stats = trainer.stats
            assert stats.fallback is None, stats
            assert stats.eager_steps > 1 and stats.graphed_steps > 10, stats
            trainer.close()
    # Not bitwise: this process is not in deterministic mode (the benchmark test above is).
    # Momentum started afresh at every launch would move parameters by a tenth as much.
    for a, b in zip(params[False], params[True], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_step_that_draws_dropout_masks_is_graphed_with_fresh_masks_every_launch(cuda):
    # grape's launches get PyTorch's replay prologue (grape.torch.rng): the same batch, steps
    # apart, sees other dropout masks, as eager steps do.
    from grape.torch.training import GraphedTraining

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.5)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # no learning: only the masks change

    def loss_fn(m, x, y):
        return torch.nn.functional.mse_loss(m(x).mean(1), y)

    trainer = GraphedTraining(model, loss_fn, opt, lengths=[3, 2], input_shape=(2, 3, 64),
                              target_shape=(2, 64), target_dtype=torch.float32)
    x, y = torch.randn(2, 3, 64, device="cuda"), torch.randn(2, 64, device="cuda")
    trainer(x, y)
    losses = []
    for _ in range(4):
        trainer(x, y)
        losses.append(trainer.loss.item())
    assert trainer.stats.fallback is None and trainer.stats.graphed_steps == 4
    assert trainer._random is not None and trainer._random.launches == 4
    assert len(set(losses)) == 4, losses  # fresh masks: a different loss every step


def test_without_the_prologue_a_family_repeats_its_draws_and_with_it_does_not(cuda):
    from grape.torch.family import capture_family
    from grape.torch.rng import GraphRandom

    ones = torch.ones(2, 256, device="cuda")
    out = torch.zeros(2, 256, device="cuda")

    def step(n):
        out[:, :n].copy_(torch.nn.functional.dropout(ones[:, :n], 0.5))

    fam = capture_family(step, [256, 128])
    try:
        def masks(random):
            got = []
            for _ in range(3):
                if random is not None:
                    random.before_launch(torch.cuda.current_stream().cuda_stream)
                fam.run(256)
                torch.cuda.synchronize()
                got.append(out.clone())
            return got

        same = masks(None)
        assert torch.equal(same[0], same[1]) and torch.equal(same[1], same[2])
        fresh = masks(GraphRandom.probe("cuda"))
        assert not torch.equal(fresh[0], fresh[1]) and not torch.equal(fresh[1], fresh[2])
        kept = torch.stack(fresh).ne(0).float().mean().item()
        assert 0.4 < kept < 0.6  # dropout(0.5) keeps about half
    finally:
        fam.close()


class _SyncingBackward(torch.autograd.Function):
    """Identity whose backward reads a value back to the host: no capture can hold it."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if grad.abs().max().item() > 1e30:  # the host sync the warning must name
            grad = grad.clamp(-1e30, 1e30)
        return grad


def _fallback_run(make_optimizer, layer=None):
    """A small model trained eagerly and by a GraphedTraining whose capture fails: the
    warnings, the graphed trainer's stats, and both models' parameters."""
    from grape.torch.training import GraphedTraining

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, (3, 2)[i % 2], 64, generator=g).cuda(),
                torch.randn(2, 1, generator=g).cuda()) for i in range(6)]
    out = {}
    for graphs in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 1)).cuda()

        def loss_fn(m, x, y):
            h = m(x)
            return torch.nn.functional.mse_loss((layer(h) if layer else h).mean(1), y)

        trainer = GraphedTraining(model, loss_fn, make_optimizer(model), lengths=[3, 2],
                                  input_shape=(2, 3, 64), target_shape=(2, 1),
                                  target_dtype=torch.float32, graphs=graphs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in batches:
                trainer(x, y)
        out[graphs] = ([str(w.message) for w in caught], trainer.stats,
                       [p.detach().clone() for p in model.parameters()])
    return out


def _assert_fell_back(out, *expected):
    (eager_warnings, _, eager_params), (warned, stats, params) = out[False], out[True]
    ours = [w for w in warned if w.startswith("grape")]  # PyTorch may add its own
    assert not [w for w in eager_warnings if w.startswith("grape")]
    assert len(ours) == 1, warned
    assert ours[0].startswith("grape trains eagerly: the step cannot be graphed: "), ours
    assert all(e in ours[0] for e in expected), ours[0]
    assert stats.fallback is not None and stats.graphed_steps == 0 and stats.eager_steps == 6
    for a, b in zip(eager_params, params, strict=True):  # nothing the failed capture did stays
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_host_sync_in_a_custom_backward_is_named_and_training_goes_on_eagerly(cuda):
    out = _fallback_run(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                        layer=_SyncingBackward.apply)
    _assert_fell_back(out, "test_gpu_training.py", "grad.abs().max().item()")


def test_a_non_capturable_optimizer_is_named_and_training_goes_on_eagerly(cuda):
    out = _fallback_run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, capturable=False))
    _assert_fell_back(out, "capturable")
