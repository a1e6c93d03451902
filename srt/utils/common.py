"""Helpers SGLang's model files import from `sglang.srt.utils` (SGLang's `utils/common.py`):
weight-name prefixes, the per-layer module list, platform probes, environment switches.

The platform probes answer for srt: CUDA (NVIDIA) or CPU. ROCm, NPU, XPU and FlashInfer paths
of SGLang's files are never taken, so `is_hip` / `is_npu` / `is_xpu` are False and
`is_flashinfer_available` is False (srt runs its own kernels, not FlashInfer's).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from srt.settings import sglang_switch


def add_prefix(name: str | int, prefix: str) -> str:
    """`prefix.name`, or `name` when prefix is empty (weight names: "model.layers.3.mlp")."""
    return str(name) if not prefix else f"{prefix}.{name}"


def is_cuda() -> bool:
    """A CUDA (NVIDIA) device is present."""
    return torch.cuda.is_available() and torch.version.cuda is not None


def is_cuda_alike() -> bool:
    return is_cuda()


def is_hip() -> bool:
    """ROCm: srt does not run there."""
    return False


def is_npu() -> bool:
    return False


def is_xpu() -> bool:
    return False


def is_cpu() -> bool:
    """No CUDA device: srt runs on the CPU."""
    return not torch.cuda.is_available()


def is_flashinfer_available() -> bool:
    """False: SGLang's files take their FlashInfer fast paths only when this is True, and srt
    runs its own kernels."""
    return False


def get_device(device_id: int | None = None) -> str:
    """ "cuda" (or "cuda:<id>") when a GPU is present, else "cpu"."""
    if torch.cuda.is_available():
        return "cuda" if device_id is None else f"cuda:{device_id}"
    return "cpu"


def get_bool_env_var(name: str, default: str = "false") -> bool:
    """An environment variable read as a boolean ("true"/"1" are true)."""
    return (sglang_switch(name) or default).strip().lower() in ("true", "1")


def get_int_env_var(name: str, default: int = 0) -> int:
    value = sglang_switch(name)
    try:
        return int(value) if value and value.strip() else default
    except ValueError:
        return default


def get_exception_traceback() -> str:
    """The current exception's formatted traceback (SGLang's `sglang.utils` helper)."""
    return "".join(traceback.format_exc())


class LazyValue:
    """A value computed on first use (`.value`), then kept."""

    def __init__(self, creator: Callable[[], Any]) -> None:
        self._creator: Callable[[], Any] | None = creator
        self._value: Any = None

    @property
    def value(self) -> Any:
        if self._creator is not None:
            self._value = self._creator()
            self._creator = None
        return self._value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.value, name)

    def __getitem__(self, key: Any) -> Any:
        return self.value[key]


def make_layers(
    num_hidden_layers: int,
    layer_fn: Callable[..., nn.Module],
    pp_rank: int | None = None,
    pp_size: int | None = None,
    prefix: str = "",
    return_tuple: bool = False,
    offloader_kwargs: dict[str, Any] | None = None,
    final_read: Any = None,
    stage_facts: Callable[[int], Sequence[Any]] | None = None,
) -> Any:
    """The model's decoder layers: `layer_fn(idx=i, prefix="<prefix>.<i>")` for every layer.

    Returns the nn.ModuleList, or (list, start_layer, end_layer) when pp_rank and pp_size are
    given. Pipeline parallelism (pp_size > 1), weight offloading and a final read other than
    the plain final norm are not supported and raise. `stage_facts` (SGLang's per-layer stage
    declaration, needed by its pipeline stages) is accepted: one stage holds every layer.
    """
    from srt.distributed import get_pp_indices

    if offloader_kwargs:
        raise NotImplementedError("weight offloading (offloader_kwargs) is not supported")
    if final_read is not None:
        raise NotImplementedError("make_layers(final_read=...): only the plain final norm")
    start, end = get_pp_indices(num_hidden_layers, pp_rank or 0, pp_size or 1)
    layers = nn.ModuleList(
        [layer_fn(idx=i, prefix=add_prefix(i, prefix)) for i in range(start, end)]
    )
    if pp_rank is None or pp_size is None:
        return layers
    return layers, start, end


def make_pp_layers(
    num_hidden_layers: int,
    layer_fn: Callable[..., nn.Module],
    prefix: str = "",
    return_tuple: bool = False,
    offloader_kwargs: dict[str, Any] | None = None,
    final_read: Any = None,
    stage_facts: Callable[[int], Sequence[Any]] | None = None,
) -> tuple[nn.ModuleList, int, int]:
    """This pipeline stage's layers and their range [start_layer, end_layer): all of them
    (srt runs one pipeline stage)."""
    from srt.runtime_context import get_parallel

    parallel = get_parallel()
    return make_layers(
        num_hidden_layers,
        layer_fn,
        parallel.pp_rank,
        parallel.pp_size,
        prefix,
        return_tuple,
        offloader_kwargs,
        final_read,
        stage_facts,
    )
