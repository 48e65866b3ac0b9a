"""Products of one row by weights of different sizes, read as one product by a copy of their
weights stacked, made by a torch.compile backend (grape.torch.sibling_products through
grape.torch.weight_rows.WeightRows), kept up to date with their parameters."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from grape.torch.weight_rows import WeightRows  # noqa: E402


class _Layer(torch.nn.Module):
    """A query, key and value of different sizes over one row; a gate and up projection of
    one size over another; a product over a third row alone."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = torch.nn.Linear(8, 6, bias=bias)
        self.k = torch.nn.Linear(8, 2, bias=bias)
        self.v = torch.nn.Linear(8, 2, bias=bias)
        self.gate = torch.nn.Linear(8, 4, bias=False)
        self.up = torch.nn.Linear(8, 4, bias=False)
        self.out = torch.nn.Linear(4, 8, bias=False)
        self.copies = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attended = self.q(x)[..., :2] * self.k(x) + self.v(x)
        h = x + attended.repeat(1, 4)
        return self.copies * self.out(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def _compiled(module: torch.nn.Module) -> tuple[WeightRows, object]:
    # (Dynamo's graph run as it is, after stack: what the stacked graph computes)
    backend = WeightRows(lambda gm, example_inputs: gm.forward, most_rows=None, stacks=True)
    return backend, torch.compile(module, backend=backend, dynamic=False)


@pytest.mark.parametrize("bias", [False, True])
def test_products_of_different_sizes_over_one_row_read_one_stacked_copy(bias):
    torch._dynamo.reset()
    module = _Layer(bias)
    backend, compiled = _compiled(module)
    x = torch.randn(1, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x))
    # the query, key and value stacked in order (and their biases); the gate and up
    # projection, of one size, left to Inductor; the output product alone
    weights = [s for s in backend.stacked if s.copy.dim() == 2]
    biases = [s for s in backend.stacked if s.copy.dim() == 1]
    [stacked] = weights
    assert stacked.sources == (module.q.weight, module.k.weight, module.v.weight)
    assert torch.equal(stacked.copy, torch.cat([module.q.weight, module.k.weight,
                                                module.v.weight]).detach())
    assert [b.sources for b in biases] == ([(module.q.bias, module.k.bias, module.v.bias)]
                                           if bias else [])
    assert backend.relaid == []


def test_products_with_and_without_a_bias_are_not_stacked_together():
    torch._dynamo.reset()
    module = _Layer(bias=True)
    module.k = torch.nn.Linear(8, 2, bias=False)
    backend, compiled = _compiled(module)
    x = torch.randn(1, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x))
    # the query and value (biased) together; the key alone
    assert [s.sources for s in backend.stacked] == [(module.q.weight, module.v.weight),
                                                    (module.q.bias, module.v.bias)]


def test_a_weight_changed_in_place_is_copied_again_by_refresh():
    torch._dynamo.reset()
    module = _Layer(bias=True)
    backend, compiled = _compiled(module)
    x = torch.randn(1, 8)
    with torch.no_grad():
        compiled(x)
        module.k.weight.mul_(2.0)
        module.v.bias.add_(1.0)
        assert not torch.allclose(compiled(x), module(x))  # (the copy, before a refresh)
        assert backend.refresh() == 2 and backend.refresh() == 0
        torch.testing.assert_close(compiled(x), module(x))


def test_graphs_of_other_shapes_read_the_copy_made_for_the_first():
    torch._dynamo.reset()
    module = _Layer()
    backend, compiled = _compiled(module)
    x = torch.randn(1, 8)
    with torch.no_grad():
        for copies in (1, 2, 3):  # (an integer attribute Dynamo guards on: a graph each)
            module.copies = copies
            torch.testing.assert_close(compiled(x), module(x))
    assert len(backend.stacked) == 1


def test_a_graph_that_fails_to_compile_keeps_no_stacked_copies():
    torch._dynamo.reset()

    def failing(gm, example_inputs):
        raise RuntimeError("the compiler refused")

    backend = WeightRows(failing, most_rows=None, stacks=True)
    compiled = torch.compile(_Layer(), backend=backend, dynamic=False)
    with torch.no_grad(), pytest.raises(Exception, match="the compiler refused"):
        compiled(torch.randn(1, 8))
    assert backend.stacked == [] and backend._known_stacks == {}


def test_a_group_whose_smallest_weight_is_large_is_left_as_it_is():
    # (sibling_products.SMALLEST: products that read enough to fill the GPU gain a launch a
    # layer at most from stacking, and the copies would cost their bytes again)
    from grape.torch.sibling_products import stack

    torch._dynamo.reset()
    module = _Layer()
    kept = []

    def backend(gm, example_inputs):
        smallest = module.k.weight.nbytes  # (the key's and value's: 2 x 8 floats)
        kept.append(stack(gm, example_inputs, smallest=smallest - 1))
        kept.append(stack(gm, example_inputs, smallest=smallest))
        return gm.forward

    compiled = torch.compile(module, backend=backend, dynamic=False)
    x = torch.randn(1, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x))
    assert kept[0] == [] and [s.sources for s in kept[1]] == [
        (module.q.weight, module.k.weight, module.v.weight)]


def test_a_graph_with_an_autocast_region_is_left_as_it_is():
    # (the stacked product would sit in or out of the region, and its dtype with it)
    class _Autocast(_Layer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                q = self.q(x)
            return q[..., :2].float() * self.k(x) + self.v(x)

    torch._dynamo.reset()
    module = _Autocast()
    backend, compiled = _compiled(module)
    x = torch.randn(1, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x))
    assert backend.stacked == []
