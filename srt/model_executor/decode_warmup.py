"""Compile the eager decode path's kernels at start-up, for the batch sizes no CUDA graph takes,
and the split-KV extend's.

A Triton kernel compiles on its first launch with a new set of constexprs, and the decode
kernels' constexprs depend on the batch size rounded up to a power of two (the KV split count,
and with shared prefixes the cascade's prefix chunks and merge width). The graph capture warms
the sizes it captures; a decode batch larger than `cuda_graph_max_bs` runs eagerly and would
otherwise compile in the middle of serving, a stall of seconds for every request running. So
the runner runs one dummy eager decode per power-of-two size above the graphs, with and without
a (dummy, empty) shared prefix when the backend has the cascade decode.

The dummy rows are the graph capture's padding rows: token 0 at position 0 of request row 0,
its K/V written to the padding slot 0, which no request reads.

The same holds for the extend attention's split-KV variants (a short chunk after a long cached
prefix, `extend_num_splits`: chunked prefill while others decode, a prefix-cache hit): one dummy
extend of one token after 0, 2048 and 4096 cached keys compiles each split count. Its prefix is
request row 0's first columns, all the padding slot 0 before any request ran.
"""

from __future__ import annotations

from typing import Any

import torch

from srt.layers.attention.triton_ops.extend_attention import MAX_EXTEND_SPLITS, MIN_SPLIT_KEYS
from srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    SharedPrefixes,
    compute_extend_metadata,
)

# Eager sizes warmed at most up to this many requests (larger ones pick the same launch
# variants for models with 4 or more KV heads; a model with fewer compiles those on first use).
MAX_WARM_BATCH = 1024


def eager_decode_sizes(first: int, last: int) -> list[int]:
    """Powers of two from the one at or above `first` up to `last` (the largest included when it
    is not a power of two itself), capped at MAX_WARM_BATCH."""
    last = min(last, MAX_WARM_BATCH)
    size, sizes = 1, []
    while size < first:
        size *= 2
    while size <= last:
        sizes.append(size)
        size *= 2
    if last >= first and (not sizes or sizes[-1] != last):
        sizes.append(last)
    return sizes


def _dummy_forward(runner: Any, zeros: torch.Tensor, **fields: Any) -> None:
    """One eager forward of `runner` over dummy rows: request row 0, token 0, K/V into the
    padding slot 0 (zeros: int64 [rows or tokens] on the runner's device)."""
    hybrid = hasattr(runner.token_to_kv_pool, "translate_loc_from_full_to_swa")
    fb = ForwardBatch(
        input_ids=zeros,
        req_pool_indices=zeros,
        out_cache_loc=zeros,
        out_cache_loc_swa=zeros if hybrid else None,
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool=runner.token_to_kv_pool,
        attn_backend=runner.attn_backend,
        enable_fused_rope_kv=runner.server_args.enable_fused_rope_kv,
        **fields,
    )
    runner.forward(fb, use_cuda_graph=False)


def warmup_eager_decode(runner: Any, sizes: list[int], cascade: bool) -> None:
    """One dummy eager decode forward of `runner` (a ModelRunner) per batch size, and one with a
    shared prefix too when `cascade` (the backend's cascade launches); nothing is kept."""
    dev = runner.device
    for bs in sizes:
        zeros = torch.zeros(bs, dtype=torch.int64, device=dev)
        seq_lens = torch.ones(bs, dtype=torch.int64, device=dev)
        variants = [None] + ([SharedPrefixes((tuple(range(bs)),), (0,), (0,))] if cascade else [])
        for shared in variants:
            _dummy_forward(
                runner,
                zeros,
                forward_mode=ForwardMode.DECODE,
                batch_size=bs,
                seq_lens=seq_lens,
                seq_lens_sum=bs,
                positions=zeros,
                seq_lens_cpu=torch.ones(bs, dtype=torch.int64),
                shared_prefixes=shared,
            )
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def extend_warm_prefixes(context_len: int) -> list[int]:
    """Cached-key counts whose one-token extend takes each split count up to MAX_EXTEND_SPLITS
    (0: one program; 2 * MIN_SPLIT_KEYS * s / 2: s chunks), those that fit in the context."""
    out, splits = [0], 2
    while splits <= MAX_EXTEND_SPLITS and splits * MIN_SPLIT_KEYS < context_len:
        out.append(splits * MIN_SPLIT_KEYS)
        splits *= 2
    return out


def warmup_extend_splits(runner: Any) -> None:
    """One dummy one-token extend of `runner` per prefix of `extend_warm_prefixes` (before any
    request: row 0 reads only the padding slot, which the token's K/V overwrites)."""
    dev = runner.device
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    width = min(runner.context_len, runner.req_to_token_pool.req_to_token.shape[1])
    for prefix in extend_warm_prefixes(width):
        fields = compute_extend_metadata([prefix], [1], dev)
        _dummy_forward(runner, zero, forward_mode=ForwardMode.EXTEND, batch_size=1, **fields)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
