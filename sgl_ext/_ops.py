"""torch.library registration of the sgl_ext ops, used only under torch.compile.

Eager calls go straight to the implementation (no dispatcher overhead); when
`torch.compiler.is_compiling()` the public functions call these ops instead, so dynamo sees one
opaque mutating op (no graph break) and inductor keeps the in-place semantics. Each op's schema
and written arguments come from its declaration in `rope_kv_schema.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sgl_ext import kv_cache, qk_norm_rope, rope
from sgl_ext.rope_kv_schema import QK_NORM_OP, ROPE_OP, SET_KV_OP, OpSpec


def _register(spec: OpSpec, impl: Callable[..., None]) -> object:
    op = torch.library.custom_op(
        f"sgl_ext::{spec.name}", impl, mutates_args=spec.mutates, schema=spec.schema
    )
    op.register_fake(_fake)
    return op


def _fake(*args: object) -> None:
    return None


def _rope_kv(*args: object) -> None:
    """ROPE_OP.registered: the RoPE op's arguments, then the write's (rope.op_kv_args)."""
    n = len(ROPE_OP.registered) - 6
    arg = rope.fused_arg(*args[n:])  # type: ignore[arg-type]
    rope.apply_rope_with_cos_sin_cache_inplace(*args[:n], arg)  # type: ignore[arg-type, call-arg]


def _qk_norm_rope_kv(*args: object) -> None:
    """QK_NORM_OP.registered: the q/k-norm op's arguments, then the write's."""
    n = len(QK_NORM_OP.registered) - 6
    arg = rope.fused_arg(*args[n:])  # type: ignore[arg-type]
    qk_norm_rope.apply_qk_norm_rope_with_cos_sin_cache_inplace(*args[:n], arg)  # type: ignore


rope_kv_op = _register(ROPE_OP, _rope_kv)
qk_norm_rope_kv_op = _register(QK_NORM_OP, _qk_norm_rope_kv)
set_kv_op = _register(SET_KV_OP, kv_cache.set_kv_buffer)
