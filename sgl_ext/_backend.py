"""Backend choice for the sgl_ext ops: `native` or `triton`.

`SGL_EXT_BACKEND` (settings.backend) forces one (CI sets `triton` with `TRITON_INTERPRET=1` to
run the Triton kernel on CPU tensors). Otherwise CUDA tensors get the Triton kernels and others
`native`. The ops choose once per launch plan (see `rope.py`), not per call.
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


def select_backend(device: torch.device) -> str:
    """Pick the backend for tensors on `device`: the forced one (`SGL_EXT_BACKEND`, checked it
    can run here), else `triton` on CUDA (when installed) and `native` elsewhere."""
    s = settings.get()
    forced = s.backend
    if forced == "triton":
        if not triton_available():
            raise RuntimeError("SGL_EXT_BACKEND=triton but triton is not installed")
        if device.type != "cuda" and not s.interpret:
            raise RuntimeError(
                f"SGL_EXT_BACKEND=triton needs CUDA tensors (got {device}) or TRITON_INTERPRET=1"
            )
        return forced
    if forced is not None:
        return forced
    if device.type == "cuda" and triton_available():
        return "triton"
    return "native"
