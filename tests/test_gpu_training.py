"""Graphed training on a real GPU: a Wav2Vec2 CTC family's steps against the same steps run
eagerly (benchmarks/training.py, in a fresh process: determinism settings take effect only
before the first GPU work)."""

from __future__ import annotations

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
    # Six audio lengths, 20 steps in a shuffled order: the first eager, then one launch each,
    # fp16 autocast with the loss scaler's skip as an IF node, clipping and the learning-rate
    # schedule on the device; parameters bitwise those of the same steps run eagerly.
    doc = run_benchmark("training.py", tmp_path, "--small", "--deterministic", "--lengths",
                        "6", "--steps", "20", "--batch", "2", "--ways",
                        "eager,grape_family,grape_family_aliased,per_shape_graphs")
    rows = {r["way"]: r for r in doc["results"]}
    torch_graphs_as_eager = rows["per_shape_graphs"]["params_bitwise_equal_to_eager"]
    for way in ("grape_family", "grape_family_aliased"):  # batches copied, or re-pointed at
        grape_row = rows[way]
        assert grape_row["fallback"] is None and grape_row["graphed_steps"] == 19, way
        # The same kernels as PyTorch's own graphs of the step, so the same bits; and as
        # eager's wherever PyTorch's graphs are (a capture may pick other library kernels).
        assert grape_row["params_bitwise_equal_to_per_shape_graphs"] is True, way
        assert grape_row["params_bitwise_equal_to_eager"] is torch_graphs_as_eager, way
        assert grape_row["final_loss_scale"] == rows["eager"]["final_loss_scale"], way
        assert grape_row["final_loss"] == rows["per_shape_graphs"]["final_loss"], way


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
