"""torch.library registration of the sgl_ext ops, used only under torch.compile.

Eager calls go straight to the implementation (no dispatcher overhead); when
`torch.compiler.is_compiling()` the public functions call these ops instead, so dynamo sees one
opaque mutating op (no graph break) and inductor keeps the in-place semantics.
"""

from __future__ import annotations

import torch

from sgl_ext import kv_cache, qk_norm_rope, rope

_ROPE_MUTATES = ("query", "key", "k_buffer", "v_buffer")


@torch.library.custom_op("sgl_ext::rope_kv", mutates_args=_ROPE_MUTATES)
def rope_kv_op(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    value: torch.Tensor | None,
    k_buffer: torch.Tensor | None,
    v_buffer: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    cache_loc: torch.Tensor | None,
) -> None:
    arg = rope.fused_arg(value, k_buffer, v_buffer, k_scale, v_scale, cache_loc)
    rope.apply_rope_with_cos_sin_cache_inplace(
        positions, query, key, head_size, cos_sin_cache, is_neox, arg
    )


@rope_kv_op.register_fake
def _rope_kv_fake(*args: object) -> None:
    return None


@torch.library.custom_op("sgl_ext::qk_norm_rope_kv", mutates_args=_ROPE_MUTATES)
def qk_norm_rope_kv_op(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    is_neox: bool,
    value: torch.Tensor | None,
    k_buffer: torch.Tensor | None,
    v_buffer: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    cache_loc: torch.Tensor | None,
) -> None:
    arg = rope.fused_arg(value, k_buffer, v_buffer, k_scale, v_scale, cache_loc)
    qk_norm_rope.apply_qk_norm_rope_with_cos_sin_cache_inplace(
        positions,
        query,
        key,
        head_size,
        cos_sin_cache,
        q_norm_weight,
        k_norm_weight,
        eps,
        is_neox,
        arg,
    )


@qk_norm_rope_kv_op.register_fake
def _qk_norm_rope_kv_fake(*args: object) -> None:
    return None


@torch.library.custom_op("sgl_ext::set_kv", mutates_args=("k_buffer", "v_buffer"))
def set_kv_op(
    key: torch.Tensor,
    value: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    cache_loc: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    head_size: int,
) -> None:
    kv_cache.set_kv_buffer(key, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale, head_size)


@set_kv_op.register_fake
def _set_kv_fake(*args: object) -> None:
    return None
