"""RMSNorm and fused residual-add + RMSNorm, source-compatible with sgl_kernel's `rmsnorm` and
`fused_add_rmsnorm`.

One Triton launch per call on CUDA (one pass over each row); the torch-native functions below are
the CPU path and the test oracle. Both round in the same order (SGLang / HF):

    s   = round(x + residual)                       # in x's dtype (fused_add_rmsnorm only)
    xn  = float32(s) * rsqrt(mean(float32(s)^2) + eps)
    out = weight * round(xn)                        # default (Llama, Qwen)
    out = round(float32(weight) * xn)               # weight_in_fp32=True (gpt-oss)

so the kernel and the reference differ only by the float32 reduction order and rsqrt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl_ext import _common as C
from sgl_ext._backend import select_backend
from sgl_ext.fast_launch import OpTable
from sgl_ext.plan_cache import KEY_ERRORS, PlanCache, optional_key, tensor_key

if TYPE_CHECKING:
    from sgl_ext.triton.launcher import KernelLauncher

_is_compiling = torch.compiler.is_compiling

MAX_HIDDEN = 65536  # the Triton kernel keeps one row in one program's registers


def rmsnorm_native(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = False
) -> torch.Tensor:
    """Reference RMSNorm of x [..., N] with weight [N]; returns a new tensor of x's dtype
    (of the promoted dtype if weight's differs and weight_in_fp32 is False, as torch does)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        return (weight.float() * xf).to(dtype)
    return weight * xf.to(dtype)


def fused_add_rmsnorm_native(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: (rmsnorm(x + residual), x + residual), both new tensors."""
    s = x + residual
    return rmsnorm_native(s, weight, eps, weight_in_fp32), s


def moe_sum_add_rmsnorm_native(
    pairs: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    top_k: int,
    weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: s = round(sum over j of pairs[t * top_k + j]) + residual (the sum in float32,
    j in order: moe_sum's bits); returns (rmsnorm(s), s), new tensors."""
    p = pairs.view(-1, top_k, pairs.shape[-1])  # [T, k, N]
    acc = p[:, 0].float()
    for j in range(1, top_k):
        acc = acc + p[:, j].float()
    return fused_add_rmsnorm_native(acc.to(pairs.dtype), residual, weight, eps, weight_in_fp32)


def _check(
    input: object,
    weight: object,
    eps: object,
    weight_in_fp32: bool,
    residual: object = None,
    name: str = "input",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate (metadata only) and return [rows, N] views of input (called `name` in errors)
    and residual; no copies."""
    C.check_tensor(name, input, C.INPUT_DTYPES)
    C.check_tensor("weight", weight, C.INPUT_DTYPES)
    assert isinstance(input, torch.Tensor) and isinstance(weight, torch.Tensor)
    C.check_eps("eps", eps, allow_zero=True)
    n = input.shape[-1] if input.ndim else 0
    if n == 0 or n > MAX_HIDDEN:
        raise ValueError(f"{name} must be [..., hidden], 0 < hidden <= {MAX_HIDDEN}, got {n}")
    if weight.shape != (n,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be contiguous [{n}] ({name}'s last dim)")
    if not weight_in_fp32 and weight.dtype != input.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must equal {name} dtype {input.dtype}")
    C.check_device("weight", weight, input.device)
    x2 = _rows(name, input)
    if residual is None:
        return x2, None
    C.check_tensor("residual", residual)
    assert isinstance(residual, torch.Tensor)
    if residual.shape != input.shape or residual.dtype != input.dtype:
        raise ValueError(
            f"residual must match input ({tuple(input.shape)}, {input.dtype}), got "
            f"({tuple(residual.shape)}, {residual.dtype})"
        )
    C.check_device("residual", residual, input.device)
    return x2, _rows("residual", residual)


def _dest(name: str, t: object, like: torch.Tensor) -> torch.Tensor:
    """[rows, N] view of a caller-given output with like's shape, dtype and device."""
    C.check_tensor(name, t, (like.dtype,))
    assert isinstance(t, torch.Tensor)
    if t.shape != like.shape:
        raise ValueError(f"{name} must have input's shape {tuple(like.shape)}")
    C.check_device(name, t, like.device)
    return _rows(name, t)


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """[rows, N] view of t (last dim contiguous, leading dims one stride); never a copy."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dim")
    try:
        return t.view(-1, t.shape[-1])  # [rows, N]
    except RuntimeError:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} and strides {t.stride()} cannot be seen as "
            "[rows, hidden] without a copy"
        ) from None


def _new(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


@dataclass(frozen=True)
class NormPlan:
    """A checked rmsnorm / fused_add_rmsnorm call: its backend and (Triton, rows > 0) its
    kernel launch, whose per-call tensors are x, residual, weight, out, residual_out."""

    backend: str
    launcher: KernelLauncher | None


_PLANS = PlanCache()
# The C fast path of fused_add_rmsnorm in place (the decoder layers' call): arguments input,
# residual, weight, eps, weight_in_fp32, inplace, out, residual_out (leaves 0-7); the kernel
# reads and writes input and residual.
_FAST_ADD = OpTable()


def _plan(
    input: object,
    weight: object,
    eps: object,
    weight_in_fp32: bool,
    residual: object = None,
    out: object = None,
    residual_out: object = None,
    inplace: bool = False,
) -> NormPlan:
    """Check a call (metadata only) and choose its backend and launch."""
    x2, r2 = _check(input, weight, eps, weight_in_fp32, residual)
    assert isinstance(input, torch.Tensor)
    if inplace and (out is not None or residual_out is not None):
        raise ValueError("out / residual_out need inplace=False")
    if inplace:
        out, residual_out = input, residual
    o2 = None if out is None else _dest("out", out, input)
    ro2 = None if r2 is None or residual_out is None else _dest("residual_out", residual_out, input)
    backend = select_backend(input.device)
    if backend != "triton":
        return NormPlan(backend, None)
    from sgl_ext.triton.norm import plan_rmsnorm

    n = x2.shape[1]
    o_st = n if o2 is None else o2.stride(0)  # a new output is contiguous
    if r2 is None:
        strides = (x2.stride(0), x2.stride(0), o_st, o_st)
    else:
        strides = (x2.stride(0), r2.stride(0), o_st, n if ro2 is None else ro2.stride(0))
    assert isinstance(eps, (int, float))
    launcher = plan_rmsnorm(
        x2.shape[0], n, strides, eps, r2 is not None, weight_in_fp32, input.device
    )
    return NormPlan(backend, launcher)


def _launch(
    plan: NormPlan,
    x: torch.Tensor,
    r: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None,
    r_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a Triton plan: new outputs where None; direct launch once compiled (a new output
    from the caching allocator is 16-byte aligned, as the compiled kernel may assume)."""
    new_o, new_r = out is None, r_out is None
    if out is None:
        out = _new(x)
    if r_out is None:
        r_out = _new(x) if r is not x else out
    lau = plan.launcher
    if lau is None:  # no rows
        return out, r_out
    if _is_compiling():
        lau.launch_jit(x, r, w, out, r_out)
        return out, r_out
    op, rop = out.data_ptr(), r_out.data_ptr()
    if lau.compiled is not None and not ((new_o and op & 15) or (new_r and rop & 15)):
        lau.direct(x.data_ptr(), r.data_ptr(), w.data_ptr(), op, rop)
    else:
        lau.launch(x, r, w, out, r_out)
    return out, r_out


def rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
    *,
    weight_in_fp32: bool = False,
) -> torch.Tensor:
    """out = RMSNorm(input) * weight (sgl_kernel's `rmsnorm`).

    Checked once per distinct metadata (input, weight, out, eps, weight_in_fp32); the Triton
    kernel of a plan is then launched directly (`_plans.py`).

    Parameters
    ----------
    input : [..., N] bf16/fp16/fp32, last dim contiguous (leading dims may be one strided dim).
    weight : [N], contiguous, the dtype of input (any float dtype with weight_in_fp32).
    eps : variance epsilon: 0, or positive, finite and normal in float32.
    out : optional [..., N] output of input's dtype (may be input itself); new tensor if None.
    enable_pdl : accepted for sgl_kernel compatibility; no effect.
    weight_in_fp32 : apply the weight in float32 before the one rounding (gpt-oss order).

    Returns
    -------
    out : [..., N], input's dtype.
    """
    key: tuple | None = None
    plan = None
    if not _is_compiling():
        try:
            key = (tensor_key(input), tensor_key(weight), optional_key(out))
            key = (key, eps.__class__, eps, bool(weight_in_fp32))
            plan = _PLANS.get(key)
        except KEY_ERRORS:  # not a (dense) tensor, unhashable: the checks will say
            key = None
    if plan is None:
        plan = _PLANS.put(key, _plan(input, weight, eps, weight_in_fp32, out=out))
    if plan.backend == "triton":
        return _launch(plan, input, input, weight, out, out)[0]
    y = rmsnorm_native(input, weight, eps, weight_in_fp32)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
    *,
    weight_in_fp32: bool = False,
    inplace: bool = True,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual = input + residual; input = RMSNorm(residual) * weight, in one pass
    (sgl_kernel's `fused_add_rmsnorm`: in place by default).

    Checked once per distinct metadata, then launched directly, as `rmsnorm`.

    Parameters
    ----------
    input : [..., N] bf16/fp16/fp32, last dim contiguous (leading dims one strided dim).
    residual : [..., N], input's dtype and layout rules.
    weight : [N], as for `rmsnorm`. eps : variance epsilon.
    enable_pdl : accepted for sgl_kernel compatibility; no effect.
    weight_in_fp32 : gpt-oss rounding order (see `rmsnorm`).
    inplace : True (sgl_kernel): input receives the normalised output, residual the sum.
        False: input and residual stay intact and the results go to `out` / `residual_out`
        (new tensors where None).
    out, residual_out : optional [..., N] destinations of input's dtype (inplace=False only).

    Returns
    -------
    (normalised, sum) : [..., N] each, input's dtype; the tensors written.
    """
    key: tuple | None = None
    plan = None
    compiling = _is_compiling()
    fast = -1
    if inplace and not compiling:
        fast_args = (input, residual, weight, eps, weight_in_fp32, inplace, out, residual_out)
        fast = _FAST_ADD.launch(*fast_args)
        if fast == 1:
            return input, residual
    if not compiling:
        try:
            key = (tensor_key(input), tensor_key(residual), tensor_key(weight))
            key = (key, optional_key(out), optional_key(residual_out), eps.__class__, eps)
            key = (key, bool(weight_in_fp32), bool(inplace))
            plan = _PLANS.get(key)
        except KEY_ERRORS:  # not a (dense) tensor, unhashable: the checks will say
            key = None
    if plan is None:
        args = (input, weight, eps, weight_in_fp32, residual, out, residual_out, inplace)
        plan = _PLANS.put(key, _plan(*args))
    if inplace:
        out, residual_out = input, residual
    if plan.backend == "triton":
        res = _launch(plan, input, residual, weight, out, residual_out)
        lau = plan.launcher
        if fast == 0 and lau is not None and lau.compiled is not None:
            # the next in-place call with this metadata launches from C: (x, r, w, x, r)
            _FAST_ADD.register(lau, (0, 1, 2, 0, 1), *fast_args)
        return res
    y, s = fused_add_rmsnorm_native(input, residual, weight, eps, weight_in_fp32)
    if residual_out is not None:  # the sum first: residual_out may alias input
        residual_out.copy_(s)
    if out is not None:
        out.copy_(y)
    return (y if out is None else out), (s if residual_out is None else residual_out)


def _plan_moe_sum(
    pairs: object,
    residual: object,
    weight: object,
    eps: object,
    top_k: object,
    weight_in_fp32: bool,
    out: object,
) -> NormPlan:
    """Check a moe_sum_add_rmsnorm call (metadata only) and choose its backend and launch."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    p2, _ = _check(pairs, weight, eps, weight_in_fp32, name="pairs")
    C.check_tensor("residual", residual, (p2.dtype,))
    assert isinstance(residual, torch.Tensor) and isinstance(pairs, torch.Tensor)
    n = p2.shape[1]
    if residual.ndim != 2 or residual.shape[1] != n or pairs.ndim != 2:
        raise ValueError(f"pairs must be [T * top_k, {n}] and residual [T, {n}] (2-D)")
    if pairs.shape[0] != residual.shape[0] * top_k:
        raise ValueError(
            f"pairs has {pairs.shape[0]} rows; residual's {residual.shape[0]} tokens x top_k "
            f"{top_k} = {residual.shape[0] * top_k}"
        )
    C.check_device("residual", residual, pairs.device)
    r2 = _rows("residual", residual)
    o2 = None if out is None else _dest("out", out, residual)
    backend = select_backend(pairs.device)
    if backend != "triton":
        return NormPlan(backend, None)
    from sgl_ext.triton.norm import plan_rmsnorm

    strides = (p2.stride(0), r2.stride(0), n if o2 is None else o2.stride(0), r2.stride(0))
    assert isinstance(eps, (int, float))
    lau = plan_rmsnorm(
        r2.shape[0], n, strides, eps, True, weight_in_fp32, pairs.device, x_rows=top_k
    )
    return NormPlan(backend, lau)


def moe_sum_add_rmsnorm(
    pairs: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    top_k: int,
    weight_in_fp32: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE's top-k combine, the residual add and RMSNorm in one pass: residual += each
    token's top_k expert rows of pairs summed (float32 in order, rounded once, as `moe_sum`);
    out = RMSNorm(residual) * weight. Replaces moe_sum + fused_add_rmsnorm (one launch fewer,
    the same bits).

    Parameters
    ----------
    pairs : [T * top_k, N] bf16/fp16/fp32, last dim contiguous: token t's rows t*top_k ..
        t*top_k + top_k - 1 (the routed experts' weighted outputs).
    residual : [T, N], pairs' dtype, last dim contiguous; receives the sum (in place).
    weight : [N], as for `rmsnorm`. eps : variance epsilon.
    top_k : rows of pairs per token (>= 1).
    weight_in_fp32 : gpt-oss rounding order (see `rmsnorm`).
    out : optional [T, N] destination of pairs' dtype; a new tensor if None.

    Returns
    -------
    (normalised, residual) : [T, N] each, pairs' dtype; residual is the tensor passed in.
    """
    key: tuple | None = None
    plan = None
    if not _is_compiling():
        try:
            key = (tensor_key(pairs), tensor_key(residual), tensor_key(weight))
            key = (key, optional_key(out), eps.__class__, eps, bool(weight_in_fp32), top_k)
            plan = _PLANS.get(key)
        except KEY_ERRORS:  # not a (dense) tensor, unhashable: the checks will say
            key = None
    if plan is None:
        args = (pairs, residual, weight, eps, top_k, weight_in_fp32, out)
        plan = _PLANS.put(key, _plan_moe_sum(*args))
    if plan.backend == "triton":
        o = out if out is not None else _new(residual)
        return _launch(plan, pairs, residual, weight, o, residual)
    y, s = moe_sum_add_rmsnorm_native(pairs, residual, weight, eps, top_k, weight_in_fp32)
    residual.copy_(s)
    if out is None:
        return y, residual
    out.copy_(y)
    return out, residual
