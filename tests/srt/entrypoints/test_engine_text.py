"""Text features of the Engine with the embedded tiny model and tokenizer: stop strings (cut
before the string unless no_stop_trim), stop-token trimming, streamed text."""

from __future__ import annotations

import pytest

import srt

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 16}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine():
    eng = srt.Engine(device="cpu", max_total_tokens=1024)
    if eng.tokenizer is None:
        pytest.skip("tiny tokenizer not shipped")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def full(engine):
    return engine.generate(prompt=PROMPT, sampling_params=GREEDY)


def _stop_string(text: str) -> str:
    """A stop string taken from the middle of the greedy text (first occurrence matters)."""
    s = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(s) == 3 and s.strip()
    return s


def test_stop_string_cuts_text_before_it(engine, full):
    s = _stop_string(full["text"])
    out = engine.generate(prompt=PROMPT, sampling_params=dict(GREEDY, stop=s))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": s}
    assert out["text"] == full["text"][: full["text"].find(s)]
    n = len(out["output_ids"])
    assert n < len(full["output_ids"]) and out["output_ids"] == full["output_ids"][:n]
    kept = engine.generate(prompt=PROMPT, sampling_params=dict(GREEDY, stop=[s], no_stop_trim=True))
    assert kept["text"].startswith(full["text"][: full["text"].find(s) + len(s)])
    assert kept["output_ids"] == out["output_ids"]


def test_stop_token_is_dropped_from_text(engine, full):
    tok = full["output_ids"][2]
    out = engine.generate(prompt=PROMPT, sampling_params=dict(GREEDY, stop_token_ids=[tok]))
    k = full["output_ids"].index(tok)
    assert out["output_ids"] == full["output_ids"][: k + 1]
    assert out["text"] == engine.tokenizer.decode(full["output_ids"][:k], skip_special_tokens=True)
    kept = engine.generate(
        prompt=PROMPT, sampling_params=dict(GREEDY, stop_token_ids=[tok], no_stop_trim=True)
    )
    assert kept["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_streamed_text_is_cumulative_by_default(engine, full):
    """SGLang's default: every chunk has the whole text so far (clients slice text[prev:])."""
    chunks = list(engine.generate(prompt=PROMPT, sampling_params=GREEDY, stream=True))
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    s = _stop_string(full["text"])
    cut = engine.generate(prompt=PROMPT, sampling_params=dict(GREEDY, stop=s))
    streamed = list(
        engine.generate(prompt=PROMPT, sampling_params=dict(GREEDY, stop=s), stream=True)
    )
    assert all(s not in c["text"] for c in streamed)  # the stop string never streamed
    assert streamed[-1]["text"] == cut["text"]


def test_incremental_streamed_text_adds_up(full):
    eng = srt.Engine(device="cpu", max_total_tokens=256, incremental_streaming_output=True)
    chunks = list(eng.generate(prompt=PROMPT, sampling_params=GREEDY, stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
    s = _stop_string(full["text"])
    cut = eng.generate(prompt=PROMPT, sampling_params=dict(GREEDY, stop=s))
    streamed = list(eng.generate(prompt=PROMPT, sampling_params=dict(GREEDY, stop=s), stream=True))
    assert "".join(c["text"] for c in streamed) == cut["text"]
    eng.shutdown()


def test_empty_text_prompt_is_refused_before_it_runs(engine):
    """Issue 50: "" (alone or in a list) reached the forward step and failed it for all."""
    steps = engine.scheduler.num_prefill_steps
    with pytest.raises(ValueError, match="prompt '' is empty: it encodes to no tokens"):
        engine.generate(prompt="", sampling_params=GREEDY)
    with pytest.raises(ValueError, match="request 1: prompt '' is empty"):
        engine.generate(prompt=["hi", ""], sampling_params=GREEDY)
    assert engine.scheduler.num_prefill_steps == steps
    assert engine.generate(prompt=["hi"], sampling_params=dict(GREEDY, max_new_tokens=2))


@pytest.mark.parametrize("stop", [5, {"a": 1}, ["x", 3]])
def test_stop_of_the_wrong_type_is_refused(engine, stop):
    """A dict is not taken as its keys; an int is a TypeError naming stop, not "not iterable"."""
    with pytest.raises(TypeError, match="stop must be a string or a list"):
        engine.generate(prompt=PROMPT, sampling_params=dict(GREEDY, stop=stop))


def test_stop_strings_need_a_tokenizer():
    eng = srt.Engine(device="cpu", max_total_tokens=256, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        eng.generate(input_ids=[1, 2], sampling_params={"stop": "x", "max_new_tokens": 2})


def test_eval_engine_io_gets_rejections_as_errors(engine):
    """srt/eval/engine_io.py retries a refused batch one prompt at a time: an over-long prompt
    becomes an error Completion, the others their texts (no silent empty answer)."""
    from srt.eval.engine_io import generate_completions

    ctx = engine.model_runner.context_len
    prompts = [[5, 6, 7], [4] * (ctx - 3), [8, 9]]  # the second: over the context with 8 new
    sp = dict(GREEDY, max_new_tokens=8)
    done = generate_completions(engine, prompts, sp, batch_size=3)
    assert done[1].text is None and "context length" in done[1].error
    solo = [engine.generate(input_ids=p, sampling_params=sp)["text"] for p in prompts[::2]]
    assert [done[0].text, done[2].text] == solo
