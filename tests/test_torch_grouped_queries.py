"""grape.torch.grouped_queries without a GPU: traced by Dynamo, one query's grouped-query
attention reads the keys where they lie and gives transformers' attention, to float32's
rounding; every other call, and every eager one, is transformers' own; outside the block the
entry is transformers' again."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from grape.torch.grouped_queries import grouped_queries  # noqa: E402


class _Attention(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _inputs(batch, kv_heads, groups, queries, keys, seed=0, dim=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * groups, queries, dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, keys, dim, generator=g) for _ in range(2))
    return q, k, v


def _calls(fn, fullgraph=True):
    """``fn`` traced by Dynamo (its eager backend: the traced Python alone), inside the block,
    and the number of times transformers' own entry ran while it was traced."""
    ran = []

    def theirs(*args, **kwargs):
        ran.append(1)
        return sdpa_attention_forward(*args, **kwargs)
    entries = AttentionInterface._global_mapping
    saved, entries["sdpa"] = entries["sdpa"], theirs
    torch._dynamo.reset()
    try:
        with grouped_queries():
            out = torch.compile(fn, backend="eager", fullgraph=fullgraph)()
    finally:
        entries["sdpa"] = saved
    return out, len(ran)


@pytest.mark.parametrize("batch,kv_heads,groups", [(1, 2, 2), (3, 2, 4), (2, 1, 8)])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_one_query_attends_to_the_keys_where_they_lie_as_transformers_does(
        batch, kv_heads, groups, kind):
    keys = 9
    q, k, v = _inputs(batch, kv_heads, groups, 1, keys)
    padding = torch.ones(batch, 1, 1, keys, dtype=torch.bool)
    padding[0, ..., :4] = False  # a left-padded row
    mask = (padding if kind == "bool"
            else torch.zeros(padding.shape).masked_fill_(~padding, float("-inf")))
    module = _Attention(groups)
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)

    def step():
        return AttentionInterface._global_mapping["sdpa"](module, q, k, v, mask, scaling=0.3)
    (out, weights), theirs = _calls(step)
    assert theirs == 0 and weights is None
    assert out.shape == expected.shape == (batch, 1, kv_heads * groups, q.shape[-1])
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert out.is_contiguous()


@pytest.mark.parametrize("case", ["two queries", "no mask", "one key head a query head",
                                  "a mask per query head", "a position bias",
                                  "attention weights asked for"])
def test_every_other_call_is_transformers_own(case):
    groups = 1 if case == "one key head a query head" else 2
    q, k, v = _inputs(2, 2, groups, 2 if case == "two queries" else 1, 6)
    heads = q.shape[1]
    mask = (None if case == "no mask"
            else torch.ones(2, heads if case == "a mask per query head" else 1, q.shape[2], 6,
                            dtype=torch.bool))
    kwargs = {"position_bias": torch.zeros(1, heads, q.shape[2], 6)} if (
        case == "a position bias") else {"output_attentions": case.startswith("attention")}
    module = _Attention(groups)

    def step():
        return AttentionInterface._global_mapping["sdpa"](module, q, k, v, mask, **kwargs)
    # (transformers warns of attention weights it cannot give, where Dynamo breaks the graph)
    (out, _), theirs = _calls(step, fullgraph=not case.startswith("attention"))
    assert theirs == 1
    torch.testing.assert_close(out, sdpa_attention_forward(module, q, k, v, mask, **kwargs)[0])


def test_eager_calls_and_calls_after_the_block_are_transformers_own():
    entries = AttentionInterface._global_mapping
    saved = entries["sdpa"]
    q, k, v = _inputs(1, 2, 2, 1, 5)
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    ran = []

    def theirs(*args, **kwargs):
        ran.append(1)
        return sdpa_attention_forward(*args, **kwargs)
    entries["sdpa"] = theirs
    try:
        with grouped_queries():
            inside = entries["sdpa"]
            assert inside is not theirs and inside.grape_original is theirs
            inside(_Attention(2), q, k, v, mask)  # eagerly: passed through
            with grouped_queries():  # nested: the same entry
                assert entries["sdpa"] is inside
        assert entries["sdpa"] is theirs and ran == [1]
        with grouped_queries():  # the same wrapper again: what Dynamo guards on stays
            assert entries["sdpa"] is inside
    finally:
        entries["sdpa"] = saved

