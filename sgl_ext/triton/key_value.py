"""Triton helpers of the rope_kv kernel: the token's position and cos/sin row, the cache slot's
rows, and a key/value block (rotate K in place, store K and V into the cache slot).

The position -> cos/sin row chain is the longest of a program; `POS_LAST` (see rope_kv_kernel)
decides where the position is loaded.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_ext.triton.pairs import (
    inplace_fence,
    load_pairs,
    load_scale,
    quantize,
    reciprocal,
    rotate_pair,
    store_pairs,
)
from sgl_ext.triton.qk_norm import load_norm_weights, rms_norm_head
from sgl_ext.triton.rope_kv_args import KVBlock


@triton.jit
def clamp_position(pos, max_pos):
    """The position as int64 within [0, max_pos): memory safety (debug checks report it)."""
    return tl.minimum(tl.maximum(pos.to(tl.int64), 0), max_pos - 1)


@triton.jit
def barrier_zero(EMULATE: tl.constexpr):
    """A block barrier (bar.red.popc of a false predicate) that returns 0 as int64: what uses
    it stays behind the barrier (ptxas moves arithmetic across a plain one). EMULATE (the
    interpreter, which has no inline PTX): 0 without a barrier."""
    if EMULATE:
        return tl.zeros([1], tl.int64).sum(axis=0)
    z = tl.inline_asm_elementwise(
        "{ .reg .pred %p; setp.ne.u32 %p, $1, $1; bar.red.popc.u32 $0, 0, %p; }",
        "=r,r",
        [tl.zeros([1], tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    return tl.sum(z, axis=0).to(tl.int64)


@triton.jit
def position_at(pos_at, LOAD: tl.constexpr):
    """The position's address pos_at, or with LOAD the position itself (POS_LAST 3)."""
    if LOAD:
        return tl.load(pos_at)
    else:
        return pos_at


@triton.jit
def cos_sin(pos, tile, eps, cfg):
    """The token's cos and sin rows as [1, BLOCK_HALF] fp32 (zeros without rotation), and
    the norm's epsilon eps to use from here on. pos: a CosSinRow, tile: the program's Tile, cfg:
    the kernel's Flags (rope_kv_args.py).

    pos.row: the token's cos/sin row, from the position loaded at the start of the program; with
    POS_LAST the table itself, and the position is loaded here from pos.pos_at (POS_LAST 2:
    behind a barrier; see rope_kv_kernel). POS_LAST 3: pos.pos_at is the position, loaded with
    the data, and a barrier comes first; the clamp and the returned eps (eps + 0) take its
    result, so the arithmetic on them stays behind it. POS_LAST 4: pos.row and pos.pos_at are
    the cos and sin rows themselves, loaded before the wait for the previous kernel. Called
    after every other load of the program.
    """
    cs_row, pos_at, cs_stride, max_pos = pos
    if cfg.ROTATE and cfg.POS_LAST == 4:
        cos = cs_row
        sin = pos_at
    elif cfg.ROTATE:
        if cfg.POS_LAST == 3:
            # every load of the program is in (pos_at: the position); the clamp and the norm
            # (through its epsilon) wait for the barrier
            zero = barrier_zero(cfg.EMULATE_FP8)
            cs_row += clamp_position(tl.maximum(pos_at, zero), max_pos) * cs_stride
            eps += zero.to(tl.float32)
        elif cfg.POS_LAST:
            if cfg.POS_LAST == 2:
                tl.debug_barrier()  # ptxas moves no load across it
            cs_row += clamp_position(tl.load(pos_at), max_pos) * cs_stride
        cos = tl.load(cs_row + tile.c, mask=tile.c_ok, other=0.0).to(tl.float32)
        sin = tl.load(cs_row + cfg.HALF + tile.c, mask=tile.c_ok, other=0.0).to(tl.float32)
    else:
        cos = tl.zeros([1, cfg.BLOCK_HALF], tl.float32)
        sin = cos
    return cos, sin, eps


