"""get_rope: build the right RotaryEmbedding from an HF `rope_scaling` / `rope_parameters` dict.

Instances are shared between calls with identical arguments (every attention layer of a model
asks for the same one), keyed by ALL arguments, as SGLang does; a shared instance serves any
device (see `RotaryEmbedding._cache_for`).
"""

from __future__ import annotations

from typing import Any

import torch

from srt.layers.rotary_embedding.base import RotaryEmbedding
from srt.layers.rotary_embedding.scaling import (
    DeepseekScalingRotaryEmbedding,
    DynamicNTKScalingRotaryEmbedding,
    LinearScalingRotaryEmbedding,
    Llama3RotaryEmbedding,
    YaRNScalingRotaryEmbedding,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "deepseek_yarn", "llama3")
_YARN_KEYS = ("extrapolation_factor", "attn_factor", "beta_fast", "beta_slow", "truncate")
_ROPE_DICT: dict[tuple, RotaryEmbedding] = {}


def _freeze(x: Any) -> Any:
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x


def _require(rope_scaling: dict, key: str, rope_type: str) -> Any:
    if rope_scaling.get(key) is None:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs {key!r}: {rope_scaling}")
    return rope_scaling[key]


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    is_neox_style: bool = True,
    rope_scaling: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    partial_rotary_factor: float = 1.0,
    dual_chunk_attention_config: dict[str, Any] | None = None,
) -> RotaryEmbedding:
    """The rotary embedding for a model config.

    Parameters
    ----------
    head_size : int
    rotary_dim : int
        Rotated dims before `partial_rotary_factor` is applied (usually head_size).
    max_position : int
        The model's max_position_embeddings.
    base : float
        rope_theta.
    is_neox_style : bool
    rope_scaling : dict, optional
        HF `rope_scaling` (or `rope_parameters`); the type is read from `rope_type` or `type`.
        Supported: default, linear, dynamic, yarn (attention_factor, mscale/mscale_all_dim,
        truncate), deepseek_yarn, llama3.
    dtype : torch.dtype, optional
        Activation dtype (default: torch.get_default_dtype()); the cache is float32 regardless.
    partial_rotary_factor : float
        rotary_dim is scaled by it (e.g. 0.5 rotates half of each head).
    dual_chunk_attention_config : dict, optional
        SGLang's dual-chunk attention RoPE (long-context Qwen); not supported (raises).
    """
    if dual_chunk_attention_config is not None:
        raise NotImplementedError("dual chunk attention (dual_chunk_attention_config) RoPE")
    if dtype is None:
        dtype = torch.get_default_dtype()
    if not 0 < partial_rotary_factor <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial_rotary_factor}")
    if partial_rotary_factor < 1.0:
        rotary_dim = int(rotary_dim * partial_rotary_factor)
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise TypeError(f"rope_scaling must be a dict or None, got {type(rope_scaling).__name__}")
    key = (
        head_size,
        rotary_dim,
        max_position,
        float(base),
        bool(is_neox_style),
        _freeze(rope_scaling),
        dtype,
        str(torch.get_default_device()),
    )
    rope = _ROPE_DICT.get(key)
    if rope is None:
        rope = _build(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype)
        _ROPE_DICT[key] = rope
    return rope


def _build(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    is_neox_style: bool,
    rope_scaling: dict[str, Any] | None,
    dtype: torch.dtype,
) -> RotaryEmbedding:
    args = (head_size, rotary_dim, max_position, base, is_neox_style)
    rs = rope_scaling or {}
    rope_type = rs.get("rope_type", rs.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return RotaryEmbedding(*args, dtype)
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(*args, _require(rs, "factor", rope_type), dtype)
    if rope_type == "dynamic":
        return DynamicNTKScalingRotaryEmbedding(*args, _require(rs, "factor", rope_type), dtype)
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(
            *args,
            dtype,
            _require(rs, "factor", rope_type),
            _require(rs, "low_freq_factor", rope_type),
            _require(rs, "high_freq_factor", rope_type),
            _require(rs, "original_max_position_embeddings", rope_type),
        )
    # yarn / deepseek_yarn: max_position_embeddings of the layer is the ORIGINAL context.
    original = _require(rs, "original_max_position_embeddings", rope_type)
    factor = rs.get("factor") or max_position / original
    extra = {k: rs[k] for k in _YARN_KEYS if rs.get(k) is not None}
    yarn_args = (head_size, rotary_dim, original, base, is_neox_style, factor, dtype)
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if rope_type == "deepseek_yarn" or (
        mscale and mscale_all_dim and rs.get("attention_factor") is None
    ):
        return DeepseekScalingRotaryEmbedding(
            *yarn_args,
            mscale=mscale if mscale is not None else 1.0,
            mscale_all_dim=mscale_all_dim or 0.0,
            **extra,
        )
    return YaRNScalingRotaryEmbedding(
        *yarn_args, attention_factor=rs.get("attention_factor"), **extra
    )
