"""Flash-decoding's second kernel: one program per (request, query head) merges the float32
partial outputs and log-sum-exps of the request's KV chunks (decode_attention.py, NUM_SPLITS > 1)
and adds the attention-sink column. A separate launch on purpose: with programmatic dependent
launch its programs are resident before the chunks finish, and merging in the chunks' last
program instead (a ticket counter with release / acquire) made the decode step slower
(docs/performance.md).

With a cascade (prefix_decode.py) a row has PREFIX_SPLITS more slots after its NUM_SPLITS, the
prefix kernel's chunks, merged only for a row with PrefixLens[b] > 0: another row's prefix slots
hold stale data, which is masked out of the loads (w = 0 would not cancel a stale NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_ext.launch import pdl_enter
from srt.layers.attention.triton_ops.kv_load import pow2


def decode_scratch_shape(
    batch_size: int, num_q_heads: int, v_head_dim: int, splits: int
) -> tuple[int, int, int, int]:
    """Shape of the float32 partial-output scratch [B, Hq, splits, BLOCK_DV] (the log-sum-exp
    scratch is its first three dims; rows are new tokens for the extend). `splits`: the slots
    in all, with a cascade the stage-1 splits + the prefix chunks P."""
    return batch_size, num_q_heads, splits, max(16, pow2(v_head_dim))


def merge_scratch(
    q: torch.Tensor,
    shape: tuple[int, int, int, int],
    mid_o: torch.Tensor | None,
    mid_lse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge kernel's inputs: mid_o `shape` (`decode_scratch_shape`) and mid_lse shape[:3],
    float32 contiguous; allocated on q's device where None, else checked (a ValueError naming
    the one that is not)."""
    mid_o = q.new_empty(shape, dtype=torch.float32) if mid_o is None else mid_o
    mid_lse = q.new_empty(shape[:3], dtype=torch.float32) if mid_lse is None else mid_lse
    for name, t, want in (("mid_o", mid_o, shape), ("mid_lse", mid_lse, shape[:3])):
        if tuple(t.shape) != want or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be float32 contiguous {want}")
    return mid_o, mid_lse


@triton.jit
def merge_kernel(
    MidO,
    MidLse,
    Out,
    Sinks,
    PrefixLens,  # PREFIX_SPLITS > 0: int32 [B]
    stride_mid_b,
    stride_mid_h,
    stride_ot,
    stride_oh,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PREFIX_SPLITS: tl.constexpr = 0,
    BLOCK_S: tl.constexpr = 1,  # PREFIX_SPLITS > 0: NUM_SPLITS + PREFIX_SPLITS, a power of two up
    USE_PDL: tl.constexpr = False,
):
    """Out[b, h] = the chunks' partial outputs weighted by their softmax mass (+ the sink)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    if HAS_SINKS:  # a weight: loaded while the chunks run
        sink = tl.load(Sinks + h).to(tl.float32)
    if PREFIX_SPLITS > 0:  # the slots this row merges (the host's metadata: read early too)
        n = NUM_SPLITS + tl.where(tl.load(PrefixLens + b) > 0, PREFIX_SPLITS, 0)
    pdl_enter(USE_PDL)
    if PREFIX_SPLITS > 0:
        s = tl.arange(0, BLOCK_S)
        valid = s < n
    else:
        s = tl.arange(0, NUM_SPLITS)
    dv = tl.arange(0, BLOCK_DV)
    row = b * stride_mid_b + h * stride_mid_h + s  # [NUM_SPLITS] or [BLOCK_S]
    if PREFIX_SPLITS > 0:
        lse = tl.load(MidLse + row, mask=valid, other=float("-inf"))
    else:
        lse = tl.load(MidLse + row)
    m = tl.max(lse, axis=0)
    if HAS_SINKS:
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)  # [NUM_SPLITS]; 0 for empty chunks
    den = tl.sum(w, axis=0)
    if HAS_SINKS:
        den += tl.exp(sink - m)
    if PREFIX_SPLITS > 0:
        o = tl.load(MidO + row[:, None] * BLOCK_DV + dv[None, :], mask=valid[:, None], other=0.0)
    else:
        o = tl.load(MidO + row[:, None] * BLOCK_DV + dv[None, :])  # [NUM_SPLITS, BLOCK_DV]
    out = tl.sum(w[:, None] * o, axis=0) / den
    o_ptr = Out + b * stride_ot + h * stride_oh + dv
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=dv < DV)
