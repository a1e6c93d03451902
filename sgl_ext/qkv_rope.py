"""qkv_proj_with_rope_kv: a packed qkv projection, RoPE on its q and k, and the KV-cache write.

The composition of two existing ops: `out = x W^T (+ b)` (`linear_small_m`'s skinny GEMM with the
caller's configuration), then `apply_rope_with_cos_sin_cache_inplace` on out's q and k columns
with the fused KV write. At decode sizes both are a launch on the critical path of a layer; on
CUDA, when the GEMM runs its broadcast path (dot=False, no split-K) and whole heads are rotated,
one Triton kernel does both (`triton/gemm_rope_kv.py`): the GEMM's epilogue rotates and stores.
It gives the two ops' bits: the same GEMM sums, rounded, then the rope_kv kernel's rotation.
Any other call runs the two ops (the torch-native reference composes their references).

Checked once per distinct metadata (plan cache, as the RoPE op); the kernel then launches
directly. Under torch.compile, and with autograd, the two ops.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from sgl_ext import _common as C
from sgl_ext._alias import AliasGuard, rope_kv_guard
from sgl_ext._backend import select_backend
from sgl_ext._common import check_rope
from sgl_ext._reference import native_reference
from sgl_ext.fused_arg import FusedSetKVBufferArg
from sgl_ext.gemm import MAX_M, GemmConfig, _check, linear_small_m
from sgl_ext.plan_cache import KEY_ERRORS, PlanCache, optional_key, tensor_key
from sgl_ext.rope import apply_rope_native, apply_rope_with_cos_sin_cache_inplace, call_key
from sgl_ext.rope_kv_schema import POINTER_TENSORS

if TYPE_CHECKING:
    from sgl_ext.triton.gemm_rope_kv import GemmRopeKVLaunch

_is_compiling = torch.compiler.is_compiling


@dataclass(frozen=True)
class QKVRopePlan:
    """A checked call: the q / k / v column sizes and, when one kernel serves it, its launch;
    the guard of its aliasing decision (`_alias`; pointers in `_pointers`' order)."""

    q_size: int
    kv_size: int
    launch: GemmRopeKVLaunch | None
    alias: AliasGuard | None = None


# out (with its q, k, v columns) and the KV buffers are written; their indexes in the
# pointer order of `_pointers` (the rope_kv kernel's, then x, weight, bias, out).
_WRITTEN = frozenset(POINTER_TENSORS.index(n) for n in ("k_buffer", "v_buffer"))


def _alias_check(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    arg: FusedSetKVBufferArg | None,
    out: torch.Tensor,
) -> AliasGuard:
    """ValueError naming both when out or a KV buffer may share memory with another argument
    (value is out's v columns by contract: it is not listed); the guard of that decision."""
    kv: tuple = (None,) * 5
    if arg is not None:
        kv = (arg.k_buffer, arg.v_buffer, arg.cache_loc, arg.k_scale, arg.v_scale)
    extra = (("x", 10, False, x), ("weight", 11, False, weight), ("bias", 12, False, bias))
    tensors = (positions, cos_sin_cache, None, None, None, *kv)
    return rope_kv_guard(tensors, _WRITTEN, (*extra, ("out", 13, True, out)))


def _pointers(
    rope_ptrs: tuple[int, ...],
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> tuple[int, ...]:
    """A call's pointers for its aliasing guard: rope.call_key's, then x, weight, bias, out."""
    b = 0 if bias is None else bias.data_ptr()
    return (*rope_ptrs, x.data_ptr(), weight.data_ptr(), b, out.data_ptr())


_PLANS = PlanCache()


def _views(out: torch.Tensor, q_size: int, kv_size: int) -> tuple[torch.Tensor, ...]:
    # q [M, Hq*D], k [M, Hkv*D], v [M, Hkv*D]: column blocks of out [M, N]
    return out.split_with_sizes((q_size, kv_size, kv_size), -1)


def _check_call(*args: Any) -> QKVRopePlan:
    """Every check of a call (args: the op's, in its order; metadata only), and the launch
    when the fused kernel serves it."""
    x, weight, bias, positions, cos_sin_cache, head_size, num_kv_heads = args[:7]
    out, is_neox, arg, config = args[7:]
    m, n, k = _check(x, weight, bias)
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a GemmConfig or None, got {type(config).__name__}")
    if not isinstance(head_size, int) or isinstance(head_size, bool) or head_size <= 0:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    if not isinstance(num_kv_heads, int) or isinstance(num_kv_heads, bool) or num_kv_heads <= 0:
        raise ValueError(f"num_kv_heads must be a positive int, got {num_kv_heads!r}")
    kv_size = num_kv_heads * head_size
    q_size = n - 2 * kv_size
    if q_size <= 0 or q_size % head_size:
        raise ValueError(
            f"weight has {n} rows: expected (num_q_heads + 2 * {num_kv_heads}) * {head_size}"
        )
    C.check_tensor("out", out, (x.dtype,))
    C.check_device("out", out, x.device)
    if tuple(out.shape) != (m, n) or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be [{m}, {n}] with contiguous rows, got {tuple(out.shape)}")
    C.check_writable("out", out)
    q, kk, v = _views(out, q_size, kv_size)
    if arg is not None and isinstance(arg, FusedSetKVBufferArg):
        a = arg.value
        same = a.data_ptr() == v.data_ptr() and a.numel() == v.numel() and a.shape[0] == m
        rows = a.dim() in (2, 3) and (m == 1 or a.stride(0) == v.stride(0))
        heads = a.stride(-1) == 1 and (a.dim() == 2 or a.stride(1) == a.shape[2])
        if not (same and rows and heads):
            raise ValueError("fused_set_kv_buffer_arg.value must be out's v columns (a view)")
    call = check_rope(positions, q, kk, head_size, cos_sin_cache, is_neox, arg)
    alias = _alias_check(x, weight, bias, positions, cos_sin_cache, arg, out)
    launch = None
    fused = (
        isinstance(config, GemmConfig)
        and select_backend(x.device) == "triton"
        and 1 <= m <= MAX_M
        and out.stride(0) == n
    )
    if fused:
        from sgl_ext.triton.gemm_rope_kv import fold_supported, plan_gemm_rope_kv

        assert config is not None
        if fold_supported(call, n, config):
            stride_xm = x.reshape(m, k).stride(0)
            has_bias = bias is not None
            launch = plan_gemm_rope_kv(call, k, stride_xm, weight.stride(0), has_bias, config)
    return QKVRopePlan(q_size, kv_size, launch, alias)


def qkv_proj_with_rope_kv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    num_kv_heads: int,
    out: torch.Tensor,
    is_neox: bool = True,
    fused_set_kv_buffer_arg: FusedSetKVBufferArg | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """out = x weight^T (+ bias) with RoPE applied to its q and k heads, and (with the
    argument) the rotated K and the V stored into the KV cache.

    Parameters
    ----------
    x : [M, K] bf16/fp16/fp32 (leading dims viewable as [M, K]), last dim contiguous.
    weight : [N, K] of x's dtype, last dim contiguous: the packed q, k, v projection, N =
        (Hq + 2 Hkv) * D.
    bias : optional [N] of x's dtype, contiguous.
    positions : int32/int64 [M], contiguous.
    cos_sin_cache : float32 [max_pos, rotary_dim] (apply_rope_with_cos_sin_cache_inplace's).
    head_size : D.
    num_kv_heads : Hkv (the query heads are the rest).
    out : [M, N] of x's dtype, rows contiguous: written. q = out[:, :Hq*D], k and v the next
        Hkv*D columns each.
    is_neox : neox (rotate halves) or GPT-J (interleaved pairs) RoPE.
    fused_set_kv_buffer_arg : FusedSetKVBufferArg or None; its value must be out's v columns.
        The rotated K and the V are stored at its cache_loc (apply_rope's semantics).
    config : the skinny GEMM's launch configuration (`linear_small_m`); None: F.linear.

    Returns
    -------
    out. Bit for bit what `linear_small_m(x, weight, bias, config)` followed by
    `apply_rope_with_cos_sin_cache_inplace` gives (one kernel where it can, see the module).
    """
    a = fused_set_kv_buffer_arg
    if _is_compiling() or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        args = (x, weight, bias, positions, cos_sin_cache, head_size, num_kv_heads, out, is_neox)
        return _two_ops(*args, a, config)
    key: tuple | None = None
    ptrs: tuple[int, ...] = ()
    plan: QKVRopePlan | None = None
    try:
        q, k, _ = _views(out, *_split_sizes(weight, head_size, num_kv_heads))
        rk, ptrs = call_key(positions, q, k, head_size, cos_sin_cache, is_neox, a, None)
        key = (
            rk,
            tensor_key(x),
            tensor_key(weight),
            optional_key(bias),
            tensor_key(out),
            num_kv_heads,
            config,
        )
        plan = _PLANS.get(key)
        if plan is not None and plan.alias is not None:
            if not plan.alias.holds(_pointers(ptrs, x, weight, bias, out)):  # checked again
                alias = _alias_check(x, weight, bias, positions, cos_sin_cache, a, out)
                plan = _PLANS.put(key, dataclasses.replace(plan, alias=alias))
    except KEY_ERRORS:  # the checks will say
        key = None
    if plan is None or plan.launch is None:
        args = (x, weight, bias, positions, cos_sin_cache, head_size, num_kv_heads, out, is_neox)
        if plan is None:
            plan = _PLANS.put(key, _check_call(*args, a, config))
        if plan.launch is None:
            return _two_ops(*args, a, config)
    b = bias if bias is not None else weight  # never read without a bias
    main = plan.launch.launcher
    if ptrs and main.compiled is not None:  # a cached plan: the compiled kernel, directly
        pp, cp, _, _, _, kbp, vbp, lp, ksp, vsp = ptrs
        main.direct(
            x.data_ptr(),
            weight.data_ptr(),
            b.data_ptr(),
            out.data_ptr(),
            pp,
            cp,
            kbp,
            vbp,
            lp,
            ksp,
            vsp,
        )
        return out
    kv: tuple = (out,) * 5  # stand-ins (never read) without a KV write
    if a is not None:
        ks = a.k_scale if isinstance(a.k_scale, torch.Tensor) else out
        vs = a.v_scale if isinstance(a.v_scale, torch.Tensor) else out
        kv = (a.k_buffer, a.v_buffer, a.cache_loc, ks, vs)
    main.launch(x, weight, b, out, positions, cos_sin_cache, *kv)  # through the JIT
    return out


def _split_sizes(weight: torch.Tensor, head_size: int, num_kv_heads: int) -> tuple[int, int]:
    kv_size = num_kv_heads * head_size
    return weight.shape[0] - 2 * kv_size, kv_size


def _two_ops(*args: Any) -> torch.Tensor:
    """The composition the fused kernel stands for (args: the op's, in its order)."""
    x, weight, bias, positions, cos_sin_cache, head_size, num_kv_heads, out, is_neox, a = args[:10]
    config = args[10]
    y = F.linear(x, weight, bias) if config is None else linear_small_m(x, weight, bias, config)
    out.copy_(y.reshape(out.shape))
    q, k, _ = _views(out, *_split_sizes(weight, head_size, num_kv_heads))
    apply_rope_with_cos_sin_cache_inplace(positions, q, k, head_size, cos_sin_cache, is_neox, a)
    return out


def _reference(*args: Any) -> torch.Tensor:
    """F.linear into out, then apply_rope_native on its q and k."""
    plan = _check_call(*args, None)
    x, weight, bias, positions, cos_sin_cache, head_size, _, out, is_neox, a = args
    out.copy_(F.linear(x, weight, bias).reshape(out.shape))
    q, k, _ = _views(out, plan.q_size, plan.kv_size)
    apply_rope_native(positions, q, k, head_size, cos_sin_cache, is_neox, a)
    return out


qkv_proj_with_rope_kv_native = native_reference(qkv_proj_with_rope_kv, _reference, ("config",))
