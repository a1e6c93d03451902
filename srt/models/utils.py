"""Model-side helpers for fusing the KV-cache write into the RoPE kernel.

An attention layer does::

    if enable_fused_set_kv_buffer(forward_batch):
        q, k = self.rotary_emb(positions, q, k, fused_set_kv_buffer_arg=
                               create_fused_set_kv_buffer_arg(v, self.attn, forward_batch))
        out = self.attn(q, k, v, forward_batch, save_kv_cache=False)
    else:
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, forward_batch)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sgl_ext import FP8_DTYPES, INPUT_DTYPES, FusedSetKVBufferArg

if TYPE_CHECKING:
    from srt.layers.layernorm import RMSNorm
    from srt.layers.radix_attention import RadixAttention
    from srt.model_executor.forward_batch_info import ForwardBatch

# KV-cache dtypes the fused kernel can store (fp8 pools pass fp8 views of their uint8 storage).
FUSED_KV_DTYPES = (*INPUT_DTYPES, *FP8_DTYPES)


def _supported_buffer(buf: object) -> bool:
    """Layout check on metadata only: [slots, H, D] or [pages, page_size, H, D], last dim dense."""
    return (
        isinstance(buf, torch.Tensor)
        and buf.ndim in (3, 4)
        and buf.dtype in FUSED_KV_DTYPES
        and (buf.stride(-1) == 1 or buf.shape[-1] == 1)
    )


def enable_fused_set_kv_buffer(forward_batch: ForwardBatch) -> bool:
    """Whether attention layers should let RoPE write K/V into the cache.

    True when the batch allows fusion (`forward_batch.enable_fused_rope_kv`), the pool is an
    MHA-style pool (get_key_buffer / get_value_buffer) whose dtype the kernel stores (bf16,
    fp16, fp32, fp8 e4m3 / e5m2), and its buffers have a supported strided layout. Looks at
    metadata only (no device sync), so it is safe under CUDA-graph capture. The pool's answer
    is kept in `forward_batch.fused_kv_memo` (a pool never changes its buffers), so only the
    first layer of a batch inspects the pool.
    """
    if not getattr(forward_batch, "enable_fused_rope_kv", False):
        return False
    pool = forward_batch.token_to_kv_pool
    memo = getattr(forward_batch, "fused_kv_memo", None)
    if memo is not None and memo[0] is pool:
        return memo[1]
    ok = _pool_supports_fusion(pool)
    if hasattr(forward_batch, "fused_kv_memo"):
        forward_batch.fused_kv_memo = (pool, ok)
    return ok


def _pool_supports_fusion(pool: object) -> bool:
    if pool is None or not hasattr(pool, "get_key_buffer") or not hasattr(pool, "get_value_buffer"):
        return False
    if getattr(pool, "dtype", None) not in FUSED_KV_DTYPES:
        return False
    layer0 = getattr(pool, "start_layer", 0)
    return _supported_buffer(pool.get_key_buffer(layer0)) and _supported_buffer(
        pool.get_value_buffer(layer0)
    )


def create_fused_set_kv_buffer_arg(
    value: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch
) -> FusedSetKVBufferArg:
    """The FusedSetKVBufferArg that makes RoPE store this layer's K and V.

    Parameters
    ----------
    value : [T, Hkv*Dv] or [T, Hkv, Dv], the model dtype (a strided view of qkv is fine).
    layer : the RadixAttention (its layer_id selects the buffers; k_scale / v_scale are used
        for fp8 pools and ignored otherwise, matching the pool's unfused set_kv_buffer).
    forward_batch : gives the pool and out_cache_loc (int64 [T], < 0 = skip); with a hybrid
        SWAKVPool, window layers write the window slots `out_cache_loc_swa` instead.
    """
    pool = forward_batch.token_to_kv_pool
    k_buffer = pool.get_key_buffer(layer.layer_id)  # [slots, H, D] or [pages, ps, H, D]
    v_buffer = pool.get_value_buffer(layer.layer_id)
    fp8 = k_buffer.dtype in FP8_DTYPES
    cache_loc = forward_batch.out_cache_loc  # int64 [T] full slots
    if getattr(pool, "is_swa_layer", None) is not None and pool.is_swa_layer(layer.layer_id):
        # A sliding-window layer of a hybrid pool: its buffers are indexed by window slots.
        swa_loc = forward_batch.out_cache_loc_swa
        if swa_loc is None:
            swa_loc = pool.translate_loc_from_full_to_swa(forward_batch.out_cache_loc)
        cache_loc = swa_loc
    return FusedSetKVBufferArg(
        value=value,
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        k_scale=layer.k_scale if fp8 else None,
        v_scale=layer.v_scale if fp8 else None,
        cache_loc=cache_loc,
    )


def apply_qk_norm(
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm: RMSNorm,
    k_norm: RMSNorm,
    head_dim: int,
    alt_stream: torch.cuda.Stream | None = None,
    allow_inplace: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [T, Hq*D] and k [T, Hkv*D] (SGLang's helper, used by its Qwen3).

    Returns new tensors of the same shapes (allow_inplace permits, never requires, in-place
    work). alt_stream: SGLang overlaps k's norm with q's on it; srt runs both on the current
    stream (SGLang's files pass None here: `srt.runtime_context.get_stream`). srt's own Qwen3
    does this norm, RoPE and the KV write in one kernel (`RopeAttention.norm_and_rope`).
    """
    T = q.shape[0]
    q_out = q_norm(q.reshape(-1, head_dim)).view(T, -1)  # [T * Hq, D] -> [T, Hq * D]
    k_out = k_norm(k.reshape(-1, head_dim)).view(T, -1)
    return q_out, k_out
