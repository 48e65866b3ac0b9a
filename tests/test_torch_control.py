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


def test_while_loop_runs_until_the_condition_or_the_bound():
    from grape.torch.control import while_loop

    (x,) = while_loop(lambda t: t.sum() < 10, lambda t: (t + 3,), (torch.zeros(1),), 100)
    assert x.item() == 12
    (x,) = while_loop(lambda t: t.sum() < 10, lambda t: (t + 3,), (torch.zeros(1),), 2)
    assert x.item() == 6
    (x,) = while_loop(lambda t: t.sum() < 0, lambda t: (t + 3,), (torch.zeros(1),), 5)
    assert x.item() == 0  # the condition is checked before the first iteration


def test_while_loop_refuses_bodies_that_change_the_state_and_loops_without_a_bound():
    from grape.torch.control import while_loop

    state = (torch.zeros(2), torch.zeros((), dtype=torch.long))
    with pytest.raises(GrapeError, match=r"keep state 0 at \(2,\) torch.float32, found \(3,\)"):
        while_loop(lambda a, n: n < 3, lambda a, n: (torch.zeros(3), n + 1), state, 10)
    with pytest.raises(GrapeError, match=r"keep state 1 at \(\) torch.int64, found \(\) "
                                         r"torch.float32"):
        while_loop(lambda a, n: n < 3, lambda a, n: (a, n + 0.5), state, 10)
    with pytest.raises(GrapeError, match="return 2 tensors"):
        while_loop(lambda a, n: n < 3, lambda a, n: (a,), state, 10)
    with pytest.raises(GrapeError, match="a loop without one is refused"):
        while_loop(lambda a, n: n < 3, lambda a, n: (a, n + 1), state, 0)
    with pytest.raises(GrapeError, match="boolean or integer scalar tensor"):
        while_loop(lambda a, n: a, lambda a, n: (a, n + 1), state, 3)
