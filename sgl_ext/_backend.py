"""Backend choice for the sgl_ext ops: `native`, `triton` or `cuda`.

`SGL_EXT_BACKEND` (settings.backend) forces one (CI sets `triton` with `TRITON_INTERPRET=1` to
run the Triton kernel on CPU tensors). Otherwise CUDA tensors get the fastest available kernel and
others `native`. The ops choose once per launch plan (see `rope.py`), not per call.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from sgl_ext import settings


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton runs in its interpreter (`TRITON_INTERPRET=1`, read once into the settings)."""
    return settings.get().interpret


@functools.cache
def pdl_capable(device_index: int | None) -> bool:
    """Programmatic dependent launch needs Hopper (sm_90) or newer."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def select_backend(
    device: torch.device, cuda_ok: bool = False, cuda_preferred: bool = True, has_cuda: bool = True
) -> str:
    """Pick the backend for tensors on `device`.

    cuda_ok: the CUDA kernel supports this call and is built; cuda_preferred: it is measured
    faster than Triton at this size; has_cuda: the op has a CUDA kernel at all (forcing `cuda`
    for an op without one falls back to the automatic choice).
    """
    s = settings.get()
    forced = s.backend
    if forced == "cuda" and not has_cuda:
        forced = None
    if forced is not None:
        if forced == "triton" and not triton_available():
            raise RuntimeError("SGL_EXT_BACKEND=triton but triton is not installed")
        if forced == "triton" and device.type != "cuda" and not s.interpret:
            raise RuntimeError(
                f"SGL_EXT_BACKEND=triton needs CUDA tensors (got {device}) or TRITON_INTERPRET=1"
            )
        if forced == "cuda" and (device.type != "cuda" or not cuda_ok):
            raise RuntimeError("SGL_EXT_BACKEND=cuda but the CUDA kernel cannot run this call")
        return forced
    if device.type == "cuda":
        if cuda_ok and cuda_preferred:
            return "cuda"
        if triton_available():
            return "triton"
    return "native"
