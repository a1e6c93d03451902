"""The OpenAI API's request and response bodies, translated to and from `Engine.generate`.

Pure functions, no I/O: `http_server.py` calls them. Requests take the OpenAI names
(max_tokens, stop, n, seed, temperature, top_p, frequency/presence_penalty, logit_bias;
logprobs, top_logprobs and echo are read by openai_logprobs.py) and SGLang's extra sampling
keys (top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
skip_special_tokens, no_stop_trim); chat requests also `reasoning_effort` and
`chat_template_kwargs`, which go to the chat template. Fields this server does not know are
ignored (logged at debug level), as SGLang and vLLM do; options it knows but cannot honour
(tools, a `response_format` other than text) raise BadRequest (HTTP 400), never a silent 200.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import fields
from typing import Any

from srt.entrypoints.http_checks import (
    BadRequest,
    check_logit_bias,
    check_prompt_text,
    check_sampling_params,
)
from srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

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
)
# Read elsewhere, or accepted with no effect on the output here.
_OTHER = "model user stream stream_options best_of suffix prompt echo logprobs".split()
_OTHER += ["logit_bias", "response_format"]
_CHAT_ONLY = "messages tools tool_choice top_logprobs reasoning_effort chat_template_kwargs".split()
LOGIT_BIAS = "logit_bias"  # the SamplingParams field it goes to
# apply_chat_template's own arguments, which chat_template_kwargs may not set (a template sent
# with a request is refused, as SGLang does unless told to trust it).
_TEMPLATE_ARGUMENTS = {"messages", "conversation", "tokenize", "add_generation_prompt"}
_TEMPLATE_ARGUMENTS |= {"chat_template", "tools", "return_dict", "return_tensors"}


def error_body(message: str, param: str | None = None, code: int = 400) -> dict[str, Any]:
    """OpenAI's error body."""
    kind = "invalid_request_error" if code < 500 else "internal_server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _known_fields(chat: bool) -> set[str]:
    known = {*_RENAMED, *_SAME, *_OTHER}
    return known | set(_CHAT_ONLY) if chat else known


def _check_response_format(value: Any) -> None:
    if value is None or value == {"type": "text"}:
        return
    kind = value.get("type") if isinstance(value, dict) else value
    raise BadRequest(
        f"response_format {kind!r} is not supported by this server (no grammar backend): "
        'only {"type": "text"}',
        "response_format",
    )


def sampling_params(
    body: dict[str, Any], chat: bool, vocab_size: int | None = None
) -> dict[str, Any]:
    """Engine sampling_params from an OpenAI request body.

    Unknown fields are ignored (debug log). Raises BadRequest for options this server cannot
    honour and for values the engine could not reject cleanly (http_checks).
    """
    unknown = sorted(set(body) - _known_fields(chat))
    if unknown:
        logger.debug("ignoring unknown request fields %s", unknown)
    if body.get("tools"):
        raise BadRequest("tools are not supported by this server", "tools")
    _check_response_format(body.get("response_format"))
    params: dict[str, Any] = {}
    for name in _SAME:
        if body.get(name) is not None:
            params[name] = body[name]
    for name, ours in _RENAMED.items():
        if body.get(name) is not None:
            params[ours] = body[name]
    bias = body.get("logit_bias")
    if bias:  # None and {} change nothing
        check_logit_bias(bias, vocab_size)
        if LOGIT_BIAS not in {f.name for f in fields(SamplingParams)}:
            raise BadRequest("logit_bias is not supported by this server", "logit_bias")
        params[LOGIT_BIAS] = bias
    if not chat:
        params.setdefault("max_new_tokens", DEFAULT_MAX_TOKENS)
    check_sampling_params(params, vocab_size)
    return params


def chat_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """Extra variables for the chat template: `reasoning_effort` (when given), then the
    request's `chat_template_kwargs` (SGLang's order: the latter wins)."""
    kwargs: dict[str, Any] = {}
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise BadRequest(
                f"reasoning_effort must be a string, got {type(effort).__name__}",
                "reasoning_effort",
            )
        kwargs["reasoning_effort"] = effort
    extra = body.get("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
            raise BadRequest(
                "chat_template_kwargs must be an object with string keys", "chat_template_kwargs"
            )
        reserved = _TEMPLATE_ARGUMENTS & set(extra)
        if reserved:
            raise BadRequest(
                f"chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs"
            )
        kwargs.update(extra)
    return kwargs


def completion_inputs(body: dict[str, Any]) -> dict[str, Any]:
    """`prompt` or `input_ids` for generate, from a completions `prompt` field."""
    prompt = body.get("prompt")
    check_prompt_text(prompt, "prompt")
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


def chat_input_ids(
    tokenizer: Any, messages: list[dict[str, str]], template_kwargs: dict[str, Any]
) -> list[int]:
    """The prompt ids of a chat: the tokenizer's chat template with `template_kwargs` as extra
    variables, or the plain fallback template. A template that rejects the messages (an
    unknown role, a variable of the wrong type: jinja raises) is the request's fault: 400."""
    if tokenizer is None:
        raise BadRequest("this server has no tokenizer: use /v1/completions with token ids")
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(plain_chat_template(messages)))
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **template_kwargs
        )
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError and whatever a template raises
        raise BadRequest(f"the chat template rejected the request: {e}", "messages") from e
    if not isinstance(text, str):
        raise BadRequest("the chat template did not render to text", "messages")
    return list(tokenizer.encode(text, add_special_tokens=False))  # the template has its BOS


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


def usage(outputs: list[dict[str, Any]], n: int = 1, cache_report: bool = False) -> dict[str, Any]:
    """Token counts of a response: every prompt's tokens once (its n outputs share them, as
    OpenAI counts with n > 1), every output's tokens; with `cache_report` (SGLang's
    --enable-cache-report) also `prompt_tokens_details.cached_tokens`, the prompt tokens
    taken from the prefix cache (counted once per prompt too).

    Parameters
    ----------
    outputs : prompt-major, the n outputs of each prompt next to each other.
    n : outputs per prompt.
    cache_report : add prompt_tokens_details.
    """
    if n < 1 or len(outputs) % n:
        raise ValueError(f"{len(outputs)} outputs are not a whole number of prompts of n={n}")
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outputs[::n])
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cache_report:
        cached = sum(o["meta_info"].get("cached_tokens", 0) for o in outputs[::n])
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_response(
    rid: str, model: str, outputs: list[dict[str, Any]], n: int = 1, cache_report: bool = False
) -> dict[str, Any]:
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
        "usage": usage(outputs, n, cache_report),
    }


def chat_response(
    rid: str, model: str, outputs: list[dict[str, Any]], n: int = 1, cache_report: bool = False
) -> dict[str, Any]:
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
        "usage": usage(outputs, n, cache_report),
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
