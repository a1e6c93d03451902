"""openai_api's pure translation: usage counts, ignored fields, template variables, options it
refuses, and http_checks' limits."""

from __future__ import annotations

import logging

import pytest

from srt.entrypoints import openai_api as oai
from srt.entrypoints.http_checks import MAX_N, BadRequest, check_depth, check_sampling_params


def _out(prompt_tokens: int, completion_tokens: int) -> dict:
    meta = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return {"meta_info": meta}


def test_usage_counts_every_prompt_once():
    # Equal-length prompts are different prompts: [[1, 2], [3, 4]] holds 4 prompt tokens.
    assert oai.usage([_out(2, 5), _out(2, 5)])["prompt_tokens"] == 4
    # n = 3 copies of each of two prompts share their prompt tokens.
    outs = [_out(2, 1)] * 3 + [_out(5, 2)] * 3
    assert oai.usage(outs, n=3) == {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}
    with pytest.raises(ValueError, match="whole number"):
        oai.usage(outs, n=4)


def test_unknown_fields_are_ignored_with_a_debug_log(caplog):
    with caplog.at_level(logging.DEBUG, logger="srt.entrypoints.openai_api"):
        params = oai.sampling_params({"prompt": "x", "max_tokens": 3, "frobnicate": 1}, False)
    assert params == {"max_new_tokens": 3}
    assert "frobnicate" in caplog.text


@pytest.mark.parametrize(
    "body",
    [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {}}},
        {"response_format": "json"},
        {"tools": [{"type": "function"}]},
    ],
)
def test_options_it_cannot_honour_are_refused(body):
    with pytest.raises(BadRequest):
        oai.sampling_params({"messages": [], **body}, True)


def test_text_response_format_is_accepted():
    assert oai.sampling_params({"response_format": {"type": "text"}}, True) == {}


def test_chat_template_kwargs_and_reasoning_effort():
    body = {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}
    assert oai.chat_template_kwargs(body) == {"reasoning_effort": "low", "enable_thinking": False}
    # The request's chat_template_kwargs win, as in SGLang.
    body = {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}
    assert oai.chat_template_kwargs(body) == {"reasoning_effort": "high"}
    assert oai.chat_template_kwargs({}) == {}
    for key in ("chat_template", "tokenize", "messages"):
        with pytest.raises(BadRequest, match=key):
            oai.chat_template_kwargs({"chat_template_kwargs": {key: "x"}})


class _Tok:
    chat_template = "{{ x }}"

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.kwargs: dict = {}

    def apply_chat_template(self, messages, **kwargs):
        if self.error is not None:
            raise self.error
        self.kwargs = kwargs
        return "rendered"

    def encode(self, text, add_special_tokens=True):
        return [len(text)]


def test_chat_input_ids_passes_variables_and_turns_template_errors_into_400():
    tok = _Tok()
    assert oai.chat_input_ids(tok, [{"role": "user", "content": "a"}], {"y": 1}) == [8]
    assert tok.kwargs == {"tokenize": False, "add_generation_prompt": True, "y": 1}
    jinja2 = pytest.importorskip("jinja2")
    bad = _Tok(jinja2.TemplateError("Unknown role: robot"))
    with pytest.raises(BadRequest, match="Unknown role: robot"):
        oai.chat_input_ids(bad, [{"role": "robot", "content": "a"}], {})


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"stop": 5}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
        ({"stop_token_ids": "1"}, "stop_token_ids"),
        ({"n": MAX_N + 1}, "n"),
        ({"n": 0}, "n"),
        ({"n": 2.5}, "n"),
        ({"sampling_seed": 2**63}, "sampling_seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**63 - 2, "n": 3}, "seed"),
        ({"logit_bias": {"1": float("nan")}}, "logit_bias"),
        ("temperature=0", None),
    ],
)
def test_sampling_checks_name_the_field(params, field):
    with pytest.raises(BadRequest) as e:
        check_sampling_params(params, vocab_size=1024)
    assert e.value.param == field


def test_sampling_checks_accept_the_limits():
    check_sampling_params({"n": MAX_N, "seed": 2**63 - MAX_N, "stop": ["a", "b"]})
    check_sampling_params({"seed": -(2**63), "stop_token_ids": 3, "stop": "x"})
    check_sampling_params({"n": 2.0, "logit_bias": {"1023": -100}}, vocab_size=1024)


def test_depth_check_is_iterative():
    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    with pytest.raises(BadRequest, match="nests deeper than 64"):
        check_depth({"prompt": deep})
    check_depth({"a": [[[{"b": [1]}]]]})
