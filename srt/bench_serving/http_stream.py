"""A small HTTP/1.1 client on asyncio streams (stdlib only): JSON requests and server-sent
events, for the ``openai`` backend of ``python -m srt.bench_serving``.

One connection per request (``Connection: close``), so hundreds of concurrent streams need no
pool and no threads; the response body may be chunked (uvicorn's streaming responses) or
plain. http and https URLs.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

_LIMIT = 1 << 24  # longest line the reader accepts (a big SSE payload)


class HTTPError(RuntimeError):
    """A response whose status is not 2xx: ``status`` and the start of its body."""

    def __init__(self, status: int, body: str) -> None:
        self.status = status
        super().__init__(f"HTTP {status}: {body[:300]}")


async def _open(
    method: str, url: str, body: Any, headers: dict[str, str]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int, dict[str, str]]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    reader, writer = await asyncio.open_connection(
        parts.hostname, port, ssl=ssl.create_default_context() if https else None, limit=_LIMIT
    )
    data = b"" if body is None else json.dumps(body).encode()
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    head = [f"{method} {path} HTTP/1.1", f"Host: {parts.hostname}:{port}", "Connection: close"]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    await writer.drain()
    status_line = (await reader.readline()).decode("latin-1").split()
    if len(status_line) < 2 or not status_line[1].isdigit():
        writer.close()
        raise ConnectionError(f"no HTTP response from {url}")
    response_headers: dict[str, str] = {}
    while True:
        line = (await reader.readline()).decode("latin-1").strip()
        if not line:
            break
        key, _, value = line.partition(":")
        response_headers[key.strip().lower()] = value.strip()
    return reader, writer, int(status_line[1]), response_headers


async def _body_chunks(
    reader: asyncio.StreamReader, headers: dict[str, str]
) -> AsyncIterator[bytes]:
    """The response body as it arrives (chunked transfer decoded)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)  # the chunk's CRLF
            yield data
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(1 << 16):
            yield data


async def request_json(
    method: str, url: str, body: Any = None, headers: dict[str, str] | None = None
) -> Any:
    """The decoded JSON answer of one request, or its text when it is not JSON (HTTPError for a
    non-2xx status)."""
    reader, writer, status, rh = await _open(method, url, body, headers or {})
    try:
        data = b"".join([c async for c in _body_chunks(reader, rh)])
    finally:
        writer.close()
    text = data.decode("utf-8", "replace")
    if not 200 <= status < 300:
        raise HTTPError(status, text)
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return text


async def stream_events(
    url: str, body: Any, headers: dict[str, str] | None = None
) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent-event response to a POST, as they arrive
    (``[DONE]`` included as it is). HTTPError for a non-2xx status."""
    reader, writer, status, rh = await _open(
        "POST", url, body, {"Accept": "text/event-stream", **(headers or {})}
    )
    try:
        if not 200 <= status < 300:
            data = b"".join([c async for c in _body_chunks(reader, rh)])
            raise HTTPError(status, data.decode("utf-8", "replace"))
        pending = b""
        async for chunk in _body_chunks(reader, rh):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.rstrip(b"\r")
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode("utf-8", "replace")
        if pending.startswith(b"data:"):
            yield pending[5:].strip().decode("utf-8", "replace")
    finally:
        writer.close()


__all__ = ["HTTPError", "request_json", "stream_events"]
