"""OpenAI's logprobs and echo: request options to Engine.generate's, meta_info to OpenAI's shapes.

Requests: completions `logprobs` (int, top entries per token; 0 gives the chosen tokens' only)
and `echo` (the prompt's text before the completion; with logprobs also the prompt tokens',
the first of them null: `logprob_start_len=0`, as SGLang does), chat `logprobs` (bool) and
`top_logprobs` (int, needs logprobs). lm-eval-style scoring sends echo + logprobs with
max_tokens 0 or 1 and reads `token_logprobs` / `top_logprobs` of the prompt.

Responses: completions `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (top lists
as {token text: logprob}, most likely first; [] when logprobs is 0, as SGLang's; text_offset the
running length of the tokens' texts in the choice's text), chat `{"content": [{"token",
"logprob", "bytes", "top_logprobs": [...]}]}`. A token without text (a server without a
tokenizer) is written "token_id:<id>".
"""

from __future__ import annotations

from typing import Any

from srt.entrypoints.openai_api import BadRequest

MAX_TOP_LOGPROBS = 20


def _top_count(body: dict[str, Any], name: str) -> int:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}]", name)
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}", name)
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean", name)
    return bool(value)


def generate_logprob_args(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """Engine.generate's logprob arguments for an OpenAI request body (BadRequest if bad)."""
    if chat:
        want = _flag(body, "logprobs")
        top = _top_count(body, "top_logprobs") if body.get("top_logprobs") is not None else 0
        if top and not want:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        if not want:
            return {}
        return {"return_logprob": True, "top_logprobs_num": top, "return_text_in_logprobs": True}
    echo = _flag(body, "echo")
    if body.get("logprobs") is None or body.get("logprobs") is False:  # (0 asks: no top lists)
        return {}
    return {
        "return_logprob": True,
        "top_logprobs_num": _top_count(body, "logprobs"),
        "logprob_start_len": 0 if echo else -1,
        "return_text_in_logprobs": True,
    }


def echo_texts(body: dict[str, Any], tokenizer: Any) -> list[str] | None:
    """The prompt text each completions choice starts with under `echo` (None without echo),
    one per prompt; choice i echoes prompt i // n."""
    if not body.get("echo"):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    prompts = prompt if isinstance(prompt, list) else []
    if prompts and all(isinstance(p, str) for p in prompts):
        return list(prompts)
    if prompts and not isinstance(prompts[0], list):
        prompts = [prompts]  # one prompt of token ids
    if tokenizer is None:
        return ["" for _ in prompts]
    return [tokenizer.decode(p, skip_special_tokens=True) for p in prompts]


def _token(entry: Any) -> str:
    _, tok, text = entry
    return text if text is not None else f"token_id:{tok}"


def _top_dict(row: list | None) -> dict[str, float] | None:
    if row is None:
        return None
    out: dict[str, float] = {}
    for entry in row:  # most likely first: a text two tokens share keeps the likelier
        out.setdefault(_token(entry), entry[0])
    return out


def completion_logprobs(
    meta: dict[str, Any], with_input: bool, text_offset: int = 0
) -> dict[str, Any]:
    """A completions choice's `logprobs` from meta_info (prompt tokens too with_input; text
    offsets counted from text_offset)."""
    entries = list(meta.get("input_token_logprobs") or []) if with_input else []
    entries += list(meta.get("output_token_logprobs") or [])
    tops: list = []
    if "output_top_logprobs" in meta:
        tops = list(meta.get("input_top_logprobs") or []) if with_input else []
        tops += list(meta["output_top_logprobs"])
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(_token(entry))
    return {
        "tokens": [_token(e) for e in entries],
        "token_logprobs": [e[0] for e in entries],
        "top_logprobs": [_top_dict(row) for row in tops],
        "text_offset": offsets,
    }


def _chat_entry(entry: Any) -> dict[str, Any]:
    text = _token(entry)
    return {"token": text, "logprob": entry[0], "bytes": list(text.encode("utf-8"))}


def chat_logprobs(meta: dict[str, Any]) -> dict[str, Any]:
    """A chat choice's `logprobs` ({"content": [...]}) from meta_info."""
    entries = list(meta.get("output_token_logprobs") or [])
    tops = list(meta.get("output_top_logprobs") or [])
    content = []
    for i, entry in enumerate(entries):
        item = _chat_entry(entry)
        row = tops[i] if i < len(tops) else None
        item["top_logprobs"] = [_chat_entry(e) for e in row or []]
        content.append(item)
    return {"content": content}


def add_logprobs(
    response: dict[str, Any],
    outputs: list[dict[str, Any]],
    chat: bool,
    echo: list[str] | None,
    n: int,
) -> dict[str, Any]:
    """Fill a whole (non-streamed) response's choices: logprobs where asked, echoed prompts."""
    for choice, out in zip(response["choices"], outputs, strict=True):
        meta = out.get("meta_info", {})
        if echo is not None:
            choice["text"] = echo[choice["index"] // n] + choice["text"]
        if "output_token_logprobs" not in meta:
            continue
        if chat:
            choice["logprobs"] = chat_logprobs(meta)
        else:
            choice["logprobs"] = completion_logprobs(meta, with_input=echo is not None)
    return response


class StreamLogprobs:
    """Per-choice state of a streamed response: the echo sent, the text offset so far.

    Fed the engine's incremental chunks (the server asks for them): a chunk's meta_info lists
    only its own new output entries.
    """

    def __init__(self, chat: bool, echo: list[str] | None, n: int) -> None:
        self.chat, self.echo, self.n = chat, echo, n
        self.started: set[int] = set()  # choice indices with a chunk sent
        self.offset: dict[int, int] = {}  # choice index -> characters sent (completions)

    def fill(self, payload: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
        """Add the logprobs (and, first, the echo) of chunk `out` to its SSE payload."""
        choice = payload["choices"][0]
        index = choice["index"]
        first = index not in self.started
        self.started.add(index)
        meta = out.get("meta_info", {})
        if first and self.echo is not None:
            choice["text"] = self.echo[index // self.n] + (choice.get("text") or "")
        if meta.get("output_token_logprobs") is None:
            return payload
        if self.chat:
            choice["logprobs"] = chat_logprobs(meta)
        else:
            with_input = first and self.echo is not None
            got = completion_logprobs(meta, with_input, self.offset.get(index, 0))
            choice["logprobs"] = got
            if got["tokens"]:
                self.offset[index] = got["text_offset"][-1] + len(got["tokens"][-1])
        return payload
