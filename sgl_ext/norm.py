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

import torch

from sgl_ext import _common as C
from sgl_ext._backend import select_backend

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


def _check(
    input: object, weight: object, eps: object, residual: object = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate and return 2-D views [rows, N] of input (and residual); never copies."""
    C.check_tensor("input", input, C.INPUT_DTYPES)
    C.check_tensor("weight", weight, C.INPUT_DTYPES)
    assert isinstance(input, torch.Tensor) and isinstance(weight, torch.Tensor)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    if input.ndim < 1 or input.shape[-1] == 0:
        raise ValueError(f"input must be [..., hidden] with hidden > 0, got {tuple(input.shape)}")
    n = input.shape[-1]
    if n > MAX_HIDDEN:
        raise ValueError(f"input hidden size {n} exceeds {MAX_HIDDEN}")
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}] (input's last dim), got {tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    C.check_device("weight", weight, input.device)
    x2 = _rows("input", input)
    if residual is None:
        return x2, x2
    C.check_tensor("residual", residual)
    assert isinstance(residual, torch.Tensor)
    if residual.shape != input.shape or residual.dtype != input.dtype:
        raise ValueError(
            f"residual must match input ({tuple(input.shape)}, {input.dtype}), got "
            f"({tuple(residual.shape)}, {residual.dtype})"
        )
    C.check_device("residual", residual, input.device)
    return x2, _rows("residual", residual)


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

    Parameters
    ----------
    input : [..., N] bf16/fp16/fp32, last dim contiguous (leading dims may be one strided dim).
    weight : [N], contiguous, the dtype of input (or float32 with weight_in_fp32).
    eps : variance epsilon (>= 0).
    out : optional [..., N] output of input's dtype (may be input itself); new tensor if None.
    enable_pdl : accepted for sgl_kernel compatibility; no effect.
    weight_in_fp32 : apply the weight in float32 before the one rounding (gpt-oss order).

    Returns
    -------
    out : [..., N], input's dtype.
    """
    x2, _ = _check(input, weight, eps)
    if not weight_in_fp32 and weight.dtype != input.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must equal input dtype {input.dtype}")
    if out is None:
        out = torch.empty_like(input, memory_format=torch.contiguous_format)
    else:
        C.check_tensor("out", out, (input.dtype,))
        if out.shape != input.shape:
            raise ValueError(f"out must have input's shape {tuple(input.shape)}")
        C.check_device("out", out, input.device)
    o2 = _rows("out", out)
    if select_backend(input.device, has_cuda=False) == "native":
        o2.copy_(rmsnorm_native(x2, weight, eps, weight_in_fp32))
        return out
    from sgl_ext.triton.norm import rmsnorm_launch

    rmsnorm_launch(x2, weight, eps, o2, weight_in_fp32=weight_in_fp32)
    return out


def fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
    *,
    weight_in_fp32: bool = False,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> None:
    """residual = input + residual; input = RMSNorm(residual) * weight (sgl_kernel's
    `fused_add_rmsnorm`, in place), in one pass.

    Parameters
    ----------
    input : [..., N] bf16/fp16/fp32, last dim contiguous; receives the normalised output
        unless `out` is given.
    residual : [..., N], input's dtype; receives the sum unless `residual_out` is given.
    weight : [N], as for `rmsnorm`. eps : variance epsilon.
    enable_pdl : accepted for sgl_kernel compatibility; no effect.
    weight_in_fp32 : gpt-oss rounding order (see `rmsnorm`).
    out, residual_out : optional [..., N] destinations (out of place; the inputs stay intact).
    """
    x2, r2 = _check(input, weight, eps, residual)
    if not weight_in_fp32 and weight.dtype != input.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must equal input dtype {input.dtype}")
    dests = []
    for name, t, default in (("out", out, x2), ("residual_out", residual_out, r2)):
        if t is None:
            dests.append(default)
            continue
        C.check_tensor(name, t, (input.dtype,))
        if t.shape != input.shape:
            raise ValueError(f"{name} must have input's shape {tuple(input.shape)}")
        C.check_device(name, t, input.device)
        dests.append(_rows(name, t))
    o2, ro2 = dests
    if select_backend(input.device, has_cuda=False) == "native":
        y, s = fused_add_rmsnorm_native(x2, r2, weight, eps, weight_in_fp32)
        ro2.copy_(s)
        o2.copy_(y)
        return
    from sgl_ext.triton.norm import rmsnorm_launch

    rmsnorm_launch(x2, weight, eps, o2, r2, ro2, weight_in_fp32=weight_in_fp32)
