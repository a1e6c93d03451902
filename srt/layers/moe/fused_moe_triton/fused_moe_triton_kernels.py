"""Grouped GEMMs over token-expert pairs grouped by expert (see moe_align_block_size.py).

Both kernels run a static grid of max_blocks x N-tiles programs; a program whose block lies past
num_tokens_post_padded exits before reading anything. Weights are read in their [E, N, K] layout
(K contiguous), so each weight tile load is wide and coalesced along K.

gate_up: rows of x gathered by pair (token = pair // k) @ the expert's gate and up rows, two
accumulators for the same intermediate columns; epilogue: biases, activation, store in padded-row
order (act [max_blocks * BLOCK_M, I]).
down: act rows @ the expert's down rows; epilogue: bias, routing weight, store at the pair's row
(out [T*k, H]); the top-k sum happens after (no atomics).

MXFP4 weights (uint8 E2M1 pairs [E, N, K/2], byte j of a row holding K elements 2j (low nibble)
and 2j+1 (high nibble), and E8M0 scales [E, N, K/32], one per 32 K elements; K a multiple of 32,
BLOCK_K of 32) are streamed packed, as wide uint8 loads along K, in one of two modes:
  MXFP4 == 2 ("dot_scaled"): tl.dot_scaled(x, None, "bf16", w [BK/2, BN], scales [BN, BK/32],
      "e2m1"): Triton's own FP4 upcast (bf16/fp16 activations only).
  MXFP4 == 1 ("split"): no in-register shuffles: x's even and odd K columns are loaded through
      strided pointers and multiplied with the low and the high nibbles,
      acc += x[:, 0::2] @ lo + x[:, 1::2] @ hi; a nibble becomes an fp16 by bit arithmetic
      (sign to bit 15, exponent and mantissa bits to 11..9: the value / 2**14, exact, E2M1's
      subnormal 0.5 an fp16 subnormal) and one fp32 multiply applies 2**14 * 2**(scale - 127)
      (scales up to 240, i.e. factors up to 2**113). Any activation dtype (fp32 included).

UPCAST (the CPU interpreter only) multiplies in fp32: Triton 3.9's interpreter returns garbage
for bf16 tl.dot.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _block_coords(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Program id -> (block m, tile n), GROUP_M blocks of m per n sweep (weight tiles reused)."""
    group_size = GROUP_M * num_n
    group = pid // group_size
    first_m = group * GROUP_M
    rows = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows
    pid_n = (pid % group_size) // rows
    return pid_m, pid_n


