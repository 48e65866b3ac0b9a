"""grape.torch.sampling: generate's top-k and top-p survivors over top-k's candidates alone."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.generation.logits_process import (  # noqa: E402
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grape.torch.sampling import MOST_CANDIDATES, SPARE, CandidateSampler  # noqa: E402
from grape.torch.warpers import DeviceTemperature, DeviceTopP  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture
def stable_sort(monkeypatch):
    # generate's top-p sorts the vocabulary; on a GPU that sort is stable (tied scores in
    # ascending index), on the CPU it is not, so the reference here asks for a stable one.
    unstable = torch.sort

    def sort(input, dim=-1, descending=False, stable=False, **kwargs):
        return unstable(input, dim=dim, descending=descending, stable=True, **kwargs)
    monkeypatch.setattr(torch, "sort", sort)


def _generates_survivors(logits, temperature, top_k, top_p):
    scores = TemperatureLogitsWarper(temperature)(None, logits)
    scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.isfinite(scores)


def _sampler(temperature, top_k, top_p):
    return CandidateSampler(DeviceTemperature(temperature, CPU), top_k,
                            DeviceTopP(top_p, CPU) if top_p < 1 else None)


def _survivors(sampler, logits):
    _, index, kept, overflowed = sampler.candidates(logits)
    survivors = torch.zeros(logits.shape, dtype=torch.bool).scatter_(1, index, kept)
    return survivors, overflowed


@pytest.mark.parametrize("top_k, top_p, temperature", [
    (50, 0.9, 0.8), (50, 1.0, 1.0), (3, 0.5, 1.3), (1, 0.9, 0.7), (200, 0.95, 1.0)])
def test_the_survivors_are_generates_with_ties_everywhere(stable_sort, top_k, top_p,
                                                          temperature):
    g = torch.Generator().manual_seed(top_k)
    sampler = _sampler(temperature, top_k, top_p)
    compared = 0
    for levels in (None, 64, 8):  # scores rounded to bfloat16, or to a few levels: many ties
        logits = torch.randn((16, 3000), generator=g)
        logits = (logits.bfloat16().float() if levels is None
                  else torch.round(logits * levels / 4) * 4 / levels)
        survivors, overflowed = _survivors(sampler, logits)
        expected = _generates_survivors(logits, temperature, top_k, top_p)
        fits = ~overflowed  # (rows whose ties at the k-th outnumber the candidates are said)
        assert torch.equal(survivors[fits], expected[fits]), levels
        compared += int(fits.sum())
    assert compared >= 16


def test_ties_at_the_top_p_cut_keep_the_stable_sorts_order(stable_sort):
    # Four tokens of one score straddle the cut: generate keeps the higher indices (they come
    # last in its ascending sort), which the candidates' order must not change.
    logits = torch.full((1, 100), -5.0)
    logits[0, [10, 40, 70, 90]] = 1.0
    logits[0, 5] = 2.0
    sampler = _sampler(1.0, 5, 0.6)
    survivors, overflowed = _survivors(sampler, logits)
    expected = _generates_survivors(logits, 1.0, 5, 0.6)
    assert not overflowed.any()
    assert 0 < int(expected[0, [10, 40, 70, 90]].sum()) < 4  # the cut falls inside the tie
    assert torch.equal(survivors, expected)


def test_more_ties_at_the_kth_score_than_candidates_are_said():
    logits = torch.zeros((2, 1000))
    logits[0, :5] = 3.0  # row 0: the 10th score ties with the many zeros
    logits[1, :SPARE + 20] = torch.linspace(5, 1, SPARE + 20)  # row 1: no tie
    _, overflowed = _survivors(_sampler(1.0, 10, 0.9), logits)
    assert overflowed.tolist() == [True, False]
    # A top-k as wide as the vocabulary holds every token: nothing can be missed.
    _, overflowed = _survivors(_sampler(1.0, 1000, 0.9), logits)
    assert not overflowed.any()
    # Nothing finite below the k-th: every token there is -inf, and none counts as missed.
    logits = torch.full((1, 1000), -torch.inf)
    logits[0, :3] = torch.tensor([1.0, 2.0, 3.0])
    _, overflowed = _survivors(_sampler(1.0, 10, 0.9), logits)
    assert not overflowed.any()


def test_the_draw_follows_the_survivors_distribution(stable_sort):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn((1, 500), generator=g) * 2
    sampler = _sampler(0.9, 20, 0.8)
    survivors, _ = _survivors(sampler, logits)
    probs = torch.where(survivors, logits.double() / 0.9, -torch.inf).softmax(-1)[0]
    n = 20000
    uniforms = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # evenly over [0, 1)
    tokens = torch.stack([sampler.draw(logits, u.float().view(1, 1))[0] for u in uniforms])
    counts = torch.bincount(tokens.flatten(), minlength=500).double()
    assert counts[~survivors[0]].sum() == 0  # never a removed token
    # An inverse transform over an even grid gives each token its share, to a grid step or two.
    assert (counts - probs * n).abs().max() <= 2, (counts - probs * n).abs().max()


_SIZES = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=2, n_positions=128),
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
    "mixtral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2),
}


def _model(model_type="gpt2"):
    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(
        model_type, **_SIZES[model_type], vocab_size=300, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_which_generations_sample_over_the_candidates():
    from grape.torch.options import resolve

    m = _model()
    ids = torch.randint(30, 300, (2, 5))

    def candidates(**kwargs):
        return resolve(m, ids, None, dict(max_new_tokens=4, **kwargs))[0].samples_candidates
    assert candidates(do_sample=True, top_k=20, top_p=0.9)
    assert candidates(do_sample=True, top_k=20, return_dict_in_generate=True,
                      output_logits=True)
    assert not candidates(do_sample=True, top_k=0, top_p=0.9)  # top-p over the vocabulary
    assert candidates(do_sample=True, top_k=MOST_CANDIDATES - SPARE)
    assert not candidates(do_sample=True, top_k=MOST_CANDIDATES - SPARE + 1)  # pairs: too many
    assert not candidates(do_sample=False)
    assert not candidates(do_sample=True, top_k=20, min_p=0.1)
    assert not candidates(do_sample=True, top_k=20, renormalize_logits=True)
    assert not candidates(do_sample=True, top_k=20, return_dict_in_generate=True,
                          output_scores=True)  # the processed scores are the caller's
    options = resolve(m, ids, None, dict(max_new_tokens=4, do_sample=True, top_k=20))[0]
    again = dataclasses.replace(options, whole_vocabulary=True)
    assert not again.samples_candidates and again.key != options.key  # its own executable


@pytest.mark.parametrize("model_type", list(_SIZES))
def test_a_sampled_generation_draws_generates_survivors_and_repeats_for_a_seed(stable_sort,
                                                                               model_type):
    from grape.torch.host_loop import generate_on_host

    m = _model(model_type)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(30, 300, (3, 6), generator=g)
    kwargs = dict(do_sample=True, top_k=12, top_p=0.8, temperature=0.7, max_new_tokens=10,
                  return_dict_in_generate=True, output_logits=True)
    out = generate_on_host(m, ids, seed=4, **kwargs)
    made = out.sequences[:, ids.shape[1]:]
    for step, logits in enumerate(out.logits):
        allowed = _generates_survivors(logits, 0.7, 12, 0.8)
        assert allowed.gather(1, made[:, step:step + 1]).all(), step
    assert torch.equal(out.sequences, generate_on_host(m, ids, seed=4, **kwargs).sequences)
    assert not torch.equal(out.sequences, generate_on_host(m, ids, seed=5, **kwargs).sequences)


def test_a_generation_whose_ties_outnumbered_the_candidates_is_refused_at_its_result():
    from grape.torch.decoding import TokenDecoder
    from grape.torch.options import resolve
    from grape.torch.sampling import CandidatesOverflowed

    m = _model()
    ids = torch.randint(30, 300, (1, 5))
    options, _ = resolve(m, ids, None, dict(max_new_tokens=3, do_sample=True, top_k=10))
    decoder = TokenDecoder(m, 1, ids.shape[1], options)
    decoder.set_seed(9)
    with torch.no_grad():  # every score alike: 300 tokens tie with the 10th
        m.lm_head.weight.zero_()
        decoder.prefill(ids, None)
    with pytest.raises(CandidatesOverflowed) as raised:
        decoder.result(ids)
    assert raised.value.seed == 9
    with pytest.raises(CandidatesOverflowed):  # (and what the chain would make is exact)
        decoder.result(ids)
    chain = TokenDecoder(m, 1, ids.shape[1], dataclasses.replace(options, whole_vocabulary=True))
    chain.set_seed(9)
    chain.prefill(ids, None)
    assert chain.result(ids).shape == (1, ids.shape[1] + 1)


def test_the_host_loop_makes_a_generation_whose_ties_outnumbered_the_candidates_again():
    from grape.torch.host_loop import generate_on_host

    m = _model()
    with torch.no_grad():
        m.lm_head.weight.zero_()  # every score alike
    ids = torch.randint(30, 300, (2, 5))
    calls = []
    kwargs = dict(max_new_tokens=6, do_sample=True, top_k=10, top_p=0.9)
    out = generate_on_host(m, ids, seed=3, calls=calls, **kwargs)
    assert calls[0].options.whole_vocabulary and calls[0].decoder.sampler is None
    # what the warpers over the whole vocabulary make for that seed, from the first token on
    chain = generate_on_host(m, ids, seed=3, **dict(kwargs, top_k=0))
    assert out.shape == chain.shape == (2, 11)
    # top-k of 10 among 300 tied scores keeps all 300 (generate's rule), as top_k=0 does
    assert torch.equal(out, chain)


def test_the_sweep_s_sampled_rows_hold_every_draw_to_generates_survivors(tmp_path):
    # benchmarks/arch_sweep.py --strategies sample: the harness itself, on two architectures
    # (the whole sweep's rows are committed under benchmarks/results/arch_sweep_cpu/).
    from tests.benchrun import run_sweep

    rows = run_sweep(tmp_path, "--host-loop", "--strategies", "sample", "--archs",
                     "gpt2,mixtral", "--new-tokens", "6")
    assert len(rows) == 4
    for row in rows:
        assert row["stage"] == "done" and row["graphed"] and row["candidates"], row
        assert row["draws"] > 0 and row["rows_compared"] >= row["draws"], row
        assert row["survivors_differ"] == 0 and row["same_seed_same_tokens"], row
