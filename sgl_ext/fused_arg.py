"""The KV-cache write argument of the RoPE op (`FusedSetKVBufferArg`), and SGLang 0.5's call
form of the op translated to sgl_kernel's (`sglang_call`).

SGLang has called the fused op two ways: sgl_kernel's (#9014) `apply_rope_with_cos_sin_cache_
inplace(positions, query, key, head_size, cos_sin_cache, is_neox, fused_set_kv_buffer_arg)` with
a six-field argument built positionally, and SGLang 0.5's `(q, k, cos_sin_cache, positions, *,
is_neox, rope_dim=0, fused_args=None)` with four fields built by keyword. The op takes both and
launches the same plan for both (same bits); this module holds what tells them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A cache scale as the ops take it: none, a float, or a 1-element float tensor.
Scale = float | torch.Tensor | None


@dataclass
class FusedSetKVBufferArg:
    """The KV-cache write fused into the RoPE op.

    Both generations of SGLang build it: sgl_kernel's (#9014) positionally, `(value, k_buffer,
    v_buffer, k_scale, v_scale, cache_loc)`, and SGLang 0.5's by keyword with four fields,
    `(value=, k_buffer=, v_buffer=, cache_loc=)` (the scales default to None). cache_loc is
    required either way.

    value: [T, Hkv*Dv] or [T, Hkv, Dv], the dtype of key.
    k_buffer / v_buffer: the layer's caches, [slots, H*D], [slots, H, D] or
        [pages, page_size, H, D] (any strided view whose last dim is contiguous); dtype of key or
        fp8 (float8_e4m3fn / float8_e5m2).
    k_scale / v_scale: None, a float that is positive and finite in float32, or a 1-element
        float tensor (CUDA-graph safe; never read on the host, so its value must be positive
        and finite: SGL_EXT_DEBUG checks it); the cache stores x * (1 / scale) cast to the
        buffer dtype (fp8: finite values saturate, NaN stays NaN).
    cache_loc: [T] int32/int64 slot per token; a slot < 0 (or >= num_slots) is not written.
    """

    value: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    k_scale: Scale = None
    v_scale: Scale = None
    cache_loc: torch.Tensor = None  # type: ignore[assignment]  # required: __post_init__

    def __post_init__(self) -> None:
        if self.cache_loc is not None:
            return
        k = self.k_scale
        if isinstance(k, torch.Tensor) and not k.is_floating_point():
            raise TypeError(
                "FusedSetKVBufferArg: cache_loc is missing and k_scale is an integer tensor: "
                "SGLang 0.5's positional order (value, k_buffer, v_buffer, cache_loc) is not "
                "this class's (value, k_buffer, v_buffer, k_scale, v_scale, cache_loc); pass "
                "cache_loc=... by keyword"
            )
        raise TypeError("FusedSetKVBufferArg: cache_loc is required (the slot of each token)")


def sglang_call(
    legacy: tuple[object, ...],
    q: object,
    k: object,
    rope_dim: object,
    fused_args: object,
) -> tuple:
    """An SGLang 0.5 call as sgl_kernel's arguments (positions, query, key, head_size,
    cos_sin_cache, fused_set_kv_buffer_arg).

    legacy: the op's first five parameters and fused_set_kv_buffer_arg as called; in a positional
    SGLang 0.5 call the first four hold (q, k, cos_sin_cache, positions). Raises TypeError for a
    call that mixes the forms, ValueError for a bad value (naming it)."""
    positions, query, key, head_size, cos_sin_cache, legacy_arg = legacy
    if isinstance(head_size, torch.Tensor):  # (q, k, cos_sin_cache, positions) positionally
        given = {"q": q, "k": k, "cos_sin_cache (5th)": cos_sin_cache}
        q, k, cos_sin_cache, positions = positions, query, key, head_size
        mixed = [n for n, v in given.items() if v is not None]
    else:
        pairs = (("query", query), ("key", key), ("head_size", head_size))
        mixed = [n for n, v in pairs if v is not None]
    if legacy_arg is not None:
        mixed.append("fused_set_kv_buffer_arg")
    if mixed:
        raise TypeError(
            "apply_rope_with_cos_sin_cache_inplace: SGLang 0.5's form (q, k, cos_sin_cache, "
            f"positions, rope_dim, fused_args) mixed with sgl_kernel's: {', '.join(mixed)}"
        )
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.ndim != 3:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be a [num_tokens, num_heads, head_dim] tensor, got {got}"
            )
    assert isinstance(q, torch.Tensor)
    if not isinstance(cos_sin_cache, torch.Tensor) or cos_sin_cache.ndim != 2:
        raise ValueError("cos_sin_cache must be a [max_position, rope_dim] tensor")
    width = cos_sin_cache.shape[-1]
    if rope_dim.__class__ is not int or rope_dim not in (0, width):
        raise ValueError(
            f"rope_dim must be 0 or cos_sin_cache's width {width} (its rows hold rope_dim / 2 "
            f"cos values, then rope_dim / 2 sin values), got {rope_dim!r}"
        )
    arg = fused_args
    if arg is not None and not isinstance(arg, FusedSetKVBufferArg):
        try:
            fields = (arg.value, arg.k_buffer, arg.v_buffer)  # type: ignore[attr-defined]
            loc = arg.cache_loc  # type: ignore[attr-defined]
        except AttributeError:
            raise TypeError(
                "fused_args must be a FusedSetKVBufferArg (value, k_buffer, v_buffer, "
                f"cache_loc), got {type(arg).__name__}"
            ) from None
        scales = (getattr(arg, "k_scale", None), getattr(arg, "v_scale", None))
        arg = FusedSetKVBufferArg(*fields, *scales, loc)
    return positions, q, k, q.shape[-1], cos_sin_cache, arg
