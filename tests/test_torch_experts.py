"""Experts that read back inside a capture run by transformers' batched_mm, or densely, while
grape captures (grape.torch.experts), and as before afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from grape.torch import experts  # noqa: E402
from grape.torch.experts import (  # noqa: E402
    DENSE_TOKENS,
    dense_experts_forward,
    experts_on_device,
    reads_back,
    way,
)
from grape.torch.readback import ReadBack, as_captured  # noqa: E402

H100 = (9, 0)


@pytest.mark.parametrize("implementation, dtype, capability, expected", [
    # PyTorch's grouped GEMM runs on the device alone in bf16 from compute capability 8.0;
    # otherwise it loops over the experts with their offsets copied to the host
    ("grouped_mm", torch.bfloat16, H100, False),
    (None, torch.bfloat16, H100, False),  # transformers' default
    ("grouped_mm", torch.float16, H100, True),
    ("grouped_mm", torch.float32, H100, True),
    ("grouped_mm", torch.bfloat16, (7, 5), True),
    ("eager", torch.bfloat16, H100, True),  # the model's loop finds its experts by nonzero
    ("batched_mm", torch.float16, H100, False),
    ("sonicmoe", torch.float16, H100, False),  # another library's kernels: not second-guessed
    ("eager", torch.float16, None, False),  # on the CPU: nothing captured, nothing switched
])
def test_which_experts_read_back_inside_a_capture(implementation, dtype, capability, expected):
    assert reads_back(implementation, dtype, capability) is expected


def _mixtral(implementation: str, experts: int = 4):
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=experts,
                                        num_experts_per_tok=2, vocab_size=100)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    model.set_experts_implementation(implementation)
    return model


def _forward(model, ids=(3, 14, 15, 92, 65)):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_experts_that_would_read_back_run_batched_inside_and_as_before_after(monkeypatch):
    # The CPU stands in for an H100 (the weights' capability), so that the model's eager
    # experts, whose nonzero a capture refuses, are the ones to switch. One token picks 2 of
    # the 8 experts: batched.
    monkeypatch.setattr(experts, "_capability", lambda weight: H100)
    model = _mixtral("eager", experts=8)
    before = _forward(model, (3,))
    with pytest.raises(ReadBack, match="nonzero"), as_captured():
        _forward(model, (3,))
    with experts_on_device(model) as switched_from:
        assert switched_from == "eager in float32"
        assert model.get_experts_implementation()[""] == experts.ON_DEVICE
        with as_captured():  # (a read-back raises ReadBack here, as above)
            inside = _forward(model, (3,))
    assert model.get_experts_implementation()[""] == "eager"  # the caller's model, as it was
    # the same sums, but for the order of rounding (batched_mm adds the top-k in float32)
    torch.testing.assert_close(inside, before, rtol=1e-5, atol=1e-5)
    assert torch.equal(_forward(model, (3,)), before)


@pytest.mark.parametrize("pairs, tokens, num_experts, expected", [
    (2, 1, 8, "batched"),  # a decode step at batch 1, top 2 of 8
    (4, 2, 8, "dense"),  # batched_mm would move 12 experts' weights where dense reads 8
    (16, 8, 8, "dense"),  # batch 8
    (10, 5, 8, "dense"),  # five beams
    (8, 1, 64, "batched"),  # top 8 of 64: batch 1 and 2 batched, batch 4 dense
    (16, 2, 64, "batched"),
    (32, 4, 64, "dense"),
    (2 * DENSE_TOKENS, DENSE_TOKENS, 8, "dense"),
    (2 * DENSE_TOKENS + 2, DENSE_TOKENS + 1, 8, "given"),  # a prompt: its arithmetic 4x over
    (8 * 512, 512, 16384, "batched"),  # (few pairs of very many experts, whatever the tokens)
])
def test_which_way_a_call_runs(pairs, tokens, num_experts, expected):
    assert way(pairs, tokens, num_experts) == expected


def test_a_call_of_more_pairs_than_experts_runs_densely_on_the_device(monkeypatch):
    # Five tokens pick 10 (token, expert) pairs of 4 experts: gathering their weights would
    # copy more than the layer holds, so every token runs through every expert, weighted by
    # its routing, without reading back; the sums are the eager loop's up to rounding.
    monkeypatch.setattr(experts, "_capability", lambda weight: H100)
    model = _mixtral("eager")
    before = _forward(model)
    with experts_on_device(model) as switched_from:
        assert switched_from == "eager in float32"
        with as_captured():
            inside = _forward(model)
    torch.testing.assert_close(inside, before, rtol=1e-5, atol=1e-5)
    assert torch.equal(_forward(model), before)


def test_a_call_of_more_tokens_than_the_dense_bound_runs_as_given(monkeypatch):
    # Over DENSE_TOKENS (a prompt; grape.generate then runs it eagerly, before each launch),
    # the model's own experts run, bit for bit, and read back as before.
    monkeypatch.setattr(experts, "_capability", lambda weight: H100)
    monkeypatch.setattr(experts, "DENSE_TOKENS", 4)
    model = _mixtral("eager")
    before = _forward(model)
    with experts_on_device(model) as switched_from:
        assert switched_from == "eager in float32"
        assert torch.equal(_forward(model), before)  # the eager loop's own arithmetic
        with pytest.raises(ReadBack, match="nonzero"), as_captured():
            _forward(model)


def test_grouped_experts_run_grouped_over_the_bounds_and_on_the_device_under_them(monkeypatch):
    # grouped_mm in float32 reads the experts' offsets back on a GPU (PyTorch's loop over
    # them); over the dense bound it still runs, bit for bit; under it, batched_mm's sums
    # for one token of 8 experts, dense sums for five
    monkeypatch.setattr(experts, "_capability", lambda weight: H100)
    model = _mixtral("grouped_mm", experts=8)
    prompt, one = _forward(model), _forward(model, (3,))
    with experts_on_device(model) as switched_from:
        assert switched_from == "grouped_mm in float32"
        torch.testing.assert_close(_forward(model, (3,)), one, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_forward(model), prompt, rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(experts, "DENSE_TOKENS", 4)
        assert torch.equal(_forward(model), prompt)
    assert model.get_experts_implementation()[""] == "grouped_mm"


def _experts_model_types() -> list[str]:
    """The model types whose modeling file has transformers' experts dispatch."""
    import importlib.util

    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING_NAMES,
        model_type_to_module_name,
    )

    found = []
    for model_type in CONFIG_MAPPING_NAMES:
        name = model_type_to_module_name(model_type)
        spec = importlib.util.find_spec(f"transformers.models.{name}.modeling_{name}")
        if spec is not None and spec.origin and "@use_experts_implementation" in Path(
                spec.origin).read_text():
            found.append(model_type)
    return found