@triton.jit
def _swiglu(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """fp32 activation: "swiglu_oai" (gpt-oss, clamped) or "silu" (silu(gate) * up)."""
    if ACTIVATION == "swiglu_oai":
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    else:
        return gate * tl.sigmoid(gate) * up


@triton.jit
def _e2m1_to_f16_over_2e14(nib):
    """E2M1 nibbles (uint8 0..15: sign, 2 exponent bits, 1 mantissa bit) -> fp16 value / 2**14."""
    n = nib.to(tl.uint16)
    return (((n & 8) << 12) | ((n & 7) << 9)).to(tl.float16, bitcast=True)


@triton.jit
def _mxfp4_split(q, sc):
    """Packed bytes q [BK/2, BN] and their E8M0 scales sc (same shape, one per byte) -> the
    dequantised low-nibble (K even) and high-nibble (K odd) tiles, fp32 [BK/2, BN] each."""
    scale = ((sc.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)  # 2**14 * 2**(s - 127)
    lo = _e2m1_to_f16_over_2e14(q & 15).to(tl.float32) * scale
    hi = _e2m1_to_f16_over_2e14(q >> 4).to(tl.float32) * scale
    return lo, hi


@triton.jit
def _load_scales(s_base, col_ok, kk, K, BLOCK_K: tl.constexpr, MODE: tl.constexpr):
    """The E8M0 scales of the K block starting at kk (a multiple of 32; none at or past K:
    127 there, so a prefetch past the last block reads nothing). MODE 1: s_base [BK/2, BN],
    one pointer per weight byte; MODE 2: s_base [BN, BK/32], one per scale group."""
    if MODE == 1:
        kb = tl.arange(0, BLOCK_K // 2)
        ok = (kb < (K - kk) // 2)[:, None] & col_ok[None, :]
    else:
        kg = tl.arange(0, BLOCK_K // 32)
        ok = col_ok[:, None] & (kg < (K - kk) // 32)[None, :]
    return tl.load(s_base + kk // 32, mask=ok, other=127)


@triton.jit
def _mxfp4_dot(
    acc, x, x_odd, q, sc, DOT_PRECISION: tl.constexpr, MODE: tl.constexpr, A_FORMAT: tl.constexpr
):
    """acc + x @ one dequantised MXFP4 tile (MODE 1: x even K columns, x_odd odd ones)."""
    if MODE == 1:
        lo, hi = _mxfp4_split(q, sc)
        acc = tl.dot(x, lo.to(x.dtype), acc, input_precision=DOT_PRECISION)
        acc = tl.dot(x_odd, hi.to(x_odd.dtype), acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot_scaled(x, None, A_FORMAT, q, sc, "e2m1", acc, fast_math=True)
    return acc


@triton.jit
def _mxfp4_gemm(
    acc0,
    acc1,
    a_rows,  # [BM] pointers to the activation rows
    a_ok,  # [BM] valid rows
    w_ptr,
    ws_ptr,
    q_rows,  # [BN] byte offsets of the packed weight rows
    s_rows,  # [BN] offsets of their scale rows
    q_off1,  # offset of the second matrix's rows (TWO)
    s_off1,
    col_ok,
    K,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    MODE: tl.constexpr,
    A_FORMAT: tl.constexpr,
    TWO: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """acc0 (+= x @ w rows q_rows) and, with TWO, acc1 (+= x @ w rows q_rows + q_off1), over K,
    the weights MXFP4 (MODE 1 "split" or 2 "dot_scaled", see the module docstring).

    The scale rows (K/32 bytes, 2-byte aligned at best) are too narrow for the software
    pipeliner's asynchronous copies, so a plain load in the iteration that uses it stalls every
    K block on a memory round trip. PREFETCH loads them one K block ahead into registers instead
    (a deeper register rotation made Triton 3.6 drop the pipelining of the weight tiles)."""
    kb = tl.arange(0, BLOCK_K // 2)  # byte (K pair) index in the block
    q_ptrs = w_ptr + q_rows[None, :] + kb[:, None]  # [BK/2, BN], contiguous along K
    if MODE == 1:
        a_ptrs = a_rows[:, None] + 2 * kb[None, :]  # [BM, BK/2]: the even K columns
        s_base = ws_ptr + s_rows[None, :] + (kb // 16)[:, None]  # [BK/2, BN]: each byte's scale
    else:
        ks = tl.arange(0, BLOCK_K)
        kg = tl.arange(0, BLOCK_K // 32)
        a_ptrs = a_rows[:, None] + ks[None, :]  # [BM, BK]
        s_base = ws_ptr + s_rows[:, None] + kg[None, :]  # [BN, BK/32]
    if PREFETCH:  # the scales of the next K block, in flight (c: first matrix, d: second)
        c = _load_scales(s_base, col_ok, 0, K, BLOCK_K, MODE)
        d = c
        if TWO:
            d = _load_scales(s_base + s_off1, col_ok, 0, K, BLOCK_K, MODE)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            q_ok = col_ok[None, :]
            a_mask = a_ok[:, None]
        else:
            kb_ok = kb < (K - k0) // 2
            q_ok = kb_ok[:, None] & col_ok[None, :]
            if MODE == 1:
                a_mask = a_ok[:, None] & kb_ok[None, :]
            else:
                a_mask = a_ok[:, None] & (ks < K - k0)[None, :]
        if PREFETCH:  # this block's scales arrived; issue the next block's
            sc = c
            sd = d
            c = _load_scales(s_base, col_ok, k0 + BLOCK_K, K, BLOCK_K, MODE)
            if TWO:
                d = _load_scales(s_base + s_off1, col_ok, k0 + BLOCK_K, K, BLOCK_K, MODE)
        else:
            sc = _load_scales(s_base, col_ok, k0, K, BLOCK_K, MODE)
        if MODE == 1:
            x = tl.load(a_ptrs, mask=a_mask, other=0.0)
            x_odd = tl.load(a_ptrs + 1, mask=a_mask, other=0.0)
            if UPCAST:
                x, x_odd = x.to(tl.float32), x_odd.to(tl.float32)
        else:
            x = tl.load(a_ptrs, mask=a_mask, other=0.0)
            x_odd = x
        q = tl.load(q_ptrs, mask=q_ok, other=0)
        acc0 = _mxfp4_dot(acc0, x, x_odd, q, sc, DOT_PRECISION, MODE, A_FORMAT)
        if TWO:
            if PREFETCH == 0:
                sd = _load_scales(s_base + s_off1, col_ok, k0, K, BLOCK_K, MODE)
            q = tl.load(q_ptrs + q_off1, mask=q_ok, other=0)
            acc1 = _mxfp4_dot(acc1, x, x_odd, q, sd, DOT_PRECISION, MODE, A_FORMAT)
        a_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // 2
    return acc0, acc1


@triton.jit
def moe_gate_up_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [E, 2N, K]: gate rows 0..N-1, up rows N..2N-1 (MXFP4: uint8 [E, 2N, K/2])
    ws_ptr,  # MXFP4: uint8 E8M0 scales [E, 2N, K/32]; else a dummy
    b_ptr,  # [E, 2N] or a dummy
    act_ptr,  # [max_blocks * BLOCK_M, N]
    sorted_ids_ptr,  # int32 [max_blocks * BLOCK_M]
    expert_ids_ptr,  # int32 [max_blocks]
    num_post_pad_ptr,  # int32 [1]
    num_pairs,
    N,
    K,
    max_blocks,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_am,
    alpha,
    limit,
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    MXFP4: tl.constexpr,  # 0: bf16/fp16/fp32 weights; 1: MXFP4 "split"; 2: "dot_scaled"
    A_FORMAT: tl.constexpr,  # dot_scaled's name of x's dtype ("bf16" / "fp16")
    SCALE_PREFETCH: tl.constexpr,  # MXFP4: scales loaded one K block ahead (0 / 1)
):
    pid_m, pid_n = _block_coords(tl.program_id(0), max_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)
    valid = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MXFP4:
        acc_g, acc_u = _mxfp4_gemm(
            acc_g,
            acc_u,
            x_ptr + token * stride_xm,
            valid,
            w_ptr,
            ws_ptr,
            expert * stride_we + cols * stride_wn,
            expert * stride_se + cols * stride_sn,
            N * stride_wn,
            N * stride_sn,
            col_ok,
            K,
            DOT_PRECISION,
            BLOCK_N,
            BLOCK_K,
            EVEN_K,
            UPCAST,
            MXFP4,
            A_FORMAT,
            True,
            SCALE_PREFETCH,
        )
    else:
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + token[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
        g_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None]  # [BK, BN]
        u_ptrs = g_ptrs + N * stride_wn
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                wg = tl.load(g_ptrs, mask=col_ok[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = ks < K - k0
                a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    if HAS_BIAS:
        b_row = b_ptr + expert * stride_be
        acc_g += tl.load(b_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_row + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    act = _swiglu(acc_g, acc_u, alpha, limit, ACTIVATION)
    out_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_am + cols[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit
def moe_down_kernel(
    act_ptr,  # [max_blocks * BLOCK_M, K]
    w_ptr,  # [E, N, K] (MXFP4: uint8 [E, N, K/2])
    ws_ptr,  # MXFP4: uint8 E8M0 scales [E, N, K/32]; else a dummy
    b_ptr,  # [E, N] or a dummy
    topk_weights_ptr,  # [T*k]
    out_ptr,  # [T*k, N]
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_pad_ptr,
    num_pairs,
    N,
    K,
    max_blocks,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_om,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    MXFP4: tl.constexpr,
    A_FORMAT: tl.constexpr,
    SCALE_PREFETCH: tl.constexpr,
):
    pid_m, pid_n = _block_coords(tl.program_id(0), max_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)
    valid = pair < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MXFP4:
        acc, _ = _mxfp4_gemm(
            acc,
            acc,
            act_ptr + rows.to(tl.int64) * stride_am,
            valid,
            w_ptr,
            ws_ptr,
            expert * stride_we + cols * stride_wn,
            expert * stride_se + cols * stride_sn,
            0,
            0,
            col_ok,
            K,
            DOT_PRECISION,
            BLOCK_N,
            BLOCK_K,
            EVEN_K,
            UPCAST,
            MXFP4,
            A_FORMAT,
            False,
            SCALE_PREFETCH,
        )
    else:
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :]  # [BM, BK]
        w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None]  # [BK, BN]
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = ks < K - k0
                a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[
            None, :
        ]
    gate = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)  # [BM]
    acc = acc * gate[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])
