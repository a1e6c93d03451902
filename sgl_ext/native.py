"""Torch-native reference implementations of the sgl_ext ops.

These run on any device, are the CPU path and the oracle for the kernels. They are sync-free
(a skipped token never becomes a data-dependent shape), so they also capture in CUDA graphs and
compile with torch.compile.
"""

from __future__ import annotations

import torch

from sgl_ext._common import KVLayout, Scale, fp8_max


def rotate_native(
    positions: torch.Tensor,
    x: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Rotate the first rotary_dim dims of every head of x ([T, H*D] or [T, H, D]) in place."""
    rot = cos_sin_cache.shape[1]
    half = rot // 2
    xs = x.unflatten(-1, (-1, head_size)) if x.ndim == 2 else x  # [T, H, D] view
    # Out-of-range positions are clamped (memory safety; the debug checks report them).
    pos = positions.long().clamp(0, cos_sin_cache.shape[0] - 1)
    cos_sin = cos_sin_cache.index_select(0, pos).unsqueeze(1)  # [T, 1, rot]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]  # [T, 1, rot/2] each
    xr = xs[..., :rot].float()  # [T, H, rot]
    if is_neox:
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]  # [T, H, rot/2]: even and odd dims
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    xs[..., :rot] = out.to(x.dtype)


def quantize_native(x: torch.Tensor, buf_dtype: torch.dtype, scale: Scale) -> torch.Tensor:
    """What the cache stores for x: x * (1 / scale) in fp32, cast to the buffer dtype.

    The reciprocal is one IEEE fp32 division. fp8: finite values saturate to the largest finite
    value; NaN stays NaN; +-inf is not saturated (e5m2 stores +-inf, e4m3fn, which has no
    infinity, NaN).
    """
    if scale is None and buf_dtype == x.dtype:
        return x
    y = x.float()
    if scale is not None:
        s = scale if isinstance(scale, torch.Tensor) else torch.tensor(scale, device=x.device)
        inv = torch.reciprocal(s.reshape(1).to(device=x.device, dtype=torch.float32))  # [1]
        y = y * inv
    fmax = fp8_max(buf_dtype)
    if fmax:
        inf_out = y if buf_dtype == torch.float8_e5m2 else torch.full_like(y, float("nan"))
        y = torch.where(y.isinf(), inf_out, y.clamp(-fmax, fmax))  # clamp keeps NaN
    return y.to(buf_dtype)


def _slot_view(buf: torch.Tensor, lay: KVLayout) -> torch.Tensor:
    """A no-copy view of buf indexed as [slots, H, D] (2-D/3-D) or [pages, page_size, H, D]."""
    if buf.ndim == 2:
        return buf.unflatten(1, (lay.num_heads, lay.head_dim))
    return buf


def _slot_index(buf: torch.Tensor, lay: KVLayout, loc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if buf.ndim == 4:
        return (loc // lay.page_size, loc % lay.page_size)
    return (loc,)


def scatter_native(
    buf: torch.Tensor, lay: KVLayout, cache_loc: torch.Tensor, rows: torch.Tensor
) -> None:
    """buf[slot cache_loc[i]] = rows[i] for every i with 0 <= cache_loc[i] < num_slots.

    Sync-free: a skipped token repeats the first written token's (slot, value) pair, which is
    harmless; if no token is written, slot 0 is rewritten with its own contents.
    """
    if cache_loc.shape[0] == 0:
        return
    view = _slot_view(buf, lay)
    rows = rows.reshape(rows.shape[0], lay.num_heads, lay.head_dim).to(buf.dtype)  # [T, H, D]
    if fp8_max(buf.dtype):  # fp8 has few kernels (where, index_put): move its bytes instead
        view, rows = view.view(torch.uint8), rows.view(torch.uint8)
    loc = cache_loc.long()
    valid = (loc >= 0) & (loc < lay.num_slots)  # [T]
    # 1-element index tensors throughout: indexing with a 0-d tensor would call .item() (a sync).
    first = valid.to(torch.int8).argmax().view(1)  # [1] first written token, 0 if none
    any_valid = valid.any()
    zero = torch.zeros(1, dtype=torch.long, device=loc.device)
    target = torch.where(valid, loc, torch.where(any_valid, loc.index_select(0, first), zero))
    slot0 = view[_slot_index(buf, lay, zero)]  # [1, H, D], current contents of slot 0
    fill = torch.where(any_valid, rows.index_select(0, first), slot0)  # [1, H, D]
    rows = torch.where(valid[:, None, None], rows, fill)
    view[_slot_index(buf, lay, target)] = rows


def kv_write_native(
    key: torch.Tensor,
    value: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    cache_loc: torch.Tensor,
    k_scale: Scale,
    v_scale: Scale,
    k_lay: KVLayout,
    v_lay: KVLayout,
) -> None:
    """Store key/value ([T, H*D] or [T, H, D]) into the cache slots cache_loc."""
    scatter_native(k_buffer, k_lay, cache_loc, quantize_native(key, k_buffer.dtype, k_scale))
    scatter_native(v_buffer, v_lay, cache_loc, quantize_native(value, v_buffer.dtype, v_scale))


def rms_norm_heads_native(
    x: torch.Tensor, head_size: int, weight: torch.Tensor, eps: float
) -> None:
    """RMSNorm every head of x ([T, H*D] or [T, H, D]) over its D dims, in place.

    The rounding of Qwen3's (and HF's) RMSNorm, so that the fused op's native path equals the
    unfused torch norm bit for bit: normalise in float32, cast to x's dtype, then multiply by
    the weight (x's dtype).
    """
    xs = x.unflatten(-1, (-1, head_size)) if x.ndim == 2 else x  # [T, H, D] view
    xf = xs.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [T, H, D] fp32
    xs.copy_(weight * xf.to(x.dtype))
