"""Triton kernel: RoPE on q/k in place, and the rotated K plus V stored into the KV cache.

One program handles one token and a block of heads: program_id(1) < num_q_blocks rotates query
heads, the rest rotate key heads and (WRITE_KV) store K and V into the cache slot of the token.
The same kernel with ROTATE=False is the standalone KV write.

The rotary dims of a head are addressed as a [HALF, 2] grid of pairs (i, j): neox pairs dim i
with dim i + HALF, GPT-J pairs dim 2i with 2i + 1. Both load as one contiguous tile and are split
in registers, so neither needs a gather.
"""

from __future__ import annotations

import functools
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
    normal = ((bits + ((1 << (SHIFT - 1)) - 1) + lsb) & ~((1 << SHIFT) - 1)).to(
        tl.float32, bitcast=True
    )
    QUANT: tl.constexpr = 2.0 ** (MIN_EXP - MANT)
    MAGIC: tl.constexpr = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to integer
    sub = ((tl.abs(x) * (1.0 / QUANT) + MAGIC) - MAGIC) * QUANT
    # Copy x's sign bit (tiny negatives round to -0.0; `-sub` would be 0 - sub = +0.0).
    sub = (sub.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 2.0**MIN_EXP, sub, normal)


@triton.jit
def _quantize(x, inv_scale, HAS_SCALE: tl.constexpr, FP8_MAX: tl.constexpr, EMULATE: tl.constexpr):
    """x (fp32) * inv_scale, clamped to the fp8 range when FP8_MAX > 0."""
    if HAS_SCALE:
        x = x * inv_scale
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
    """The scale as a [1] fp32 tensor (mode 2: device tensor, 1: float argument, 0: unused)."""
    one = tl.full((1,), 1.0, tl.float32)
    if MODE == 2:
        return one * tl.load(ptr).to(tl.float32)
    return one * f


@triton.jit
def _reciprocal(s):
    """1 / s as one IEEE fp32 division. Call it after every load is issued: the division's
    slow-path CALL is a scheduling barrier, and loads placed after it would wait for it."""
    return tl.math.div_rn(tl.full((1,), 1.0, tl.float32), s)


@triton.jit
def _unpack16(w, IS_BF16: tl.constexpr):
    """int32 words holding two 16-bit floats (little-endian) -> (low, high) in fp32."""
    if IS_BF16:
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    else:
        lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _pack16(lo, hi, DT: tl.constexpr):
    """Two fp32 tensors -> int32 words of two 16-bit floats of dtype DT (lo in the low half)."""
    lo16 = lo.to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(DT).to(tl.int16, bitcast=True).to(tl.int32)
    return lo16 | (hi16 << 16)


