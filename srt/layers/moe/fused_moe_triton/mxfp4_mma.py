"""MXFP4 experts on the tensor cores with the weights as the MMA's first operand (decode sizes).

out^T [BN, BM] = W [BN, BK] @ x^T [BK, BM]: a program takes BLOCK_N rows of one expert's weight
and BLOCK_M token-expert pairs (the MMA's N side: 16 columns, one per pair), so the dequantised
weight tile is the register operand of the MMA and the few activation rows are the shared-memory
one. Two addressings:
  PER_PAIR: one pair per program (its x row in every column; no alignment launch), for T*k pairs
      that rarely share an expert.
  grouped: BLOCK_M pairs of one expert per program, from moe_align_block_size (padded rows).

Dequantisation, per uint32 word of 8 E2M1 nibbles (nibble i = K offset i of the word): for
r = 0..3, m = (w << 4r) & 0xF000F000 holds nibbles 3 - r and 7 - r as the top nibbles of each
16-bit half; (m & C) | ((m >> 6) & ~C) with C = 0x82008200 moves each sign to bit 15 and its
exponent and mantissa bits to 8..6: the bf16 pair (value * 2**-126, E2M1's subnormal 0.5 a bf16
subnormal), exact. One bf16x2 multiply by 2**(s - 1) (the E8M0 scale s times 2**126) gives the
weights, exact again: ~5 instructions per weight byte on the GPU (inline PTX; the same integer
arithmetic in Triton where PTX cannot run, e.g. the CPU interpreter). The factor is a bf16 only
for s <= 128 (weights below 16 in magnitude): the caller checks the scales (MAX_SCALE).

K order: the MMA's register operand gives each thread two K pairs per 16 K (kWidth 2), so the
tile's logical k = 32 cc + 16 c1 + 8 h + 2 q + b is laid out so that every element a thread
holds comes from its own words: word CC q + cc of the K block (BLOCK_K / 32 = CC contiguous words
per thread), nibble 4 b + 3 - (2 c1 + h). The activation columns are gathered in that order
(`_kperm`), the weights are read as stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_ext import settings
from sgl_ext.triton.launcher import cached_launcher
from srt.layers.moe.fused_moe_triton.fused_moe_triton_kernels import _swiglu
from srt.layers.moe.fused_moe_triton.moe_align_block_size import moe_align_block_size
from srt.layers.moe.fused_moe_triton.moe_gemv import ExpertWeightArgs

# E8M0 scales up to this value have a bf16 factor 2**(s - 1) (see the module docstring).
MAX_SCALE = 128

_C: tl.constexpr = tl.constexpr(0x82008200)
_NOT_C: tl.constexpr = tl.constexpr(0x7DFF7DFF)
# r-th bf16 pair of the word $4 times the factor $5 into $r; lop3 0xE4 = c ? a : b.
_DEQUANT_PTX: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 m, t;\n"
    + "".join(
        (
            f"shl.b32 m, $4, {4 * r};\nand.b32 m, m, 0xF000F000;\n"
            if r
            else "and.b32 m, $4, 0xF000F000;\n"
        )
        + f"shr.u32 t, m, 6;\nlop3.b32 t, m, t, 0x82008200, 0xE4;\nmul.rn.bf16x2 ${r}, t, $5;\n"
        for r in range(4)
    )
    + "}"
)


@triton.jit
def _f32_pair(m, f):
    """The pair move in integer arithmetic, as float32 (the bf16 bits widened) times the float32
    f: the ASM path's values, for the CPU interpreter (whose bf16 arithmetic is not IEEE).
    Returned as a trailing dim of 2 (lo first)."""
    p = (m & _C) | ((m >> 6) & _NOT_C)
    lo = (p << 16).to(tl.float32, bitcast=True)
    hi = (p & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.join(lo * f, hi * f)


@triton.jit
def _halves(p):
    """A uint32 holding a bf16 pair -> its two bf16 as a trailing dim of 2 (lo first)."""
    lo = (p & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    hi = (p >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _dequant(w, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """Words w uint32 [BN, 4, CC] and their E8M0 scales s uint8 (same shape) -> the weight tile
    [BN, BK] in the logical K order of the module docstring: bf16 (ASM) or float32 (the same
    values)."""
    if ASM:
        f = (s.to(tl.uint32) + 126) << 7  # bf16 bits of 2**(s - 1)
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            asm=_DEQUANT_PTX,
            constraints="=r,=r,=r,=r,r,r",
            args=[w, f | (f << 16)],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
            is_pure=True,
            pack=1,
        )
        e01 = tl.join(_halves(p0), _halves(p1))
        e23 = tl.join(_halves(p2), _halves(p3))
    else:
        f = ((s.to(tl.uint32) + 126) << 23).to(tl.float32, bitcast=True)  # 2**(s - 1)
        e01 = tl.join(_f32_pair(w & 0xF000F000, f), _f32_pair((w << 4) & 0xF000F000, f))
        e23 = tl.join(_f32_pair((w << 8) & 0xF000F000, f), _f32_pair((w << 12) & 0xF000F000, f))
    e = tl.join(e01, e23)  # [BN, q, cc, b, h, c1]: pair r = 2 c1 + h, half b
    e = tl.permute(e, (0, 2, 5, 4, 1, 3))  # [BN, cc, c1, h, q, b]
    return tl.reshape(e, [BLOCK_N, BLOCK_K])


@triton.jit
def _kperm(BLOCK_K: tl.constexpr):
    """[BK] physical K offset (within the K block) of each logical k of the weight tile."""
    CC: tl.constexpr = BLOCK_K // 32
    kl = tl.arange(0, BLOCK_K)
    b = kl & 1
    q = (kl >> 1) & 3
    h = (kl >> 3) & 1
    c1 = (kl >> 4) & 1
    cc = kl >> 5
    return 8 * (CC * q + cc) + 4 * b + 3 - 2 * c1 - h


@triton.jit
def _mma_load(
    q_ptrs,
    s_ptrs,
    x_ptrs,
    widx,
    kp,
    w_off1,
    s_off1,
    k_left,
    PER_PAIR: tl.constexpr,
    TWO: tl.constexpr,
    MASK: tl.constexpr,
):
    """One K block's operands: the activations as loaded ([BK] or [BM, BK]), the packed words
    and scales [BN, 4, CC] of the rows (and of the second matrix's with TWO; else the first's
    again). MASK: the block is the tail (k_left < BLOCK_K left): nothing past it is read."""
    if MASK:
        w_ok = (widx < k_left // 8)[None, :, :]  # [1, 4, CC]
        k_ok = kp < k_left
        if PER_PAIR:
            x = tl.load(x_ptrs, mask=k_ok, other=0.0)
        else:
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
        w0 = tl.load(q_ptrs, mask=w_ok, other=0)
        s0 = tl.load(s_ptrs, mask=w_ok, other=0)
        w1, s1 = w0, s0
        if TWO:
            w1 = tl.load(q_ptrs + w_off1 // 4, mask=w_ok, other=0)
            s1 = tl.load(s_ptrs + s_off1, mask=w_ok, other=0)
    else:
        x = tl.load(x_ptrs)
        w0 = tl.load(q_ptrs)
        s0 = tl.load(s_ptrs)
        w1, s1 = w0, s0
        if TWO:
            w1 = tl.load(q_ptrs + w_off1 // 4)
            s1 = tl.load(s_ptrs + s_off1)
    return x, w0, s0, w1, s1


@triton.jit
def _mma_dot(
    acc0,
    acc1,
    x,
    w0,
    s0,
    w1,
    s1,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PER_PAIR: tl.constexpr,
    TWO: tl.constexpr,
    ASM: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """acc0 += W0 @ x^T and, with TWO, acc1 += W1 @ x^T for one K block's operands."""
    if PER_PAIR:
        xt = tl.broadcast_to(x[:, None], [BLOCK_K, BLOCK_M])  # [BK, BM]: the pair everywhere
    else:
        xt = tl.trans(x)  # [BK, BM]
    if UPCAST:  # the interpreter: float32 dot (its bf16 dot is not IEEE)
        xt = xt.to(tl.float32)
    acc0 = tl.dot(_dequant(w0, s0, BLOCK_N, BLOCK_K, ASM), xt, acc0)
    if TWO:
        acc1 = tl.dot(_dequant(w1, s1, BLOCK_N, BLOCK_K, ASM), xt, acc1)
    return acc0, acc1


