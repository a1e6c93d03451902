"""Checks the HTTP server runs on a request body before anything of it reaches the engine.

A body that would make the engine or its scheduler raise (a nesting too deep for the JSON
decoder, an empty prompt text, a `stop` that is not text, a seed beyond 64 bits, an `n` that
would flood the batch) is answered HTTP 400 here, naming the field, so it never joins a batch
that other clients' requests share. The engine still checks every value itself
(`SamplingParams`, `request_checks.py`); these checks only make sure a request it would reject
late, or fail on, is turned away first.
"""

from __future__ import annotations

import math
from typing import Any

# The most outputs one request may ask for (OpenAI's own limit for `n`).
MAX_N = 128
# Deepest JSON nesting accepted; the APIs' bodies need about 5 levels.
MAX_BODY_DEPTH = 64
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class BadRequest(ValueError):
    """A request body the API cannot serve (HTTP 400, with `param` naming the field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_depth(body: Any, limit: int = MAX_BODY_DEPTH) -> None:
    """Raise BadRequest if `body` nests lists/objects deeper than `limit` (walked iteratively,
    so the check itself cannot overflow the stack)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            raise BadRequest(f"the body nests deeper than {limit} levels")
        stack.extend((child, depth + 1) for child in children)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} ({text[:60]}{'...' if len(text) > 60 else ''})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_prompt_text(prompt: Any, param: str) -> None:
    """A prompt given as text must not be empty (a string, or each string of a list)."""
    texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
    for i, text in enumerate(texts):
        if isinstance(text, str) and not text:
            where = param if isinstance(prompt, str) else f"{param}[{i}]"
            raise BadRequest(f"{where} is an empty string: a request needs some text", param)


def _check_stop(stop: Any) -> None:
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest(
            f"stop must be a string or a list of strings, got {_describe(stop)}", "stop"
        )


def _check_stop_token_ids(ids: Any) -> None:
    if ids is None or _is_int(ids):
        return
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise BadRequest(
            f"stop_token_ids must be an int or a list of ints, got {_describe(ids)}",
            "stop_token_ids",
        )


def _check_n(n: Any) -> int:
    if n is None:
        return 1
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be an integer in [1, {MAX_N}], got {_describe(n)}", "n")
    return int(n)


def _check_seed(name: str, seed: Any, n: int) -> None:
    if seed is None:
        return
    if not _is_int(seed) or not SEED_MIN <= seed <= SEED_MAX - (n - 1):
        raise BadRequest(
            f"{name} must be an integer in [-2**63, 2**63 - n] (the n outputs take seeds "
            f"{name}, {name} + 1, ...), got {_describe(seed)}",
            name,
        )


def check_logit_bias(bias: Any, vocab_size: int | None) -> None:
    """`logit_bias`: an object from token ids (as strings, JSON's keys) to finite numbers."""
    if not isinstance(bias, dict):
        raise BadRequest(
            f"logit_bias must be an object of token id -> bias, got {_describe(bias)}",
            "logit_bias",
        )
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadRequest(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise BadRequest(
                f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})",
                "logit_bias",
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(
                f"logit_bias[{key!r}] must be a number, got {_describe(value)}", "logit_bias"
            )
        if not math.isfinite(value):
            raise BadRequest(f"logit_bias[{key!r}] must be finite, got {value}", "logit_bias")


def check_sampling_params(params: Any, vocab_size: int | None = None) -> None:
    """The values of one `sampling_params` dict (SGLang's names) that the engine could not
    reject cleanly, or would misread: `stop`, `stop_token_ids`, `n` (at most MAX_N), the seed
    (with its n - 1 successors within 64 signed bits) and `logit_bias`.

    Raises
    ------
    BadRequest : naming the field.
    """
    if params is None:
        return
    if not isinstance(params, dict):
        raise BadRequest(f"sampling_params must be an object, got {_describe(params)}")
    _check_stop(params.get("stop"))
    _check_stop_token_ids(params.get("stop_token_ids"))
    n = _check_n(params.get("n"))
    for name in ("sampling_seed", "seed"):
        _check_seed(name, params.get(name), n)
    if params.get("logit_bias") is not None:
        check_logit_bias(params["logit_bias"], vocab_size)


def check_generate_body(body: dict[str, Any], vocab_size: int | None = None) -> None:
    """The checks above for a native /generate body (a list of sampling_params too)."""
    check_prompt_text(body.get("text", body.get("prompt")), "text")
    params = body.get("sampling_params")
    for p in params if isinstance(params, list) else [params]:
        check_sampling_params(p, vocab_size)


def cache_key_args(body: dict[str, Any], openai: bool) -> dict[str, Any]:
    """`extra_key` for generate: SGLang's `extra_key` (on /generate a string or one per
    prompt), and on the OpenAI routes vLLM's `cache_salt` too (both given: both count).
    Requests with different keys never share a cached prefix. {} when neither is set."""
    key, salt = body.get("extra_key"), body.get("cache_salt") if openai else None
    for name, v in (("extra_key", key), ("cache_salt", salt)):
        many = name == "extra_key" and not openai and isinstance(v, list)
        ok = v is None or isinstance(v, str) or (many and all(isinstance(k, str) for k in v))
        if not ok:
            want = "a string" + ("" if openai else " or a list of strings")
            raise BadRequest(f"{name} must be {want}, got {_describe(v)}", name)
    if key is None and salt is None:
        return {}
    if salt is not None:
        key = salt if key is None else f"{key}\x00salt:{salt}"
    return {"extra_key": key}


__all__ = [
    "MAX_N",
    "BadRequest",
    "cache_key_args",
    "check_depth",
    "check_generate_body",
    "check_logit_bias",
    "check_prompt_text",
    "check_sampling_params",
]
