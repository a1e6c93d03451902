"""rmsnorm / fused_add_rmsnorm / silu_and_mul check once per distinct metadata: a cached call
is reused for new data, a changed input is still caught after it, and (CUDA) the direct launch
of the compiled kernel gives the JIT launch's bits."""

from __future__ import annotations

import pytest
import torch

from sgl_ext import activation, fused_add_rmsnorm, norm, rmsnorm, settings, silu_and_mul
from tests.sgl_ext.sgl_ext_testutil import TOL, bits, poison

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def _rand(shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(DEV, dtype)


def _rms_ref(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("name", ["native", "triton"])
def test_rmsnorm_plan_reused_for_new_data(backend, name):
    backend(name)
    norm._PLANS.clear()
    w = _rand(33, seed=1) + 1
    for seed in (2, 3):
        x = _rand((7, 33), seed=seed, scale=3)
        out = poison(torch.empty_like(x))
        rmsnorm(x, w, 1e-6, out=out)
        torch.testing.assert_close(out.double(), _rms_ref(x, w, 1e-6), atol=2e-2, rtol=2e-2)
    assert len(norm._PLANS) == 1


@pytest.mark.parametrize("name", ["native", "triton"])
def test_rmsnorm_changed_input_caught_after_cached_call(backend, name):
    backend(name)
    x, w = _rand((5, 16), seed=4), _rand(16, seed=5)
    out = torch.empty_like(x)
    rmsnorm(x, w, 1e-6, out=out)  # cached
    before = bits(out).clone()
    with pytest.raises(TypeError, match="weight dtype"):
        rmsnorm(x, w.float(), 1e-6, out=out)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        rmsnorm(x, w[:8], 1e-6, out=out)
    with pytest.raises(ValueError, match="out must have"):
        rmsnorm(x, w, 1e-6, out=out[:4])
    with pytest.raises(ValueError, match="eps"):
        rmsnorm(x, w, -1.0, out=out)
    assert torch.equal(bits(out), before)


@pytest.mark.parametrize("name", ["native", "triton"])
def test_fused_add_rmsnorm_changed_input_caught_after_cached_call(backend, name):
    backend(name)
    x, r, w = _rand((5, 16), seed=6), _rand((5, 16), seed=7), _rand(16, seed=8)
    xs, rs = x.clone(), r.clone()
    y, s = fused_add_rmsnorm(x, r, w, 1e-6)  # in place, cached
    assert y is x and s is r
    ref_s = (xs.float() + rs.float()).to(x.dtype)
    assert torch.equal(bits(s), bits(ref_s))
    torch.testing.assert_close(y.double(), _rms_ref(ref_s, w, 1e-6), atol=2e-2, rtol=2e-2)
    before = (bits(x).clone(), bits(r).clone())
    with pytest.raises(ValueError, match="residual must match"):
        fused_add_rmsnorm(x, r[:4], w, 1e-6)
    with pytest.raises(ValueError, match="need inplace=False"):
        fused_add_rmsnorm(x, r, w, 1e-6, out=torch.empty_like(x))
    assert torch.equal(bits(x), before[0]) and torch.equal(bits(r), before[1])
    # Out of place with the same tensors: another plan, inputs intact.
    y2, s2 = fused_add_rmsnorm(x, r, w, 1e-6, inplace=False)
    assert torch.equal(bits(x), before[0]) and torch.equal(bits(r), before[1])
    assert y2.data_ptr() != x.data_ptr() and s2.data_ptr() != r.data_ptr()


@pytest.mark.parametrize("name", ["native", "triton"])
def test_silu_and_mul_changed_input_caught_after_cached_call(backend, name):
    backend(name)
    activation._PLANS.clear()
    x = _rand((7, 66), seed=9)
    out = poison(torch.empty(7, 33, dtype=x.dtype, device=DEV))
    silu_and_mul(x, out)
    g, u = x[:, :33].float(), x[:, 33:].float()
    ref = (g * torch.sigmoid(g)).to(x.dtype).float() * u
    tol = TOL[torch.bfloat16]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    silu_and_mul(_rand((7, 66), seed=10), out)  # same metadata: the cached plan
    assert len(activation._PLANS) == 1
    before = bits(out).clone()
    with pytest.raises(ValueError, match="input must be"):
        silu_and_mul(x[:, :65], out)
    with pytest.raises(TypeError, match="out must have dtype"):
        silu_and_mul(x, out.float())
    assert torch.equal(bits(out), before)


@gpu
@pytest.mark.parametrize("rows", [1, 7, 257])
def test_cuda_direct_launch_equals_jit(backend, rows):
    """The second call of a plan launches the compiled kernel directly: same bits as the JIT
    launch with direct launches off (SGL_EXT_DIRECT_LAUNCH=0)."""
    backend("triton")
    x, r, w = _rand((rows, 4096), seed=rows, scale=3), _rand((rows, 4096)), _rand(4096) + 1
    a = _rand((rows, 2 * 14336), seed=rows + 1)

    def run():
        xx, rr = x.clone(), r.clone()
        fused_add_rmsnorm(xx, rr, w, 1e-5)
        return rmsnorm(x, w, 1e-5), xx, rr, silu_and_mul(a)

    first = run()
    plans = [*norm._PLANS.values(), *activation._PLANS.values()]
    assert all(p.launcher is not None and p.launcher.compiled is not None for p in plans)
    second = run()  # direct launches
    with settings.override(direct_launch=False):
        jit = run()
    for f, s, j in zip(first, second, jit, strict=True):
        assert torch.equal(bits(f), bits(s)) and torch.equal(bits(f), bits(j))
