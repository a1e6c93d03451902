"""Checks of one request's input before it is built: token ids and the context length."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def check_input_ids(input_ids: Any, vocab_size: int) -> list[int]:
    """input_ids as a list of ints in [0, vocab_size).

    Parameters
    ----------
    input_ids : a list/tuple of ints, or an integer tensor [n] (any device).
    vocab_size : the model's vocabulary size.

    Raises
    ------
    TypeError : not a list, or an element that is not an int (bools and floats included).
    ValueError : empty, or an id outside the vocabulary.
    """
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids.tolist()
    if not isinstance(input_ids, (list, tuple)):
        raise TypeError(f"input_ids must be a list of ints, got {type(input_ids).__name__}")
    bad = next((t for t in input_ids if isinstance(t, bool) or not isinstance(t, int)), None)
    if bad is not None:
        raise TypeError(
            f"input_ids must be ints, got {type(bad).__name__} ({bad!r}) in the request"
        )
    if not input_ids:
        raise ValueError("a request needs at least one input token")
    outside = [t for t in input_ids if not 0 <= t < vocab_size]
    if outside:
        raise ValueError(f"input_ids {outside[:5]} outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in input_ids]


def fit_context(
    ids: list[int], params: SamplingParams, context_len: int, allow_auto_truncate: bool
) -> tuple[list[int], SamplingParams, dict[str, Any]]:
    """Reject (or, with allow_auto_truncate, cut) a request longer than the context.

    A request fits when prompt + max_new_tokens <= context_len. Cutting keeps the first
    context_len - 1 prompt tokens and caps max_new_tokens to what is left.

    Returns
    -------
    (prompt ids, sampling params, meta_info to report: {} or {"truncation": {...}})
    """
    ctx = context_len
    n, m = len(ids), params.max_new_tokens
    if n + m <= ctx:
        return ids, params, {}
    if not allow_auto_truncate:
        raise ValueError(
            f"prompt of {n} tokens + max_new_tokens {m} = {n + m} exceeds the context length"
            f" {ctx}; shorten the prompt, lower max_new_tokens or set allow_auto_truncate"
        )
    keep = min(n, ctx - 1)
    new_m = min(m, ctx - keep)
    params = dataclasses.replace(
        params, max_new_tokens=new_m, min_new_tokens=min(params.min_new_tokens, new_m)
    )
    logger.warning(
        "request cut to the context length %d: prompt %d -> %d tokens, max_new_tokens %d -> %d",
        ctx,
        n,
        keep,
        m,
        new_m,
    )
    cut = {"prompt_tokens": n, "kept_prompt_tokens": keep, "max_new_tokens": m}
    cut["capped_max_new_tokens"] = new_m
    return ids[:keep], params, {"truncation": cut}
