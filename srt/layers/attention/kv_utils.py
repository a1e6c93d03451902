"""Helpers the attention backends share: save K/V to the pool, gather and dequantise cached K/V."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sgl_ext import FP8_DTYPES
from srt.mem_cache.memory_pool import slot_index

if TYPE_CHECKING:
    from srt.layers.radix_attention import RadixAttention
    from srt.model_executor.forward_batch_info import ForwardBatch


def save_kv_cache(
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    layer: RadixAttention,
    forward_batch: ForwardBatch,
) -> None:
    """Unfused path: store k [T, Hkv*D | Hkv, D] and v into the pool at out_cache_loc."""
    if k is None or v is None:
        raise ValueError("save_kv_cache=True needs k and v tensors")
    T = k.shape[0]
    k = k.view(T, layer.tp_k_head_num, layer.qk_head_dim)  # [T, Hkv, D] (no copy)
    v = v.view(T, layer.tp_v_head_num, layer.v_head_dim)  # [T, Hkv, Dv]
    forward_batch.token_to_kv_pool.set_kv_buffer(
        layer, forward_batch.out_cache_loc, k, v, layer.k_scale, layer.v_scale
    )


def gather_kv(
    buf: torch.Tensor, slots: torch.Tensor, scale: float | torch.Tensor | None
) -> torch.Tensor:
    """float32 [*slots.shape, H, D]: buf at `slots`, dequantised (fp8: stored * scale).

    Scales apply to fp8 buffers only (non-fp8 pools ignore them, as in SGLang)."""
    idx = slot_index(buf, slots.long())
    if buf.dtype in FP8_DTYPES:
        # Move bytes (fp8 lacks some indexing kernels on CPU), then reinterpret.
        out = buf.view(torch.uint8)[idx].view(buf.dtype).float()
    else:
        return buf[idx].float()
    if scale is not None:
        if isinstance(scale, torch.Tensor):
            out = out * scale.reshape(()).to(device=out.device, dtype=torch.float32)
        else:
            out = out * float(scale)
    return out


def layer_buffers(
    layer: RadixAttention, forward_batch: ForwardBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_buffer, v_buffer) of this layer from the pool: [slots, H, D] or [pages, ps, H, D]."""
    pool = forward_batch.token_to_kv_pool
    return pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)


def req_to_token_for_layer(
    req_to_token_pool, layer: RadixAttention, forward_batch: ForwardBatch
) -> torch.Tensor:
    """int32 [rows, max_ctx]: the table mapping (request row, position) to this layer's slots.

    `req_to_token` (full slots), or for a sliding-window layer of a hybrid `SWAKVPool` the
    window-slot table `req_to_swa_token` (the layer's buffers are the window pool's)."""
    pool = forward_batch.token_to_kv_pool
    is_swa = getattr(pool, "is_swa_layer", None)
    if is_swa is not None and is_swa(layer.layer_id):
        table = req_to_token_pool.req_to_swa_token
        if table is None:
            raise ValueError("a hybrid SWAKVPool needs ReqToTokenPool(enable_swa=True)")
        return table
    return req_to_token_pool.req_to_token
