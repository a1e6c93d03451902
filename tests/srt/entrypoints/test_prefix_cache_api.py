"""The prefix cache's API (issue 48): Engine.flush_cache, /flush_cache (GET or POST, 400 while
requests run), meta_info cached_tokens, OpenAI usage.prompt_tokens_details.cached_tokens with
--enable-cache-report, the hit rate in get_server_info and the prefill log line (tiny model,
CPU)."""

from __future__ import annotations

import logging

import pytest

import srt
from srt.managers.schedule_batch import Req
from srt.sampling.sampling_params import SamplingParams

SP = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
PROMPT = list(range(40, 90))


def test_engine_flush_cache(caplog):
    eng = srt.Engine(device="cpu", skip_tokenizer_init=True, max_total_tokens=1024, page_size=4)
    sched, alloc = eng.scheduler, eng.model_runner.token_to_kv_pool_allocator
    first = eng.generate(input_ids=PROMPT, sampling_params=SP)
    with caplog.at_level(logging.INFO, logger="srt.managers.scheduler"):
        again = eng.generate(input_ids=PROMPT, sampling_params=SP)
    line = "#new-token: 2, #cached-token: 48, cache hit rate: 48.0%"
    assert any(line in r.getMessage() for r in caplog.records)
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == 48  # 49 tokens may match: 12 whole pages
    assert again["output_ids"] == first["output_ids"]
    assert sched.tree_cache.total_size() > 0 and alloc.available_size() < 1024
    info = eng.get_server_info()["internal_states"][0]
    assert info["cache_hit_rate"] == pytest.approx(48 / 100)
    assert info["available_kv_tokens"] == 1024 and info["token_usage"] == 0.0
    # a waiting request: not flushed, nothing changed
    req = Req("w", list(PROMPT), SamplingParams(**SP))
    sched.add_request(req)
    size = sched.tree_cache.total_size()
    assert eng.flush_cache() is False and sched.tree_cache.total_size() == size
    sched.run_until_idle()
    assert req.cached_tokens == 48
    assert eng.flush_cache() is True
    assert sched.tree_cache.total_size() == 0 and alloc.available_size() == 1024
    assert eng.generate(input_ids=PROMPT, sampling_params=SP)["meta_info"]["cached_tokens"] == 0
    eng.shutdown()
    off = srt.Engine(device="cpu", skip_tokenizer_init=True, disable_radix_cache=True)
    assert off.flush_cache() is True  # nothing to drop
    off.shutdown()


def test_extra_key_keeps_requests_from_sharing_a_prefix():
    """SGLang's extra_key: a prefix cached under one key is never matched under another."""
    eng = srt.Engine(device="cpu", skip_tokenizer_init=True, max_total_tokens=1024, page_size=4)
    try:
        run = lambda **kw: eng.generate(input_ids=PROMPT, sampling_params=SP, **kw)
        first = run(extra_key="tenant-a")
        assert first["meta_info"]["cached_tokens"] == 0
        assert run(extra_key="tenant-b")["meta_info"]["cached_tokens"] == 0
        assert run()["meta_info"]["cached_tokens"] == 0  # no key is a key of its own
        hit = run(extra_key="tenant-a")
        assert hit["meta_info"]["cached_tokens"] == 48 and hit["output_ids"] == first["output_ids"]
        outs = eng.generate(
            input_ids=[PROMPT] * 3, sampling_params=SP, extra_key=["a", "b", "tenant-b"]
        )
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0, 48]
        with pytest.raises(ValueError, match="2 extra_key values for 3 requests"):
            eng.generate(input_ids=[PROMPT] * 3, sampling_params=SP, extra_key=["a", "b"])
        with pytest.raises(TypeError, match="extra_key must be a string"):
            eng.generate(input_ids=PROMPT, sampling_params=SP, extra_key=7)
    finally:
        eng.shutdown()


httpx = pytest.importorskip("httpx", reason="install the dev extra (httpx)")
pytest.importorskip("fastapi", reason="install the server extra (fastapi, uvicorn)")

from tests.srt.entrypoints.server_harness import start_server, stop_server  # noqa: E402


@pytest.mark.parametrize("report", [True, False], ids=["cache-report", "no-report"])
def test_openai_usage_cached_tokens_and_flush_endpoint(report):
    st = start_server({"enable_cache_report": report})
    url = st.url
    body = {"model": "tiny", "prompt": "the same long prompt " * 8, "max_tokens": 3}
    try:
        usages = [httpx.post(url + "/v1/completions", json=body).json()["usage"] for _ in "ab"]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 20}]}
        chats = [
            httpx.post(url + "/v1/chat/completions", json={**chat, "max_tokens": 2}).json()
            for _ in "ab"
        ]
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=streamed) as r:
            last = [ln for ln in r.iter_lines() if ln.startswith("data: {")][-1]
        if report:
            first, second = (u["prompt_tokens_details"]["cached_tokens"] for u in usages)
            assert first == 0 and 0 < second < usages[1]["prompt_tokens"]
            assert chats[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert '"prompt_tokens_details": {"cached_tokens": ' in last
        else:
            assert all("prompt_tokens_details" not in u for u in usages)
            assert "prompt_tokens_details" not in last
        assert httpx.get(url + "/flush_cache").status_code == 200
        assert httpx.post(url + "/flush_cache").status_code == 200
        again = httpx.post(url + "/v1/completions", json=body).json()["usage"]
        assert again.get("prompt_tokens_details", {"cached_tokens": 0})["cached_tokens"] == 0
        # while a request runs: 400, nothing flushed
        long = {**body, "max_tokens": 1500, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=long, timeout=120) as r:
            lines = r.iter_lines()  # kept open: the request runs until the stream closes
            assert next(ln for ln in lines if ln.startswith("data: {"))
            busy = httpx.post(url + "/flush_cache")
        assert busy.status_code == 400 and "running" in busy.text
    finally:
        stop_server(st)


def test_extra_key_and_cache_salt_over_http():
    """/generate's extra_key (one or one per prompt), OpenAI's extra_key / cache_salt; a
    wrong type is a 400 naming the field."""
    st = start_server({"enable_cache_report": True})
    url = st.url
    ids = list(range(40, 90))
    gen = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    body = {"model": "tiny", "prompt": ids, "max_tokens": 2}
    cached = lambda r: r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    try:
        post = lambda path, b: httpx.post(url + path, json=b)
        assert (
            post("/generate", {**gen, "extra_key": "a"}).json()["meta_info"]["cached_tokens"] == 0
        )
        assert post("/generate", {**gen, "extra_key": "a"}).json()["meta_info"]["cached_tokens"] > 0
        two = post("/generate", {**gen, "input_ids": [ids, ids], "extra_key": ["b", "a"]}).json()
        assert [o["meta_info"]["cached_tokens"] > 0 for o in two] == [False, True]
        assert cached(post("/v1/completions", {**body, "cache_salt": "s1"})) == 0
        assert cached(post("/v1/completions", {**body, "cache_salt": "s1"})) > 0
        assert cached(post("/v1/completions", {**body, "cache_salt": "s2"})) == 0
        assert cached(post("/v1/completions", {**body, "extra_key": "a", "cache_salt": "s1"})) == 0
        for path, b, field in (
            ("/generate", {**gen, "extra_key": 3}, "extra_key"),
            ("/v1/completions", {**body, "extra_key": ["a"]}, "extra_key"),
            ("/v1/completions", {**body, "cache_salt": 1}, "cache_salt"),
        ):
            r = post(path, b)
            assert r.status_code == 400 and field in r.text
    finally:
        stop_server(st)
