"""Triton helpers of the q/k RMSNorm in the rope_kv kernel (QK_NORM): the weights loaded like
the rotary pairs, the norm over whole heads with the unfused path's rounding, and the query
side's load / normalise-rotate-store.

Each head's rotary dims arrive as pairs (a, b) [BH, BLOCK_HALF] (see pairs.load_pairs) and, for
partial rotary, its pass-through dims as a tail [BH, BLOCK_TAIL]; the sum of squares runs over
both, so the norm covers the whole head.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_ext.triton.pairs import inplace_fence, load_pairs, rotate_pair, store_pairs


@triton.jit
def load_norm_weights(
    w_ptr,
    c,
    c_ok,
    dt,
    t_ok,
    HALF: tl.constexpr,
    MODE: tl.constexpr,
    IS_BF16: tl.constexpr,
    HAS_TAIL: tl.constexpr,
):
    """The RMSNorm weight of a head, laid out like its rotary pairs ([1, BLOCK_HALF] each, as in
    load_pairs) plus its pass-through dims dt ([1, BLOCK_TAIL]; zeros without a tail), fp32."""
    wa, wb = load_pairs(w_ptr, c, c_ok, HALF, MODE, IS_BF16)
    if HAS_TAIL:
        wt = tl.load(w_ptr + dt, mask=t_ok, other=0.0).to(tl.float32)
    else:
        wt = tl.zeros([1, 1], tl.float32)
    return wa, wb, wt


@triton.jit
def _norm_round(x, rstd, w, DT: tl.constexpr):
    """Qwen3's rounding: (x * rstd) cast to DT, times the weight in DT (the product of two
    16-bit floats is exact in fp32, so one rounding), returned as fp32."""
    return ((x * rstd).to(DT).to(tl.float32) * w).to(DT).to(tl.float32)


@triton.jit
def rms_norm_head(
    a,
    b,
    tail,
    wa,
    wb,
    wt,
    eps,
    HEAD_DIM: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    DT: tl.constexpr,
    SS_FP64: tl.constexpr,
):
    """RMSNorm over whole heads: a, b [BH, BLOCK_HALF] rotary pairs and tail [BH, BLOCK_TAIL]
    pass-through dims (fp32, zeros where masked). Returns the normalised (a, b, tail), each
    rounded to DT as the unfused torch norm stores it, in fp32.

    SS_FP64: the sum of squares runs in float64, where every square of a 16-bit (or 32-bit)
    float is exact, and so is the sum of a head's squares of a 16-bit input unless its values
    span more than 2^15 (bf16) or 2^12 (fp16) in magnitude: its bits then do not depend on the
    order any launch layout adds them in. Otherwise it runs in float32 (as torch's norm does),
    whose rounding depends on the order the program's layout (heads per program, warps) adds the
    squares in: the plan gives the QK_NORM variant one layout with and without the KV write
    (rope_kv_plan.qk_norm_launch_config), so the fused and unfused Qwen3 paths agree bit for bit.
    The mean square is the sum times 1 / HEAD_DIM (exact for a power-of-two head size): a
    division would be Newton steps and a slow-path call on the critical path.
    """
    if SS_FP64:
        a64, b64 = a.to(tl.float64), b.to(tl.float64)
        ss64 = tl.sum(a64 * a64 + b64 * b64, axis=1)  # [BH] fp64
        if HAS_TAIL:
            t64 = tail.to(tl.float64)
            ss64 += tl.sum(t64 * t64, axis=1)
        var = (ss64 * (1.0 / HEAD_DIM)).to(tl.float32)  # [BH] the mean square
    else:
        ss = tl.sum(a * a + b * b, axis=1)  # [BH] fp32
        if HAS_TAIL:
            ss += tl.sum(tail * tail, axis=1)
        var = ss * (1.0 / HEAD_DIM)  # [BH]
    rstd = tl.rsqrt(var + eps)[:, None]  # [BH, 1]
    a = _norm_round(a, rstd, wa, DT)
    b = _norm_round(b, rstd, wb, DT)
    if HAS_TAIL:
        tail = _norm_round(tail, rstd, wt, DT)
    return a, b, tail


@triton.jit
def query_in(
    q_row,
    c,
    q_mask,
    dqt,
    qt_mask,
    qw_ptr,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    PAIR_MODE: tl.constexpr,
    IS_BF16: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    """Load the query pairs (a, b) fp32 [BH, BLOCK_HALF]; with QK_NORM also the pass-through
    dims qt [BH, BLOCK_TAIL] and the norm weights (wa, wb [1, BLOCK_HALF], wt [1, BLOCK_TAIL])."""
    a, b = load_pairs(q_row, c, q_mask, HALF, PAIR_MODE, IS_BF16)
    qt = tl.zeros([1, 1], tl.float32)  # unused without the norm or a tail
    wa, wb, wt = qt, qt, qt
    if QK_NORM:
        if BLOCK_TAIL > 0:
            qt = tl.load(q_row + dqt, mask=qt_mask, other=0.0).to(tl.float32)
        wa, wb, wt = load_norm_weights(
            qw_ptr, c, c < HALF, dqt, dqt < HEAD_DIM, HALF, PAIR_MODE, IS_BF16, BLOCK_TAIL > 0
        )
    return a, b, qt, wa, wb, wt


@triton.jit
def query_norm(
    q_row,
    a,
    b,
    qt,
    wa,
    wb,
    wt,
    dqt,
    qt_mask,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    SS_FP64: tl.constexpr,
):
    """RMSNorm of the query pairs (a, b) and pass-through dims qt (see rms_norm_head); the
    normalised pass-through dims are stored in place. Returns the normalised (a, b, qt)."""
    QT: tl.constexpr = q_row.dtype.element_ty
    a, b, qt = rms_norm_head(a, b, qt, wa, wb, wt, eps, HEAD_DIM, BLOCK_TAIL > 0, QT, SS_FP64)
    if BLOCK_TAIL > 0:
        inplace_fence()
        tl.store(q_row + dqt, qt.to(QT), mask=qt_mask)
    return a, b, qt


@triton.jit
def query_out(
    q_row,
    c,
    q_mask,
    a,
    b,
    qt,
    wa,
    wb,
    wt,
    dqt,
    qt_mask,
    cos,
    sin,
    eps,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    PAIR_MODE: tl.constexpr,
    QK_NORM: tl.constexpr,
    SS_FP64: tl.constexpr,
):
    """Normalise (QK_NORM; SS_FP64: see rms_norm_head) and rotate the query pairs (a, b) and
    store them in place (with the normalised pass-through dims qt)."""
    if QK_NORM:
        a, b, qt = query_norm(
            q_row, a, b, qt, wa, wb, wt, dqt, qt_mask, eps, HEAD_DIM, BLOCK_TAIL, SS_FP64
        )
    a, b = rotate_pair(a, b, cos, sin)
    inplace_fence()
    store_pairs(q_row, c, q_mask, a, b, HALF, PAIR_MODE)
