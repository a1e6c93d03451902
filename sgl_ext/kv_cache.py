"""set_kv_buffer: store K and V into the KV cache (the unfused write; the fused op's semantics).

For layers that cannot fuse the write into RoPE. Identical bits to the fused op's cache write:
fused == RoPE alone + this op, exactly.
"""

from __future__ import annotations

import torch

from sgl_ext import _common as C
from sgl_ext._backend import select_backend
from sgl_ext.native import Scale, kv_write_native


def _check(
    key: object,
    value: object,
    k_buffer: object,
    v_buffer: object,
    cache_loc: object,
    k_scale: object,
    v_scale: object,
    head_size: int | None,
) -> tuple:
    C.check_tensor("key", key, C.INPUT_DTYPES)
    assert isinstance(key, torch.Tensor)
    if head_size is None:
        if key.ndim == 3:
            head_size = key.shape[2]
        elif isinstance(k_buffer, torch.Tensor) and k_buffer.ndim >= 3:
            head_size = k_buffer.shape[-1]
        else:
            raise ValueError("head_size is required for a 2-D key with a 2-D k_buffer")
    if not isinstance(head_size, int) or head_size <= 0:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    k_info = C.heads_view("key", key, key.shape[0], head_size)
    k_lay, v_lay, v_dim, v_tok, v_head = C.check_kv_write(
        key, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale, key.shape[0], head_size
    )
    if C.debug_checks_enabled():
        assert isinstance(cache_loc, torch.Tensor)
        C.debug_check_slots(cache_loc, k_lay.num_slots)
    kv = (value, v_tok, v_head, v_dim, k_buffer, v_buffer, cache_loc, k_scale, v_scale)
    return head_size, k_info, (*kv, k_lay, v_lay)


def _run(key: torch.Tensor, head_size: int, k_info: tuple, kv: tuple) -> None:
    if select_backend(key.device, has_cuda=False) == "native":
        value, _, _, _, kbuf, vbuf, loc, ks, vs, k_lay, v_lay = kv
        kv_write_native(key, value, kbuf, vbuf, loc, ks, vs, k_lay, v_lay)
        return
    from sgl_ext.triton.rope_kv import launch_rope_kv

    launch_rope_kv(None, None, key, head_size, None, True, None, k_info, kv)


def set_kv_buffer(
    key: torch.Tensor,
    value: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    cache_loc: torch.Tensor,
    k_scale: Scale = None,
    v_scale: Scale = None,
    head_size: int | None = None,
) -> None:
    """Store key and value into the cache slots `cache_loc` (no rotation).

    Parameters
    ----------
    key : bf16/fp16/fp32 [T, Hkv*D] or [T, Hkv, D]
    value : dtype of key, [T, Hkv*Dv] or [T, Hkv, Dv]
    k_buffer, v_buffer : [slots, H*D], [slots, H, D] or [pages, page_size, H, D] strided views,
        last dim contiguous; dtype of key or fp8 (float8_e4m3fn / float8_e5m2).
    cache_loc : int32/int64 [T]
        Slot per token; slots < 0 (or >= num_slots) are not written.
    k_scale, v_scale : None, positive float, or 1-element float tensor
        The cache stores x * (1 / scale) cast to the buffer dtype (saturating for fp8).
    head_size : int, optional
        D; needed only when both key and k_buffer are 2-D.
    """
    head_size, k_info, kv = _check(
        key, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale, head_size
    )
    if torch.compiler.is_compiling():
        from sgl_ext.rope import _scale_tensor

        ks, vs = _scale_tensor(k_scale, key), _scale_tensor(v_scale, key)
        torch.ops.sgl_ext.set_kv(key, value, k_buffer, v_buffer, cache_loc, ks, vs, head_size)
        return
    _run(key, head_size, k_info, kv)


def set_kv_buffer_native(
    key: torch.Tensor,
    value: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    cache_loc: torch.Tensor,
    k_scale: Scale = None,
    v_scale: Scale = None,
    head_size: int | None = None,
) -> None:
    """Torch-native reference of set_kv_buffer."""
    _, _, kv = _check(key, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale, head_size)
    value, _, _, _, kbuf, vbuf, loc, ks, vs, k_lay, v_lay = kv
    kv_write_native(key, value, kbuf, vbuf, loc, ks, vs, k_lay, v_lay)
