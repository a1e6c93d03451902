"""Argument checks of the sgl_ext ops and the checked call they produce.

Every check here looks only at tensor metadata (dtype, device, shape, strides, requires_grad) and
Python scalars, so it never synchronises the device; its result is a `RopeCall`, the frozen
description of a call (head views, KV layouts, scale modes) that a backend launches from. The
ops cache it per distinct metadata (see `rope.py`), so these checks run once per shape. The
opt-in debug checks (`SGL_EXT_DEBUG=1` or `set_debug_checks`) read values and do synchronise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sgl_ext import settings
from sgl_ext.fused_arg import FusedSetKVBufferArg, Scale

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INDEX_DTYPES = (torch.int32, torch.int64)

SCALE_NONE, SCALE_FLOAT, SCALE_TENSOR = 0, 1, 2  # how a kernel receives a cache scale


@dataclass(frozen=True)
class HeadsView:
    """A [T, H*D] or [T, H, D] activation: head count and element strides."""

    num_heads: int
    token_stride: int
    head_stride: int


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


@dataclass(frozen=True)
class KVWrite:
    """The checked cache write: value's view, both buffers' layouts and dtypes, scale modes.

    k_inv / v_inv: for SCALE_FLOAT, the fp32 reciprocal the kernels multiply by (else 1.0).
    """

    value: HeadsView
    v_head_dim: int
    k_layout: KVLayout
    v_layout: KVLayout
    k_dtype: torch.dtype
    v_dtype: torch.dtype
    k_scale_mode: int
    v_scale_mode: int
    k_inv: float
    v_inv: float


@dataclass(frozen=True)
class RopeCall:
    """A checked call of the fused op (or, with query None and rot_dim 0, of the KV write).

    rot_dim / max_pos / cs_stride describe cos_sin_cache [max_pos, rot_dim] (row stride).
    """

    num_tokens: int
    head_size: int
    dtype: torch.dtype
    device: torch.device
    query: HeadsView | None
    key: HeadsView
    rot_dim: int
    max_pos: int
    cs_stride: int
    is_neox: bool
    kv: KVWrite | None


@dataclass(frozen=True)
class QKNormCall:
    """The checked q/k RMSNorm of a call (apply_qk_norm_rope_with_cos_sin_cache_inplace).

    eps: the variance epsilon; q_weight_align / k_weight_align: the weights' data_ptr() % 16
    (GPT-J pairs of the weights load as 32-bit words only from 4-byte aligned rows).
    """

    eps: float
    q_weight_align: int
    k_weight_align: int


def set_debug_checks(enabled: bool | None) -> None:
    """Turn the value-reading debug checks on/off (None: follow `SGL_EXT_DEBUG`)."""
    if enabled is None:
        enabled = settings.from_env().debug
    settings.set_fields(debug=bool(enabled))


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1), for launch sizes on the host: plain Python
    (triton.next_power_of_2 costs ~7 µs a call)."""
    return 1 << max(0, n - 1).bit_length()


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype; 0.0 for other dtypes (no clamping)."""
    return float(torch.finfo(dtype).max) if dtype in FP8_DTYPES else 0.0


def to_float32(x: float) -> float:
    """x rounded to float32 (to nearest, ties to even; subnormals and overflow to inf as IEEE),
    as a Python float. Pure Python, so torch.compile can trace the checks that use it."""
    if x == 0 or not math.isfinite(x):
        return x
    ax = abs(x)
    if ax >= 2.0**128 - 2.0**103:  # at or past the midpoint of FLT_MAX and 2^128
        return math.copysign(math.inf, x)
    m, e = math.frexp(ax)  # ax = m * 2^e, 0.5 <= m < 1
    bits = 24 - max(0, -125 - e)  # mantissa bits kept (fewer below the normal range)
    return math.copysign(math.ldexp(round(math.ldexp(m, bits)), e - bits), x)


def host_inverse(scale: float) -> float:
    """1 / scale as the reference computes it: fp32(scale), then one IEEE fp32 division (a
    double division rounded to fp32 is the same: 53 >= 2 * 24 + 2 bits)."""
    s = to_float32(float(scale))
    if s == 0:
        return math.copysign(math.inf, s)
    return to_float32(1.0 / s)


def scale_args(scale: Scale) -> tuple[int, torch.Tensor | None, float]:
    """How a kernel receives a cache scale: (mode, device tensor, float). SCALE_NONE; SCALE_FLOAT:
    a python float, passed as its host_inverse; SCALE_TENSOR: inverted in the kernel."""
    if scale is None:
        return SCALE_NONE, None, 1.0
    if isinstance(scale, torch.Tensor):
        return SCALE_TENSOR, scale, 1.0
    return SCALE_FLOAT, None, host_inverse(scale)


def check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:  # sparse, mkldnn: no data pointer and strides to launch on
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (same device as the inputs)")


def check_writable(name: str, t: torch.Tensor) -> None:
    """The op writes t in place: no autograd history, no element reachable twice."""
    if t.requires_grad:
        raise ValueError(f"{name} requires grad; the op writes it in place (detach it first)")
    # Sorted by stride, each dim must step past everything the smaller dims span: a sufficient
    # condition for distinct elements (an expanded view has a stride-0 dim and fails it).
    span = 0
    dims = sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s > 1)
    for stride, size in dims:
        if stride <= span:
            raise ValueError(
                f"{name} is an overlapping view (strides {tuple(t.stride())}, shape"
                f" {tuple(t.shape)}): the op writes every element once"
            )
        span += stride * (size - 1)


def check_index_vector(name: str, t: object, num_tokens: int, device: torch.device) -> None:
    check_tensor(name, t, INDEX_DTYPES)
    assert isinstance(t, torch.Tensor)
    if t.ndim != 1:
        raise ValueError(f"{name} must be 1-D [num_tokens], got shape {tuple(t.shape)}")
    if t.shape[0] != num_tokens:
        raise ValueError(f"len({name}) = {t.shape[0]} must equal num_tokens = {num_tokens}")
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous (stride {t.stride(0)})")
    check_device(name, t, device)


def heads_view(name: str, t: torch.Tensor, num_tokens: int, head_dim: int) -> HeadsView:
    """Decode a [T, H*D] or [T, H, D] activation."""
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
    return HeadsView(num_heads, t.stride(0), head_stride)


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


def _as_float(name: str, x: int | float) -> float:
    """float(x), or a ValueError naming the argument for an int past the float range."""
    try:
        return float(x)
    except OverflowError:
        bits = x.bit_length() if isinstance(x, int) else 0
        raise ValueError(f"{name} must be finite in float32, got an int of {bits} bits") from None


def check_eps(name: str, eps: object, allow_zero: bool = False) -> float:
    """Check a variance epsilon as the scales are checked: a float or int that is positive,
    finite and normal in float32 (or exactly 0 with `allow_zero`). Every backend adds it in
    float32, where 1e-50 is 0 and 1e39 is inf, and a GPU may flush a subnormal to 0. Returns
    it as a float."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(eps).__name__}")
    f = _as_float(name, eps)
    f32 = to_float32(f)
    if not ((math.isfinite(f32) and f32 >= _FLOAT32_TINY) or (allow_zero and f == 0)):
        zero = "0 or " if allow_zero else ""
        raise ValueError(
            f"{name} must be {zero}positive, finite and normal in float32"
            f" (>= {_FLOAT32_TINY:.4g}), got {eps!r}"
        )
    return f


