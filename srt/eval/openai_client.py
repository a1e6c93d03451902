"""A minimal OpenAI-compatible chat client (stdlib only) for running evals against a server.

``python -m srt.eval.gpqa --base-url http://host:port/v1`` sends every question as one user
message to ``POST {base_url}/chat/completions`` (the server applies its chat template), so the
same eval runs against our server, SGLang's or vLLM's. Requests run ``concurrency`` at a time;
a request the server rejects (HTTP 4xx, e.g. a prompt beyond the context length) or that keeps
failing becomes an error `Completion` and the run goes on. No ``openai`` package needed.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from srt.eval.engine_io import Completion

logger = logging.getLogger(__name__)


class OpenAIServerError(ValueError):
    """The server at --base-url cannot be used (unreachable, no models, bad answer)."""


@dataclass(frozen=True)
class ChatSampling:
    """The sampling fields of a chat-completions request."""

    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None


class OpenAIChatClient:
    """Chat completions against an OpenAI-compatible server.

    Parameters
    ----------
    base_url : the API root, e.g. ``http://127.0.0.1:30000/v1``.
    model : the model name sent with every request; None asks ``GET /models`` for the first.
        Its card's ``max_model_len`` (SGLang's, vLLM's and our server's) is `context_length`.
    api_key : sent as a bearer token (servers without auth ignore it).
    timeout : seconds per request.
    max_retries : extra attempts after a connection error or an HTTP 5xx.
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str = "EMPTY",
        timeout: float = 600.0,
        max_retries: int = 2,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise OpenAIServerError(f"--base-url must start with http:// or https:// ({base_url})")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries
        self.context_length: int | None = None
        self.model = model or self._first_model()
        if model is not None:
            self._learn_context_length(model)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.base_url}{path}", data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.api_key}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # noqa: S310 (http(s) only)
            return json.loads(resp.read().decode("utf-8"))

    def _first_model(self) -> str:
        try:
            listing = self._request("GET", "/models")
            card = listing["data"][0]
            self.context_length = _max_model_len(card)
            return str(card["id"])
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise OpenAIServerError(
                f"cannot reach the OpenAI-compatible server: {reason} ({self.base_url}/models)"
            ) from e
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise OpenAIServerError(
                f"GET /models returned no model: pass --model ({self.base_url}/models)"
            ) from e

    def _learn_context_length(self, model: str) -> None:
        """`context_length` from the named model's card, where the server lists it."""
        try:
            listing = self._request("GET", "/models")
            cards = [c for c in listing["data"] if c.get("id") == model]
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError, AttributeError):
            return  # a server without the listing: the context stays unknown
        if cards:
            self.context_length = _max_model_len(cards[0])

    def chat(self, prompt: str, sampling: ChatSampling) -> Completion:
        """One user turn; the assistant's text, or the error that ended the request."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        error = ""
        for attempt in range(self.max_retries + 1):
            try:
                out = self._request("POST", "/chat/completions", body)
                usage = out.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}  # --enable-cache-report
                return Completion(
                    out["choices"][0]["message"].get("content") or "",
                    prompt_tokens=usage.get("prompt_tokens"),
                    cached_tokens=details.get("cached_tokens"),
                )
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}: {_error_message(e)}"
                if e.code < 500:
                    break  # the request itself is wrong: retrying cannot help
            except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
                error = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            except (ValueError, KeyError, IndexError, TypeError) as e:
                error = f"malformed response: {type(e).__name__}: {e}"
                break
            if attempt < self.max_retries:
                time.sleep(min(2.0**attempt, 8.0))
        logger.warning("request failed: %s", error)
        return Completion(None, error)

    def complete_all(
        self,
        prompts: Sequence[str],
        sampling: ChatSampling,
        concurrency: int,
        desc: str = "requests",
    ) -> list[Completion]:
        """`chat` for every prompt, ``concurrency`` requests in flight; results in prompt order."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        with (
            ThreadPoolExecutor(max_workers=concurrency) as pool,
            tqdm(total=len(prompts), desc=desc, unit="prompt", file=sys.stderr) as bar,
        ):
            futures = [pool.submit(self.chat, p, sampling) for p in prompts]
            done = []
            for f in futures:
                done.append(f.result())
                bar.update(1)
        return done


def _max_model_len(card: Any) -> int | None:
    value = card.get("max_model_len") if isinstance(card, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _error_message(e: urllib.error.HTTPError) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the body or the reason."""
    try:
        raw = e.read().decode("utf-8", "replace")
    except OSError:
        return str(e.reason)
    try:
        body = json.loads(raw)
        err = body.get("error", body) if isinstance(body, dict) else body
        msg = err.get("message") if isinstance(err, dict) else err
        return " ".join(str(msg or raw).split())[:500]
    except ValueError:
        return " ".join(raw.split())[:500] or str(e.reason)


__all__ = ["ChatSampling", "OpenAIChatClient", "OpenAIServerError"]
