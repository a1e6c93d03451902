"""Shared argument checks and KV-buffer layout decoding for the sgl_ext ops.

Every check here looks only at tensor metadata (dtype, device, shape, strides), so it never
synchronises the device. The opt-in debug checks (`SGL_EXT_DEBUG=1` or `set_debug_checks`) read
values and therefore do synchronise.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INDEX_DTYPES = (torch.int32, torch.int64)

_debug_override: bool | None = None


def set_debug_checks(enabled: bool | None) -> None:
    """Turn the value-reading debug checks on/off (None: follow `SGL_EXT_DEBUG`)."""
    global _debug_override
    _debug_override = enabled


def debug_checks_enabled() -> bool:
    if _debug_override is not None:
        return _debug_override
    return os.environ.get("SGL_EXT_DEBUG", "0") not in ("", "0", "false", "False")


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype; 0.0 for other dtypes (no clamping)."""
    return float(torch.finfo(dtype).max) if dtype in FP8_DTYPES else 0.0


def host_inverse(scale: float) -> float:
    """1 / scale as the reference computes it: fp32(scale), then one IEEE fp32 division."""
    with np.errstate(over="ignore", divide="ignore"):
        return float(np.float32(1.0) / np.float32(scale))


def scale_args(scale: float | torch.Tensor | None) -> tuple[int, torch.Tensor | None, float]:
    """How a kernel receives a cache scale: (mode, device tensor, float). Mode 0: no scale;
    1: a python float, passed as its host_inverse; 2: a device tensor, inverted in the kernel."""
    if scale is None:
        return 0, None, 1.0
    if isinstance(scale, torch.Tensor):
        return 2, scale, 1.0
    return 1, None, host_inverse(scale)


def check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (same device as the inputs)")


def check_index_vector(name: str, t: object, num_tokens: int, device: torch.device) -> None:
    check_tensor(name, t, INDEX_DTYPES)
    assert isinstance(t, torch.Tensor)
    if t.ndim != 1:
        raise ValueError(f"{name} must be 1-D [num_tokens], got shape {tuple(t.shape)}")
    if t.shape[0] != num_tokens:
        raise ValueError(f"len({name}) = {t.shape[0]} must equal num_tokens = {num_tokens}")
    check_device(name, t, device)


def heads_view(name: str, t: torch.Tensor, num_tokens: int, head_dim: int) -> tuple[int, int, int]:
    """Decode a [T, H*D] or [T, H, D] activation. Returns (num_heads, token_stride, head_stride)."""
    if t.ndim == 2:
        if t.shape[1] % head_dim != 0:
            raise ValueError(
                f"{name} last dim {t.shape[1]} is not a multiple of the head size {head_dim}"
            )
        num_heads, head_stride = t.shape[1] // head_dim, head_dim
    elif t.ndim == 3:
        if t.shape[2] != head_dim:
            raise ValueError(f"{name} head dim {t.shape[2]} != expected head size {head_dim}")
        num_heads, head_stride = t.shape[1], t.stride(1)
    else:
        raise ValueError(f"{name} must be 2-D [T, H*D] or 3-D [T, H, D], got {t.ndim}-D")
    if t.shape[0] != num_tokens:
        raise ValueError(f"{name} has {t.shape[0]} tokens, expected num_tokens = {num_tokens}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride {t.stride(-1)})")
    if num_heads == 0:
        raise ValueError(f"{name} has no heads")
    return num_heads, t.stride(0), head_stride


@dataclass(frozen=True)
class KVLayout:
    """Where slot s, head h, dim d of a KV buffer lives (in elements, from its data pointer):

    (s // page_size) * page_stride + (s % page_size) * offset_stride + h * head_stride + d
    """

    num_slots: int
    page_size: int
    page_stride: int
    offset_stride: int
    head_stride: int
    num_heads: int
    head_dim: int

    @property
    def strides(self) -> tuple[int, int, int]:
        """(page_stride, offset_stride, head_stride)."""
        return self.page_stride, self.offset_stride, self.head_stride


def kv_layout(
    name: str, buf: torch.Tensor, num_heads: int, head_dim: int | None, dim_of: str = "head_size"
) -> KVLayout:
    """Decode a 2-D [slots, H*D], 3-D [slots, H, D] or 4-D [pages, page_size, H, D] buffer."""
    if buf.ndim == 2:
        if head_dim is None or buf.shape[1] != num_heads * head_dim:
            raise ValueError(
                f"{name} is 2-D with row size {buf.shape[1]}, expected num_kv_heads * head_dim"
                f" = {num_heads} * {head_dim}"
            )
        lay = KVLayout(buf.shape[0], 1, buf.stride(0), 0, head_dim, num_heads, head_dim)
    elif buf.ndim in (3, 4):
        pages, ps = (buf.shape[0], 1) if buf.ndim == 3 else (buf.shape[0], buf.shape[1])
        h, d = buf.shape[-2], buf.shape[-1]
        if h != num_heads:
            raise ValueError(f"{name} has {h} heads, expected num_kv_heads = {num_heads}")
        if head_dim is not None and d != head_dim:
            raise ValueError(f"{name} head dim {d} != {dim_of} {head_dim}")
        off_stride = 0 if buf.ndim == 3 else buf.stride(1)
        lay = KVLayout(pages * ps, ps, buf.stride(0), off_stride, buf.stride(-2), h, d)
    else:
        raise ValueError(
            f"{name} must be 2-D [slots, H*D], 3-D [slots, H, D] or 4-D [pages, page_size, H, D],"
            f" got {buf.ndim}-D"
        )
    if buf.stride(-1) != 1 and buf.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride {buf.stride(-1)})")
    if lay.num_slots == 0:
        raise ValueError(f"{name} has no slots")
    return lay


