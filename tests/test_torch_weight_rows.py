"""One-row products by parameters stored (in, out) read copies laid (out, in), made by a
torch.compile backend (grape.torch.weight_rows), kept up to date with their parameters."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from grape.torch.weight_rows import WeightRows  # noqa: E402


class _Products(torch.nn.Module):
    """A parameter stored (in, out), read by two products; a buffer stored so; a Linear."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(8, 6, generator=generator))
        self.register_buffer("state", torch.randn(8, 6, generator=generator))
        self.linear = torch.nn.Linear(8, 6)
        self.copies = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.copies * (torch.addmm(self.linear.bias, x, self.weight) + x @ self.weight
                + torch.mm(x, self.state) + self.linear(x))


def _compiled(module: torch.nn.Module) -> tuple[WeightRows, object]:
    # (Dynamo's graph run as it is, after relay: what the relaid graph computes)
    backend = WeightRows(lambda gm, example_inputs: gm.forward, most_rows=1)
    return backend, torch.compile(module, backend=backend, dynamic=False)


@pytest.mark.parametrize("rows", [1, 3])
def test_one_row_products_by_a_parameter_stored_in_out_read_one_copy_laid_out_in(rows):
    torch._dynamo.reset()
    module = _Products()
    backend, compiled = _compiled(module)
    x = torch.randn(rows, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x))
    if rows > 1:  # (products of more rows read their weights as they lie)
        assert backend.relaid == []
        return
    # one copy for the two products by the parameter; the buffer and the Linear as they lie
    [relaid] = backend.relaid
    assert relaid.source is module.weight
    assert relaid.copy.shape == (6, 8) and relaid.copy.is_contiguous()
    assert torch.equal(relaid.copy, module.weight.detach().t())


def test_a_parameter_changed_in_place_is_copied_again_by_refresh():
    torch._dynamo.reset()
    module = _Products()
    backend, compiled = _compiled(module)
    x = torch.randn(1, 8)
    with torch.no_grad():
        compiled(x)
        module.weight.mul_(2.0)
        assert not torch.allclose(compiled(x), module(x))  # (the copy, before a refresh)
        assert backend.refresh() == 1 and backend.refresh() == 0
        torch.testing.assert_close(compiled(x), module(x))


def test_a_graph_that_fails_to_compile_keeps_no_copies():
    torch._dynamo.reset()

    def failing(gm, example_inputs):
        raise RuntimeError("the compiler refused")

    backend = WeightRows(failing, most_rows=1)
    compiled = torch.compile(_Products(), backend=backend, dynamic=False)
    with torch.no_grad(), pytest.raises(Exception, match="the compiler refused"):
        compiled(torch.randn(1, 8))
    assert backend.relaid == []


def test_graphs_of_other_shapes_read_the_copy_made_for_the_first():
    # (each executable's shapes compile a graph of their own: one copy serves them all)
    torch._dynamo.reset()
    module = _Products()
    backend, compiled = _compiled(module)
    x = torch.randn(1, 8)
    with torch.no_grad():
        for copies in (1, 2, 3):  # (an integer attribute Dynamo guards on: a graph each)
            module.copies = copies
            torch.testing.assert_close(compiled(x), module(x))
    assert len(backend.relaid) == 1 and backend.relaid[0].source is module.weight
