"""set_kv_buffer: store K and V into the KV cache (the unfused write; the fused op's semantics).

For layers that cannot fuse the write into RoPE. Identical bits to the fused op's cache write:
fused == RoPE alone + this op, exactly. Checked once per distinct metadata and launched
directly, like the fused op (see `rope.py`).
"""

from __future__ import annotations

import dataclasses

import torch

from sgl_ext import _common as C
from sgl_ext import settings
from sgl_ext._alias import AliasGuard, rope_kv_guard
from sgl_ext._backend import select_backend
from sgl_ext._common import RopeCall, Scale
from sgl_ext._plans import kv_key, kv_present, rope_kv_launcher, scale_tensor
from sgl_ext.fast_launch import OpTable
from sgl_ext.native import kv_write_native
from sgl_ext.plan_cache import KEY_ERRORS, PlanCache
from sgl_ext.rope import RopeKVPlan
from sgl_ext.rope_kv_schema import SET_KV_OP

_is_compiling = torch.compiler.is_compiling
_PLANS = PlanCache()
# The C fast path's table: leaves and written ones from SET_KV_OP's declaration.
_FAST = OpTable(expand=SET_KV_OP.expand(), grad=SET_KV_OP.grad(), written=SET_KV_OP.grad())
# k_buffer and v_buffer, by their index in the kernels' pointer order; key and value are only
# read here, so they may be one tensor.
_WRITTEN = SET_KV_OP.written_pointers()


def alias_check(
    key: object,
    value: object,
    k_buffer: object,
    v_buffer: object,
    cache_loc: object,
    k_scale: object,
    v_scale: object,
) -> AliasGuard:
    """ValueError naming both when k_buffer or v_buffer may share memory with another
    argument; the guard of that decision (after the other checks passed)."""
    tensors = (None, None, None, key, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale)
    return rope_kv_guard(tensors, _WRITTEN)


def check(
    key: object,
    value: object,
    k_buffer: object,
    v_buffer: object,
    cache_loc: object,
    k_scale: object,
    v_scale: object,
    head_size: object,
) -> RopeCall:
    """All argument checks of set_kv_buffer: the checked call (no rotation)."""
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
    kv = C.check_kv_write(
        key, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale, key.shape[0], head_size
    )
    return RopeCall(key.shape[0], head_size, key.dtype, key.device, None, k_view, 0, 1, 0, True, kv)


def _new_plan(plan_key: object, *args: object) -> RopeKVPlan:
    call = check(*args)
    key, k_buffer = args[0], args[2]
    assert isinstance(key, torch.Tensor) and isinstance(k_buffer, torch.Tensor)
    alias = alias_check(*args[:7])
    s = settings.get()
    backend = select_backend(call.device)
    launcher = None
    if backend == "triton" and call.num_tokens > 0:
        launcher = rope_kv_launcher(call, None, key, k_buffer, None)
    return _PLANS.put(plan_key, RopeKVPlan(call, backend, s.debug, launcher, alias=alias))


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
        plan = _new_plan(plan_key, *args)
    elif plan.alias is not None and not plan.alias.holds(ptrs):  # checked again
        alias = alias_check(*args[:7])
        plan = _PLANS.put(plan_key, dataclasses.replace(plan, alias=alias))
    launcher = plan.launcher
    if launcher is not None and launcher.compiled is not None and not plan.debug:
        launcher.run_ptrs(ptrs)
        if fast == 0:  # this metadata has no C plan yet: the next call launches from C
            leaves = SET_KV_OP.leaves({"key"} | kv_present(True, k_scale, v_scale))
            _FAST.register(launcher, leaves, *args)
        return
    _run(plan, *args[:7])


def _run(
    plan: RopeKVPlan,
    key: torch.Tensor,
    value: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    cache_loc: torch.Tensor,
    k_scale: Scale,
    v_scale: Scale,
) -> None:
    call = plan.call
    kv = call.kv
    assert kv is not None
    if plan.debug:
        C.debug_check_slots(cache_loc, kv.k_layout.num_slots)
        C.debug_check_scales(k_scale, v_scale)
    if call.num_tokens == 0:
        return
    if plan.backend == "native":
        kv_write_native(
            key, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale, kv.k_layout, kv.v_layout
        )
        return
    from sgl_ext.triton.rope_kv_plan import rope_kv_args

    tensors = rope_kv_args(
        None, None, key, None, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale
    )
    plan.launcher.launch(*tensors)  # type: ignore[union-attr]


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
    call = check(key, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale, head_size)
    alias_check(key, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale)
    kv = call.kv
    assert kv is not None
    kv_write_native(
        key, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale, kv.k_layout, kv.v_layout
    )
