"""Triton decode attention over the paged KV cache: one query token per request.

One program per (request, KV head, KV split) handles the GROUP query heads that share that KV
head, so each cached K/V tile is read once per group (GQA), streaming its share of the request's
keys in blocks with an online softmax. Sliding window, logit cap, attention sinks, page_size >= 1
and fp8 caches.

Flash-decoding: with NUM_SPLITS > 1 each request's visible keys are cut into NUM_SPLITS equal
chunks (a multiple of SPLIT_ALIGN keys each, computed on the device from the request's length),
every chunk writes its normalised partial output and log-sum-exp to a float32 scratch buffer, and
a second kernel merges them (decode_merge.py, adding the sink column). With NUM_SPLITS == 1 the
first kernel writes the output itself. Keys stream in BLOCK_N tiles through a pipelined loop;
16-bit caches use 16-bit tensor-core dots (float32 accumulation). The split count depends only
on host-known shapes, so the launch reads only device tensors and fixed shapes and captures in a
CUDA graph.

The first tile is loaded before the kernel waits for the previous one (programmatic dependent
launch, sgl_ext/triton/pdl.py), all but the newest key: the kernels that may still run then
(the RoPE + KV write, or the RoPE op and a KV save) write only q, k and the newest key / value.
q and the newest key / value are loaded after the wait. In the gpt-oss-20b / Llama-3-8B bs-1
decode graphs this took 0.8-1 µs off each layer (docs/performance.md). A short sliding window
(gpt-oss: 129 keys) at up to 8 requests is one wide tile (`decode_config`), so after the wait a
program runs one softmax step, not one per 64-key tile.

Shared prefixes (`cascade`, prefix_decode.py): a group's shared prompt prefix is read once per
work item by the prefix kernel; this kernel (HAS_PREFIX) covers each request's keys past its
prefix and always writes partials, which the merge kernel combines with the prefix's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sgl_ext.launch import cached_launcher, interpreting, pdl_enter
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
    early_tile_step,
    load_tile,
    softmax_step,
    with_newest,
)
from srt.layers.attention.triton_ops.kv_load import pow2 as _pow2
from srt.layers.attention.triton_ops.prefix_decode import (
    CascadeArgs,
    PrefixConfig,
    PrefixLaunch,
    check_cascade,
    launch_prefix,
    plan_prefix,
)


@triton.jit
def _decode_kernel(
    Q,
    K,
    V,
    Out,
    MidO,
    MidLse,
    Sinks,
    ReqToToken,
    ReqPoolIdx,
    SeqLens,
    KScale,
    VScale,
    PrefixLens,  # HAS_PREFIX: int32 [B], keys [0, PrefixLens[b]) are the prefix kernel's
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
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
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
    NUM_SPLITS: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    PRE_TILES: tl.constexpr,  # tiles loaded before the PDL wait (1..3)
    HAS_PREFIX: tl.constexpr = False,  # cascade: partials always, the merge adds the prefix's
    USE_PDL: tl.constexpr = False,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    DIRECT: tl.constexpr = NUM_SPLITS == 1 and not HAS_PREFIX  # writes Out itself (no merge)
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
    # Before the wait for the previous kernel (see the module docstring): the batch's metadata,
    # the slot table, the first tiles' cached keys / values except the newest, the sinks.
    req = tl.load(ReqPoolIdx + b).to(tl.int64)
    slots = (ReqToToken, req, stride_r2t)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    qpos = seq_len - 1
    g = tl.arange(0, BLOCK_H)
    gm = g < GROUP
    heads = kvh * GROUP + g  # [BLOCK_H] query heads of this KV head
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    head = KVHead(kvh, d, dv)
    n0 = tl.zeros([], dtype=tl.int32)  # a tensor: the loop bounds' type is fixed
    if USE_WINDOW:
        n0 = tl.maximum(qpos - window, n0)
    if HAS_PREFIX:  # (no window with a prefix)
        n0 = tl.load(PrefixLens + b).to(tl.int32)
    end = seq_len
    if NUM_SPLITS > 1:  # this program's chunk of keys [n0, end), a multiple of SPLIT_ALIGN
        chunk = tl.cdiv(tl.cdiv(seq_len - n0, NUM_SPLITS), SPLIT_ALIGN) * SPLIT_ALIGN
        n0 = n0 + split * chunk
        end = tl.minimum(n0 + chunk, seq_len)
    # The first PRE_TILES tiles' slots and cached keys / values but the newest (a short window's
    # whole span in one program: no DRAM round trip left after the wait).
    j0, jm0, s0, k0, v0 = load_tile(kv, slots, n0, end, qpos, True, head, cfg)
    if PRE_TILES >= 2:
        j1, jm1, s1, k1, v1 = load_tile(kv, slots, n0 + BLOCK_N, end, qpos, True, head, cfg)
    if PRE_TILES >= 3:
        j2, jm2, s2, k2, v2 = load_tile(kv, slots, n0 + 2 * BLOCK_N, end, qpos, True, head, cfg)
    if HAS_SINKS and DIRECT:  # split: the merge kernel adds the sink column
        sink = tl.load(Sinks + heads, mask=gm, other=0).to(tl.float32)
    pdl_enter(USE_PDL)
    q_ptr = Q + b * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=gm[:, None] & (d[None, :] < D), other=0)  # [BLOCK_H, BLOCK_D]
    if TILE_F32:
        q = q.to(tl.float32)
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_SINKS and DIRECT:
        m_i = sink
        l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    k0, v0 = with_newest(k0, v0, j0, n0, s0, qpos, head, kv, cfg)
    m_i, l_i, acc = softmax_step(q, k0, v0, jm0[None, :], m_i, l_i, acc, logits, V, cfg)
    if PRE_TILES >= 2:
        tile1 = (k1, v1, j1, jm1, n0 + BLOCK_N, s1)
        m_i, l_i, acc = early_tile_step(q, tile1, end, qpos, (m_i, l_i, acc), head, kv, logits, cfg)
    if PRE_TILES >= 3:
        tile2 = (k2, v2, j2, jm2, n0 + 2 * BLOCK_N, s2)
        m_i, l_i, acc = early_tile_step(q, tile2, end, qpos, (m_i, l_i, acc), head, kv, logits, cfg)
    # The other tiles: a for loop over a tl.range, which the compiler pipelines (num_stages: the
    # next tiles' slot and K/V loads are in flight while this tile is computed).
    for start in tl.range(n0 + PRE_TILES * BLOCK_N, end, BLOCK_N):
        _, jm, _, k, v = load_tile(kv, slots, start, end, qpos, False, head, cfg)
        m_i, l_i, acc = softmax_step(q, k, v, jm[None, :], m_i, l_i, acc, logits, V, cfg)
    om = gm[:, None] & (dv[None, :] < DV)
    if DIRECT:
        l_i = tl.where(gm, l_i, 1.0)  # padding heads (not stored): avoid 0 / 0
        out = acc / l_i[:, None]
        o_ptr = Out + b * stride_ot + heads[:, None] * stride_oh + dv[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=om)
    else:  # partial result of this chunk: acc / l and lse (an empty chunk: 0 and -inf)
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        row = b * stride_mid_b + heads * stride_mid_h + split  # [BLOCK_H]
        tl.store(MidLse + row, lse, mask=gm)
        tl.store(MidO + row[:, None] * BLOCK_DV + dv[None, :], out, mask=om)


MAX_KV_SPLITS = 16
SPLIT_ALIGN = 16  # chunk boundaries are multiples of this many keys
# Programs per SM the split heuristic aims for (enough resident programs to keep loads in flight).
_WAVES = 2
# Sliding windows with fewer keys than this take one program per (request, KV head)
WINDOW_ONE_SPLIT_KEYS = 192
# ... and at up to WIDE_WINDOW_BATCH requests one tile of up to WIDE_TILE_KEYS keys (decode_config)
WIDE_TILE_KEYS = 256
WIDE_WINDOW_BATCH = 8


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel: keys per tile, warps, software-pipeline stages."""

    block_n: int
    num_warps: int
    num_stages: int


