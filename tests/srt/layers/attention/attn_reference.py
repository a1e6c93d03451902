"""Shared attention-backend checks: float64 reference and a prefill+extend+decode scenario."""

from __future__ import annotations

import math

import torch

from srt.layers.radix_attention import RadixAttention
from tests.srt.models.fb_harness import Harness, make_kv_pool


def ref_attention(q, k, v, q_pos, scaling, window=-1, cap=0.0, sinks=None):
    """float64 reference. q [n, Hq, D] at positions q_pos [n]; k/v [L, Hkv, D] at 0..L-1."""
    q, k, v = q.double(), k.double(), v.double()
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, dim=1)  # [L, Hq, D]
    v = v.repeat_interleave(G, dim=1)
    s = torch.einsum("qhd,lhd->hql", q, k) * scaling  # [Hq, n, L]
    if cap > 0:
        s = cap * torch.tanh(s / cap)
    j = torch.arange(k.shape[0])
    mask = j[None, :] <= q_pos[:, None]
    if window >= 0:
        mask &= j[None, :] >= q_pos[:, None] - window
    s = s.masked_fill(~mask[None], -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(-1, s.shape[1], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., : k.shape[0]]
    return torch.einsum("hql,lhd->qhd", p, v)  # [n, Hq, Dv]


def quant(x, dtype, scale):
    """What an fp8 cache returns after dequantisation."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x
    s = 1.0 if scale is None else float(scale)
    fmax = torch.finfo(dtype).max
    return (x.float() / s).clamp(-fmax, fmax).to(dtype).float() * s


def run_scenario(
    make_backend,
    *,
    page_size=1,
    hq=4,
    hkv=2,
    d=16,
    window=-1,
    cap=0.0,
    use_sinks=False,
    kv_dtype=torch.float32,
    scale=None,
    dtype=torch.float32,
    device="cpu",
    save_kv=True,
    seed=0,
    atol=None,
    pool_kw=None,
):
    """Two requests: prefill (7 and 1 tokens), an extend chunk (3 and 5), 3 decode steps.

    Checks every output against ref_attention over the request's full K/V history.
    """
    g = torch.Generator().manual_seed(seed)
    pool = make_kv_pool(256, page_size, kv_dtype, hkv, d, 2, device, **(pool_kw or {}))
    backend = make_backend()
    h = Harness(pool, backend, max_reqs=4, max_ctx=64, device=device)
    sinks = torch.randn(hq, generator=g).to(device) if use_sinks else None
    layer = RadixAttention(
        hq,
        d,
        d**-0.5,
        hkv,
        1,
        sliding_window_size=window,
        logit_cap=cap,
        sinks=sinks,
        k_scale=scale,
        v_scale=scale,
    )
    rows = [2, 0]
    hist_k = {r: [] for r in rows}
    hist_v = {r: [] for r in rows}
    atol = atol or (2e-5 if dtype == torch.float32 else 2e-2)
    if kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        atol = max(atol, 2e-5)

    def step(fb, lens):
        T = sum(lens)
        q = torch.randn(T, hq * d, generator=g).to(device, dtype)
        k = torch.randn(T, hkv * d, generator=g).to(device, dtype)
        v = torch.randn(T, hkv * d, generator=g).to(device, dtype)
        if not save_kv:  # the fused path: the cache is written beforehand, by someone else
            pool.set_kv_buffer(layer, fb.out_cache_loc, k, v, scale, scale)
            before = [b.clone() for b in (pool.get_key_buffer(1), pool.get_value_buffer(1))]
        out = layer(q, k if save_kv else None, v if save_kv else None, fb, save_kv_cache=save_kv)
        if not save_kv:
            for b, a in zip(
                before, (pool.get_key_buffer(1), pool.get_value_buffer(1)), strict=True
            ):
                assert torch.equal(b.view(torch.uint8), a.view(torch.uint8)), "cache written"
        assert out.shape == (T, hq * d) and out.dtype == dtype
        start = 0
        for r, n in zip(rows, lens, strict=True):
            hist_k[r].append(quant(k[start : start + n].view(n, hkv, d).cpu(), kv_dtype, scale))
            hist_v[r].append(quant(v[start : start + n].view(n, hkv, d).cpu(), kv_dtype, scale))
            kk, vv = torch.cat(hist_k[r]), torch.cat(hist_v[r])
            L = kk.shape[0]
            qp = torch.arange(L - n, L)
            ref = ref_attention(
                q[start : start + n].view(n, hq, d).cpu(),
                kk,
                vv,
                qp,
                d**-0.5,
                window,
                cap,
                None if sinks is None else sinks.cpu(),
            )
            got = out[start : start + n].view(n, hq, d).cpu().double()
            torch.testing.assert_close(got, ref, atol=atol, rtol=atol)
            start += n

    step(h.extend(rows, [[1] * 7, [2]]), [7, 1])
    step(h.extend(rows, [[1] * 3, [2] * 5]), [3, 5])
    for _ in range(3):
        step(h.decode(rows, [3, 4]), [1, 1])
    return pool