@triton.jit
def _load_pairs(row, c, mask, HALF: tl.constexpr, MODE: tl.constexpr, IS_BF16: tl.constexpr):
    """The rotary pairs (a, b) of rows [BH, 1] at pair index c [1, BLOCK_HALF], as fp32.

    MODE 0: neox, b sits HALF dims after a; 1: GPT-J, adjacent dims; 2: GPT-J with each 16-bit
    pair loaded as one int32 word (vectorised, no strided access).
    """
    if MODE == 0:
        a = tl.load(row + c, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(row + HALF + c, mask=mask, other=0.0).to(tl.float32)
    elif MODE == 1:
        a = tl.load(row + 2 * c, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(row + 2 * c + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.load(row.to(tl.pointer_type(tl.int32)) + c, mask=mask, other=0)
        a, b = _unpack16(w, IS_BF16)
    return a, b


@triton.jit
def _store_pairs(row, c, mask, a, b, HALF: tl.constexpr, MODE: tl.constexpr):
    """Store fp32 pairs (a, b) to rows of the row pointer's dtype (layout as in _load_pairs)."""
    DT: tl.constexpr = row.dtype.element_ty
    if MODE == 0:
        tl.store(row + c, a.to(DT), mask=mask)
        tl.store(row + HALF + c, b.to(DT), mask=mask)
    elif MODE == 1:
        tl.store(row + 2 * c, a.to(DT), mask=mask)
        tl.store(row + 2 * c + 1, b.to(DT), mask=mask)
    else:
        tl.store(row.to(tl.pointer_type(tl.int32)) + c, _pack16(a, b, DT), mask=mask)


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
    num_slots,
    k_scale_ptr,
    v_scale_ptr,
    k_scale_f,
    v_scale_f,
    num_q_heads,
    num_kv_heads,
    num_q_blocks,
    max_pos,
    PAGE_SIZE: tl.constexpr,  # constexpr: a power of two becomes a shift, no 64-bit division
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,  # query heads per program
    BLOCK_HKV: tl.constexpr,  # key/value heads per program
    PAIR_MODE: tl.constexpr,  # see _load_pairs
    KBUF_PAIR_MODE: tl.constexpr,  # pair layout used for the K-cache store
    IS_BF16: tl.constexpr,
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
    h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    HALF: tl.constexpr = ROT_DIM // 2
    c = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]: pair index = cos/sin column
    c_ok = c < HALF
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
        mask = (heads < num_q_heads) & c_ok
        row = q_ptr + t * q_tok_stride + heads * q_head_stride
        a, b = _load_pairs(row, c, mask, HALF, PAIR_MODE, IS_BF16)
        cos = tl.load(cs_row + c, mask=c_ok, other=0.0)
        sin = tl.load(cs_row + HALF + c, mask=c_ok, other=0.0)
        _store_pairs(row, c, mask, a * cos - b * sin, b * cos + a * sin, HALF, PAIR_MODE)
    else:
        kh = (hb - num_q_blocks) * BLOCK_HKV + tl.arange(0, BLOCK_HKV)[:, None]  # [BHKV, 1]
        h_ok = kh < num_kv_heads
        k_row = k_ptr + t * k_tok_stride + kh * k_head_stride
        if WRITE_KV:
            # Issue every independent load first: slot, V row, K tail, scales.
            # [1, 1] rather than a scalar: newer Triton interpreters reject scalar & tensor masks.
            loc = tl.load(loc_ptr + t + tl.zeros([1, 1], tl.int32)).to(tl.int64)
            dv = tl.arange(0, BLOCK_DV)[None, :]
            dv_mask = h_ok & (dv < V_HEAD_DIM)
            v = tl.load(v_ptr + t * v_tok_stride + kh * v_head_stride + dv, mask=dv_mask)
            k_s = _load_scale(k_scale_ptr, k_scale_f, K_SCALE_MODE)
            v_s = _load_scale(v_scale_ptr, v_scale_f, V_SCALE_MODE)
            if BLOCK_TAIL > 0:  # pass-through dims of K (partial rotary) go to the cache too
                dt = ROT_DIM + tl.arange(0, BLOCK_TAIL)[None, :]
                t_mask = h_ok & (dt < HEAD_DIM)
                k_tail = tl.load(k_row + dt, mask=t_mask)
        km = h_ok & c_ok
        if ROTATE:
            ka, kb = _load_pairs(k_row, c, km, HALF, PAIR_MODE, IS_BF16)
            cos = tl.load(cs_row + c, mask=c_ok, other=0.0)
            sin = tl.load(cs_row + HALF + c, mask=c_ok, other=0.0)
            KT: tl.constexpr = k_ptr.dtype.element_ty
            # Round to the key dtype: the cache stores exactly the key the op returns.
            ka, kb = (
                (ka * cos - kb * sin).to(KT).to(tl.float32),
                (kb * cos + ka * sin).to(KT).to(tl.float32),
            )
            _store_pairs(k_row, c, km, ka, kb, HALF, PAIR_MODE)
        else:  # plain KV write: the whole head as one contiguous "pair" tile
            ka, kb = _load_pairs(k_row, c, km, HALF, 0, IS_BF16)
        if WRITE_KV:
            ok = (loc >= 0) & (loc < num_slots)  # other slots are skipped, never written
            loc = tl.where(ok, loc, 0)
            page = loc // PAGE_SIZE
            off = loc - page * PAGE_SIZE
            kdst = kbuf_ptr + page * kb_page_stride + off * kb_off_stride + kh * kb_head_stride
            vdst = vbuf_ptr + page * vb_page_stride + off * vb_off_stride + kh * vb_head_stride
            KS: tl.constexpr = K_SCALE_MODE > 0
            k_inv = _reciprocal(k_s)  # after all loads (see _reciprocal); unused without scale
            v_inv = _reciprocal(v_s)
            qa = _quantize(ka, k_inv, KS, K_FP8_MAX, EMULATE_FP8)
            qb = _quantize(kb, k_inv, KS, K_FP8_MAX, EMULATE_FP8)
            _store_pairs(kdst, c, km & ok, qa, qb, HALF, KBUF_PAIR_MODE if ROTATE else 0)
            if BLOCK_TAIL > 0:
                kt = _quantize(k_tail.to(tl.float32), k_inv, KS, K_FP8_MAX, EMULATE_FP8)
                tl.store(kdst + dt, kt.to(kbuf_ptr.dtype.element_ty), mask=t_mask & ok)
            vq = _quantize(v.to(tl.float32), v_inv, V_SCALE_MODE > 0, V_FP8_MAX, EMULATE_FP8)
            tl.store(vdst + dv, vq.to(vbuf_ptr.dtype.element_ty), mask=dv_mask & ok)


@functools.cache
def _pdl_capable(device_index: int | None) -> bool:
    """Programmatic dependent launch needs Hopper (sm_90) or newer."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _pow2(n: int) -> int:
    """Smallest power of two >= n (plain Python: triton.next_power_of_2 costs ~7 µs a call)."""
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _scale_args(scale: float | torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """(mode, pointer, float): 0 no scale, 1 python float, 2 device tensor."""
    if scale is None:
        return 0, dummy, 1.0
    if isinstance(scale, torch.Tensor):
        return 2, scale, 1.0
    return 1, dummy, float(scale)


def _word_aligned(t: torch.Tensor, *strides: int) -> bool:
    """Every head row of t starts on a 4-byte boundary (16-bit pairs load as int32 words)."""
    return t.data_ptr() % 4 == 0 and all(s % 2 == 0 for s in strides)


def _strides(lay: KVLayout) -> tuple[int, int, int]:
    return lay.page_stride, lay.offset_stride, lay.head_stride


def _gptj_mode(rows: list[tuple[torch.Tensor, int, int]]) -> int:
    """2: 16-bit GPT-J pairs as int32 words when every row is 4-byte aligned, else 1 (strided).

    rows: (tensor, token stride, head stride) of query and key.
    """
    if rows[0][0].dtype not in (torch.bfloat16, torch.float16):
        return 1
    return 2 if all(_word_aligned(t, ts, hs) for t, ts, hs in rows) else 1


def launch_config(num_tokens: int, max_heads: int, head_dim: int) -> tuple[int, int]:
    """(heads per program, num_warps): small batches split heads finer for parallelism."""
    override = os.environ.get("SGL_EXT_TRITON_CONFIG")  # "block_h,num_warps", for tuning only
    if override:
        bh, nw = (int(x) for x in override.split(","))
        return bh, nw
    # Measured on the H100 (benchmarks/NOTES.md): few tokens want many small programs (one head
    # each) to spread latency; more tokens want ~1K elements per program, and very many tokens
    # whole tokens per program (up to 32 heads) to amortise the position and slot loads.
    if num_tokens <= 8:
        block_h = 1
    elif num_tokens <= 64:
        block_h = max(1, 512 // head_dim)
    elif num_tokens <= 4096:
        block_h = max(1, 1024 // head_dim)
    else:
        block_h = max(1, min(32, 4096 // head_dim))
    block_h = min(block_h, _pow2(max_heads))
    num_warps = 4
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
    # A plain KV write moves each head as one neox-style "pair" tile (plus an odd tail dim).
    rot = cos_sin_cache.shape[1] if rotate else head_size - head_size % 2
    num_q_heads, q_tok, q_head = q_info if q_info is not None else (0, 0, 0)
    num_kv_heads, k_tok, k_head = k_info
    block_h, num_warps = launch_config(num_tokens, max(num_q_heads, num_kv_heads), head_size)
    block_hkv = min(block_h, _pow2(num_kv_heads))
    num_q_blocks = _cdiv(num_q_heads, block_h)
    grid = (num_tokens, num_q_blocks + _cdiv(num_kv_heads, block_hkv))
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
        enable_pdl = key.is_cuda and _pdl_capable(key.device.index)
    use_pdl = bool(enable_pdl) and not interp
    tail = head_size - rot
    pair_mode = 0
    if rotate and not is_neox:
        pair_mode = _gptj_mode([(query, q_tok, q_head), (key, k_tok, k_head)])
    kbuf_mode = pair_mode
    if pair_mode == 2 and (kbuf.dtype != key.dtype or not _word_aligned(kbuf, *_strides(k_lay))):
        kbuf_mode = 1
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
        k_lay.num_slots,
        k_sptr,
        v_sptr,
        k_sf,
        v_sf,
        num_q_heads,
        num_kv_heads,
        num_q_blocks,
        cos_sin_cache.shape[0] if rotate else 1,
        PAGE_SIZE=k_lay.page_size,
        HEAD_DIM=head_size,
        V_HEAD_DIM=v_head_dim,
        ROT_DIM=rot,
        BLOCK_HALF=_pow2(max(1, rot // 2)),
        BLOCK_TAIL=_pow2(tail) if tail > 0 else 0,
        BLOCK_DV=_pow2(v_head_dim),
        BLOCK_H=block_h,
        BLOCK_HKV=block_hkv,
        PAIR_MODE=pair_mode,
        KBUF_PAIR_MODE=kbuf_mode,
        IS_BF16=key.dtype == torch.bfloat16,
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
