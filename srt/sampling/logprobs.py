"""Output-token logprobs: the log-probability of each sampled token, and each row's top-k.

The distribution is the one the token was drawn from, as SGLang defines it (its default, without
SGLANG_RETURN_ORIGINAL_LOGPROB): the last-position logits after the penalties and logit_bias,
divided by the request's temperature for a sampled request (a greedy one: temperature 1), before
any top_k / top_p / min_p cut. So a sampled token's logprob is log_softmax(logits / T), which
is what the sampler's softmax(logits / T) gives it before the cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from srt.layers.logprob_processor import token_logprobs
from srt.mem_cache.host_copy import upload
from srt.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class OutputLogprob:
    """One sampled token's logprob and its row's top entries.

    Attributes
    ----------
    logprob : the token's log-probability.
    top : (logprob, token id) of the row's most likely tokens, descending (top_logprobs_num
        entries; empty when 0).
    """

    logprob: float
    top: tuple[tuple[float, int], ...] = ()


def logprob_temperature(params: SamplingParams) -> float:
    """The temperature of the distribution a request's token is drawn from (greedy: 1)."""
    return 1.0 if params.is_greedy else float(params.temperature)


def output_logprobs(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    next_ids: torch.Tensor,
    top_logprobs_nums: Sequence[int | None],
) -> list[OutputLogprob | None]:
    """The logprob of each row's sampled token, for the rows that ask.

    Parameters
    ----------
    logits : float [B, V], the logits the sampler drew from (penalties and logit_bias applied).
    params : B SamplingParams (their temperatures).
    next_ids : int64 [B] on logits' device, the sampled tokens.
    top_logprobs_nums : B entries: None for a row without logprobs, else its top-k size.

    Returns
    -------
    B entries: None for rows without logprobs, else their OutputLogprob. One host read.
    """
    bs = logits.shape[0]
    if len(params) != bs or len(top_logprobs_nums) != bs or next_ids.shape != (bs,):
        raise ValueError(
            f"need {bs} params, top_logprobs_nums and next_ids, got {len(params)}, "
            f"{len(top_logprobs_nums)}, {tuple(next_ids.shape)}"
        )
    rows = [i for i, k in enumerate(top_logprobs_nums) if k is not None]
    out: list[OutputLogprob | None] = [None] * bs
    if not rows:
        return out
    dev = logits.device
    temps = [logprob_temperature(params[i]) for i in rows]
    if len(rows) == bs:
        sub, ids = logits.float(), next_ids
    else:
        idx = upload(torch.tensor(rows, dtype=torch.int64), dev)  # [R]
        sub, ids = logits.index_select(0, idx).float(), next_ids.index_select(0, idx)
    if any(t != 1.0 for t in temps):
        sub = sub / upload(torch.tensor(temps, dtype=torch.float32), dev)[:, None]
    ks = [int(top_logprobs_nums[i] or 0) for i in rows]
    got = token_logprobs(sub, ids, max(ks))
    cols = [got.token_logprobs.double()[:, None]]
    if got.top_logprobs_val is not None and got.top_logprobs_idx is not None:
        cols += [got.top_logprobs_val.double(), got.top_logprobs_idx.double()]  # ids exact
    host = torch.cat(cols, dim=1).tolist()  # [R, 1 + 2 K], the one read
    width = (len(host[0]) - 1) // 2
    for j, (i, k) in enumerate(zip(rows, ks, strict=True)):
        vals, toks = host[j][1 : 1 + width], host[j][1 + width :]
        top = tuple((vals[c], int(toks[c])) for c in range(min(k, width)))
        out[i] = OutputLogprob(host[j][0], top)
    return out
