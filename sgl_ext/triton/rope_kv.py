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
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from sgl_ext import settings
from sgl_ext._backend import pdl_capable
from sgl_ext._common import KVLayout, QKNormCall, RopeCall, fp8_max
from sgl_ext.triton.launcher import KernelLauncher, make_launcher
from sgl_ext.triton.pairs import load_pairs, load_scale, quantize, reciprocal, store_pairs
from sgl_ext.triton.qk_norm import load_norm_weights, query_in, query_out, rms_norm_head


@triton.jit
def _cos_sin(cs_row, c, c_ok, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, ROTATE: tl.constexpr):
    """The token's cos and sin rows as [1, BLOCK_HALF] fp32 (zeros without rotation)."""
    if ROTATE:
        cos = tl.load(cs_row + c, mask=c_ok, other=0.0).to(tl.float32)
        sin = tl.load(cs_row + HALF + c, mask=c_ok, other=0.0).to(tl.float32)
    else:
        cos = tl.zeros([1, BLOCK_HALF], tl.float32)
        sin = cos
    return cos, sin


@triton.jit
def _key_value(
    t,
    kvb,
    cs_row,
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
):
    """Key/value block kvb of token t: rotate K in place, store K and V into the cache slot.
    Returns the token's (cos, sin), loaded after every other load of the block."""
    HALF: tl.constexpr = ROT_DIM // 2
    kh = kvb * BLOCK_HKV + tl.arange(0, BLOCK_HKV)[:, None]  # [BHKV, 1]
    h_ok = kh < num_kv_heads
    k_row = k_ptr + t * k_tok_stride + kh * k_head_stride
    if WRITE_KV:
        # Issue every independent load first: slot, V row, K tail, scales.
        # [1, 1] rather than a scalar: newer Triton interpreters reject scalar & tensor masks.
        loc = tl.load(loc_ptr + t + tl.zeros([1, 1], tl.int32)).to(tl.int64)
        dv = tl.arange(0, BLOCK_DV)[None, :]
        dv_mask = h_ok & (dv < V_HEAD_DIM)
        v = tl.load(v_ptr + t * v_tok_stride + kh * v_head_stride + dv, mask=dv_mask)
        k_s = load_scale(k_scale_ptr, k_scale_f, K_SCALE_MODE)
        v_s = load_scale(v_scale_ptr, v_scale_f, V_SCALE_MODE)
    if BLOCK_TAIL > 0:
        dt = ROT_DIM + tl.arange(0, BLOCK_TAIL)[None, :]  # [1, BLOCK_TAIL] pass-through dims
        t_mask = h_ok & (dt < HEAD_DIM)
        if WRITE_KV or QK_NORM:  # they go to the cache too, and the norm reads them
            k_tail = tl.load(k_row + dt, mask=t_mask, other=0.0)
    else:
        dt, t_mask = c, c_ok  # unused
        k_tail = tl.zeros([1, 1], tl.float32)  # unused
    km = h_ok & c_ok
    if ROTATE:
        ka, kb = load_pairs(k_row, c, km, HALF, PAIR_MODE, IS_BF16)
    else:  # plain KV write: the whole head as one contiguous "pair" tile
        ka, kb = load_pairs(k_row, c, km, HALF, 0, IS_BF16)
    if QK_NORM:
        wa, wb, wt = load_norm_weights(
            kw_ptr, c, c_ok, dt, dt < HEAD_DIM, HALF, PAIR_MODE, IS_BF16, BLOCK_TAIL > 0
        )
    cos, sin = _cos_sin(cs_row, c, c_ok, HALF, BLOCK_HALF, ROTATE)
    if ROTATE:
        KT: tl.constexpr = k_ptr.dtype.element_ty
        if QK_NORM:  # RMSNorm of the whole head, rounded to the key dtype as torch does
            ka, kb, k_tail = rms_norm_head(
                ka, kb, k_tail.to(tl.float32), wa, wb, wt, eps, HEAD_DIM, BLOCK_TAIL > 0, KT
            )
            if BLOCK_TAIL > 0:
                tl.store(k_row + dt, k_tail.to(KT), mask=t_mask)
        # Round to the key dtype: the cache stores exactly the key the op returns.
        ka, kb = (
            (ka * cos - kb * sin).to(KT).to(tl.float32),
            (kb * cos + ka * sin).to(KT).to(tl.float32),
        )
        store_pairs(k_row, c, km, ka, kb, HALF, PAIR_MODE)
    if WRITE_KV:
        ok = (loc >= 0) & (loc < num_slots)  # other slots are skipped, never written
        loc = tl.where(ok, loc, 0)
        page = loc // PAGE_SIZE
        off = loc - page * PAGE_SIZE
        kdst = kbuf_ptr + page * kb_page_stride + off * kb_off_stride + kh * kb_head_stride
        vdst = vbuf_ptr + page * vb_page_stride + off * vb_off_stride + kh * vb_head_stride
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
    return cos, sin


