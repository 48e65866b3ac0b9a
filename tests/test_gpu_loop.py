"""Loops on the device: a WHILE node around a captured PyTorch body, on a real GPU."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from grape.errors import GrapeError  # noqa: E402
from tests.benchrun import run_benchmark  # noqa: E402


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")


def _counter(limit):
    x = torch.zeros(1, device="cuda")
    running = torch.ones((), dtype=torch.bool, device="cuda")

    def body():
        x.add_(1)
        torch.lt(x[0], limit, out=running)

    body()  # eager warm-up, then back to the start
    x.zero_()
    running.fill_(True)
    return x, running, body


@pytest.mark.parametrize(("limit", "bound", "expected"), [(10, 100, 10), (10, 3, 3), (1, 5, 1)])
def test_a_device_loop_runs_until_its_condition_or_its_bound(cuda, limit, bound, expected):
    from grape.torch.loop import DeviceLoop

    x, running, body = _counter(limit)
    loop = DeviceLoop(body, running, bound)
    try:
        for _ in range(2):  # launches repeat: the bound is reset by the graph itself
            x.zero_()
            running.fill_(True)
            loop.launch()
            torch.cuda.synchronize()
            assert x.item() == expected
    finally:
        loop.close()


def test_bad_conditions_and_bounds_are_refused(cuda):
    from grape.torch.loop import DeviceLoop

    x, running, body = _counter(3)
    with pytest.raises(GrapeError, match="CUDA boolean scalar, found torch.float32"):
        DeviceLoop(body, x, 4)
    with pytest.raises(GrapeError, match="a loop without one is refused"):
        DeviceLoop(body, running, 0)


@pytest.mark.parametrize("prefill_inside", [False, True], ids=["loop", "prefill and loop"])
@pytest.mark.parametrize("eos_at", [None, 5], ids=["no EOS", "EOS"])
def test_greedy_generation_on_the_device_matches_generate(cuda, eos_at, prefill_inside):
    from grape.torch.generate import GreedyDecoder, generate_host_loop
    from grape.torch.loop import DeviceLoop

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=256, n_layer=2, n_head=4, n_positions=256)
    model = transformers.GPT2LMHeadModel(config).cuda().half().eval()
    prompt = torch.randint(0, 50000, (2, 16), device="cuda")
    new = 48
    host = generate_host_loop(GreedyDecoder(model, prompt, new, None, 0))
    eos = None if eos_at is None else int(host[0, eos_at])
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=new, do_sample=False,
                                  eos_token_id=eos, pad_token_id=0)[:, prompt.shape[1]:]
    decoder = GreedyDecoder(model, prompt, new, eos, 0)
    decoder.prefill()
    decoder.step()  # warm-up outside capture
    decoder.prefill()
    loop = DeviceLoop(decoder.step, decoder.running, new, params=dict(model.named_parameters()),
                      prologue=decoder.prefill if prefill_inside else None)
    try:
        for _ in range(2):  # a second generation from the same graph
            decoder.tokens.fill_(-7)  # whatever the last run left is overwritten
            if not prefill_inside:
                decoder.prefill()
            loop.launch()  # the whole generation: one launch, read back once below
            got = decoder.generated()
            assert torch.equal(got, expected)
    finally:
        loop.close()


def test_while_loop_on_the_device_matches_the_eager_loop(cuda):
    from grape.torch.control import while_loop

    def run(on_device):
        x = torch.zeros(4, device="cuda")
        n = torch.zeros((), dtype=torch.long, device="cuda")
        cond = lambda a, k: a.sum() < 50  # noqa: E731
        body = lambda a, k: (a + torch.arange(4, device="cuda"), k + 1)  # noqa: E731
        body(x, n)  # warm-up: nothing may initialise lazily inside a capture
        return while_loop(cond, body, (x, n), 100, on_device=on_device)

    eager, device = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, device, strict=True))
    assert device[1].item() == 9  # 6 per iteration: 54 after the ninth


def test_with_deterministic_kernels_the_captured_step_is_the_eager_step_for_256_tokens(
        cuda, tmp_path):
    # With cuBLAS's default workspace two eager decoders part bitwise after 33-58 steps (seen on
    # the H200), and after a near tie their tokens too: the captured step is held to the eager
    # one where kernels repeat themselves. A fresh process, as cuBLAS reads its workspace
    # setting once; batch 8, where the default kernels made another token at step 93.
    doc = run_benchmark("capture_numerics.py", tmp_path, "--new", "256", "--batch", "8",
                     "--deterministic")
    assert len(doc["steps"]) == 255
    assert doc["first_eager_repeat_difference"] is None
    assert doc["first_logits_difference"] is None
    assert doc["first_token_difference"] is None


def test_with_deterministic_kernels_every_graphed_way_makes_its_reference_tokens(
        cuda, tmp_path):
    # generate with Hugging Face's static cache runs the attention shapes grape's step runs, so
    # with deterministic kernels the host loop and the device loop make its tokens, with and
    # without EOS, over 256 tokens. One launch captures the prefill too, where Hugging Face
    # materialises the causal mask (other attention kernels, other last bits: on the H200 its
    # tokens part from generate's at token 24, batch 1): it is held to the same captured
    # prefill followed by the host loop. A fresh process, as cuBLAS reads its setting once.
    rows = run_benchmark("predication.py", tmp_path, "--new", "256", "--batches", "1",
                      "--deterministic")["results"]
    eager_prefill = [r for r in rows if r["way"] in ("host loop", "device loop")]
    one_launch = [r for r in rows if r["way"] == "one launch"]
    assert len(eager_prefill) == 4 and len(one_launch) == 2
    wrong = [(r["run"], r["way"], r["tokens"], r["first_difference_static"])
             for r in eager_prefill if not r["tokens_identical_static"]]
    wrong += [(r["run"], r["way"], r["tokens"], "against its captured prefill + host loop")
              for r in one_launch if not r["tokens_identical_captured_prefill"]]
    assert not wrong, f"(run, way, tokens made, first token differing): {wrong}"
