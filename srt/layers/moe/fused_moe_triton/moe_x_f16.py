"""The activations of the fp16-product MXFP4 GEMV (moe_gemv_f16.py) in its fp16 pair order.

  x16[t, 16 g + 4 c + j] = fp16(x[t, 32 g + 8 j + c] * 2**s)
                           | fp16(x[t, 32 g + 8 j + c + 4] * 2**s) << 16

the x16 word that meets nibbles c and c + 4 of packed weight word j of scale group g. For the
gate/up input, s is per token (the row's max |x| * 2**s in [2**14, 2**15); `x_to_f16`, one
program per token); the gate/up kernel stores its activations in the same order with a fixed
2**act_shift (`act_f16_shift`: gpt-oss's clamped SwiGLU bounds them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sgl_ext.launch import cached_launcher, pdl_enter


@triton.jit
def pair_position(k):
    """Element k of a row (K index) -> its fp16 slot in the pair-ordered row (see the module)."""
    r = k % 32
    j = r // 8
    c = r % 4
    return (k - r) + 2 * (4 * c + j) + (r % 8) // 4


@triton.jit
def row_f16_scale(x):
    """(2**s, 2**-s) of a float32 row x: the row's max |x| * 2**s in [2**14, 2**15)."""
    m = tl.max(tl.abs(x), axis=0)
    e = ((m.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32)  # biased exponent of the max
    s = tl.minimum(tl.maximum(141 - e, -126), 126)  # 14 - floor(log2 max), 0 and tiny: 126
    up = ((s + 127) << 23).to(tl.float32, bitcast=True)  # 2**s
    inv = ((127 - s) << 23).to(tl.float32, bitcast=True)  # 2**-s
    return up, inv


@triton.jit
def row_to_f16(x_row, x16_row, inv_ptr, K, BLOCK: tl.constexpr):
    """One row of x (K elements) -> its fp16 words in pair order, times 2**s (row_f16_scale),
    and 2**-s to *inv_ptr."""
    k = tl.arange(0, BLOCK)
    ok = k < K
    x = tl.load(x_row + k, mask=ok, other=0.0).to(tl.float32)
    up, inv = row_f16_scale(x)
    tl.store(x16_row + pair_position(k), (x * up).to(tl.float16), mask=ok)
    tl.store(inv_ptr, inv)


@triton.jit
def moe_x_to_f16_kernel(
    x_ptr,  # [T, K] bf16
    x16_ptr,  # fp16 [T, K], pair-ordered
    inv_ptr,  # float32 [T]: 2**-s
    K,
    stride_xm,
    stride_hm,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Row t of x -> its fp16 words and 2**-s (row_to_f16)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    row_to_f16(x_ptr + t * stride_xm, x16_ptr + t * stride_hm, inv_ptr + t, K, BLOCK)


@dataclass(frozen=True)
class XF16:
    """Activations as the fp16-product GEMV reads them: words fp16 [T, K] (x in pair order,
    times 2**s per row) and inv float32 [T] (2**-s)."""

    words: torch.Tensor
    inv: torch.Tensor

    @classmethod
    def empty(cls, T: int, K: int, device: torch.device) -> XF16:
        return cls(
            torch.empty(T, K, dtype=torch.float16, device=device),
            torch.empty(T, dtype=torch.float32, device=device),
        )


def x_to_f16(x: torch.Tensor, out: XF16 | None = None) -> XF16:
    """bf16 x [T, K] (rows contiguous, K % 32 == 0) -> its XF16 (into `out`, contiguous, when
    given). One program per row."""
    T, K = x.shape
    out = out if out is not None else XF16.empty(T, K, x.device)
    block = triton.next_power_of_2(K)
    cached_launcher(moe_x_to_f16_kernel)[(T,)](
        x,
        out.words,
        out.inv,
        K,
        x.stride(0),
        out.words.stride(0),
        BLOCK=block,
        num_warps=4 if block > 512 else 1,
    )
    return out


def pair_order(K: int) -> torch.Tensor:
    """int64 [K]: the pair-ordered slot of each element k (x16[..., pair_order(K)] is x in K
    order, times 2**s)."""
    k = torch.arange(K)
    r = k % 32
    return (k - r) + 2 * (4 * (r % 4) + r // 8) + (r % 8) // 4


def act_f16_shift(activation: str, alpha: float, limit: float) -> int | None:
    """The power of two the gate/up kernel scales its activations by for fp16 (|act| * 2**shift
    <= 2**15), or None when the activation is unbounded (then the float32 path runs)."""
    if activation != "swiglu_oai" or not (math.isfinite(limit) and alpha > 0):
        return None
    bound = (abs(limit) + 1.0) * max(abs(limit), 0.28 / alpha, 1.0)
    return math.floor(math.log2(2.0**15 / bound))