@triton.jit
def _slot_rows(loc, kh, cache, PAGE_SIZE: tl.constexpr):
    """(whether the slot is written, the K and V cache rows [BHKV, 1] of slot loc's heads kh) in
    cache (a KVCache): slots outside [0, cache.num_slots) are skipped, never written (their rows
    point at slot 0)."""
    kb, vb = cache.k, cache.v
    ok = (loc >= 0) & (loc < cache.num_slots)
    loc = tl.where(ok, loc, 0)
    page = loc // PAGE_SIZE
    off = loc - page * PAGE_SIZE
    kdst = kb.ptr + page * kb.page_stride + off * kb.off_stride + kh * kb.head_stride
    vdst = vb.ptr + page * vb.page_stride + off * vb.off_stride + kh * vb.head_stride
    return ok, kdst, vdst


@triton.jit
def key_value_in(tile, kvb, src, cfg):
    """Every load of key/value block kvb of the tile's token but the cos/sin row, from src (a
    KVSource): the slot (unless SLOT_PRE: loaded before the PDL wait, see rope_kv_kernel), V, the
    scales, K (rotary pairs and pass-through tail) and the key's norm weights. A block past the
    last key/value head loads no K or V (masked; the slot and scales read valid addresses).
    Returns the block (a KVBlock) and the norm weights (wa, wb, wt)."""
    t, c, c_ok = tile
    kh = kvb * cfg.BLOCK_HKV + tl.arange(0, cfg.BLOCK_HKV)[:, None]  # [BHKV, 1]
    h_ok = kh < src.num_heads
    k_row = src.k.ptr + t * src.k.tok_stride + kh * src.k.head_stride
    dv = tl.arange(0, cfg.BLOCK_DV)[None, :]
    dv_mask = h_ok & (dv < cfg.V_HEAD_DIM)
    zero = tl.zeros([1, 1], tl.float32)  # for the values a variant does not have
    loc = tl.zeros([1, 1], tl.int64)
    v, k_s, v_s = zero, zero, zero
    if cfg.WRITE_KV:
        # Issue every independent load first: slot, V row, K tail, scales.
        # [1, 1] rather than a scalar: newer Triton interpreters reject scalar & tensor masks.
        if not cfg.SLOT_PRE:
            loc = tl.load(src.loc_ptr + t + tl.zeros([1, 1], tl.int32)).to(tl.int64)
        v = tl.load(src.v.ptr + t * src.v.tok_stride + kh * src.v.head_stride + dv, mask=dv_mask)
        k_s = load_scale(src.k_scale.ptr, src.k_scale.f, cfg.K_SCALE_MODE)
        v_s = load_scale(src.v_scale.ptr, src.v_scale.f, cfg.V_SCALE_MODE)
    k_tail = zero
    if cfg.BLOCK_TAIL > 0:
        dt = cfg.ROT_DIM + tl.arange(0, cfg.BLOCK_TAIL)[None, :]  # [1, BLOCK_TAIL] pass-through
        t_mask = h_ok & (dt < cfg.HEAD_DIM)
        if cfg.WRITE_KV or cfg.QK_NORM:  # they go to the cache too, and the norm reads them
            k_tail = tl.load(k_row + dt, mask=t_mask, other=0.0)
    else:
        dt, t_mask = c, c_ok  # unused
    km = h_ok & c_ok
    if cfg.ROTATE:
        ka, kb = load_pairs(k_row, c, km, cfg.HALF, cfg.PAIR_MODE, cfg.IS_BF16)
    else:  # plain KV write: the whole head as one contiguous "pair" tile
        ka, kb = load_pairs(k_row, c, km, cfg.HALF, 0, cfg.IS_BF16)
    wa, wb, wt = zero, zero, zero
    if cfg.QK_NORM:
        wa, wb, wt = load_norm_weights(src.norm_w_ptr, c, c_ok, dt, dt < cfg.HEAD_DIM, cfg)
    blk = KVBlock(kh, k_row, km, dv, dv_mask, dt, t_mask, loc, v, k_s, v_s, k_tail, ka, kb)
    return blk, (wa, wb, wt)


