"""Triton kernel: a packed qkv projection's skinny decode GEMM with RoPE and the KV-cache write
in its epilogue (one launch instead of the GEMM's and the rope_kv kernel's).

out[M, N] = x[M, K] @ w[N, K]^T (+ bias), N = (Hq + 2 Hkv) * D: query heads, key heads, value
heads. Each program owns BLOCK_N rows of w, all from one head: BLOCK_N / 2 rotary pairs (neox:
dims p and p + D/2; GPT-J: 2p and 2p + 1), so the epilogue has both halves of every pair it
rotates. A row of a GEMV is a contiguous stream whatever its neighbours, so reading the pairs'
rows costs the same as reading BLOCK_N consecutive ones.

The K loop is the skinny GEMM's (`gemm.py`, dot=False, no split-K) on the same [BLOCK_M,
BLOCK_N, BLOCK_K] tiles, so each output column's sum has the same order and bits. The epilogue
then does what the rope_kv kernel does to those bits: rounds the GEMM result to x's dtype
(bias added in float32 first), rotates q and k in float32 with the same expressions, rounds,
and stores q, k, v into out; with WRITE_KV the rotated K and the V also go to the cache slot of
each token (slots < 0 or >= num_slots skipped; fp8 caches quantised as the rope_kv kernel does).

The positions, their cos/sin rows, the slots and the bias are loaded before the PDL wait: no
kernel that may still run writes them (pdl.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from sgl_ext import rope_kv_schema, settings
from sgl_ext._common import RopeCall
from sgl_ext.gemm_config import GemmConfig
from sgl_ext.triton.key_value import _slot_rows, clamp_position
from sgl_ext.triton.launcher import KernelLauncher, make_launcher, runtime_param_names
from sgl_ext.triton.pairs import load_scale, quantize, reciprocal, rotate_pair
from sgl_ext.triton.pdl import pdl_enter
from sgl_ext.triton.rope_kv_args import KVCache, PagedBuffer
from sgl_ext.triton.rounding import cast_rne


@triton.jit
def _pair_dims(j, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, IS_NEOX: tl.constexpr):
    """[BLOCK_N] dims of a head for program j of that head: the first BLOCK_N / 2 are the pairs'
    first elements (pair index p = j * BLOCK_N / 2 + i), the rest their partners."""
    HALF_N: tl.constexpr = BLOCK_N // 2
    i = tl.arange(0, BLOCK_N)
    p = j * HALF_N + i % HALF_N
    if IS_NEOX:
        return (i // HALF_N) * (HEAD_DIM // 2) + p
    else:
        return 2 * p + i // HALF_N


@triton.jit
def _halves(t, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] -> its two [BLOCK_M, BLOCK_N / 2] column halves."""
    t3 = tl.reshape(t, [BLOCK_M, 2, BLOCK_N // 2])
    return tl.split(tl.permute(t3, (0, 2, 1)))


@triton.jit(do_not_specialize=["M"])
def gemm_rope_kv_kernel(
    X,
    W,
    Bias,
    Out,
    Pos,
    CosSin,
    KBuf,
    VBuf,
    Loc,
    KScale,
    VScale,
    M,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    cs_stride,
    max_pos,
    kb_page_stride,
    kb_off_stride,
    kb_head_stride,
    vb_page_stride,
    vb_off_stride,
    vb_head_stride,
    num_slots,
    k_scale_f,
    v_scale_f,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    WRITE_KV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    K_SCALE_MODE: tl.constexpr,
    V_SCALE_MODE: tl.constexpr,
    K_FP8_MAX: tl.constexpr,
    V_FP8_MAX: tl.constexpr,
    EMULATE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    HALF_N: tl.constexpr = BLOCK_N // 2
    PROGS_PER_HEAD: tl.constexpr = HEAD_DIM // BLOCK_N
    pid = tl.program_id(0)
    head = pid // PROGS_PER_HEAD  # q heads, then k heads, then v heads
    j = pid % PROGS_PER_HEAD
    rotated = head < NUM_Q_HEADS + NUM_KV_HEADS
    d = _pair_dims(j, HEAD_DIM, BLOCK_N, IS_NEOX)  # [BN] dims within the head
    rn = head * HEAD_DIM + d  # [BN] output columns = rows of w
    rm = tl.arange(0, BLOCK_M)  # [BM] tokens
    rk = tl.arange(0, BLOCK_K)  # [BK]
    m_ok = rm < M
    # Before the wait: positions -> cos/sin rows [BM, BN/2] (pair index p), and the slots.
    pos = clamp_position(tl.load(Pos + rm, mask=m_ok, other=0), max_pos)
    pa = j * HALF_N + tl.arange(0, HALF_N)  # [BN/2] pair index within the head
    cs_row = CosSin + pos[:, None] * cs_stride
    cos = tl.load(cs_row + pa[None, :]).to(tl.float32)
    sin = tl.load(cs_row + HEAD_DIM // 2 + pa[None, :]).to(tl.float32)
    loc = tl.full([BLOCK_M], -1, tl.int64)
    if WRITE_KV:
        loc = tl.load(Loc + rm, mask=m_ok, other=-1).to(tl.int64)
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:  # a weight: no DRAM round trip left at the program's end
        bias = tl.load(Bias + rn).to(tl.float32)
    pdl_enter(USE_PDL)
    # The skinny GEMM's K loop (gemm.py, dot=False): the same tiles, the same sums.
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]  # [BN, BK]
    x_ptrs = X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]  # [BM, BK]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K) * BLOCK_K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k + rk) < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BM, BN, BK]
        acc += tl.sum(prod, axis=2)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += bias[None, :]
    DT: tl.constexpr = Out.dtype.element_ty
    res = cast_rne(acc, DT, EMULATE).to(tl.float32)  # the GEMM's output
    a, b = _halves(res, BLOCK_M, BLOCK_N)  # [BM, BN/2]: pairs' first / second elements
    if IS_NEOX:  # [1, BN/2]: the dims of a and b (as _pair_dims orders them)
        da = pa[None, :]
        db = da + HEAD_DIM // 2
    else:
        da = 2 * pa[None, :]
        db = da + 1
    if rotated:  # the rope_kv kernel's rotation, rounded as it rounds
        a, b = rotate_pair(a, b, cos, sin)
        a, b = a.to(DT).to(tl.float32), b.to(DT).to(tl.float32)
    row_ok = m_ok[:, None]
    o = Out + rm[:, None].to(tl.int64) * stride_om + head * HEAD_DIM
    tl.store(o + da, a.to(DT), mask=row_ok)
    tl.store(o + db, b.to(DT), mask=row_ok)
    if WRITE_KV:
        is_k = rotated & (head >= NUM_Q_HEADS)
        kvh = tl.where(is_k, head - NUM_Q_HEADS, tl.maximum(head - NUM_Q_HEADS - NUM_KV_HEADS, 0))
        kbuf = PagedBuffer(KBuf, kb_page_stride, kb_off_stride, kb_head_stride)
        vbuf = PagedBuffer(VBuf, vb_page_stride, vb_off_stride, vb_head_stride)
        ok, kdst, vdst = _slot_rows(loc[:, None], kvh, KVCache(kbuf, vbuf, num_slots), PAGE_SIZE)
        ok = ok & row_ok
        if is_k:
            KDT: tl.constexpr = KBuf.dtype.element_ty
            k_inv = reciprocal(load_scale(KScale, k_scale_f, K_SCALE_MODE), K_SCALE_MODE)
            KS: tl.constexpr = K_SCALE_MODE > 0
            tl.store(kdst + da, quantize(a, k_inv, KS, K_FP8_MAX, EMULATE, KDT), mask=ok)
            tl.store(kdst + db, quantize(b, k_inv, KS, K_FP8_MAX, EMULATE, KDT), mask=ok)
        elif not rotated:
            VDT: tl.constexpr = VBuf.dtype.element_ty
            v_inv = reciprocal(load_scale(VScale, v_scale_f, V_SCALE_MODE), V_SCALE_MODE)
            VS: tl.constexpr = V_SCALE_MODE > 0
            tl.store(vdst + da, quantize(a, v_inv, VS, V_FP8_MAX, EMULATE, VDT), mask=ok)
            tl.store(vdst + db, quantize(b, v_inv, VS, V_FP8_MAX, EMULATE, VDT), mask=ok)


@dataclass(frozen=True)
class GemmRopeKVLaunch:
    """A planned call of gemm_rope_kv_kernel. Per call, `launcher.launch` (tensors) or
    `launcher.direct` (their pointers) takes, in the kernel's order: x, weight, bias (or
    weight), out, positions, cos_sin_cache, k_buffer, v_buffer, cache_loc, k_scale, v_scale (a
    stand-in tensor where a call has none)."""

    m: int
    launcher: KernelLauncher


def fold_supported(call: RopeCall, n: int, config: GemmConfig) -> bool:
    """Whether the kernel serves a checked RoPE call on a GEMM of n columns with config: the
    broadcast (dot=False) path without split-K, whole heads rotated, BLOCK_N (>= 2) dividing the
    head, q / k / v packed back to back in out."""
    d = call.head_size
    q, k = call.query, call.key
    return (
        not config.dot
        and config.split_k == 1
        and 2 <= config.block_n <= d
        and d % config.block_n == 0
        and call.rot_dim == d
        and q is not None
        and n == (q.num_heads + 2 * k.num_heads) * d
    )


# The kernel's fixed arguments: its runtime parameters after the per-call pointers (x, weight,
# bias, out, positions, cos_sin_cache, both buffers, slots, both scales).
_FIXED_NAMES = runtime_param_names(gemm_rope_kv_kernel)[11:]


def plan_gemm_rope_kv(
    call: RopeCall, k: int, stride_xm: int, stride_wn: int, has_bias: bool, config: GemmConfig
) -> GemmRopeKVLaunch:
    """The launch of a checked call that `fold_supported` accepts: out [M, N] contiguous, q /
    k / v its column blocks, x [M, k] (row stride stride_xm), weight [N, k] (stride_wn)."""
    assert call.query is not None
    m, d = call.num_tokens, call.head_size
    hq, hkv = call.query.num_heads, call.key.num_heads
    n = (hq + 2 * hkv) * d
    kv_fixed, kv_consts = rope_kv_schema.kv_write_values(call.kv)  # the rope_kv kernel's names
    constexprs = dict(
        NUM_Q_HEADS=hq,
        NUM_KV_HEADS=hkv,
        HEAD_DIM=d,
        IS_NEOX=call.is_neox,
        BLOCK_M=config.block_m(m),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        HAS_BIAS=has_bias,
        EVEN_K=k % config.block_k == 0,
        WRITE_KV=call.kv is not None,
        EMULATE=settings.get().interpret,
        **kv_consts,
    )
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    grid = (n // config.block_n,)
    values: dict[str, int | float] = dict(M=m, K=k, stride_xm=stride_xm, stride_wn=stride_wn)
    values.update(stride_om=n, cs_stride=call.cs_stride, max_pos=call.max_pos, **kv_fixed)
    fixed = rope_kv_schema.ordered(_FIXED_NAMES, values, "gemm_rope_kv fixed arguments")
    launcher = make_launcher(gemm_rope_kv_kernel, grid, fixed, constexprs, options, call.device)
    return GemmRopeKVLaunch(m, launcher)
