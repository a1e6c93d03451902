"""Launch plans cached per call metadata: the shared piece of every op's eager fast path.

An op checks a call once per distinct metadata and keeps what it decided (backend, Triton
`KernelLauncher`) in a frozen plan under a key that holds everything the checks and the launch
configuration read: each tensor's dtype, shape, strides, device and data_ptr() % 16 (and
requires_grad where the op writes it), and the scalars with their types. A changed input
therefore misses and is checked again; a hit skips the checks and launches the plan's compiled
kernel directly (`triton/launcher.py`).

Keys are flat tuples in a fixed order per op (no nested tuples to build, hash and compare), read
from each tensor once. The pieces the RoPE op, the q/k-norm op and set_kv_buffer share live
here: the KV-write part of a key (`kv_key`), a cache scale's part (`scale_key`), the Triton plan
of a checked call (`rope_kv_launcher`) and a float scale as the registered ops take it
(`scale_tensor`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from sgl_ext import settings

if TYPE_CHECKING:
    from sgl_ext._common import QKNormCall, RopeCall, Scale
    from sgl_ext.triton.launcher import KernelLauncher

MAX_PLANS = 4096  # a cache past this size is dropped (e.g. a float scale that changes per call)
# What building a plan key raises for an argument the checks reject (the op then runs them,
# and they name it): not a tensor, unhashable, or a tensor without a data pointer (sparse).
KEY_ERRORS = (AttributeError, TypeError, RuntimeError)


class PlanCache(dict):
    """key -> plan of one op; emptied when the settings change (plans hold the backend and
    launch configuration chosen under them) and when it grows past MAX_PLANS."""

    def __init__(self) -> None:
        super().__init__()
        settings.on_change(self.clear)

    def put(self, key: object, plan: Any) -> Any:
        """Store plan under key (None: an uncacheable call, not stored); returns plan."""
        if key is not None:
            if len(self) >= MAX_PLANS:
                self.clear()
            self[key] = plan
        return plan


def tensor_key(t: torch.Tensor) -> tuple:
    """A tensor's part of a plan key: (dtype, shape, strides, device, data_ptr() % 16).

    Raises AttributeError / TypeError for a non-tensor (the caller then runs the checks, which
    name the bad argument)."""
    return (t.dtype, t.shape, t.stride(), t.device, t.data_ptr() & 15)


def optional_key(t: torch.Tensor | None) -> tuple | None:
    """tensor_key of an optional tensor argument (None stays None)."""
    return None if t is None else (t.dtype, t.shape, t.stride(), t.device, t.data_ptr() & 15)


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


def kv_ptr_leaves(first: int, unused: int, write: bool, k_scale: object, v_scale: object) -> tuple:
    """Where the C fast path (`fast_launch.py`) finds the KV-write pointers of a call: the leaf
    indexes of (value, k_buffer, v_buffer, cache_loc, k_scale, v_scale), which are the leaves
    first .. first + 5; `unused` (the key's leaf) for a scale that is not a tensor, and for all
    six without a write (the pointers `kv_key` gives)."""
    if not write:
        return (unused,) * 6
    ks = first + 4 if isinstance(k_scale, torch.Tensor) else unused
    vs = first + 5 if isinstance(v_scale, torch.Tensor) else unused
    return (first, first + 1, first + 2, first + 3, ks, vs)


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
