"""sgl_ext.linear_small_m: the skinny Triton GEMM (interpreted on CPU) against float64.

CPU: small odd shapes through every path (broadcast multiply + sum, tensor-core dot, split-K,
bias, uneven N and K), the checks, the fallbacks. GPU (skipped without CUDA): the decode shapes
of llama3-8b / gpt-oss-20b at M 1..64, graph == eager bits, rows independent of M in a bucket.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sgl_ext.gemm import MAX_M, GemmConfig, default_config, linear_small_m, linear_small_m_native
from tests.sgl_ext.sgl_ext_testutil import TOL, bits, poison, run_compile_script

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FMA = GemmConfig(block_n=16, block_k=64, num_warps=4, num_stages=2)
FMA_SPLIT = GemmConfig(block_n=8, block_k=32, num_warps=2, num_stages=1, split_k=3)
DOT = GemmConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, dot=True)
DOT_SPLIT = GemmConfig(block_n=32, block_k=64, num_warps=4, num_stages=3, split_k=2, dot=True)


def _problem(m, n, k, dtype, bias, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed * 1000 + m * 7 + n + k)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    return x, w, b


def _ref(x, w, b):
    out = x.double() @ w.double().t()
    return out if b is None else out + b.double()


def _close(out, ref, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "dtype, m, n, k, bias, cfg",
    [
        (torch.bfloat16, 1, 33, 200, False, FMA),
        (torch.float16, 3, 257, 64, True, FMA_SPLIT),
        (torch.bfloat16, 7, 33, 200, True, DOT),
        (torch.float32, 20, 64, 200, False, DOT_SPLIT),
        (torch.bfloat16, 1, 257, 64, True, None),  # default_config
    ],
)
def test_linear_small_m_matches_float64(backend, dtype, m, n, k, bias, cfg):
    backend("triton")
    x, w, b = _problem(m, n, k, dtype, bias)
    x0, w0 = x.clone(), w.clone()
    out = linear_small_m(x, w, b, cfg)
    assert out.shape == (m, n) and out.dtype == dtype
    _close(out, _ref(x, w, b), dtype)
    assert torch.equal(bits(x), bits(x0)) and torch.equal(bits(w), bits(w0))
    again = linear_small_m(x, w, b, cfg)  # a plan hit (on CUDA: the direct launch)
    assert torch.equal(bits(again), bits(out))


@pytest.mark.parametrize("cfg", [FMA_SPLIT, DOT], ids=["fma_split", "dot"])
def test_kernel_writes_every_element(backend, cfg):
    """Straight to the launch with a poisoned output (the op always allocates its own)."""
    backend("triton")
    from sgl_ext.triton.gemm import plan_skinny_gemm, run_skinny_gemm

    m, n, k = 3, 33, 200
    x, w, b = _problem(m, n, k, torch.bfloat16, True, seed=1)
    out = poison(torch.empty(m, n, dtype=torch.bfloat16, device=DEV))
    plan = plan_skinny_gemm(m, n, k, k, k, n, x.dtype, True, cfg, x.device)
    run_skinny_gemm(plan, x, w, b, out)
    _close(out, _ref(x, w, b), torch.bfloat16)


@pytest.mark.parametrize("cfg", [FMA, FMA_SPLIT, DOT_SPLIT], ids=["fma", "fma_split", "dot_split"])
def test_float32_out_is_the_16_bit_result_widened(backend, cfg):
    """out_dtype=float32 (an LM head's logits): the bits of the 16-bit result, widened, in the
    GEMM's own store (every element written: the output starts poisoned); F.linear's widened
    result on the native backend."""
    backend("triton")
    from sgl_ext.triton.gemm import plan_skinny_gemm, run_skinny_gemm

    m, n, k = 3, 257, 200
    x, w, b = _problem(m, n, k, torch.bfloat16, True, seed=5)
    half = linear_small_m(x, w, b, cfg)
    wide = linear_small_m(x, w, b, cfg, out_dtype=torch.float32)
    assert wide.dtype == torch.float32 and wide.shape == (m, n)
    assert torch.equal(wide, half.float())
    out = poison(torch.empty(m, n, dtype=torch.float32, device=DEV))
    plan = plan_skinny_gemm(m, n, k, k, k, n, x.dtype, True, cfg, x.device, torch.float32)
    run_skinny_gemm(plan, x, w, b, out)
    assert torch.equal(out, half.float())
    backend("native")
    nat = linear_small_m(x, w, b, cfg, out_dtype=torch.float32)
    assert torch.equal(nat, F.linear(x, w, b).float())


def test_leading_dims_and_row_stride(backend):
    """x [2, 3, K] gives [2, 3, N]; x as rows of a wider buffer (row stride > K)."""
    backend("triton")
    x, w, b = _problem(6, 33, 64, torch.bfloat16, True, seed=2)
    out = linear_small_m(x.view(2, 3, 64), w, b, FMA)
    assert out.shape == (2, 3, 33)
    _close(out.view(6, 33), _ref(x, w, b), torch.bfloat16)
    wide = torch.randn(5, 80, dtype=torch.bfloat16, device=DEV)
    xs = wide[:, :64]  # [5, 64], row stride 80
    _close(linear_small_m(xs, w, None, DOT), _ref(xs, w, None), torch.bfloat16)


@pytest.mark.parametrize("cfg", [FMA, DOT_SPLIT], ids=["fma", "dot_split"])
def test_rows_do_not_depend_on_m_within_a_bucket(backend, cfg):
    """M = 3 and M = 4 share BLOCK_M (4, or 16 for dots): the first 3 rows have the same bits
    (why a CUDA-graph bucket and its smaller eager batches agree)."""
    backend("triton")
    x, w, _ = _problem(4, 40, 96, torch.bfloat16, False, seed=3)
    assert cfg.block_m(3) == cfg.block_m(4)
    full = linear_small_m(x, w, None, cfg)
    part = linear_small_m(x[:3].clone(), w, None, cfg)
    assert torch.equal(bits(part), bits(full[:3]))


def test_fallbacks_are_f_linear(backend):
    """More than MAX_M rows, or the native backend: F.linear's own result."""
    x, w, b = _problem(MAX_M + 1, 16, 32, torch.float32, True, seed=4)
    backend("triton")
    assert torch.equal(linear_small_m(x, w, b), F.linear(x, w, b))
    backend("native")
    xs = x[:5]
    assert torch.equal(linear_small_m(xs, w, b, FMA), F.linear(xs, w, b))
    assert torch.equal(linear_small_m_native(xs, w, b), F.linear(xs, w, b))


def test_bad_input_raises():
    x = torch.randn(3, 8)
    w = torch.randn(5, 8)
    for exc, word, call in [
        (TypeError, "x", lambda: linear_small_m(x.int(), w)),
        (TypeError, "weight", lambda: linear_small_m(x, w.double())),
        (ValueError, "weight", lambda: linear_small_m(x, torch.randn(5, 7))),
        (ValueError, "weight", lambda: linear_small_m(x, torch.randn(8, 5).t())),
        (ValueError, "bias", lambda: linear_small_m(x, w, torch.randn(4))),
        (TypeError, "bias", lambda: linear_small_m(x, w, torch.randn(5).half())),
        (ValueError, "x", lambda: linear_small_m(torch.randn(8, 3).t(), w)),
        (TypeError, "config", lambda: linear_small_m(x, w, None, "fma")),  # type: ignore[arg-type]
        (ValueError, "out_dtype", lambda: linear_small_m(x, w, out_dtype=torch.float16)),
    ]:
        with pytest.raises(exc, match=word):
            call()


@pytest.mark.parametrize(
    "kw",
    [
        dict(block_n=12),
        dict(block_k=8),
        dict(block_n=8, dot=True),
        dict(num_warps=3),
        dict(num_stages=0),
        dict(split_k=0),
    ],
)
def test_bad_config_raises(kw):
    with pytest.raises(ValueError, match="config"):
        GemmConfig(**kw)


def test_config_tag_and_block_m():
    assert DOT_SPLIT.tag == "dot n32 k64 w4 s3 x2"
    assert [FMA.block_m(m) for m in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert [DOT.block_m(m) for m in (1, 16, 17, 64)] == [16, 16, 32, 64]
    assert not default_config(1).dot and default_config(64).dot


# ----------------------------------------------------------------------------- GPU
LLAMA = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@gpu
@pytest.mark.parametrize("n, k", LLAMA + [(5120, 2880), (2880, 4096)])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16, 24, 64])
def test_cuda_decode_shapes(n, k, m):
    bias = n in (5120, 2880)  # gpt-oss attention has biases
    x, w, b = _problem(m, n, k, torch.bfloat16, bias, device="cuda")
    ref = _ref(x, w, b)
    scale = ref.abs().max().item()
    for cfg in (None, FMA_SPLIT if m <= 8 else DOT_SPLIT, GemmConfig(block_n=64, dot=True)):
        out = linear_small_m(x, w, b, cfg)
        torch.testing.assert_close(out.double(), ref, atol=2e-2 * scale, rtol=1.6e-2)
        torch.testing.assert_close(out, F.linear(x, w, b), atol=2e-2 * scale, rtol=1.6e-2)


