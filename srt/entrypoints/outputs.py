"""Output dicts of `Engine.generate`: whole results, streamed increments and per-request errors.

Format as SGLang's: `text` (with a tokenizer), `output_ids`, `meta_info` (`id` a string,
`finish_reason`, `prompt_tokens`, `completion_tokens`, `cached_tokens`, `e2e_latency`, plus
`truncation` when allow_auto_truncate cut the request), `output_token_logprobs` on request
(and SGLang's logprob fields in meta_info: srt/entrypoints/logprob_io.py).
A request that failed alone inside a step also has `error` (its finish reason is abort with the
message and status_code 500; its tokens so far are kept).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from srt.entrypoints.logprob_io import logprob_meta
from srt.managers.schedule_batch import Req

REPLACEMENT_CHAR = "\ufffd"  # what a partial UTF-8 sequence decodes to


@dataclass(frozen=True)
class RequestError:
    """A request rejected before it ran (bad input or sampling parameters).

    Attributes
    ----------
    rid : the id it would have had.
    error : the ValueError / TypeError raised while checking it.
    index : the position of its prompt in the call (0 for a single prompt).
    """

    rid: str
    error: Exception
    index: int = 0

    @property
    def message(self) -> str:
        return str(self.error)


def output_text(req: Req, tokenizer: Any) -> str:
    """The request's text so far; a matched stop token or string is cut off (SGLang's trim)."""
    params = req.sampling_params
    ids = req.output_ids
    reason = req.finished_reason or {}
    trim = reason.get("type") == "stop" and not params.no_stop_trim
    matched = reason.get("matched")
    if trim and isinstance(matched, int) and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
    if trim and isinstance(matched, str):
        pos = text.find(matched)
        if pos >= 0:
            text = text[:pos]
    return text


def meta_info(req: Req) -> dict[str, Any]:
    """SGLang's meta_info of a request (finish_reason None while it runs)."""
    end = req.finished_time or time.perf_counter()
    meta: dict[str, Any] = {
        "id": str(req.rid),
        "finish_reason": req.finished_reason,
        "prompt_tokens": len(req.origin_input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,  # prompt tokens taken from the prefix cache
        "e2e_latency": end - req.created_time,
    }
    meta.update(req.meta)
    return meta


def final_output(req: Req, tokenizer: Any) -> dict[str, Any]:
    """The whole result of a finished request."""
    out: dict[str, Any] = {"output_ids": list(req.output_ids)}
    if tokenizer is not None:
        out["text"] = output_text(req, tokenizer)
    meta = meta_info(req)
    if req.return_logprob:
        out["output_token_logprobs"] = list(req.output_token_logprobs)
        meta.update(logprob_meta(req, tokenizer))
    out["meta_info"] = meta
    if req.error is not None:
        out["error"] = req.finished_reason["message"] if req.finished_reason else str(req.error)
    return out


def error_output(err: RequestError, with_text: bool) -> dict[str, Any]:
    """The entry of a rejected request: no tokens, `error`, finish_reason abort with message."""
    out: dict[str, Any] = {"output_ids": [], "error": err.message}
    if with_text:
        out["text"] = ""
    out["meta_info"] = {
        "id": err.rid,
        "finish_reason": {"type": "abort", "message": err.message, "status_code": 400},
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "cached_tokens": 0,
        "e2e_latency": 0.0,
    }
    return out


class StreamState:
    """Turns a running request into streamed chunks, one per step that produced something.

    Cumulative by default, as SGLang's streams: each chunk has every output id and the whole
    text so far (`incremental_streaming_output=False`). With `incremental`, a chunk has only
    the ids and the text added since the previous one.

    Text that could still change is held back: a trailing partial UTF-8 character, and, while
    the request has stop strings, the last (longest stop string - 1) characters, so a stop
    string is never streamed before it is cut.
    """

    def __init__(self, req: Req, tokenizer: Any, incremental: bool = False) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self.incremental = incremental
        self.sent_ids = 0
        self.sent_chars = 0
        self.done = False

    def _visible_text(self) -> str:
        text = output_text(self.req, self.tokenizer)
        if self.req.finished:
            return text
        text = text.rstrip(REPLACEMENT_CHAR)
        stops = self.req.sampling_params.stop
        if stops:
            text = text[: max(0, len(text) - (max(len(s) for s in stops) - 1))]
        return text

    def next_chunk(self) -> dict[str, Any] | None:
        """The output so far (or, incremental, what is new since the last call), or None if
        there is nothing new."""
        req = self.req
        if self.done or (len(req.output_ids) == self.sent_ids and not req.finished):
            return None
        start = self.sent_ids if self.incremental else 0
        chunk: dict[str, Any] = {"output_ids": req.output_ids[start:]}
        if self.tokenizer is not None:
            text = self._visible_text()
            chunk["text"] = text[self.sent_chars :] if self.incremental else text
            self.sent_chars = max(self.sent_chars, len(text))
        meta = meta_info(req)
        if req.error is not None and req.finished_reason:
            chunk["error"] = req.finished_reason["message"]
        if req.return_logprob:
            chunk["output_token_logprobs"] = req.output_token_logprobs[start:]
            meta.update(logprob_meta(req, self.tokenizer, out_start=start))
        chunk["meta_info"] = meta
        self.sent_ids = len(req.output_ids)
        self.done = req.finished
        return chunk
