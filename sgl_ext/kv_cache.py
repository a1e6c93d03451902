"""set_kv_buffer: store K and V into the KV cache (the unfused write; the fused op's semantics).

For layers that cannot fuse the write into RoPE. Identical bits to the fused op's cache write:
fused == RoPE alone + this op, exactly. Checked once per distinct metadata and launched
directly, like the fused op (see `rope.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from sgl_ext import _common as C
from sgl_ext._alias import AliasGuard, rope_kv_guard
from sgl_ext._common import RopeCall, Scale
from sgl_ext._plans import RopeKVPlan, kv_key, kv_present, new_plan, run, run_native, scale_tensor
from sgl_ext._reference import native_reference
from sgl_ext.fast_launch import OpTable
from sgl_ext.plan_cache import KEY_ERRORS, PlanCache
from sgl_ext.rope_kv_schema import SET_KV_OP

_is_compiling = torch.compiler.is_compiling
_PLANS = PlanCache()
# The C fast path's table: leaves and written ones from SET_KV_OP's declaration.
_FAST = OpTable(expand=SET_KV_OP.expand(), grad=SET_KV_OP.grad(), written=SET_KV_OP.grad())
# k_buffer and v_buffer, by their index in the kernels' pointer order; key and value are only
# read here, so they may be one tensor.
_WRITTEN = SET_KV_OP.written_pointers()


def alias_check(*tensors: object) -> AliasGuard:
    """alias_check(key, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale): a ValueError
    naming both when k_buffer or v_buffer may share memory with another of them; the guard of
    that decision (after the other checks passed)."""
    return rope_kv_guard(_tensors(tensors), _WRITTEN)


def _tensors(args: tuple) -> tuple:
    """The op's arguments (key .. v_scale, head_size) as the kernel's per-call tensors, in
    pointer order: no positions, cos_sin_cache, query or norm weights."""
    return (None, None, None, *args[:7], None, None)


def check(*args: Any) -> RopeCall:
    """All argument checks of set_kv_buffer (args: its arguments, key .. head_size, in its
    order): the checked call (no rotation)."""
    key, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale, head_size = args
    C.check_tensor("key", key, C.INPUT_DTYPES)
    assert isinstance(key, torch.Tensor)
    if head_size is None:
        if key.ndim == 3:
            head_size = key.shape[2]
        elif isinstance(k_buffer, torch.Tensor) and k_buffer.ndim >= 3:
            head_size = k_buffer.shape[-1]
        else:
            raise ValueError("head_size is required for a 2-D key with a 2-D k_buffer")
    if not isinstance(head_size, int) or isinstance(head_size, bool) or head_size <= 0:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    k_view = C.heads_view("key", key, key.shape[0], head_size)
    kv_args = (value, k_buffer, v_buffer, cache_loc, k_scale, v_scale)
    kv = C.check_kv_write(key, *kv_args, key.shape[0], head_size)
    return RopeCall(key.shape[0], head_size, key.dtype, key.device, None, k_view, 0, 1, 0, True, kv)


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
        last dim contiguous, not requiring grad, not overlapping themselves; dtype of key or
        fp8 (float8_e4m3fn / float8_e5m2).
    cache_loc : int32/int64 [T], contiguous
        Slot per token; slots < 0 (or >= num_slots) are not written.
    k_scale, v_scale : None, float (positive and finite in float32), or 1-element float tensor
        The cache stores x * (1 / scale) cast to the buffer dtype (fp8: finite values saturate,
        NaN stays NaN). A tensor scale is never read on the host: it must be positive and
        finite (SGL_EXT_DEBUG checks it).
    head_size : int, optional
        D; needed only when both key and k_buffer are 2-D.

    Raises
    ------
    TypeError, ValueError
        A bad argument, named, before anything is written. ValueError naming both when
        k_buffer and v_buffer (written in place) may share memory with each other
        or another argument; views of one buffer in disjoint places (q/k/v columns of one qkv
        row, the cross-layer KV layout's K and V) are fine.
    """
    args = (key, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale, head_size)
    if _is_compiling():
        call = check(*args)
        ks, vs = scale_tensor(k_scale, key), scale_tensor(v_scale, key)
        torch.ops.sgl_ext.set_kv(key, value, k_buffer, v_buffer, cache_loc, ks, vs, call.head_size)
        return
    fast = _FAST.launch(*args)
    if fast == 1:
        return
    plan_key: tuple | None
    plan: RopeKVPlan | None
    try:
        kp = key.data_ptr()
        kv, kv_ptrs = kv_key(value, k_buffer, v_buffer, cache_loc, k_scale, v_scale, kp)
        ptrs = (kp, kp, kp, kp, *kv_ptrs, kp, kp)
        plan_key = (
            key.dtype,
            key.shape,
            key.stride(),
            key.device,
            kp & 15,
            head_size.__class__,
            head_size,
            kv,
        )
        plan = _PLANS.get(plan_key)
    except KEY_ERRORS:  # not a (dense) tensor, unhashable: the checks will say
        plan_key = plan = None
    if plan is None:
        plan = _PLANS.put(plan_key, new_plan(check(*args), _tensors(args), _WRITTEN, None))
    elif plan.alias is not None and not plan.alias.holds(ptrs):  # checked again
        alias = alias_check(*args)
        plan = _PLANS.put(plan_key, dataclasses.replace(plan, alias=alias))
    launcher = plan.launcher
    if launcher is not None and launcher.compiled is not None and not plan.debug:
        launcher.run_ptrs(ptrs)
        if fast == 0:  # this metadata has no C plan yet: the next call launches from C
            leaves = SET_KV_OP.leaves({"key"} | kv_present(True, k_scale, v_scale))
            _FAST.register(launcher, leaves, *args)
        return
    run(plan, _tensors(args))


def _reference(*args: Any) -> None:
    """(No rotation: the KV write alone.)"""
    tensors = _tensors(args)
    run_native(new_plan(check(*args), tensors, _WRITTEN, None, backend="native"), tensors)


set_kv_buffer_native = native_reference(set_kv_buffer, _reference)
