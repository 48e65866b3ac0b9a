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


def test_a_step_that_draws_dropout_masks_is_not_graphed(cuda):
    # grape's launches would repeat one step's masks: refused with one warning, trained eagerly.
    from grape.torch.training import GraphedTraining

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(m, x, y):
        return torch.nn.functional.mse_loss(m(x).mean(1), y)

    trainer = GraphedTraining(model, loss_fn, opt, lengths=[3, 2], input_shape=(2, 3, 4),
                              target_shape=(2, 4), target_dtype=torch.float32)
    x, y = torch.randn(2, 3, 4, device="cuda"), torch.randn(2, 4, device="cuda")
    trainer(x, y)
    with pytest.warns(UserWarning, match="expected a step that draws no random numbers on the "
                                         "device, found the CUDA generator advanced by"):
        trainer(x, y)
    assert trainer.stats.graphed_steps == 0 and trainer.stats.eager_steps == 2
    assert "dropout" in trainer.stats.fallback
