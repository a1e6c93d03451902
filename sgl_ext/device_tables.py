"""Per-GPU exceptions to a measured table: the tables whose key occurs in the GPU's name.

srt's `gemm_choice.DEVICE_OVERRIDES` (decode linears) and `MXFP4_DEVICE_OVERRIDES` (the MXFP4
expert kernels) and sgl_ext's `rope_kv_plan.QK_NORM_DEVICE_LAYOUTS` (the q/k-norm op's layouts)
and `DECODE_DEVICE_LAYOUTS` (RoPE + KV at decode sizes) hold what another GPU measured better
than the H100's table, keyed by a substring of
`torch.cuda.get_device_name` (e.g. "H200").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch

T = TypeVar("T")
_names: dict[int, str] = {}  # CUDA device index -> its name (read once)


def device_tables(overrides: Mapping[str, T], device: torch.device | None) -> list[T]:
    """The values of `overrides` whose key is a substring of CUDA `device`'s name, in the
    mapping's order; none for no device, off CUDA or without a GPU."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return []
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = _names.get(index)
    if name is None:
        name = _names[index] = torch.cuda.get_device_name(index)
    return [t for sub, t in overrides.items() if sub in name]
