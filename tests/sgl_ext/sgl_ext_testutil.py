"""Float64 references and builders shared by the sgl_ext tests (independent of sgl_ext.native)."""

from __future__ import annotations

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def make_cos_sin_cache(max_pos: int, rot: int, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)  # [rot/2]
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]  # [P, rot/2]
    return torch.cat((ang.cos(), ang.sin()), dim=-1).float()  # [P, rot]


def rope_ref(
    positions: torch.Tensor, x: torch.Tensor, head_size: int, cs: torch.Tensor, neox: bool
) -> torch.Tensor:
    """Float64 RoPE through complex multiplication; x [T, H*D] or [T, H, D] -> [T, H, D] f64."""
    xs = x.double().reshape(x.shape[0], -1, head_size)  # [T, H, D]
    rot = cs.shape[1]
    half = rot // 2
    c = cs.double()[positions.long()]  # [T, rot]
    w = torch.complex(c[:, :half], c[:, half:])[:, None, :]  # [T, 1, rot/2]
    xr = xs[..., :rot]
    if neox:
        z = torch.complex(xr[..., :half], xr[..., half:]) * w
        out = torch.cat((z.real, z.imag), dim=-1)
    else:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2]) * w
        out = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    return torch.cat((out, xs[..., rot:]), dim=-1)


def quant_ref(x: torch.Tensor, buf_dtype: torch.dtype, scale) -> torch.Tensor:
    """What the cache must hold for x: fp32 multiply by the fp32 reciprocal, saturate, cast."""
    if scale is None and buf_dtype == x.dtype:
        return x.clone()
    y = x.float()
    if scale is not None:
        s = scale.float().reshape(()) if isinstance(scale, torch.Tensor) else torch.tensor(scale)
        y = y * (1.0 / s.to(device=y.device, dtype=torch.float32))
    if buf_dtype in FP8:  # finite values saturate; NaN stays; inf: e5m2 inf, e4m3fn NaN
        m = torch.finfo(buf_dtype).max
        inf_out = y if buf_dtype == torch.float8_e5m2 else torch.full_like(y, float("nan"))
        y = torch.where(y.isinf(), inf_out, y.clamp(-m, m))
    return y.to(buf_dtype)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with a NaN bit pattern (0xFF bytes is NaN for every float dtype used here)."""
    t.view(torch.uint8).fill_(0xFF) if t.is_contiguous() else t.copy_(
        torch.full_like(t, float("nan"))
    )
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    """A same-shape integer view for exact (bitwise, NaN-safe) comparison."""
    return t.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def _layout_views(layout: str, bases: tuple[torch.Tensor, ...], layer: int):
    if layout == "token":
        return bases
    if layout == "flat":
        return tuple(b.flatten(1) for b in bases)
    if layout == "nhd":
        return bases
    if layout == "hnd":
        return tuple(b.permute(0, 2, 1, 3) for b in bases)
    if layout == "cross":
        return bases[0][:, layer, 0], bases[0][:, layer, 1]
    raise ValueError(layout)


LAYOUTS = ("token", "flat", "nhd", "hnd", "cross")


def make_kv_buffers(
    layout: str,
    num_slots: int,
    heads: int,
    d: int,
    dv: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    page_size: int = 4,
    layers: int = 3,
    layer: int = 1,
):
    """Poisoned KV buffers in a layout. Returns (bases, views_fn) with views_fn(bases) -> (k, v).

    layouts: "token" [S, H, D], "flat" [S, H*D], "nhd" [P, ps, H, D], "hnd" [P, H, ps, D] passed
    permuted to [P, ps, H, D], "cross" one layer of [P, layers, 2, ps, H, D] (requires d == dv).
    """
    pages = num_slots // page_size
    if layout in ("token", "flat"):
        shapes = [(num_slots, heads, d), (num_slots, heads, dv)]
    elif layout == "nhd":
        shapes = [(pages, page_size, heads, d), (pages, page_size, heads, dv)]
    elif layout == "hnd":
        shapes = [(pages, heads, page_size, d), (pages, heads, page_size, dv)]
    elif layout == "cross":
        assert d == dv
        shapes = [(pages, layers, 2, page_size, heads, d)]
    else:
        raise ValueError(layout)
    bases = tuple(poison(torch.empty(s, dtype=dtype, device=device)) for s in shapes)
    return bases, lambda b: _layout_views(layout, b, layer)


def write_slots(buf: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """buf[logical slot] = rows ([n, H, D]) for a buffer view of any layout above."""
    slots = slots.long()
    if buf.dtype in FP8:
        buf, rows = buf.view(torch.uint8), rows.view(torch.uint8)
    if buf.ndim == 2:
        buf[slots] = rows.flatten(1)
    elif buf.ndim == 3:
        buf[slots] = rows
    else:
        ps = buf.shape[1]
        buf[slots // ps, slots % ps] = rows


def run_compile_script(code: str) -> None:
    """Run a script of real (not interpreted) Triton compiles in a fresh interpreter with the
    repository on the path, and assert it printed "compiled" (the interpreter misses front-end
    errors that fail the sm_90 compile)."""
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.path.abspath(root)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "compiled" in out.stdout
