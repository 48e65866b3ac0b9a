"""A streamer given to grape: handed what generate hands it, in generate's order (the sequences'
head, then each step's tokens, then end), held on the CPU through grape's host loop, which
hands each token on as it is made; on a GPU the host follows the one launch instead
(grape.torch.streaming; tests/test_gpu_generate.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from transformers.generation.streamers import BaseStreamer  # noqa: E402

from grape.errors import GrapeError  # noqa: E402
from grape.torch.host_loop import generate_on_host  # noqa: E402
from grape.torch.options import resolve  # noqa: E402
from grape.torch.streaming import TokenFeed  # noqa: E402
from tests.test_torch_generation import CONFIGS, _built, _prompt, _seq2seq  # noqa: E402


class Recording(BaseStreamer):
    """Every call a streamer gets: ("put", a list of the tensor's values) and ("end",)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def put(self, value: torch.Tensor) -> None:
        assert value.device.type == "cpu"
        self.calls.append(("put", value.tolist()))

    def end(self) -> None:
        self.calls.append(("end",))


CALLS = {
    "greedy": {},
    "greedy, EOS in some rows, min_new_tokens": {"eos_token_id": [5, 7, 11, 13, 17, 19, 23],
                                                 "min_new_tokens": 3},
    "two sequences a prompt, sampled with one candidate": {
        "do_sample": True, "top_k": 1, "num_return_sequences": 2},
}


@pytest.mark.parametrize("kind", ["llama", "gpt2", "t5"])
@pytest.mark.parametrize("call", list(CALLS))
def test_a_streamer_is_handed_what_generate_hands_it(kind, call):
    model = _seq2seq("t5") if kind == "t5" else _built(kind, CONFIGS[kind])
    ids, mask = _prompt()
    kwargs = dict(CALLS[call], max_new_tokens=10)
    theirs, ours = Recording(), Recording()
    reference = model.generate(ids, attention_mask=mask, cache_implementation="static",
                               streamer=theirs, **kwargs)
    out = generate_on_host(model, ids, mask, streamer=ours, **kwargs)
    assert torch.equal(out, reference)
    assert ours.calls == theirs.calls
    # the head (the prompt, or the decoder's start token), a put per new token, then end
    head = ours.calls[0][1]
    assert len(head) == out.shape[0] and len(ours.calls) == out.shape[1] - len(head[0]) + 2
    assert ours.calls[-1] == ("end",)


def test_a_text_streamer_prints_what_it_prints_under_generate(capsys):
    from tests.word_tokenizer import word_tokenizer

    model = _built("gpt2", CONFIGS["gpt2"])
    tokenizer = word_tokenizer(300)
    ids = torch.randint(30, 300, (1, 6), generator=torch.Generator().manual_seed(3))
    streamer = transformers.TextStreamer(tokenizer, skip_prompt=True)
    model.generate(ids, max_new_tokens=12, cache_implementation="static", streamer=streamer)
    printed = capsys.readouterr().out
    generate_on_host(model, ids, max_new_tokens=12, streamer=streamer)
    assert capsys.readouterr().out == printed and len(printed.strip()) >= 12


def test_a_streamer_with_beam_search_is_one_line():
    # generate streams no beam search (it raises a ValueError): grape says so, in one line
    model = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    with pytest.raises(GrapeError, match=r"^expected num_beams=1 with a streamer \(generate "
                                         r"streams no beam search\), found num_beams=3$"):
        resolve(model, ids, mask, dict(max_new_tokens=4, num_beams=3, streamer=Recording()))


def test_a_feed_hands_on_each_token_once_in_order_and_the_head_first():
    # What TokenFeed.follow does with each copy it reads while a launch runs: the tokens the
    # count covers, from where it left off; the head once, before them; nothing for a count
    # of zero (the launch's prompt has not run yet).
    streamer = Recording()
    feed = TokenFeed(streamer)
    head = torch.tensor([[4, 5], [6, 7]])
    tokens = torch.tensor([[10, 11, 12, 0], [20, 21, 22, 0]])
    for made in (0, 1, 1, 3, 2):
        if made:
            feed.deliver(head, tokens, made)
    feed.end()
    assert streamer.calls == [("put", [[4, 5], [6, 7]]), ("put", [10, 20]), ("put", [11, 21]),
                              ("put", [12, 22]), ("end",)]
