"""sgl_ext.rmsnorm / fused_add_rmsnorm (native and Triton, interpreted on CPU) against float64."""

from __future__ import annotations

import pytest
import torch

from sgl_ext import (
    fused_add_rmsnorm,
    fused_add_rmsnorm_native,
    moe_sum_add_rmsnorm,
    moe_sum_add_rmsnorm_native,
    rmsnorm,
    rmsnorm_native,
)
from tests.sgl_ext.sgl_ext_testutil import TOL, bits, poison

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 RMSNorm of x [..., N] (no intermediate rounding)."""
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _inputs(rows: int, n: int, dtype: torch.dtype, seed: int = 0, device: str = DEV):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g) * 3).to(device, dtype)
    r = torch.randn(rows, n, generator=g).to(device, dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(device, dtype)
    return x, r, w


def _check(out, ref, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["native", "triton"])
@pytest.mark.parametrize(
    "dtype, rows, n",
    [
        (torch.float32, 1, 33),
        (torch.bfloat16, 7, 128),
        (torch.float16, 33, 257),
        (torch.bfloat16, 3, 1),
    ],
)
def test_rmsnorm(backend, name, dtype, rows, n):
    backend(name)
    x, r, w = _inputs(rows, n, dtype)
    x0 = x.clone()
    out = poison(torch.empty_like(x))
    assert rmsnorm(x, w, 1e-5, out=out) is out
    _check(out, _ref(x, w, 1e-5), dtype)
    assert torch.equal(bits(x), bits(x0))
    new = rmsnorm(x, w, 1e-5)  # fresh output
    assert torch.equal(bits(new), bits(out))


@pytest.mark.parametrize("name", ["native", "triton"])
@pytest.mark.parametrize(
    "dtype, rows, n", [(torch.float32, 7, 33), (torch.bfloat16, 1, 257), (torch.float16, 33, 64)]
)
def test_fused_add_rmsnorm_in_place(backend, name, dtype, rows, n):
    """sgl_kernel semantics: residual <- input + residual (rounded, exact), input <- norm."""
    backend(name)
    x, r, w = _inputs(rows, n, dtype, seed=1)
    s = x + r  # the rounded sum the model computes
    x0, r0 = x.clone(), r.clone()
    new_out, new_res = fused_add_rmsnorm(x0, r0, w, 1e-6, inplace=False)  # fresh outputs
    assert torch.equal(x0, x) and torch.equal(r0, r)
    got = fused_add_rmsnorm(x, r, w, 1e-6)
    assert got[0] is x and got[1] is r
    assert torch.equal(bits(r), bits(s)) and torch.equal(bits(new_res), bits(s))
    _check(x, _ref(s, w, 1e-6), dtype)
    assert torch.equal(bits(new_out), bits(x))


@pytest.mark.parametrize("name", ["native", "triton"])
@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_fused_add_rmsnorm_out_of_place_strided(backend, name, weight_in_fp32):
    """Rows of a wider buffer (one strided dim), 3-D input, separate destinations."""
    backend(name)
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(2, 5, 40, generator=g).to(DEV, dtype)
    x = wide[..., :33]  # [2, 5, 33], row stride 40
    r = torch.randn(2, 5, 33, generator=g).to(DEV, dtype)
    w = torch.randn(33, generator=g).to(DEV, torch.float32 if weight_in_fp32 else dtype)
    wide0, r0 = wide.clone(), r.clone()
    out = poison(torch.empty(2, 5, 33, dtype=dtype, device=DEV))
    res = poison(torch.empty(2, 5, 33, dtype=dtype, device=DEV))
    got = fused_add_rmsnorm(
        x, r, w, 1e-6, weight_in_fp32=weight_in_fp32, inplace=False, out=out, residual_out=res
    )
    assert got[0] is out and got[1] is res
    assert torch.equal(bits(wide), bits(wide0)) and torch.equal(bits(r), bits(r0))
    assert torch.equal(bits(res), bits(x + r))
    _check(out, _ref(x + r, w, 1e-6), dtype)
    ref_out, ref_res = fused_add_rmsnorm_native(x, r, w, 1e-6, weight_in_fp32)
    torch.testing.assert_close(out, ref_out, atol=TOL[dtype], rtol=TOL[dtype])


def test_native_rounding_order_matches_torch_layer_math():
    """The reference rounds like HF Llama: normalise in fp32, cast, then multiply the weight."""
    x, _, w = _inputs(7, 33, torch.bfloat16, seed=3, device="cpu")
    xf = x.float()
    expect = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    assert torch.equal(rmsnorm_native(x, w, 1e-6), expect)


def _raise_each(cases) -> None:
    """Each (exception type, word its message names, call) raises that."""
    for exc, word, call in cases:
        with pytest.raises(exc, match=word):
            call()


@pytest.mark.parametrize("name", ["native", "triton"])
def test_bad_input_raises_before_launch(backend, name):
    backend(name)
    x, r, w = _inputs(7, 33, torch.float32, seed=4)
    x0, r0 = x.clone(), r.clone()
    cases = [
        (ValueError, "weight", lambda: rmsnorm(x, w[:32])),
        (TypeError, "weight", lambda: rmsnorm(x, w.half())),
        (TypeError, "input", lambda: rmsnorm(x.int(), w)),
        (ValueError, "eps", lambda: rmsnorm(x, w, -1.0)),
        # issue 50: past float32 (OverflowError for a huge int), or inf / 0 there
        (ValueError, "eps", lambda: rmsnorm(x, w, 2**2000)),
        (ValueError, "eps", lambda: rmsnorm(x, w, float("inf"))),
        (ValueError, "eps", lambda: rmsnorm(x, w, 1e39)),
        (ValueError, "eps", lambda: rmsnorm(x, w, 1e-50)),
        (ValueError, "eps", lambda: fused_add_rmsnorm(x, r, w, float("nan"))),
        (TypeError, "eps", lambda: rmsnorm(x, w, True)),
        (TypeError, "input", lambda: rmsnorm(x.to_sparse(), w)),
        (TypeError, "weight", lambda: rmsnorm(x, w.to_sparse())),
        (ValueError, "out", lambda: rmsnorm(x, w, out=x[:3])),
        (ValueError, "residual", lambda: fused_add_rmsnorm(x, r[:3], w)),
        (ValueError, "residual", lambda: fused_add_rmsnorm(x, r.half().float()[:, :32], w)),
        (ValueError, "input", lambda: rmsnorm(x.t(), torch.ones(7))),
        (ValueError, "inplace", lambda: fused_add_rmsnorm(x, r, w, out=torch.empty_like(x))),
        (
            TypeError,
            "residual_out",
            lambda: fused_add_rmsnorm(x, r, w, inplace=False, residual_out=r.half()),
        ),
    ]
    _raise_each(cases)
    assert torch.equal(x, x0) and torch.equal(r, r0)
    rmsnorm(x.clone(), w, 0.0)  # 0 stays legal for these norms


@gpu
@pytest.mark.parametrize("rows", [1, 7, 512])
@pytest.mark.parametrize("n", [128, 4096, 5120])
def test_cuda_bf16_model_shapes(rows, n):
    """Llama/Qwen shapes on the GPU: Triton vs the native path, and the exact residual sum."""
    x, r, w = _inputs(rows, n, torch.bfloat16, seed=5, device="cuda")
    out, res = poison(torch.empty_like(x)), poison(torch.empty_like(x))
    fused_add_rmsnorm(x, r, w, 1e-5, inplace=False, out=out, residual_out=res)
    ref_out, ref_res = fused_add_rmsnorm_native(x, r, w, 1e-5)
    assert torch.equal(bits(res), bits(ref_res))
    _check(out, _ref(ref_res, w, 1e-5), torch.bfloat16)
    # Rounding order as native: at most one bf16 ulp apart, and almost always identical.
    diff = (out.float() - ref_out.float()).abs()
    assert (diff <= ref_out.float().abs() * 2**-7 + 1e-6).all()
    assert (out != ref_out).float().mean().item() < 0.01
    _check(rmsnorm(x, w, 1e-5), _ref(x, w, 1e-5), torch.bfloat16)


@pytest.mark.parametrize("n", [128, 257])
def test_triton_row_bits_independent_of_row_count(backend, n):
    """A row's result never depends on how many rows the call has (CUDA-graph padding)."""
    backend("triton")
    x, r, w = _inputs(33, n, torch.bfloat16, seed=6)
    full = fused_add_rmsnorm(x, r, w, 1e-6, inplace=False)
    part = fused_add_rmsnorm(x[:3], r[:3], w, 1e-6, inplace=False)
    assert torch.equal(bits(part[0]), bits(full[0][:3]))
    assert torch.equal(bits(rmsnorm(x[:1], w)), bits(rmsnorm(x, w)[:1]))


