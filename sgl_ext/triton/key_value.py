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
def cos_sin(
    cs_row,
    pos_at,
    cs_stride,
    max_pos,
    c,
    c_ok,
    eps,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROTATE: tl.constexpr,
    POS_LAST: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """The token's cos and sin rows as [1, BLOCK_HALF] fp32 (zeros without rotation), and
    the norm's epsilon eps to use from here on.

    cs_row: the token's cos/sin row, from the position loaded at the start of the program; with
    POS_LAST the table itself, and the position is loaded here from pos_at (POS_LAST 2: behind a
    barrier; see rope_kv_kernel). POS_LAST 3: pos_at is the position, loaded with the data, and
    a barrier comes first; the clamp and the returned eps (eps + 0) take its result, so the
    arithmetic on them stays behind it. POS_LAST 4: cs_row and pos_at are the cos and sin rows
    themselves, loaded before the wait for the previous kernel. Called after every other load
    of the program.
    """
    if ROTATE and POS_LAST == 4:
        cos = cs_row
        sin = pos_at
    elif ROTATE:
        if POS_LAST == 3:
            # every load of the program is in (pos_at: the position); the clamp and the norm
            # (through its epsilon) wait for the barrier
            zero = barrier_zero(EMULATE)
            cs_row += clamp_position(tl.maximum(pos_at, zero), max_pos) * cs_stride
            eps += zero.to(tl.float32)
        elif POS_LAST:
            if POS_LAST == 2:
                tl.debug_barrier()  # ptxas moves no load across it
            cs_row += clamp_position(tl.load(pos_at), max_pos) * cs_stride
        cos = tl.load(cs_row + c, mask=c_ok, other=0.0).to(tl.float32)
        sin = tl.load(cs_row + HALF + c, mask=c_ok, other=0.0).to(tl.float32)
    else:
        cos = tl.zeros([1, BLOCK_HALF], tl.float32)
        sin = cos
    return cos, sin, eps


@triton.jit
def _slot_rows(
    loc,
    num_slots,
    kh,
    kbuf_ptr,
    kb_page_stride,
    kb_off_stride,
    kb_head_stride,
    vbuf_ptr,
    vb_page_stride,
    vb_off_stride,
    vb_head_stride,
    PAGE_SIZE: tl.constexpr,
):
    """(whether the slot is written, the K and V cache rows [BHKV, 1] of slot loc's heads kh):
    slots outside [0, num_slots) are skipped, never written (their rows point at slot 0)."""
    ok = (loc >= 0) & (loc < num_slots)
    loc = tl.where(ok, loc, 0)
    page = loc // PAGE_SIZE
    off = loc - page * PAGE_SIZE
    kdst = kbuf_ptr + page * kb_page_stride + off * kb_off_stride + kh * kb_head_stride
    vdst = vbuf_ptr + page * vb_page_stride + off * vb_off_stride + kh * vb_head_stride
    return ok, kdst, vdst


@triton.jit
def key_value_in(
    t,
    kvb,
    c,
    c_ok,
    k_ptr,
    k_tok_stride,
    k_head_stride,
    v_ptr,
    v_tok_stride,
    v_head_stride,
    loc_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_scale_f,
    v_scale_f,
    num_kv_heads,
    kw_ptr,
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    PAIR_MODE: tl.constexpr,
    IS_BF16: tl.constexpr,
    ROTATE: tl.constexpr,
    WRITE_KV: tl.constexpr,
    K_SCALE_MODE: tl.constexpr,
    V_SCALE_MODE: tl.constexpr,
    QK_NORM: tl.constexpr,
    SLOT_PRE: tl.constexpr = False,
):
    """Every load of key/value block kvb of token t but the cos/sin row: the slot (unless
    SLOT_PRE: loaded before the PDL wait, see rope_kv_kernel), V, the scales, K (rotary pairs and
    pass-through tail) and the key's norm weights. A block past the last key/value head loads no
    K or V (masked; the slot and scales read valid addresses)."""
    HALF: tl.constexpr = ROT_DIM // 2
    kh = kvb * BLOCK_HKV + tl.arange(0, BLOCK_HKV)[:, None]  # [BHKV, 1]
    h_ok = kh < num_kv_heads
    k_row = k_ptr + t * k_tok_stride + kh * k_head_stride
    dv = tl.arange(0, BLOCK_DV)[None, :]
    dv_mask = h_ok & (dv < V_HEAD_DIM)
    zero = tl.zeros([1, 1], tl.float32)  # for the values a variant does not have
    loc = tl.zeros([1, 1], tl.int64)
    v, k_s, v_s = zero, zero, zero
    if WRITE_KV:
        # Issue every independent load first: slot, V row, K tail, scales.
        # [1, 1] rather than a scalar: newer Triton interpreters reject scalar & tensor masks.
        if not SLOT_PRE:
            loc = tl.load(loc_ptr + t + tl.zeros([1, 1], tl.int32)).to(tl.int64)
        v = tl.load(v_ptr + t * v_tok_stride + kh * v_head_stride + dv, mask=dv_mask)
        k_s = load_scale(k_scale_ptr, k_scale_f, K_SCALE_MODE)
        v_s = load_scale(v_scale_ptr, v_scale_f, V_SCALE_MODE)
    k_tail = zero
    if BLOCK_TAIL > 0:
        dt = ROT_DIM + tl.arange(0, BLOCK_TAIL)[None, :]  # [1, BLOCK_TAIL] pass-through dims
        t_mask = h_ok & (dt < HEAD_DIM)
        if WRITE_KV or QK_NORM:  # they go to the cache too, and the norm reads them
            k_tail = tl.load(k_row + dt, mask=t_mask, other=0.0)
    else:
        dt, t_mask = c, c_ok  # unused
    km = h_ok & c_ok
    if ROTATE:
        ka, kb = load_pairs(k_row, c, km, HALF, PAIR_MODE, IS_BF16)
    else:  # plain KV write: the whole head as one contiguous "pair" tile
        ka, kb = load_pairs(k_row, c, km, HALF, 0, IS_BF16)
    wa, wb, wt = zero, zero, zero
    if QK_NORM:
        wa, wb, wt = load_norm_weights(
            kw_ptr, c, c_ok, dt, dt < HEAD_DIM, HALF, PAIR_MODE, IS_BF16, BLOCK_TAIL > 0
        )
    return kh, k_row, km, dv, dv_mask, dt, t_mask, loc, v, k_s, v_s, k_tail, ka, kb, wa, wb, wt


@triton.jit
def key_value_out(
    kh,
    k_row,
    km,
    dv,
    dv_mask,
    dt,
    t_mask,
    loc,
    v,
    k_s,
    v_s,
    k_tail,
    ka,
    kb,
    wa,
    wb,
    wt,
    cos,
    sin,
    c,
    kbuf_ptr,
    kb_page_stride,
    kb_off_stride,
    kb_head_stride,
    vbuf_ptr,
    vb_page_stride,
    vb_off_stride,
    vb_head_stride,
    num_slots,
    eps,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    PAIR_MODE: tl.constexpr,
    KBUF_PAIR_MODE: tl.constexpr,
    ROTATE: tl.constexpr,
    WRITE_KV: tl.constexpr,
    K_SCALE_MODE: tl.constexpr,
    V_SCALE_MODE: tl.constexpr,
    K_FP8_MAX: tl.constexpr,
    V_FP8_MAX: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
    QK_NORM: tl.constexpr,
    SS_FP64: tl.constexpr,
    SLOT_EARLY: tl.constexpr,
    slot_pre=None,
    SLOT_PRE: tl.constexpr = False,
):
    """A key/value block once its loads (key_value_in) and the cos/sin row are in: normalise
    (QK_NORM) and rotate K in place, store K and V into the cache slot. SLOT_EARLY: the slot's
    cache rows first (see key_value). SLOT_PRE: slot_pre holds them (worked out before the PDL
    wait by rope_kv_kernel; loc is then unused)."""
    HALF: tl.constexpr = ROT_DIM // 2
    if WRITE_KV and SLOT_PRE:
        ok, kdst, vdst = slot_pre
    elif WRITE_KV and SLOT_EARLY:
        ok, kdst, vdst = _slot_rows(
            loc,
            num_slots,
            kh,
            kbuf_ptr,
            kb_page_stride,
            kb_off_stride,
            kb_head_stride,
            vbuf_ptr,
            vb_page_stride,
            vb_off_stride,
            vb_head_stride,
            PAGE_SIZE,
        )
    if ROTATE:
        KT: tl.constexpr = k_row.dtype.element_ty
        if QK_NORM:  # RMSNorm of the whole head, rounded to the key dtype as torch does
            ka, kb, k_tail = rms_norm_head(
                ka,
                kb,
                k_tail.to(tl.float32),
                wa,
                wb,
                wt,
                eps,
                HEAD_DIM,
                BLOCK_TAIL > 0,
                KT,
                SS_FP64,
            )
        # Round to the key dtype: the cache stores exactly the key the op returns.
        ka, kb = rotate_pair(ka, kb, cos, sin)
        ka, kb = ka.to(KT).to(tl.float32), kb.to(KT).to(tl.float32)
        inplace_fence()  # every load of the key (any layout's copy) before it is overwritten
        if QK_NORM and BLOCK_TAIL > 0:
            tl.store(k_row + dt, k_tail.to(KT), mask=t_mask)
        store_pairs(k_row, c, km, ka, kb, HALF, PAIR_MODE)
    if WRITE_KV:
        if not SLOT_EARLY and not SLOT_PRE:
            ok, kdst, vdst = _slot_rows(
                loc,
                num_slots,
                kh,
                kbuf_ptr,
                kb_page_stride,
                kb_off_stride,
                kb_head_stride,
                vbuf_ptr,
                vb_page_stride,
                vb_off_stride,
                vb_head_stride,
                PAGE_SIZE,
            )
        KS: tl.constexpr = K_SCALE_MODE > 0
        KDT: tl.constexpr = kbuf_ptr.dtype.element_ty
        VDT: tl.constexpr = vbuf_ptr.dtype.element_ty
        k_inv = reciprocal(k_s, K_SCALE_MODE)  # after all loads (see reciprocal)
        v_inv = reciprocal(v_s, V_SCALE_MODE)
        qa = quantize(ka, k_inv, KS, K_FP8_MAX, EMULATE_FP8, KDT)
        qb = quantize(kb, k_inv, KS, K_FP8_MAX, EMULATE_FP8, KDT)
        store_pairs(kdst, c, km & ok, qa, qb, HALF, KBUF_PAIR_MODE if ROTATE else 0)
        if BLOCK_TAIL > 0:
            kt = quantize(k_tail.to(tl.float32), k_inv, KS, K_FP8_MAX, EMULATE_FP8, KDT)
            tl.store(kdst + dt, kt, mask=t_mask & ok)
        vq = quantize(v.to(tl.float32), v_inv, V_SCALE_MODE > 0, V_FP8_MAX, EMULATE_FP8, VDT)
        tl.store(vdst + dv, vq, mask=dv_mask & ok)


@triton.jit
def key_value(
    t,
    kvb,
    cs_row,
    pos_at,
    cs_stride,
    max_pos,
    c,
    c_ok,
    k_ptr,
    k_tok_stride,
    k_head_stride,
    v_ptr,
    v_tok_stride,
    v_head_stride,
    kbuf_ptr,
    kb_page_stride,
    kb_off_stride,
    kb_head_stride,
    vbuf_ptr,
    vb_page_stride,
    vb_off_stride,
    vb_head_stride,
    loc_ptr,
    num_slots,
    k_scale_ptr,
    v_scale_ptr,
    k_scale_f,
    v_scale_f,
    num_kv_heads,
    kw_ptr,
    kw_pre_a,
    kw_pre_b,
    kw_pre_t,
    eps,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    PAIR_MODE: tl.constexpr,
    KBUF_PAIR_MODE: tl.constexpr,
    IS_BF16: tl.constexpr,
    ROTATE: tl.constexpr,
    WRITE_KV: tl.constexpr,
    K_SCALE_MODE: tl.constexpr,
    V_SCALE_MODE: tl.constexpr,
    K_FP8_MAX: tl.constexpr,
    V_FP8_MAX: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
    QK_NORM: tl.constexpr,
    SS_FP64: tl.constexpr,
    POS_LAST: tl.constexpr,
    W_PRE: tl.constexpr = False,
    slot_pre=None,
    SLOT_PRE: tl.constexpr = False,
):
    """Key/value block kvb of token t: rotate K in place, store K and V into the cache slot.
    Returns the token's (cos, sin), loaded after every other load of the block. With W_PRE the
    key's norm weights are kw_pre_a / kw_pre_b / kw_pre_t (loaded by the caller before the PDL
    wait); otherwise those are unused. With SLOT_PRE, slot_pre is the slot's cache rows
    (worked out before the wait) and the slot is not loaded here.

    With the norm and POS_LAST 1 the slot's cache rows are worked out under the cos/sin load:
    after the rotation (as without the norm), ptxas leaves this arithmetic behind the branch of
    the in-place K store, on the program's critical path (~60 dependent instructions at T = 1).
    """
    (kh, k_row, km, dv, dv_mask, dt, t_mask, loc, v, k_s, v_s, k_tail, ka, kb, wa, wb,
     wt) = key_value_in(
        t, kvb, c, c_ok, k_ptr, k_tok_stride, k_head_stride, v_ptr, v_tok_stride, v_head_stride,
        loc_ptr, k_scale_ptr, v_scale_ptr, k_scale_f, v_scale_f, num_kv_heads, kw_ptr, HEAD_DIM,
        V_HEAD_DIM, ROT_DIM, BLOCK_HALF, BLOCK_TAIL, BLOCK_DV, BLOCK_HKV, PAIR_MODE, IS_BF16,
        ROTATE, WRITE_KV, K_SCALE_MODE, V_SCALE_MODE, QK_NORM, SLOT_PRE,
    )  # fmt: skip
    if W_PRE:  # loaded before the PDL wait (rope_kv_kernel's NORM_W_PRE)
        wa, wb, wt = kw_pre_a, kw_pre_b, kw_pre_t
    HALF: tl.constexpr = ROT_DIM // 2
    cos, sin, eps = cos_sin(
        cs_row, pos_at, cs_stride, max_pos, c, c_ok, eps, HALF, BLOCK_HALF, ROTATE, POS_LAST,
        EMULATE_FP8,
    )  # fmt: skip
    key_value_out(
        kh, k_row, km, dv, dv_mask, dt, t_mask, loc, v, k_s, v_s, k_tail, ka, kb, wa, wb, wt,
        cos, sin, c, kbuf_ptr, kb_page_stride, kb_off_stride, kb_head_stride, vbuf_ptr,
        vb_page_stride, vb_off_stride, vb_head_stride, num_slots, eps, PAGE_SIZE, HEAD_DIM,
        ROT_DIM, BLOCK_TAIL, PAIR_MODE, KBUF_PAIR_MODE, ROTATE, WRITE_KV, K_SCALE_MODE,
        V_SCALE_MODE, K_FP8_MAX, V_FP8_MAX, EMULATE_FP8, QK_NORM, SS_FP64,
        QK_NORM and POS_LAST == 1, slot_pre, SLOT_PRE,
    )  # fmt: skip
    return cos, sin, eps
