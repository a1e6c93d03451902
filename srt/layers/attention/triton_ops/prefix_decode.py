"""Cascade decode attention: a shared prompt prefix read once per group of requests per step.

With the radix prefix cache many decoding requests hold the same KV slots for a long prompt
prefix (a system prompt). `_decode_kernel` (decode_attention.py) reads each request's keys on its
own, so such a batch reads every shared prefix once per request and step. With `CascadeArgs` the
decode launch splits the keys of each grouped request in two:

- the prefix kernel here: one program per (work item, KV head, prefix chunk) loads each K/V tile
  of the chunk once and runs it through the online softmax of all the item's query rows at once
  (BLOCK_R requests x BLOCK_H query heads of the KV head: one [BLOCK_R * BLOCK_H, D] query tile,
  tensor-core dots), writing each row's partial output and log-sum-exp to the flash-decoding
  scratch at slots NUM_SPLITS .. NUM_SPLITS + P - 1;
- `_decode_kernel` (HAS_PREFIX) covers each row's own keys [prefix_lens[b], seq_len), split into
  NUM_SPLITS chunks as without a prefix, and always writes its partials to slots 0 .. NUM_SPLITS-1;
- the merge kernel (decode_merge.py) merges all NUM_SPLITS + P slots of the rows with a prefix
  and the first NUM_SPLITS of the others (whose prefix slots hold stale data).

The host (the scheduler) groups the requests and fills the three tensors in place, so a decode
CUDA graph keeps their shapes (W work items per bucket). Its contract, not checked on the device:
every row r in rows[row_start:row_end] of an item has prefix_lens[r] == prefix_len <=
seq_lens[r] - 1 (never the newest key) and the same first prefix_len slots as the item's
req_pool_index in req_to_token; a row appears in at most one item, and a row with
prefix_lens[r] > 0 in exactly one (its prefix keys are read by no other program); rows with
prefix_lens 0 are in no item; prefix_len is a multiple of the page size (the kernels do not rely
on it).

Launch order per layer: prefix kernel, `_decode_kernel`, merge, each with programmatic dependent
launch (sgl_ext/triton/pdl.py). The kernels that may still run when the prefix kernel's programs
start (the RoPE + KV write, or the RoPE op and a KV save) write q, k and each request's newest
key / value only. Prefix keys are never a request's newest key and sit in shared slots that no
request writes, so the item's metadata, slot row and first K/V tile are loaded before the wait;
q after it. Every program waits, also one with nothing to do (an unused item exits after the
wait): the next kernel's wait then implies that the RoPE + KV write has completed too, as its
q and newest-key loads need. The scratch is written only after the wait (the previous layer's
merge reads it until then).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sgl_ext.launch import cached_launcher, pdl_enter
from srt.layers.attention.triton_ops.kv_load import (
    AttnFlags,
    KVBuffer,
    KVBuffers,
    KVHead,
    load_tile,
    pow2,
    sm_count,
    softmax_step,
)

CASCADE_ROWS_PER_ITEM: int = 16  # max batch rows per work item (the host splits larger groups)
MAX_CASCADE_SPLITS = 16
# Programs per SM cascade_splits aims for (as the stage-1 split count does).
_WAVES = 2


@dataclass(frozen=True)
class CascadeArgs:
    """A decode batch's shared prefixes as device tensors of fixed shapes (CUDA-graph capturable:
    the host refreshes their contents in place). Contract: the module docstring."""

    # int32 [B]: row b's keys [0, prefix_lens[b]) are read by the prefix kernel; 0 = row not in
    # any group
    prefix_lens: torch.Tensor
    # int32 [>= B]: batch rows ordered by work item; items index ranges of it
    rows: torch.Tensor
    # int32 [W, 4]: per work item (row_start, row_end, prefix_len, req_pool_index); prefix_len
    # == 0 marks an unused item (its programs exit). W is fixed per graph bucket.
    items: torch.Tensor


@dataclass(frozen=True)
class PrefixConfig:
    """Launch parameters of the prefix kernel: requests per query tile, keys per tile, warps,
    software-pipeline stages."""

    block_r: int
    block_n: int
    num_warps: int
    num_stages: int


def prefix_config(group: int, dot16: bool = True, ieee: bool = False) -> PrefixConfig:
    """Up to CASCADE_ROWS_PER_ITEM requests x the padded GQA group in one query tile, 32-key
    tiles. dot16 (16-bit caches and models: 16-bit tensor-core dots): up to 128 rows (Llama-3-8B,
    group 4: 16 x 4 = 64 rows on 4 warps; group 8: 16 x 8 = 128 on 8 warps), 3 stages. Float32
    tiles (fp8 caches, TF32 dots): up to 64 rows, 2 stages; fp32 models (`ieee`, no tensor
    cores): 16 rows. By ptxas on sm_90 (no GPU run yet): the 16-bit tiles keep the Llama shapes'
    accumulators and in-flight tiles in registers without spills (209-234 registers), where
    64-key tiles on 4 warps spilled; fp8 spills a few dozen bytes at most."""
    block_h = pow2(group)
    rows = 128 if dot16 else (16 if ieee else 64)
    block_r = max(1, min(CASCADE_ROWS_PER_ITEM, rows // block_h))
    warps = 8 if block_r * block_h >= 128 else 4
    return PrefixConfig(block_r, 32, warps, 3 if dot16 else 2)


def cascade_splits(batch_size: int, num_kv_heads: int, num_sms: int) -> int:
    """Prefix chunks P per work item: enough programs (items x KV heads x P) for ~_WAVES per SM,
    a power of two in [1, MAX_CASCADE_SPLITS], from host-known shapes only.

    Assumes the fewest items a batch can have (full items of CASCADE_ROWS_PER_ITEM rows); a batch
    with more items only runs more waves. Depends on the batch size rounded up to a power of two,
    so a CUDA-graph bucket and the eager batch it serves split alike (the same bits). Not yet
    tuned on a GPU."""
    items = max(1, -(-pow2(max(1, batch_size)) // CASCADE_ROWS_PER_ITEM))
    want = max(1, _WAVES * num_sms // (items * max(1, num_kv_heads)))
    return min(MAX_CASCADE_SPLITS, 1 << (want.bit_length() - 1))


@triton.jit
def _prefix_decode_kernel(
    Q,
    K,
    V,
    MidO,
    MidLse,
    Rows,
    Items,
    ReqToToken,
    KScale,
    VScale,
    k_scale_f,
    v_scale_f,
    sm_scale,
    logit_cap,
    stride_qt,
    stride_qh,
    stride_r2t,
    stride_mid_b,
    stride_mid_h,
    k_page_stride,
    k_off_stride,
    k_head_stride,
    v_page_stride,
    v_off_stride,
    v_head_stride,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,  # the padded GQA group
    BLOCK_R: tl.constexpr,  # requests per query tile
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    K_SCALE_MODE: tl.constexpr,
    V_SCALE_MODE: tl.constexpr,
    USE_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TILE_F32: tl.constexpr,
    P_LOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # stage 1's slots: this kernel writes slot NUM_SPLITS + chunk
    PREFIX_SPLITS: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Partial attention of a work item's query rows over its shared prefix's chunk."""
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    cfg: tl.constexpr = AttnFlags(
        D=D,
        DV=DV,
        BLOCK_N=BLOCK_N,
        PAGE_SIZE=PAGE_SIZE,
        KV_FP8=KV_FP8,
        K_SCALE_MODE=K_SCALE_MODE,
        V_SCALE_MODE=V_SCALE_MODE,
        TILE_F32=TILE_F32,
        USE_CAP=USE_CAP,
        DOT_PRECISION=DOT_PRECISION,
        P_LOW=P_LOW,
    )
    kbuf = KVBuffer(K, k_page_stride, k_off_stride, k_head_stride, KScale, k_scale_f)
    kv = KVBuffers(kbuf, KVBuffer(V, v_page_stride, v_off_stride, v_head_stride, VScale, v_scale_f))
    logits = (sm_scale, logit_cap)
    # Before the wait (module docstring): the item, its slot row and first tile of prefix keys.
    item = Items + w * 4
    row_start = tl.load(item)
    row_end = tl.load(item + 1)
    prefix_len = tl.load(item + 2)  # 0: an unused item (an empty chunk below)
    slots = (ReqToToken, tl.load(item + 3).to(tl.int64), stride_r2t)
    chunk = tl.cdiv(tl.cdiv(prefix_len, PREFIX_SPLITS), SPLIT_ALIGN) * SPLIT_ALIGN
    n0 = split * chunk
    end = tl.minimum(n0 + chunk, prefix_len)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    head = KVHead(kvh, d, dv)
    _, jm0, _, k0, v0 = load_tile(kv, slots, n0, end, -1, False, head, cfg)
    pdl_enter(USE_PDL)  # in every program, also an unused item's (module docstring)
    if prefix_len == 0:
        return
    # Query row m of the tile: request m // BLOCK_H of the row block, head g = m % BLOCK_H.
    m = tl.arange(0, BLOCK_R * BLOCK_H)
    g = m % BLOCK_H
    rowtile = (m // BLOCK_H, kvh * GROUP + g, g < GROUP)
    io = (Q, Rows, MidO, MidLse, stride_qt, stride_qh, stride_mid_b, stride_mid_h)
    span = (n0, end, row_end, NUM_SPLITS + split)
    _row_block(row_start, (jm0, k0, v0), rowtile, io, span, kv, slots, head, logits, cfg)
    # An item of more than BLOCK_R rows (BLOCK_R < 16: wide GQA groups, float32 tiles): the next
    # row blocks read the chunk again (L2 hits). Apart, so the first tile is not live across
    # the loops (it was, and spilled registers).
    for r0 in range(row_start + BLOCK_R, row_end, BLOCK_R):
        _, jm, _, k, v = load_tile(kv, slots, n0, end, -1, False, head, cfg)
        _row_block(r0, (jm, k, v), rowtile, io, span, kv, slots, head, logits, cfg)


@triton.jit
def _row_block(r0, first, rowtile, io, span, kv, slots, head, logits, cfg):
    """One block of an item's rows from rows[r0]: their q tile gathered, the chunk's keys
    [n0, end) through the online softmax from `first` = (mask, K, V), its first tile's, and
    the partials stored to scratch slot `slot`. rowtile = (request in the block, query head,
    head mask) per query row; span = (n0, end, row_end, slot)."""
    r, heads, gm = rowtile
    Q, Rows, MidO, MidLse, stride_qt, stride_qh, stride_mid_b, stride_mid_h = io
    n0, end, row_end, slot = span
    d, dv = head.d, head.dv
    ri = r0 + r
    rm = ri < row_end
    b = tl.load(Rows + ri, mask=rm, other=0).to(tl.int64)
    qm = rm & gm
    q_ptr = Q + b[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=qm[:, None] & (d[None, :] < cfg.D), other=0)
    if cfg.TILE_F32:
        q = q.to(tl.float32)
    m_i = tl.zeros(gm.shape, dtype=tl.float32) - float("inf")
    l_i = tl.zeros(gm.shape, dtype=tl.float32)
    acc = tl.zeros([gm.shape[0], dv.shape[0]], dtype=tl.float32)
    jm0, k0, v0 = first
    V = kv.v.ptr
    m_i, l_i, acc = softmax_step(q, k0, v0, jm0[None, :], m_i, l_i, acc, logits, V, cfg)
    # pipelined (num_stages): the next tiles' slot and K/V loads overlap this tile's dots
    for start in tl.range(n0 + cfg.BLOCK_N, end, cfg.BLOCK_N):
        _, jm, _, k, v = load_tile(kv, slots, start, end, -1, False, head, cfg)
        m_i, l_i, acc = softmax_step(q, k, v, jm[None, :], m_i, l_i, acc, logits, V, cfg)
    # the chunk's partial result: acc / l and lse (an empty chunk: 0 and -inf)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    row = b * stride_mid_b + heads * stride_mid_h + slot
    tl.store(MidLse + row, lse, mask=qm)
    om = qm[:, None] & (dv[None, :] < cfg.DV)
    tl.store(MidO + row[:, None] * dv.shape[0] + dv[None, :], out, mask=om)


# Stage 1's constexprs the prefix kernel takes as they are.
_SHARED = (
    "GROUP D DV BLOCK_D BLOCK_DV PAGE_SIZE KV_FP8 K_SCALE_MODE V_SCALE_MODE USE_CAP DOT_PRECISION "
    "TILE_F32 P_LOW NUM_SPLITS SPLIT_ALIGN"
).split()


@dataclass(frozen=True)
class PrefixLaunch:
    """The prefix kernel's part of a DecodeLaunch: its chunk count P, grid dims but the items'
    (Hkv, P), scalar arguments and constexprs / launch options."""

    splits: int
    grid_tail: tuple[int, int]
    scalars: tuple[int | float, ...]
    constexprs: dict[str, object]


def plan_prefix(
    q: torch.Tensor,
    req_to_token: torch.Tensor,
    sm_scale: float,
    kv,
    logit_cap: float,
    splits: int,
    decode_constexprs: dict[str, object],
    mid_strides: tuple[int, int],
    config: PrefixConfig | None = None,
) -> PrefixLaunch:
    """The prefix kernel's launch for `plan_decode`'s call shape (its stage-1 constexprs and the
    scratch's batch / head strides), P = `splits` chunks per item."""
    if splits < 1 or splits > MAX_CASCADE_SPLITS or splits & (splits - 1):
        raise ValueError(f"cascade_splits must be a power of two in [1, {MAX_CASCADE_SPLITS}]")
    group = int(decode_constexprs["GROUP"])  # type: ignore[call-overload]
    dot16, ieee = decode_constexprs["P_LOW"], decode_constexprs["DOT_PRECISION"] == "ieee"
    cfg = config or prefix_config(group, bool(dot16), ieee)
    scalars = (
        kv.k_scale_f,
        kv.v_scale_f,
        float(sm_scale),
        float(logit_cap),
        q.stride(0),
        q.stride(1),
        req_to_token.stride(0),
        *mid_strides,
        *kv.k_strides,
        *kv.v_strides,
    )
    constexprs = {name: decode_constexprs[name] for name in _SHARED}
    constexprs.update(
        BLOCK_H=pow2(group),
        BLOCK_R=cfg.block_r,
        BLOCK_N=cfg.block_n,
        PREFIX_SPLITS=splits,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return PrefixLaunch(splits, (kv.k_buffer.shape[-2], splits), scalars, constexprs)


def launch_prefix(
    plan: PrefixLaunch,
    q: torch.Tensor,
    req_to_token: torch.Tensor,
    kv,
    mid_o: torch.Tensor | None,
    mid_lse: torch.Tensor | None,
    cascade: CascadeArgs,
) -> None:
    """Launch the prefix kernel over cascade's W work items: grid (W, Hkv, P). No checks."""
    cached_launcher(_prefix_decode_kernel)[(cascade.items.shape[0], *plan.grid_tail)](
        q,
        kv.k_buffer,
        kv.v_buffer,
        mid_o,
        mid_lse,
        cascade.rows,
        cascade.items,
        req_to_token,
        kv.k_scale_ptr,
        kv.v_scale_ptr,
        *plan.scalars,
        **plan.constexprs,
    )


def check_cascade(
    cascade: CascadeArgs, batch_size: int, kv, device: torch.device, splits: int | None = None
) -> int:
    """`decode_attention_fwd`'s check of a cascade's tensors' metadata (dtype, shape, layout,
    device): a ValueError naming the field; the contents (the host's contract, module docstring)
    are not read. Returns P: `splits`, or None: `cascade_splits` for the device's SMs and the
    layer's KV heads (kv: the KVArgs)."""
    want = {
        "prefix_lens": (1, lambda t: t.shape[0] == batch_size, f"[{batch_size}]"),
        "rows": (1, lambda t: t.shape[0] >= batch_size, f"[>= {batch_size}]"),
        "items": (2, lambda t: t.shape[0] >= 1 and t.shape[1] == 4, "[W >= 1, 4]"),
    }
    for name, (ndim, ok, shape) in want.items():
        t = getattr(cascade, name)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device != device:
            raise ValueError(f"cascade.{name} must be an int32 tensor on {device}")
        if t.ndim != ndim or not ok(t) or not t.is_contiguous():
            raise ValueError(f"cascade.{name} must be contiguous {shape}, got {tuple(t.shape)}")
    if splits is not None:
        return splits
    return cascade_splits(batch_size, kv.k_buffer.shape[-2], sm_count(device))