def _pairs(T: int, k: int, n: int, dtype: torch.dtype, seed: int, device: str = DEV):
    g = torch.Generator().manual_seed(seed)
    pairs = (torch.randn(T * k, n, generator=g) * 2).to(device, dtype)
    r = torch.randn(T, n, generator=g).to(device, dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(device, dtype)
    return pairs, r, w


def _combine64(pairs: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """float64 top-k sum rounded once to dtype (what the op adds to the residual)."""
    return pairs.double().view(-1, k, pairs.shape[1]).sum(1).to(dtype)


@pytest.mark.parametrize("name", ["native", "triton"])
@pytest.mark.parametrize(
    "dtype, T, k, n",
    [(torch.float32, 1, 4, 33), (torch.bfloat16, 7, 4, 257), (torch.float16, 3, 1, 64),
     (torch.bfloat16, 33, 2, 128)],
)  # fmt: skip
def test_moe_sum_add_rmsnorm(backend, name, dtype, T, k, n):
    """residual += round(sum of each token's k rows); out = norm(residual): against float64
    (the sum within one rounding of the float64 sum), pairs untouched, residual in place."""
    backend(name)
    pairs, r, w = _pairs(T, k, n, dtype, seed=7)
    p0, r0 = pairs.clone(), r.clone()
    out = poison(torch.empty(T, n, dtype=dtype, device=DEV))
    got = moe_sum_add_rmsnorm(pairs, r, w, 1e-6, top_k=k, out=out)
    assert got[0] is out and got[1] is r
    assert torch.equal(bits(pairs), bits(p0))
    s = _combine64(p0, k, dtype).double() + r0.double()
    torch.testing.assert_close(r.double(), s, atol=TOL[dtype], rtol=TOL[dtype])
    _check(out, _ref(r, w, 1e-6), dtype)
    r1 = r0.clone()
    new, _ = moe_sum_add_rmsnorm(pairs, r1, w, 1e-6, top_k=k)  # a fresh output
    assert torch.equal(bits(r1), bits(r)) and torch.equal(bits(new), bits(out))
    ref_out, ref_res = moe_sum_add_rmsnorm_native(p0, r0, w, 1e-6, k)
    assert torch.equal(bits(ref_res), bits(r))  # the sum's order is fixed: exact
    torch.testing.assert_close(out, ref_out, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("name", ["native", "triton"])
def test_moe_sum_add_rmsnorm_bad_input_raises_before_launch(backend, name):
    backend(name)
    pairs, r, w = _pairs(5, 4, 33, torch.float32, seed=8)
    p0, r0 = pairs.clone(), r.clone()
    cases = [
        (ValueError, "top_k", lambda: moe_sum_add_rmsnorm(pairs, r, w, top_k=0)),
        (ValueError, "top_k", lambda: moe_sum_add_rmsnorm(pairs, r, w, top_k=True)),
        (ValueError, "pairs has", lambda: moe_sum_add_rmsnorm(pairs, r, w, top_k=3)),
        (ValueError, "residual", lambda: moe_sum_add_rmsnorm(pairs, r[:, :32], w, top_k=4)),
        (TypeError, "residual", lambda: moe_sum_add_rmsnorm(pairs, r.half(), w, top_k=4)),
        (TypeError, "pairs", lambda: moe_sum_add_rmsnorm(pairs.int(), r, w, top_k=4)),
        (ValueError, "weight", lambda: moe_sum_add_rmsnorm(pairs, r, w[:32], top_k=4)),
        (ValueError, "out", lambda: moe_sum_add_rmsnorm(pairs, r, w, top_k=4, out=r[:2])),
        (ValueError, "pairs", lambda: moe_sum_add_rmsnorm(pairs.t(), r, w, top_k=4)),
    ]
    _raise_each(cases)
    assert torch.equal(pairs, p0) and torch.equal(r, r0)


@gpu
@pytest.mark.parametrize("T", [1, 7, 64])
@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_cuda_moe_sum_add_rmsnorm_equals_moe_sum_then_norm(T, weight_in_fp32):
    """gpt-oss shape: the same bits as moe_sum followed by fused_add_rmsnorm (what it replaces)."""
    from srt.layers.moe.fused_moe_triton.moe_sum import moe_sum

    k, n = 4, 2880
    pairs, r, w = _pairs(T, k, n, torch.bfloat16, seed=9, device="cuda")
    w = w.float() if weight_in_fp32 else w
    x = moe_sum(pairs, T, k)
    r_ref = r.clone()
    out_ref, _ = fused_add_rmsnorm(x, r_ref, w, 1e-5, weight_in_fp32=weight_in_fp32)
    out, res = moe_sum_add_rmsnorm(pairs, r, w, 1e-5, top_k=k, weight_in_fp32=weight_in_fp32)
    assert torch.equal(bits(res), bits(r_ref)) and torch.equal(bits(out), bits(out_ref))
