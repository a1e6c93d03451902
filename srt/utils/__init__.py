"""Small helpers shared by the command-line jobs and the layers, and the names SGLang's model
files import from `sglang.srt.utils` (they live in `common.py`; loaded on first use, so that
`srt.utils.cli` stays free of torch)."""

from __future__ import annotations

from typing import Any

_COMMON = (
    "LazyValue",
    "add_prefix",
    "get_bool_env_var",
    "get_device",
    "get_exception_traceback",
    "get_int_env_var",
    "is_cpu",
    "is_cuda",
    "is_cuda_alike",
    "is_flashinfer_available",
    "is_hip",
    "is_npu",
    "is_xpu",
    "make_layers",
    "make_pp_layers",
)
__all__ = list(_COMMON)


def __getattr__(name: str) -> Any:
    if name in _COMMON:
        from srt.utils import common

        return getattr(common, name)
    raise AttributeError(f"module 'srt.utils' has no attribute {name!r}")
