"""sgl_ext: RoPE fused with the KV-cache write, source-compatible with sgl_kernel."""

from sgl_ext import _ops  # noqa: F401  (registers torch.ops.sgl_ext.* for torch.compile)
from sgl_ext._common import FP8_DTYPES, INPUT_DTYPES, set_debug_checks
from sgl_ext.activation import silu_and_mul, silu_and_mul_native
from sgl_ext.kv_cache import set_kv_buffer, set_kv_buffer_native
from sgl_ext.norm import (
    fused_add_rmsnorm,
    fused_add_rmsnorm_native,
    moe_sum_add_rmsnorm,
    moe_sum_add_rmsnorm_native,
    rmsnorm,
    rmsnorm_native,
)
from sgl_ext.qk_norm_rope import (
    apply_qk_norm_rope_native,
    apply_qk_norm_rope_with_cos_sin_cache_inplace,
)
from sgl_ext.qkv_rope import qkv_proj_with_rope_kv, qkv_proj_with_rope_kv_native
from sgl_ext.rope import (
    FusedSetKVBufferArg,
    apply_rope_native,
    apply_rope_with_cos_sin_cache_inplace,
)

__all__ = [
    "FP8_DTYPES",
    "INPUT_DTYPES",
    "FusedSetKVBufferArg",
    "apply_qk_norm_rope_native",
    "apply_qk_norm_rope_with_cos_sin_cache_inplace",
    "apply_rope_native",
    "fused_add_rmsnorm",
    "fused_add_rmsnorm_native",
    "moe_sum_add_rmsnorm",
    "moe_sum_add_rmsnorm_native",
    "qkv_proj_with_rope_kv",
    "qkv_proj_with_rope_kv_native",
    "rmsnorm",
    "rmsnorm_native",
    "apply_rope_with_cos_sin_cache_inplace",
    "set_debug_checks",
    "set_kv_buffer",
    "set_kv_buffer_native",
    "silu_and_mul",
    "silu_and_mul_native",
]
