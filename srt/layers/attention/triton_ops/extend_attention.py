"""Triton extend (prefill) attention over the paged KV cache.

The new tokens' K/V are already in the cache (saved by the backend or by the fused RoPE kernel),
so every key is read from the pool through req_to_token: one code path for prefix and new
tokens. One program per (request, KV head, block of BLOCK_M new tokens) covers the GROUP query
heads of that KV head (rows = token x head, so each K/V tile is loaded once per group); causal,
GQA, sliding window, logit cap, sinks, page_size >= 1, fp8 caches. Matmuls accumulate in fp32:
exact IEEE products for fp32 models, 16-bit tensor-core dots for 16-bit models and caches, TF32
for fp8 caches. Keys stream through a pipelined loop of BLOCK_N tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sgl_ext.launch import cached_launcher, interpreting
from srt.layers.attention.triton_ops.decode_merge import (
    decode_scratch_shape,
    merge_kernel,
    merge_scratch,
)
from srt.layers.attention.triton_ops.kv_load import (
    KV_FP8_NONE,
    AttnFlags,
    KVBuffer,
    KVBuffers,
    KVHead,
    load_kv_tiles,
    softmax_step,
)
from srt.layers.attention.triton_ops.kv_load import pow2 as _pow2


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    MidO,  # NUM_SPLITS > 1: float32 [T, Hq, NUM_SPLITS, BLOCK_DV] partial outputs
    MidLse,  # NUM_SPLITS > 1: float32 [T, Hq, NUM_SPLITS] their log-sum-exps
    Sinks,
    ReqToToken,
    ReqPoolIdx,
    ExtLens,
    PrefixLens,
    StartLoc,
    KScale,
    VScale,
    k_scale_f,
    v_scale_f,
    sm_scale,
    logit_cap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_r2t,
    k_page_stride,
    k_off_stride,
    k_head_stride,
    v_page_stride,
    v_off_stride,
    v_head_stride,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    K_SCALE_MODE: tl.constexpr,
    V_SCALE_MODE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TILE_F32: tl.constexpr,
    P_LOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr = 1,
    SPLIT_ALIGN: tl.constexpr = 16,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mb = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    # What the helpers take, bundled (kv_load.py: no IR of their own).
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
    n_ext = tl.load(ExtLens + b).to(tl.int32)
    if mb * BLOCK_M >= n_ext:
        return
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    tok0 = tl.load(StartLoc + b).to(tl.int64)
    req = tl.load(ReqPoolIdx + b).to(tl.int64)
    # One row per (new token, query head of this KV head): [BLOCK_M * BLOCK_H] rows, token-major,
    # so every K/V tile is loaded once for the whole group.
    r = tl.arange(0, BLOCK_M * BLOCK_H)
    m = mb * BLOCK_M + r // BLOCK_H
    g = r % BLOCK_H
    h = kvh * GROUP + g
    mm = (m < n_ext) & (g < GROUP)
    qpos = prefix + m  # [ROWS]
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    head = KVHead(kvh, d, dv)
    q_ptr = Q + (tok0 + m)[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=mm[:, None] & (d[None, :] < D), other=0)  # [ROWS, BLOCK_D]
    if TILE_F32:
        q = q.to(tl.float32)
    m_i = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32)
    if HAS_SINKS and NUM_SPLITS == 1:  # split: the merge kernel adds the sink column
        m_i = tl.load(Sinks + h, mask=g < GROUP, other=0).to(tl.float32)
        l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_DV], dtype=tl.float32)
    hi = prefix + tl.minimum(n_ext, (mb + 1) * BLOCK_M)  # keys [lo, hi) can be visible
    lo = tl.zeros([], dtype=tl.int32)  # a tensor: the loop bounds' type is fixed
    if USE_WINDOW:
        lo = tl.maximum(prefix + mb * BLOCK_M - window, lo)
    if NUM_SPLITS > 1:  # this program's chunk of those keys, a multiple of SPLIT_ALIGN
        chunk = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), SPLIT_ALIGN) * SPLIT_ALIGN
        lo = lo + split * chunk
        hi = tl.minimum(lo + chunk, hi)
    # a pipelined loop over key tiles (num_stages: the next tiles' loads overlap this tile)
    for n0 in tl.range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        jm = j < hi
        slot = tl.load(ReqToToken + req * stride_r2t + j, mask=jm, other=0).to(tl.int64)
        k, v = load_kv_tiles(kv, slot, jm, head, cfg)
        vis = jm[None, :] & (j[None, :] <= qpos[:, None])  # [ROWS, BLOCK_N]
        if USE_WINDOW:
            vis = vis & (j[None, :] >= qpos[:, None] - window)
        m_i, l_i, acc = softmax_step(q, k, v, vis, m_i, l_i, acc, logits, V, cfg)
    om = mm[:, None] & (dv[None, :] < DV)
    if NUM_SPLITS == 1:
        l_i = tl.where(mm, l_i, 1.0)  # padding rows (not stored): avoid 0 / 0
        out = acc / l_i[:, None]
        o_ptr = Out + (tok0 + m)[:, None] * stride_ot + h[:, None] * stride_oh + dv[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=om)
    else:  # this chunk's partial result (an empty chunk: 0 and -inf), merged by merge_kernel
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        row = ((tok0 + m) * (GROUP * tl.num_programs(1)) + h) * NUM_SPLITS + split  # [ROWS]
        tl.store(MidLse + row, lse, mask=mm)
        tl.store(MidO + row[:, None] * BLOCK_DV + dv[None, :], out, mask=om)


@dataclass(frozen=True)
class ExtendConfig:
    """Launch parameters of the extend kernel: (token, head) rows per program, keys per tile,
    warps, software-pipeline stages."""

    rows: int
    block_n: int
    num_warps: int
    num_stages: int


def extend_config(batch_size: int, block_h: int, max_extend_len: int) -> ExtendConfig:
    """Tile shape from host-known sizes: 64 (token, head) rows per program (the group's heads
    share each K/V tile; tensor-core M), 64-key tiles, 4 warps, 3 stages. H100 sweep
    (`benchmarks/bench_layers.py --extend-sweep`, Llama-3-8B heads): best or within 10% of best
    at B=1 (L 512 / 2048), 8 and 64 (L 512); 16 or 32 rows (more programs at small batch) were
    slower at every shape. The interpreter gets 16 rows (its cost grows with the tile)."""
    if interpreting():
        return ExtendConfig(16, 32, 4, 1)
    return ExtendConfig(64, 64, 4, 3)


def _block_m(cfg: ExtendConfig, block_h: int) -> int:
    """New tokens per program: rows = (token, query head of the group) pairs; tl.dot needs
    M >= 16."""
    return max(1, cfg.rows // block_h, 16 // block_h)


# Each key chunk of a split-KV extend program covers at least this many keys, so that its
# partial output and the merge stay small beside the chunk's own reads.
MIN_SPLIT_KEYS = 1024
# At most this many (8 and 16 were slower wherever 4 was possible on the H100 sweep, and every
# split count is one more kernel variant to compile, at start-up: decode_warmup.py).
MAX_EXTEND_SPLITS = 4


def extend_num_splits(
    batch_size: int, num_kv_heads: int, group: int, max_extend_len: int, max_keys: int, num_sms: int
) -> int:
    """Key chunks per program for an extend batch (`extend_attention_fwd`'s num_splits).

    A short chunk after a long cached prefix (chunked prefill, a prefix-cache hit) launches
    few programs, each streaming every key alone: Llama-3-8B heads, 128 new tokens after 32K
    keys are 64 programs on an H100's 132 SMs. Splitting the keys doubles the programs while
    they stay within two waves and each chunk keeps >= MIN_SPLIT_KEYS keys. H100
    (`bench_layers.py --extend-split`): 128 tokens after 8K / 32K keys, 1 split 286 / 1139 us
    a layer, 4 splits 99 / 316 us (8 and 16 slower); 512 tokens (256 programs) gain nothing.
    At most MAX_EXTEND_SPLITS.
    `max_keys`: the longest request's keys (prefix + new, or the window's span)."""
    block_h = _pow2(group)
    block_m = _block_m(extend_config(batch_size, block_h, max_extend_len), block_h)
    programs = batch_size * num_kv_heads * -(-max_extend_len // block_m)
    splits = 1
    while (
        splits < MAX_EXTEND_SPLITS
        and programs * splits * 2 <= 2 * num_sms
        and max_keys // (splits * 2) >= MIN_SPLIT_KEYS
    ):
        splits *= 2
    return splits


def extend_attention_fwd(
    q,
    o,
    req_to_token,
    req_pool_indices,
    extend_seq_lens,
    extend_prefix_lens,
    extend_start_loc,
    max_extend_len,
    sm_scale,
    kv,
    sinks=None,
    window=-1,
    logit_cap=0.0,
    config: ExtendConfig | None = None,
    num_splits: int = 1,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
):
    """o[t, h] = causal attention of new token t over its request's cached keys.

    Parameters
    ----------
    q : [T, Hq, D]; o : [T, Hq, Dv] (written), model dtype.
    req_to_token : int32 [max_reqs, max_ctx]; req_pool_indices : int [B].
    extend_seq_lens, extend_prefix_lens, extend_start_loc : int32 [B].
    max_extend_len : host int, max(extend_seq_lens) (sizes the grid).
    kv : KVArgs: the layer's caches (fp8 as uint8 views), already holding the new tokens' K/V,
        page size, fp8 kind, scales. sinks : float [Hq] or None.
    config : tile shape (benchmarks); None: `extend_config(...)`.
    num_splits : key chunks per block of new tokens (a power of two <= 16): split-KV for few
        programs over long keys (a short chunk after a long cached prefix), each chunk's
        partial output and log-sum-exp in float32 scratch, merged by decode_merge's kernel
        (which adds the sinks). mid_o [T, Hq, num_splits, max(16, pow2(Dv))] / mid_lse
        [T, Hq, num_splits] float32 contiguous: allocated here when None.

    Precision: as the decode kernel (fp32 models: exact float32 products; 16-bit models and
    caches: 16-bit tensor-core dots, probabilities rounded to the cache dtype; fp8 caches: TF32
    on float32 tiles).
    """
    T, Hq, D = q.shape
    B = req_pool_indices.shape[0]
    Hkv, DV = kv.k_buffer.shape[-2], kv.v_buffer.shape[-1]
    group = Hq // Hkv
    block_h = _pow2(group)
    cfg = config or extend_config(B, block_h, max_extend_len)
    block_m = _block_m(cfg, block_h)
    block_d = max(16, _pow2(D))
    low = q.dtype in (torch.bfloat16, torch.float16) and kv.fp8 == KV_FP8_NONE
    interp = interpreting()
    if num_splits < 1 or num_splits > 16 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two in [1, 16], got {num_splits}")
    block_dv = max(16, _pow2(DV))
    if num_splits > 1:
        shape = decode_scratch_shape(T, Hq, DV, num_splits)
        mid_o, mid_lse = merge_scratch(q, shape, mid_o, mid_lse)
    grid = (B, Hkv, -(-max_extend_len // block_m) * num_splits)
    cached_launcher(_extend_kernel)[grid](  # direct launch once planned
        q,
        kv.k_buffer,
        kv.v_buffer,
        o,
        mid_o if num_splits > 1 else o,
        mid_lse if num_splits > 1 else o,
        sinks if sinks is not None else q,
        req_to_token,
        req_pool_indices,
        extend_seq_lens,
        extend_prefix_lens,
        extend_start_loc,
        kv.k_scale_ptr,
        kv.v_scale_ptr,
        kv.k_scale_f,
        kv.v_scale_f,
        float(sm_scale),
        float(logit_cap),
        int(window),
        q.stride(0),
        q.stride(1),
        o.stride(0),
        o.stride(1),
        req_to_token.stride(0),
        *kv.k_strides,
        *kv.v_strides,
        GROUP=group,
        D=D,
        DV=DV,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        PAGE_SIZE=kv.page_size,
        KV_FP8=kv.fp8,
        K_SCALE_MODE=kv.k_scale_mode,
        V_SCALE_MODE=kv.v_scale_mode,
        HAS_SINKS=sinks is not None,
        USE_WINDOW=window >= 0,
        USE_CAP=logit_cap > 0,
        # fp32 models: exact IEEE products; fp8 caches: TF32 on float32 tiles.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # float32 tiles, except 16-bit tiles on the GPU (the interpreter's 16-bit dot is wrong:
        # it gets float32 copies of the same values)
        TILE_F32=not low or interp,
        P_LOW=low,
        NUM_SPLITS=num_splits,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        cached_launcher(merge_kernel)[(T, Hq)](
            mid_o,
            mid_lse,
            o,
            sinks if sinks is not None else q,
            q,  # (no cascade: PrefixLens unread)
            Hq * num_splits,
            num_splits,
            o.stride(0),
            o.stride(1),
            DV=DV,
            BLOCK_DV=block_dv,
            NUM_SPLITS=num_splits,
            HAS_SINKS=sinks is not None,
        )
    return o
