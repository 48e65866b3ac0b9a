"""grape.torch.deferred_checks without a GPU: a capture is stood in for (``capturing`` made
true), and the device is the CPU. What is checked: a model's tensor checks are folded into one
device value and raised after the launch as eager code raises them, the first failure first;
device values formatted into messages are not read; outside the block, and without a capture,
PyTorch's own functions run."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import grape.torch.deferred_checks as deferred_checks  # noqa: E402
from grape.torch.deferred_checks import DeferredChecks  # noqa: E402
from grape.torch.readback import ReadBack, as_captured  # noqa: E402


@pytest.fixture
def captured(monkeypatch):
    monkeypatch.setattr(deferred_checks, "capturing", lambda: True)


def _placeholder_check(tokens: torch.Tensor, features: int) -> None:
    # transformers' LLaVA placeholder check, as torch_compilable_check runs it eagerly
    torch._check_tensor_all_with(
        ValueError, tokens == features,
        lambda: f"Image features and image tokens do not match, tokens: {tokens}, "
                f"features: {features}")


def test_a_failed_check_is_raised_after_the_launch_as_eager_code_raises_it(captured):
    checks = DeferredChecks("cpu")
    checks.reset()
    tokens = torch.tensor(3)
    with checks.deferring(), as_captured():
        message = f"tokens: {tokens}"  # formatted, not read
        _placeholder_check(tokens, 3)  # holds
        _placeholder_check(tokens, 5)  # fails: the first failure
        torch._check_tensor_all_with(RuntimeError, tokens < 0, "second failure")
    assert message == "tokens: <scalar torch.int64 on the device>"
    assert int(checks.failed) == 2
    with pytest.raises(ValueError, match=r"^Image features and image tokens do not match, "
                                         r"tokens: <scalar torch.int64 on the device>, "
                                         r"features: 5$"):
        checks.raise_failed()
    checks.reset()  # the next launch, whose checks all hold
    checks.raise_failed()


def test_outside_the_block_or_a_capture_pytorch_reads_and_raises_as_before(monkeypatch):
    checks = DeferredChecks("cpu")
    with checks.deferring():  # no capture
        assert f"{torch.tensor(3)}" == "3"
        with pytest.raises(ValueError, match="tokens: 3"):
            _placeholder_check(torch.tensor(3), 5)
    monkeypatch.setattr(deferred_checks, "capturing", lambda: True)
    with pytest.raises(ReadBack), as_captured():  # a capture, outside the block: a read-back
        f"{torch.tensor(3)}"
    assert not hasattr(torch._check_tensor_all_with, "grape_original")
    assert not hasattr(torch.Tensor.__format__, "grape_original")
    assert checks.recorded == []


def test_a_vision_language_prompt_reads_nothing_back_and_a_mismatch_is_raised_after():
    # LLaVA's prompt checks its image tokens against its image features with a message of
    # device values: on the H100 grape ran it eagerly before every launch, the capture refused.
    # As a capture sees it (grape.torch.readback), it now reads nothing back; an image token
    # too few is raised after the launch as generate raises it. (One too many is a
    # masked_scatter with more places than values, which CUDA's kernel asserts on the device
    # before anything is read: see the module.)
    import warnings

    from grape.torch.host_loop import generate_on_host
    from tests.test_torch_generation import _llava

    model, ids, mask, pixels = _llava()
    calls = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        generate_on_host(model, ids, mask, calls=calls, max_new_tokens=2, pixel_values=pixels)
    call = calls[-1]
    decoder = call.again()
    with as_captured():
        decoder.prefill(call.ids, call.mask, model_inputs=call.model_inputs)
    decoder.checks.raise_failed()  # held
    fewer = call.ids.clone()
    fewer[:, 1] = 5  # 15 image tokens for 16 features
    with as_captured():
        decoder.prefill(fewer, call.mask, model_inputs=call.model_inputs)
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        decoder.checks.raise_failed()


def test_a_check_given_as_a_compilers_hint_keeps_its_callers_type_and_message(captured):
    # Under a capture transformers thinks it is traced, and its torch_compilable_check gives
    # PyTorch the condition alone (torch._check_tensor_all(cond)); its type and message are its
    # own (a function of that name, as transformers' is).
    def torch_compilable_check(cond, msg, error_type=ValueError):
        torch._check_tensor_all(cond)

    checks = DeferredChecks("cpu")
    with checks.deferring():
        torch_compilable_check(torch.tensor(False), "the caller's words")
        torch._check_tensor_all(torch.tensor(False))  # no such caller: PyTorch's own
    assert checks.recorded == [(ValueError, "the caller's words"),
                               (RuntimeError, "Expected cond to be True")]
    with pytest.raises(ValueError, match="^the caller's words$"):
        checks.raise_failed()
