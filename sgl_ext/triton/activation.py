"""Triton SiLU-and-mul: out = silu(gate) * up for x = [gate | up], one launch.

Rounding follows the torch-native reference (`F.silu(gate) * up`): silu in float32 rounded to the
input dtype, then the product in float32 rounded once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_ext import settings
from sgl_ext.triton.rounding import cast_rne

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(X, Out, D, stride_x, stride_o, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < D
    g = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + D + cols, mask=m, other=0.0).to(tl.float32)
    s = cast_rne(g / (1.0 + tl.exp(-g)), Out.dtype.element_ty, EMULATE).to(tl.float32)
    tl.store(Out + row * stride_o + cols, cast_rne(s * u, Out.dtype.element_ty, EMULATE), mask=m)


def silu_and_mul_launch(x: torch.Tensor, out: torch.Tensor) -> None:
    """Launch on checked 2-D operands: x [rows, 2 * d], out [rows, d], last dims contiguous."""
    rows, d = out.shape
    if rows == 0 or d == 0:
        return
    block = min(BLOCK, 1 << (d - 1).bit_length())
    _silu_and_mul_kernel[(rows, -(-d // block))](
        x,
        out,
        d,
        x.stride(0),
        out.stride(0),
        BLOCK=block,
        EMULATE=settings.get().interpret,
        num_warps=4,
    )
