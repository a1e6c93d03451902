"""Triton kernel: RoPE on q/k in place, and the rotated K plus V stored into the KV cache.

One program handles one token and a block of heads: program_id(1) < num_q_blocks rotates query
heads, the rest rotate key heads and (WRITE_KV) store K and V into the cache slot of the token.
The same kernel with ROTATE=False is the standalone KV write.

The rotary dims of a head are addressed as a [HALF, 2] grid of pairs (i, j): neox pairs dim i
with dim i + HALF, GPT-J pairs dim 2i with 2i + 1. Both load as one contiguous tile and are split
in registers, so neither needs a gather.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sgl_ext._backend import interpreting
from sgl_ext._common import KVLayout, fp8_max


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
def _quantize(x, scale, HAS_SCALE: tl.constexpr, FP8_MAX: tl.constexpr, EMULATE: tl.constexpr):
    """x (fp32) / scale (IEEE division), clamped to the fp8 range when FP8_MAX > 0."""
    if HAS_SCALE:
        x = tl.math.div_rn(x, tl.zeros_like(x) + scale)
    if FP8_MAX > 0:
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
        if EMULATE:
            if FP8_MAX == 448.0:  # e4m3fn
                x = _round_to_fp8_grid(x, 3, -6)
            else:  # e5m2
                x = _round_to_fp8_grid(x, 2, -14)
    return x


@triton.jit
def _load_scale(ptr, f, MODE: tl.constexpr):
    if MODE == 2:
        return tl.load(ptr).to(tl.float32)
    return f


@triton.jit
def _pair_offsets(
    BLOCK_HALF: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr
):  # -> [1, BLOCK_HALF, 2] dim offsets and mask
    i = tl.arange(0, BLOCK_HALF)[None, :, None]
    j = tl.arange(0, 2)[None, None, :]
    if IS_NEOX:
        d = i + j * HALF
    else:
        d = 2 * i + j
    return d, (i < HALF) & (j < 2)


@triton.jit
def _rotate_pairs(x, cos, sin):
    """x [H, HALF, 2] fp32 pairs (a, b) -> (a cos - b sin, b cos + a sin)."""
    a, b = tl.split(x)
    return tl.join(a * cos - b * sin, b * cos + a * sin)


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
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_NEOX: tl.constexpr,
    ROTATE: tl.constexpr,
    WRITE_KV: tl.constexpr,
    K_SCALE_MODE: tl.constexpr,  # 0 none, 1 python float, 2 device tensor
    V_SCALE_MODE: tl.constexpr,
    K_FP8_MAX: tl.constexpr,  # 0 when the buffer is not fp8
    V_FP8_MAX: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)[:, None, None]  # [BLOCK_H, 1, 1]
    HALF: tl.constexpr = ROT_DIM // 2
    d, pair_mask = _pair_offsets(BLOCK_HALF, HALF, IS_NEOX)  # [1, BLOCK_HALF, 2]
    ci = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]: cos/sin column of each pair
    if USE_PDL:
        # Programmatic dependent launch: everything above overlapped the previous kernel; wait
        # for its results before the first load, and let the next kernel start launching.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if ROTATE:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)  # memory safety; debug checks report
        cs_row = cos_sin_ptr + pos * cs_stride
    else:
        cs_row = cos_sin_ptr  # unused: there are no query blocks without rotation
    if hb < num_q_blocks:
        heads = hb * BLOCK_H + h
        mask = (heads < num_q_heads) & pair_mask
        ptrs = q_ptr + t * q_tok_stride + heads * q_head_stride + d
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        cos = tl.load(cs_row + ci, mask=ci < HALF, other=0.0)
        sin = tl.load(cs_row + HALF + ci, mask=ci < HALF, other=0.0)
        tl.store(ptrs, _rotate_pairs(x, cos, sin).to(q_ptr.dtype.element_ty), mask=mask)
    else:
        heads = (hb - num_q_blocks) * BLOCK_H + h  # [BLOCK_H, 1, 1]
        h_ok = heads < num_kv_heads
        mask = h_ok & pair_mask
        k_row = k_ptr + t * k_tok_stride + heads * k_head_stride
        if WRITE_KV:
            # Issue every independent load first: slot, V row, K tail, scales.
            loc = tl.load(loc_ptr + t).to(tl.int64)
            dv = tl.arange(0, BLOCK_DV)[None, None, :]
            dv_mask = h_ok & (dv < V_HEAD_DIM)
            v = tl.load(v_ptr + t * v_tok_stride + heads * v_head_stride + dv, mask=dv_mask)
            k_scale = _load_scale(k_scale_ptr, k_scale_f, K_SCALE_MODE)
            v_scale = _load_scale(v_scale_ptr, v_scale_f, V_SCALE_MODE)
            if BLOCK_TAIL > 0:  # pass-through dims of K (partial rotary) go to the cache too
                dt = ROT_DIM + tl.arange(0, BLOCK_TAIL)[None, None, :]
                t_mask = h_ok & (dt < HEAD_DIM)
                k_tail = tl.load(k_row + dt, mask=t_mask)
        k = tl.load(k_row + d, mask=mask, other=0.0)
        if ROTATE:
            cos = tl.load(cs_row + ci, mask=ci < HALF, other=0.0)
            sin = tl.load(cs_row + HALF + ci, mask=ci < HALF, other=0.0)
            k = _rotate_pairs(k.to(tl.float32), cos, sin).to(k_ptr.dtype.element_ty)
            tl.store(k_row + d, k, mask=mask)
        if WRITE_KV:
            ok = (loc >= 0) & (loc < num_slots)  # other slots are skipped, never written
            loc = tl.where(ok, loc, 0)
            page = loc // page_size
            off = loc - page * page_size
            kdst = kbuf_ptr + page * kb_page_stride + off * kb_off_stride + heads * kb_head_stride
            vdst = vbuf_ptr + page * vb_page_stride + off * vb_off_stride + heads * vb_head_stride
            KT = kbuf_ptr.dtype.element_ty
            kq = _quantize(k.to(tl.float32), k_scale, K_SCALE_MODE > 0, K_FP8_MAX, EMULATE_FP8)
            tl.store(kdst + d, kq.to(KT), mask=ok & mask)
            if BLOCK_TAIL > 0:
                kt = _quantize(k_tail.to(tl.float32), k_scale, K_SCALE_MODE > 0, K_FP8_MAX,
                               EMULATE_FP8)  # fmt: skip
                tl.store(kdst + dt, kt.to(KT), mask=ok & t_mask)
            vq = _quantize(v.to(tl.float32), v_scale, V_SCALE_MODE > 0, V_FP8_MAX, EMULATE_FP8)
            tl.store(vdst + dv, vq.to(vbuf_ptr.dtype.element_ty), mask=ok & dv_mask)


def _scale_args(scale: float | torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """(mode, pointer, float): 0 no scale, 1 python float, 2 device tensor."""
    if scale is None:
        return 0, dummy, 1.0
    if isinstance(scale, torch.Tensor):
        return 2, scale, 1.0
    return 1, dummy, float(scale)


def launch_config(num_tokens: int, max_heads: int, head_dim: int) -> tuple[int, int]:
    """(heads per program, num_warps): small batches split heads finer for parallelism."""
    override = os.environ.get("SGL_EXT_TRITON_CONFIG")  # "block_h,num_warps", for tuning only
    if override:
        bh, nw = (int(x) for x in override.split(","))
        return bh, nw
    # Measured on the H100 (benchmarks/NOTES.md): few tokens want many small programs (one warp,
    # one head each) to spread latency; many tokens want ~1-2K elements per program.
    if num_tokens <= 8:
        elems = 128
    elif num_tokens <= 32:
        elems = 256
    elif num_tokens <= 128:
        elems = 512
    elif num_tokens <= 4096:
        elems = 1024
    else:
        elems = 2048
    block_h = max(1, min(triton.next_power_of_2(max_heads), elems // head_dim))
    if num_tokens <= 128 or 1024 < num_tokens <= 4096:
        num_warps = 1
    elif num_tokens <= 1024:
        num_warps = 2
    else:
        num_warps = max(1, min(8, block_h * head_dim // 512))
    return block_h, num_warps


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
    enable_pdl: bool | None = None,
) -> None:
    """Launch the kernel. q/positions/cos_sin_cache None: KV write only; kv None: RoPE only."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    rotate = cos_sin_cache is not None
    rot = cos_sin_cache.shape[1] if rotate else 0
    num_q_heads, q_tok, q_head = q_info if q_info is not None else (0, 0, 0)
    num_kv_heads, k_tok, k_head = k_info
    block_h, num_warps = launch_config(num_tokens, max(num_q_heads, num_kv_heads), head_size)
    num_q_blocks = triton.cdiv(num_q_heads, block_h)
    grid = (num_tokens, num_q_blocks + triton.cdiv(num_kv_heads, block_h))
    if kv is not None:
        value, v_tok, v_head, v_head_dim, kbuf, vbuf, loc, ks, vs, k_lay, v_lay = kv
    else:
        value, v_tok, v_head, v_head_dim, kbuf, vbuf, loc, ks, vs = (
            key, 0, 0, 1, key, key, key, None, None,
        )  # fmt: skip
        k_lay = v_lay = KVLayout(1, 1, 0, 0, 0, 1, 1)
    k_mode, k_sptr, k_sf = _scale_args(ks, key)
    v_mode, v_sptr, v_sf = _scale_args(vs, key)
    interp = interpreting()
    if enable_pdl is None:
        enable_pdl = key.is_cuda and torch.cuda.get_device_capability(key.device)[0] >= 9
    use_pdl = bool(enable_pdl) and not interp
    tail = head_size - rot
    extra = {"launch_pdl": True} if use_pdl else {}
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
        ROT_DIM=rot,
        BLOCK_HALF=triton.next_power_of_2(max(1, rot // 2)),
        BLOCK_TAIL=triton.next_power_of_2(tail) if tail > 0 else 0,
        BLOCK_DV=triton.next_power_of_2(v_head_dim),
        BLOCK_H=block_h,
        IS_NEOX=bool(is_neox),
        ROTATE=rotate,
        WRITE_KV=kv is not None,
        K_SCALE_MODE=k_mode,
        V_SCALE_MODE=v_mode,
        K_FP8_MAX=fp8_max(kbuf.dtype),
        V_FP8_MAX=fp8_max(vbuf.dtype),
        EMULATE_FP8=interp,
        USE_PDL=use_pdl,
        num_warps=num_warps,
        **extra,
    )
