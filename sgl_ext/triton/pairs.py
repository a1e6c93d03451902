"""Triton helpers of the fused RoPE + KV-write kernel: 16-bit pair packing, rotary pair
loads/stores for the neox and GPT-J layouts, fp8 scales and quantisation."""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_ext.triton.rounding import cast_rne


@triton.jit
def round_to_fp8_grid(x, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
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
def quantize(
    x,
    inv_scale,
    HAS_SCALE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EMULATE: tl.constexpr,
    DT: tl.constexpr,
):
    """x (fp32) * inv_scale as the cache dtype DT. fp8 (FP8_MAX > 0): finite values saturate to
    +-FP8_MAX, NaN stays NaN, +-inf stays +-inf in e5m2 and becomes NaN in e4m3fn (no inf)."""
    if HAS_SCALE:
        x = x * inv_scale
    if FP8_MAX > 0:
        INF: tl.constexpr = float("inf")
        big = tl.abs(x) > FP8_MAX  # false for NaN
        sat = tl.where(x < 0, -FP8_MAX, FP8_MAX)
        if FP8_MAX == 448.0:  # e4m3fn
            x = tl.where(big, tl.where(tl.abs(x) < INF, sat, float("nan")), x)
            if EMULATE:
                x = round_to_fp8_grid(x, 3, -6)
        else:  # e5m2
            x = tl.where(big & (tl.abs(x) < INF), sat, x)
            if EMULATE:
                x = round_to_fp8_grid(x, 2, -14)
        # The hardware cast saturates (cvt .satfinite turns inf into the largest value) and the
        # interpreter's may not keep NaN: set the non-finite codes' bits explicitly.
        b = x.to(DT).to(tl.uint8, bitcast=True).to(tl.int32)
        b = tl.where(x != x, 127, b)  # NaN: 0x7F in both formats
        if FP8_MAX != 448.0:
            b = tl.where(x == INF, 124, tl.where(x == -INF, 252, b))  # e5m2 +-inf: 0x7C, 0xFC
        return b.to(tl.uint8).to(DT, bitcast=True)
    return cast_rne(x, DT, EMULATE)  # round to nearest even under the interpreter too


@triton.jit
def inplace_fence():
    """A CTA barrier before a program's first store into one of its inputs (query or key, which
    the op rotates in place). Every load a program issued before it has completed (bar.sync
    performs the prior accesses of all its threads), so no thread can read an element another
    warp already overwrote. Without it that happened: Triton rematerialises a small tile's load
    in each layout that uses it (a tile of fewer elements than threads counts as cheap to load
    again), e.g. the key's pairs once for the in-place store and once for an fp8 cache's byte
    stores, and a warp that reached its copy of the load late read the rotated key and stored
    it rotated twice into the cache; replicated layouts load one element in several warps too."""
    tl.debug_barrier()


@triton.jit
def rotate_pair(a, b, cos, sin):
    """RoPE on fp32 pairs: (a cos - b sin, b cos + a sin), each one product then one FMA,
    spelled out so that every kernel that rotates (rope_kv's query and key programs, the qkv
    GEMM's epilogue) gives the same bits; left to the compiler, the contraction into an FMA
    can pick either product."""
    return tl.fma(a, cos, -(b * sin)), tl.fma(b, cos, a * sin)


@triton.jit
def load_scale(ptr, f, MODE: tl.constexpr):
    """Mode 2: the device-tensor scale as a [1] fp32 tensor; mode 1: the float argument f, which
    the launcher already inverted; 0: unused."""
    one = tl.full((1,), 1.0, tl.float32)
    if MODE == 2:
        return one * tl.load(ptr).to(tl.float32)
    return one * f


@triton.jit
def reciprocal(s, MODE: tl.constexpr):
    """1 / s as one IEEE fp32 division for a device-tensor scale (MODE 2); other modes pass s
    through (a float scale arrives inverted). Call it after every load is issued: the division's
    slow-path CALL is a scheduling barrier, and loads placed after it would wait for it."""
    if MODE != 2:
        return s
    return tl.math.div_rn(tl.full((1,), 1.0, tl.float32), s)


@triton.jit
def unpack16(w, IS_BF16: tl.constexpr):
    """int32 words holding two 16-bit floats (little-endian) -> (low, high) in fp32."""
    if IS_BF16:
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    else:
        lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def pack16(lo, hi, DT: tl.constexpr):
    """Two fp32 tensors -> int32 words of two 16-bit floats of dtype DT (lo in the low half)."""
    lo16 = lo.to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(DT).to(tl.int16, bitcast=True).to(tl.int32)
    return lo16 | (hi16 << 16)


@triton.jit
def load_pairs(row, c, mask, HALF: tl.constexpr, MODE: tl.constexpr, IS_BF16: tl.constexpr):
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
        a, b = unpack16(w, IS_BF16)
    return a, b


@triton.jit
def store_pairs(row, c, mask, a, b, HALF: tl.constexpr, MODE: tl.constexpr):
    """Store fp32 pairs (a, b) to rows of the row pointer's dtype (layout as in load_pairs)."""
    DT: tl.constexpr = row.dtype.element_ty
    if MODE == 0:
        tl.store(row + c, a.to(DT), mask=mask)
        tl.store(row + HALF + c, b.to(DT), mask=mask)
    elif MODE == 1:
        tl.store(row + 2 * c, a.to(DT), mask=mask)
        tl.store(row + 2 * c + 1, b.to(DT), mask=mask)
    else:
        tl.store(row.to(tl.pointer_type(tl.int32)) + c, pack16(a, b, DT), mask=mask)
