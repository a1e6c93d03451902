"""SiLU-and-mul, source-compatible with sgl_kernel's `silu_and_mul`: one Triton launch on CUDA.

out = silu(x[..., :d]) * x[..., d:]; the torch-native function below is the CPU path and the
test oracle and rounds in the same order (silu rounded to the input dtype, then the product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_ext import _common as C
from sgl_ext._backend import select_backend


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """Reference: x [..., 2 * d] -> silu(x[..., :d]) * x[..., d:], [..., d] (new tensor)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul(
    input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None
) -> torch.Tensor:
    """silu(gate) * up for input = [gate | up] (sgl_kernel's `silu_and_mul`).

    Parameters
    ----------
    input : [..., 2 * d] bf16/fp16/fp32, last dim contiguous, leading dims one strided dim.
    out : optional [..., d] of input's dtype, last dim contiguous; new tensor if None.
    enable_pdl : accepted for sgl_kernel compatibility; no effect.

    Returns
    -------
    out : [..., d], input's dtype.
    """
    C.check_tensor("input", input, C.INPUT_DTYPES)
    if input.ndim < 1 or input.shape[-1] % 2:
        raise ValueError(f"input must be [..., 2 * d], got shape {tuple(input.shape)}")
    d = input.shape[-1] // 2
    shape = (*input.shape[:-1], d)
    if out is not None:
        C.check_tensor("out", out, (input.dtype,))
        if tuple(out.shape) != shape:
            raise ValueError(f"out must be {shape}, got {tuple(out.shape)}")
        C.check_device("out", out, input.device)
    x2 = _rows("input", input, 2 * d)
    o2 = None if out is None else _rows("out", out, d)
    if select_backend(input.device, has_cuda=False) == "native":
        y = silu_and_mul_native(input)
        if out is None:
            return y
        o2.copy_(y.view(o2.shape))
        return out
    from sgl_ext.triton.activation import silu_and_mul_launch

    if out is None:
        out = torch.empty(shape, dtype=input.dtype, device=input.device)
        o2 = out.view(-1, d)
    silu_and_mul_launch(x2, o2)
    return out


def _rows(name: str, t: torch.Tensor, n: int) -> torch.Tensor:
    """[rows, n] view of t; a ValueError naming t if that needs a copy."""
    if t.stride(-1) != 1 and n > 1:
        raise ValueError(f"{name} must be contiguous in its last dim")
    try:
        return t.view(-1, n)  # [rows, n]
    except RuntimeError:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} and strides {t.stride()} cannot be seen as "
            "[rows, n] without a copy"
        ) from None
