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
def load_norm_weights(w_ptr, c, c_ok, dt, t_ok, cfg):
    """The RMSNorm weight of a head, laid out like its rotary pairs ([1, BLOCK_HALF] each, as in
    load_pairs with cfg.PAIR_MODE) plus its pass-through dims dt ([1, BLOCK_TAIL]; zeros
    without a tail), fp32. cfg: the kernel's Flags (rope_kv_args.py)."""
    wa, wb = load_pairs(w_ptr, c, c_ok, cfg.HALF, cfg.PAIR_MODE, cfg.IS_BF16)
    if cfg.BLOCK_TAIL > 0:
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
def rms_norm_head(x, w, eps, DT: tl.constexpr, cfg):
    """RMSNorm over whole heads: x = (a, b, tail), a, b [BH, BLOCK_HALF] rotary pairs and tail
    [BH, BLOCK_TAIL] pass-through dims (fp32, zeros where masked), w = (wa, wb, wt) their
    weights (see load_norm_weights). Returns the normalised (a, b, tail), each rounded to DT as
    the unfused torch norm stores it, in fp32.

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
    a, b, tail = x
    wa, wb, wt = w
    if cfg.SS_FP64:
        a64, b64 = a.to(tl.float64), b.to(tl.float64)
        ss64 = tl.sum(a64 * a64 + b64 * b64, axis=1)  # [BH] fp64
        if cfg.BLOCK_TAIL > 0:
            t64 = tail.to(tl.float64)
            ss64 += tl.sum(t64 * t64, axis=1)
        var = (ss64 * (1.0 / cfg.HEAD_DIM)).to(tl.float32)  # [BH] the mean square
    else:
        ss = tl.sum(a * a + b * b, axis=1)  # [BH] fp32
        if cfg.BLOCK_TAIL > 0:
            ss += tl.sum(tail * tail, axis=1)
        var = ss * (1.0 / cfg.HEAD_DIM)  # [BH]
    rstd = tl.rsqrt(var + eps)[:, None]  # [BH, 1]
    a = _norm_round(a, rstd, wa, DT)
    b = _norm_round(b, rstd, wb, DT)
    if cfg.BLOCK_TAIL > 0:
        tail = _norm_round(tail, rstd, wt, DT)
    return a, b, tail


@triton.jit
def query_in(q, c, w_ptr, cfg):
    """Load the query pairs (a, b) fp32 [BH, BLOCK_HALF] of q (QueryRows, rope_kv_args.py) at
    pair columns c; with QK_NORM also the pass-through dims qt [BH, BLOCK_TAIL] and the norm
    weights (wa, wb [1, BLOCK_HALF], wt [1, BLOCK_TAIL]) from w_ptr. Returns ((a, b, qt),
    (wa, wb, wt))."""
    a, b = load_pairs(q.row, c, q.mask, cfg.HALF, cfg.PAIR_MODE, cfg.IS_BF16)
    qt = tl.zeros([1, 1], tl.float32)  # unused without the norm or a tail
    wa, wb, wt = qt, qt, qt
    if cfg.QK_NORM:
        if cfg.BLOCK_TAIL > 0:
            qt = tl.load(q.row + q.dt, mask=q.t_mask, other=0.0).to(tl.float32)
        wa, wb, wt = load_norm_weights(w_ptr, c, c < cfg.HALF, q.dt, q.dt < cfg.HEAD_DIM, cfg)
    return (a, b, qt), (wa, wb, wt)


@triton.jit
def query_norm(q, x, w, eps, cfg):
    """RMSNorm of the query pairs and pass-through dims x = (a, b, qt) with weights w (see
    rms_norm_head); the normalised pass-through dims are stored in place. Returns the
    normalised (a, b, qt)."""
    QT: tl.constexpr = q.row.dtype.element_ty
    a, b, qt = rms_norm_head(x, w, eps, QT, cfg)
    if cfg.BLOCK_TAIL > 0:
        inplace_fence()
        tl.store(q.row + q.dt, qt.to(QT), mask=q.t_mask)
    return a, b, qt


@triton.jit
def query_out(q, c, x, w, cos, sin, eps, cfg, NORM: tl.constexpr):
    """Normalise (NORM; SS_FP64: see rms_norm_head) and rotate the query pairs x = (a, b, qt)
    and store them in place (with the normalised pass-through dims qt)."""
    if NORM:
        x = query_norm(q, x, w, eps, cfg)
    a, b, qt = x
    a, b = rotate_pair(a, b, cos, sin)
    inplace_fence()
    store_pairs(q.row, c, q.mask, a, b, cfg.HALF, cfg.PAIR_MODE)
