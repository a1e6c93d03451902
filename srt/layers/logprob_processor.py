"""Log-probabilities of chosen tokens and the top-k of each row (SGLang's logprob_processor).

One definition serves the prompt positions (computed by the LogitsProcessor during a prefill,
chunk by chunk so a long prompt never holds all its [T, V] logits at once) and the sampled
tokens (computed by the scheduler from the logits the sampler drew from): logprob = logit -
logsumexp(row), in float32 (-inf clamped to float32's lowest value). The chosen token's value
and the top-k values come from the same row and the same normaliser, so a greedy token's
logprob equals its row's top-1 exactly (clients such as lm-eval compare them to decide "is
greedy").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Logit elements one chunk of prompt positions may hold (float32: 256 MiB).
CHUNK_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs of N rows.

    Attributes
    ----------
    token_logprobs : float32 [N], the chosen token's logprob in each row.
    top_logprobs_val : float32 [N, K], the K largest logprobs of each row, descending (None
        when K is 0).
    top_logprobs_idx : int64 [N, K], their token ids (None when K is 0).
    """

    token_logprobs: torch.Tensor
    top_logprobs_val: torch.Tensor | None = None
    top_logprobs_idx: torch.Tensor | None = None


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int = 0) -> TokenLogprobs:
    """Log-softmax of each row at `token_ids`, and each row's top_k.

    Parameters
    ----------
    logits : float [N, V], any device (not modified; computed in float32).
    token_ids : int64 [N] on logits' device, one id in [0, V) per row.
    top_k : entries of each row's top list (0: none; more than V: V).

    Returns
    -------
    TokenLogprobs of the N rows.
    """
    if logits.dim() != 2 or token_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"logits must be [N, V] and token_ids [N], got {tuple(logits.shape)} and "
            f"{tuple(token_ids.shape)}"
        )
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)  # [N]
    # a masked token (-inf logit) gets float32's lowest value, as SGLang clamps: JSON has no -inf
    low = torch.finfo(torch.float32).min
    chosen = (x.gather(1, token_ids.long()[:, None]).squeeze(1) - lse).clamp_(min=low)  # [N]
    k = min(top_k, x.shape[1])
    if k == 0:
        return TokenLogprobs(chosen)
    vals, idx = x.topk(k, dim=-1)  # [N, k] descending
    return TokenLogprobs(chosen, (vals - lse[:, None]).clamp_(min=low), idx)


def input_logprob_rows(
    extend_seq_lens: list[int], logprob_start_lens: list[int]
) -> tuple[list[int], list[int]]:
    """Which prefill rows give input-token logprobs, and how many per request.

    Request i's new tokens are rows start_i .. start_i + L_i - 1 of the batch (request after
    request). Its input logprobs cover prompt tokens s_i .. L_i - 1 as SGLang returns them: the
    first (token s_i) has none, token p > s_i is scored by row p - 1. So the rows are
    start_i + s_i .. start_i + L_i - 2, each predicting the next input token.

    Parameters
    ----------
    extend_seq_lens : L_i, new tokens per request.
    logprob_start_lens : s_i in [0, L_i] per request (L_i: no input logprobs).

    Returns
    -------
    (rows: the scoring rows of the whole batch, in order; counts: how many are request i's)
    """
    if len(extend_seq_lens) != len(logprob_start_lens):
        raise ValueError(
            f"{len(extend_seq_lens)} extend_seq_lens but {len(logprob_start_lens)} start lens"
        )
    rows: list[int] = []
    counts: list[int] = []
    start = 0
    for n, s in zip(extend_seq_lens, logprob_start_lens, strict=True):
        if not 0 <= s <= n:
            raise ValueError(f"logprob start {s} outside [0, {n}]")
        first, last = start + s, start + n - 1  # rows first .. last - 1 score tokens s+1 .. n-1
        rows.extend(range(first, last))
        counts.append(max(0, last - first))
        start += n
    return rows, counts


def input_token_logprobs(
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    rows: list[int],
    project: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
    top_k: int = 0,
) -> TokenLogprobs:
    """Logprobs of the next input token at each of `rows`, projected chunk by chunk.

    Parameters
    ----------
    hidden_states : [T, H] of the batch's new tokens (or [T, V] logits with an identity
        `project`).
    input_ids : int64 [T], the batch's new tokens; row r scores input_ids[r + 1].
    rows : host row indices, each < T - 1 (see `input_logprob_rows`).
    project : [n, H] -> float [n, V] logits (the LM head).
    vocab_size : V (sizes the chunks: CHUNK_ELEMENTS logits at most).
    top_k : entries of each row's top list.

    Returns
    -------
    TokenLogprobs of len(rows) rows.
    """
    dev = hidden_states.device
    k = min(top_k, vocab_size)
    if not rows:
        empty = torch.empty(0, dtype=torch.float32, device=dev)
        if k == 0:
            return TokenLogprobs(empty)
        return TokenLogprobs(
            empty,
            torch.empty((0, k), dtype=torch.float32, device=dev),
            torch.empty((0, k), dtype=torch.int64, device=dev),
        )
    idx = torch.tensor(rows, dtype=torch.int64).to(dev)  # [N]
    targets = input_ids.index_select(0, idx + 1)  # [N]
    step = max(1, CHUNK_ELEMENTS // max(1, vocab_size))
    parts = [
        token_logprobs(
            project(hidden_states.index_select(0, idx[lo : lo + step])),
            targets[lo : lo + step],
            k,
        )
        for lo in range(0, len(rows), step)
    ]
    if len(parts) == 1:
        return parts[0]
    lp = torch.cat([p.token_logprobs for p in parts])
    if k == 0:
        return TokenLogprobs(lp)
    vals = torch.cat([p.top_logprobs_val for p in parts])  # type: ignore[misc]
    ids = torch.cat([p.top_logprobs_idx for p in parts])  # type: ignore[misc]
    return TokenLogprobs(lp, vals, ids)
