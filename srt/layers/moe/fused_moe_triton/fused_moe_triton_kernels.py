"""Grouped GEMMs over token-expert pairs grouped by expert (see moe_align_block_size.py).

Both kernels run a static grid of max_blocks x N-tiles programs; a program whose block lies past
num_tokens_post_padded exits before reading anything. Weights are read in their [E, N, K] layout
(K contiguous), so each weight tile load is wide and coalesced along K.

gate_up: rows of x gathered by pair (token = pair // k) @ the expert's gate and up rows, two
accumulators for the same intermediate columns; epilogue: biases, activation, store in padded-row
order (act [max_blocks * BLOCK_M, I]).
down: act rows @ the expert's down rows; epilogue: bias, routing weight, store at the pair's row
(out [T*k, H]); the top-k sum happens after (no atomics).

MXFP4 weights (uint8 E2M1 pairs [E, N, K/2], low nibble first, and E8M0 scales [E, N, K/32],
one per 32 values along K) are dequantised per tile in registers before the dot; K must be a
multiple of 32 and BLOCK_K of 32.

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
def _e2m1_to_f32(nib):
    """E2M1 nibbles (uint8 0..15: sign, 2 exponent bits, 1 mantissa bit) -> fp32 values."""
    e = ((nib >> 1) & 3).to(tl.float32)
    m = (nib & 1).to(tl.float32)
    mag = tl.where(e == 0.0, m * 0.5, (1.0 + m * 0.5) * tl.exp2(e - 1.0))
    return tl.where((nib & 8) != 0, -mag, mag)


@triton.jit
def _mxfp4_tile(
    q_ptr, s_ptr, q_rows, s_rows, col_ok, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """MXFP4 weight tile [BLOCK_K, BLOCK_N] in fp32, rows starting at q_rows / s_rows [BLOCK_N]
    (byte offsets into the packed values [.., K/2] and the E8M0 scales [.., K/32]), at k0."""
    kb = tl.arange(0, BLOCK_K // 2)
    kg = tl.arange(0, BLOCK_K // 32)
    q_ok = col_ok[:, None] & (kb[None, :] < (K - k0) // 2)
    q = tl.load(q_ptr + q_rows[:, None] + k0 // 2 + kb[None, :], mask=q_ok, other=0)  # [BN, BK/2]
    s_ok = col_ok[:, None] & (kg[None, :] < (K - k0) // 32)
    sc = tl.load(s_ptr + s_rows[:, None] + k0 // 32 + kg[None, :], mask=s_ok, other=127)
    v = tl.interleave(_e2m1_to_f32(q & 15), _e2m1_to_f32(q >> 4))  # [BN, BK]: lo0 hi0 lo1 ...
    v = tl.reshape(v, [BLOCK_N, BLOCK_K // 32, 32])  # [BN, groups, 32]
    v = v * tl.exp2(sc.to(tl.float32) - 127.0)[:, :, None]
    return tl.trans(tl.reshape(v, [BLOCK_N, BLOCK_K]))  # [BK, BN]


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
    MXFP4: tl.constexpr,
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
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    gq_rows = expert * stride_we + cols * stride_wn  # MXFP4 [BN] byte offsets
    gs_rows = expert * stride_se + cols * stride_sn
    for k0 in range(0, K, BLOCK_K):
        if MXFP4:
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            wg = _mxfp4_tile(w_ptr, ws_ptr, gq_rows, gs_rows, col_ok, k0, K, BLOCK_N, BLOCK_K)
            wu = _mxfp4_tile(
                w_ptr,
                ws_ptr,
                gq_rows + N * stride_wn,
                gs_rows + N * stride_sn,
                col_ok,
                k0,
                K,
                BLOCK_N,
                BLOCK_K,
            )
            wg, wu = wg.to(a.dtype), wu.to(a.dtype)
        elif EVEN_K:
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
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :]  # [BM, BK]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None]  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    q_rows = expert * stride_we + cols * stride_wn  # MXFP4 [BN] byte offsets
    s_rows = expert * stride_se + cols * stride_sn
    for k0 in range(0, K, BLOCK_K):
        if MXFP4:
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = _mxfp4_tile(w_ptr, ws_ptr, q_rows, s_rows, col_ok, k0, K, BLOCK_N, BLOCK_K)
            w = w.to(a.dtype)
        elif EVEN_K:
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
