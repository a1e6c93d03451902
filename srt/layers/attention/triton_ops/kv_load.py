"""Triton helpers shared by the attention kernels: load a tile of cached K or V.

A KV buffer is addressed through its strides: slot s lives at
(s // PAGE_SIZE) * page_stride + (s % PAGE_SIZE) * off_stride + head * head_stride + d.
fp8 caches are passed as their uint8 bytes and decoded exactly with integer ops (the same code on
the GPU and under TRITON_INTERPRET, whose fp8 support is incomplete), then multiplied by the
layer's scale.
"""

from __future__ import annotations

import triton
import triton.language as tl

KV_FP8_NONE, KV_FP8_E4M3, KV_FP8_E5M2 = 0, 1, 2
SCALE_NONE, SCALE_FLOAT, SCALE_PTR = 0, 1, 2


def pow2(n: int) -> int:
    """The smallest power of two >= n (host ints; triton.next_power_of_2 is a slower
    constexpr function)."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


@triton.jit
def fp8_bytes_to_f32(b, KV_FP8: tl.constexpr):
    """uint8 fp8 codes -> float32 (exact; e4m3fn or e5m2, finite codes)."""
    x = b.to(tl.int32)
    sign = (x & 0x80) << 24
    if KV_FP8 == 1:  # e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits
        e = (x >> 3) & 0xF
        m = x & 0x7
        normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125  # m * 2^-9
    else:  # e5m2: 5 exponent bits (bias 15), 2 mantissa bits
        e = (x >> 2) & 0x1F
        m = x & 0x3
        normal = (sign | ((e + 112) << 23) | (m << 21)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.0000152587890625  # m * 2^-16
    sub = tl.where((x & 0x80) != 0, -sub, sub)
    return tl.where(e == 0, sub, normal)


@triton.jit
def load_kv_tile(
    buf_ptr,
    slot,
    mask,
    head,
    dims,
    page_stride,
    off_stride,
    head_stride,
    scale_ptr,
    scale_f,
    PAGE_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    OUT_F32: tl.constexpr = True,
):
    """[len(slot), len(dims)]: the cached rows `slot` (int64) of one head, float32 (fp8 caches:
    always; 16-bit caches keep their dtype when OUT_F32 is False, for 16-bit tensor-core dots)."""
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    ptr = buf_ptr + page[:, None] * page_stride + off[:, None] * off_stride
    ptr = ptr + head * head_stride + dims[None, :]
    x = tl.load(ptr, mask=mask, other=0)
    if KV_FP8 != 0:
        x = fp8_bytes_to_f32(x, KV_FP8)
        if SCALE_MODE == 1:
            x = x * scale_f
        elif SCALE_MODE == 2:
            x = x * tl.load(scale_ptr).to(tl.float32)
    if OUT_F32:
        x = x.to(tl.float32)
    return x
