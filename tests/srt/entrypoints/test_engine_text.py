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


def test_streamed_text_adds_up(engine, full):
    chunks = list(engine.generate(prompt=PROMPT, sampling_params=GREEDY, stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    s = _stop_string(full["text"])
    cut = engine.generate(prompt=PROMPT, sampling_params=dict(GREEDY, stop=s))
    streamed = list(
        engine.generate(prompt=PROMPT, sampling_params=dict(GREEDY, stop=s), stream=True)
    )
    assert "".join(c["text"] for c in streamed) == cut["text"]  # the stop string never streamed


def test_stop_strings_need_a_tokenizer():
    eng = srt.Engine(device="cpu", max_total_tokens=256, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        eng.generate(input_ids=[1, 2], sampling_params={"stop": "x", "max_new_tokens": 2})
