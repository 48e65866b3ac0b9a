"""Models whose class has a generate of its own (Whisper's): the wrapper runs as it is, and the
call it makes of GenerationMixin.generate is grape's (grape.torch.own_generate). On the CPU that
call runs grape's host loop, the step a device loop captures, held token for token to the
model's own generate with a static cache."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from transformers import GenerationMixin  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
)
from transformers.generation.stopping_criteria import MaxTimeCriteria  # noqa: E402

from grape.errors import GrapeError  # noqa: E402
from grape.torch.host_loop import generate_on_host, loop_on_host  # noqa: E402
from grape.torch.options import NotGraphable, resolve  # noqa: E402
from grape.torch.own_generate import inner_arguments, owns_generate, routed  # noqa: E402

# Whisper's special tokens, renumbered into a small vocabulary: its generate builds the
# decoder's prompt from these fields of the generation config, as a checkpoint's holds them.
SOT, EOT, NO_TIMESTAMPS = 300, 299, 310
LANGUAGES = {"<|en|>": 301, "<|de|>": 302}
TASKS = {"transcribe": 305, "translate": 304}
BEGIN_SUPPRESSED = [220, EOT]
SUPPRESSED = [1, 2, 7, 8, 9, 10, 14, 25]


def _whisper(boost=()):
    """A small Whisper with a multilingual checkpoint's generation config; ``boost`` raises
    those tokens' logits so that they win every step where they are not suppressed."""
    transformers.logging.set_verbosity_error()
    config = transformers.WhisperConfig(
        d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
        max_source_positions=50, max_target_positions=40, vocab_size=400,
        decoder_start_token_id=SOT, pad_token_id=EOT, bos_token_id=EOT, eos_token_id=EOT)
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=SOT, bos_token_id=EOT, eos_token_id=EOT, pad_token_id=EOT,
        begin_suppress_tokens=BEGIN_SUPPRESSED, suppress_tokens=SUPPRESSED,
        is_multilingual=True, lang_to_id=LANGUAGES, task_to_id=TASKS,
        no_timestamps_token_id=NO_TIMESTAMPS, prev_sot_token_id=308,
        max_initial_timestamp_index=5, return_timestamps=False, max_length=40)
    if boost:
        raised = torch.zeros(config.vocab_size)
        raised[list(boost)] = 100.0
        # (a buffer, so that model.cuda() moves it: the GPU tests build the same model)
        model.proj_out.register_buffer("raised", raised)
        model.proj_out.register_forward_hook(lambda module, args, out: out + module.raised)
    features = torch.randn(2, 16, 100, generator=torch.Generator().manual_seed(0))
    return model, features


def _host_loop(model, args, kwargs):
    """grape's host loop for one call of GenerationMixin.generate (on a GPU grape.generate
    captures the same step in a device loop)."""
    inputs, mask, kw = inner_arguments(model, args, kwargs)
    return loop_on_host(model, inputs, mask, wrapped=True, **kw)


def _through_grape(model, features, made=None, **kwargs):
    """The model's generate with its calls of the generic loop run by grape's host loop; the
    decoder prompts of those calls, and (in ``made``) the new tokens each call made."""
    calls = []

    def handler(model, args, kw):
        calls.append(kw.get("decoder_input_ids"))
        out = _host_loop(model, args, kw)
        if made is not None:
            made.append(out[:, calls[-1].shape[1]:])
        return out
    with routed(model, handler):
        out = model.generate(features, **kwargs)
    return out, calls


WHISPER_CALLS = {
    "greedy, English": {"language": "en"},
    "4 beams, translating to English": {"language": "de", "task": "translate", "num_beams": 4},
    "greedy, language detected": {},
}


@pytest.mark.parametrize("call", list(WHISPER_CALLS))
def test_whispers_own_generate_around_grapes_loop_makes_its_tokens(call):
    model, features = _whisper()
    kwargs = dict(WHISPER_CALLS[call], max_new_tokens=8)
    calls = []
    out = generate_on_host(model, features, calls=calls, **kwargs)
    reference = model.generate(features, cache_implementation="static", **kwargs)
    assert torch.equal(out, reference)
    # One call of the generic loop, with the decoder prompt Whisper built for the call.
    assert len(calls) == 1
    language = LANGUAGES.get(f"<|{kwargs.get('language')}|>")
    if language is not None:
        task = TASKS[kwargs.get("task", "transcribe")]
        assert calls[0].decoder_ids.tolist() == [[SOT, language, task, NO_TIMESTAMPS]] * 2


