"""Bad requests get HTTP 400 and never reach the batch; OpenAI fields as SGLang and vLLM read them.

Tiny model on CPU behind a loopback server (server_harness).
"""

from __future__ import annotations

import random
import threading

import pytest

httpx = pytest.importorskip("httpx", reason="install the dev extra (httpx)")
pytest.importorskip("fastapi", reason="install the server extra (fastapi, uvicorn)")

from tests.srt.entrypoints.server_harness import (  # noqa: E402
    GREEDY,
    TIMEOUT_S,
    free_slots,
    sse_events,
    start_server,
    stop_server,
    wait_idle,
)

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "x"}]
# (path, body, a word the error message must hold)
BAD_REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "robot"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": {"a": 1}}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", 3]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64, "temperature": 0.7}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**63 - 1, "n": 2}, "seed"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, "n must be"),
    ("/v1/completions", {"prompt": "hi", "n": True}, "n must be"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": ["hi", ""]}, "empty"),
    ("/generate", {"text": ""}, "empty"),
    ("/generate", {"text": ["hi", ""]}, "empty"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": 5}}, "stop"),
    ("/generate", {"text": "hi", "sampling_params": {"seed": 2**64}}, "seed"),
    ("/generate", {"text": "hi", "sampling_params": [{"n": 1000}]}, "n must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 500}, "n"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema"}}, "response"),
    (CHAT, {"messages": MSGS, "reasoning_effort": 3}, "reasoning_effort"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {"tokenize": True}}, "tokenize"),
    (CHAT, {"messages": MSGS, "stream": True, "stream_options": [1]}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
]


@pytest.fixture(scope="module")
def server():
    st = start_server()
    yield st
    stop_server(st)


def _post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT_S, **kw)