@triton.jit
def _mma_gemm(
    acc0,
    acc1,
    x_rows,  # PER_PAIR: pointer to the pair's activation row; else [BM] pointers (in range)
    w_ptr,
    ws_ptr,
    w_rows,  # [BN] byte offsets of the packed weight rows (all in range: clamped by the caller)
    s_rows,  # [BN] offsets of their scale rows
    w_off1,  # offset of the second matrix's rows (TWO), bytes
    s_off1,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PER_PAIR: tl.constexpr,
    TWO: tl.constexpr,
    PREFETCH: tl.constexpr,
    ASM: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """acc0 (+= w rows @ x^T) and, with TWO, acc1, fp32 [BN, BM], over K (a multiple of 32):
    whole K blocks unmasked, then the tail block masked. PER_PAIR: x's row in every column.
    PREFETCH (K >= BLOCK_K): each whole block's loads are issued before the previous block's
    arithmetic (operands double-buffered in registers; the last one re-reads its block)."""
    CC: tl.constexpr = BLOCK_K // 32
    widx = (CC * tl.arange(0, 4))[:, None] + tl.arange(0, CC)[None, :]  # [4, CC] word in block
    words = w_ptr.to(tl.pointer_type(tl.uint32))  # rows are 16-byte multiples (K % 32 == 0)
    q_ptrs = words + (w_rows // 4)[:, None, None] + widx[None, :, :]  # [BN, 4, CC]
    s_ptrs = ws_ptr + s_rows[:, None, None] + (widx // 4)[None, :, :]  # [BN, 4, CC]
    kp = _kperm(BLOCK_K)  # [BK]
    if PER_PAIR:
        x_ptrs = x_rows + kp  # [BK]
    else:
        x_ptrs = x_rows[:, None] + kp[None, :]  # [BM, BK]
    k_main = K - K % BLOCK_K
    if PREFETCH:
        x, w0, s0, w1, s1 = _mma_load(
            q_ptrs, s_ptrs, x_ptrs, widx, kp, w_off1, s_off1, 0, PER_PAIR, TWO, False
        )
        for k0 in range(0, k_main, BLOCK_K):
            step = tl.where(k0 + BLOCK_K < k_main, BLOCK_K, 0)
            nx, nw0, ns0, nw1, ns1 = _mma_load(
                q_ptrs + step // 8, s_ptrs + step // 32, x_ptrs + step, widx, kp, w_off1,
                s_off1, 0, PER_PAIR, TWO, False,
            )  # fmt: skip
            acc0, acc1 = _mma_dot(
                acc0, acc1, x, w0, s0, w1, s1, BLOCK_M, BLOCK_N, BLOCK_K, PER_PAIR, TWO, ASM,
                UPCAST,
            )  # fmt: skip
            x, w0, s0, w1, s1 = nx, nw0, ns0, nw1, ns1
            q_ptrs += step // 8
            s_ptrs += step // 32
            x_ptrs += step
        q_ptrs += BLOCK_K // 8  # the loop left them on the last whole block
        s_ptrs += BLOCK_K // 32
        x_ptrs += BLOCK_K
    else:
        for _ in range(0, k_main, BLOCK_K):
            x, w0, s0, w1, s1 = _mma_load(
                q_ptrs, s_ptrs, x_ptrs, widx, kp, w_off1, s_off1, 0, PER_PAIR, TWO, False
            )
            acc0, acc1 = _mma_dot(
                acc0, acc1, x, w0, s0, w1, s1, BLOCK_M, BLOCK_N, BLOCK_K, PER_PAIR, TWO, ASM,
                UPCAST,
            )  # fmt: skip
            q_ptrs += BLOCK_K // 8
            s_ptrs += BLOCK_K // 32
            x_ptrs += BLOCK_K
    if k_main < K:
        x, w0, s0, w1, s1 = _mma_load(
            q_ptrs, s_ptrs, x_ptrs, widx, kp, w_off1, s_off1, K - k_main, PER_PAIR, TWO, True
        )
        acc0, acc1 = _mma_dot(
            acc0, acc1, x, w0, s0, w1, s1, BLOCK_M, BLOCK_N, BLOCK_K, PER_PAIR, TWO, ASM, UPCAST
        )
    return acc0, acc1


@triton.jit
def _block(
    ids_ptr, expert_ids_ptr, num_pairs, num_experts, BLOCK_M: tl.constexpr, PER_PAIR: tl.constexpr
):
    """This program's pairs: (rows [BM]: their rows of act (PER_PAIR: the pair's, else the padded
    rows), pair [BM], valid [BM], expert (int64; 0 when out of range), whether it is in range).
    PER_PAIR: ids_ptr = topk_ids [T*k] and only column 0 is valid; else the alignment's sorted
    ids and expert_ids_ptr its block experts."""
    pid_m = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    if PER_PAIR:
        e = tl.load(ids_ptr + pid_m).to(tl.int64)
        e_ok = (e >= 0) & (e < num_experts)
        rows = pid_m + m * 0
        pair = rows
        valid = m == 0
        e = tl.where(e_ok, e, 0)
    else:
        rows = pid_m * BLOCK_M + m
        pair = tl.load(ids_ptr + rows)
        valid = pair < num_pairs
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        e_ok = e >= 0
    return rows, pair, valid, e, e_ok


@triton.jit
def _column0(t, BLOCK_M: tl.constexpr):
    """[BN, BM] -> its column 0, [BN] (PER_PAIR: every column holds the pair's result)."""
    return tl.sum(tl.where(tl.arange(0, BLOCK_M)[None, :] == 0, t, 0.0), axis=1)


@triton.jit
def moe_mma_gate_up_kernel(
    x_ptr,  # [T, K] bf16
    w_ptr,  # uint8 [E, 2N, K/2]: gate rows 0..N-1, up rows N..2N-1
    ws_ptr,  # uint8 E8M0 scales [E, 2N, K/32]
    b_ptr,  # [E, 2N] or a dummy
    act_ptr,  # PER_PAIR: [T*k, N]; else [max_blocks * BLOCK_M, N]
    ids_ptr,  # PER_PAIR: topk_ids [T*k]; else the alignment's sorted ids
    expert_ids_ptr,  # the alignment's block experts (a dummy with PER_PAIR)
    num_post_pad_ptr,  # the alignment's padded rows in use (a dummy with PER_PAIR)
    num_pairs,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PER_PAIR: tl.constexpr,
    PREFETCH: tl.constexpr,
    ASM: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not PER_PAIR:
        if tl.program_id(0) * BLOCK_M >= tl.load(num_post_pad_ptr):
            return
    rows, pair, valid, expert, e_ok = _block(
        ids_ptr, expert_ids_ptr, num_pairs, num_experts, BLOCK_M, PER_PAIR
    )
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < tl.where(e_ok, N, 0)
    rows_w = tl.minimum(cols, N - 1)  # every load in range; rows past N are not stored
    if PER_PAIR:
        x_rows = x_ptr + (tl.program_id(0) // TOP_K).to(tl.int64) * stride_xm
    else:
        token = tl.minimum(pair, num_pairs - 1) // TOP_K  # padding rows read a real row
        x_rows = x_ptr + token.to(tl.int64) * stride_xm
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_g, acc_u = _mma_gemm(
        acc_g, acc_u, x_rows, w_ptr, ws_ptr,
        expert * stride_we + rows_w * stride_wn, expert * stride_se + rows_w * stride_sn,
        N * stride_wn, N * stride_sn, K,
        BLOCK_M, BLOCK_N, BLOCK_K, PER_PAIR, True, PREFETCH, ASM, UPCAST,
    )  # fmt: skip
    if HAS_BIAS:
        b_row = b_ptr + expert * stride_be
        acc_g += tl.load(b_row + cols, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        acc_u += tl.load(b_row + N + cols, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    act = _swiglu(acc_g, acc_u, alpha, limit, ACTIVATION)  # [BN, BM]
    DT: tl.constexpr = act_ptr.dtype.element_ty
    if PER_PAIR:
        a = tl.where(e_ok, _column0(act, BLOCK_M), 0.0)
        tl.store(
            act_ptr + tl.program_id(0).to(tl.int64) * stride_am + cols, a.to(DT), mask=cols < N
        )
    else:
        out = act_ptr + rows.to(tl.int64)[None, :] * stride_am + cols[:, None]
        tl.store(out, act.to(DT), mask=(cols < N)[:, None])


@triton.jit
def moe_mma_down_kernel(
    act_ptr,  # PER_PAIR: [T*k, K]; else [max_blocks * BLOCK_M, K] (the gate/up kernel's rows)
    w_ptr,  # uint8 [E, N, K/2]
    ws_ptr,  # uint8 E8M0 scales [E, N, K/32]
    b_ptr,  # [E, N] or a dummy
    topk_weights_ptr,  # [T*k]
    out_ptr,  # [T*k, N], pair order
    ids_ptr,
    expert_ids_ptr,
    num_post_pad_ptr,
    num_pairs,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PER_PAIR: tl.constexpr,
    PREFETCH: tl.constexpr,
    ASM: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not PER_PAIR:
        if tl.program_id(0) * BLOCK_M >= tl.load(num_post_pad_ptr):
            return
    rows, pair, valid, expert, e_ok = _block(
        ids_ptr, expert_ids_ptr, num_pairs, num_experts, BLOCK_M, PER_PAIR
    )
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < tl.where(e_ok, N, 0)
    rows_w = tl.minimum(cols, N - 1)  # every load in range; rows past N are not stored
    if PER_PAIR:
        x_rows = act_ptr + tl.program_id(0).to(tl.int64) * stride_am
    else:
        x_rows = act_ptr + rows.to(tl.int64) * stride_am
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc, _ = _mma_gemm(
        acc, acc, x_rows, w_ptr, ws_ptr,
        expert * stride_we + rows_w * stride_wn, expert * stride_se + rows_w * stride_sn,
        0, 0, K,
        BLOCK_M, BLOCK_N, BLOCK_K, PER_PAIR, False, PREFETCH, ASM, UPCAST,
    )  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + cols, mask=n_ok, other=0.0).to(tl.float32)[
            :, None
        ]
    DT: tl.constexpr = out_ptr.dtype.element_ty
    if PER_PAIR:
        o = _column0(acc, BLOCK_M) * tl.load(topk_weights_ptr + tl.program_id(0)).to(tl.float32)
        o = tl.where(e_ok, o, 0.0)
        tl.store(
            out_ptr + tl.program_id(0).to(tl.int64) * stride_om + cols, o.to(DT), mask=cols < N
        )
    else:
        gate = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)  # [BM]
        out = out_ptr + pair.to(tl.int64)[None, :] * stride_om + cols[:, None]
        tl.store(out, (acc * gate[None, :]).to(DT), mask=valid[None, :] & (cols < N)[:, None])


def run_mma(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    cfg,
    activation: str,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """The "mma" MXFP4 path of `fused_experts` (arguments checked there; bf16 activations, every
    scale <= MAX_SCALE): [T*k, H] pair rows in pair order (the caller adds each token's k rows).
    cfg: a MoeConfig; gemv=True runs one pair per program (PER_PAIR), else BLOCK_M pairs of an
    expert from the alignment; each GEMM's block_n, block_k and num_warps apply, and num_stages
    > 1 prefetches the next K block into registers."""
    T, H = x.shape
    k = topk_ids.shape[1]
    E, inter = w13.shape[0], w13.shape[1] // 2
    a13 = ExpertWeightArgs.of(w13, w13_scale, w13_bias)
    a2 = ExpertWeightArgs.of(w2, w2_scale, w2_bias)
    per_pair = cfg.gemv
    bm = 16 if per_pair else cfg.block_m
    if per_pair:
        ids = topk_ids.reshape(-1)  # [T*k]
        blocks, sorted_ids, expert_ids, post_pad = T * k, ids, ids, ids
        rows = T * k
    else:
        align = moe_align_block_size(topk_ids, E, bm)
        blocks, sorted_ids = align.max_blocks, align.sorted_token_ids
        expert_ids, post_pad = align.expert_ids, align.num_tokens_post_padded
        rows = blocks * bm
    act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    gpu = x.is_cuda and not settings.get().interpret
    common = dict(BLOCK_M=bm, PER_PAIR=per_pair, ASM=gpu, UPCAST=not gpu)
    g, d = cfg.gate_up, cfg.down
    cached_launcher(moe_mma_gate_up_kernel)[(blocks, triton.cdiv(inter, g.block_n))](
        x,
        *a13.ptrs,
        act,
        sorted_ids,
        expert_ids,
        post_pad,
        T * k,
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
        PREFETCH=g.num_stages > 1 and H >= g.block_k,
        num_warps=g.num_warps,
        num_stages=1,
        **common,
    )
    out = torch.empty(T * k, H, dtype=x.dtype, device=x.device)  # [T*k, H], pair order
    cached_launcher(moe_mma_down_kernel)[(blocks, triton.cdiv(H, d.block_n))](
        act,
        *a2.ptrs,
        topk_weights.reshape(-1),
        out,
        sorted_ids,
        expert_ids,
        post_pad,
        T * k,
        E,
        H,
        inter,
        act.stride(0),
        *a2.strides,
        out.stride(0),
        HAS_BIAS=w2_bias is not None,
        BLOCK_N=d.block_n,
        BLOCK_K=d.block_k,
        PREFETCH=d.num_stages > 1 and inter >= d.block_k,
        num_warps=d.num_warps,
        num_stages=1,
        **common,
    )
    return out
