"""The HTTP server: OpenAI-compatible and SGLang-native endpoints over an EngineLoop (FastAPI).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": server-sent
events ending in `data: [DONE]`), GET /v1/models and /v1/models/{id}, POST /generate (SGLang's
native body: text or input_ids, sampling_params, return_logprob, logprob_start_len,
top_logprobs_num, return_text_in_logprobs, stream: cumulative text and ids per event as SGLang
sends them, or only the new ones with incremental_streaming_output), GET /health,
/health_generate (one token through the engine), /get_model_info, /get_server_info (also
/server_info), /metrics (Prometheus text) and /flush_cache (GET or POST: drops the prefix
cache; 400 while requests run).
Every request goes to the one continuous-batching scheduler of the EngineLoop; a client that
disconnects has its requests aborted (their KV slots freed). A bad request gets HTTP 400 with
OpenAI's error body, checked here before it reaches the engine (http_checks.py), so it never
joins the batch other clients share. A request that fails inside a step fails alone (the
scheduler retries the step without it): its call gets HTTP 500 with the message, as SGLang
answers an abort with status 500 (a stream sends an error event instead, being 200 already);
every other request goes on untouched.

Streams ask the engine for the chunks they send: /generate cumulative ones (the engine's
default) or increments under incremental_streaming_output, OpenAI streams increments. Nothing
is accumulated or sliced here.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from srt.entrypoints import openai_api as oai
from srt.entrypoints import openai_logprobs as oai_lp
from srt.entrypoints.engine_loop import EngineLoop, Submission
from srt.entrypoints.http_checks import (
    BadRequest,
    cache_key_args,
    check_depth,
    check_generate_body,
)
from srt.entrypoints.logprob_io import LOGPROB_ARGS
from srt.entrypoints.metrics import CONTENT_TYPE, ServerMetrics, scheduler_load

_DISCONNECT_POLL_S = 0.5
HEALTH_CHECK_TIMEOUT_S = 20.0
_HEALTH_REQUEST = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}


class _Failed(Exception):
    """A submission ended in an error event: `status` and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _events(
    loop: EngineLoop,
    request: Request,
    kwargs: dict,
    stream: bool,
    metrics: ServerMetrics | None = None,
    incremental: bool = True,
) -> AsyncGenerator:
    """The events of one submission; cancels it if the client leaves or the caller stops.
    Each finished output is counted in `metrics`. Streamed chunks are increments, or the
    whole output so far unless `incremental`."""
    aio = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def sink(event: tuple) -> None:
        try:
            aio.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    sub = Submission(kwargs, sink, stream, incremental=incremental)
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
                if metrics is not None:
                    metrics.observe(event[2])
            yield event
    finally:
        if remaining != 0:
            loop.cancel(sub)


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(oai.error_body(message, param, status), status_code=status)


def _status(out: dict[str, Any]) -> int:
    """The HTTP status of an output with `error`: its abort's status_code (500: it failed
    inside a step; 400: the engine rejected it), 400 where it names none."""
    reason = (out.get("meta_info") or {}).get("finish_reason") or {}
    code = reason.get("status_code")
    return code if isinstance(code, int) and 400 <= code < 600 else 400


def _failed(outs: list[dict[str, Any]], min_status: int = 400) -> JSONResponse | None:
    """The error response of a call whose outputs include an error entry of at least
    `min_status` (the worst status wins), or None."""
    bad = [o for o in outs if "error" in o and _status(o) >= min_status]
    if not bad:
        return None
    worst = max(bad, key=_status)
    return _error(_status(worst), worst["error"])


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except RecursionError:
        raise BadRequest("the body nests too deeply for the JSON decoder") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    check_depth(body)
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


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    return bool((options or {}).get("include_usage"))


