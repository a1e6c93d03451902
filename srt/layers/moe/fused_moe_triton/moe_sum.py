"""moe_sum: a routed-expert layer's top-k combine, [T * k, H] pair rows -> [T, H], one launch.

Below both the routed-expert path (`fused_moe.py`, which combines its pair rows) and
`TopKPairs.combine` (a layer's rows combined by whoever needs the [T, H] tensor).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_ext import settings
from sgl_ext.launch import cached_launcher, cast_rne, pdl_enter


@triton.jit
def moe_sum_kernel(
    pairs_ptr,
    out_ptr,
    H,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EMULATE: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    """The top-k combine: out[t] = sum over j of pairs[t * TOP_K + j] ([T * k, H] -> [T, H],
    rows contiguous), in float32 in the order j = 0..k-1, rounded once to out's dtype (to
    nearest even under the interpreter too: EMULATE)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (t * TOP_K + j) * H + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + h, cast_rne(acc, out_ptr.dtype.element_ty, EMULATE), mask=ok)


def moe_sum(pairs: torch.Tensor, T: int, k: int) -> torch.Tensor:
    """[T * k, H] (pair order, contiguous) -> [T, H]: each token's k rows summed in float32 in
    pair order, rounded once (one launch; torch's strided reduction took ~5 µs a layer at T = 1)."""
    H = pairs.shape[1]
    out = torch.empty(T, H, dtype=pairs.dtype, device=pairs.device)
    block_h = min(1024, triton.next_power_of_2(H))
    cached_launcher(moe_sum_kernel)[(T, triton.cdiv(H, block_h))](
        pairs, out, H, TOP_K=k, BLOCK_H=block_h, EMULATE=settings.get().interpret, num_warps=4
    )
    return out
