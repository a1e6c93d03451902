"""What loading a model costs, checked before anything is allocated, and the loading message.

`weight_footprint` counts the parameters of the registry's class for a config on the meta
device (exact, no memory) and prices them in the target dtype; `check_weight_memory` compares
that with what the device has now (free CUDA memory, or the host's available RAM on CPU) and
raises `NotEnoughMemoryError` (a ValueError: a user error) instead of letting a preset such as
``llama3-8b`` in float32 on a small CPU box get killed half-way; `describe_load` is the one line
the runner logs before it loads.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Weights may take at most this share of what the device has; the rest is for the KV cache,
# activations and the temporary float32 tensors the dummy initialisation draws.
WEIGHT_MEMORY_SHARE = 0.9


class NotEnoughMemoryError(ValueError):
    """The model's weights do not fit in the device memory that is available."""


@dataclass(frozen=True)
class WeightFootprint:
    """Parameters one rank holds and their size in the load dtype."""

    num_params: int  # this rank's parameters (full count / tp_size)
    num_bytes: int  # num_params * element size of dtype
    dtype: torch.dtype


def count_parameters(model_config: Any, model_impl: str = "srt") -> int:
    """Exact parameter count of the TP-1 model (a meta-device build: no memory, no weights);
    model_impl "sglang": the registered SGLang model file's class."""
    from srt.model_loader.loader import full_parameter_shapes
    from srt.models.registry import get_model_class

    cls = get_model_class(model_config.architecture, model_impl)
    shapes = full_parameter_shapes(cls, model_config, model_impl)
    return sum(math.prod(shape) for _, shape in shapes)


def weight_footprint(
    model_config: Any, dtype: torch.dtype, tp_size: int = 1, model_impl: str = "srt"
) -> WeightFootprint:
    """The footprint of one TP rank's weights in ``dtype``."""
    n = count_parameters(model_config, model_impl) // max(1, tp_size)
    return WeightFootprint(n, n * torch.empty((), dtype=dtype).element_size(), dtype)


def available_memory(device: torch.device) -> int | None:
    """Bytes that can be allocated on ``device`` now, or None when unknown.

    CUDA: the free memory of the device. CPU: the host's ``MemAvailable`` (Linux), else the
    free physical pages.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_weight_memory(footprint: WeightFootprint, device: torch.device, what: str) -> None:
    """Raise NotEnoughMemoryError when the weights exceed the device's available memory.

    Parameters
    ----------
    footprint : from `weight_footprint`.
    device : where the weights will be allocated.
    what : names the model in the message (a path or a preset's architecture).
    """
    have = available_memory(device)
    if have is None or footprint.num_bytes <= WEIGHT_MEMORY_SHARE * have:
        return
    dtype = str(footprint.dtype).replace("torch.", "")
    hint = ", --dtype bfloat16 halves that" if footprint.dtype == torch.float32 else ""
    raise NotEnoughMemoryError(
        f"not enough memory for {what} on {device}: {format_count(footprint.num_params)} "
        f"parameters in {dtype}{hint} ({footprint.num_bytes / 2**30:.1f} GiB needed, "
        f"{have / 2**30:.1f} GiB available)"
    )


def format_count(n: int) -> str:
    """8030261248 -> "8.03 B", 204800 -> "0.20 M"."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def describe_load(
    what: str, architecture: str, footprint: WeightFootprint, device: torch.device, weights: str
) -> str:
    """The loading line: what, architecture, parameter count, dtype and size, device."""
    dtype = str(footprint.dtype).replace("torch.", "")
    return (
        f"loading {what} ({architecture}): {format_count(footprint.num_params)} parameters, "
        f"{footprint.num_bytes / 2**30:.2f} GiB in {dtype} on {device}, {weights} weights"
    )


__all__ = [
    "NotEnoughMemoryError",
    "WeightFootprint",
    "available_memory",
    "check_weight_memory",
    "count_parameters",
    "describe_load",
    "weight_footprint",
]
