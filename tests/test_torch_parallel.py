"""grape.torch.parallel on the CPU: a Llama-shaped model split over two processes (gloo) by its
config's own plan computes the unsplit model's logits and tokens, on both ranks alike; the
ranks agree on the loop condition and on falling back; bad plans are named."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from grape.errors import GrapeError  # noqa: E402
from grape.torch.parallel import shard  # noqa: E402

CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)


def _model():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    return transformers.LlamaForCausalLM(config).eval()


def _errors(dist) -> list[str]:
    out = []
    for plan in ({"layers.*.mlp.up_proj": "gather"}, {"layers.*.input_layernorm": "colwise"},
                 {"nothing.*": "colwise"}):
        try:
            shard(_model(), plan=plan)
        except GrapeError as e:
            out.append(str(e))
    odd = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(
        CONFIG, num_attention_heads=3, num_key_value_heads=1, hidden_size=48)))
    try:
        shard(odd)
    except GrapeError as e:
        out.append(str(e))
    return out


def _worker(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from grape.torch.beam import BeamDecoder
    from grape.torch.decoding import TokenDecoder
    from grape.torch.options import resolve
    from grape.torch.parallel import agree

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    try:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(30, 300, (2, 6), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        whole, split = _model(), shard(_model())
        result: dict = {}
        with torch.no_grad():
            a, b = whole(ids, attention_mask=mask).logits, split(ids, attention_mask=mask).logits
        result["max_logit_difference"] = float((a - b).abs().max())
        result["logits_checksum"] = float(b.double().sum())
        for name, kwargs in (("greedy", {}), ("beam 3", {"num_beams": 3})):
            tokens = []
            for model in (whole, split):
                options, m = resolve(model, ids, mask, dict(kwargs, max_new_tokens=8))
                cls = BeamDecoder if options.strategy == "beam" else TokenDecoder
                tokens.append(cls(model, 2, 6, options).generate_on_host(ids, m).tolist())
            result[name] = tokens
        # The loop condition: rank 0 would stop, rank 1 go on; after agreeing, both go on.
        options, _ = resolve(split, ids, mask, {"max_new_tokens": 8})
        decoder = TokenDecoder(split, 2, 6, options)
        decoder.running.fill_(rank == 1)
        decoder._agree()
        result["agreed_running"] = bool(decoder.running)
        result["agree_one_fails"] = agree(rank == 0, dist.group.WORLD)
        result["agree_all_hold"] = agree(True, dist.group.WORLD)
        try:
            shard(split)
        except GrapeError as e:
            result["twice"] = str(e)
        result["errors"] = _errors(dist)
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(2, str(tmp / "store"), str(tmp)), nprocs=2, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_ranks_compute_the_whole_models_logits_and_the_same_as_each_other(ranks):
    for r in ranks:
        assert r["max_logit_difference"] < 1e-5
    assert ranks[0]["logits_checksum"] == ranks[1]["logits_checksum"]


@pytest.mark.parametrize("strategy", ["greedy", "beam 3"])
def test_two_ranks_make_the_whole_models_tokens(ranks, strategy):
    whole, split = ranks[0][strategy]
    assert split == whole
    assert ranks[1][strategy][1] == split


def test_ranks_agree_on_the_loop_condition_and_on_falling_back(ranks):
    assert [r["agreed_running"] for r in ranks] == [True, True]
    assert [r["agree_one_fails"] for r in ranks] == [False, False]
    assert [r["agree_all_hold"] for r in ranks] == [True, True]


def test_bad_plans_and_a_second_split_are_named(ranks):
    errors = ranks[0]["errors"]
    assert errors[0] == ("expected plan styles 'colwise' or 'rowwise', found 'gather' for "
                         "layers.0.mlp.up_proj")
    assert errors[1] == ("expected a linear layer at layers.0.input_layernorm (colwise), found "
                         "LlamaRMSNorm")
    assert errors[2].startswith("expected the plan to name modules of LlamaForCausalLM, found "
                                "none matching")
    assert errors[3] == ("expected num_attention_heads (3) divisible by the 2 ranks, found a "
                         "remainder of 1")
    assert ranks[0]["twice"] == ("expected a model not yet sharded, found LlamaForCausalLM "
                                 "already split over 2 ranks")


def test_sharding_without_a_process_group_is_refused():
    with pytest.raises(GrapeError, match="expected torch.distributed to be initialised"):
        shard(_model())