def create_app(
    loop: EngineLoop, model_name: str, incremental_streaming_output: bool | None = None
) -> FastAPI:
    """The FastAPI app serving `loop`'s engine under the name `model_name`.

    incremental_streaming_output : /generate streams send only what is new in each event
        (SGLang's --incremental-streaming-output); otherwise each event holds the whole text
        and output_ids so far, as SGLang's do. None: the engine's ServerArgs field of that name.
    """
    app = FastAPI(title="srt")
    engine = loop.engine
    incremental = incremental_streaming_output
    if incremental is None:
        incremental = bool(engine.server_args.incremental_streaming_output)
    metrics = ServerMetrics(model_name)
    vocab_size = _vocab_size(engine)
    cache_report = bool(getattr(engine.server_args, "enable_cache_report", False))

    def card() -> dict[str, Any]:
        info = {"id": model_name, "object": "model", "created": int(time.time())}
        info.update(owned_by="srt", root=model_name, max_model_len=_context_len(engine))
        return info

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """200 once a one-token request went through the engine, 503 if it failed or took
        longer than HEALTH_CHECK_TIMEOUT_S (not counted in /metrics)."""
        events = _events(loop, request, dict(_HEALTH_REQUEST), stream=False)

        async def run() -> list[dict[str, Any]]:
            return await _collect(events, await _first(events))

        try:
            outs = await asyncio.wait_for(run(), HEALTH_CHECK_TIMEOUT_S)
        except (asyncio.TimeoutError, _Failed):
            return Response(status_code=503)
        finally:
            await events.aclose()
        return Response(status_code=503 if "error" in outs[0] else 200)

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": engine.server_args.model_path, "is_generation": True}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info() -> JSONResponse:
        return JSONResponse(engine.get_server_info())

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        """SGLang's: 200 once the prefix cache is dropped, 400 while requests run."""
        if await asyncio.to_thread(engine.flush_cache):
            return Response("Cache flushed.\n", status_code=200)
        return Response("Cache not flushed: requests are running.\n", status_code=400)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(scheduler_load(engine)), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> Response:
        if model != model_name:
            return _error(404, f"The model {model!r} does not exist", "model")
        return JSONResponse(card())

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            body = await _body(request)
            check_generate_body(body, vocab_size)
            kwargs = {
                "prompt": body.get("text", body.get("prompt")),
                "input_ids": body.get("input_ids"),
                "sampling_params": body.get("sampling_params"),
                "return_logprob": body.get("return_logprob") or False,
            }
            kwargs.update({k: body[k] for k in LOGPROB_ARGS[1:] if body.get(k) is not None})
            kwargs.update(cache_key_args(body, openai=False))
            stream = bool(body.get("stream"))
            events = _events(loop, request, kwargs, stream, metrics, incremental)
            start = await _first(events)
        except BadRequest as e:
            return _error(400, str(e), e.param)
        except _Failed as e:
            return _error(e.status, str(e))
        single = start[2]
        if not stream:
            try:
                outs = await _collect(events, start)
            except _Failed as e:
                return _error(e.status, str(e))
            # a request that failed inside a step: 500, as SGLang (an entry the engine
            # rejected stays an entry of the list; a single one was a 400 already)
            failed = _failed(outs, min_status=500)
            if failed is not None:
                return failed
            return JSONResponse(outs[0] if single else outs)

        async def native_stream() -> AsyncIterator[str]:
            ended: set[int] = set()  # outputs whose last chunk was sent
            try:
                async for kind, i, out in events:
                    if kind == "chunk":
                        if out["meta_info"]["finish_reason"] is not None:
                            ended.add(i)
                    elif i in ended or "error" not in out:
                        continue  # its last chunk had it all
                    yield _sse(out if single else {**out, "index": i})
            except _Failed as e:
                yield _sse(oai.error_body(str(e), code=e.status))
            yield "data: [DONE]\n\n"

        return StreamingResponse(native_stream(), media_type="text/event-stream")

    async def openai_call(request: Request, chat: bool) -> Response:
        try:
            body = await _body(request)
            params = oai.sampling_params(body, chat, vocab_size)
            if chat:
                messages = oai.chat_messages(body)
                template_kwargs = oai.chat_template_kwargs(body)
                ids = oai.chat_input_ids(engine.tokenizer, messages, template_kwargs)
                inputs: dict[str, Any] = {"input_ids": ids}
            else:
                inputs = oai.completion_inputs(body)
            stream = bool(body.get("stream"))
            lp_args = oai_lp.generate_logprob_args(body, chat)
            echo = None if chat else oai_lp.echo_texts(body, engine.tokenizer)
            include_usage = _include_usage(body)
            kwargs = {**inputs, "sampling_params": params, **lp_args}
            kwargs.update(cache_key_args(body, openai=True))
            events = _events(loop, request, kwargs, stream, metrics)
            start = await _first(events)
        except BadRequest as e:
            return _error(400, str(e), e.param)
        except _Failed as e:
            return _error(e.status, str(e))
        n = int(params.get("n") or 1)
        rid = oai.new_id("chatcmpl" if chat else "cmpl")
        model = body.get("model") or model_name
        if not stream:
            try:
                outs = await _collect(events, start)
            except _Failed as e:
                return _error(e.status, str(e))
            failed = _failed(outs)
            if failed is not None:
                return failed
            build = oai.chat_response if chat else oai.completion_response
            return JSONResponse(
                oai_lp.add_logprobs(build(rid, model, outs, n, cache_report), outs, chat, echo, n)
            )

        async def openai_stream() -> AsyncIterator[str]:
            finals: dict[int, dict[str, Any]] = {}
            failed: set[int] = set()  # choices whose error event was sent
            lp_stream = oai_lp.StreamLogprobs(chat, echo, n)
            if chat:
                for i in range(start[1]):
                    yield _sse(oai.stream_chunk(rid, model, True, i, None, None))
            try:
                async for kind, index, out in events:  # chunks: increments (the default)
                    if "error" in out:  # rejected, or failed inside a step: SGLang's error
                        if index not in failed:  # event in place of the choice's chunk
                            failed.add(index)
                            yield _sse(oai.error_body(out["error"], code=_status(out)))
                    if kind == "final":
                        finals[index] = out
                    if kind == "final" or "error" in out:
                        continue
                    reason = oai.finish_reason(out["meta_info"]["finish_reason"])
                    text = out.get("text", "")
                    payload = oai.stream_chunk(rid, model, chat, index, text, reason)
                    yield _sse(lp_stream.fill(payload, out))
            except _Failed as e:
                yield _sse(oai.error_body(str(e), code=e.status))
            if include_usage and len(finals) == start[1]:
                kind = "chat.completion.chunk" if chat else "text_completion"
                last = {"id": rid, "object": kind, "created": int(time.time()), "model": model}
                ordered = [finals[i] for i in range(start[1])]
                use = oai.usage(ordered, n, cache_report)
                yield _sse({**last, "choices": [], "usage": use})
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


def _vocab_size(engine: Any) -> int | None:
    runner = getattr(engine, "model_runner", None)
    return None if runner is None else int(runner.model_config.vocab_size)


class ServerThread:
    """uvicorn serving `create_app(...)` on a background thread (tests, notebooks).

    Parameters
    ----------
    engine : the Engine to serve (through its EngineLoop, which `close` stops with the server;
        the engine is left to its owner).
    host, port : where to listen; port 0 picks a free port (see `url`).
    model_name : the name /v1/models reports.
    incremental_streaming_output : see `create_app`.
    """

    def __init__(
        self,
        engine: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "default",
        incremental_streaming_output: bool | None = None,
    ) -> None:
        import uvicorn

        self.loop = engine.engine_loop()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, int(self._sock.getsockname()[1])
        config = uvicorn.Config(
            create_app(self.loop, model_name, incremental_streaming_output),
            log_level="warning",
            lifespan="off",
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