def check_scale(name: str, scale: object, device: torch.device) -> None:
    if scale is None:
        return
    if isinstance(scale, bool):
        raise TypeError(f"{name} must be a float, a 1-element tensor or None, got bool")
    if isinstance(scale, (int, float)):
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"{name} must be a finite positive number, got {scale}")
        return
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a float, a 1-element tensor or None, got {type(scale)}")
    if not scale.dtype.is_floating_point:
        raise TypeError(f"{name} tensor must have a floating dtype, got {scale.dtype}")
    if scale.numel() != 1:
        raise ValueError(f"{name} tensor must have exactly 1 element, got {scale.numel()}")
    check_device(name, scale, device)


def check_kv_write(
    key: torch.Tensor,
    value: object,
    k_buffer: object,
    v_buffer: object,
    cache_loc: object,
    k_scale: object,
    v_scale: object,
    num_tokens: int,
    head_dim: int,
) -> tuple[KVLayout, KVLayout, int, int, int]:
    """Check the KV-write arguments. Returns (k_layout, v_layout, v_head_dim, v_tok, v_head)."""
    device = key.device
    num_kv_heads = heads_view("key", key, num_tokens, head_dim)[0]
    check_tensor("value", value)
    assert isinstance(value, torch.Tensor)
    if value.dtype != key.dtype:
        raise TypeError(f"value dtype {value.dtype} must equal key dtype {key.dtype}")
    check_device("value", value, device)
    if value.ndim == 3:
        v_head_dim = value.shape[2]
    elif value.ndim == 2:
        if value.shape[1] % num_kv_heads != 0:
            raise ValueError(
                f"value last dim {value.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        v_head_dim = value.shape[1] // num_kv_heads
    else:
        raise ValueError(f"value must be 2-D [T, H*Dv] or 3-D [T, H, Dv], got {value.ndim}-D")
    v_heads, v_tok, v_head = heads_view("value", value, num_tokens, v_head_dim)
    if v_heads != num_kv_heads:
        raise ValueError(f"value has {v_heads} heads, key has {num_kv_heads}")
    allowed = (key.dtype, *FP8_DTYPES)
    check_tensor("k_buffer", k_buffer, allowed)
    check_tensor("v_buffer", v_buffer, allowed)
    assert isinstance(k_buffer, torch.Tensor) and isinstance(v_buffer, torch.Tensor)
    check_device("k_buffer", k_buffer, device)
    check_device("v_buffer", v_buffer, device)
    k_lay = kv_layout("k_buffer", k_buffer, num_kv_heads, head_dim)
    v_lay = kv_layout("v_buffer", v_buffer, num_kv_heads, v_head_dim, "the head dim of value")
    if (k_lay.num_slots, k_lay.page_size) != (v_lay.num_slots, v_lay.page_size):
        raise ValueError(
            f"v_buffer has {v_lay.num_slots} slots in pages of {v_lay.page_size}, k_buffer has"
            f" {k_lay.num_slots} in pages of {k_lay.page_size}"
        )
    check_index_vector("cache_loc", cache_loc, num_tokens, device)
    check_scale("k_scale", k_scale, device)
    check_scale("v_scale", v_scale, device)
    return k_lay, v_lay, v_head_dim, v_tok, v_head


def debug_check_slots(cache_loc: torch.Tensor, num_slots: int) -> None:
    """Opt-in (synchronising) check: written slots are in range and not duplicated."""
    loc = cache_loc.detach().to("cpu", torch.int64)
    written = loc[loc >= 0]
    if written.numel() and int(written.max()) >= num_slots:
        raise ValueError(f"cache_loc has slot {int(written.max())} >= num_slots {num_slots}")
    if written.unique().numel() != written.numel():
        raise ValueError("cache_loc writes the same slot twice")


def debug_check_positions(positions: torch.Tensor, max_pos: int) -> None:
    pos = positions.detach().to("cpu", torch.int64)
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= max_pos):
        raise ValueError(
            f"positions must lie in [0, {max_pos}), got [{int(pos.min())}, {int(pos.max())}]"
        )
