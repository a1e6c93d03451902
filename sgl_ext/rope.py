"""apply_rope_with_cos_sin_cache_inplace: RoPE on q/k, optionally fused with the KV-cache write.

Source-compatible with `sgl_kernel.apply_rope_with_cos_sin_cache_inplace`. With a
`FusedSetKVBufferArg`, the rotated K and the V are stored into the layer's KV cache by the same
kernel that rotates q and k (no separate `set_kv_buffer` launch, no re-read of K).

Eager cost: a call is checked once per distinct metadata. The key of `_PLANS` holds everything
a check reads (each tensor's dtype, shape, strides, device, requires_grad and data_ptr() % 16,
the scalars' types and values, a float scale's value, a tensor scale's metadata); a hit returns
the `RopeKVPlan` made when that metadata was first checked, so a changed input always misses
and is checked. Aliasing between the arguments depends on the pointers, which the key does not
hold: a plan keeps the guard of its aliasing decision, checked on every call (`_alias.py`; the C
fast path keeps the equivalent per plan). The Triton kernel of a plan is launched directly
after its first launch (`triton/launcher.py`). Under torch.compile the op goes through
`torch.ops.sgl_ext.rope_kv`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from sgl_ext._alias import rope_kv_guard
from sgl_ext._common import check_rope as check
from sgl_ext._plans import (
    RopeKVPlan,
    kv_key,
    kv_present,
    kv_tensors,
    new_plan,
    run,
    run_native,
    scale_tensor,
)
from sgl_ext._reference import native_reference
from sgl_ext.fast_launch import OpTable
from sgl_ext.fused_arg import FusedSetKVBufferArg, sglang_call
from sgl_ext.plan_cache import KEY_ERRORS, PlanCache
from sgl_ext.rope_kv_schema import ROPE_OP

_is_compiling = torch.compiler.is_compiling

_PLANS = PlanCache()
# The C fast path's table: its leaves and the written ones come from ROPE_OP's declaration
# (positions, query, key, head_size, cos_sin_cache, is_neox, enable_pdl, the argument, then the
# argument's fields).
_FAST = OpTable(expand=ROPE_OP.expand(), grad=ROPE_OP.grad(), written=ROPE_OP.grad())
_ROPE_TENSORS = {"positions", "query", "key", "cos_sin_cache"}
# The written tensors (query, key, k_buffer, v_buffer) by their index in the kernels' pointer
# order (rope_kv_schema.POINTER_TENSORS).
ROPE_WRITTEN = ROPE_OP.written_pointers()


def apply_rope_with_cos_sin_cache_inplace(
    # (None defaults: SGLang 0.5's form passes q, k and positions / cos_sin_cache by keyword)
    positions: torch.Tensor = None,  # type: ignore[assignment]
    query: torch.Tensor = None,  # type: ignore[assignment]
    key: torch.Tensor = None,  # type: ignore[assignment]
    head_size: int = None,  # type: ignore[assignment]
    cos_sin_cache: torch.Tensor = None,  # type: ignore[assignment]
    is_neox: bool = True,
    fused_set_kv_buffer_arg: FusedSetKVBufferArg | None = None,
    enable_pdl: bool | None = None,
    *,
    q: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    rope_dim: int = 0,
    fused_args: object = None,
) -> None:
    """Rotate query and key in place; optionally store the rotated K and V into the KV cache.

    Two call forms, the same bits: sgl_kernel's (#9014), `(positions, query, key, head_size,
    cos_sin_cache, is_neox=True, fused_set_kv_buffer_arg=None, enable_pdl=None)`, and SGLang
    0.5's, `(q, k, cos_sin_cache, positions, *, is_neox, rope_dim=0, fused_args=None)` (q / k
    [T, H, D]; head_size is D; rope_dim, 0 for cos_sin_cache's width, must be that width and
    may be less than D: partial rotary). A call mixing the two raises TypeError.

    Parameters
    ----------
    positions : int32/int64 [T], contiguous
        Position of each token (row of cos_sin_cache).
    query : bf16/fp16/fp32 [T, Hq*D] or [T, Hq, D]
        Rotated in place; may be a strided view (e.g. of a fused qkv output), last dim contiguous;
        must not require grad or overlap itself.
    key : same dtype as query, [T, Hkv*D] or [T, Hkv, D]
        Rotated in place (same conditions as query).
    head_size : int
        D.
    cos_sin_cache : float32 [max_pos, rotary_dim], max_pos >= 1
        cos in the first rotary_dim/2 columns, sin in the rest; rotary_dim even and <= D. Dims
        rotary_dim..D of each head pass through unchanged (partial rotary).
    is_neox : bool
        True rotates the two halves of the rotary dims; False rotates interleaved (GPT-J) pairs.
    fused_set_kv_buffer_arg : FusedSetKVBufferArg or None
        If given, the rotated K and the V are also written to the cache slots `cache_loc`.
    enable_pdl : bool or None
        Programmatic dependent launch on Hopper+ (the kernel's launch overlaps the previous
        kernel's tail). None: on where supported.
    q, k, rope_dim, fused_args
        SGLang 0.5's names: query and key [T, H, D], the rotary width, the fused write (ours,
        or any object with SGLang's four fields and optional k_scale / v_scale).

    Raises
    ------
    TypeError, ValueError
        A bad argument, named, before anything is written. ValueError naming both when
        query, key, k_buffer and v_buffer (written in place) may share memory with each other
        or another argument; views of one buffer in disjoint places (q/k/v columns of one qkv
        row, the cross-layer KV layout's K and V) are fine.
    """
    if (
        q is not None
        or k is not None
        or fused_args is not None
        or rope_dim
        or (
            head_size.__class__ is torch.Tensor  # SGLang 0.5's order, positionally
        )
    ):
        positions, query, key, head_size, cos_sin_cache, fused_set_kv_buffer_arg = sglang_call(
            (positions, query, key, head_size, cos_sin_cache, fused_set_kv_buffer_arg),
            q,
            k,
            rope_dim,
            fused_args,
        )
    a = fused_set_kv_buffer_arg
    if _is_compiling():  # check while tracing, then one opaque mutating op
        check(positions, query, key, head_size, cos_sin_cache, is_neox, a)
        kv_args = op_kv_args(a)
        torch.ops.sgl_ext.rope_kv(
            positions, query, key, head_size, cos_sin_cache, is_neox, *kv_args
        )
        return
    fast = _FAST.launch(positions, query, key, head_size, cos_sin_cache, is_neox, enable_pdl, a)
    if fast == 1:
        return
    plan_key: tuple | None
    plan: RopeKVPlan | None
    try:
        plan_key, ptrs = call_key(
            positions, query, key, head_size, cos_sin_cache, is_neox, a, enable_pdl
        )
        plan = _PLANS.get(plan_key)
    except KEY_ERRORS:  # not a (dense) tensor, unhashable: the checks will say
        plan_key = plan = None
    if plan is None:
        call = check(positions, query, key, head_size, cos_sin_cache, is_neox, a)
        tensors = (positions, cos_sin_cache, query, key, *kv_tensors(a), None, None)
        plan = _PLANS.put(plan_key, new_plan(call, tensors, ROPE_WRITTEN, enable_pdl))
    elif plan.alias is not None and not plan.alias.holds(ptrs):  # checked again
        tensors = (positions, cos_sin_cache, query, key, *kv_tensors(a), None, None)
        alias = rope_kv_guard(tensors, ROPE_WRITTEN)
        plan = _PLANS.put(plan_key, dataclasses.replace(plan, alias=alias))
    launcher = plan.launcher
    if launcher is not None and launcher.compiled is not None and not plan.debug:
        kp = ptrs[3]
        launcher.run_ptrs((*ptrs, kp, kp))  # no norm weights
        if fast == 0:  # this metadata has no C plan yet: the next call launches from C
            ks, vs = (a.k_scale, a.v_scale) if a is not None else (None, None)
            leaves = ROPE_OP.leaves(_ROPE_TENSORS | kv_present(a is not None, ks, vs))
            fast_args = (positions, query, key, head_size, cos_sin_cache, is_neox, enable_pdl, a)
            _FAST.register(launcher, leaves, *fast_args)
        return
    run(plan, (positions, cos_sin_cache, query, key, *kv_tensors(a), None, None))


def call_key(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    a: FusedSetKVBufferArg | None,
    enable_pdl: bool | None,
) -> tuple[tuple, tuple[int, ...]]:
    """The plan-cache key of a call (a flat tuple; with a KV write, that tuple, the argument's
    class and its `kv_key`) and its kernel pointers (pos, cos_sin, q, k, v, k_buffer, v_buffer,
    cache_loc, k_scale, v_scale; key's for the ones the call does not have).

    The key holds everything the checks and the launch plan read: each tensor's dtype, shape,
    strides, device, data_ptr() % 16 and requires_grad where written, the scalars' types and
    values, enable_pdl, the argument's class and its `kv_key`. Raises AttributeError /
    TypeError for arguments that are not tensors (the caller then runs the checks, which say
    what is wrong).
    """
    pp, qp, kp = positions.data_ptr(), query.data_ptr(), key.data_ptr()
    cp = cos_sin_cache.data_ptr()
    rope_key = (
        positions.dtype,
        positions.shape,
        positions.stride(),
        positions.device,
        pp & 15,
        query.dtype,
        query.shape,
        query.stride(),
        query.device,
        qp & 15,
        query.requires_grad,
        key.dtype,
        key.shape,
        key.stride(),
        key.device,
        kp & 15,
        key.requires_grad,
        cos_sin_cache.dtype,
        cos_sin_cache.shape,
        cos_sin_cache.stride(),
        cos_sin_cache.device,
        cp & 15,
        head_size.__class__,
        head_size,
        is_neox.__class__,
        is_neox,
        enable_pdl,
    )
    if a is None:
        return rope_key, (pp, cp, qp, kp, kp, kp, kp, kp, kp, kp)
    kv, kv_ptrs = kv_key(a.value, a.k_buffer, a.v_buffer, a.cache_loc, a.k_scale, a.v_scale, kp)
    return (rope_key, a.__class__, kv), (pp, cp, qp, kp, *kv_ptrs)


def op_kv_args(a: FusedSetKVBufferArg | None) -> tuple:
    """(value, k_buffer, v_buffer, k_scale, v_scale, cache_loc) as the registered ops take them
    (float scales as 0-d tensors; all None without a KV write); `fused_arg` undoes it."""
    if a is None:
        return (None,) * 6
    ks, vs = scale_tensor(a.k_scale, a.value), scale_tensor(a.v_scale, a.value)
    return a.value, a.k_buffer, a.v_buffer, ks, vs, a.cache_loc


def fused_arg(
    value: torch.Tensor | None,
    k_buffer: torch.Tensor | None,
    v_buffer: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    cache_loc: torch.Tensor | None,
) -> FusedSetKVBufferArg | None:
    """The FusedSetKVBufferArg a registered op's KV arguments stand for (None without a write)."""
    if value is None:
        return None
    assert k_buffer is not None and v_buffer is not None and cache_loc is not None
    return FusedSetKVBufferArg(value, k_buffer, v_buffer, k_scale, v_scale, cache_loc)


def _reference(*args: Any) -> None:
    """sgl_kernel's call form (SGLang 0.5's is the op's own)."""
    positions, query, key, _, cos_sin_cache, _, a = args
    tensors = (positions, cos_sin_cache, query, key, *kv_tensors(a), None, None)
    run_native(new_plan(check(*args), tensors, ROPE_WRITTEN, None, backend="native"), tensors)


apply_rope_native = native_reference(
    apply_rope_with_cos_sin_cache_inplace,
    _reference,
    drop=("enable_pdl", "q", "k", "rope_dim", "fused_args"),
)