@pytest.mark.parametrize("num_beams", [1, 3])
def test_whispers_prompt_of_previous_text_is_the_decoder_prompt(num_beams):
    # prompt_ids: Whisper puts its previous-text token and the prompt before the start token;
    # the decoder's prompt grows by them, and Whisper strips them from what it returns.
    model, features = _whisper()
    kwargs = dict(language="en", max_new_tokens=8, num_beams=num_beams,
                  prompt_ids=torch.tensor([308, 40, 41, 42]))
    calls = []
    out = generate_on_host(model, features, calls=calls, **kwargs)
    assert torch.equal(out, model.generate(features, cache_implementation="static", **kwargs))
    (call,) = calls
    assert call.decoder_ids.tolist() == [[308, 40, 41, 42, SOT, 301, 305, NO_TIMESTAMPS]] * 2


def test_whispers_sampling_repeats_itself_for_a_seed():
    # grape's draws are not torch.multinomial's, so not generate's tokens: its own, again for
    # a seed. What Whisper's wrapper does with them (here: a second call of the loop for a
    # row that ended early, at one seed) follows from the tokens.
    model, features = _whisper()
    kwargs = dict(language="en", do_sample=True, top_k=50, temperature=20.0, max_new_tokens=8)
    runs = {}
    for seed in (3, 3, 4):
        calls = []
        out = generate_on_host(model, features, seed=seed, calls=calls, **kwargs)
        assert calls and all(c.options.strategy == "sample" for c in calls)
        if seed in runs:
            assert torch.equal(out, runs[seed])
        runs[seed] = out
    assert not torch.equal(runs[3], runs[4])


def test_whispers_suppression_objects_act_at_the_lengths_they_name():
    # Token 220 would win every step, and is suppressed only at the first new token (after
    # the four-token prompt); token 7 would win every step, and is suppressed throughout.
    for boost in (220, 7):
        model, features = _whisper(boost=(boost,))
        reference = model.generate(features, language="en", max_new_tokens=5,
                                   cache_implementation="static")
        made = []
        out, _ = _through_grape(model, features, made, language="en", max_new_tokens=5)
        assert torch.equal(out, reference)
        (new,) = made
        assert new.shape == (2, 5) and (new[:, 0] != boost).all()
        assert (new[:, 1:] == 220).all() if boost == 220 else not (new == boost).any()


