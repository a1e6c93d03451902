"""apply_qk_norm_rope_with_cos_sin_cache_inplace: q/k RMSNorm + RoPE (+ KV-cache write), one kernel.

Qwen3-style attention normalises every query and key head (RMSNorm over the head, float32, a
weight of [head_size]) before RoPE. This op does the norm, the rotation and, with a
`FusedSetKVBufferArg`, the KV-cache write of `apply_rope_with_cos_sin_cache_inplace` in one
launch of the same Triton kernel (its QK_NORM variant): the norm rides on the bytes the RoPE +
KV op already moves. The cache write has exactly the semantics of that op (DESIGN §2.1).

Eager cost: as the RoPE op (`rope.py`), a call is checked once per distinct metadata; the plan
key is the RoPE op's key plus both weights' metadata (dtype, shape, stride, device, data_ptr()
% 16) and eps, and the plan's Triton kernel is launched directly after its first launch.
The q/k bits do not depend on whether the KV write is on: the kernel sums a head's squares in
float32 in the order of a launch layout that the write does not change
(`rope_kv_plan.qk_norm_launch_config`), or in float64 (`QK_NORM_SUM_FP64`; exact for 16-bit
inputs, whatever the layout).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from sgl_ext import _common as C
from sgl_ext._alias import rope_kv_guard
from sgl_ext._common import QKNormCall, RopeCall
from sgl_ext._plans import RopeKVPlan, kv_present, kv_tensors, new_plan, run, run_native
from sgl_ext._reference import native_reference
from sgl_ext.fast_launch import OpTable
from sgl_ext.fused_arg import FusedSetKVBufferArg
from sgl_ext.plan_cache import KEY_ERRORS, PlanCache
from sgl_ext.rope import ROPE_WRITTEN, call_key, op_kv_args
from sgl_ext.rope_kv_schema import QK_NORM_OP

_is_compiling = torch.compiler.is_compiling
_PLANS = PlanCache()
# The C fast path's table: leaves and written ones from QK_NORM_OP's declaration.
_FAST = OpTable(expand=QK_NORM_OP.expand(), grad=QK_NORM_OP.grad(), written=QK_NORM_OP.grad())
_NORM_TENSORS = {"positions", "query", "key", "cos_sin_cache", "q_norm_weight", "k_norm_weight"}


def _check_norm(
    query: torch.Tensor, head_size: int, q_norm_weight: object, k_norm_weight: object, eps: object
) -> float:
    """Metadata-only checks of the norm arguments (after the RoPE checks: head_size is valid);
    returns eps as a float."""
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        C.check_tensor(name, w, C.INPUT_DTYPES)
        assert isinstance(w, torch.Tensor)
        if w.dtype != query.dtype:
            raise TypeError(f"{name} dtype {w.dtype} must equal query dtype {query.dtype}")
        C.check_device(name, w, query.device)
        if tuple(w.shape) != (head_size,):
            raise ValueError(
                f"{name} must have shape [head_size] = [{head_size}], got {tuple(w.shape)}"
            )
        if w.stride(0) != 1 and head_size > 1:
            raise ValueError(f"{name} must be contiguous (stride {w.stride(0)})")
    return C.check_eps("eps", eps)


def check(
    positions: object,
    query: object,
    key: object,
    head_size: object,
    cos_sin_cache: object,
    q_norm_weight: object,
    k_norm_weight: object,
    eps: object,
    is_neox: object,
    fused_set_kv_buffer_arg: object = None,
) -> tuple[RopeCall, float]:
    """All argument checks of the op (metadata only), RoPE first, then the norm, then the KV
    write: the checked call and eps, or a ValueError / TypeError naming the bad argument."""
    call = C.check_rope(positions, query, key, head_size, cos_sin_cache, is_neox)
    assert isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
    eps_f = _check_norm(query, call.head_size, q_norm_weight, k_norm_weight, eps)
    if fused_set_kv_buffer_arg is not None:
        kv = C.check_fused_arg(key, fused_set_kv_buffer_arg, call.head_size)
        call = dataclasses.replace(call, kv=kv)
    return call, eps_f


def _new_plan(args: tuple, enable_pdl: bool | None, backend: str | None = None) -> RopeKVPlan:
    """The plan of a call (args: the op's, enable_pdl aside), after every check."""
    call, eps = check(*args)
    positions, query, key, _, cos_sin_cache, qw, kw, _, _, a = args
    norm = QKNormCall(eps, qw.data_ptr() % 16, kw.data_ptr() % 16)
    tensors = (positions, cos_sin_cache, query, key, *kv_tensors(a), qw, kw)
    return new_plan(call, tensors, ROPE_WRITTEN, enable_pdl, norm, backend)


def apply_qk_norm_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    is_neox: bool = True,
    fused_set_kv_buffer_arg: FusedSetKVBufferArg | None = None,
    enable_pdl: bool | None = None,
) -> None:
    """RMSNorm every query and key head, rotate them in place; optionally store K and V.

    Parameters
    ----------
    positions : int32/int64 [T]
        Position of each token (row of cos_sin_cache).
    query : bf16/fp16/fp32 [T, Hq*D] or [T, Hq, D]
        Normalised and rotated in place; may be a strided view (e.g. of a fused qkv output),
        last dim contiguous.
    key : same dtype as query, [T, Hkv*D] or [T, Hkv, D]
        Normalised and rotated in place.
    head_size : int
        D.
    cos_sin_cache : float32 [max_pos, rotary_dim]
        cos in the first rotary_dim/2 columns, sin in the rest; rotary_dim even and <= D.
    q_norm_weight, k_norm_weight : [D], the dtype of query, contiguous
        RMSNorm weights of the query and key heads. The norm runs over the whole head (also
        the dims past rotary_dim): y = weight * (x / sqrt(mean(x^2) + eps)) with x in float32,
        the normalised value rounded to the input dtype before the weight multiply (Qwen3).
    eps : float
        Variance epsilon: positive, finite and normal in float32 (the norm adds it in float32).
    is_neox : bool
        True rotates the two halves of the rotary dims; False rotates interleaved (GPT-J) pairs.
    fused_set_kv_buffer_arg : FusedSetKVBufferArg or None
        If given, the normalised, rotated K and the V are also written to the cache slots
        `cache_loc`, with the semantics of apply_rope_with_cos_sin_cache_inplace. The q/k
        results are the same bits with and without it.
    enable_pdl : bool or None
        Programmatic dependent launch on Hopper+; None: on where supported.

    Raises
    ------
    TypeError, ValueError
        As apply_rope_with_cos_sin_cache_inplace: a bad argument, named, before anything is
        written; a ValueError naming both where two written arguments (query, key, k_buffer,
        v_buffer) or one and another argument may share memory.
    """
    a = fused_set_kv_buffer_arg
    qw, kw = q_norm_weight, k_norm_weight
    fast_args = (positions, query, key, head_size, cos_sin_cache, qw, kw, eps, is_neox)
    if _is_compiling():  # check while tracing, then one opaque mutating op
        _, eps_f = check(*fast_args, a)
        torch.ops.sgl_ext.qk_norm_rope_kv(*fast_args[:7], eps_f, is_neox, *op_kv_args(a))
        return
    fast = _FAST.launch(*fast_args, enable_pdl, a)
    if fast == 1:
        return
    plan_key: tuple | None
    plan: RopeKVPlan | None
    try:
        rope_key, ptrs = call_key(
            positions, query, key, head_size, cos_sin_cache, is_neox, a, enable_pdl
        )
        qwp, kwp = qw.data_ptr(), kw.data_ptr()
        ptrs = (*ptrs, qwp, kwp)
        plan_key = (
            rope_key,
            qw.dtype,
            qw.shape,
            qw.stride(),
            qw.device,
            qwp & 15,
            kw.dtype,
            kw.shape,
            kw.stride(),
            kw.device,
            kwp & 15,
            eps.__class__,
            eps,
        )
        plan = _PLANS.get(plan_key)
    except KEY_ERRORS:  # not a (dense) tensor, unhashable: the checks will say
        plan_key = plan = None
    if plan is None:
        plan = _PLANS.put(plan_key, _new_plan((*fast_args, a), enable_pdl))
    elif plan.alias is not None and not plan.alias.holds(ptrs):  # checked again
        tensors = (positions, cos_sin_cache, query, key, *kv_tensors(a), qw, kw)
        alias = rope_kv_guard(tensors, ROPE_WRITTEN)
        plan = _PLANS.put(plan_key, dataclasses.replace(plan, alias=alias))
    launcher = plan.launcher
    if launcher is not None and launcher.compiled is not None and not plan.debug:
        launcher.run_ptrs(ptrs)
        if fast == 0:  # this metadata has no C plan yet: the next call launches from C
            ks, vs = (a.k_scale, a.v_scale) if a is not None else (None, None)
            leaves = QK_NORM_OP.leaves(_NORM_TENSORS | kv_present(a is not None, ks, vs))
            _FAST.register(launcher, leaves, *fast_args, enable_pdl, a)
        return
    run(plan, (positions, cos_sin_cache, query, key, *kv_tensors(a), qw, kw))


def _reference(*args: Any) -> None:
    """Torch RMSNorm as Qwen3 does it, then the RoPE op's reference."""
    positions, query, key, _, cos_sin_cache, qw, kw, _, _, a = args
    tensors = (positions, cos_sin_cache, query, key, *kv_tensors(a), qw, kw)
    run_native(_new_plan(args, None, backend="native"), tensors)


apply_qk_norm_rope_native = native_reference(
    apply_qk_norm_rope_with_cos_sin_cache_inplace, _reference
)
