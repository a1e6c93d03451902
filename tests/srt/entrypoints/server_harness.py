"""Shared pieces of the HTTP server tests: a tiny-model server on a free loopback port, SSE
reading and a wait for the engine to be idle again."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import srt
from srt.entrypoints.http_server import ServerThread

GREEDY = {"temperature": 0.0, "ignore_eos": True}
TIMEOUT_S = 120


def start_server(engine_kwargs: dict[str, Any] | None = None, **server_kwargs: Any) -> ServerThread:
    """The embedded tiny model on CPU (more Engine arguments in engine_kwargs) behind a
    ServerThread (skips without the tokenizer)."""
    kw: dict[str, Any] = dict(device="cpu", max_total_tokens=4096, max_running_requests=16)
    eng = srt.Engine(**{**kw, **(engine_kwargs or {})})
    if eng.tokenizer is None:
        eng.shutdown()
        pytest.skip("tiny tokenizer not shipped")
    st = ServerThread(eng, model_name="tiny", **server_kwargs)
    st.engine = eng  # type: ignore[attr-defined]
    return st


def stop_server(st: ServerThread) -> None:
    st.close()
    st.engine.shutdown()  # type: ignore[attr-defined]


def free_slots(eng: Any) -> tuple[int, int]:
    r = eng.model_runner
    return eng.scheduler.available_kv_size(), r.req_to_token_pool.available_size()


def wait_idle(st: ServerThread, start: tuple[int, int]) -> None:
    deadline = time.monotonic() + 30
    while st.loop.num_active or free_slots(st.engine) != start:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the server did not free the request"
        time.sleep(0.05)


def sse_events(url: str, body: dict[str, Any]) -> Iterator[Any]:
    """The decoded `data:` payloads of a streamed POST, `[DONE]` included as a string."""
    with httpx.stream("POST", url, json=body, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                yield payload if payload == "[DONE]" else json.loads(payload)
