"""The scheduler's logprob work: prompt-token logprobs at the prefill, output ones per token.

SGLang's semantics (`return_logprob`, `logprob_start_len`, `top_logprobs_num`): a request's
input logprobs cover its prompt tokens from logprob_start_len on, the first of them None (SGLang
scores token p with position p - 1 only from logprob_start_len + 1 on); its output logprobs are
those of its sampled tokens (srt/sampling/logprobs.py). Top lists are (logprob, token id) pairs,
most likely first. A prefill whose requests want no input logprobs runs exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from srt.layers.logprob_processor import input_logprob_rows
from srt.managers.schedule_batch import Req
from srt.sampling.logprobs import OutputLogprob


def wants_input_logprobs(req: Req) -> bool:
    """Whether the request asks for logprobs of prompt tokens (logprob_start_len inside it)."""
    return req.return_logprob and 0 <= req.logprob_start_len < len(req.origin_input_ids)


def prefill_logits(runner: Any, forward_batch: Any, reqs: Sequence[Req]) -> torch.Tensor:
    """Run a prefill batch of reqs; store the input logprobs of those that ask for them.

    Returns
    -------
    float [B, V]: each request's next-token logits (what `runner.forward` returns).
    """
    wanted = [wants_input_logprobs(r) for r in reqs]
    if not any(wanted):
        return runner.forward(forward_batch)
    # positions relative to each request's computed tokens (past a cached prefix, which the
    # scheduler keeps at or before logprob_start_len for requests that ask)
    lens = list(forward_batch.extend_seq_lens_cpu)
    pre = list(forward_batch.extend_prefix_lens_cpu)
    starts = [
        r.logprob_start_len - p if w else n
        for r, w, n, p in zip(reqs, wanted, lens, pre, strict=True)
    ]
    tops = [r.top_logprobs_num if w else 0 for r, w in zip(reqs, wanted, strict=True)]
    rows, counts = input_logprob_rows(lens, starts)
    host: list[list[float]] = []
    if rows:
        fb = forward_batch
        fb.return_logprob = True
        fb.extend_logprob_start_lens_cpu = starts
        fb.top_logprobs_nums = tops
        out = runner.forward_with_input_logprobs(fb)
        logits = out.next_token_logits
        got = out.input_logprobs
        cols = [got.token_logprobs.double()[:, None]]
        if got.top_logprobs_val is not None:
            cols += [got.top_logprobs_val.double(), got.top_logprobs_idx.double()]  # ids exact
        host = torch.cat(cols, dim=1).tolist()  # [N, 1 + 2 K], one read
    else:  # each asks only for its first prompt token's, which is None
        logits = runner.forward(forward_batch)
    width = (len(host[0]) - 1) // 2 if host else 0
    offset = 0
    for req, w, n in zip(reqs, wanted, counts, strict=True):
        if not w:
            continue
        mine = host[offset : offset + n]
        offset += n
        req.input_token_logprobs = [None, *(row[0] for row in mine)]
        k = min(req.top_logprobs_num, width)
        if req.top_logprobs_num > 0:
            req.input_top_logprobs = [
                None,
                *([(r[1 + c], int(r[1 + width + c])) for c in range(k)] for r in mine),
            ]
    return logits


def record_output_logprob(req: Req, lp: OutputLogprob | None) -> None:
    """Append a sampled token's logprob (and its top list) to a request that asked."""
    if not req.return_logprob:
        return
    if lp is None:
        raise RuntimeError(f"request {req.rid} asked for logprobs but its row has none")
    req.output_token_logprobs.append(lp.logprob)
    if req.top_logprobs_num > 0:
        req.output_top_logprobs.append(list(lp.top))


def top_logprobs_nums(reqs: Sequence[Req]) -> list[int | None]:
    """Per row: None without logprobs, else the request's top_logprobs_num."""
    return [r.top_logprobs_num if r.return_logprob else None for r in reqs]
