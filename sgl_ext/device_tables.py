"""Per-GPU exceptions to a measured table: the sections whose key occurs in the GPU's name.

The launch tables (`sgl_ext/tables/*.json`, read by `launch_tables`) keep what another GPU
measured better than the H100's rows under `devices`, keyed by a substring of
`torch.cuda.get_device_name` (e.g. "H200"); `launch_tables.LaunchTable.device_rows` picks them
through `device_tables`.
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