def test_dense_experts_sum_what_batched_mm_sums_in_every_architecture_with_experts():
    # Every layout transformers' experts take (gate and up concatenated or interleaved,
    # transposed weights, biases, no gate, a model's own gate with its clamps), as built from
    # each architecture's small config: the same sums as batched_mm's, up to rounding.
    import sys

    from transformers.integrations.moe import batched_mm_experts_forward

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import arch_sweep

    checked, layouts = [], set()
    for model_type in _experts_model_types():
        try:
            model = arch_sweep.build(model_type, "cpu", torch.float32)
        except arch_sweep.NotBuilt:  # (a vision or audio part, no causal LM to build)
            continue
        for module in experts._experts(model)[:1]:
            down = module.down_proj
            hidden = down.shape[-1] if module.is_transposed else down.shape[-2]
            generator = torch.Generator().manual_seed(1)
            tokens = torch.randn(6, hidden, generator=generator)
            index = torch.stack([torch.randperm(module.num_experts, generator=generator)[:2]
                                 for _ in range(6)])
            weights = torch.rand(6, 2, generator=generator)
            with torch.no_grad():
                batched = batched_mm_experts_forward(module, tokens, index, weights)
                dense = dense_experts_forward(module, tokens, index, weights)
            torch.testing.assert_close(dense, batched, rtol=1e-5,
                                       atol=1e-5 * float(batched.abs().max()))
            checked.append(model_type)
            layouts.add((module.has_gate, module.has_bias, module.is_transposed,
                         module.is_concatenated))
    # (transformers 5.17 builds 45 such causal LMs from the sweep's configs, in 3 layouts:
    # gated and concatenated; gated, biased, transposed and interleaved; ungated)
    assert len(checked) >= 20 and len(layouts) >= 3, (checked, layouts)


