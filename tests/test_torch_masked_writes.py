"""Writes through a boolean mask made capturable (grape.torch.masked_writes): the same bytes as
PyTorch's own write, and no count read back where the values do not depend on it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from grape.torch.capture import culprit  # noqa: E402
from grape.torch.masked_writes import masked_writes, where_form  # noqa: E402
from grape.torch.readback import ReadBack, as_captured  # noqa: E402


@st.composite
def writes(draw):
    """A tensor, a boolean mask over its leading dimensions, and values that broadcast over
    the places the mask selects (leading dimensions of 1 allowed, as index_put allows)."""
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    masked = draw(st.integers(1, len(shape)))
    rest = shape[masked:]
    kept = draw(st.integers(0, len(rest)))
    values = [draw(st.sampled_from([1, s])) for s in rest[len(rest) - kept:]]
    values = [1] * draw(st.integers(0, 1 if kept == len(rest) else 0)) + values
    seed = draw(st.integers(0, 2**16))
    return shape, masked, values, seed, draw(st.booleans())


@settings(max_examples=200, deadline=None)
@given(writes())
def test_a_write_through_a_mask_is_the_same_bytes_as_pytorch_s(case):
    shape, masked, values_shape, seed, accumulate = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    mask = torch.rand(shape[:masked], generator=g) > 0.5
    values = torch.randn(values_shape, generator=g)
    expected = x.clone().index_put_((mask,), values, accumulate=accumulate)
    assert torch.equal(where_form(x, (mask,), values, accumulate), expected)
    with as_captured():  # no count read back: the probe refuses a write that reads one
        written = x.clone()
        written.index_put_((mask,), values, accumulate=accumulate)
        out_of_place = x.index_put((mask,), values, accumulate=accumulate)
    assert torch.equal(written, expected)
    assert torch.equal(out_of_place, expected)


def test_an_embedding_written_where_a_token_is_lands_in_the_caller_s_tensor():
    # T5Gemma 2's pattern (x[ids == eoi] = eoi_embedding), through a view: the write reaches
    # the tensor the view is of, as PyTorch's does.
    g = torch.Generator().manual_seed(0)
    embeddings = torch.randn(3, 2, 5, 4, generator=g)
    ids = torch.randint(0, 3, (2, 5), generator=g)
    row = torch.randn(4, generator=g)
    expected = embeddings.clone()
    expected[1][ids == 2] = row
    with masked_writes():
        embeddings[1][ids == 2] = row
    assert torch.equal(embeddings, expected)


MASK = torch.tensor([[True, False], [True, True]])


@pytest.mark.parametrize("indices, values", [
    ((MASK,), torch.ones(3, 3)),  # one row per selected place: their count is the mask's
    ((MASK[:, 0], torch.tensor([0])), torch.ones(3)),  # a mask beside positions
])
def test_values_that_depend_on_the_count_are_left_to_pytorch_and_refused(indices, values):
    x = torch.zeros(2, 2, 3)
    assert where_form(x, indices, values) is None
    expected = x.clone().index_put_(indices, values)
    with pytest.raises(ReadBack, match="boolean mask") as refused, as_captured():
        x.index_put_(indices, values)
    # the line that wrote is named, not the rewriting mode's (LongCat-Flash's scan named it)
    assert culprit(refused.value).startswith(f"{__file__}:")
    with masked_writes():
        x.index_put_(indices, values)  # as PyTorch writes it (which on a GPU reads back)
    assert torch.equal(x, expected)


def test_a_number_written_through_a_mask_is_rewritten_too():
    # On the CPU the number lies on x's device (on a GPU it is PyTorch's masked_fill, left
    # so by grape's staging): the probe's rewrite writes the same bytes either way.
    x = torch.tensor([[0, 4, 0], [5, 0, 6]])
    with as_captured() as rewritten:
        x[x == 0] = 7
    assert rewritten == {"index_put_.default": 1}
    assert torch.equal(x, torch.tensor([[7, 4, 7], [5, 7, 6]]))


def test_a_host_number_passes_the_rewrite_and_grape_s_staging_to_pytorch_s_masked_fill():
    # As grape.generate captures a step: staging outside, the rewrite inside. The meta device
    # stands in for the GPU (Python's indexing makes the number on meta, so the call is made
    # as CUDA's: a host scalar given to index_put_). Neither mode moves it to the device,
    # where the write would read the mask's count back.
    from grape.torch.staging import HostConstants, PinnedArena

    copies = []
    stage = HostConstants(PinnedArena(64, pin=False), "meta",
                          copy=lambda *args: copies.append(args))
    x = torch.zeros(2, 5, dtype=torch.long, device="meta")
    with stage, masked_writes() as rewrite:
        x.index_put_((x == 3,), torch.tensor(0))
    assert copies == [] and stage.values == [] and rewrite.rewritten == {}


class _Reaching(TorchDispatchMode):
    """The operations that reach it: entered before masked_writes, those it passes on."""

    def __enter__(self):
        self.ops = set()
        super().__enter__()
        return self.ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_a_fill_by_a_tensor_value_is_the_same_bytes_as_pytorch_s(dtype):
    # masked_fill's CUDA kernel reads a tensor value back (value.item()); rewritten as where.
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 4, 5, generator=g) * 100).to(dtype)
    mask = torch.rand(4, 5, generator=g) > 0.5  # broadcast over the first dimension
    value = torch.tensor(-7.75)  # converted to x's dtype as masked_fill converts it
    expected = x.masked_fill(mask, value)
    with masked_writes():
        filled = x.masked_fill(mask, value)
        in_place = x.clone()
        in_place.masked_fill_(mask, value)
    assert filled.dtype == dtype
    assert torch.equal(filled, expected)
    assert torch.equal(in_place, expected)
    # out of place, a mask of more dimensions broadcasts the tensor (in place it may not)
    wider = torch.rand(2, 3, 4, 5, generator=g) > 0.5
    with _Reaching() as reached, masked_writes():
        broadcast = x.masked_fill(wider, value)
        x.clone().masked_fill_(mask, value)
    assert torch.equal(broadcast, x.masked_fill(wider, value))
    assert not {torch.ops.aten.masked_fill.Tensor, torch.ops.aten.masked_fill_.Tensor} & reached
    with pytest.raises(RuntimeError), masked_writes():
        x.clone().masked_fill_(wider, value)


def test_the_probe_counts_the_writes_it_ran_as_where():
    # arch_sweep.py --check-read-backs reports them per model (steps and prompts apart).
    x = torch.zeros(2, 3, 4)
    mask = torch.tensor([[True, False, True], [False, False, True]])
    with as_captured() as rewritten:
        x[mask] = torch.ones(4)
        x.masked_fill_(mask[..., None], torch.tensor(2.0))
        x.masked_fill_(mask[..., None], 3.0)  # a Python number: PyTorch's own, nothing read
    assert rewritten == {"index_put_.default": 1, "masked_fill_.Tensor": 1}
    assert torch.equal(x, torch.where(mask[..., None], 3.0, 0.0).expand(2, 3, 4))
