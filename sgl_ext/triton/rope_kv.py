"""Triton kernel: RoPE on q/k in place, and the rotated K plus V stored into the KV cache.

One program handles one token and a block of heads: program_id(1) < num_q_blocks rotates query
heads, the rest rotate key heads and (WRITE_KV) store K and V into the cache slot of the token.
The same kernel with ROTATE=False is the standalone KV write.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sgl_ext._common import KVLayout, fp8_max


@triton.jit
def _rotate(
    row_ptrs,  # [BLOCK_H, 1] pointers to the start of each head row
    head_mask,  # [BLOCK_H, 1]
    cos_ptr,  # pointer to this token's cos row (sin follows after ROT_DIM // 2)
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_NEOX: tl.constexpr,
    ROTATE: tl.constexpr,
):
    """Load [BLOCK_H, BLOCK_D] rows and return them rotated, in fp32."""
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    d_mask = d < HEAD_DIM
    x = tl.load(row_ptrs + d, mask=head_mask & d_mask, other=0.0).to(tl.float32)
    if ROTATE:
        HALF: tl.constexpr = ROT_DIM // 2
        rot = d < ROT_DIM
        if IS_NEOX:
            ci = tl.where(d < HALF, d, d - HALF)
            partner = tl.where(d < HALF, d + HALF, d - HALF)
            sign = tl.where(d < HALF, -1.0, 1.0)
        else:
            ci = d // 2
            partner = d ^ 1
            sign = tl.where((d % 2) == 0, -1.0, 1.0)
        ci = tl.where(rot, ci, 0)
        partner = tl.where(rot, partner, d)
        cos = tl.load(cos_ptr + ci, mask=rot, other=1.0)
        sin = tl.load(cos_ptr + HALF + ci, mask=rot, other=0.0)
        xp = tl.load(row_ptrs + partner, mask=head_mask & rot, other=0.0).to(tl.float32)
        x = tl.where(rot, x * cos + (sign * xp) * sin, x)
    return x


@triton.jit
def _round_to_fp8_grid(x, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round fp32 x to nearest-even on the fp8 grid (MANT mantissa bits, min normal 2^MIN_EXP).

    Only for TRITON_INTERPRET: the interpreter's fp32->fp8 cast does not round correctly, but it
    converts values already on the fp8 grid exactly.
    """
    SHIFT: tl.constexpr = 23 - MANT
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> SHIFT) & 1
    bits = (bits + ((1 << (SHIFT - 1)) - 1) + lsb) & ~((1 << SHIFT) - 1)
    normal = bits.to(tl.float32, bitcast=True)
    QUANT: tl.constexpr = 2.0 ** (MIN_EXP - MANT)
    MAGIC: tl.constexpr = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to integer
    sub = ((x * (1.0 / QUANT) + MAGIC) - MAGIC) * QUANT
    return tl.where(tl.abs(x) < 2.0**MIN_EXP, sub, normal)


@triton.jit
def _quantize(
    x, scale_ptr, scale_f, SCALE_MODE: tl.constexpr, FP8_MAX: tl.constexpr, EMULATE: tl.constexpr
):
    """x (fp32) / scale, clamped to the fp8 range when FP8_MAX > 0."""
    if SCALE_MODE == 1:
        x = tl.math.div_rn(x, tl.full(x.shape, scale_f, tl.float32))
    elif SCALE_MODE == 2:
        s = tl.load(scale_ptr).to(tl.float32)
        x = tl.math.div_rn(x, tl.full(x.shape, 1.0, tl.float32) * s)
    if FP8_MAX > 0:
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
        if EMULATE:
            if FP8_MAX == 448.0:  # e4m3fn
                x = _round_to_fp8_grid(x, 3, -6)
            else:  # e5m2
                x = _round_to_fp8_grid(x, 2, -14)
    return x


