"""grape.torch.static_layers.CountedLayer on the CPU: it writes where the shared count says and
never advances it; transformers reads that count as its length."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")

from grape.errors import GrapeError  # noqa: E402
from grape.torch.static_layers import CountedLayer  # noqa: E402


def _states(tokens: int, fill: float) -> torch.Tensor:
    return torch.full((1, 2, tokens, 4), fill)  # (batch, heads, tokens, head size)


def test_layers_write_at_the_shared_count_and_leave_it_to_their_owner():
    count = torch.zeros(1, dtype=torch.long)
    layers = [CountedLayer(max_cache_len=8, count=count) for _ in range(3)]
    for layer in layers:  # a prompt of three tokens, at positions 0..2
        layer.update(_states(3, 1.0), _states(3, -1.0))
    assert count.item() == 0  # no layer advanced it
    count.fill_(3)
    for step in range(2):  # two decode steps, each token at the count
        for layer in layers:
            keys, _ = layer.update(_states(1, 2.0 + step), _states(1, -2.0 - step))
            assert keys is layer.keys  # the whole cache, as transformers returns it
        count.add_(1)
    for layer in layers:
        assert layer.keys[0, 0, :, 0].tolist() == [1, 1, 1, 2, 3, 0, 0, 0]
        assert layer.values[0, 0, :, 0].tolist() == [-1, -1, -1, -2, -3, 0, 0, 0]
        # transformers' length is the count itself: a 0-dim view, as transformers keeps it
        assert layer.get_seq_length().shape == () and layer.get_seq_length().item() == 5
        assert layer.cumulative_length.data_ptr() == count.data_ptr()


def test_a_reset_clears_the_cache_and_the_count():
    count = torch.zeros(1, dtype=torch.long)
    layer = CountedLayer(max_cache_len=4, count=count)
    layer.update(_states(2, 1.0), _states(2, 1.0))
    count.fill_(2)
    layer.reset()
    assert count.item() == 0 and not layer.keys.any()


def test_the_count_must_be_one_long_element():
    with pytest.raises(GrapeError, match=r"shape \(1,\) and dtype long, found shape \(\) "
                                         r"and torch.int32"):
        CountedLayer(max_cache_len=4, count=torch.zeros((), dtype=torch.int32))
