"""sgl_ext.silu_and_mul (native and Triton, interpreted on CPU) against float64."""

from __future__ import annotations

import pytest
import torch

from sgl_ext import silu_and_mul, silu_and_mul_native
from tests.sgl_ext.sgl_ext_testutil import TOL, bits, poison

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _ref(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    d = x.shape[-1] // 2
    g = x[..., :d]
    return g / (1 + torch.exp(-g)) * x[..., d:]


@pytest.mark.parametrize("name", ["native", "triton"])
@pytest.mark.parametrize(
    "dtype, rows, d",
    [
        (torch.float32, 1, 1),
        (torch.bfloat16, 7, 33),
        (torch.float16, 33, 257),
        (torch.float32, 2, 1100),
    ],
)
def test_silu_and_mul(backend, name, dtype, rows, d):
    backend(name)
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(rows, 2 * d, generator=g) * 4).to(DEV, dtype)
    x0 = x.clone()
    out = poison(torch.empty(rows, d, dtype=dtype, device=DEV))
    assert silu_and_mul(x, out) is out
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), _ref(x), atol=tol, rtol=tol)
    assert torch.equal(bits(x), bits(x0))
    assert torch.equal(bits(silu_and_mul(x)), bits(out))


@pytest.mark.parametrize("name", ["native", "triton"])
def test_silu_and_mul_strided_3d(backend, name):
    """Rows of a wider buffer and a leading batch dim; output [..., d]."""
    backend(name)
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(3, 2, 20, generator=g).to(DEV)
    x = wide[..., :14]  # [3, 2, 14], row stride 20
    out = silu_and_mul(x)
    assert out.shape == (3, 2, 7)
    torch.testing.assert_close(out.double(), _ref(x), atol=1e-5, rtol=1e-5)


def test_bad_input_raises():
    x = torch.randn(4, 6)
    out = torch.randn(4, 3)
    out0 = out.clone()
    for exc, word, call in [
        (ValueError, "input", lambda: silu_and_mul(torch.randn(4, 5))),
        (TypeError, "input", lambda: silu_and_mul(x.int())),
        (ValueError, "out", lambda: silu_and_mul(x, torch.empty(4, 2))),
        (TypeError, "out", lambda: silu_and_mul(x, out.half())),
        (ValueError, "input", lambda: silu_and_mul(torch.randn(6, 4).t())),
    ]:
        with pytest.raises(exc, match=word):
            call()
    assert torch.equal(out, out0)


def test_native_rounding_order():
    x = torch.randn(5, 18).bfloat16()
    assert torch.equal(silu_and_mul_native(x), torch.nn.functional.silu(x[:, :9]) * x[:, 9:])


@gpu
@pytest.mark.parametrize("rows", [1, 7, 512])
def test_cuda_bf16_llama_shape(rows):
    """Llama-3-8B's intermediate size on the GPU: close to float64, ~always equal to native."""
    x = (torch.randn(rows, 2 * 14336, device="cuda") * 3).bfloat16()
    out = silu_and_mul(x)
    torch.testing.assert_close(out.double(), _ref(x), atol=TOL[torch.bfloat16], rtol=1.6e-2)
    assert (out != silu_and_mul_native(x)).float().mean().item() < 0.01
