"""logit_bias: OpenAI's / SGLang's per-request {token id: bias} added to the logits.

Checked when the request is made (`parse_logit_bias`, `check_logit_bias_vocab`); applied to a
batch's last-position logits after the penalties, as SGLang does, in one scatter-add for every
biased row (`apply_logit_bias`). Applied outside any CUDA graph, on the logits a graph returns, so
graphs are unchanged; a batch without a bias costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from srt.mem_cache.host_copy import upload

MAX_ABS_BIAS = 100.0  # OpenAI's range: [-100, 100]

LogitBias = tuple[tuple[int, float], ...]  # (token id, bias), sorted by id, ids unique


def _token_id(key: Any) -> int:
    if isinstance(key, bool):
        raise TypeError(f"logit_bias keys must be token ids, got {key!r}")
    if isinstance(key, int):
        tok = key
    elif isinstance(key, str) and key.strip().lstrip("+-").isdigit():
        tok = int(key)
    else:
        raise ValueError(f"logit_bias keys must be token ids (ints or digit strings), got {key!r}")
    if tok < 0:
        raise ValueError(f"logit_bias has a negative token id {key!r}")
    return tok


def _bias(key: Any, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"logit_bias[{key!r}] must be a number, got {type(value).__name__}")
    bias = float(value)
    if not math.isfinite(bias) or abs(bias) > MAX_ABS_BIAS:
        raise ValueError(f"logit_bias[{key!r}] must be in [-100, 100], got {value!r}")
    return bias


def parse_logit_bias(value: Any) -> LogitBias | None:
    """`value` ({token id: bias}, keys ints or digit strings as in OpenAI's JSON, or (id, bias)
    pairs) as sorted (id, bias) pairs; None or empty: None.

    Raises
    ------
    TypeError / ValueError naming logit_bias and the bad key or value: a key that is not a
    non-negative token id, the same id twice, a bias that is not a finite number in [-100, 100].
    """
    if value is None:
        return None
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in value
    ):
        items = [tuple(p) for p in value]
    else:
        kind = type(value).__name__
        raise TypeError(f"logit_bias must be a dict of token id -> bias, got {kind}")
    pairs: dict[int, float] = {}
    for key, bias in items:
        tok = _token_id(key)
        if tok in pairs:
            raise ValueError(f"logit_bias names token {tok} twice")
        pairs[tok] = _bias(key, bias)
    return tuple(sorted(pairs.items())) or None


def check_logit_bias_vocab(bias: LogitBias | None, vocab_size: int) -> None:
    """Raise ValueError if a biased token id is outside [0, vocab_size)."""
    if bias and bias[-1][0] >= vocab_size:
        raise ValueError(
            f"logit_bias has token id {bias[-1][0]} outside the vocabulary [0, {vocab_size})"
        )


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[LogitBias | None]) -> torch.Tensor:
    """Logits with each row's bias added.

    Parameters
    ----------
    logits : float [B, V], any device. Not modified (it may be a CUDA graph's output).
    biases : B entries, a row's (id, bias) pairs or None.

    Returns
    -------
    `logits` itself when no row has a bias, else a float32 copy with the biases added (one
    upload of the (row, id, bias) triples through pinned memory and one scatter-add; no wait).
    """
    if len(biases) != logits.shape[0]:
        raise ValueError(f"need {logits.shape[0]} logit_bias entries, got {len(biases)}")
    triples = [(i, tok, b) for i, pairs in enumerate(biases) if pairs for tok, b in pairs]
    if not triples:
        return logits
    vocab = logits.shape[1]
    bad = next((t for _, t, _ in triples if t >= vocab), None)
    if bad is not None:
        raise ValueError(f"logit_bias has token id {bad} outside the vocabulary [0, {vocab})")
    # float64 is exact for row and token ids and holds the biases; one upload for all three
    cfg = upload(torch.tensor(triples, dtype=torch.float64).T.contiguous(), logits.device)
    out = logits.float().clone()  # [B, V]
    out.index_put_((cfg[0].long(), cfg[1].long()), cfg[2].float(), accumulate=True)
    return out
