"""The CPU's forecast of a capture's read-backs (grape.torch.readback.as_captured): what a GPU
reads back to the host that the CPU does not, and what the CPU reads back that a GPU does not."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from grape.torch.readback import ReadBack, _one_hot_as_on_a_gpu, as_captured  # noqa: E402

X = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 1.0]])
MASK = X > 0.5


@pytest.mark.parametrize("name, work", [
    ("nonzero()", lambda: MASK.nonzero()),
    ("nonzero()", lambda: torch.where(MASK)),  # where of a condition alone
    ("indexing by a boolean mask", lambda: X[MASK]),
    ("masked_select()", lambda: X.masked_select(MASK)),
    ("unique()", lambda: torch.unique(X)),
    ("bincount()", lambda: torch.bincount(torch.tensor([1, 0]))),
    ("repeat_interleave()", lambda: torch.repeat_interleave(torch.tensor([1, 2]),
                                                            torch.tensor([2, 1]))),
    # T5Gemma 2's encoder, x[ids == eoi] = embedding: the mask made positions by nonzero on a
    # GPU (its capture failed there; this probe called it clean before).
    ("boolean mask", lambda: X.clone().__setitem__(MASK, torch.ones(4))),
    ("boolean mask", lambda: X.clone().index_put((MASK,), torch.ones(4))),
    # a mask beside positions: no masked_fill, whatever the value
    ("boolean mask", lambda: X.clone().index_put_((torch.tensor([True, False]),
                                                   torch.tensor([0])), torch.ones(1))),
    ("equal()", lambda: torch.equal(X, X)),
    ("allclose()", lambda: torch.allclose(X, X)),
])
def test_an_output_sized_by_the_values_it_reads_is_a_read_back(name, work):
    # On a GPU each of these copies its output's count to the host and waits for it, which a
    # capture refuses; on the CPU none reads anything back.
    work()
    with pytest.raises(ReadBack, match=re.escape(name)), as_captured():
        work()


@pytest.mark.parametrize("work", [
    lambda: torch.where(MASK, X, 0.0),
    lambda: X[torch.tensor([1, 0])],
    lambda: X.masked_fill(MASK, 0.0),
    lambda: X.clone().__setitem__(MASK, 0.0),  # a number: grape.torch.masked_writes rewrites it
    lambda: X.clone().__setitem__(torch.tensor([1, 0]), torch.ones(3)),  # positions: no count
    lambda: torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([2, 1]), output_size=3),
    lambda: torch.repeat_interleave(torch.tensor([1, 2]), 2),
])
def test_outputs_whose_size_the_shapes_decide_are_not(work):
    with as_captured():
        work()


def test_one_hot_given_its_classes_reads_nothing_back_as_on_a_gpu():
    # PyTorch checks the indices' range on the host on the CPU alone (on a GPU a device assert
    # does): a mixture of experts' routing mask would read as a read-back on the CPU only.
    indices = torch.tensor([[1, 0], [2, 2]])
    with as_captured():
        found = torch.nn.functional.one_hot(indices, num_classes=3)
    assert torch.equal(found, torch.nn.functional.one_hot(indices, num_classes=3))
    assert found.dtype == torch.long
    with as_captured():  # the builtin's own keyword names
        named = torch.nn.functional.one_hot(input=indices, num_classes=3)
    assert torch.equal(named, found)
    assert torch.equal(_one_hot_as_on_a_gpu(indices, 4),
                       torch.nn.functional.one_hot(indices, num_classes=4))
    with pytest.raises(ReadBack), as_captured():
        torch.nn.functional.one_hot(indices)  # its classes counted from the values: read back


@pytest.mark.parametrize("work, refused", [
    (lambda: X.to("cpu"), True),
    (lambda: X.to(device="cpu", dtype=torch.float16), True),
    (lambda: X.to(torch.float16), False),  # a dtype alone: no copy to the host
    (lambda: X.to(X), False),  # another tensor's device: not known to be the host's
    # A device object: on a CPU run the model's own device (transformers' masks move theirs
    # to inputs_embeds.device), no copy to the host on a GPU.
    (lambda: X.to(device=X.device, dtype=torch.bool), False),
])
def test_a_tensor_moved_to_the_cpu_by_name_is_a_read_back(work, refused):
    # On the CPU .to("cpu") is no copy at all; on a GPU it copies to the host and waits.
    if refused:
        with pytest.raises(ReadBack, match="to the host"), as_captured():
            work()
    else:
        with as_captured():
            work()
