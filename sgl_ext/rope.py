"""apply_rope_with_cos_sin_cache_inplace: RoPE on q/k, optionally fused with the KV-cache write.

Source-compatible with `sgl_kernel.apply_rope_with_cos_sin_cache_inplace`. With a
`FusedSetKVBufferArg`, the rotated K and the V are stored into the layer's KV cache by the same
kernel that rotates q and k (no separate `set_kv_buffer` launch, no re-read of K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_ext import _common as C
from sgl_ext._backend import forced_backend, select_backend
from sgl_ext.native import Scale, kv_write_native, rotate_native


@dataclass
class FusedSetKVBufferArg:
    """The KV-cache write fused into the RoPE op (field order as in sgl_kernel).

    value: [T, Hkv*Dv] or [T, Hkv, Dv], the dtype of key.
    k_buffer / v_buffer: the layer's caches, [slots, H*D], [slots, H, D] or
        [pages, page_size, H, D] (any strided view whose last dim is contiguous); dtype of key or
        fp8 (float8_e4m3fn / float8_e5m2).
    k_scale / v_scale: None, a positive float, or a 1-element float tensor (CUDA-graph safe);
        the cache stores x * (1 / scale) cast to the buffer dtype (saturating for fp8).
    cache_loc: [T] int32/int64 slot per token; a slot < 0 (or >= num_slots) is not written.
    """

    value: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    k_scale: Scale
    v_scale: Scale
    cache_loc: torch.Tensor


def _check_rope(
    positions: object,
    query: object,
    key: object,
    head_size: object,
    cos_sin_cache: object,
    is_neox: object,
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    C.check_tensor("positions", positions, C.INDEX_DTYPES)
    C.check_tensor("query", query, C.INPUT_DTYPES)
    C.check_tensor("key", key, C.INPUT_DTYPES)
    C.check_tensor("cos_sin_cache", cos_sin_cache, (torch.float32,))
    assert isinstance(positions, torch.Tensor) and isinstance(query, torch.Tensor)
    assert isinstance(key, torch.Tensor) and isinstance(cos_sin_cache, torch.Tensor)
    if not isinstance(head_size, int) or isinstance(head_size, bool) or head_size <= 0:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox must be a bool, got {type(is_neox).__name__}")
    if key.dtype != query.dtype:
        raise TypeError(f"key dtype {key.dtype} must equal query dtype {query.dtype}")
    if positions.ndim != 1:
        raise ValueError(f"positions must be 1-D [num_tokens], got shape {tuple(positions.shape)}")
    device = query.device
    for name, t in (("key", key), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        C.check_device(name, t, device)
    num_tokens = positions.shape[0]
    q_info = C.heads_view("query", query, num_tokens, head_size)
    k_info = C.heads_view("key", key, num_tokens, head_size)
    if cos_sin_cache.ndim != 2:
        raise ValueError(
            f"cos_sin_cache must be 2-D [max_pos, rotary_dim], got {cos_sin_cache.ndim}-D"
        )
    rot = cos_sin_cache.shape[1]
    if rot == 0 or rot % 2 or rot > head_size:
        raise ValueError(
            f"cos_sin_cache rotary_dim {rot} must be even, positive and <= head_size {head_size}"
        )
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be contiguous in its last dim")
    return q_info, k_info


def _check_kv(key: torch.Tensor, arg: object, head_size: int, debug: bool | None = None) -> tuple:
    if not isinstance(arg, FusedSetKVBufferArg):
        raise TypeError(
            f"fused_set_kv_buffer_arg must be a FusedSetKVBufferArg or None, got {type(arg)}"
        )
    k_lay, v_lay, v_dim, v_tok, v_head = C.check_kv_write(
        key,
        arg.value,
        arg.k_buffer,
        arg.v_buffer,
        arg.cache_loc,
        arg.k_scale,
        arg.v_scale,
        key.shape[0],
        head_size,
    )
    if C.debug_checks_enabled() if debug is None else debug:
        C.debug_check_slots(arg.cache_loc, k_lay.num_slots)
    kv = (arg.value, v_tok, v_head, v_dim, arg.k_buffer, arg.v_buffer, arg.cache_loc)
    return (*kv, arg.k_scale, arg.v_scale, k_lay, v_lay)


def _run(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    q_info: tuple[int, int, int],
    k_info: tuple[int, int, int],
    kv: tuple | None,
    enable_pdl: bool | None = None,
) -> None:
    cuda_ok = cuda_preferred = False
    if query.is_cuda:
        from sgl_ext.cuda import rope_kv as cuda_rope_kv

        # Look at the call (and build/load the kernel: a few seconds, once) only when the CUDA
        # kernel would be used: forced, or preferred at this size.
        cuda_preferred = cuda_rope_kv.preferred(key.shape[0])
        if cuda_preferred or forced_backend() == "cuda":
            cuda_ok = cuda_rope_kv.supports(
                query, key, head_size, cos_sin_cache, q_info, k_info, kv
            ) and cuda_rope_kv.available(query.device)
    backend = select_backend(query.device, cuda_ok, cuda_preferred)
    if backend == "cuda":
        cuda_rope_kv.launch(
            positions,
            query,
            key,
            head_size,
            cos_sin_cache,
            is_neox,
            q_info,
            k_info,
            kv,
            enable_pdl,
        )
        return
    if backend == "native":
        rotate_native(positions, query, head_size, cos_sin_cache, is_neox)
        rotate_native(positions, key, head_size, cos_sin_cache, is_neox)
        if kv is not None:
            value, _, _, _, kbuf, vbuf, loc, ks, vs, k_lay, v_lay = kv
            kv_write_native(key, value, kbuf, vbuf, loc, ks, vs, k_lay, v_lay)
        return
    from sgl_ext.triton.rope_kv import launch_rope_kv

    launch_rope_kv(
        positions, query, key, head_size, cos_sin_cache, is_neox, q_info, k_info, kv, enable_pdl
    )


def apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    fused_set_kv_buffer_arg: FusedSetKVBufferArg | None = None,
    enable_pdl: bool | None = None,
) -> None:
    """Rotate query and key in place; optionally store the rotated K and V into the KV cache.

    Parameters
    ----------
    positions : int32/int64 [T]
        Position of each token (row of cos_sin_cache).
    query : bf16/fp16/fp32 [T, Hq*D] or [T, Hq, D]
        Rotated in place; may be a strided view (e.g. of a fused qkv output), last dim contiguous.
    key : same dtype as query, [T, Hkv*D] or [T, Hkv, D]
        Rotated in place.
    head_size : int
        D.
    cos_sin_cache : float32 [max_pos, rotary_dim]
        cos in the first rotary_dim/2 columns, sin in the rest; rotary_dim even and <= D. Dims
        rotary_dim..D of each head pass through unchanged (partial rotary).
    is_neox : bool
        True rotates the two halves of the rotary dims; False rotates interleaved (GPT-J) pairs.
    fused_set_kv_buffer_arg : FusedSetKVBufferArg or None
        If given, the rotated K and the V are also written to the cache slots `cache_loc`.
    enable_pdl : bool or None
        Programmatic dependent launch on Hopper+ (the kernel's launch overlaps the previous
        kernel's tail). None: on where supported.
    """
    q_info, k_info = _check_rope(positions, query, key, head_size, cos_sin_cache, is_neox)
    debug = C.debug_checks_enabled()
    if debug:
        C.debug_check_positions(positions, cos_sin_cache.shape[0])
    kv = None
    if fused_set_kv_buffer_arg is not None:
        kv = _check_kv(key, fused_set_kv_buffer_arg, head_size, debug)
    if torch.compiler.is_compiling():
        a = fused_set_kv_buffer_arg
        torch.ops.sgl_ext.rope_kv(
            positions,
            query,
            key,
            head_size,
            cos_sin_cache,
            is_neox,
            *(_op_kv_args(a) if a is not None else (None,) * 6),
        )
        return
    _run(positions, query, key, head_size, cos_sin_cache, is_neox, q_info, k_info, kv, enable_pdl)


def _op_kv_args(a: FusedSetKVBufferArg) -> tuple:
    """Flatten the dataclass for the registered op (a float scale travels as a tensor)."""
    return (
        a.value,
        a.k_buffer,
        a.v_buffer,
        _scale_tensor(a.k_scale, a.value),
        _scale_tensor(a.v_scale, a.value),
        a.cache_loc,
    )


def _scale_tensor(scale: Scale, like: torch.Tensor) -> torch.Tensor | None:
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.full((), float(scale), dtype=torch.float32, device=like.device)


def apply_rope_native(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    fused_set_kv_buffer_arg: FusedSetKVBufferArg | None = None,
) -> None:
    """The torch-native reference of apply_rope_with_cos_sin_cache_inplace (same semantics)."""
    q_info, k_info = _check_rope(positions, query, key, head_size, cos_sin_cache, is_neox)
    rotate_native(positions, query, head_size, cos_sin_cache, is_neox)
    rotate_native(positions, key, head_size, cos_sin_cache, is_neox)
    if fused_set_kv_buffer_arg is not None:
        value, _, _, _, kbuf, vbuf, loc, ks, vs, k_lay, v_lay = _check_kv(
            key, fused_set_kv_buffer_arg, head_size
        )
        kv_write_native(key, value, kbuf, vbuf, loc, ks, vs, k_lay, v_lay)
