"""apply_qk_norm_rope_with_cos_sin_cache_inplace: q/k RMSNorm + RoPE (+ KV-cache write), one kernel.

Qwen3-style attention normalises every query and key head (RMSNorm over the head, float32, a
weight of [head_size]) before RoPE. This op does the norm, the rotation and, with a
`FusedSetKVBufferArg`, the KV-cache write of `apply_rope_with_cos_sin_cache_inplace` in one
launch of the same Triton kernel (its QK_NORM variant): the norm rides on the bytes the RoPE +
KV op already moves. The cache write has exactly the semantics of that op (DESIGN §2.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sgl_ext import _common as C
from sgl_ext._backend import select_backend
from sgl_ext.native import kv_write_native, rms_norm_heads_native, rotate_native
from sgl_ext.rope import FusedSetKVBufferArg, _check_kv, _check_rope, _op_kv_args


@dataclass(frozen=True)
class QKNorm:
    """The q/k RMSNorm parameters that travel to the kernel.

    q_weight / k_weight: [head_size], the dtype of query, contiguous, on query's device.
    eps: the variance epsilon (positive, finite).
    """

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


def _check_norm(
    query: torch.Tensor, head_size: int, q_norm_weight: object, k_norm_weight: object, eps: object
) -> QKNorm:
    """Metadata-only checks of the norm arguments (after the RoPE checks: head_size is valid)."""
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        C.check_tensor(name, w, C.INPUT_DTYPES)
        assert isinstance(w, torch.Tensor)
        if w.dtype != query.dtype:
            raise TypeError(f"{name} dtype {w.dtype} must equal query dtype {query.dtype}")
        C.check_device(name, w, query.device)
        if tuple(w.shape) != (head_size,):
            raise ValueError(
                f"{name} must have shape [head_size] = [{head_size}], got {tuple(w.shape)}"
            )
        if w.stride(0) != 1 and head_size > 1:
            raise ValueError(f"{name} must be contiguous (stride {w.stride(0)})")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be a finite positive number, got {eps}")
    assert isinstance(q_norm_weight, torch.Tensor) and isinstance(k_norm_weight, torch.Tensor)
    return QKNorm(q_norm_weight, k_norm_weight, float(eps))


def _run(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    norm: QKNorm,
    is_neox: bool,
    q_info: tuple[int, int, int],
    k_info: tuple[int, int, int],
    kv: tuple | None,
    enable_pdl: bool | None = None,
) -> None:
    # No CUDA C++ kernel for this op: forcing `cuda` falls back to the automatic choice.
    backend = select_backend(query.device, cuda_ok=False, cuda_preferred=False, has_cuda=False)
    if backend == "native":
        _native(positions, query, key, head_size, cos_sin_cache, norm, is_neox, kv)
        return
    from sgl_ext.triton.rope_kv import launch_rope_kv

    launch_rope_kv(
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
        qk_norm=norm,
    )


def _native(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    norm: QKNorm,
    is_neox: bool,
    kv: tuple | None,
) -> None:
    """Torch RMSNorm (Qwen3's rounding), then the RoPE op's native path: the same bits as the
    unfused model path (torch q/k norm, RoPE, set_kv_buffer) on the CPU."""
    rms_norm_heads_native(query, head_size, norm.q_weight, norm.eps)
    rms_norm_heads_native(key, head_size, norm.k_weight, norm.eps)
    rotate_native(positions, query, head_size, cos_sin_cache, is_neox)
    rotate_native(positions, key, head_size, cos_sin_cache, is_neox)
    if kv is not None:
        value, _, _, _, kbuf, vbuf, loc, ks, vs, k_lay, v_lay = kv
        kv_write_native(key, value, kbuf, vbuf, loc, ks, vs, k_lay, v_lay)


def apply_qk_norm_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    is_neox: bool = True,
    fused_set_kv_buffer_arg: FusedSetKVBufferArg | None = None,
    enable_pdl: bool | None = None,
) -> None:
    """RMSNorm every query and key head, rotate them in place; optionally store K and V.

    Parameters
    ----------
    positions : int32/int64 [T]
        Position of each token (row of cos_sin_cache).
    query : bf16/fp16/fp32 [T, Hq*D] or [T, Hq, D]
        Normalised and rotated in place; may be a strided view (e.g. of a fused qkv output),
        last dim contiguous.
    key : same dtype as query, [T, Hkv*D] or [T, Hkv, D]
        Normalised and rotated in place.
    head_size : int
        D.
    cos_sin_cache : float32 [max_pos, rotary_dim]
        cos in the first rotary_dim/2 columns, sin in the rest; rotary_dim even and <= D.
    q_norm_weight, k_norm_weight : [D], the dtype of query, contiguous
        RMSNorm weights of the query and key heads. The norm runs over the whole head (also
        the dims past rotary_dim): y = weight * (x / sqrt(mean(x^2) + eps)) with x in float32,
        the normalised value rounded to the input dtype before the weight multiply (Qwen3).
    eps : float
        Variance epsilon, positive and finite.
    is_neox : bool
        True rotates the two halves of the rotary dims; False rotates interleaved (GPT-J) pairs.
    fused_set_kv_buffer_arg : FusedSetKVBufferArg or None
        If given, the normalised, rotated K and the V are also written to the cache slots
        `cache_loc`, with the semantics of apply_rope_with_cos_sin_cache_inplace.
    enable_pdl : bool or None
        Programmatic dependent launch on Hopper+; None: on where supported.
    """
    q_info, k_info = _check_rope(positions, query, key, head_size, cos_sin_cache, is_neox)
    norm = _check_norm(query, head_size, q_norm_weight, k_norm_weight, eps)
    debug = C.debug_checks_enabled()
    if debug:
        C.debug_check_positions(positions, cos_sin_cache.shape[0])
    kv = None
    if fused_set_kv_buffer_arg is not None:
        kv = _check_kv(key, fused_set_kv_buffer_arg, head_size, debug)
    if torch.compiler.is_compiling():
        a = fused_set_kv_buffer_arg
        torch.ops.sgl_ext.qk_norm_rope_kv(
            positions,
            query,
            key,
            head_size,
            cos_sin_cache,
            q_norm_weight,
            k_norm_weight,
            norm.eps,
            is_neox,
            *(_op_kv_args(a) if a is not None else (None,) * 6),
        )
        return
    _run(
        positions,
        query,
        key,
        head_size,
        cos_sin_cache,
        norm,
        is_neox,
        q_info,
        k_info,
        kv,
        enable_pdl,
    )


def apply_qk_norm_rope_native(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    is_neox: bool = True,
    fused_set_kv_buffer_arg: FusedSetKVBufferArg | None = None,
) -> None:
    """The torch-native reference of apply_qk_norm_rope_with_cos_sin_cache_inplace (same
    arguments and semantics): torch RMSNorm as Qwen3 does it, then the RoPE op's reference."""
    q_info, k_info = _check_rope(positions, query, key, head_size, cos_sin_cache, is_neox)
    norm = _check_norm(query, head_size, q_norm_weight, k_norm_weight, eps)
    kv = None
    if fused_set_kv_buffer_arg is not None:
        kv = _check_kv(key, fused_set_kv_buffer_arg, head_size)
    _native(positions, query, key, head_size, cos_sin_cache, norm, is_neox, kv)