def decode_config(
    batch_size: int, num_splits: int, head_dim: int, window: int = -1
) -> DecodeConfig:
    """The tile shape for a launch, from host-known shapes only (graph bucket == eager batch).

    H100 sweep (`benchmarks/bench_layers.py --decode-sweep`, Llama-3-8B heads, graph-timed per
    layer): 64-key tiles, 4 warps, 3 stages were best or within 5% of best at B=64 (L 512 / 2048:
    1.15x / 1.04x the read floor) and B=8, and within 8% at B=1 (L 512 / 4096).

    A short window's whole span in one program (one split, up to WIDE_WINDOW_BATCH requests,
    window + 1 <= WIDE_TILE_KEYS keys) is one tile: a single softmax step after the PDL wait
    instead of one per 64-key tile (`WIDE_TILE_KEYS`; docs/performance.md).
    """
    if num_splits == 1 and 0 <= window < WIDE_TILE_KEYS and batch_size <= WIDE_WINDOW_BATCH:
        return DecodeConfig(max(64, _pow2(window + 1)), 8, 1)
    return DecodeConfig(64, 4, 3)


def num_kv_splits(batch_size: int, num_kv_heads: int, num_sms: int, window: int = -1) -> int:
    """KV splits per request: enough programs for ~_WAVES per SM, a power of two; one for a
    sliding window of at most WINDOW_ONE_SPLIT_KEYS keys (window >= 0: window-left W, W + 1
    keys), whose few tiles one program streams faster than split programs plus the merge kernel
    (gpt-oss-20b bs 1, window 128: decode graph -9 to -13 µs, 12 such layers; RESULTS.md).

    Depends on the batch size rounded up to a power of two, so a CUDA-graph bucket (1, 2, 4, 8,
    then multiples of 8, always within the same power-of-two range) splits exactly like the eager
    batch it serves and both give the same bits.
    """
    if 0 <= window < WINDOW_ONE_SPLIT_KEYS:
        return 1
    b = _pow2(max(1, batch_size))
    want = max(1, _WAVES * num_sms // (b * num_kv_heads))
    return min(MAX_KV_SPLITS, 1 << (want.bit_length() - 1))


def pre_tiles(batch_size: int, num_splits: int, window: int, block_n: int) -> int:
    """Tiles a program loads before its PDL wait: a short window's whole span (one split, up to
    8 requests: registers are plenty with so few programs), else the first tile."""
    if num_splits == 1 and 0 <= window and batch_size <= 8:
        return max(1, min(3, -(-(window + 1) // block_n)))
    return 1


@dataclass(frozen=True)
class DecodeLaunch:
    """Everything a decode launch passes besides its tensors, worked out once per call shape:
    the grids, the kernels' scalar arguments and their constexprs / launch options (the merge
    kernel's with NUM_SPLITS > 1 or a cascade; the prefix kernel's with a cascade).
    `launch_decode` adds the tensors."""

    grid: tuple[int, int, int]  # (B, Hkv, splits)
    scalars: tuple[int | float, ...]  # _decode_kernel's arguments from k_scale_f on
    constexprs: dict[str, object]  # its constexprs and launch options
    num_splits: int
    merge_grid: tuple[int, int]  # (B, Hq)
    merge_scalars: tuple[int, ...]
    merge_constexprs: dict[str, object]
    prefix: PrefixLaunch | None = None  # cascade_splits > 0


def plan_decode(
    q: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    sm_scale: float,
    kv,
    has_sinks: bool,
    window: int = -1,
    logit_cap: float = 0.0,
    num_splits: int = 1,
    config: DecodeConfig | None = None,
    cascade_splits: int = 0,
    prefix_config: PrefixConfig | None = None,
) -> DecodeLaunch:
    """The DecodeLaunch of `decode_attention_fwd`'s call with these tensors' metadata (their
    shapes, strides and dtypes; the pointers are not read), `kv` and the scalars.
    cascade_splits > 0: a cascade launch (`launch_decode` then needs `cascade`) with that many
    prefix chunks P per work item; its scratch has num_splits + P slots."""
    B, Hq, D = q.shape
    Hkv, DV = kv.k_buffer.shape[-2], kv.v_buffer.shape[-1]
    if num_splits < 1 or num_splits > MAX_KV_SPLITS or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two in [1, {MAX_KV_SPLITS}]")
    if cascade_splits and window >= 0:
        raise ValueError("cascade is not supported with a sliding window (window >= 0)")
    slots = num_splits + cascade_splits
    group = Hq // Hkv
    block_dv = max(16, _pow2(DV))
    # (one wide tile only from 16-bit or float32 caches: fp8 ones dequantise to float32 tiles)
    cfg = config or decode_config(B, num_splits, D, window if kv.fp8 == KV_FP8_NONE else -1)
    low = q.dtype in (torch.bfloat16, torch.float16) and kv.fp8 == KV_FP8_NONE
    scalars = (
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
        Hq * slots,  # mid scratch strides (batch, head)
        slots,
        *kv.k_strides,
        *kv.v_strides,
    )
    constexprs = dict(
        GROUP=group,
        D=D,
        DV=DV,
        BLOCK_H=max(16, _pow2(group)),
        BLOCK_D=max(16, _pow2(D)),
        BLOCK_DV=block_dv,
        BLOCK_N=cfg.block_n,
        PAGE_SIZE=kv.page_size,
        KV_FP8=kv.fp8,
        K_SCALE_MODE=kv.k_scale_mode,
        V_SCALE_MODE=kv.v_scale_mode,
        HAS_SINKS=has_sinks,
        USE_WINDOW=window >= 0,
        USE_CAP=logit_cap > 0,
        # fp32 models: exact IEEE products; fp8 caches: TF32 on float32 tiles.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # float32 tiles, except 16-bit tiles on the GPU (the interpreter's 16-bit dot is wrong:
        # it gets float32 copies of the same values)
        TILE_F32=not low or interpreting(),
        P_LOW=low,
        NUM_SPLITS=num_splits,
        SPLIT_ALIGN=SPLIT_ALIGN,
        PRE_TILES=pre_tiles(B, num_splits, window, cfg.block_n),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    merge_scalars = (Hq * slots, slots, o.stride(0), o.stride(1))
    merge_constexprs = dict(DV=DV, BLOCK_DV=block_dv, NUM_SPLITS=num_splits, HAS_SINKS=has_sinks)
    prefix = None
    if cascade_splits:  # (without: the constexprs above, the kernels compiled without cascade)
        constexprs["HAS_PREFIX"] = True
        merge_constexprs.update(PREFIX_SPLITS=cascade_splits, BLOCK_S=_pow2(slots))
        args = (q, req_to_token, sm_scale, kv, logit_cap, cascade_splits, constexprs)
        prefix = plan_prefix(*args, scalars[10:12], prefix_config)  # (mid scratch strides)
    return DecodeLaunch(
        (B, Hkv, num_splits),
        scalars,
        constexprs,
        num_splits,
        (B, Hq),
        merge_scalars,
        merge_constexprs,
        prefix,
    )


def launch_decode(
    plan: DecodeLaunch,
    q: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv,
    sinks: torch.Tensor | None,
    mid_o: torch.Tensor | None,
    mid_lse: torch.Tensor | None,
    cascade: CascadeArgs | None = None,
) -> None:
    """Launch `plan` on tensors with the metadata it was planned for (q [B, Hq, D], o
    [B, Hq, Dv], the scratch of `decode_scratch_shape` when it splits or has a cascade, the
    cascade's tensors): no checks but that a cascade plan gets a cascade and no other plan does.
    A cascade launches the prefix kernel first (prefix_decode.py: the PDL order)."""
    s = sinks if sinks is not None else q  # never read without HAS_SINKS
    prefix_lens = q  # never read without HAS_PREFIX
    if (cascade is None) != (plan.prefix is None):
        raise ValueError("cascade must be given exactly when the plan has cascade_splits > 0")
    if plan.prefix and cascade:
        launch_prefix(plan.prefix, q, req_to_token, kv, mid_o, mid_lse, cascade)
        prefix_lens = cascade.prefix_lens
    elif plan.num_splits == 1:
        mid_o = mid_lse = o  # unused
    cached_launcher(_decode_kernel)[plan.grid](  # direct launch once planned
        q,
        kv.k_buffer,
        kv.v_buffer,
        o,
        mid_o,
        mid_lse,
        s,
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv.k_scale_ptr,
        kv.v_scale_ptr,
        prefix_lens,
        *plan.scalars,
        **plan.constexprs,
    )
    if plan.num_splits > 1 or plan.prefix is not None:
        cached_launcher(merge_kernel)[plan.merge_grid](
            mid_o, mid_lse, o, s, prefix_lens, *plan.merge_scalars, **plan.merge_constexprs
        )


def decode_attention_fwd(
    q: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv,
    sinks: torch.Tensor | None = None,
    window: int = -1,
    logit_cap: float = 0.0,
    num_splits: int = 1,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    cascade: CascadeArgs | None = None,
    cascade_splits: int | None = None,
) -> torch.Tensor:
    """o[b, h] = attention of q[b, h] over request b's cached keys 0..seq_lens[b]-1.

    Parameters
    ----------
    q : [B, Hq, D]; o : [B, Hq, Dv] (written), model dtype.
    req_to_token : int32 [max_reqs, max_ctx]; req_pool_indices, seq_lens : int [B].
    kv : KVArgs from triton_backend: the layer's caches ([slots, H, D] or [pages, ps, H, D];
        fp8 caches as uint8 views), page size, fp8 kind, scales.
    sinks : float [Hq] or None; window : -1 or window-left; logit_cap : 0 for none.
    num_splits : KV chunks per request (a power of two <= MAX_KV_SPLITS); > 1 adds the merge
        launch and needs the scratch buffers.
    mid_o : float32 contiguous `decode_scratch_shape(B, Hq, Dv, slots)`, slots = num_splits
        (+ cascade_splits with a cascade);
    mid_lse : float32 contiguous [B, Hq, slots]. Allocated here when None.
    config : tile shape (benchmarks); None: `decode_config(B, num_splits, D, window)`.
    cascade : the batch's shared prefixes (prefix_decode.py, whose contract the host keeps);
        None: none. Not with a sliding window. The result is the same up to float rounding.
    cascade_splits : prefix chunks P per work item with a cascade (a power of two <= 16);
        None: `prefix_decode.cascade_splits(B, Hkv, the device's SMs)`.

    Precision: fp32 models use exact float32 products. 16-bit models with a 16-bit cache use
    16-bit tensor-core dots with float32 accumulation (the probabilities rounded to the cache
    dtype before the PV dot); with an fp8 cache the dequantised tiles are float32 (TF32 dots).

    The launch is `plan_decode` + `launch_decode`; a caller that launches the same call shape
    per layer (the Triton backend) keeps the plan and calls `launch_decode` itself.
    """
    B, Hq, _ = q.shape
    P = 0 if cascade is None else check_cascade(cascade, B, kv, q.device, cascade_splits)
    args = (q, o, req_to_token, sm_scale, kv, sinks is not None, window, logit_cap, num_splits)
    plan = plan_decode(*args, config, P)
    if num_splits + P > 1:
        shape = decode_scratch_shape(B, Hq, kv.v_buffer.shape[-1], num_splits + P)
        mid_o, mid_lse = merge_scratch(q, shape, mid_o, mid_lse)
    launch_decode(
        plan, q, o, req_to_token, req_pool_indices, seq_lens, kv, sinks, mid_o, mid_lse, cascade
    )
    return o
