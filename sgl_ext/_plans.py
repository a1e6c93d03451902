"""The plan-cache keys, plans and slow-path launches the RoPE op, the q/k-norm op and
set_kv_buffer share (the cache itself: `plan_cache.py`).

Keys are flat tuples in a fixed order per op (no nested tuples to build, hash and compare), read
from each tensor once. The pieces the three ops share live here: the KV-write part of a key
(`kv_key`), a cache scale's part (`scale_key`), the plan of a checked call (`RopeKVPlan`,
`new_plan`: the aliasing check, the backend, the Triton launch), the slow way to run one (`run`:
the debug checks, then the torch path, `run_native`, or the Triton JIT) and a float scale as the
registered ops take it (`scale_tensor`).

Past its checks a call is its tensors in the kernel's pointer order (`rope_kv_schema.
POINTER_TENSORS`: positions, cos_sin_cache, query, key, value, k_buffer, v_buffer, cache_loc,
k_scale, v_scale, q_norm_weight, k_norm_weight; None where the op or call has none): the aliasing
check, the torch path and the kernel read them in that one order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sgl_ext import _common as C
from sgl_ext import settings
from sgl_ext._alias import AliasGuard, rope_kv_guard
from sgl_ext._backend import select_backend
from sgl_ext.native import kv_write_native, rms_norm_heads_native, rotate_native
from sgl_ext.rope_kv_schema import stand_in

if TYPE_CHECKING:
    from sgl_ext._common import QKNormCall, RopeCall, Scale
    from sgl_ext.fused_arg import FusedSetKVBufferArg
    from sgl_ext.triton.launcher import KernelLauncher


@dataclass(frozen=True)
class RopeKVPlan:
    """What a checked call launches: the call, its backend and (Triton) its kernel launch;
    for the q/k-norm op also the checked norm; the guard of its aliasing decision (`_alias`:
    a call whose pointers break it is checked again)."""

    call: RopeCall
    backend: str
    debug: bool
    launcher: KernelLauncher | None  # for backend "triton"
    norm: QKNormCall | None = None
    alias: AliasGuard | None = None


def kv_tensors(a: FusedSetKVBufferArg | None) -> tuple[Any, ...]:
    """(value, k_buffer, v_buffer, cache_loc, k_scale, v_scale): the kernels' order (all None
    without a KV write)."""
    if a is None:
        return None, None, None, None, None, None
    return a.value, a.k_buffer, a.v_buffer, a.cache_loc, a.k_scale, a.v_scale


def new_plan(
    call: RopeCall,
    tensors: Sequence[Any],
    written: frozenset[int],
    enable_pdl: bool | None,
    norm: QKNormCall | None = None,
    backend: str | None = None,
) -> RopeKVPlan:
    """The plan of a checked call (tensors: its tensors in pointer order; written: the indexes
    of those the op writes): a ValueError naming both where a written one may share memory with
    another, else the guard of that decision; the backend (`backend`, or `select_backend`'s);
    for Triton with tokens to write, the kernel launch."""
    alias = rope_kv_guard(tensors, written)
    backend = backend or select_backend(call.device)
    launcher = None
    if backend == "triton" and call.num_tokens > 0:
        query, key, k_buffer = tensors[2], tensors[3], tensors[5]
        launcher = rope_kv_launcher(call, query, key, k_buffer, enable_pdl, norm)
    return RopeKVPlan(call, backend, settings.get().debug, launcher, norm, alias)


def run(plan: RopeKVPlan, tensors: Sequence[Any]) -> None:
    """Launch a plan the slow way (tensors in pointer order): SGL_EXT_DEBUG's checks, then the
    torch path, or Triton through its JIT."""
    call = plan.call
    if plan.debug:
        debug_checks(call, tensors)
    if call.num_tokens == 0:
        return
    if plan.backend == "native":
        run_native(plan, tensors)
        return
    launcher = plan.launcher
    assert launcher is not None
    launcher.launch(*stand_in(tensors, tensors[3]))  # key for the pointers the call lacks


def run_native(plan: RopeKVPlan, tensors: Sequence[Any]) -> None:
    """The torch path of a checked call (tensors in pointer order): the q/k norm (Qwen3's
    rounding) with one, the rotation with a query, the KV write with one; the same bits as the
    unfused model path (torch q/k norm, RoPE, set_kv_buffer) on the CPU."""
    call, norm = plan.call, plan.norm
    positions, cos_sin_cache, query, key = tensors[:4]
    d = call.head_size
    if norm is not None:
        rms_norm_heads_native(query, d, tensors[10], norm.eps)
        rms_norm_heads_native(key, d, tensors[11], norm.eps)
    if call.query is not None:
        rotate_native(positions, query, d, cos_sin_cache, call.is_neox)
        rotate_native(positions, key, d, cos_sin_cache, call.is_neox)
    if call.kv is not None:
        value, k_buffer, v_buffer, cache_loc, k_scale, v_scale = tensors[4:10]
        k_lay, v_lay = call.kv.k_layout, call.kv.v_layout
        kv_write_native(key, value, k_buffer, v_buffer, cache_loc, k_scale, v_scale, k_lay, v_lay)


def debug_checks(call: RopeCall, tensors: Sequence[Any]) -> None:
    """SGL_EXT_DEBUG's synchronising checks: positions inside the table (with a rotation); with
    a KV write, slots in range and unique, scales positive and finite."""
    if call.query is not None:
        C.debug_check_positions(tensors[0], call.max_pos)
    if call.kv is not None:
        C.debug_check_slots(tensors[7], call.kv.k_layout.num_slots)
        C.debug_check_scales(tensors[8], tensors[9])


def scale_key(scale: object, unused_ptr: int) -> tuple[object, int]:
    """A cache scale's part of a plan key, and the pointer the kernel receives for it
    (unused_ptr unless it is a tensor): None; (type, value) of a float or int; a tensor's
    dtype, shape, device and data_ptr() % 16. Raises AttributeError for anything else (a float
    subclass included: the caller runs the checks uncached)."""
    if scale is None:
        return None, unused_ptr
    cls = scale.__class__
    if cls is float or cls is int:
        return (cls, scale), unused_ptr
    t: torch.Tensor = scale  # type: ignore[assignment]  # else AttributeError: the checks say
    ptr = t.data_ptr()
    return (t.dtype, t.shape, t.device, ptr & 15), ptr


def kv_key(
    value: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    cache_loc: torch.Tensor,
    k_scale: object,
    v_scale: object,
    unused_ptr: int,
) -> tuple[tuple, tuple[int, int, int, int, int, int]]:
    """The KV-write part of a plan key (flat), and the kernel pointers (value, k_buffer,
    v_buffer, cache_loc, k_scale, v_scale; unused_ptr for a scale that is not a tensor).

    Holds value's, the buffers' and cache_loc's dtype, shape, strides, device and
    data_ptr() % 16, the buffers' requires_grad, and both scales' `scale_key`. Raises
    AttributeError / TypeError for a non-tensor (the caller then runs the checks)."""
    vp, kbp, vbp, lp = (
        value.data_ptr(),
        k_buffer.data_ptr(),
        v_buffer.data_ptr(),
        cache_loc.data_ptr(),
    )
    if k_scale is None and v_scale is None:
        ks_key = vs_key = None
        ksp = vsp = unused_ptr
    else:
        ks_key, ksp = scale_key(k_scale, unused_ptr)
        vs_key, vsp = scale_key(v_scale, unused_ptr)
    key = (
        value.dtype,
        value.shape,
        value.stride(),
        value.device,
        vp & 15,
        k_buffer.dtype,
        k_buffer.shape,
        k_buffer.stride(),
        k_buffer.device,
        kbp & 15,
        k_buffer.requires_grad,
        v_buffer.dtype,
        v_buffer.shape,
        v_buffer.stride(),
        v_buffer.device,
        vbp & 15,
        v_buffer.requires_grad,
        cache_loc.dtype,
        cache_loc.shape,
        cache_loc.stride(),
        cache_loc.device,
        lp & 15,
        ks_key,
        vs_key,
    )
    return key, (vp, kbp, vbp, lp, ksp, vsp)


def kv_present(write: bool, k_scale: object, v_scale: object) -> set[str]:
    """The KV-write tensors a call passes (the C fast path's `OpSpec.leaves` takes them): none
    without a write; the scales only where they are tensors."""
    if not write:
        return set()
    names = {"value", "k_buffer", "v_buffer", "cache_loc"}
    names |= {
        n for n, s in (("k_scale", k_scale), ("v_scale", v_scale)) if isinstance(s, torch.Tensor)
    }
    return names


def rope_kv_launcher(
    call: RopeCall,
    query: torch.Tensor | None,
    key: torch.Tensor,
    k_buffer: torch.Tensor | None,
    enable_pdl: bool | None,
    norm: QKNormCall | None = None,
) -> KernelLauncher:
    """The Triton launch plan of a checked call of the rope_kv kernel (RoPE op, q/k-norm op or
    set_kv_buffer): query / k_buffer None stand for key (no query; no KV write)."""
    from sgl_ext.triton.rope_kv_plan import plan_rope_kv

    k_align = key.data_ptr() % 16
    q_align = query.data_ptr() % 16 if query is not None else k_align
    kb_align = k_buffer.data_ptr() % 16 if k_buffer is not None else k_align
    return plan_rope_kv(call, q_align, k_align, kb_align, enable_pdl, norm)


def scale_tensor(scale: Scale, like: torch.Tensor) -> torch.Tensor | None:
    """A float scale as a 0-d fp32 tensor on like's device (the registered ops take tensors)."""
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.full((), float(scale), dtype=torch.float32, device=like.device)
