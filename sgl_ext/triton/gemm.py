"""Triton skinny GEMM for decode: out[M, N] = x[M, K] @ w[N, K]^T (+ bias) for M <= 64.

At decode sizes the GEMM reads its weight once and does almost no arithmetic, so the kernel is
built for HBM bandwidth: program (n, s) owns BLOCK_N output columns (BLOCK_N rows of w) and
streams them over its K range in [BLOCK_N, BLOCK_K] tiles with wide loads along K (w rows are
contiguous), in a loop the compiler pipelines (`num_stages`). Every program reads all M rows of
x (tiny, from L2).

Two inner products:
  dot=False  broadcast multiply + sum in float32 (CUDA cores): `sum(x[:, None, :] * w[None])`
             per tile; for M <= 8, where a tensor-core tile would be mostly padding.
  dot=True   "swap AB" tensor-core dot: acc[BLOCK_N, BLOCK_M] += w_tile @ x_tile^T, so the
             weight is the MMA's M side (BLOCK_N >= 16 rows) and the few tokens its N side
             (BLOCK_M = max(16, pow2(M)), padded rows of x masked to zero).

Split-K (split_k > 1): program (n, s) sums K range s and writes float32 partials [splits, M, N];
a second kernel adds them in split order (then the bias) and rounds once. No atomics: the bits
depend only on the launch configuration and BLOCK_M, never on timing, so a CUDA graph replay and
an eager call with the same configuration agree bit for bit. Each output row is computed
independently of the others (its own products and sums in the same order), so rows do not
depend on M within one BLOCK_M (M is not specialised on).

Launches: the op's plan holds `KernelLauncher`s (`launcher.py`): the first call goes through
the JIT, later ones call the compiled kernel directly with integer pointers (the least host
work per eager call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sgl_ext import settings
from sgl_ext.gemm_config import GemmConfig
from sgl_ext.triton.launcher import KernelLauncher, make_launcher
from sgl_ext.triton.pdl import pdl_enter
from sgl_ext.triton.rounding import cast_rne

REDUCE_BLOCK = 1024  # output columns per program of the split-K reduction


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    X,
    W,
    Bias,
    Out,
    Part,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    EMULATE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns = rows of w
    rm = tl.arange(0, BLOCK_M)  # [BM] tokens
    rk = tl.arange(0, BLOCK_K)  # [BK]
    k0 = pid_k * k_per_split
    n_ok = rn < N
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS and not WRITE_PARTIAL:  # a weight: loaded while the previous kernel runs
        bias = tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    m_ok = rm < M
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :]  # [BN, BK]
    x_ptrs = X + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :]  # [BM, BK]
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # out^T tile
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + k + rk) < K
            if EVEN_N:
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_DOT:
            if EMULATE:  # the interpreter's 16-bit dot is wrong: exact float32 copies instead
                acc = tl.dot(
                    w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee"
                )
            else:
                acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)  # [BN, BM]
        else:
            prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BM, BN, BK]
            acc += tl.sum(prod, axis=2)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if USE_DOT:
        res = tl.trans(acc)  # [BM, BN]
    else:
        res = acc
    mask = m_ok[:, None] & n_ok[None, :]
    if WRITE_PARTIAL:  # float32 [splits, M, N]; the reduction adds bias and rounds
        p = Part + pid_k.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :]
        tl.store(p, res, mask=mask)
    else:
        if HAS_BIAS:
            res += bias[None, :]
        o = Out + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        # one rounding to x's dtype, then (a float32 out) widened exactly
        y = cast_rne(res, X.dtype.element_ty, EMULATE).to(Out.dtype.element_ty)
        tl.store(o, y, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _split_k_reduce_kernel(
    Part,
    Bias,
    Out,
    M,
    N,
    stride_om,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EMULATE: tl.constexpr,
    ROUND_F32: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = rn < N
    src = Part + m.to(tl.int64) * N + rn
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # fixed order: deterministic
        acc += tl.load(src + s * M * N, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=ok, other=0.0).to(tl.float32)
    dst = Out + m.to(tl.int64) * stride_om + rn
    if ROUND_F32:  # a float32 out of 16-bit x: round to Bias's dtype (x's), then widen
        y = cast_rne(acc, Bias.dtype.element_ty, EMULATE).to(tl.float32)
    else:
        y = cast_rne(acc, Out.dtype.element_ty, EMULATE)
    tl.store(dst, y, mask=ok)


@dataclass(frozen=True)
class SkinnyLaunch:
    """A planned call: the GEMM kernel's launch and, with split-K, the reduction's.

    Per call: main(x, weight, bias or weight, out, partials or out); reduce(partials, bias or
    weight, out). The fixed arguments (M, N, K, the row strides, the split) are the plan's."""

    m: int
    n: int
    splits: int  # K ranges actually used (<= config.split_k)
    main: KernelLauncher
    reduce: KernelLauncher | None