_FLOAT32_TINY = 2.0**-126  # smallest positive normal float32


def check_scale(name: str, scale: object, device: torch.device) -> tuple[int, float]:
    """Check a cache scale; returns (mode, the fp32 reciprocal for a float scale else 1.0).

    A float scale must be positive and finite in float32, and so must its fp32 reciprocal (the
    kernels multiply by it). A tensor scale is not read (no sync): its value must be positive
    and finite, which only the debug checks verify.
    """
    if scale is None:
        return SCALE_NONE, 1.0
    if isinstance(scale, bool):
        raise TypeError(f"{name} must be a float, a 1-element tensor or None, got bool")
    if isinstance(scale, (int, float)):
        f32 = to_float32(_as_float(name, scale))
        inv = host_inverse(f32) if f32 > 0 else 0.0
        if not (math.isfinite(f32) and f32 > 0 and math.isfinite(inv) and inv > 0):
            raise ValueError(
                f"{name} must be positive and finite in float32 (and so its reciprocal), got"
                f" {scale!r}"
            )
        return SCALE_FLOAT, inv
    check_tensor(name, scale)  # a dense tensor
    assert isinstance(scale, torch.Tensor)
    if not scale.dtype.is_floating_point:
        raise TypeError(f"{name} tensor must have a floating dtype, got {scale.dtype}")
    if scale.numel() != 1:
        raise ValueError(f"{name} tensor must have exactly 1 element, got {scale.numel()}")
    check_device(name, scale, device)
    return SCALE_TENSOR, 1.0


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
) -> KVWrite:
    """Check the KV-write arguments (key already checked as an activation)."""
    device = key.device
    num_kv_heads = heads_view("key", key, num_tokens, head_dim).num_heads
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
    v_view = heads_view("value", value, num_tokens, v_head_dim)
    if v_view.num_heads != num_kv_heads:
        raise ValueError(f"value has {v_view.num_heads} heads, key has {num_kv_heads}")
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
    check_writable("k_buffer", k_buffer)
    check_writable("v_buffer", v_buffer)
    check_index_vector("cache_loc", cache_loc, num_tokens, device)
    k_mode, k_inv = check_scale("k_scale", k_scale, device)
    v_mode, v_inv = check_scale("v_scale", v_scale, device)
    return KVWrite(
        v_view,
        v_head_dim,
        k_lay,
        v_lay,
        k_buffer.dtype,
        v_buffer.dtype,
        k_mode,
        v_mode,
        k_inv,
        v_inv,
    )


