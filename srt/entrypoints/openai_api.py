"""The OpenAI API's request and response bodies, translated to and from `Engine.generate`.

Pure functions, no I/O: `http_server.py` calls them. Requests take the OpenAI names
(max_tokens, stop, n, seed, temperature, top_p, frequency/presence_penalty, logit_bias; logprobs,
top_logprobs and echo in openai_logprobs.py) and SGLang's extra
sampling keys (top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
skip_special_tokens, no_stop_trim). Unsupported OpenAI options raise ValueError (HTTP 400).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default
# OpenAI name -> SamplingParams name.
_RENAMED = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
}
_SAME = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "n",
    "logit_bias",
)
# Accepted and ignored (no effect on the output here; logprobs, top_logprobs and echo are read
# by openai_logprobs.py).
_IGNORED = ("model", "user", "stream", "stream_options", "best_of", "suffix")
_CHAT_ONLY = ("messages", "max_completion_tokens", "response_format", "tools", "tool_choice")


class BadRequest(ValueError):
    """A request body the API cannot serve (HTTP 400, with `param` naming the field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, param: str | None = None, code: int = 400) -> dict[str, Any]:
    """OpenAI's error body."""
    kind = "invalid_request_error" if code < 500 else "internal_server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sampling_params(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """Engine sampling_params from an OpenAI request body (unknown fields raise BadRequest)."""
    allowed = {*_RENAMED, *_SAME, *_IGNORED, "logprobs", "echo", "prompt"}
    if chat:
        allowed |= {*_CHAT_ONLY, "top_logprobs"}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unsupported request fields {unknown}", unknown[0])
    if body.get("tools"):
        raise BadRequest("tools are not supported by this server", "tools")
    params: dict[str, Any] = {}
    for name in _SAME:
        if body.get(name) is not None:
            params[name] = body[name]
    for name, ours in _RENAMED.items():
        if body.get(name) is not None:
            params[ours] = body[name]
    if not chat:
        params.setdefault("max_new_tokens", DEFAULT_MAX_TOKENS)
    return params


def completion_inputs(body: dict[str, Any]) -> dict[str, Any]:
    """`prompt` or `input_ids` for generate, from a completions `prompt` field."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return {"prompt": prompt}
        if all(isinstance(p, list) for p in prompt):
            return {"input_ids": prompt}
        if not any(isinstance(p, (str, list)) for p in prompt):
            return {"input_ids": prompt}
    raise BadRequest(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists",
        "prompt",
    )


def plain_chat_template(messages: list[dict[str, str]]) -> str:
    """The fallback template for a tokenizer without one: "role: content" lines."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant:"])


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """The checked `messages` of a chat request (text content; a list of text parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message needs a role and a content", "messages")
        content = m.get("content")
        if isinstance(content, list):
            texts = [
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            ]
            if len(texts) != len(content):
                raise BadRequest("only text content parts are supported", "messages")
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise BadRequest("message content must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def finish_reason(reason: dict[str, Any] | None) -> str | None:
    """OpenAI's finish_reason ("stop", "length", "abort") from SGLang's dict."""
    return None if reason is None else str(reason.get("type"))


def usage(outputs: list[dict[str, Any]]) -> dict[str, int]:
    """Token counts of a response (each prompt counted once, as OpenAI does with n > 1)."""
    prompts = {o["meta_info"]["prompt_tokens"] for o in outputs}  # the n copies share one
    prompt = sum(prompts) if len(prompts) > 1 else next(iter(prompts), 0)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_response(rid: str, model: str, outputs: list[dict[str, Any]]) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "text": o.get("text", ""),
            "logprobs": None,
            "finish_reason": finish_reason(o["meta_info"]["finish_reason"]),
        }
        for i, o in enumerate(outputs)
    ]
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(outputs),
    }


def chat_response(rid: str, model: str, outputs: list[dict[str, Any]]) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": o.get("text", "")},
            "logprobs": None,
            "finish_reason": finish_reason(o["meta_info"]["finish_reason"]),
        }
        for i, o in enumerate(outputs)
    ]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(outputs),
    }


def stream_chunk(
    rid: str, model: str, chat: bool, index: int, text: str | None, reason: str | None
) -> dict[str, Any]:
    """One server-sent chunk of a streamed completion / chat completion."""
    if chat:
        delta: dict[str, Any] = {} if text is None else {"content": text}
        if text is None and reason is None:
            delta = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
        kind = "text_completion"
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