@triton.jit
def rope_kv_kernel(
    # Per-call pointers first, then the launch plan's fixed arguments, then the constexprs
    # (the order KernelLauncher's direct launch relies on).
    pos_ptr,
    cos_sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    kbuf_ptr,
    vbuf_ptr,
    loc_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qw_ptr,  # QK_NORM: RMSNorm weights [HEAD_DIM] of the query and key heads
    kw_ptr,
    k_scale_f,
    v_scale_f,
    cs_stride,
    q_tok_stride,
    q_head_stride,
    k_tok_stride,
    k_head_stride,
    v_tok_stride,
    v_head_stride,
    kb_page_stride,
    kb_off_stride,
    kb_head_stride,
    vb_page_stride,
    vb_off_stride,
    vb_head_stride,
    num_slots,
    num_q_heads,
    num_kv_heads,
    max_pos,
    eps,  # QK_NORM: the RMSNorm epsilon
    NUM_Q_BLOCKS: tl.constexpr,  # query head blocks per token
    NUM_KV_BLOCKS: tl.constexpr,  # key/value head blocks per token
    MERGED: tl.constexpr,  # program j does query block j and key/value block j (if any)
    GRID_ORDER: tl.constexpr,  # ORDER_2D, ORDER_TOKEN or ORDER_KV_FIRST (see LaunchConfig)
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
):
    NUM_BLOCKS: tl.constexpr = (
        max(NUM_Q_BLOCKS, NUM_KV_BLOCKS) if MERGED else NUM_Q_BLOCKS + NUM_KV_BLOCKS
    )
    if GRID_ORDER == 1:  # ORDER_TOKEN, 1-D grid: a token's programs are neighbours (cos/sin)
        pid = tl.program_id(0)
        t = (pid // NUM_BLOCKS).to(tl.int64)
        hb = pid % NUM_BLOCKS
    elif GRID_ORDER == 2:  # ORDER_KV_FIRST, 1-D, merged: the longer key/value programs of all
        # tokens first (token-major), then the query-only ones (token-major): no long program is
        # left to start in the last wave.
        QO_BLOCKS: tl.constexpr = NUM_BLOCKS - NUM_KV_BLOCKS
        pid = tl.program_id(0)
        n_kv = tl.num_programs(0) // NUM_BLOCKS * NUM_KV_BLOCKS
        kv = pid < n_kv
        j = pid - n_kv
        t = tl.where(kv, pid // NUM_KV_BLOCKS, j // QO_BLOCKS).to(tl.int64)
        hb = tl.where(kv, pid % NUM_KV_BLOCKS, NUM_KV_BLOCKS + j % QO_BLOCKS)
    else:  # ORDER_2D, grid (tokens, blocks): no division; faster at small T (docs/performance.md)
        t = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
    HALF: tl.constexpr = ROT_DIM // 2
    c = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]: pair index = cos/sin column
    c_ok = c < HALF
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1] query heads
    if USE_PDL:
        # Programmatic dependent launch: everything above overlapped the previous kernel; wait
        # for its results before the first load, and let the next kernel start launching.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if ROTATE:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)  # memory safety; debug checks report
        cs_row = cos_sin_ptr + pos * cs_stride
    else:  # plain KV write: no query blocks, no rotation
        cs_row = cos_sin_ptr
    # Loads are issued in order (slot, data, then the cos/sin row, which waits on the position),
    # all before the first store.
    q_mask = (heads < num_q_heads) & c_ok  # all false past the last query block
    q_row = q_ptr + t * q_tok_stride + heads * q_head_stride
    if QK_NORM and BLOCK_TAIL > 0:  # the query's pass-through dims are normalised too
        dqt = ROT_DIM + tl.arange(0, BLOCK_TAIL)[None, :]  # [1, BLOCK_TAIL]
        qt_mask = (heads < num_q_heads) & (dqt < HEAD_DIM)
    else:
        dqt, qt_mask = c, q_mask  # unused
    if MERGED:
        a, b, qt, wa, wb, wt = query_in(
            q_row,
            c,
            q_mask,
            dqt,
            qt_mask,
            qw_ptr,
            HALF,
            HEAD_DIM,
            BLOCK_TAIL,
            PAIR_MODE,
            IS_BF16,
            QK_NORM,
        )
        if hb < NUM_KV_BLOCKS:
            cos, sin = _key_value(
                t,
                hb,
                cs_row,
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
                eps,
                PAGE_SIZE,
                HEAD_DIM,
                V_HEAD_DIM,
                ROT_DIM,
                BLOCK_HALF,
                BLOCK_TAIL,
                BLOCK_DV,
                BLOCK_HKV,
                PAIR_MODE,
                KBUF_PAIR_MODE,
                IS_BF16,
                ROTATE,
                WRITE_KV,
                K_SCALE_MODE,
                V_SCALE_MODE,
                K_FP8_MAX,
                V_FP8_MAX,
                EMULATE_FP8,
                QK_NORM,
            )
        else:
            cos, sin = _cos_sin(cs_row, c, c_ok, HALF, BLOCK_HALF, ROTATE)
        query_out(
            q_row,
            c,
            q_mask,
            a,
            b,
            qt,
            wa,
            wb,
            wt,
            dqt,
            qt_mask,
            cos,
            sin,
            eps,
            HALF,
            HEAD_DIM,
            BLOCK_TAIL,
            PAIR_MODE,
            QK_NORM,
        )
    elif hb < NUM_Q_BLOCKS:
        a, b, qt, wa, wb, wt = query_in(
            q_row,
            c,
            q_mask,
            dqt,
            qt_mask,
            qw_ptr,
            HALF,
            HEAD_DIM,
            BLOCK_TAIL,
            PAIR_MODE,
            IS_BF16,
            QK_NORM,
        )
        cos, sin = _cos_sin(cs_row, c, c_ok, HALF, BLOCK_HALF, ROTATE)
        query_out(
            q_row,
            c,
            q_mask,
            a,
            b,
            qt,
            wa,
            wb,
            wt,
            dqt,
            qt_mask,
            cos,
            sin,
            eps,
            HALF,
            HEAD_DIM,
            BLOCK_TAIL,
            PAIR_MODE,
            QK_NORM,
        )
    else:
        _key_value(
            t,
            hb - NUM_Q_BLOCKS,
            cs_row,
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
            eps,
            PAGE_SIZE,
            HEAD_DIM,
            V_HEAD_DIM,
            ROT_DIM,
            BLOCK_HALF,
            BLOCK_TAIL,
            BLOCK_DV,
            BLOCK_HKV,
            PAIR_MODE,
            KBUF_PAIR_MODE,
            IS_BF16,
            ROTATE,
            WRITE_KV,
            K_SCALE_MODE,
            V_SCALE_MODE,
            K_FP8_MAX,
            V_FP8_MAX,
            EMULATE_FP8,
            QK_NORM,
        )


