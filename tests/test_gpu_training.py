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
                        "eager,grape_family,grape_family_aliased")
    rows = {r["way"]: r for r in doc["results"]}
    for way in ("grape_family", "grape_family_aliased"):  # batches copied, or re-pointed at
        grape_row = rows[way]
        assert grape_row["fallback"] is None and grape_row["graphed_steps"] == 19, way
        assert grape_row["params_bitwise_equal_to_eager"] is True, way
        assert grape_row["final_loss_scale"] == rows["eager"]["final_loss_scale"], way
        assert grape_row["final_loss"] == rows["eager"]["final_loss"], way
