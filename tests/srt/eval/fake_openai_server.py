"""A tiny OpenAI-compatible HTTP server on 127.0.0.1 for the eval's --base-url tests.

``/v1/models`` lists one model; ``/v1/chat/completions`` answers every GPQA prompt correctly (it
finds the choice text "right-<i>"), rejects a prompt containing ``TOO LONG`` with HTTP 400 and an
OpenAI-style error body (as a server does for a prompt beyond the context length), and fails a
prompt containing ``FLAKY`` with HTTP 500 the first time only.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake-model"
CONTEXT_ERROR = "This model's maximum context length is 64 tokens; the request has 4000."


class FakeOpenAIServer:
    """Start with ``with FakeOpenAIServer() as srv:``; ``srv.base_url`` ends in ``/v1``."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.failed_once: set[str] = set()
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output quiet
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                if self.path != "/v1/chat/completions":
                    self._send(404, {"error": {"message": "not found"}})
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append(body)
                prompt = body["messages"][-1]["content"]
                if "TOO LONG" in prompt:
                    err = {"message": CONTEXT_ERROR, "type": "BadRequestError", "code": 400}
                    self._send(400, {"object": "error", "error": err})
                    return
                with outer.lock:
                    flaky = "FLAKY" in prompt and prompt not in outer.failed_once
                    outer.failed_once.add(prompt)
                if flaky:
                    self._send(500, {"error": {"message": "internal error"}})
                    return
                letter = re.search(r"^([A-D])\) right-", prompt, re.M).group(1)
                msg = {"role": "assistant", "content": f"Reasoning...\nAnswer: {letter}"}
                self._send(
                    200,
                    {
                        "id": "cmpl-1",
                        "object": "chat.completion",
                        "model": body["model"],
                        "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
                    },
                )

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeOpenAIServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)