@gpu
@pytest.mark.parametrize("cfg", [None, FMA_SPLIT, DOT_SPLIT], ids=["default", "fma_x3", "dot_x2"])
def test_cuda_graph_equals_eager_and_buckets(cfg):
    """Replay == eager bit for bit; rows of M = 3 / 13 equal the first rows of M = 4 / 16."""
    n, k = 4096, 4096
    for small, big in ((3, 4), (13, 16)):
        c = cfg or default_config(big)
        if c.block_m(small) != c.block_m(big):
            continue
        x, w, b = _problem(big, n, k, torch.bfloat16, True, device="cuda")
        eager = linear_small_m(x, w, b, c)
        part = linear_small_m(x[:small].clone(), w, b, c)
        assert torch.equal(bits(part), bits(eager[:small]))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            linear_small_m(x, w, b, c)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = linear_small_m(x, w, b, c)
        poison(out)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(out), bits(eager))


_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sgl_ext.triton.gemm import _skinny_gemm_kernel as K, _split_k_reduce_kernel as R

def one(fn, sig, consts, warps, stages):
    sig = dict(sig, **{k: "constexpr" for k in consts})
    triton.compile(ASTSource(fn, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps, "num_stages": stages})

ptrs = dict(X="*bf16", W="*bf16", Bias="*bf16", Out="*bf16", Part="*fp32")
ints = {n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "k_per_split")}
for bm, bn, bk, dot, part, even in [(1, 16, 512, False, False, True), (4, 8, 128, False, True,
        False), (16, 64, 128, True, False, True), (64, 32, 64, True, True, False)]:
    one(K, {**ptrs, **ints}, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot,
        DOT_PRECISION="tf32", WRITE_PARTIAL=part, HAS_BIAS=True, EVEN_N=even, EVEN_K=even,
        EMULATE=False, USE_PDL=dot), 4, 3)
    one(K, {**ptrs, **ints, "Out": "*fp32"}, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        USE_DOT=dot, DOT_PRECISION="tf32", WRITE_PARTIAL=part, HAS_BIAS=True, EVEN_N=even,
        EVEN_K=even, EMULATE=False, USE_PDL=True), 4, 3)  # float32 logits
for out, wide in (("*bf16", False), ("*fp32", True)):
    one(R, dict(Part="*fp32", Bias="*bf16", Out=out, M="i32", N="i32", stride_om="i32"),
        dict(SPLITS=3, BLOCK=1024, HAS_BIAS=True, EMULATE=False, ROUND_F32=wide, USE_PDL=True),
        4, 1)
print("compiled")
"""


def test_kernels_compile_for_sm90():
    """A real sm_90 compile of both kernels (the interpreter misses front-end errors)."""
    run_compile_script(_COMPILE)
