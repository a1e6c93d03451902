"""Triton SiLU-and-mul: out = silu(gate) * up for x = [gate | up], one launch.

Rounding follows the torch-native reference (`F.silu(gate) * up`): silu in float32 rounded to the
input dtype, then the product in float32 rounded once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_ext import settings
from sgl_ext.triton.launcher import KernelLauncher, make_launcher
from sgl_ext.triton.pdl import pdl_enter
from sgl_ext.triton.rounding import cast_rne

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    X,
    Out,
    D,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    EMULATE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < D
    g = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + D + cols, mask=m, other=0.0).to(tl.float32)
    s = cast_rne(g / (1.0 + tl.exp(-g)), Out.dtype.element_ty, EMULATE).to(tl.float32)
    tl.store(Out + row * stride_o + cols, cast_rne(s * u, Out.dtype.element_ty, EMULATE), mask=m)


def plan_silu_and_mul(
    rows: int, d: int, stride_x: int, stride_o: int, device: torch.device
) -> KernelLauncher | None:
    """The launch of checked operands x [rows, 2 * d], out [rows, d] (row strides given, last
    dims contiguous); None when there is nothing to do. Per call: x, out."""
    if rows == 0 or d == 0:
        return None
    block = min(BLOCK, 1 << (d - 1).bit_length())
    grid = (rows, -(-d // block))
    constexprs = dict(BLOCK=block, EMULATE=settings.get().interpret)
    fixed = (d, stride_x, stride_o)
    return make_launcher(_silu_and_mul_kernel, grid, fixed, constexprs, {"num_warps": 4}, device)
