"""Where ``python -m srt.bench_serving`` sends its requests, one coroutine per request.

- `EngineBackend`: an in-process `srt.Engine`, through its streaming `async_generate`. The
  engine's scheduler runs on its own loop thread; the benchmark's requests are asyncio tasks
  on the caller's thread that only wait for events, so measuring adds no work to a step
  beyond building the streamed chunks (incremental ones: the ids of that step).
- `OpenAIBackend`: any OpenAI-compatible server (srt's, SGLang's, vLLM's): streamed
  ``/v1/completions`` with the prompt as token ids, usage (and the prefix cache's
  ``prompt_tokens_details.cached_tokens`` where the server reports it) in the final chunk.

Every request asks for exactly its output length: greedy, ``ignore_eos`` (and
``min_tokens`` on the OpenAI API), no stop strings.
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from srt.bench_serving.datasets import DatasetRow
from srt.bench_serving.http_stream import request_json, stream_events
from srt.bench_serving.metrics import RequestOutput


class Backend(Protocol):
    """What the benchmark loop needs of a backend."""

    name: str

    async def send(self, row: DatasetRow) -> RequestOutput:
        """Send one request; its measurement (failures recorded, not raised)."""
        ...

    async def flush_cache(self) -> bool:
        """Drop the server's prefix cache, if it can; whether it did."""
        ...

    def describe(self) -> dict[str, Any]:
        """Facts about the server for the result row."""
        ...


def _output(row: DatasetRow) -> RequestOutput:
    return RequestOutput(prompt_len=row.prompt_len, role=row.role)


class EngineBackend:
    """Requests to an in-process `srt.Engine` (built with a tokenizer or without)."""

    name = "engine"

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.incremental = bool(engine.server_args.incremental_streaming_output)

    async def send(self, row: DatasetRow) -> RequestOutput:
        out = _output(row)
        params = {"max_new_tokens": row.output_len, "temperature": 0.0, "ignore_eos": True}
        seen = 0
        out.start_time = time.perf_counter()
        try:
            chunks = await self.engine.async_generate(
                input_ids=list(row.prompt), sampling_params=params, stream=True
            )
            async for chunk in chunks:
                now = time.perf_counter()
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                ids = len(chunk["output_ids"])
                new = ids if self.incremental else ids - seen
                if new > 0:
                    out.token_times.append(now)
                    seen += new
                out.cached_tokens = chunk["meta_info"].get("cached_tokens")
            out.end_time = time.perf_counter()
            out.output_len = seen
            out.success = True
        except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
            out.end_time = time.perf_counter()
            out.error = f"{type(e).__name__}: {e}"
        return out

    async def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

    def describe(self) -> dict[str, Any]:
        args = self.engine.server_args
        report = self.engine.get_kv_memory_report()
        return {
            "device": str(args.device),
            "disable_radix_cache": args.disable_radix_cache,
            "chunked_prefill_size": args.chunked_prefill_size,
            "decode_chunked_prefill_size": args.decode_chunked_prefill_size,
            "page_size": args.page_size,
            "kv_cache_dtype": args.kv_cache_dtype,
            "cuda_graph": not args.disable_cuda_graph,
            "max_total_num_tokens": None if report is None else report.max_total_num_tokens,
        }


def completions_url(base_url: str) -> str:
    """The completions endpoint of a server root (``http://host:port``) or of its OpenAI
    prefix (``.../v1``), as SGLang's and our GPQA client take it."""
    base = base_url.rstrip("/")
    return f"{base}/completions" if base.endswith("/v1") else f"{base}/v1/completions"


def server_root(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


class OpenAIBackend:
    """Streamed ``/v1/completions`` requests to an OpenAI-compatible server.

    A chunk with a choice counts as one arrival (the servers stream one chunk per step), except
    a closing chunk that carries only its finish reason. The output length is the usage's
    ``completion_tokens`` when the server sends usage (``stream_options.include_usage``),
    else the length asked for (exact with ignore_eos).
    """

    name = "openai"

    def __init__(self, base_url: str, model: str, api_key: str = "EMPTY") -> None:
        self.url = completions_url(base_url)
        self.root = server_root(base_url)
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"}

    @classmethod
    async def connect(cls, base_url: str, model: str | None, api_key: str) -> OpenAIBackend:
        """The backend, naming the server's first model when ``model`` is None."""
        if model is None:
            root = server_root(base_url)
            cards = await request_json("GET", f"{root}/v1/models", None, cls._auth(api_key))
            data = (cards or {}).get("data") or []
            model = str(data[0]["id"]) if data else "default"
        return cls(base_url, model, api_key)

    @staticmethod
    def _auth(api_key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"}

    def payload(self, row: DatasetRow) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": list(row.prompt),
            "max_tokens": row.output_len,
            "min_tokens": row.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def send(self, row: DatasetRow) -> RequestOutput:
        out = _output(row)
        usage: dict[str, Any] | None = None
        out.start_time = time.perf_counter()
        try:
            async for data in stream_events(self.url, self.payload(row), self.headers):
                now = time.perf_counter()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    raise RuntimeError(err.get("message") if isinstance(err, dict) else err)
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    if choice.get("text") or choice.get("finish_reason") is None:
                        out.token_times.append(now)
                        break
            out.end_time = time.perf_counter()
            out.output_len = row.output_len
            if usage:
                out.output_len = int(usage.get("completion_tokens") or row.output_len)
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    out.cached_tokens = int(details["cached_tokens"])
            out.success = True
        except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
            out.end_time = time.perf_counter()
            out.error = f"{type(e).__name__}: {e}"
        return out

    async def flush_cache(self) -> bool:
        try:
            await request_json("POST", f"{self.root}/flush_cache", None, self.headers)
        except (OSError, RuntimeError, ValueError):
            return False
        return True

    def describe(self) -> dict[str, Any]:
        return {"base_url": self.root, "model": self.model}


__all__ = ["Backend", "EngineBackend", "OpenAIBackend", "completions_url", "server_root"]
