"""grape.torch.ctc without a GPU: the Hugging Face CTC heads' loss, and bad input."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from grape.errors import GrapeError  # noqa: E402
from grape.torch.ctc import ctc_loss, hf_ctc_loss  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(hidden_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, intermediate_size=64,
                                         vocab_size=32, ctc_loss_reduction="mean")
    return transformers.Wav2Vec2ForCTC(config).eval()


def _labels(lengths, width=20):
    labels = torch.full((len(lengths), width), -100)
    for row, n in zip(labels, lengths, strict=True):
        row[:n] = torch.randint(1, 32, (n,))
    return labels


@pytest.mark.parametrize("masked", [False, True])
def test_the_heads_loss_is_the_models_own(model, masked):
    torch.manual_seed(1)
    audio = torch.randn(2, 16000)
    mask = None
    if masked:  # the second utterance is 0.6 s of the second's 1 s
        mask = torch.ones(2, 16000, dtype=torch.long)
        mask[1, 9600:] = 0
    labels = _labels([7, 12])
    ours = hf_ctc_loss(model, audio, labels, attention_mask=mask)
    theirs = model(audio, attention_mask=mask, labels=labels).loss
    assert torch.equal(ours, theirs)


def test_bad_arguments_are_named():
    lp = torch.randn(10, 2, 5).log_softmax(-1)
    targets, lengths = torch.ones(2, 3, dtype=torch.long), torch.tensor([10, 10])
    with pytest.raises(GrapeError, match="expected reduction 'mean', 'sum' or 'none', found "
                                         "'avg'"):
        ctc_loss(lp, targets, lengths, torch.tensor([3, 3]), reduction="avg")
    with pytest.raises(GrapeError, match=r"expected log_probs \(frames, batch, classes\) and "
                                         r"targets \(batch, max_target_length\), found "
                                         r"\(10, 2, 5\) and \(6,\)"):
        ctc_loss(lp, targets.flatten(), lengths, torch.tensor([3, 3]))
    with pytest.raises(GrapeError, match=r"expected target_lengths of shape \(2,\) on cpu, "
                                         r"found \(3,\) on cpu"):
        ctc_loss(lp, targets, lengths, torch.tensor([3, 3, 3]))
