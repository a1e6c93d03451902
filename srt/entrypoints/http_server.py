"""The HTTP server: OpenAI-compatible and SGLang-native endpoints over an EngineLoop (FastAPI).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": server-sent
events ending in `data: [DONE]`), GET /v1/models, POST /generate (SGLang's native body: text or
input_ids, sampling_params, return_logprob, stream), GET /health, GET /get_model_info.
Every request goes to the one continuous-batching scheduler of the EngineLoop; a client that
disconnects has its requests aborted (their KV slots freed). A bad request gets HTTP 400 with
OpenAI's error body; a failed forward step HTTP 500.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from srt.entrypoints import openai_api as oai
from srt.entrypoints.engine_loop import EngineLoop, Submission

_DISCONNECT_POLL_S = 0.5


class _Failed(Exception):
    """A submission ended in an error event: `status` and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _events(loop: EngineLoop, request: Request, kwargs: dict, stream: bool) -> AsyncIterator:
    """The events of one submission; cancels it if the client leaves or the caller stops."""
    aio = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def sink(event: tuple) -> None:
        try:
            aio.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    sub = Submission(kwargs, sink, stream, incremental=True)  # the handlers send deltas
    loop.submit(sub)
    remaining: int | None = None  # outputs still to come; None until the "start" event
    try:
        while remaining is None or remaining > 0:
            try:
                event = await asyncio.wait_for(events.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            kind = event[0]
            if kind == "error":
                raise _Failed(400, str(event[1]))
            if kind == "fatal":
                raise _Failed(500, f"generation failed: {event[1]}")
            if kind == "start":
                remaining = event[1]
            elif kind == "final":
                assert remaining is not None, "a final event before the start event"
                remaining -= 1
            yield event
    finally:
        if remaining != 0:
            loop.cancel(sub)


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(oai.error_body(message, param, status), status_code=status)


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise oai.BadRequest(f"the body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise oai.BadRequest("the body must be a JSON object")
    return body


async def _first(events: AsyncIterator) -> tuple:
    """The "start" event (errors raise _Failed before any response is sent)."""
    async for event in events:
        return event
    raise _Failed(499, "client disconnected")


async def _collect(events: AsyncIterator, start: tuple) -> list[dict[str, Any]]:
    outputs: list[dict[str, Any]] = [{}] * start[1]
    async for event in events:
        if event[0] == "final":
            outputs[event[1]] = event[2]
    return outputs


def create_app(loop: EngineLoop, model_name: str) -> FastAPI:
    """The FastAPI app serving `loop`'s engine under the name `model_name`."""
    app = FastAPI(title="srt")
    engine = loop.engine

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": engine.server_args.model_path, "is_generation": True}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": int(time.time())}
        card.update(owned_by="srt", root=model_name, max_model_len=_context_len(engine))
        return {"object": "list", "data": [card]}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            body = await _body(request)
            prompt = body.get("text", body.get("prompt"))
            kwargs = {
                "prompt": prompt,
                "input_ids": body.get("input_ids"),
                "sampling_params": body.get("sampling_params"),
                "return_logprob": body.get("return_logprob") or False,
            }
            stream = bool(body.get("stream"))
            events = _events(loop, request, kwargs, stream)
            start = await _first(events)
        except oai.BadRequest as e:
            return _error(400, str(e), e.param)
        except _Failed as e:
            return _error(e.status, str(e))
        if not stream:
            try:
                outs = await _collect(events, start)
            except _Failed as e:
                return _error(e.status, str(e))
            return JSONResponse(outs[0] if start[2] else outs)

        async def native_stream() -> AsyncIterator[str]:
            try:
                async for event in events:
                    if event[0] == "chunk" or (event[0] == "final" and "error" in event[2]):
                        yield _sse(event[2])
            except _Failed as e:
                yield _sse(oai.error_body(str(e), code=e.status))
            yield "data: [DONE]\n\n"

        return StreamingResponse(native_stream(), media_type="text/event-stream")

    async def openai_call(request: Request, chat: bool) -> Response:
        try:
            body = await _body(request)
            params = oai.sampling_params(body, chat)
            if chat:
                inputs = {"input_ids": _chat_input_ids(engine, oai.chat_messages(body))}
            else:
                inputs = oai.completion_inputs(body)
            stream = bool(body.get("stream"))
            events = _events(loop, request, {**inputs, "sampling_params": params}, stream)
            start = await _first(events)
        except oai.BadRequest as e:
            return _error(400, str(e), e.param)
        except _Failed as e:
            return _error(e.status, str(e))
        rid = oai.new_id("chatcmpl" if chat else "cmpl")
        model = body.get("model") or model_name
        if not stream:
            try:
                outs = await _collect(events, start)
            except _Failed as e:
                return _error(e.status, str(e))
            bad = next((o for o in outs if "error" in o), None)
            if bad is not None:
                return _error(400, bad["error"])
            build = oai.chat_response if chat else oai.completion_response
            return JSONResponse(build(rid, model, outs))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def openai_stream() -> AsyncIterator[str]:
            finals: list[dict[str, Any]] = []
            if chat:
                for i in range(start[1]):
                    yield _sse(oai.stream_chunk(rid, model, True, i, None, None))
            try:
                async for event in events:
                    kind, index, out = event
                    if kind == "final":
                        finals.append(out)
                        if "error" in out:
                            yield _sse(oai.error_body(out["error"]))
                        continue
                    reason = oai.finish_reason(out["meta_info"]["finish_reason"])
                    text = out.get("text", "")
                    yield _sse(oai.stream_chunk(rid, model, chat, index, text, reason))
            except _Failed as e:
                yield _sse(oai.error_body(str(e), code=e.status))
            if include_usage and finals:
                kind = "chat.completion.chunk" if chat else "text_completion"
                last = {"id": rid, "object": kind, "created": int(time.time()), "model": model}
                yield _sse({**last, "choices": [], "usage": oai.usage(finals)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(openai_stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai_call(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai_call(request, chat=True)

    return app


def _context_len(engine: Any) -> int | None:
    runner = getattr(engine, "model_runner", None)
    return None if runner is None else int(runner.context_len)


def _chat_input_ids(engine: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids: the tokenizer's chat template, or the plain fallback template."""
    tok = engine.tokenizer
    if tok is None:
        raise oai.BadRequest("this server has no tokenizer: use /v1/completions with token ids")
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))  # the template has its BOS
    return list(tok.encode(oai.plain_chat_template(messages)))


class ServerThread:
    """uvicorn serving `create_app(...)` on a background thread (tests, notebooks).

    Parameters
    ----------
    engine : the Engine to serve (through its EngineLoop, which `close` stops with the server;
        the engine is left to its owner).
    host, port : where to listen; port 0 picks a free port (see `url`).
    model_name : the name /v1/models reports.
    """

    def __init__(
        self, engine: Any, host: str = "127.0.0.1", port: int = 0, model_name: str = "default"
    ) -> None:
        import uvicorn

        self.loop = engine.engine_loop()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, int(self._sock.getsockname()[1])
        config = uvicorn.Config(
            create_app(self.loop, model_name), log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self.loop.close()
        self._sock.close()