@triton.jit
def rope_kv_kernel(
    pos_ptr,
    cos_sin_ptr,
    cs_stride,
    q_ptr,
    q_tok_stride,
    q_head_stride,
    k_ptr,
    k_tok_stride,
    k_head_stride,
    v_ptr,
    v_tok_stride,
    v_head_stride,
    kbuf_ptr,
    kb_page_stride,
    kb_off_stride,
    kb_head_stride,
    vbuf_ptr,
    vb_page_stride,
    vb_off_stride,
    vb_head_stride,
    loc_ptr,
    page_size,
    num_slots,
    k_scale_ptr,
    v_scale_ptr,
    k_scale_f,
    v_scale_f,
    num_q_heads,
    num_kv_heads,
    num_q_blocks,
    max_pos,
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_NEOX: tl.constexpr,
    ROTATE: tl.constexpr,
    WRITE_KV: tl.constexpr,
    K_SCALE_MODE: tl.constexpr,
    V_SCALE_MODE: tl.constexpr,
    K_FP8_MAX: tl.constexpr,
    V_FP8_MAX: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    if ROTATE:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)  # memory safety; debug checks report
        cos_ptr = cos_sin_ptr + pos * cs_stride
    else:
        cos_ptr = cos_sin_ptr
    if hb < num_q_blocks:
        heads = hb * BLOCK_H + h
        h_mask = heads < num_q_heads
        rows = q_ptr + t * q_tok_stride + heads * q_head_stride
        x = _rotate(rows, h_mask, cos_ptr, HEAD_DIM, ROT_DIM, BLOCK_D, IS_NEOX, True)
        tl.store(rows + d, x.to(q_ptr.dtype.element_ty), mask=h_mask & (d < ROT_DIM))
    else:
        heads = (hb - num_q_blocks) * BLOCK_H + h
        h_mask = heads < num_kv_heads
        rows = k_ptr + t * k_tok_stride + heads * k_head_stride
        k = _rotate(rows, h_mask, cos_ptr, HEAD_DIM, ROT_DIM, BLOCK_D, IS_NEOX, ROTATE)
        k = k.to(k_ptr.dtype.element_ty)
        if ROTATE:
            tl.store(rows + d, k, mask=h_mask & (d < ROT_DIM))
        if WRITE_KV:
            loc = tl.load(loc_ptr + t).to(tl.int64)
            ok = (loc >= 0) & (loc < num_slots)
            loc = tl.where(ok, loc, 0)
            page = loc // page_size
            off = loc - page * page_size
            kq = _quantize(
                k.to(tl.float32), k_scale_ptr, k_scale_f, K_SCALE_MODE, K_FP8_MAX, EMULATE_FP8
            )
            kdst = kbuf_ptr + page * kb_page_stride + off * kb_off_stride + heads * kb_head_stride
            tl.store(
                kdst + d,
                kq.to(kbuf_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                mask=ok & h_mask & (d < HEAD_DIM),
            )
            dv = tl.arange(0, BLOCK_DV)[None, :]
            dv_mask = h_mask & (dv < V_HEAD_DIM)
            vsrc = v_ptr + t * v_tok_stride + heads * v_head_stride + dv
            v = tl.load(vsrc, mask=dv_mask, other=0.0)
            vq = _quantize(
                v.to(tl.float32), v_scale_ptr, v_scale_f, V_SCALE_MODE, V_FP8_MAX, EMULATE_FP8
            )
            vdst = vbuf_ptr + page * vb_page_stride + off * vb_off_stride + heads * vb_head_stride
            tl.store(
                vdst + dv,
                vq.to(vbuf_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                mask=ok & dv_mask,
            )


def _scale_args(scale: float | torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """(mode, pointer, float): 0 no scale, 1 python float, 2 device tensor."""
    if scale is None:
        return 0, dummy, 1.0
    if isinstance(scale, torch.Tensor):
        return 2, scale, 1.0
    return 1, dummy, float(scale)


def _block_h(num_heads: int, block_d: int) -> int:
    return max(1, min(triton.next_power_of_2(num_heads), max(1, 2048 // block_d)))


def launch_rope_kv(
    positions: torch.Tensor | None,
    query: torch.Tensor | None,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor | None,
    is_neox: bool,
    q_info: tuple[int, int, int] | None,  # (num_heads, token stride, head stride)
    k_info: tuple[int, int, int],
    kv: tuple | None,  # (value, v_tok, v_head, v_head_dim, kbuf, vbuf, loc, ks, vs, k_lay, v_lay)
) -> None:
    """Launch the kernel. q/positions/cos_sin_cache None: KV write only; kv None: RoPE only."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    rotate = cos_sin_cache is not None
    block_d = triton.next_power_of_2(head_size)
    num_q_heads, q_tok, q_head = q_info if q_info is not None else (0, 0, 0)
    num_kv_heads, k_tok, k_head = k_info
    block_h = _block_h(max(num_q_heads, num_kv_heads), block_d)
    num_q_blocks = triton.cdiv(num_q_heads, block_h)
    grid = (num_tokens, num_q_blocks + triton.cdiv(num_kv_heads, block_h))
    dummy = key
    if kv is not None:
        value, v_tok, v_head, v_head_dim, kbuf, vbuf, loc, ks, vs, k_lay, v_lay = kv
        k_lay: KVLayout
        v_lay: KVLayout
    else:
        value, v_tok, v_head, v_head_dim, kbuf, vbuf, loc, ks, vs = (
            key,
            0,
            0,
            1,
            key,
            key,
            key,
            None,
            None,
        )
        k_lay = v_lay = KVLayout(1, 1, 0, 0, 0, 1, 1)
    k_mode, k_sptr, k_sf = _scale_args(ks, dummy)
    v_mode, v_sptr, v_sf = _scale_args(vs, dummy)
    rope_kv_kernel[grid](
        positions if rotate else key,
        cos_sin_cache if rotate else key,
        cos_sin_cache.stride(0) if rotate else 0,
        query if query is not None else key,
        q_tok,
        q_head,
        key,
        k_tok,
        k_head,
        value,
        v_tok,
        v_head,
        kbuf,
        k_lay.page_stride,
        k_lay.offset_stride,
        k_lay.head_stride,
        vbuf,
        v_lay.page_stride,
        v_lay.offset_stride,
        v_lay.head_stride,
        loc,
        k_lay.page_size,
        k_lay.num_slots,
        k_sptr,
        v_sptr,
        k_sf,
        v_sf,
        num_q_heads,
        num_kv_heads,
        num_q_blocks,
        cos_sin_cache.shape[0] if rotate else 1,
        HEAD_DIM=head_size,
        V_HEAD_DIM=v_head_dim,
        ROT_DIM=cos_sin_cache.shape[1] if rotate else 0,
        BLOCK_D=block_d,
        BLOCK_DV=triton.next_power_of_2(v_head_dim),
        BLOCK_H=block_h,
        IS_NEOX=bool(is_neox),
        ROTATE=rotate,
        WRITE_KV=kv is not None,
        K_SCALE_MODE=k_mode,
        V_SCALE_MODE=v_mode,
        K_FP8_MAX=fp8_max(kbuf.dtype),
        V_FP8_MAX=fp8_max(vbuf.dtype),
        EMULATE_FP8=os.environ.get("TRITON_INTERPRET", "0") == "1",
        num_warps=4,
    )
