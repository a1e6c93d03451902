"""SGLang's endpoints and /generate streaming as an SGLang client reads them (tiny model, CPU)."""

from __future__ import annotations

import re

import pytest

httpx = pytest.importorskip("httpx", reason="install the dev extra (httpx)")
pytest.importorskip("fastapi", reason="install the server extra (fastapi, uvicorn)")

from tests.srt.entrypoints.server_harness import (  # noqa: E402
    GREEDY,
    TIMEOUT_S,
    sse_events,
    start_server,
    stop_server,
)

BODY = {"text": "Hello world", "sampling_params": dict(GREEDY, max_new_tokens=7)}


@pytest.fixture(scope="module")
def server():
    st = start_server()
    yield st
    stop_server(st)


def _get(server, path):
    return httpx.get(server.url + path, timeout=TIMEOUT_S)


def test_generate_streams_cumulative_text_by_default(server):
    whole = httpx.post(server.url + "/generate", json=BODY, timeout=TIMEOUT_S).json()
    events = list(sse_events(server.url + "/generate", {**BODY, "stream": True}))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["text"].startswith(a["text"])  # a client slicing text[prev:] sees increments
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
        assert len(b["output_ids"]) == b["meta_info"]["completion_tokens"]
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_generate_batch_stream_carries_the_index(server):
    body = {"text": ["Hello world", "a b"], "sampling_params": BODY["sampling_params"]}
    whole = httpx.post(server.url + "/generate", json=body, timeout=TIMEOUT_S).json()
    chunks = list(sse_events(server.url + "/generate", {**body, "stream": True}))[:-1]
    last = {}
    for c in chunks:
        last[c["index"]] = c
    assert [last[i]["text"] for i in (0, 1)] == [w["text"] for w in whole]


def test_incremental_streaming_output_option():
    st = start_server(incremental_streaming_output=True)
    try:
        whole = httpx.post(st.url + "/generate", json=BODY, timeout=TIMEOUT_S).json()
        chunks = list(sse_events(st.url + "/generate", {**BODY, "stream": True}))[:-1]
    finally:
        stop_server(st)
    assert len(chunks) >= 2
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]


LP_BODY = {
    **BODY,
    "return_logprob": True,
    "logprob_start_len": 0,
    "top_logprobs_num": 2,
}
LP_KEYS = ("output_token_logprobs", "output_top_logprobs")


def _check_generate_streams(st, cumulative: bool) -> None:
    """/generate streamed without and with logprobs, in the server's one mode: cumulative
    chunks hold the whole output so far (its ids, text and per-token logprob lists), or
    increments add up to it; either way nothing is counted twice."""
    for body in (BODY, LP_BODY):
        whole = httpx.post(st.url + "/generate", json=body, timeout=TIMEOUT_S).json()
        chunks = list(sse_events(st.url + "/generate", {**body, "stream": True}))[:-1]
        assert len(chunks) >= 2
        meta = whole["meta_info"]
        ids: list[int] = []
        lists: dict[str, list] = {k: [] for k in LP_KEYS}
        for c in chunks:
            ids = c["output_ids"] if cumulative else ids + c["output_ids"]
            assert len(ids) == c["meta_info"]["completion_tokens"]
            if body is LP_BODY:
                assert c["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"]
                for k in LP_KEYS:
                    got = c["meta_info"][k]
                    lists[k] = got if cumulative else lists[k] + got
                    assert lists[k] == meta[k][: len(ids)]
        assert ids == whole["output_ids"]
        if cumulative:
            assert chunks[-1]["text"] == whole["text"]
        else:
            assert "".join(c["text"] for c in chunks) == whole["text"]


def _check_openai_streams(st) -> None:
    """OpenAI streams are increments in every server mode: the streamed text, and with
    logprobs (and echo) the streamed tokens and logprobs, equal the whole response's."""
    url = st.url + "/v1/completions"
    base = {"model": "tiny", "prompt": "Hello world", "max_tokens": 6, "temperature": 0}
    for extra in ({}, {"logprobs": 2}, {"logprobs": 1, "echo": True}):
        body = {**base, **extra, "ignore_eos": True}
        whole = httpx.post(url, json=body, timeout=TIMEOUT_S).json()["choices"][0]
        chunks = list(sse_events(url, {**body, "stream": True}))[:-1]
        assert len(chunks) >= 2
        choices = [c["choices"][0] for c in chunks]
        assert "".join(c["text"] for c in choices) == whole["text"]
        if extra:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                assert [v for c in choices for v in c["logprobs"][key]] == whole["logprobs"][key]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    chat.update(temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)
    url = st.url + "/v1/chat/completions"
    whole = httpx.post(url, json=chat, timeout=TIMEOUT_S).json()["choices"][0]
    chunks = list(sse_events(url, {**chat, "stream": True}))[:-1]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == whole["message"]["content"]
    streamed = [e for d in deltas if d.get("logprobs") for e in d["logprobs"]["content"]]
    assert streamed == whole["logprobs"]["content"]


def test_streams_of_the_default_cumulative_server(server):
    _check_generate_streams(server, cumulative=True)
    _check_openai_streams(server)


def test_streams_of_an_incremental_engine():
    """An engine built with incremental_streaming_output (launch_server's flag) streams
    /generate increments; the HTTP layer follows it and OpenAI streams are unchanged."""
    st = start_server(engine_kwargs={"incremental_streaming_output": True})
    try:
        _check_generate_streams(st, cumulative=False)
        _check_openai_streams(st)
    finally:
        stop_server(st)


def test_server_info_and_model_card(server):
    info = _get(server, "/get_server_info").json()
    assert info["model_path"] is None and info["device"] == "cpu"
    assert info["context_length"] == server.engine.model_runner.context_len
    assert info["max_total_num_tokens"] >= 4096 and info["max_running_requests"] == 16
    assert isinstance(info["version"], str) and "internal_states" in info
    assert server.engine.get_server_info()["context_length"] == info["context_length"]
    card = _get(server, "/v1/models/tiny").json()
    assert card["id"] == "tiny" and card["max_model_len"] == info["context_length"]
    r = _get(server, "/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_health_generate_runs_a_token(server):
    steps = server.engine.scheduler.step
    calls = []

    def spy():
        calls.append(1)
        return steps()

    server.engine.scheduler.step = spy
    try:
        assert _get(server, "/health_generate").status_code == 200
    finally:
        server.engine.scheduler.step = steps
    assert calls  # it went through the engine, not just the HTTP layer
    assert _get(server, "/health").status_code == 200


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics:\n{text}"
    return float(m.group(1))


def test_metrics_count_requests_and_tokens(server):
    r = _get(server, "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = ("sglang:num_requests_total", "sglang:prompt_tokens_total")
    names += ("sglang:generation_tokens_total",)
    before = [_metric(r.text, n) for n in names]
    out = httpx.post(server.url + "/generate", json=BODY, timeout=TIMEOUT_S).json()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **GREEDY}
    usage = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=TIMEOUT_S).json()
    usage = usage["usage"]
    text = _get(server, "/metrics").text
    after = [_metric(text, n) for n in names]
    meta = out["meta_info"]
    assert after[0] - before[0] == 2
    assert after[1] - before[1] == meta["prompt_tokens"] + usage["prompt_tokens"]
    assert after[2] - before[2] == meta["completion_tokens"] + usage["completion_tokens"]
    assert _metric(text, "sglang:num_running_reqs") == 0
    assert _metric(text, "sglang:num_queue_reqs") == 0
    assert "# TYPE sglang:num_requests_total counter" in text
    assert "# TYPE sglang:num_running_reqs gauge" in text