@triton.jit
def key_value_out(blk, w, cos, sin, c, cache, eps, cfg, SLOT_EARLY: tl.constexpr, slot_pre):
    """A key/value block blk once its loads (key_value_in) and the cos/sin row are in: normalise
    (QK_NORM, weights w) and rotate K in place, store K and V into the cache slot. SLOT_EARLY:
    the slot's cache rows first (see key_value). SLOT_PRE: slot_pre holds them (worked out
    before the PDL wait by rope_kv_kernel; blk.loc is then unused)."""
    kh, k_row, km, dv, dv_mask, dt, t_mask, loc, v, k_s, v_s, k_tail, ka, kb = blk
    if cfg.WRITE_KV and cfg.SLOT_PRE:
        ok, kdst, vdst = slot_pre
    elif cfg.WRITE_KV and SLOT_EARLY:
        ok, kdst, vdst = _slot_rows(loc, kh, cache, cfg.PAGE_SIZE)
    if cfg.ROTATE:
        KT: tl.constexpr = k_row.dtype.element_ty
        if cfg.QK_NORM:  # RMSNorm of the whole head, rounded to the key dtype as torch does
            ka, kb, k_tail = rms_norm_head((ka, kb, k_tail.to(tl.float32)), w, eps, KT, cfg)
        # Round to the key dtype: the cache stores exactly the key the op returns.
        ka, kb = rotate_pair(ka, kb, cos, sin)
        ka, kb = ka.to(KT).to(tl.float32), kb.to(KT).to(tl.float32)
        inplace_fence()  # every load of the key (any layout's copy) before it is overwritten
        if cfg.QK_NORM and cfg.BLOCK_TAIL > 0:
            tl.store(k_row + dt, k_tail.to(KT), mask=t_mask)
        store_pairs(k_row, c, km, ka, kb, cfg.HALF, cfg.PAIR_MODE)
    if cfg.WRITE_KV:
        if not SLOT_EARLY and not cfg.SLOT_PRE:
            ok, kdst, vdst = _slot_rows(loc, kh, cache, cfg.PAGE_SIZE)
        KS: tl.constexpr = cfg.K_SCALE_MODE > 0
        KDT: tl.constexpr = cache.k.ptr.dtype.element_ty
        VDT: tl.constexpr = cache.v.ptr.dtype.element_ty
        k_inv = reciprocal(k_s, cfg.K_SCALE_MODE)  # after all loads (see reciprocal)
        v_inv = reciprocal(v_s, cfg.V_SCALE_MODE)
        qa = quantize(ka, k_inv, KS, cfg.K_FP8_MAX, cfg.EMULATE_FP8, KDT)
        qb = quantize(kb, k_inv, KS, cfg.K_FP8_MAX, cfg.EMULATE_FP8, KDT)
        store_pairs(kdst, c, km & ok, qa, qb, cfg.HALF, cfg.KBUF_PAIR_MODE if cfg.ROTATE else 0)
        if cfg.BLOCK_TAIL > 0:
            kt = quantize(k_tail.to(tl.float32), k_inv, KS, cfg.K_FP8_MAX, cfg.EMULATE_FP8, KDT)
            tl.store(kdst + dt, kt, mask=t_mask & ok)
        VS: tl.constexpr = cfg.V_SCALE_MODE > 0
        vq = quantize(v.to(tl.float32), v_inv, VS, cfg.V_FP8_MAX, cfg.EMULATE_FP8, VDT)
        tl.store(vdst + dv, vq, mask=dv_mask & ok)


@triton.jit
def key_value(tile, kvb, pos, src, cache, w_pre, eps, cfg, slot_pre):
    """Key/value block kvb of the tile's token: rotate K in place, store K and V into the cache
    slot (the bundles: rope_kv_args.py). Returns the token's (cos, sin), loaded after every
    other load of the block, and eps. With W_PRE the key's norm weights are w_pre (loaded by
    the caller before the PDL wait). With SLOT_PRE, slot_pre is the slot's cache rows (worked
    out before the wait) and the slot is not loaded here.

    With the norm and POS_LAST 1 the slot's cache rows are worked out under the cos/sin load:
    after the rotation (as without the norm), ptxas leaves this arithmetic behind the branch of
    the in-place K store, on the program's critical path (~60 dependent instructions at T = 1).
    """
    blk, w = key_value_in(tile, kvb, src, cfg)
    if cfg.W_PRE:  # loaded before the PDL wait (rope_kv_kernel's NORM_W_PRE)
        w = w_pre
    cos, sin, eps = cos_sin(pos, tile, eps, cfg)
    slot_early: tl.constexpr = cfg.QK_NORM and cfg.POS_LAST == 1
    key_value_out(blk, w, cos, sin, tile.c, cache, eps, cfg, slot_early, slot_pre)
    return cos, sin, eps
