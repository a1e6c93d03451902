"""RMSNorm (with fused residual add) and SiluAndMul against float64 references."""

import pytest
import torch

from srt.layers.activation import SiluAndMul
from srt.layers.layernorm import RMSNorm
from srt.layers.moe.topk_pairs import TopKPairs


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("fp32_weight", [False, True])
def test_rmsnorm_with_and_without_residual(dtype, tol, fp32_weight):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(33, eps=1e-5, weight_in_fp32=fp32_weight)
    norm.weight.copy_(torch.randn(33, generator=g))
    norm = norm.to(dtype)
    x = torch.randn(7, 33, generator=g).to(dtype)
    r = torch.randn(7, 33, generator=g).to(dtype)

    def ref(t):
        t = t.double()
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()

    out = norm(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref(x), atol=tol, rtol=tol)
    out, res = norm(x, r)
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(out.double(), ref(x + r), atol=tol, rtol=tol)


def test_silu_and_mul():
    x = torch.randn(7, 2 * 9)
    ref = torch.nn.functional.silu(x[:, :9].double()) * x[:, 9:].double()
    torch.testing.assert_close(SiluAndMul()(x).double(), ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fp32_weight", [False, True])
def test_rmsnorm_kernel_path_matches_native(backend, fp32_weight):
    """With SGL_EXT_BACKEND=triton (the CUDA path; interpreted on CPU tensors without CUDA) the
    layer launches the sgl_ext kernels: inputs untouched, residual sum exact, output within bf16
    tolerance."""
    backend("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # forced triton needs CUDA tensors there
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(33, eps=1e-6, weight_in_fp32=fp32_weight)
    norm.weight.copy_(torch.randn(33, generator=g))
    norm = norm.to(dev, torch.bfloat16)
    x = torch.randn(7, 33, generator=g).to(dev, torch.bfloat16)
    r = torch.randn(7, 33, generator=g).to(dev, torch.bfloat16)
    x0, r0 = x.clone(), r.clone()
    out, res = norm(x, r)
    assert torch.equal(x, x0) and torch.equal(r, r0)
    assert torch.equal(res, x + r)
    ref_out, _ = norm.forward_native(x, r)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(norm(x), norm.forward_native(x), atol=2e-2, rtol=2e-2)
    act = SiluAndMul()
    y = torch.randn(7, 2 * 9, generator=g).to(dev, torch.bfloat16)
    torch.testing.assert_close(act(y), act.forward_native(y), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", ["native", "triton"])
def test_rmsnorm_inplace_writes_both_tensors(backend, name):
    """inplace=True (what the decoder layers use): x holds the normalised output and residual
    the sum, with the bits of the out-of-place call; both are the returned tensors."""
    backend(name)
    dev = "cuda" if (name == "triton" and torch.cuda.is_available()) else "cpu"
    g = torch.Generator().manual_seed(2)
    norm = RMSNorm(33, eps=1e-6)
    norm.weight.copy_(torch.randn(33, generator=g))
    norm = norm.to(dev, torch.bfloat16)
    x = torch.randn(7, 33, generator=g).to(dev, torch.bfloat16)
    r = torch.randn(7, 33, generator=g).to(dev, torch.bfloat16)
    want_out, want_res = norm(x, r)
    out, res = norm(x, r, inplace=True)
    assert out is x and res is r
    assert torch.equal(x, want_out) and torch.equal(r, want_res)


@pytest.mark.parametrize("name", ["native", "triton"])
@pytest.mark.parametrize("fp32_weight", [False, True])
def test_rmsnorm_adds_up_topk_pairs(backend, name, fp32_weight):
    """A MoE layer's TopKPairs as x: the same bits as combining first (moe_sum) and then the
    in-place fused add + norm; residual takes the sum in place."""
    backend(name)
    dev = "cuda" if (name == "triton" and torch.cuda.is_available()) else "cpu"
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(33, eps=1e-6, weight_in_fp32=fp32_weight)
    norm.weight.copy_(torch.randn(33, generator=g))
    norm = norm.to(dev, torch.bfloat16)
    if fp32_weight:
        norm.weight.data = norm.weight.data.float()
    T, k = 7, 4
    pairs = TopKPairs(torch.randn(T * k, 33, generator=g).to(dev, torch.bfloat16), k)
    r = torch.randn(T, 33, generator=g).to(dev, torch.bfloat16)
    r_want = r.clone()
    want_out, want_res = norm(pairs.combine(), r_want, inplace=True)
    out, res = norm(pairs, r, inplace=True)
    assert res is r and torch.equal(res, want_res) and torch.equal(out, want_out)
    torch.testing.assert_close(norm(pairs), norm(pairs.combine()), atol=0, rtol=0)
