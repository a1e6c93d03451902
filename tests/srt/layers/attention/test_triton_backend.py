"""TritonAttnBackend (our kernels) against the float64 reference; TRITON_INTERPRET=1 on CPU.

The interpreter is slow: a representative handful of tiny cases.
"""

import pytest
import torch
from attn_reference import run_scenario

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _backend():
    from srt.layers.attention.triton_backend import TritonAttnBackend

    return TritonAttnBackend(None, DEV)


@pytest.mark.parametrize(
    "kw",
    [
        dict(page_size=1),
        dict(page_size=4, save_kv=False, hq=7, hkv=1),
        dict(page_size=16, window=3, use_sinks=True),
        dict(cap=5.0, hq=3, hkv=3, d=8),
        dict(page_size=4, kv_dtype=torch.float8_e4m3fn, scale=0.5),
        dict(kv_dtype=torch.float8_e5m2, scale="tensor", use_sinks=True),
    ],
)
def test_triton_backend(kw):
    if kw.get("scale") == "tensor":
        kw = {**kw, "scale": torch.tensor([0.25], device=DEV)}
    run_scenario(_backend, device=DEV, **kw)