def test_a_left_padded_decoder_prompt_takes_generates_positions():
    # Whisper makes its decoder's positions from the decoder mask (each token's count of ones
    # before it); from the loop's mask, as long as the whole cache, it would read the zeros of
    # the tail. Left padding makes the positions differ from the columns.
    model, features = _whisper()
    ids = torch.tensor([[SOT, 301, 305, NO_TIMESTAMPS], [EOT, SOT, 301, NO_TIMESTAMPS]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    for kwargs in ({}, {"num_beams": 3}):
        reference = GenerationMixin.generate(
            model, features, decoder_input_ids=ids, decoder_attention_mask=mask,
            max_new_tokens=6, cache_implementation="static", **kwargs)
        ours = _host_loop(model, (features,), dict(decoder_input_ids=ids,
                                                    decoder_attention_mask=mask,
                                                    max_new_tokens=6, **kwargs))
        assert torch.equal(ours, reference)


def test_grape_generate_on_a_cpu_runs_whispers_call_as_it_is_with_one_warning():
    import grape
    from grape.torch.api import last_stats

    model, features = _whisper()
    assert owns_generate(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = grape.generate(model, features, max_new_tokens=5, language="en")
    ours = [str(w.message) for w in caught if "grape.generate" in str(w.message)]
    assert ours == ["grape.generate runs WhisperForConditionalGeneration.generate's call of "
                    "GenerationMixin.generate as it is: the model is on cpu, and graphs need a "
                    "CUDA device"]
    assert torch.equal(out, model.generate(features, max_new_tokens=5, language="en"))
    assert type(model) is transformers.WhisperForConditionalGeneration  # swapped back
    stats = last_stats()
    assert not stats.graphed
    assert stats.reason == "the model is on cpu, and graphs need a CUDA device"


class _NeverCallsTheLoop(transformers.GPT2LMHeadModel):
    def generate(self, input_ids, max_new_tokens, **kwargs):  # a wrapper of its own making
        return torch.cat([input_ids, input_ids[:, -1:].repeat(1, max_new_tokens)], dim=1)


class _CallsTheLoopTwice(transformers.GPT2LMHeadModel):
    def generate(self, input_ids, **kwargs):
        first = super().generate(input_ids, **kwargs)
        return super().generate(first, **kwargs)


def _gpt2(cls):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return cls(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100,
                                       n_positions=64)).eval()


def test_a_generate_that_never_calls_the_generic_loop_runs_as_it_is_and_says_so():
    import grape
    from grape.torch.api import last_stats

    model = _gpt2(_NeverCallsTheLoop)
    ids = torch.tensor([[5, 6, 7]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = grape.generate(model, ids, max_new_tokens=3)
    assert torch.equal(out, torch.tensor([[5, 6, 7, 7, 7, 7]]))
    assert [str(w.message) for w in caught] == [
        "grape.generate ran model.generate as it is: _NeverCallsTheLoop's own generate never "
        "called GenerationMixin.generate, the part grape graphs"]
    assert not last_stats().graphed


def test_each_call_of_the_generic_loop_is_routed_and_counted():
    import grape
    from grape.torch.api import last_stats

    model = _gpt2(_CallsTheLoopTwice)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = grape.generate(model, ids, max_new_tokens=4, pad_token_id=0)
    assert len([w for w in caught if "grape.generate runs" in str(w.message)]) == 2
    assert torch.equal(out, model.generate(ids, max_new_tokens=4, pad_token_id=0))
    assert out.shape == (2, 11)
    # On a CPU both fell back; the host loop takes each as GenerationMixin's would.
    seen = []

    def handler(model, args, kwargs):
        seen.append(args[0].shape[1])
        return _host_loop(model, args, kwargs)
    with routed(model, handler):
        ours = model.generate(ids, max_new_tokens=4, pad_token_id=0)
    assert seen == [3, 7] and torch.equal(ours, out)
    assert not last_stats().graphed


def test_routing_ends_with_the_call_even_when_it_fails():
    model, features = _whisper()

    def failing(model, args, kwargs):
        raise RuntimeError("inside")
    with pytest.raises(RuntimeError, match="inside"), routed(model, failing):
        model.generate(features, max_new_tokens=3, language="en")
    assert type(model) is transformers.WhisperForConditionalGeneration
    with routed(model, failing), pytest.raises(NotGraphable, match="nested"), \
            routed(model, failing):
        pass
    # Another instance of the class is untouched while one is routed.
    other, _ = _whisper()
    with routed(model, failing):
        assert type(other) is transformers.WhisperForConditionalGeneration
        assert other.generate(features, max_new_tokens=2, language="en").shape == (2, 2)


@pytest.mark.parametrize("kwargs, reason", [
    ({"assistant_model": object()}, "assistant_model given to GenerationMixin.generate"),
    ({"prefix_allowed_tokens_fn": lambda i, s: [1]},
     "prefix_allowed_tokens_fn given to GenerationMixin.generate"),
    ({"synced_gpus": True}, "synced_gpus given to GenerationMixin.generate"),
    ({"encoder_outputs": object(), "inputs": None},
     "encoder_outputs given to GenerationMixin.generate"),
    ({"inputs": None}, "GenerationMixin.generate was called without input_features or "
                       "inputs_embeds"),
])
def test_calls_grape_does_not_take_are_named(kwargs, reason):
    model, features = _whisper()
    args = () if "inputs" in kwargs else (features,)
    kwargs = {k: v for k, v in kwargs.items() if k != "inputs"}
    with pytest.raises(NotGraphable, match=f"^{reason}$".replace("(", r"\(").replace(")", r"\)")):
        inner_arguments(model, args, dict(kwargs, max_new_tokens=3))


def test_the_calls_inputs_and_length_are_read_as_generate_reads_them():
    model, features = _whisper()
    inputs, mask, kw = inner_arguments(model, (), {"input_features": features,
                                                   "max_new_tokens": 4})
    assert inputs is features and mask is None and kw == {"max_new_tokens": 4}
    # No max_new_tokens: max_length counts the decoder's start token, as generate counts it.
    config = transformers.GenerationConfig(max_length=9)
    _, _, kw = inner_arguments(model, (features,), {"generation_config": config})
    assert kw["max_new_tokens"] == 8
    with pytest.raises(NotGraphable, match="max_length, not max_new_tokens, with a decoder"):
        inner_arguments(model, (features,), {"generation_config": config,
                                             "decoder_input_ids": torch.tensor([[SOT]] * 2)})


def test_processor_objects_are_the_options_they_stand_for_or_named():
    model = _gpt2(transformers.GPT2LMHeadModel)
    ids = torch.tensor([[5, 6, 7]])
    given = [SuppressTokensLogitsProcessor([3, 4]), SuppressTokensLogitsProcessor([4, 9]),
             SuppressTokensAtBeginLogitsProcessor([11], begin_index=5)]
    options, _ = resolve(model, ids, None, {"max_new_tokens": 4, "logits_processor": given,
                                            "suppress_tokens": [50]})
    # The first object takes the place of the processor the config makes; the second adds.
    assert options.suppressed == (3, 4, 9) and options.begin_suppressed == (11,)
    assert options.begin_at == 5 and options.read_backs == 0
    with pytest.raises(NotGraphable, match="a logits processor grape does not reproduce: "
                                           "TemperatureLogitsWarper"):
        resolve(model, ids, None, {"max_new_tokens": 4,
                                   "logits_processor": [TemperatureLogitsWarper(0.5)]})
    with pytest.raises(NotGraphable, match=r"tokens suppressed at two lengths \(3 and 4\)"):
        resolve(model, ids, None, {"max_new_tokens": 4, "logits_processor": [
            SuppressTokensAtBeginLogitsProcessor([1], 3),
            SuppressTokensAtBeginLogitsProcessor([2], 4)]})
    with pytest.raises(NotGraphable, match="stopping criteria grape does not reproduce: "
                                           "MaxTimeCriteria"):
        resolve(model, ids, None, {"max_new_tokens": 4,
                                   "stopping_criteria": [MaxTimeCriteria(10.0)]})
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    stamps = WhisperTimeStampLogitsProcessor(transformers.GenerationConfig(
        no_timestamps_token_id=90, eos_token_id=2), begin_index=3)
    options, _ = resolve(model, ids, None, {"max_new_tokens": 4, "logits_processor": [
        SuppressTokensLogitsProcessor([3]), stamps]})
    assert options.timestamps == (3, 90, 2, None, True)
    with pytest.raises(NotGraphable, match="a SuppressTokensLogitsProcessor after a "
                                           "WhisperTimeStampLogitsProcessor"):
        resolve(model, ids, None, {"max_new_tokens": 4, "logits_processor": [
            stamps, SuppressTokensLogitsProcessor([3])]})
    with pytest.raises(GrapeError, match="expected logits_processor to be a list"):
        resolve(model, ids, None, {"max_new_tokens": 4, "logits_processor": 3})


@pytest.mark.parametrize("num_beams", [1, 3])
def test_suppression_given_as_objects_makes_generates_tokens(num_beams):
    model = _gpt2(transformers.GPT2LMHeadModel)
    raised = torch.zeros(100)
    raised[[40, 41]] = torch.tensor([100.0, 99.0])  # 40, else 41, would win every step
    model.lm_head.register_forward_hook(lambda module, args, out: out + raised)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    kwargs = dict(max_new_tokens=5, num_beams=num_beams, pad_token_id=0)
    for processors in ([SuppressTokensLogitsProcessor([40])],
                       [SuppressTokensAtBeginLogitsProcessor([40, 41], begin_index=4)]):
        reference = model.generate(ids, logits_processor=processors,
                                   cache_implementation="static", **kwargs)
        ours = _host_loop(model, (ids,), dict(kwargs, logits_processor=processors))
        assert torch.equal(ours, reference)
        made = reference[:, 3:]
        if isinstance(processors[0], SuppressTokensLogitsProcessor):
            assert not (made == 40).any()
        else:  # the second new token (length 4) is free of both; the others are not
            assert not torch.isin(made[:, 1], torch.tensor([40, 41])).any()
            assert (made[:, [0, 2, 3, 4]] == 40).all()


class _PromptsWithEmbeddings(transformers.GPT2LMHeadModel):
    """As multimodal wrappers do (Granite Speech's): the prompt made into embeddings of the
    wrapper's own, then the generic loop over them."""

    def generate(self, input_ids, attention_mask=None, **kwargs):
        with torch.no_grad():
            embeds = self.get_input_embeddings()(input_ids) * 1.5
        return super().generate(inputs_embeds=embeds, attention_mask=attention_mask, **kwargs)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_a_wrapper_that_prompts_with_embeddings_makes_its_tokens(num_beams):
    model = _gpt2(_PromptsWithEmbeddings)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, num_beams=num_beams, pad_token_id=0)
    reference = model.generate(ids, cache_implementation="static", **kwargs)
    seen = []

    def handler(model, args, kw):
        inputs, _, rest = inner_arguments(model, args, kw)
        seen.append((inputs, rest["inputs_embeds"].shape))
        return _host_loop(model, args, kw)
    with routed(model, handler):
        ours = model.generate(ids, **kwargs)
    assert torch.equal(ours, reference) and ours.shape == (2, 6)
    assert seen == [(None, (2, 4, 32))]


@pytest.mark.parametrize("boost", [(), (320,), (315, 320)])
def test_whispers_timestamps_short_and_long_form_make_its_tokens(boost):
    # return_timestamps=True: Whisper passes its WhisperTimeStampLogitsProcessor; three
    # windows of audio (long form) make a call of the loop per window Whisper decides on,
    # each with the whole audio's mask beside the window. Boosted timestamp tokens make the
    # pairing rules act.
    model, features = _whisper(boost=boost)
    audio = torch.cat([features, features.flip(2), features.roll(7, dims=2)], dim=2)
    for source, extra in ((features, {}), (features, {"num_beams": 3}),
                          (audio, {"attention_mask": torch.ones(2, 300, dtype=torch.long)})):
        kwargs = dict(language="en", return_timestamps=True, max_new_tokens=10, **extra)
        calls = []
        ours = generate_on_host(model, source, calls=calls, **kwargs)
        assert torch.equal(ours, model.generate(source, cache_implementation="static",
                                                **kwargs))
        assert all(c.options.timestamps == (3, NO_TIMESTAMPS, EOT, 5, True) for c in calls)
        assert len(calls) == (2 if source is audio else 1)
        assert (ours > NO_TIMESTAMPS).any()  # timestamps were made


@pytest.mark.parametrize("num_beams", [1, 2])
def test_a_batch_of_audio_of_two_lengths_decodes_its_longer_row_alone(num_beams):
    # Whisper drops a row from its windows once its audio is done, and passes the whole
    # batch's mask beside the rows left (its encoder reads no mask): the later window is a
    # call of one row with a mask of two, which the loop takes as it is.
    model, features = _whisper(boost=(320,))
    audio = torch.cat([features, features.flip(2), features.roll(7, dims=2)], dim=2)
    mask = torch.ones(2, 300, dtype=torch.long)
    mask[1, 60:] = 0
    kwargs = dict(language="en", return_timestamps=True, max_new_tokens=10,
                  attention_mask=mask, num_beams=num_beams)
    calls = []
    ours = generate_on_host(model, audio, calls=calls, **kwargs)
    assert torch.equal(ours, model.generate(audio, cache_implementation="static", **kwargs))
    assert [c.decoder_ids.shape[0] for c in calls] == [2, 1]



@pytest.mark.parametrize("num_beams", [1, 2])
def test_long_form_conditioned_on_the_previous_window_makes_its_tokens(num_beams):
    # condition_on_prev_tokens=True: Whisper puts the previous window's text before each later
    # window's start token, so the second call's decoder prompt is longer than the first's (a
    # shape of its own: on a GPU, an executable of its own).
    model, features = _whisper(boost=(320,))
    audio = torch.cat([features, features.flip(2), features.roll(7, dims=2)], dim=2)
    kwargs = dict(language="en", return_timestamps=True, max_new_tokens=10,
                  attention_mask=torch.ones(2, 300, dtype=torch.long),
                  condition_on_prev_tokens=True, num_beams=num_beams)
    calls = []
    ours = generate_on_host(model, audio, calls=calls, **kwargs)
    assert torch.equal(ours, model.generate(audio, cache_implementation="static", **kwargs))
    assert len(calls) == 2 and calls[1].decoder_ids.shape[1] > calls[0].decoder_ids.shape[1]
    assert calls[1].decoder_ids[0, 0].item() == 308  # the previous-text token leads

def test_whispers_long_form_segments_are_its_own():
    # return_segments=True: Whisper asks the loop for its return dict and cuts each window's
    # tokens into timed segments; grape's dicts give the same segments, window by window.
    model, features = _whisper(boost=(320,))
    audio = torch.cat([features, features.flip(2), features.roll(7, dims=2)], dim=2)
    kwargs = dict(language="en", return_timestamps=True, max_new_tokens=10,
                  attention_mask=torch.ones(2, 300, dtype=torch.long), return_segments=True)
    reference = model.generate(audio, cache_implementation="static", **kwargs)
    ours = generate_on_host(model, audio, **kwargs)
    assert torch.equal(ours["sequences"], reference["sequences"])
    pairs = [(a, b) for r, o in zip(reference["segments"], ours["segments"], strict=True)
             for a, b in zip(r, o, strict=True)]
    assert len(pairs) > 2  # several segments a row
    for a, b in pairs:
        for key in ("start", "end", "tokens", "idxs"):
            assert (torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor)
                    else a[key] == b[key]), key


def _no_speech_recorded(run):
    """What ``run()`` returns, and the no-speech probabilities each WhisperNoSpeechDetection
    recorded on a first step under generate (none are recorded where grape runs the call)."""
    from transformers.generation.logits_process import WhisperNoSpeechDetection

    seen, call = [], WhisperNoSpeechDetection.__call__

    def recording(self, input_ids, scores):
        out = call(self, input_ids, scores)
        if input_ids.shape[1] == self.begin_index:
            seen.append(self.no_speech_prob)
        return out
    WhisperNoSpeechDetection.__call__ = recording
    try:
        return run(), seen
    finally:
        WhisperNoSpeechDetection.__call__ = call


def _noting_no_speech(monkeypatch):
    """The probabilities grape records for each call of the loop, as it records them (the
    detector is one object across a long audio's windows)."""
    import grape.torch.host_loop as host_loop

    recorded, note = [], host_loop.note_no_speech

    def noting(options):
        note(options)
        recorded.append(options.no_speech.no_speech_prob)
    monkeypatch.setattr(host_loop, "note_no_speech", noting)
    return recorded


NO_SPEECH_AUDIO = {"30 s": {}, "30 s, 3 beams": {"num_beams": 3},
                   "90 s in windows, timestamps": {"return_timestamps": True}}


@pytest.mark.parametrize("audio", list(NO_SPEECH_AUDIO))
@pytest.mark.parametrize("thresholds", [(0.0, 0.0), (1.0, 0.0), ("between", 0.0),
                                        (0.0, -100.0)])
def test_whispers_no_speech_detection_skips_what_generate_skips(audio, thresholds,
                                                                monkeypatch):
    # no_speech_threshold: Whisper passes a WhisperNoSpeechDetection, which changes no score
    # and records on the first step the probability of its no-speech token; after the call,
    # Whisper skips a window where it exceeds the threshold and the tokens' mean log-probability
    # is below logprob_threshold. Thresholds: every row skipped, none, the rows split (between
    # their probabilities), none for want of a low log-probability.
    model, features = _whisper()
    extra = dict(NO_SPEECH_AUDIO[audio])
    source = features
    if "return_timestamps" in extra:
        source = torch.cat([features, features.flip(2), features.roll(7, dims=2)], dim=2)
        extra["attention_mask"] = torch.ones(2, 300, dtype=torch.long)
    no_speech, logprob = thresholds
    kwargs = dict(language="en", max_new_tokens=8, temperature=0.0,
                  logprob_threshold=logprob, **extra)
    if no_speech == "between":
        _, (probs, *_) = _no_speech_recorded(lambda: model.generate(
            source, no_speech_threshold=0.5, **kwargs))
        assert probs[0] != probs[1]
        no_speech = float(probs.mean())
    reference, seen = _no_speech_recorded(lambda: model.generate(
        source, cache_implementation="static", no_speech_threshold=no_speech, **kwargs))
    recorded = _noting_no_speech(monkeypatch)
    ours = generate_on_host(model, source, no_speech_threshold=no_speech, **kwargs)
    assert torch.equal(ours, reference)
    # Each call's probabilities are those generate's processor recorded, bit for bit.
    assert len(recorded) == len(seen) >= 1
    assert all(torch.equal(a, b) for a, b in zip(recorded, seen, strict=True))
    if thresholds == (0.0, 0.0):
        assert ours.shape[1] == 0  # every window skipped as silence
    elif thresholds[0] == "between":
        assert ours.shape[1] > 0


@pytest.mark.parametrize("num_beams", [1, 3])
def test_no_speech_after_a_one_token_decoder_prompt_reads_the_first_steps_scores(num_beams):
    # An English-only Whisper with timestamps prompts its decoder with the start token alone;
    # the processor then reads the first step's scores (log-probabilities, one row per beam, in
    # a beam search) rather than running the model over the prompt.
    model, features = _whisper()
    config = model.generation_config
    config.is_multilingual = False
    del config.lang_to_id, config.task_to_id
    kwargs = dict(return_timestamps=True, max_new_tokens=8, temperature=0.0,
                  no_speech_threshold=0.5, logprob_threshold=-1.0, num_beams=num_beams)
    reference, seen = _no_speech_recorded(lambda: model.generate(
        features, cache_implementation="static", **kwargs))
    calls = []
    ours = generate_on_host(model, features, calls=calls, **kwargs)
    assert torch.equal(ours, reference)
    (call,) = calls
    assert call.decoder_ids.tolist() == [[SOT]] * 2
    assert call.options.no_speech.start_of_trans_offset == 1
    # Bit for bit: the encoder once per prompt and the decoder over every beam, as generate
    # runs them (over the prompts alone and repeated, one float32 step apart on an Intel Xeon)
    assert torch.equal(call.options.no_speech.no_speech_prob, seen[0])
    assert seen[0].shape == (2 * num_beams,)


def test_a_no_speech_detector_is_taken_only_where_grape_gives_it_what_it_reads():
    from transformers.generation.logits_process import WhisperNoSpeechDetection

    model, features = _whisper()
    detector = WhisperNoSpeechDetection(no_speech_token=309, begin_index=1)
    resolved = {"max_new_tokens": 4}
    options, _ = resolve(model, features, None, dict(resolved, logits_processor=[
        detector, SuppressTokensLogitsProcessor([3])]), wrapped=True)
    assert options.no_speech is detector and options.suppressed == (3,)
    # After a processor that changes scores, on a one-token prompt it would read those.
    with pytest.raises(NotGraphable, match="a WhisperNoSpeechDetection after other logits "
                                           "processors"):
        resolve(model, features, None, dict(resolved, logits_processor=[
            SuppressTokensLogitsProcessor([3]), detector]), wrapped=True)


def test_the_timestamp_rules_are_the_processors_bit_for_bit():
    # Random histories (text and timestamp tokens, at and after the begin index) and random
    # scores through Whisper's processor and grape's rules on the device's tensors.
    from types import SimpleNamespace

    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    from grape.torch.decoding import Decoder

    g = torch.Generator().manual_seed(0)
    width, rows, begin, head = 60, 6, 3, 3
    config = transformers.GenerationConfig(no_timestamps_token_id=40, eos_token_id=30,
                                           max_initial_timestamp_index=4)
    processor = WhisperTimeStampLogitsProcessor(config, begin_index=begin)
    acted = {"first token": 0, "after a pair": 0, "after a lone timestamp": 0,
             "timestamps outweigh text": 0}
    for trial in range(300):
        made = int(torch.randint(0, 8, (), generator=g))
        # text below 30, EOS 30, timestamps from 41, with a row of no timestamps
        tokens = torch.where(torch.rand(rows, head + made, generator=g) < 0.5,
                             torch.randint(0, 30, (rows, head + made), generator=g),
                             torch.randint(41, width, (rows, head + made), generator=g))
        tokens[0, head:] = torch.randint(0, 30, (made,), generator=g)
        scores = torch.randn(rows, width, generator=g) * (1 + trial % 5)
        history = torch.zeros(rows, head + 10, dtype=torch.long)
        history[:, :head + made] = tokens
        fake = SimpleNamespace(
            options=SimpleNamespace(timestamps=(begin, 40, 30, 4, True)), history=history,
            count=torch.tensor([made]), head_len=head)
        expected = processor(tokens, scores.clone())
        assert torch.equal(Decoder._timestamped(fake, scores.clone()), expected), trial
        # which rules the rows met (read off the tokens and the processor's output)
        stamps = tokens[:, head:] > 40
        last = stamps[:, -1] if made else torch.zeros(rows, dtype=torch.bool)
        before = stamps[:, -2] if made >= 2 else torch.ones(rows, dtype=torch.bool)
        acted["first token"] += rows * (made == 0)
        acted["after a pair"] += int((last & before).sum())
        acted["after a lone timestamp"] += int((last & ~before).sum())
        no_text = (expected[:, :41] == -float("inf")).all(dim=1)
        acted["timestamps outweigh text"] += int((no_text & ~last).sum()) * (made > 0)
    assert all(count > 10 for count in acted.values()), acted


def _seamless(cls_name):
    transformers.logging.set_verbosity_error()
    config = transformers.SeamlessM4TConfig(
        vocab_size=300, t2u_vocab_size=100, hidden_size=64, encoder_layers=1, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, speech_encoder_layers=1, speech_encoder_attention_heads=4,
        speech_encoder_intermediate_size=128, feature_projection_input_dim=16,
        adaptor_kernel_size=8, adaptor_stride=8, num_adapter_layers=1, t2u_encoder_layers=1,
        t2u_decoder_layers=1, t2u_encoder_attention_heads=2, t2u_decoder_attention_heads=2,
        t2u_encoder_ffn_dim=64, t2u_decoder_ffn_dim=64, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=2, eos_token_id=3, decoder_start_token_id=3)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config).eval()
    model.generation_config.text_decoder_lang_to_code_id = {"eng": 7, "fra": 8}
    g = torch.Generator().manual_seed(0)
    source = (torch.randn(2, 40, 16, generator=g) if "Speech" in cls_name
              else torch.randint(5, 290, (2, 9), generator=g))
    return model, source


@pytest.mark.parametrize("kwargs", [{}, {"tgt_lang": "fra"}, {"tgt_lang": "eng", "num_beams": 3}])
@pytest.mark.parametrize("cls_name", ["SeamlessM4TForSpeechToText", "SeamlessM4TForTextToText"])
def test_seamless_m4ts_own_generate_around_grapes_loop_makes_its_tokens(cls_name, kwargs):
    # Another family's own generate: SeamlessM4T puts the target language's token after the
    # decoder's start token, then calls the generic loop once.
    model, source = _seamless(cls_name)
    reference = model.generate(source, max_new_tokens=6, cache_implementation="static",
                               **kwargs)
    calls = []
    ours = generate_on_host(model, source, max_new_tokens=6, calls=calls, **kwargs)
    assert torch.equal(ours, reference) and len(calls) == 1
    if "tgt_lang" in kwargs:
        language = {"eng": 7, "fra": 8}[kwargs["tgt_lang"]]
        assert calls[0].decoder_ids.tolist() == [[3, language]] * 2


def _read_back_cases():
    from tests.test_torch_generation import CONFIGS, _built, _embedded, _llava, _prompt

    model, features = _whisper(boost=(320,))
    audio = torch.cat([features, features.flip(2), features.roll(7, dims=2)], dim=2)
    yield "Whisper, timestamps, 3 beams", model, (features,), dict(
        language="en", return_timestamps=True, num_beams=3)
    yield "Whisper, long form", model, (audio,), dict(
        language="en", return_timestamps=True, attention_mask=torch.ones(2, 300,
                                                                          dtype=torch.long))
    seamless, source = _seamless("SeamlessM4TForSpeechToText")
    yield "SeamlessM4T speech", seamless, (source,), dict(tgt_lang="fra")
    llava, ids, mask, pixels = _llava()
    yield "LLaVA", llava, (ids, mask), dict(pixel_values=pixels)
    gpt2 = _built("gpt2", CONFIGS["gpt2"])
    ids, mask = _prompt()
    yield "GPT-2, a prompt of embeddings", gpt2, (None, mask), dict(
        inputs_embeds=_embedded(gpt2, ids), num_beams=2)


def test_the_new_paths_steps_read_nothing_back_as_a_capture_sees_them():
    # Each call of the loop's step, after an eager one, run as a capture would see it
    # (grape.torch.readback): a value read back would break the capture on a GPU.
    from grape.torch.readback import as_captured

    for name, model, args, kwargs in _read_back_cases():
        calls = []
        generate_on_host(model, *args, calls=calls, max_new_tokens=8, **kwargs)
        assert calls, name
        for call in calls:
            decoder = call.again()
            decoder.step()
            with as_captured():
                decoder.step()  # raises ReadBack at the model's line where one reads back
