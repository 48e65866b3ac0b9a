"""cond and predicate run eagerly (on the CPU here) with the results a capture computes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from grape.errors import GrapeError  # noqa: E402
from grape.torch.control import cond, predicate  # noqa: E402


@pytest.mark.parametrize(("value", "expected"), [(True, 3.0), (False, -1.0), (2, 3.0), (0, -1.0)])
def test_cond_runs_the_branch_the_predicate_picks(value, expected):
    x = torch.ones(2)
    out = cond(torch.tensor(value), lambda t: t * 3, lambda t: t - 2, x)
    assert torch.equal(out, torch.full((2,), expected))


def test_nested_regions_combine_as_python_would():
    x = torch.zeros(1)
    for a in (True, False):
        for b in (True, False):
            x.zero_()
            with predicate(torch.tensor(a)) as outer:
                if outer:
                    x.add_(1)
                    with predicate(torch.tensor(b)) as inner:
                        if inner:
                            x.add_(10)
            assert x.item() == (1 if a else 0) + (10 if a and b else 0)


@pytest.mark.parametrize("bad", [torch.tensor([True, False]), torch.tensor(1.0), 1, None],
                         ids=["two values", "float", "python int", "None"])
def test_predicates_that_are_not_integer_or_boolean_scalars_are_refused(bad):
    with pytest.raises(GrapeError, match="expected a predicate that is a boolean or integer "
                                         "scalar tensor"):
        cond(bad, lambda: 1, lambda: 2)
    with pytest.raises(GrapeError, match="boolean or integer scalar tensor"), predicate(bad):
        pass
