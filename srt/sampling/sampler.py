"""Sampler: next tokens from the last-position logits of a batch (greedy or sampled)."""

from __future__ import annotations

import torch

from srt.mem_cache.host_copy import upload
from srt.sampling.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    return_logprob: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one token per row.

    Greedy rows take the argmax. Sampled rows divide by their temperature, apply top_k, top_p
    and min_p, and draw from the renormalised distribution with the row's own generator, so a
    seeded request gets the same tokens whatever batch it runs in.

    Parameters
    ----------
    logits : float [B, V], any device. Not modified.
    params : B SamplingParams.
    generators : B generators on logits' device (None: torch's default generator).
    return_logprob : also return the log-probability of each chosen token under the raw
        (temperature 1, unfiltered) distribution, float32 [B].

    Returns
    -------
    (next_token_ids int64 [B], logprobs float32 [B] or None)
    """
    bs = logits.shape[0]
    if len(params) != bs or len(generators) != bs:
        raise ValueError(f"need {bs} params and generators, got {len(params)}, {len(generators)}")
    dev = logits.device
    logits = logits.float()  # [B, V]
    next_ids = torch.argmax(logits, dim=-1)  # [B] int64
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if rows:
        vocab = logits.shape[1]
        # the rows' settings in one upload through pinned memory: no host wait for the device
        # (the overlapped decode samples step N while step N - 1 may still run)
        ps = [params[i] for i in rows]
        cfg = upload(
            torch.tensor(
                [
                    rows,
                    [p.top_k if p.top_k > 0 else vocab for p in ps],
                    [p.temperature for p in ps],
                    [p.top_p for p in ps],
                    [p.min_p for p in ps],
                ],
                dtype=torch.float64,  # exact for indices, top_k and the float settings
            ),
            dev,
        )  # [5, R]
        idx, top_k = cfg[0].long(), cfg[1].long()  # [R] each
        temps, top_p, min_p = cfg[2:].float().unbind(0)  # [R] each
        scaled = logits.index_select(0, idx) / temps[:, None]  # [R, V]
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)  # [R, V] each
        probs = sorted_logits.softmax(dim=-1)  # [R, V], descending
        rank = torch.arange(vocab, device=dev)[None, :]  # [1, V]
        drop = rank >= top_k[:, None]  # [R, V]
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]  # mass before this token
        drop |= probs < min_p[:, None] * probs[:, :1]
        drop[:, 0] = False  # the most likely token always survives
        probs = probs.masked_fill(drop, 0.0)
        picks = torch.cat(  # [R, 1] index in sorted order, each row with its own generator
            [torch.multinomial(probs[j], 1, generator=generators[i]) for j, i in enumerate(rows)]
        )[:, None]
        next_ids.index_copy_(0, idx, sorted_ids.gather(1, picks)[:, 0])
    logprobs = None
    if return_logprob:
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, next_ids[:, None]).squeeze(1)
    return next_ids, logprobs
