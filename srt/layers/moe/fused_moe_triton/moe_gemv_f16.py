"""MXFP4 routed experts for a handful of tokens, multiplied in fp16 pairs (bf16 activations).

The per-pair kernels of moe_gemv.py widen every dequantised nibble to float32 for its FMA (43
instructions per packed word in the sm_90 SASS of the gate/up loop), and on the H100 they were
issue-bound (0.64 instructions issued per scheduler cycle, ncu). Here a weight word's nibble
pair (c, c + 4) becomes one fp16x2 word by bit moves (the E2M1 value / 2**14, exact) and meets
an fp16x2 word of activations in one `fma.rn.f16x2`; only each word's two lanes are widened to
float32 (29 instructions a word, no barrier in the K loop):

  word j of a scale group (K 8j .. 8j+7, nibble c = K 8j + c), pair c = nibbles (c, c + 4):
  acc16 = sum over c of pair_c(w) * x16[pair (c, j)]      (fp16x2, 4 products a lane)
  group sum += (lo(acc16) + hi(acc16)) in float32, times 2**14 * 2**(scale - 127)

The activations come in that pair order as fp16 words scaled by a power of two (moe_x_f16.py):
the gate/up input per token (`x_to_f16`, 2**-s applied at the end), the down input as the gate/up
kernel stores it: each activation rounded to bf16 first (as the float32 path stores it), times a
fixed 2**act_shift (gpt-oss's clamped SwiGLU bounds |act|, `act_f16_shift`).

Numerics: bf16 values convert to fp16 exactly above 2**-14 after the scaling (2**-28 of the
row's max; smaller ones keep fp16's subnormal steps), and an E2M1 value (2 significant bits)
times a bf16 one (8) is exact in fp16 (11). |products| <= 6 * 2**-14 * 2**15 and a lane sums 4
of them (|partial| <= 48: no overflow), so the only roundings beyond the float32 path's are the
3 fp16 additions a lane (relative 2**-11 of a 4-product partial), below the output's bf16
rounding (fp16 activations would round their products: they take moe_gemv.py). Expert ids
outside [0, E) contribute zero, as in moe_gemv.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_ext import settings
from sgl_ext.launch import cached_launcher, cast_rne, pdl_enter
from srt.layers.moe.fused_moe_triton.config import MoeConfig
from srt.layers.moe.fused_moe_triton.fused_moe_triton_kernels import _swiglu
from srt.layers.moe.fused_moe_triton.moe_gemv import (
    ExpertWeightArgs,
    _add_gate_up_bias,
    _pair_tile,
    _scale_2e14,
    _store_down,
)
from srt.layers.moe.fused_moe_triton.moe_x_f16 import XF16, act_f16_shift, pair_position, x_to_f16


@triton.jit
def _lane(w, SHIFT: tl.constexpr):
    """The fp16 half of uint32 words w at bit SHIFT (0 or 16)."""
    return ((w >> SHIFT) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _pack2(lo, hi):
    """Two fp16 tensors -> fp16x2 words (uint32, lo in bits 0..15)."""
    lo_bits = lo.to(tl.uint16, bitcast=True).to(tl.uint32)
    return lo_bits | (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)


@triton.jit
def _hfma2(a, b, c, EMULATE: tl.constexpr):
    """a * b + c on fp16x2 words (uint32): one `fma.rn.f16x2`; the interpreter (EMULATE) runs
    it on the two fp16 lanes."""
    if EMULATE:
        return _pack2(
            _lane(a, 0) * _lane(b, 0) + _lane(c, 0), _lane(a, 16) * _lane(b, 16) + _lane(c, 16)
        )
    else:
        return tl.inline_asm_elementwise(
            "fma.rn.f16x2 $0, $1, $2, $3;",
            "=r,r,r,r",
            [a, b, c],
            dtype=tl.uint32,
            is_pure=True,
            pack=1,
        )


@triton.jit
def _hmul2(a, b, EMULATE: tl.constexpr):
    """a * b on fp16x2 words (uint32): one `mul.rn.f16x2`."""
    if EMULATE:
        return _pack2(_lane(a, 0) * _lane(b, 0), _lane(a, 16) * _lane(b, 16))
    else:
        return tl.inline_asm_elementwise(
            "mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.uint32, is_pure=True, pack=1
        )


@triton.jit
def _load_u8(s):
    """uint8 at s (pointers, or int64 addresses for inline PTX) as int32. A plain load takes
    the coalescer's layout, and the per-group sums were converted to it (a shared memory round
    trip and barriers every K block); the inline load keeps the layout of its addresses."""
    if s.dtype.is_ptr():
        return tl.load(s).to(tl.int32)
    else:
        return tl.inline_asm_elementwise(
            "ld.global.nc.u8 $0, [$1];", "=r,l", [s], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def _nibble_pair(w, C: tl.constexpr):
    """Nibbles C and C + 4 of packed E2M1 words w -> fp16x2 words (value / 2**14 each): the
    magnitude bits to 9..11 / 25..27, the sign to 15 / 31."""
    if C < 3:
        return ((w << (9 - 4 * C)) & 0x0E000E00) | ((w << (12 - 4 * C)) & 0x80008000)
    else:
        return ((w >> 3) & 0x0E000E00) | (w & 0x80008000)


@triton.jit
def _words_dot(w, x0, x1, x2, x3, EMULATE: tl.constexpr):
    """Packed E2M1 words w [BN, G, 4] dotted with their x16 words (pair c in xc), summed per
    scale group -> float32 [BN, G], in units of 2**-14."""
    acc = _hmul2(_nibble_pair(w, 0), x0, EMULATE)
    acc = _hfma2(_nibble_pair(w, 1), x1, acc, EMULATE)
    acc = _hfma2(_nibble_pair(w, 2), x2, acc, EMULATE)
    acc = _hfma2(_nibble_pair(w, 3), x3, acc, EMULATE)
    return tl.sum(_lane(acc, 0).to(tl.float32) + _lane(acc, 16).to(tl.float32), axis=2)


@triton.jit
def _f16_load(q_base, s_base, x_base, w_off1, s_off1, gb, num_groups, G: tl.constexpr, TWO):
    """Groups gb .. gb + G - 1's operands: the x16 words of pairs 0..3 [BN, G, 4] (the one
    activation row's, the same for every row), packed words [BN, G, 4] and scales [BN, G] (and
    the second matrix's with TWO; else the first's again). No masks (no zero fills): groups
    past the row's end re-read its last one, and the caller drops their sums."""
    g = tl.minimum(gb + tl.arange(0, G), num_groups - 1)
    q = q_base + (g * 4)[None, :, None]
    xp = x_base + (g * 16)[None, :, None]
    s = s_base + g[None, :]
    x0 = tl.load(xp)
    x1 = tl.load(xp + 4)
    x2 = tl.load(xp + 8)
    x3 = tl.load(xp + 12)
    w0 = tl.load(q)
    s0 = _load_u8(s)
    w1 = w0
    s1 = s0
    if TWO:
        w1 = tl.load(q + w_off1 // 4)
        s1 = _load_u8(s + s_off1)
    return x0, x1, x2, x3, w0, s0, w1, s1


@triton.jit
def _rows_dot_f16(
    x16_row,  # fp16 pointer to the pair-ordered activation row (K halves)
    w_ptr,
    s_ptr,
    w_rows,  # [BN] byte offsets of the weight rows (all readable: the caller clamps)
    s_rows,  # [BN] offsets of their scale rows
    w_off1,  # offset of the second matrix's rows (TWO)
    s_off1,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TWO: tl.constexpr,
    PREFETCH: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """float32 [BN] dot products (times 2**s of the row) of the rows w_rows (and, with TWO,
    w_rows + w_off1) with the activation row; PREFETCH loads each next K block before this
    one's math."""
    G: tl.constexpr = BLOCK_K // 32  # scale groups of a K block
    num_groups = K // 32
    acc0 = tl.zeros([BLOCK_N, G], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, G], dtype=tl.float32)
    j = tl.arange(0, 4)  # a group's 16 bytes as 4 words, word j holding K 8j .. 8j+7
    words = w_ptr.to(tl.pointer_type(tl.uint32))  # rows are 16-byte multiples (K % 32 == 0)
    q_base = words + (w_rows // 4)[:, None, None] + j[None, None, :]  # [BN, 1, 4]
    # [BN, 1, 4]: the same x16 words for every row (offset 0 along BN), pair 0's; pair c: + 4c
    x_base = x16_row.to(tl.pointer_type(tl.uint32)) + (w_rows * 0)[:, None, None] + j
    # the scales' [BN, G] offsets in the layout of the group sums: reduced from [BN, G, 4]
    # offsets in the words' layout (q >> 62 is 0 but ties them to it)
    zeros = tl.zeros([BLOCK_N, G, 4], dtype=tl.int64)
    s_tie = ((q_base + zeros).to(tl.int64) >> 62) + s_rows[:, None, None] + zeros
    if EMULATE:  # (the interpreter has no inline PTX)
        s_base = s_ptr + tl.min(s_tie, axis=2)
    else:
        s_base = s_ptr.to(tl.int64) + tl.min(s_tie, axis=2)
    x0, x1, x2, x3, w0, s0, w1, s1 = _f16_load(
        q_base, s_base, x_base, w_off1, s_off1, 0, num_groups, G, TWO
    )
    for gb in range(0, num_groups, G):
        if PREFETCH:
            nx0, nx1, nx2, nx3, nw0, ns0, nw1, ns1 = _f16_load(
                q_base, s_base, x_base, w_off1, s_off1, gb + G, num_groups, G, TWO
            )
        real = (gb + tl.arange(0, G) < num_groups)[None, :]  # groups before the row's end
        part = _words_dot(w0, x0, x1, x2, x3, EMULATE) * _scale_2e14(s0)
        acc0 += tl.where(real, part, 0.0)
        if TWO:
            part = _words_dot(w1, x0, x1, x2, x3, EMULATE) * _scale_2e14(s1)
            acc1 += tl.where(real, part, 0.0)
        if PREFETCH:
            x0, x1, x2, x3, w0, s0, w1, s1 = nx0, nx1, nx2, nx3, nw0, ns0, nw1, ns1
        else:
            x0, x1, x2, x3, w0, s0, w1, s1 = _f16_load(
                q_base, s_base, x_base, w_off1, s_off1, gb + G, num_groups, G, TWO
            )
    return tl.sum(acc0, axis=1), tl.sum(acc1, axis=1)


@triton.jit
def moe_gemv_f16_gate_up_kernel(
    x16_ptr,  # fp16 [T, K], pair-ordered, times 2**s per row
    xinv_ptr,  # float32 [T]: 2**-s
    w_ptr,  # uint8 [E, 2N, K/2]; gate rows 0..N-1, up rows N..2N-1
    ws_ptr,  # uint8 E8M0 scales [E, 2N, K/32]
    b_ptr,  # [E, 2N] or a dummy
    act16_ptr,  # fp16 [T*k, N], pair-ordered, times 2**act_shift
    topk_ids_ptr,  # [T*k]
    num_experts,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_am,
    alpha,
    limit,
    act_up,  # 2**act_shift
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT_DTYPE: tl.constexpr,  # the activations' dtype: act rounds to it first
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    EMULATE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pair, cols, expert, e_ok, n_ok = _pair_tile(topk_ids_ptr, num_experts, N, BLOCK_N)
    token = (pair // TOP_K).to(tl.int64)
    rows = tl.minimum(cols, N - 1)  # columns past N re-read row N - 1 (not stored)
    gate, up = _rows_dot_f16(
        x16_ptr + token * stride_xm,
        w_ptr,
        ws_ptr,
        expert * stride_we + rows * stride_wn,
        expert * stride_se + rows * stride_sn,
        N * stride_wn,
        N * stride_sn,
        K,
        BLOCK_N,
        BLOCK_K,
        True,
        PREFETCH,
        EMULATE,
    )
    inv = tl.load(xinv_ptr + token)
    gate *= inv
    up *= inv
    gate, up = _add_gate_up_bias(gate, up, b_ptr, expert, stride_be, cols, n_ok, N, HAS_BIAS)
    act = tl.where(e_ok, _swiglu(gate, up, alpha, limit, ACTIVATION), 0.0)
    act = cast_rne(act, ACT_DTYPE, EMULATE).to(tl.float32) * act_up
    out = act16_ptr + pair.to(tl.int64) * stride_am + pair_position(cols)
    tl.store(out, act.to(tl.float16), mask=cols < N)


@triton.jit
def moe_gemv_f16_down_kernel(
    act16_ptr,  # fp16 [T*k, K], pair-ordered, times 2**act_shift
    w_ptr,  # uint8 [E, N, K/2]
    ws_ptr,  # uint8 E8M0 scales [E, N, K/32]
    b_ptr,  # [E, N] or a dummy
    topk_weights_ptr,  # [T*k]
    out_ptr,  # [T*k, N]
    topk_ids_ptr,  # [T*k]
    num_experts,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_om,
    act_down,  # 2**-act_shift
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    EMULATE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pair, cols, expert, e_ok, n_ok = _pair_tile(topk_ids_ptr, num_experts, N, BLOCK_N)
    rows = tl.minimum(cols, N - 1)  # columns past N re-read row N - 1 (not stored)
    acc, _ = _rows_dot_f16(
        act16_ptr + pair.to(tl.int64) * stride_am,
        w_ptr,
        ws_ptr,
        expert * stride_we + rows * stride_wn,
        expert * stride_se + rows * stride_sn,
        0,
        0,
        K,
        BLOCK_N,
        BLOCK_K,
        False,
        PREFETCH,
        EMULATE,
    )
    _store_down(
        acc * act_down,
        b_ptr,
        expert,
        stride_be,
        topk_weights_ptr,
        out_ptr,
        stride_om,
        pair,
        cols,
        e_ok,
        n_ok,
        N,
        HAS_BIAS,
    )


def f16_products_apply(
    cfg: MoeConfig, x: torch.Tensor, mxfp4: bool, activation: str, alpha: float, limit: float
) -> bool:
    """Whether run_gemv_f16 serves this call: a MoeConfig cfg with gemv and fp16_products,
    MXFP4 weights, bf16 activations, a bounded activation."""
    bf16 = x.dtype == torch.bfloat16  # fp16 activations: 11-bit products would round
    fp16 = cfg.gemv and cfg.fp16_products and mxfp4 and bf16
    return fp16 and act_f16_shift(activation, alpha, limit) is not None


def run_gemv_f16(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    cfg,
    activation: str,
    alpha: float,
    limit: float,
    x_f16: XF16 | None = None,
) -> torch.Tensor:
    """run_gemv with fp16 products (f16_products_apply holds; arguments checked by
    fused_experts): [T*k, H] pair rows in pair order (the caller adds each token's k rows)."""
    T, H = x.shape
    k = topk_ids.shape[1]
    E, inter = w13.shape[0], w13.shape[1] // 2
    shift = act_f16_shift(activation, alpha, limit)
    assert shift is not None and w13_scale is not None and w2_scale is not None
    emulate = settings.get().interpret
    a13 = ExpertWeightArgs.of(w13, w13_scale, w13_bias)
    a2 = ExpertWeightArgs.of(w2, w2_scale, w2_bias)
    ids = topk_ids.reshape(-1)  # [T*k]
    xf = x_f16 if x_f16 is not None else x_to_f16(x)  # given: made with the routing
    x16, inv = xf.words, xf.inv
    act16 = torch.empty(T * k, inter, dtype=torch.float16, device=x.device)
    g, d = cfg.gate_up, cfg.down
    cached_launcher(moe_gemv_f16_gate_up_kernel)[(T * k, triton.cdiv(inter, g.block_n))](
        x16,
        inv,
        *a13.ptrs,
        act16,
        ids,
        E,
        inter,
        H,
        x16.stride(0),
        *a13.strides,
        act16.stride(0),
        alpha,
        limit,
        2.0**shift,
        TOP_K=k,
        ACTIVATION=activation,
        HAS_BIAS=w13_bias is not None,
        ACT_DTYPE=tl.bfloat16,
        BLOCK_N=g.block_n,
        BLOCK_K=g.block_k,
        PREFETCH=g.num_stages > 1,
        EMULATE=emulate,
        num_warps=g.num_warps,
        num_stages=1,
    )
    out = torch.empty(T * k, H, dtype=x.dtype, device=x.device)  # [T*k, H], pair order
    cached_launcher(moe_gemv_f16_down_kernel)[(T * k, triton.cdiv(H, d.block_n))](
        act16,
        *a2.ptrs,
        topk_weights.reshape(-1),
        out,
        ids,
        E,
        H,
        inter,
        act16.stride(0),
        *a2.strides,
        out.stride(0),
        2.0**-shift,
        HAS_BIAS=w2_bias is not None,
        BLOCK_N=d.block_n,
        BLOCK_K=d.block_k,
        PREFETCH=d.num_stages > 1,
        EMULATE=emulate,
        num_warps=d.num_warps,
        num_stages=1,
    )
    return out
