"""Routed experts for a handful of tokens: one program per (token-expert pair, N tile), CUDA-core
dot products, no alignment by expert.

At decode batch sizes every pair reads its own expert's rows anyway (T*k pairs over E experts
rarely share one), so grouping pairs by expert buys nothing and the tensor-core path pays for a
BLOCK_M of 16 rows holding one real token, for the weight tile's detour through shared memory and
for `moe_align_block_size` (one more launch). Here each program streams BLOCK_N rows of its
pair's expert along K and multiplies them with the pair's activation row in registers:

  gate/up: act[pair] = swiglu(x[token] @ w13[e, gate rows].T + b, x[token] @ w13[e, up rows].T + b)
  down:    out[pair] = (act[pair] @ w2[e].T + b2[e]) * topk_weight[pair]

then `moe_sum` adds each token's k rows. Same arithmetic as the grouped kernels (float32
accumulation, act rounded to the activations' dtype), different summation order.

MXFP4 weights (uint8 E2M1 pairs [E, N, K/2], E8M0 scales [E, N, K/32]) are read as [BLOCK_N,
BLOCK_K/32, 16] byte tiles: each scale group's 16 bytes are dequantised by bit arithmetic (the
nibble as an fp16 / 2**14, exact, as in the grouped "split" mode), multiplied with the even and
odd K elements and summed inside the thread, and the group's sum is scaled once by
2**14 * 2**(scale - 127) (scales up to 240). Unquantised weights: [BLOCK_N, BLOCK_K] tiles.

Expert ids outside [0, E) contribute zero (their pairs' rows are written as zeros).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_ext.launch import cached_launcher, pdl_enter
from srt.layers.moe.fused_moe_triton.fused_moe_triton_kernels import _swiglu


@triton.jit
def _x_by_nibble(xx):
    """x [G, 4, 8] (group, word, nibble) -> its 8 nibble slices, [G, 4] each, in nibble order."""
    G: tl.constexpr = xx.shape[0]
    x5 = tl.reshape(xx, [G, 4, 2, 2, 2])  # nibble c = 4 * c2 + 2 * c1 + c0
    e, o = tl.split(x5)  # c0
    ee, eo = tl.split(e)  # c1
    oe, oo = tl.split(o)
    x0, x4 = tl.split(ee)  # c2
    x2, x6 = tl.split(eo)
    x1, x5_ = tl.split(oe)
    x3, x7 = tl.split(oo)
    return x0, x1, x2, x3, x4, x5_, x6, x7


@triton.jit
def _group_sums(w, xs):
    """Packed E2M1 words w [BN, G, 4] (8 nibbles each, nibble c of word j = K 8j + c) dotted
    with xs, summed per scale group -> float32 [BN, G], in units of 2**-14.

    Nibbles c and c + 4 of a word sit 16 bits apart, so one shift and two masks turn both into
    an fp16 pair (sign to bits 15 / 31, exponent and mantissa to 9..11 / 25..27: the value /
    2**14, E2M1's subnormal 0.5 an fp16 subnormal), each half widened to float32 exactly."""
    part = tl.zeros(w.shape, dtype=tl.float32)
    for c in tl.static_range(4):
        t = w >> (4 * c)
        h = ((t << 9) & 0x0E000E00) | ((t << 12) & 0x80008000)  # fp16 pair (c, c + 4)
        lo = (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = ((h >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        part += lo * xs[c][None, :, :]  # two fused multiply-adds
        part += hi * xs[c + 4][None, :, :]
    return tl.sum(part, axis=2)


@triton.jit
def _scale_2e14(s):
    """E8M0 scales (uint8) -> float32 2**14 * 2**(s - 127) (exact for s <= 240)."""
    return ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mx_load(q_ptrs, s_ptrs, x_ptrs, w_off1, s_off1, n_ok, g, k_left, TWO: tl.constexpr):
    """One K block's operands (MXFP4): x [G, 4, 8] as loaded, packed words [BN, G, 4] and
    scales [BN, G] of the rows (and of the second matrix's rows with TWO; else the first's
    again). Groups at or past k_left are masked off (no memory access)."""
    g_ok = g < k_left // 32  # K is a multiple of 32
    s_ok = n_ok[:, None] & g_ok[None, :]
    xx = tl.load(x_ptrs, mask=g_ok[:, None, None], other=0.0)
    w0 = tl.load(q_ptrs, mask=s_ok[:, :, None], other=0)
    s0 = tl.load(s_ptrs, mask=s_ok, other=0)
    w1 = w0
    s1 = s0
    if TWO:
        w1 = tl.load(q_ptrs + w_off1 // 4, mask=s_ok[:, :, None], other=0)
        s1 = tl.load(s_ptrs + s_off1, mask=s_ok, other=0)
    return xx, w0, s0, w1, s1


@triton.jit
def _dense_load(w_ptrs, x_ptrs, w_off1, n_ok, kk, k_left, TWO: tl.constexpr):
    """One K block's operands (unquantised): x [BK] and the rows' tiles [BN, BK] (and the
    second matrix's with TWO; else the first's again), masked past k_left."""
    k_ok = kk < k_left
    w_ok = n_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptrs, mask=k_ok, other=0.0)
    w0 = tl.load(w_ptrs, mask=w_ok, other=0.0)
    w1 = w0
    if TWO:
        w1 = tl.load(w_ptrs + w_off1, mask=w_ok, other=0.0)
    return x, w0, w1


@triton.jit
def _rows_dot(
    x_row,  # pointer to the activation row (K elements, contiguous)
    w_ptr,
    s_ptr,
    w_rows,  # [BN] offsets of the weight rows (bytes for MXFP4, elements otherwise)
    s_rows,  # [BN] offsets of their scale rows (MXFP4)
    w_off1,  # offset of the second matrix's rows (TWO)
    s_off1,
    n_ok,  # [BN]
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MXFP4: tl.constexpr,
    TWO: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """float32 [BN] dot products of the rows w_rows (and, with TWO, w_rows + w_off1) with x.

    PREFETCH issues the next K block's loads before this block's arithmetic (operands double
    buffered in registers), so each program keeps a load in flight while it computes."""
    if MXFP4:
        g = tl.arange(0, BLOCK_K // 32)  # scale groups of the K block
        j = tl.arange(0, 4)  # a group's 16 bytes as 4 words, word j holding K 8j .. 8j+7
        i = tl.arange(0, 8)
        acc0 = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.float32)
        words = w_ptr.to(tl.pointer_type(tl.uint32))  # rows are 16-byte multiples (K % 32 == 0)
        q_ptrs = words + (w_rows // 4)[:, None, None] + (g * 4)[None, :, None] + j[None, None, :]
        s_ptrs = s_ptr + s_rows[:, None] + g[None, :]  # [BN, G]
        x_ptrs = x_row + g[:, None, None] * 32 + j[None, :, None] * 8 + i[None, None, :]
        xx, w0, s0, w1, s1 = _mx_load(q_ptrs, s_ptrs, x_ptrs, w_off1, s_off1, n_ok, g, K, TWO)
        for k0 in range(0, K, BLOCK_K):
            q_ptrs += BLOCK_K // 8
            s_ptrs += BLOCK_K // 32
            x_ptrs += BLOCK_K
            k_next = K - k0 - BLOCK_K
            if PREFETCH:
                nx, nw0, ns0, nw1, ns1 = _mx_load(
                    q_ptrs, s_ptrs, x_ptrs, w_off1, s_off1, n_ok, g, k_next, TWO
                )
            xs = _x_by_nibble(xx.to(tl.float32))  # 8 x [G, 4]: K 8j + c for c = 0..7
            acc0 += _group_sums(w0, xs) * _scale_2e14(s0)
            if TWO:
                acc1 += _group_sums(w1, xs) * _scale_2e14(s1)
            if PREFETCH:
                xx, w0, s0, w1, s1 = nx, nw0, ns0, nw1, ns1
            else:
                xx, w0, s0, w1, s1 = _mx_load(
                    q_ptrs, s_ptrs, x_ptrs, w_off1, s_off1, n_ok, g, k_next, TWO
                )
    else:
        kk = tl.arange(0, BLOCK_K)
        acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        w_ptrs = w_ptr + w_rows[:, None] + kk[None, :]  # [BN, BK]
        x_ptrs = x_row + kk
        x, w0, w1 = _dense_load(w_ptrs, x_ptrs, w_off1, n_ok, kk, K, TWO)
        for k0 in range(0, K, BLOCK_K):
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            k_next = K - k0 - BLOCK_K
            if PREFETCH:
                nx, nw0, nw1 = _dense_load(w_ptrs, x_ptrs, w_off1, n_ok, kk, k_next, TWO)
            xf = x.to(tl.float32)[None, :]
            acc0 += w0.to(tl.float32) * xf
            if TWO:
                acc1 += w1.to(tl.float32) * xf
            if PREFETCH:
                x, w0, w1 = nx, nw0, nw1
            else:
                x, w0, w1 = _dense_load(w_ptrs, x_ptrs, w_off1, n_ok, kk, k_next, TWO)
    return tl.sum(acc0, axis=1), tl.sum(acc1, axis=1)


@triton.jit
def _pair_tile(topk_ids_ptr, num_experts, N, BLOCK_N: tl.constexpr):
    """This program's pair and N tile: (pair, cols [BN], the pair's expert id as int64 (0 when
    out of range), whether it is in range, n_ok [BN]: the columns whose rows it reads, none for
    an out-of-range expert)."""
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(topk_ids_ptr + pair).to(tl.int64)
    e_ok = (e >= 0) & (e < num_experts)
    n_ok = cols < tl.where(e_ok, N, 0)  # (a scalar bool & a block trips the interpreter)
    return pair, cols, tl.where(e_ok, e, 0), e_ok, n_ok


@triton.jit
def _add_gate_up_bias(gate, up, b_ptr, expert, stride_be, cols, n_ok, N, HAS_BIAS: tl.constexpr):
    """gate / up [BN] plus their expert's biases (gate at cols, up at N + cols)."""
    if HAS_BIAS:
        b_row = b_ptr + expert * stride_be
        gate += tl.load(b_row + cols, mask=n_ok, other=0.0).to(tl.float32)
        up += tl.load(b_row + N + cols, mask=n_ok, other=0.0).to(tl.float32)
    return gate, up


@triton.jit
def _store_down(
    acc,
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
    HAS_BIAS: tl.constexpr,
):
    """A pair's down row [BN]: plus its expert's bias, times its routing weight, stored at
    out[pair, cols] (zeros for an out-of-range expert)."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + cols, mask=n_ok, other=0.0).to(tl.float32)
    acc *= tl.load(topk_weights_ptr + pair).to(tl.float32)
    out = out_ptr + pair.to(tl.int64) * stride_om + cols
    tl.store(out, tl.where(e_ok, acc, 0.0).to(out_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def moe_gemv_gate_up_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [E, 2N, K] (MXFP4: uint8 [E, 2N, K/2]); gate rows 0..N-1, up rows N..2N-1
    ws_ptr,  # MXFP4: uint8 E8M0 scales [E, 2N, K/32]; else a dummy
    b_ptr,  # [E, 2N] or a dummy
    act_ptr,  # [T*k, N]
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
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MXFP4: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pair, cols, expert, e_ok, n_ok = _pair_tile(topk_ids_ptr, num_experts, N, BLOCK_N)
    gate, up = _rows_dot(
        x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm,
        w_ptr,
        ws_ptr,
        expert * stride_we + cols * stride_wn,
        expert * stride_se + cols * stride_sn,
        N * stride_wn,
        N * stride_sn,
        n_ok,
        K,
        BLOCK_N,
        BLOCK_K,
        MXFP4,
        True,
        PREFETCH,
    )
    gate, up = _add_gate_up_bias(gate, up, b_ptr, expert, stride_be, cols, n_ok, N, HAS_BIAS)
    act = tl.where(e_ok, _swiglu(gate, up, alpha, limit, ACTIVATION), 0.0)
    out = act_ptr + pair.to(tl.int64) * stride_am + cols
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def moe_gemv_down_kernel(
    act_ptr,  # [T*k, K]
    w_ptr,  # [E, N, K] (MXFP4: uint8 [E, N, K/2])
    ws_ptr,  # MXFP4: uint8 E8M0 scales [E, N, K/32]; else a dummy
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
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MXFP4: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pair, cols, expert, e_ok, n_ok = _pair_tile(topk_ids_ptr, num_experts, N, BLOCK_N)
    acc, _ = _rows_dot(
        act_ptr + pair.to(tl.int64) * stride_am,
        w_ptr,
        ws_ptr,
        expert * stride_we + cols * stride_wn,
        expert * stride_se + cols * stride_sn,
        0,
        0,
        n_ok,
        K,
        BLOCK_N,
        BLOCK_K,
        MXFP4,
        False,
        PREFETCH,
    )
    _store_down(
        acc,
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


class ExpertWeightArgs(NamedTuple):
    """One expert weight's kernel arguments as both MoE paths' kernels take them: ptrs = (the
    weight [E, N, K] (MXFP4: uint8 [E, N, K/2]), its E8M0 scales [E, N, K/32], its bias [E, N]),
    the weight standing in for a missing scale / bias; strides = (weight e, n, scales e, n, bias
    e; 0 without a bias)."""

    ptrs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    strides: tuple[int, int, int, int, int]

    @classmethod
    def of(
        cls, w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
    ) -> ExpertWeightArgs:
        """scale None: unquantised weights."""
        s = scale if scale is not None else w
        b = bias if bias is not None else w
        be = bias.stride(0) if bias is not None else 0
        return cls((w, s, b), (w.stride(0), w.stride(1), s.stride(0), s.stride(1), be))


def run_gemv(
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
) -> torch.Tensor:
    """The per-pair path of `fused_experts` (arguments checked there): [T*k, H] pair rows in
    pair order (the caller adds each token's k rows). cfg: a MoeConfig with gemv=True (its
    gate_up / down block_n, block_k, num_warps; num_stages > 1 prefetches the next K block
    into registers)."""
    T, H = x.shape
    k = topk_ids.shape[1]
    E, inter = w13.shape[0], w13.shape[1] // 2
    mxfp4 = w13.dtype == torch.uint8
    a13 = ExpertWeightArgs.of(w13, w13_scale if mxfp4 else None, w13_bias)
    a2 = ExpertWeightArgs.of(w2, w2_scale if mxfp4 else None, w2_bias)
    ids = topk_ids.reshape(-1)  # [T*k]
    act = torch.empty(T * k, inter, dtype=x.dtype, device=x.device)
    g, d = cfg.gate_up, cfg.down
    cached_launcher(moe_gemv_gate_up_kernel)[(T * k, triton.cdiv(inter, g.block_n))](
        x,
        *a13.ptrs,
        act,
        ids,
        E,
        inter,
        H,
        x.stride(0),
        *a13.strides,
        act.stride(0),
        alpha,
        limit,
        TOP_K=k,
        ACTIVATION=activation,
        HAS_BIAS=w13_bias is not None,
        BLOCK_N=g.block_n,
        BLOCK_K=g.block_k,
        MXFP4=mxfp4,
        PREFETCH=g.num_stages > 1,
        num_warps=g.num_warps,
        num_stages=1,
    )
    out = torch.empty(T * k, H, dtype=x.dtype, device=x.device)  # [T*k, H], pair order
    cached_launcher(moe_gemv_down_kernel)[(T * k, triton.cdiv(H, d.block_n))](
        act,
        *a2.ptrs,
        topk_weights.reshape(-1),
        out,
        ids,
        E,
        H,
        inter,
        act.stride(0),
        *a2.strides,
        out.stride(0),
        HAS_BIAS=w2_bias is not None,
        BLOCK_N=d.block_n,
        BLOCK_K=d.block_k,
        MXFP4=mxfp4,
        PREFETCH=d.num_stages > 1,
        num_warps=d.num_warps,
        num_stages=1,
    )
    return out