def plan_skinny_gemm(
    m: int,
    n: int,
    k: int,
    stride_xm: int,
    stride_wn: int,
    stride_om: int,
    dtype: torch.dtype,
    has_bias: bool,
    config: GemmConfig,
    device: torch.device,
    out_dtype: torch.dtype | None = None,
) -> SkinnyLaunch:
    """The launch of a checked call: x [m, k] (row stride stride_xm), weight [n, k] (stride_wn),
    out [m, n] (stride_om) of out_dtype (None: x's dtype; or float32), last dims contiguous;
    m, n, k >= 1."""
    bk = config.block_k
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), bk) * bk
    splits = triton.cdiv(k, k_per_split)
    emulate = settings.get().interpret
    constexprs = dict(
        BLOCK_M=config.block_m(m),
        BLOCK_N=config.block_n,
        BLOCK_K=bk,
        USE_DOT=config.dot,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        WRITE_PARTIAL=splits > 1,
        HAS_BIAS=has_bias,
        EVEN_N=n % config.block_n == 0,
        EVEN_K=k == splits * k_per_split,
        EMULATE=emulate,
    )
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    grid = (triton.cdiv(n, config.block_n), splits)
    fixed = (m, n, k, stride_xm, stride_wn, stride_om, k_per_split)
    main = make_launcher(_skinny_gemm_kernel, grid, fixed, constexprs, options, device)
    reduce = None
    if splits > 1:
        reduce = make_launcher(
            _split_k_reduce_kernel,
            (m, triton.cdiv(n, REDUCE_BLOCK)),
            (m, n, stride_om),
            dict(
                SPLITS=splits,
                BLOCK=REDUCE_BLOCK,
                HAS_BIAS=has_bias,
                EMULATE=emulate,
                ROUND_F32=out_dtype not in (None, dtype),
            ),
            {"num_warps": 4},
            device,
        )
    return SkinnyLaunch(m, n, splits, main, reduce)


def run_skinny_gemm(
    plan: SkinnyLaunch,
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out2: torch.Tensor,
) -> None:
    """Launch plan on the tensors it was planned for (same metadata, pointers may differ):
    x2 [M, K], weight [N, K], bias [N] or None, out2 [M, N] (written; 16-byte aligned)."""
    b = bias if bias is not None else weight  # never read without HAS_BIAS
    part = out2
    if plan.reduce is not None:  # float32 [splits, M, N], every element written, then read
        part = torch.empty((plan.splits, plan.m, plan.n), dtype=torch.float32, device=x2.device)
    main = plan.main
    if main.compiled is not None:
        main.direct(
            x2.data_ptr(), weight.data_ptr(), b.data_ptr(), out2.data_ptr(), part.data_ptr()
        )
    else:
        main.launch(x2, weight, b, out2, part)
    red = plan.reduce
    if red is not None:
        if red.compiled is not None:
            red.direct(part.data_ptr(), b.data_ptr(), out2.data_ptr())
        else:
            red.launch(part, b, out2)
