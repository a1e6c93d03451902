"""Logprob options in (`Engine.generate`'s arguments) and logprob fields out (meta_info).

SGLang's names and shapes. In: `return_logprob`, `logprob_start_len` (-1, the default: no prompt
tokens; otherwise the first prompt position scored, at most the prompt's length),
`top_logprobs_num` (0: no top lists), `return_text_in_logprobs`; each a value for every request
or a list with one per request. Out, in meta_info: `input_token_logprobs` and
`output_token_logprobs` as (logprob, token_id, text or None) tuples (the first input one's
logprob is None, as SGLang's), and with top_logprobs_num > 0 `input_top_logprobs` /
`output_top_logprobs`: per position a list of such tuples, most likely first (None for the first
input position).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from srt.managers.schedule_batch import Req

LOGPROB_ARGS = (
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
)


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def per_request_logprob_args(n: int, **args: Any) -> list[dict[str, Any]]:
    """The logprob arguments of each of n requests (a list gives one per request, anything else
    is every request's). Raises ValueError for a list of another length."""
    unknown = sorted(set(args) - set(LOGPROB_ARGS))
    if unknown:
        raise TypeError(f"unknown logprob arguments {unknown}")
    out: list[dict[str, Any]] = [{} for _ in range(n)]
    for name, value in args.items():
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{len(value)} {name} values for {n} requests")
            for d, v in zip(out, value, strict=True):
                d[name] = v
        else:
            for d in out:
                d[name] = value
    return out


def logprob_req_fields(args: dict[str, Any], prompt_len: int) -> dict[str, Any]:
    """The Req fields of one request's logprob arguments for a prompt of prompt_len tokens.

    Raises
    ------
    TypeError / ValueError naming the argument: top_logprobs_num not an int >= 0,
    logprob_start_len not an int >= -1 or beyond the prompt (as SGLang refuses it).
    """
    want = bool(args.get("return_logprob") or False)
    top = args.get("top_logprobs_num")
    top = 0 if top is None else _int("top_logprobs_num", top, 0)
    start = args.get("logprob_start_len")
    start = -1 if start is None else _int("logprob_start_len", start, -1)
    if want and start > prompt_len:
        raise ValueError(
            f"logprob_start_len={start} is higher than the number of input tokens {prompt_len}"
        )
    return {
        "return_logprob": want,
        "top_logprobs_num": top if want else 0,
        "logprob_start_len": prompt_len if start == -1 or not want else start,
        "return_text_in_logprobs": bool(args.get("return_text_in_logprobs") or False),
    }


def _texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token's own text (SGLang decodes them one by one)."""
    if not ids:
        return []
    return list(tokenizer.batch_decode([[t] for t in ids]))


def logprob_meta(req: Req, tokenizer: Any, out_start: int = 0) -> dict[str, Any]:
    """The meta_info logprob fields of a request (its output ones from token out_start on).

    Returns {} for a request without return_logprob.
    """
    if not req.return_logprob:
        return {}
    in_ids = req.origin_input_ids[req.logprob_start_len :][: len(req.input_token_logprobs)]
    out_ids = req.output_ids[out_start : len(req.output_token_logprobs)]
    in_top = req.input_top_logprobs if req.top_logprobs_num > 0 else []
    out_top = req.output_top_logprobs[out_start:] if req.top_logprobs_num > 0 else []
    text: dict[int, str] = {}
    if req.return_text_in_logprobs and tokenizer is not None:
        ids = {*in_ids, *out_ids}
        for rows in (in_top, out_top):
            ids.update(t for row in rows if row for _, t in row)
        order = sorted(ids)
        text = dict(zip(order, _texts(tokenizer, order), strict=True))

    def triples(lps: Sequence[float | None], toks: Sequence[int]) -> list[tuple]:
        return [(lp, t, text.get(t)) for lp, t in zip(lps, toks, strict=True)]

    def top_rows(rows: Sequence[Sequence[tuple[float, int]] | None]) -> list[list[tuple] | None]:
        return [None if row is None else [(lp, t, text.get(t)) for lp, t in row] for row in rows]

    meta: dict[str, Any] = {
        "input_token_logprobs": triples(req.input_token_logprobs, in_ids),
        "output_token_logprobs": triples(req.output_token_logprobs[out_start:], out_ids),
    }
    if req.top_logprobs_num > 0:
        meta["input_top_logprobs"] = top_rows(in_top)
        meta["output_top_logprobs"] = top_rows(out_top)
    return meta
