"""Penalties: SGLang's frequency/presence/repetition penalties and min_new_tokens on logits.

Applied to the last-position logits before the sampler (greedy rows too, as in SGLang), for the
rows whose SamplingParams ask for one; a batch without penalties costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from srt.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class PenaltyInputs:
    """What one request's penalties depend on.

    Attributes
    ----------
    params : the request's SamplingParams.
    prompt_ids : the prompt's token ids (for repetition_penalty).
    output_ids : the tokens generated so far.
    banned_until_min : token ids masked while fewer than min_new_tokens were generated (the
        stop tokens and, unless ignore_eos, the EOS tokens).
    """

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    banned_until_min: frozenset[int] = frozenset()


def _counts(ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """float32 [V]: how often each token id occurs in ids."""
    out = torch.zeros(vocab, dtype=torch.float32, device=device)
    if ids:
        t = torch.tensor(list(ids), dtype=torch.int64, device=device)  # [n]
        out.index_add_(0, t, torch.ones_like(t, dtype=torch.float32))
    return out


def apply_penalties(logits: torch.Tensor, inputs: Sequence[PenaltyInputs]) -> torch.Tensor:
    """Logits with each row's penalties applied.

    Parameters
    ----------
    logits : float [B, V], any device. Not modified.
    inputs : B PenaltyInputs, one per row.

    Returns
    -------
    float32 [B, V]: `logits` itself (as float32) when no row has a penalty, else a copy where

    - repetition_penalty p: tokens of prompt or output get logit / p if > 0, logit * p if not;
    - frequency_penalty f and presence_penalty r: logit -= f * count_in_output + r * [count > 0];
    - min_new_tokens: banned_until_min tokens get -inf while the output is shorter.
    """
    if len(inputs) != logits.shape[0]:
        raise ValueError(f"need {logits.shape[0]} PenaltyInputs, got {len(inputs)}")
    rows = [i for i, x in enumerate(inputs) if x.params.has_penalties]
    logits = logits.float()
    if not rows:
        return logits
    logits = logits.clone()
    vocab, dev = logits.shape[1], logits.device
    for i in rows:
        x, p = inputs[i], inputs[i].params
        row = logits[i]  # [V] view
        if p.repetition_penalty != 1.0:
            seen = _counts([*x.prompt_ids, *x.output_ids], vocab, dev) > 0  # [V] bool
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, scaled, row))
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            count = _counts(x.output_ids, vocab, dev)  # [V]
            row -= p.frequency_penalty * count + p.presence_penalty * (count > 0).float()
        if len(x.output_ids) < p.min_new_tokens and x.banned_until_min:
            banned = [t for t in x.banned_until_min if 0 <= t < vocab]
            row[torch.tensor(banned, dtype=torch.int64, device=dev)] = float("-inf")
    return logits