def _pow2(n: int) -> int:
    """Smallest power of two >= n (plain Python: triton.next_power_of_2 costs ~7 µs a call)."""
    return 1 << max(0, n - 1).bit_length()


def _pow2_floor(n: int) -> int:
    """Largest power of two <= n (1 for n < 1)."""
    return 1 << max(0, n.bit_length() - 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _word_aligned(align: int, *strides: int) -> bool:
    """Every head row starts on a 4-byte boundary (16-bit pairs load as int32 words), given
    the data pointer % 16 and the element strides."""
    return align % 4 == 0 and all(s % 2 == 0 for s in strides)


def _gptj_mode(dtype: torch.dtype, rows: list[tuple[int, int, int]]) -> int:
    """2: 16-bit GPT-J pairs as int32 words when every row is 4-byte aligned, else 1 (strided).

    rows: (data_ptr % 16, token stride, head stride) of query and key.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        return 1
    return 2 if all(_word_aligned(a, ts, hs) for a, ts, hs in rows) else 1


ORDER_2D = 0  # 2-D (tokens, blocks) grid; the hardware runs block 0 of every token first
ORDER_TOKEN = 1  # 1-D grid, token-major: a token's programs are neighbours
ORDER_KV_FIRST = 2  # 1-D grid, merged only: every token's key/value program, then the others


class LaunchConfig(NamedTuple):
    block_h: int  # query heads per program (key/value heads: at most this many)
    num_warps: int
    order: int = ORDER_TOKEN  # program order on the grid (ORDER_*)
    merged: bool = False  # program j does query block j and key/value block j
    spread: bool = False  # merged: key/value heads spread over all query blocks (GQA groups)
    maxnreg: int = 0  # register cap per thread (0: the compiler's choice)


def launch_config(
    num_tokens: int, max_heads: int, head_dim: int, fp8_cache: bool = False
) -> LaunchConfig:
    """Heads per program and warps: small batches split heads finer for parallelism."""
    # "block_h,num_warps[,order[,merged[,spread[,maxnreg]]]]", for tuning only
    override = settings.get().triton_config
    if override:
        vals = list(override)
        # ints, then the two flags as bools, then maxnreg; LaunchConfig rejects a bad length
        args: list[Any] = [*vals[:3], *(bool(x) for x in vals[3:5]), *vals[5:6]]
        return LaunchConfig(*args)
    # Measured on the H100 (docs/performance.md, benchmarks/RESULTS.md; sweeps of 2026-11-22).
    # Up to 64 tokens:
    # separate query and key/value programs, one head each up to 8 tokens (latency: the K/V
    # program is the long one, and fp8 scales make it longer), 512 elements each up to 64.
    # More tokens: merged programs (a query block and a key/value block share the program, its
    # position and its cos/sin row), ~1K (D=128) or ~2K (D=64) elements per program, about 4
    # elements of each half tile per thread.
    # The 2-D grid (no index division) measured 0.1-0.2 µs faster than the 1-D grid at T <= 8.
    if num_tokens <= 8:
        return LaunchConfig(1, 4, ORDER_2D)
    if num_tokens <= 64:
        bh = min(_pow2_floor(512 // head_dim), 32, _pow2(max_heads))
        return LaunchConfig(bh, 4, ORDER_2D)
    maxnreg = 0
    if fp8_cache and num_tokens > 896 and head_dim in (64, 128):
        # fp8 caches from ~1K tokens: 16 heads x 4 warps, so each thread stores 8-byte pieces
        # of K and V rather than 4-byte ones; measured -1 to -4% (T 1024..32768), D = 64 with
        # a 40-register cap (without it, 16 x 4 is slower than 32 x 8).
        block_h, num_warps, maxnreg = 16, 4, 40 if head_dim == 64 else 0
    elif num_tokens <= 256 or head_dim > 64:
        block_h, num_warps = _pow2_floor(1024 // head_dim), 4
    else:
        block_h, num_warps = _pow2_floor(2048 // head_dim), 8
    block_h = min(block_h, 32, _pow2(max_heads))
    # At D = 128 the program with the key/value block moves ~3.5x the bytes of a query-only
    # one. Where the grid is a little over one wave, starting those first shortens the tail:
    # measured -1 to -3% (bf16 cache, T 448..640) and -2 to -5% (fp8, T 384..896 with 8
    # heads), +1 to +7% outside those windows (Llama-3-8B shape, H100, docs/performance.md). D = 64
    # (gpt-oss): no gain.
    lo, hi = (352, 896) if fp8_cache else (416, 704)
    order = ORDER_KV_FIRST if head_dim == 128 and lo < num_tokens <= hi else ORDER_TOKEN
    return LaunchConfig(block_h, num_warps, order, merged=True, maxnreg=maxnreg)


def plan_rope_kv(
    call: RopeCall,
    q_align: int,
    k_align: int,
    kb_align: int,
    enable_pdl: bool | None,
    norm: QKNormCall | None = None,
) -> KernelLauncher:
    """The kernel launch for a checked call: grid, fixed arguments, constexprs, options.

    q_align / k_align / kb_align: data_ptr() % 16 of query, key and k_buffer (GPT-J pairs load
    as 32-bit words only from 4-byte aligned rows). query None in `call`: the KV write alone;
    kv None: RoPE alone; norm: RMSNorm every q and k head first (the QK_NORM variant). Per
    call, `launch` (tensors) or `KernelLauncher.direct` (pointers) takes pos, cos_sin, q, k, v,
    k_buffer, v_buffer, cache_loc, k_scale, v_scale, q_norm_weight, k_norm_weight in that
    order (`rope_kv_args` fills the ones a call does not have).
    """
    s = settings.get()
    head_size = call.head_size
    rotate = call.query is not None
    # A plain KV write moves each head as one neox-style "pair" tile (plus an odd tail dim).
    rot = call.rot_dim if rotate else head_size - head_size % 2
    q = call.query
    num_q_heads, q_tok, q_head = (q.num_heads, q.token_stride, q.head_stride) if q else (0, 0, 0)
    k = call.key
    kv = call.kv
    if kv is not None:
        v_tok, v_head, v_head_dim = kv.value.token_stride, kv.value.head_stride, kv.v_head_dim
        k_lay, v_lay, k_dtype, v_dtype = kv.k_layout, kv.v_layout, kv.k_dtype, kv.v_dtype
        k_mode, v_mode, k_inv, v_inv = kv.k_scale_mode, kv.v_scale_mode, kv.k_inv, kv.v_inv
    else:
        v_tok, v_head, v_head_dim = 0, 0, 1
        k_lay = v_lay = KVLayout(1, 1, 0, 0, 0, 1, 1)
        k_dtype = v_dtype = call.dtype
        k_mode = v_mode = 0
        k_inv = v_inv = 1.0
    k_fp8_max = fp8_max(k_dtype)
    cfg = launch_config(call.num_tokens, max(num_q_heads, k.num_heads), head_size, k_fp8_max > 0)
    block_h = cfg.block_h
    num_q_blocks = _cdiv(num_q_heads, block_h)
    merged = cfg.merged and num_q_blocks > 0
    block_hkv = min(block_h, _pow2(k.num_heads))
    if merged and cfg.spread:
        block_hkv = _pow2(_cdiv(k.num_heads, num_q_blocks))
    num_kv_blocks = _cdiv(k.num_heads, block_hkv)
    per_token = max(num_q_blocks, num_kv_blocks) if merged else num_q_blocks + num_kv_blocks
    order = cfg.order
    if order == ORDER_KV_FIRST and not (merged and per_token > num_kv_blocks):
        order = ORDER_TOKEN  # nothing to put first
    # The 2-D grid's second axis holds at most 65535 blocks per token (never reached: heads).
    n = call.num_tokens
    grid = (n * per_token,) if order != ORDER_2D else (n, per_token)
    is_cuda = call.device.type == "cuda"
    if enable_pdl is None:
        enable_pdl = is_cuda and pdl_capable(call.device.index)
    use_pdl = bool(enable_pdl) and not s.interpret
    tail = head_size - rot
    pair_mode = 0
    if rotate and not call.is_neox:
        rows = [(q_align, q_tok, q_head), (k_align, *_strides(k))]
        if norm is not None:  # the weights load as pairs too
            rows += [(norm.q_weight_align, 0, 0), (norm.k_weight_align, 0, 0)]
        pair_mode = _gptj_mode(call.dtype, rows)
    kbuf_mode = pair_mode
    if pair_mode == 2 and (k_dtype != call.dtype or not _word_aligned(kb_align, *k_lay.strides)):
        kbuf_mode = 1
    options: dict[str, object] = {"num_warps": cfg.num_warps}
    if use_pdl:
        options["launch_pdl"] = True
    if cfg.maxnreg and not s.interpret:
        options["maxnreg"] = cfg.maxnreg
    fixed = (
        k_inv,
        v_inv,
        call.cs_stride if rotate else 0,
        q_tok,
        q_head,
        k.token_stride,
        k.head_stride,
        v_tok,
        v_head,
        *k_lay.strides,
        *v_lay.strides,
        k_lay.num_slots,
        num_q_heads,
        k.num_heads,
        call.max_pos if rotate else 1,
        norm.eps if norm is not None else 0.0,
    )
    constexprs = dict(
        NUM_Q_BLOCKS=num_q_blocks,
        NUM_KV_BLOCKS=num_kv_blocks,
        MERGED=merged,
        GRID_ORDER=order,
        PAGE_SIZE=k_lay.page_size,
        HEAD_DIM=head_size,
        V_HEAD_DIM=v_head_dim,
        ROT_DIM=rot,
        BLOCK_HALF=_pow2(max(1, rot // 2)),
        BLOCK_TAIL=_pow2(tail) if tail > 0 else 0,
        BLOCK_DV=_pow2(v_head_dim),
        BLOCK_H=block_h,
        BLOCK_HKV=block_hkv,
        PAIR_MODE=pair_mode,
        KBUF_PAIR_MODE=kbuf_mode,
        IS_BF16=call.dtype == torch.bfloat16,
        ROTATE=rotate,
        WRITE_KV=kv is not None,
        K_SCALE_MODE=k_mode,
        V_SCALE_MODE=v_mode,
        K_FP8_MAX=k_fp8_max,
        V_FP8_MAX=fp8_max(v_dtype),
        EMULATE_FP8=s.interpret,
        USE_PDL=use_pdl,
        QK_NORM=norm is not None,
    )
    return make_launcher(rope_kv_kernel, grid, fixed, constexprs, options, call.device)


def _strides(v) -> tuple[int, int]:
    return v.token_stride, v.head_stride


def rope_kv_args(
    positions: torch.Tensor | None,
    query: torch.Tensor | None,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor | None,
    value: torch.Tensor | None,
    k_buffer: torch.Tensor | None,
    v_buffer: torch.Tensor | None,
    cache_loc: torch.Tensor | None,
    k_scale: object,
    v_scale: object,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The kernel's per-call tensors in parameter order; key stands in for the unused ones."""
    t = (positions, cos_sin_cache, query, value, k_buffer, v_buffer, cache_loc)
    pos, cs, q, v, kb, vb, loc = (x if x is not None else key for x in t)
    ks = k_scale if isinstance(k_scale, torch.Tensor) else key
    vs = v_scale if isinstance(v_scale, torch.Tensor) else key
    qw = q_norm_weight if q_norm_weight is not None else key
    kw = k_norm_weight if k_norm_weight is not None else key
    return pos, cs, q, key, v, kb, vb, loc, ks, vs, qw, kw
