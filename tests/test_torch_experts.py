"""Experts that read back inside a capture run by transformers' batched_mm while grape
captures (grape.torch.experts), and as before afterwards."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from grape.torch import experts  # noqa: E402
from grape.torch.experts import experts_on_device, reads_back  # noqa: E402
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


def _mixtral(implementation: str):
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=4,
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
    # the 4 experts: within the bound, batched.
    monkeypatch.setattr(experts, "_capability", lambda weight: H100)
    model = _mixtral("eager")
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


def test_a_call_of_more_pairs_than_experts_runs_as_given(monkeypatch):
    # Five tokens pick 10 (token, expert) pairs of 4 experts: gathering their weights would
    # copy more than the layer holds, so the model's own experts run (a prompt; grape.generate
    # then runs it eagerly, before each launch), and read back as before.
    monkeypatch.setattr(experts, "_capability", lambda weight: H100)
    model = _mixtral("eager")
    before = _forward(model)
    with experts_on_device(model) as switched_from:
        assert switched_from == "eager in float32"
        assert torch.equal(_forward(model), before)  # the eager loop's own arithmetic
        with pytest.raises(ReadBack, match="nonzero"), as_captured():
            _forward(model)


def test_grouped_experts_over_the_bound_run_grouped_and_under_it_batched(monkeypatch):
    # grouped_mm in float32 reads the experts' offsets back on a GPU (PyTorch's loop over
    # them); over the bound it still runs, bit for bit, under it batched_mm's sums
    monkeypatch.setattr(experts, "_capability", lambda weight: H100)
    model = _mixtral("grouped_mm")
    prompt, one = _forward(model), _forward(model, (3,))
    with experts_on_device(model) as switched_from:
        assert switched_from == "grouped_mm in float32"
        assert torch.equal(_forward(model), prompt)
        torch.testing.assert_close(_forward(model, (3,)), one, rtol=1e-5, atol=1e-5)
    assert model.get_experts_implementation()[""] == "grouped_mm"


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
    # row picks 2 of 4 experts), the prompt the model's own experts, and the model is left as
    # it was. The tokens are generate's up to a near-tie.
    from grape.torch.host_loop import generate_on_host
    from tests.ties import parted_beyond_a_tie

    monkeypatch.setattr(experts, "_capability", lambda weight: H100)
    model = _mixtral("eager")
    ran = []
    original = experts._batched_when_few

    def counting(module, hidden_states, top_k_index, top_k_weights):
        ran.append(top_k_index.numel() <= module.num_experts)
        return original(module, hidden_states, top_k_index, top_k_weights)

    # (the implementation grape registers with transformers, counted)
    from transformers.integrations.moe import ExpertsInterface

    monkeypatch.setitem(ExpertsInterface._global_mapping, experts.ON_DEVICE, counting)
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    out = generate_on_host(model, ids, max_new_tokens=6, do_sample=False)
    assert model.get_experts_implementation()[""] == "eager"
    assert True in ran and False in ran  # steps batched, the prompt as given
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
    assert parted_beyond_a_tie(out, ref, 5, tie=1e-4) is None