def test_dense_experts_run_in_chunks_that_hold_at_most_dense_bytes(monkeypatch):
    # 8 experts of 64 (gated: 128 up) over 32 wide, fp32: a token's products are
    # 8 * (128 + 64 + 32 + 32) * 4 = 8192 bytes; a bound of 3 tokens' runs 7 tokens as 3, 3, 1,
    # each token's sums as in one call
    module = _mixtral("eager", experts=8).model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randn(7, 32, generator=generator)
    index = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=generator)
    per_token = experts._dense_bytes_per_token(module, tokens, weights)
    assert per_token == 8192
    with torch.no_grad():
        whole = dense_experts_forward(module, tokens, index, weights)
        sizes = []
        dense = experts._dense
        monkeypatch.setattr(experts, "_dense",
                            lambda m, h, i, w: sizes.append(h.size(0)) or dense(m, h, i, w))
        monkeypatch.setattr(experts, "DENSE_BYTES", 3 * per_token + 1)
        chunked = dense_experts_forward(module, tokens, index, weights)
    assert sizes == [3, 3, 1]
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])
def test_dense_experts_in_bf16_weight_as_batched_mm_weights(weights_dtype):
    # Routers hand their weights in the model's dtype or in float32; each product is weighted
    # in the promoted dtype, as batched_mm weights it, and the result keeps the hidden states'
    # dtype (on the CPU the two ways' sums came out bit for bit; 2 ulp of bf16 allowed here)
    from transformers.integrations.moe import batched_mm_experts_forward

    module = _mixtral("eager", experts=8).model.layers[0].mlp.experts.to(torch.bfloat16)
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randn(6, 32, generator=generator).to(torch.bfloat16)
    index = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=generator).to(weights_dtype)
    with torch.no_grad():
        batched = batched_mm_experts_forward(module, tokens, index, weights)
        dense = dense_experts_forward(module, tokens, index, weights)
    assert dense.dtype == batched.dtype == torch.bfloat16
    torch.testing.assert_close(dense.float(), batched.float(), rtol=2 ** -7, atol=1e-6)


def test_experts_that_run_on_the_device_and_models_without_experts_are_left_alone(monkeypatch):
    monkeypatch.setattr(experts, "_capability", lambda weight: H100)
    model = _mixtral("batched_mm")
    with experts_on_device(model) as switched_from:
        assert switched_from is None
        assert model.get_experts_implementation()[""] == "batched_mm"  # as it was
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2,
                                                                vocab_size=100))
    with experts_on_device(gpt2) as switched_from:
        assert switched_from is None


def test_on_the_cpu_nothing_is_switched():
    # (the host loop there keeps generate's arithmetic: bit for bit, tests/test_torch_generation)
    model = _mixtral("eager")
    with experts_on_device(model) as switched_from:
        assert switched_from is None
        assert model.get_experts_implementation()[""] == "eager"


def test_the_host_loop_runs_the_experts_as_the_launch_would(monkeypatch):
    # The host loop drives the step a launch captures: its decode steps run batched_mm (one
    # row picks 2 of 8 experts), the prompt the model's own experts (over a dense bound made
    # small here), and the model is left as it was. The tokens are generate's up to a
    # near-tie.
    from grape.torch.host_loop import generate_on_host
    from tests.ties import parted_beyond_a_tie

    monkeypatch.setattr(experts, "_capability", lambda weight: H100)
    monkeypatch.setattr(experts, "DENSE_TOKENS", 4)
    model = _mixtral("eager", experts=8)
    ran = []
    original = experts._on_device

    def counting(module, hidden_states, top_k_index, top_k_weights):
        ran.append(way(top_k_index.numel(), hidden_states.size(0), module.num_experts))
        return original(module, hidden_states, top_k_index, top_k_weights)

    # (the implementation grape registers with transformers, counted)
    from transformers.integrations.moe import ExpertsInterface

    monkeypatch.setitem(ExpertsInterface._global_mapping, experts.ON_DEVICE, counting)
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    out = generate_on_host(model, ids, max_new_tokens=6, do_sample=False)
    assert model.get_experts_implementation()[""] == "eager"
    assert set(ran) == {"batched", "given"}  # steps batched, the prompt as given
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
    assert parted_beyond_a_tie(out, ref, 5, tie=1e-4) is None


def test_every_switches_experts_that_run_on_the_device_too(monkeypatch):
    # bf16's grouped GEMM reads nothing back on an H100, so it is left as it is, unless every
    # experts layer is asked for (grape.generate(switch_experts=True)); other libraries'
    # kernels never are
    monkeypatch.setattr(experts, "_capability", lambda weight: H100)
    model = _mixtral("grouped_mm", experts=8).to(torch.bfloat16)
    with experts_on_device(model) as switched_from:
        assert switched_from is None
    with experts_on_device(model, every=True) as switched_from:
        assert switched_from == "grouped_mm in bfloat16"
        assert model.get_experts_implementation()[""] == experts.ON_DEVICE
        with as_captured():
            _forward(model, (3,))
    assert model.get_experts_implementation()[""] == "grouped_mm"
    model.set_experts_implementation("batched_mm")
    with experts_on_device(model, every=True) as switched_from:
        assert switched_from is None


def test_switch_experts_takes_true_false_or_none():
    from grape.errors import GrapeError
    from grape.torch.api import generate

    with pytest.raises(GrapeError, match="expected switch_experts to be True, False or None, "
                                         "found 'yes'"):
        generate(_mixtral("eager"), torch.tensor([[3, 14]]), max_new_tokens=2,
                 switch_experts="yes")
