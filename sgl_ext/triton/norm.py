"""Triton RMSNorm, optionally fused with the residual add: one launch, one pass over each row.

Rounding follows the torch-native reference (`sgl_ext.norm.rmsnorm_native`): the residual sum is
rounded to the input dtype before the statistics are taken, the statistics are float32, and the
normalised row is rounded to the input dtype before the weight multiply (Llama / Qwen / HF order)
unless WEIGHT_FP32 (gpt-oss: weight applied in float32, one rounding at the end).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_ext import settings
from sgl_ext.triton.launcher import KernelLauncher, make_launcher
from sgl_ext.triton.pdl import pdl_enter
from sgl_ext.triton.rounding import cast_rne


@triton.jit
def _rmsnorm_kernel(
    X,
    R,
    W,
    Out,
    ROut,
    n_rows,
    N,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    WEIGHT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EMULATE: tl.constexpr,
    X_ROWS: tl.constexpr = 1,  # rows of X per row: summed in float32 in order, rounded once
    USE_PDL: tl.constexpr = False,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    cm = cols < N
    # the weight while the previous kernel runs: small weights leave L2 under a decode step's
    # weight stream, and loaded after x it was a DRAM round trip behind the reduction
    w = tl.load(W + cols, mask=cm, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    mask = (rows < n_rows)[:, None] & cm[None, :]
    x_rows = X + (rows * X_ROWS)[:, None] * stride_x + cols[None, :]
    x = tl.load(x_rows, mask=mask, other=0.0)
    if X_ROWS > 1:  # a token's top-k expert rows (moe_sum's arithmetic)
        acc = x.to(tl.float32)
        for j in tl.static_range(1, X_ROWS):
            acc += tl.load(x_rows + j * stride_x, mask=mask, other=0.0).to(tl.float32)
        x = cast_rne(acc, X.dtype.element_ty, EMULATE)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = cast_rne(x.to(tl.float32) + r.to(tl.float32), X.dtype.element_ty, EMULATE)
        tl.store(ROut + rows[:, None] * stride_ro + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / N  # [BLOCK_M]
    xn = xf * tl.rsqrt(var + eps)[:, None]
    if WEIGHT_FP32:
        y = xn * w[None, :]
    else:
        y = cast_rne(xn, X.dtype.element_ty, EMULATE).to(tl.float32) * w[None, :]
    y = cast_rne(y, Out.dtype.element_ty, EMULATE)
    tl.store(Out + rows[:, None] * stride_o + cols[None, :], y, mask=mask)


def plan_rmsnorm(
    n_rows: int,
    n: int,
    strides: tuple[int, int, int, int],
    eps: float,
    has_residual: bool,
    weight_in_fp32: bool,
    device: torch.device,
    x_rows: int = 1,
) -> KernelLauncher | None:
    """The launch of checked [rows, N] operands (None for zero rows).

    strides: row strides of (x, residual, out, residual_out); without a residual pass x's and
    out's. x_rows > 1: x holds x_rows rows per row ([rows * x_rows, N]), summed first. Per
    call, `launch` (tensors) or `direct` (pointers) takes x, residual, weight, out, residual_out
    in that order (x and out for the missing residual ones).
    """
    if n_rows == 0:
        return None
    block_n = 1 << (n - 1).bit_length()  # next power of two (host ints: no triton helper)
    # Rows per program from the row width only: a row's reduction order (and so its bits) must not
    # depend on how many rows there are (a padded CUDA-graph batch equals the eager one).
    block_m = max(1, 1024 // block_n)
    num_warps = max(1, min(16, block_m * block_n // 512))
    constexprs = dict(
        HAS_RESIDUAL=has_residual,
        WEIGHT_FP32=weight_in_fp32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        EMULATE=settings.get().interpret,
        X_ROWS=x_rows,
    )
    fixed = (n_rows, n, *strides, float(eps))
    grid = (-(-n_rows // block_m),)
    return make_launcher(_rmsnorm_kernel, grid, fixed, constexprs, {"num_warps": num_warps}, device)
