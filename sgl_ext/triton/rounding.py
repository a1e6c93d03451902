"""Casts from float32 to a kernel's storage dtype that round to nearest even everywhere.

The GPU converts with round-to-nearest-even; TRITON_INTERPRET's float32 -> bfloat16 cast
truncates. Under the interpreter (EMULATE) the value is first rounded on the bfloat16 grid with
integer ops, so the cast that follows is exact and CPU tests see the GPU's bits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast_rne(x, DT: tl.constexpr, EMULATE: tl.constexpr):
    """float32 x -> dtype DT, rounded to nearest even (finite values)."""
    if EMULATE:
        if DT == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            x = b.to(tl.float32, bitcast=True)
    return x.to(DT)
