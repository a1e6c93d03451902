"""Triton kernel: RoPE on q/k in place, and the rotated K plus V stored into the KV cache.

One program handles one token and a block of heads. Separate layout: the first NUM_Q_BLOCKS
programs of a token rotate query heads, the rest rotate key heads and (WRITE_KV) store K and V
into the cache slot of the token. Merged layout (more tokens): program j rotates query block j
and, if j < NUM_KV_BLOCKS, also does key/value block j, sharing the position and cos/sin row.
Programs sit on a 2-D (tokens, blocks) grid or on a 1-D grid, token-major or with every
token's key/value program first (GRID_ORDER, chosen by launch_config).
The same kernel with ROTATE=False is the standalone KV write.

The rotary dims of a head are addressed as a [HALF, 2] grid of pairs (i, j): neox pairs dim i
with dim i + HALF, GPT-J pairs dim 2i with 2i + 1. Both load as one contiguous tile and are split
in registers, so neither needs a gather.

The host side (launch heuristics, the launch plan, the argument tuple) is rope_kv_plan.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_ext.triton.key_value import (
    _slot_rows,
    clamp_position,
    cos_sin,
    key_value,
    key_value_in,
    key_value_out,
    position_at,
)
from sgl_ext.triton.pdl import pdl_enter
from sgl_ext.triton.qk_norm import load_norm_weights, query_in, query_norm, query_out
from sgl_ext.triton.rope_kv_args import (
    CosSinRow,
    Flags,
    KVCache,
    KVSource,
    PagedBuffer,
    QueryRows,
    Scale,
    Tile,
    TokenHeads,
)


@triton.jit
def rope_kv_kernel(
    # The arguments of rope_kv_schema.KERNEL_ARGS (names and roles; a plan passes them in
    # CALL_NAMES' order, per-call pointers first), each pointer beside its strides here:
    # measured on the H100, 1-5% less time per call at T <= 512 than with the pointers first
    # (ptxas schedules the two orders differently).
    pos_ptr,
    cos_sin_ptr,
    cs_stride,
    q_ptr,
    q_tok_stride,
    q_head_stride,
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
    num_q_heads,
    num_kv_heads,
    max_pos,
    qw_ptr,  # QK_NORM: RMSNorm weights [HEAD_DIM] of the query and key heads
    kw_ptr,
    eps,  # QK_NORM: the RMSNorm epsilon
    NUM_Q_BLOCKS: tl.constexpr,  # query head blocks per token
    NUM_KV_BLOCKS: tl.constexpr,  # key/value head blocks per token
    MERGED: tl.constexpr,  # program j does query block j and key/value block j (if any)
    GRID_ORDER: tl.constexpr,  # launch_layout.GridOrder: 0 2d, 1 token, 2 kv_first
    PAGE_SIZE: tl.constexpr,  # constexpr: a power of two becomes a shift, no 64-bit division
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,  # query heads per program
    BLOCK_HKV: tl.constexpr,  # key/value heads per program
    PAIR_MODE: tl.constexpr,  # see load_pairs
    KBUF_PAIR_MODE: tl.constexpr,  # pair layout used for the K-cache store
    IS_BF16: tl.constexpr,
    ROTATE: tl.constexpr,
    WRITE_KV: tl.constexpr,
    K_SCALE_MODE: tl.constexpr,  # 0 none, 1 python float, 2 device tensor
    V_SCALE_MODE: tl.constexpr,
    K_FP8_MAX: tl.constexpr,  # 0 when the buffer is not fp8
    V_FP8_MAX: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
    QK_NORM: tl.constexpr = False,  # RMSNorm each q and k head (whole head) before RoPE
    SS_FP64: tl.constexpr = False,  # QK_NORM: the sum of squares in fp64 (see rms_norm_head)
    # POS_LAST: load the position in each program kind's own path, after its data loads (0:
    # at the start of the program). ptxas otherwise issues the first use of the position (its
    # clamp) before the branch to the program kinds, so their data loads start only once the
    # position has arrived, and a q/k-norm program normalises only after the cos/sin row has
    # come too. 1: no barrier (separate programs; a barrier waits for the loads in flight, one
    # more round trip: +0.12-0.15 µs at T = 1 on the H100); 2: behind a barrier, which ptxas
    # moves no load across (merged programs, where it measured faster at T ~ 512). 3
    # (LOAD_BARRIER): the position loaded with the data at the start, then every other load,
    # then a barrier whose result the position's clamp and the norm's epsilon take (ptxas moves
    # arithmetic across a plain barrier), then the cos/sin row: two round trips in every
    # program kind, the norm under the second. 4 (PRE_WAIT): the position and the cos/sin row
    # before the PDL wait (decode sizes), then the data: one round trip after the wait.
    POS_LAST: tl.constexpr = 0,
    # HOIST (merged programs): every load of the program (query, key/value block, slot, scales,
    # norm weights) before the branch to the key/value part, and the query's norm before it
    # too. Otherwise ptxas issues the key/value loads inside the branch, after the position's
    # clamp has waited for the position, and the query's norm follows the key/value stores.
    HOIST: tl.constexpr = False,
    # EARLY_RELEASE: let the next kernel launch before waiting for the previous one (the other
    # kernels' order, pdl.pdl_enter); by default this kernel waits first (see below).
    EARLY_RELEASE: tl.constexpr = False,
    # NORM_W_PRE (QK_NORM with POS_LAST 4): the query's and the key's norm weights are loaded
    # before the PDL wait too (see below).
    NORM_W_PRE: tl.constexpr = False,
    # SLOT_PRE (WRITE_KV with POS_LAST 4): the slot and its cache rows before the PDL wait too
    # (see below).
    SLOT_PRE: tl.constexpr = False,
):
    NUM_BLOCKS: tl.constexpr = (
        max(NUM_Q_BLOCKS, NUM_KV_BLOCKS) if MERGED else NUM_Q_BLOCKS + NUM_KV_BLOCKS
    )
    if GRID_ORDER == 1:  # token, 1-D grid: a token's programs are neighbours (cos/sin)
        pid = tl.program_id(0)
        t = (pid // NUM_BLOCKS).to(tl.int64)
        hb = pid % NUM_BLOCKS
    elif GRID_ORDER == 2:  # kv_first, 1-D, merged: the longer key/value programs of all
        # tokens first (token-major), then the query-only ones (token-major): no long program is
        # left to start in the last wave.
        QO_BLOCKS: tl.constexpr = NUM_BLOCKS - NUM_KV_BLOCKS
        pid = tl.program_id(0)
        n_kv = tl.num_programs(0) // NUM_BLOCKS * NUM_KV_BLOCKS
        kv = pid < n_kv
        j = pid - n_kv
        t = tl.where(kv, pid // NUM_KV_BLOCKS, j // QO_BLOCKS).to(tl.int64)
        hb = tl.where(kv, pid % NUM_KV_BLOCKS, NUM_KV_BLOCKS + j % QO_BLOCKS)
    else:  # 2d, grid (tokens, blocks): no division; faster at small T (docs/performance.md)
        t = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
    HALF: tl.constexpr = ROT_DIM // 2
    c = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]: pair index = cos/sin column
    c_ok = c < HALF
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1] query heads
    # Wait, then release the next launch (unless EARLY_RELEASE): with the early release (every
    # other kernel's order) a CUDA graph of back-to-back calls ran the q/k-norm variant
    # 1.10-1.35x RoPE + KV alone at T = 32..256 against 1.02-1.16x, and RoPE + KV alone was no
    # faster (H100; decode end to end the same either way: benchmarks/RESULTS.md 9).
    if ROTATE and POS_LAST == 4:
        # PRE_WAIT: the position and its cos/sin row before the wait. No kernel that may still
        # run writes them (positions come from the host or from kernels that have completed;
        # see pdl.py), so the position -> cos/sin chain overlaps the previous kernel.
        cs_pre = cos_sin_ptr + clamp_position(tl.load(pos_ptr + t), max_pos) * cs_stride
        cos_pre = tl.load(cs_pre + c, mask=c_ok, other=0.0).to(tl.float32)
        sin_pre = tl.load(cs_pre + HALF + c, mask=c_ok, other=0.0).to(tl.float32)
    # NORM_W_PRE (PRE_WAIT with the norm): the query's and the key's norm weights too (weights:
    # no kernel writes them). At decode they come from DRAM, a round trip of their own after the
    # wait; a program loads only the row it uses (the other's mask is empty).
    W_PRE: tl.constexpr = NORM_W_PRE and QK_NORM and ROTATE and POS_LAST == 4
    # What the helpers take, bundled (rope_kv_args.py: no IR of their own).
    cfg: tl.constexpr = Flags(
        PAGE_SIZE=PAGE_SIZE,
        HEAD_DIM=HEAD_DIM,
        V_HEAD_DIM=V_HEAD_DIM,
        ROT_DIM=ROT_DIM,
        HALF=HALF,
        BLOCK_HALF=BLOCK_HALF,
        BLOCK_TAIL=BLOCK_TAIL,
        BLOCK_DV=BLOCK_DV,
        BLOCK_HKV=BLOCK_HKV,
        PAIR_MODE=PAIR_MODE,
        KBUF_PAIR_MODE=KBUF_PAIR_MODE,
        IS_BF16=IS_BF16,
        ROTATE=ROTATE,
        WRITE_KV=WRITE_KV,
        K_SCALE_MODE=K_SCALE_MODE,
        V_SCALE_MODE=V_SCALE_MODE,
        K_FP8_MAX=K_FP8_MAX,
        V_FP8_MAX=V_FP8_MAX,
        EMULATE_FP8=EMULATE_FP8,
        QK_NORM=QK_NORM,
        SS_FP64=SS_FP64,
        POS_LAST=POS_LAST,
        W_PRE=W_PRE,
        SLOT_PRE=SLOT_PRE,
    )
    kbuf = PagedBuffer(kbuf_ptr, kb_page_stride, kb_off_stride, kb_head_stride)
    vbuf = PagedBuffer(vbuf_ptr, vb_page_stride, vb_off_stride, vb_head_stride)
    cache = KVCache(kbuf, vbuf, num_slots)
    k_in = TokenHeads(k_ptr, k_tok_stride, k_head_stride)
    v_in = TokenHeads(v_ptr, v_tok_stride, v_head_stride)
    k_scale = Scale(k_scale_ptr, k_scale_f)
    v_scale = Scale(v_scale_ptr, v_scale_f)
    src = KVSource(k_in, v_in, loc_ptr, k_scale, v_scale, num_kv_heads, kw_ptr)
    zero_w = tl.zeros([1, 1], tl.float32)
    qw_pre = (zero_w, zero_w, zero_w)
    kw_pre = qw_pre
    if W_PRE:
        if BLOCK_TAIL > 0:
            dtw = ROT_DIM + tl.arange(0, BLOCK_TAIL)[None, :]  # [1, BLOCK_TAIL]
        else:
            dtw = c  # unused
        # [1, 1] limits (0: this program does not use the row); a scalar & tensor mask is
        # rejected by newer interpreters
        one = tl.full([1, 1], 1, tl.int32)
        if MERGED:
            uses_q = one
            uses_k = tl.where(hb < NUM_KV_BLOCKS, one, 0)
        else:
            uses_q = tl.where(hb < NUM_Q_BLOCKS, one, 0)
            uses_k = 1 - uses_q
        qw_pre = load_norm_weights(qw_ptr, c, c < HALF * uses_q, dtw, dtw < HEAD_DIM * uses_q, cfg)
        kw_pre = load_norm_weights(kw_ptr, c, c < HALF * uses_k, dtw, dtw < HEAD_DIM * uses_k, cfg)
    # SLOT_PRE: the token's slot and the cache rows of this program's key/value block (slot
    # tables are batch metadata: pdl.py). Its paged-cache arithmetic (~40 dependent integer
    # instructions) otherwise ran after the data arrived, on the critical path; ptxas put it
    # behind the key's norm.
    slot_pre = (tl.zeros([1, 1], tl.int1), kbuf_ptr, vbuf_ptr)  # unused without SLOT_PRE
    if SLOT_PRE:
        if MERGED:
            kvb_pre = hb
        else:  # (query programs: block 0's rows, never used)
            kvb_pre = tl.maximum(hb - NUM_Q_BLOCKS, 0)
        kh_pre = kvb_pre * BLOCK_HKV + tl.arange(0, BLOCK_HKV)[:, None]  # [BHKV, 1]
        loc_pre = tl.load(loc_ptr + t + tl.zeros([1, 1], tl.int32)).to(tl.int64)
        slot_pre = _slot_rows(loc_pre, kh_pre, cache, PAGE_SIZE)
    pdl_enter(USE_PDL, WAIT_FIRST=not EARLY_RELEASE)
    # Loads are issued in order: the position first (the longest chain: position -> cos/sin
    # row), then the slot and the data, then the cos/sin row (cos_sin, which waits on the
    # position), all before the first store.
    if ROTATE and POS_LAST == 4:  # cos_sin hands these back
        cs_row = cos_pre
        pos_at = sin_pre
    else:
        if ROTATE and not POS_LAST:
            cs_row = cos_sin_ptr + clamp_position(tl.load(pos_ptr + t), max_pos) * cs_stride
        else:  # plain KV write (no rotation), or the position is loaded by cos_sin
            cs_row = cos_sin_ptr
        pos_at = position_at(pos_ptr + t, ROTATE and POS_LAST == 3)
    pos = CosSinRow(cs_row, pos_at, cs_stride, max_pos)
    tile = Tile(t, c, c_ok)
    q_mask = (heads < num_q_heads) & c_ok  # all false past the last query block
    q_row = q_ptr + t * q_tok_stride + heads * q_head_stride
    if QK_NORM and BLOCK_TAIL > 0:  # the query's pass-through dims are normalised too
        dqt = ROT_DIM + tl.arange(0, BLOCK_TAIL)[None, :]  # [1, BLOCK_TAIL]
        qt_mask = (heads < num_q_heads) & (dqt < HEAD_DIM)
    else:
        dqt, qt_mask = c, q_mask  # unused
    qr = QueryRows(q_row, q_mask, dqt, qt_mask)
    if MERGED:
        x, w = query_in(qr, c, qw_ptr, cfg)
        if W_PRE:  # (query_in's own weight loads are then dead code)
            w = qw_pre
        if HOIST:
            # key/value block hb's loads in every program (nothing past the last key/value head)
            blk, kw = key_value_in(tile, hb, src, cfg)
            if W_PRE:
                kw = kw_pre
            cos, sin, eps = cos_sin(pos, tile, eps, cfg)
            if QK_NORM:  # the query's norm before the branch (query_out then only rotates)
                x = query_norm(qr, x, w, eps, cfg)
            if hb < NUM_KV_BLOCKS:
                key_value_out(blk, kw, cos, sin, c, cache, eps, cfg, False, slot_pre)
        elif hb < NUM_KV_BLOCKS:
            cos, sin, eps = key_value(tile, hb, pos, src, cache, kw_pre, eps, cfg, slot_pre)
        else:
            cos, sin, eps = cos_sin(pos, tile, eps, cfg)
        query_out(qr, c, x, w, cos, sin, eps, cfg, QK_NORM and not HOIST)
    elif hb < NUM_Q_BLOCKS:
        x, w = query_in(qr, c, qw_ptr, cfg)
        if W_PRE:
            w = qw_pre
        cos, sin, eps = cos_sin(pos, tile, eps, cfg)
        query_out(qr, c, x, w, cos, sin, eps, cfg, QK_NORM)
    else:
        key_value(tile, hb - NUM_Q_BLOCKS, pos, src, cache, kw_pre, eps, cfg, slot_pre)
