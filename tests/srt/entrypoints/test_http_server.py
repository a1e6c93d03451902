"""The HTTP server driven by the official `openai` client (tiny model on CPU, 127.0.0.1 only).

Every request loop is bounded in count and time; the server listens on a free loopback port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import srt

openai = pytest.importorskip("openai", reason="install the dev extra (openai client)")
httpx = pytest.importorskip("httpx", reason="install the dev extra (httpx)")
pytest.importorskip("fastapi", reason="install the server extra (fastapi, uvicorn)")

from srt.entrypoints.http_server import ServerThread  # noqa: E402
from srt.entrypoints.openai_api import plain_chat_template  # noqa: E402

GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPTS = ["Hello world", "The capital of France is", "a", "1 2 3 4 5", "tiny", "x y", "ok", "z"]
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def server():
    eng = srt.Engine(device="cpu", max_total_tokens=4096, max_running_requests=16)
    if eng.tokenizer is None:
        pytest.skip("tiny tokenizer not shipped")
    refs = eng.generate(prompt=PROMPTS, sampling_params=dict(GREEDY, max_new_tokens=6))
    sched = eng.scheduler
    stats = {"max_running": 0, "aborted": []}
    step, abort = sched.step, sched.abort

    def spy_step():
        stats["max_running"] = max(stats["max_running"], len(sched.running) + len(sched.waiting))
        return step()

    def spy_abort(rid):
        stats["aborted"].append(rid)
        return abort(rid)

    sched.step, sched.abort = spy_step, spy_abort
    st = ServerThread(eng, model_name="tiny")
    st.refs, st.stats, st.engine = refs, stats, eng
    yield st
    st.close()
    eng.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S
    )


def _free(eng):
    r = eng.model_runner
    return eng.scheduler.available_kv_size(), r.req_to_token_pool.available_size()


def _wait_idle(server, start):
    deadline = time.monotonic() + 30
    while server.loop.num_active or _free(server.engine) != start:
        assert time.monotonic() < deadline, "the server did not free the request"
        time.sleep(0.05)


def test_models_health_and_native_generate(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    models = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "tiny"
    body = {"text": PROMPTS[1], "sampling_params": dict(GREEDY, max_new_tokens=6)}
    out = httpx.post(server.url + "/generate", json=body, timeout=TIMEOUT_S).json()
    assert out["text"] == server.refs[1]["text"] and isinstance(out["meta_info"]["id"], str)
    batch = {"input_ids": [[5, 6], [True]], "sampling_params": dict(GREEDY, max_new_tokens=2)}
    outs = httpx.post(server.url + "/generate", json=batch, timeout=TIMEOUT_S).json()
    assert len(outs[0]["output_ids"]) == 2 and "input_ids must be ints" in outs[1]["error"]


def test_completions(client, server):
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0, extra_body=GREEDY
    )
    assert r.choices[0].text == server.refs[1]["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == server.refs[1]["meta_info"]["prompt_tokens"]
    many = client.completions.create(
        model="tiny", prompt=PROMPTS[:3], max_tokens=6, temperature=0, extra_body=GREEDY
    )
    assert [c.text for c in many.choices] == [o["text"] for o in server.refs[:3]]


def test_chat_uses_template_or_plain_fallback(client, server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, extra_body=GREEDY
    )
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str) and r.usage.completion_tokens == 5
    tok = server.engine.tokenizer
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        n = len(tok.encode(text, add_special_tokens=False))
    else:
        n = len(tok.encode(plain_chat_template(messages)))
    assert r.usage.prompt_tokens == n


def test_streaming_completions_and_chat(client, server):
    pieces = []
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0, stream=True, extra_body=GREEDY
    )
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
    assert "".join(pieces) == server.refs[1]["text"] and len(pieces) >= 2
    messages = [{"role": "user", "content": "hi"}]
    ref = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, extra_body=GREEDY
    )
    text, usage, reasons = "", None, []
    for chunk in client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=GREEDY,
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert text == ref.choices[0].message.content
    assert reasons[-1] == "length" and usage.completion_tokens == 5


def test_concurrent_requests_share_the_batch(client, server):
    server.stats["max_running"] = 0

    def one(i):
        return client.completions.create(
            model="tiny", prompt=PROMPTS[i], max_tokens=6, temperature=0, extra_body=GREEDY
        )

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(one, range(len(PROMPTS)), timeout=TIMEOUT_S))
    assert time.monotonic() - t0 < TIMEOUT_S
    assert [o.choices[0].text for o in outs] == [r["text"] for r in server.refs]
    assert server.stats["max_running"] > 1  # several clients' requests in one batch


def test_disconnect_aborts_and_frees(server):
    start = _free(server.engine)
    body = {"text": "Hello", "sampling_params": dict(GREEDY, max_new_tokens=1500), "stream": True}
    n_aborted = len(server.stats["aborted"])
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=TIMEOUT_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                assert json.loads(line[6:])["output_ids"]
                break  # leave after the first chunk
    _wait_idle(server, start)
    assert len(server.stats["aborted"]) == n_aborted + 1
    # A non-streaming client that gives up is aborted too.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/generate", json=dict(body, stream=False), timeout=1.0)
    _wait_idle(server, start)
    assert len(server.stats["aborted"]) == n_aborted + 2


def test_bad_requests_get_400_with_openai_error_body(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=3, top_p=2.0)
    assert e.value.status_code == 400 and "top_p" in e.value.message
    with pytest.raises(openai.BadRequestError, match="top_k must be an int"):
        client.completions.create(
            model="tiny", prompt="hi", max_tokens=3, extra_body={"top_k": "0.5"}
        )
    with pytest.raises(openai.BadRequestError, match="exceeds the context length 2048"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])
    r = httpx.post(
        server.url + "/v1/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400 and err["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "echo": "1"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    assert not server.loop.num_active


def _run_cli(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.run(
        [sys.executable, "-m", "srt.launch_server", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_launch_server_bad_flag_is_one_line():
    r = _run_cli("--page-size", "0", "--device", "cpu")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "page_size" in lines[-1]
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_launch_server_serves_the_openai_api():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    cmd = [sys.executable, "-m", "srt.launch_server", "--device", "cpu", "--port", str(port)]
    cmd += ["--max-total-tokens", "1024", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
        r = c.completions.create(model="default", prompt="Hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens <= 4 and r.choices[0].finish_reason in ("length", "stop")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