@pytest.mark.parametrize(("path", "body", "word"), BAD_REQUESTS)
def test_bad_request_is_a_clear_400(server, path, body, word):
    r = _post(server, path, {"max_tokens": 2, **body} if path != "/generate" else body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and word in err["message"], err
    assert not server.loop.num_active


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_json_is_a_400(server, depth):
    nested = b"[" * depth + b"]" * depth
    for body, word in ((nested, ""), (b'{"prompt": ' + nested + b"}", "nest")):
        r = httpx.post(
            server.url + "/v1/completions",
            content=body,
            headers={"Content-Type": "application/json"},
            timeout=TIMEOUT_S,
        )
        assert r.status_code == 400, r.text
        assert word in r.json()["error"]["message"]


def _background_stream(server, body) -> tuple[threading.Thread, list]:
    """A /generate stream of `body` read on a thread: (the thread, the events so far), once
    its first event came (the request is in the running batch)."""
    chunks: list = []
    first = threading.Event()

    def read() -> None:
        for event in sse_events(server.url + "/generate", {**body, "stream": True}):
            chunks.append(event)
            first.set()
        first.set()

    t = threading.Thread(target=read)
    t.start()
    assert first.wait(TIMEOUT_S)
    return t, chunks


def test_poison_requests_leave_a_running_stream_untouched(server):
    """Every bad request above, sent while a long greedy stream runs: each gets its 400, the
    stream's tokens are those of the same request run alone, and every slot comes back."""
    start = free_slots(server.engine)
    body = {"text": "The capital of", "sampling_params": dict(GREEDY, max_new_tokens=48)}
    solo = _post(server, "/generate", body).json()
    wait_idle(server, start)
    t, chunks = _background_stream(server, body)
    bad = random.Random(7).sample(BAD_REQUESTS, len(BAD_REQUESTS))
    for path, b, _ in bad:
        r = _post(server, path, {"max_tokens": 2, **b} if path != "/generate" else b)
        assert r.status_code == 400, (path, b, r.text)
    t.join(TIMEOUT_S)
    assert chunks[-1] == "[DONE]" and "error" not in chunks[-2]
    assert chunks[-2]["output_ids"] == solo["output_ids"]
    assert chunks[-2]["text"] == solo["text"]
    wait_idle(server, start)


def test_usage_counts_equal_length_prompts_each(server):
    out = _post(server, "/v1/completions", {"prompt": [[1, 2], [3, 4]], "max_tokens": 2}).json()
    assert out["usage"]["prompt_tokens"] == 4 and out["usage"]["completion_tokens"] == 4
    out = _post(
        server, "/v1/completions", {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 1, "n": 3}
    ).json()
    assert len(out["choices"]) == 6 and out["usage"]["prompt_tokens"] == 5


def test_usage_of_a_stream_counts_each_prompt_once(server):
    body = {"prompt": [[1, 2], [3, 4]], "max_tokens": 2, "n": 2, "stream": True}
    body["stream_options"] = {"include_usage": True}
    events = list(sse_events(server.url + "/v1/completions", body))
    usage = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert usage == [{"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}]


def test_unknown_openai_fields_are_ignored(server):
    body = {"prompt": "hi", "max_tokens": 2, "some_new_field": {"x": 1}, "top_a": 0.3}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "metadata": {}}
    r = _post(server, "/v1/chat/completions", {**chat, "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text


def test_reasoning_effort_and_chat_template_kwargs_reach_the_template(server):
    tok = server.engine.tokenizer
    template = tok.chat_template
    seen = []
    # A template that shows both values in the prompt, so the prompt token count tells.
    tok.chat_template = (
        "{{ bos_token }}effort={{ reasoning_effort | default('unset') }} "
        "mode={{ mode | default('unset') }}\n{% for m in messages %}{{ m['content'] }}"
        "{% endfor %}"
    )
    try:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        for extra in ({}, {"reasoning_effort": "high", "chat_template_kwargs": {"mode": "x"}}):
            r = _post(server, "/v1/chat/completions", {**chat, **extra})
            assert r.status_code == 200, r.text
            seen.append(r.json()["usage"]["prompt_tokens"])
        expect = []
        for kw in ({}, {"reasoning_effort": "high", "mode": "x"}):
            text = tok.apply_chat_template(
                chat["messages"], tokenize=False, add_generation_prompt=True, **kw
            )
            expect.append(len(tok.encode(text, add_special_tokens=False)))
    finally:
        tok.chat_template = template
    assert seen == expect and seen[0] != seen[1]


def test_logit_bias_is_passed_on_or_refused(server):
    from dataclasses import fields

    from srt.sampling.sampling_params import SamplingParams

    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": 1}})
    if "logit_bias" in {f.name for f in fields(SamplingParams)}:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]
        assert "not supported" in r.json()["error"]["message"]
    # An empty bias changes nothing: accepted either way.
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {}})
    assert r.status_code == 200, r.text


# Values only the engine can judge (SamplingParams, when the request is added): whether it
# rejects them or serves them, neither the request nor the stream beside it may end in a 500.
# (top_k sends the row through the sorted sampler on every device, as any row goes on a CPU
# without the Triton interpreter.)
ENGINE_POISONS = [
    {"prompt": "hi", "max_tokens": 3, "top_k": 50, "temperature": 1e-39},
    {"prompt": "hi", "max_tokens": 3, "top_k": 50, "repetition_penalty": 1e-300},
]


@pytest.mark.parametrize("body", ENGINE_POISONS)
def test_engine_side_poisons_never_500(server, body):
    start = free_slots(server.engine)
    stream = {"text": "The capital of", "sampling_params": dict(GREEDY, max_new_tokens=200)}
    solo = _post(server, "/generate", stream).json()
    t, chunks = _background_stream(server, stream)
    r = _post(server, "/v1/completions", body)
    t.join(TIMEOUT_S)
    assert r.status_code in (200, 400), r.text
    assert chunks[-2]["output_ids"] == solo["output_ids"]
    wait_idle(server, start)


MARK = 1000  # first prompt token of a request whose forward rows raise (not a text prompt's)


def test_request_failing_inside_a_step_is_a_500_and_fails_alone(server, monkeypatch):
    """A request that still fails inside a forward step (after the checks) fails alone: its
    call is an HTTP 500 with the message on /generate and the OpenAI API (a stream ends with an
    error event of code 500), while a stream running beside it keeps its solo tokens and every
    slot comes back."""
    start = free_slots(server.engine)
    body = {"text": "The capital of", "sampling_params": dict(GREEDY, max_new_tokens=48)}
    solo = _post(server, "/generate", body).json()
    sched, runner = server.engine.scheduler, server.engine.model_runner
    real = runner.forward

    def forward(fb):
        rows = set(fb.req_pool_indices.tolist())
        if any(r.origin_input_ids[0] == MARK and r.req_pool_idx in rows for r in sched.running):
            raise RuntimeError("poisoned row")
        return real(fb)

    monkeypatch.setattr(runner, "forward", forward)
    t, chunks = _background_stream(server, body)
    poison = [MARK, 5, 6]
    sp = dict(GREEDY, max_new_tokens=4)
    r = _post(server, "/generate", {"input_ids": poison, "sampling_params": sp})
    assert r.status_code == 500 and "poisoned row" in r.json()["error"]["message"], r.text
    r = _post(server, "/generate", {"input_ids": [[1, 2], poison], "sampling_params": sp})
    assert r.status_code == 500 and "poisoned row" in r.json()["error"]["message"], r.text
    completion = {"prompt": poison, "max_tokens": 4, "temperature": 0}
    r = _post(server, "/v1/completions", completion)
    assert r.status_code == 500 and r.json()["error"]["code"] == 500, r.text
    assert "poisoned row" in r.json()["error"]["message"]
    events = list(sse_events(server.url + "/v1/completions", {**completion, "stream": True}))
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500
    native = {"input_ids": poison, "sampling_params": sp, "stream": True}
    events = list(sse_events(server.url + "/generate", native))
    assert [e for e in events[:-1] if "error" in e] == [events[-2]]  # one error event, last
    assert events[-2]["meta_info"]["finish_reason"]["status_code"] == 500
    t.join(TIMEOUT_S)
    assert chunks[-1] == "[DONE]" and "error" not in chunks[-2]
    assert chunks[-2]["output_ids"] == solo["output_ids"]
    monkeypatch.undo()
    wait_idle(server, start)