def check_rope(
    positions: object,
    query: object,
    key: object,
    head_size: object,
    cos_sin_cache: object,
    is_neox: object,
    fused_set_kv_buffer_arg: object = None,
) -> RopeCall:
    """Every check of the RoPE op (metadata only), the KV write's last: the checked call, or a
    ValueError / TypeError naming the bad argument."""
    check_tensor("positions", positions, INDEX_DTYPES)
    check_tensor("query", query, INPUT_DTYPES)
    check_tensor("key", key, INPUT_DTYPES)
    check_tensor("cos_sin_cache", cos_sin_cache, (torch.float32,))
    assert isinstance(positions, torch.Tensor) and isinstance(query, torch.Tensor)
    assert isinstance(key, torch.Tensor) and isinstance(cos_sin_cache, torch.Tensor)
    if not isinstance(head_size, int) or isinstance(head_size, bool) or head_size <= 0:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox must be a bool, got {type(is_neox).__name__}")
    if key.dtype != query.dtype:
        raise TypeError(f"key dtype {key.dtype} must equal query dtype {query.dtype}")
    if positions.ndim != 1:
        raise ValueError(f"positions must be 1-D [num_tokens], got shape {tuple(positions.shape)}")
    device = query.device
    for name, t in (("key", key), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        check_device(name, t, device)
    num_tokens = positions.shape[0]
    q_view = heads_view("query", query, num_tokens, head_size)
    k_view = heads_view("key", key, num_tokens, head_size)
    if positions.shape[0] > 1 and positions.stride(0) != 1:
        raise ValueError(f"positions must be contiguous (stride {positions.stride(0)})")
    if cos_sin_cache.ndim != 2:
        raise ValueError(
            f"cos_sin_cache must be 2-D [max_pos, rotary_dim], got {cos_sin_cache.ndim}-D"
        )
    max_pos, rot = cos_sin_cache.shape
    if rot == 0 or rot % 2 or rot > head_size:
        raise ValueError(
            f"cos_sin_cache rotary_dim {rot} must be even, positive and <= head_size {head_size}"
        )
    if max_pos == 0:
        raise ValueError("cos_sin_cache has no rows (max_pos 0): no position can be rotated")
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be contiguous in its last dim")
    check_writable("query", query)
    check_writable("key", key)
    kv = None
    if fused_set_kv_buffer_arg is not None:
        kv = check_fused_arg(key, fused_set_kv_buffer_arg, head_size)
    cs_stride = cos_sin_cache.stride(0)
    return RopeCall(
        num_tokens,
        head_size,
        query.dtype,
        device,
        q_view,
        k_view,
        rot,
        max_pos,
        cs_stride,
        is_neox,
        kv,
    )


def check_fused_arg(key: torch.Tensor, arg: object, head_size: int) -> KVWrite:
    """Check a fused argument against an already checked key (no launch)."""
    if not isinstance(arg, FusedSetKVBufferArg):
        raise TypeError(
            f"fused_set_kv_buffer_arg must be a FusedSetKVBufferArg or None, got {type(arg)}"
        )
    a = arg
    args = (a.value, a.k_buffer, a.v_buffer, a.cache_loc, a.k_scale, a.v_scale)
    return check_kv_write(key, *args, key.shape[0], head_size)


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


def debug_check_scales(k_scale: Scale, v_scale: Scale) -> None:
    """Opt-in (synchronising) check: tensor scales are positive and finite."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(s, torch.Tensor):
            v = float(s.detach().float().reshape(()).cpu())
            inv = host_inverse(v) if v > 0 else 0.0
            if not (math.isfinite(v) and v > 0 and math.isfinite(inv)):
                raise ValueError(f"{name} must be positive and finite in float32, got {v}")
