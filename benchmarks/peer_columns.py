"""The peer columns of bench_rope_kv.py: each peer kernel (peers.py) wired to a benchmark Case,
and checked against ours on fresh inputs with poisoned caches before it is timed.

  sglang   SGLang's fused RoPE + K/V store (bf16 cache, full rotary): must equal ours
  sglang_rope  SGLang's RoPE alone (eager table): q and k must equal ours
  fi_rope  FlashInfer's RoPE alone, no cache write (bf16 cache tables): q and k must equal ours
  fi_fp8   FlashInfer's RoPE + fp8 quantisation of q, K, V + paged append (fp8 e4m3 table, full
           rotary): q (fp8, out of place), K and V within one fp8 step of ours
"""

from __future__ import annotations

import peers
import torch


def _views(c, i):
    """Input set i as [T, H, D] views of the packed qkv rows, plus positions and slots: made
    once per set (the eager table times the peer's call, as ours, not the making of views)."""
    made = c.__dict__.setdefault("_peer_views", {})
    j = i % c.nsets
    views = made.get(j)
    if views is None:
        pos, q, k, v, loc = c.split(j)
        t, d = q.shape[0], c.d
        views = made[j] = (pos, q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d), loc)
    return views


def _poison(*bufs):
    for b in bufs:  # NaN: 0x7F is NaN in e4m3fn, fill_ covers the 16/32-bit dtypes
        b.view(torch.uint8).fill_(0x7F) if b.element_size() == 1 else b.fill_(float("nan"))


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> float:
    """Largest |a - b| / (rel * max(|a|, |b|) + 1e-2): <= 1 passes; NaN (unwritten) fails."""
    a, b = a.float(), b.float()
    return ((a - b).abs() / (rel * torch.maximum(a.abs(), b.abs()) + 1e-2)).max().item()


def _sglang(c):
    fn = peers.sglang_fused(c.neox, c.rot, torch.bfloat16)
    kc, vc = c.kb.view(c.kb.shape[0], -1), c.vb.view(c.vb.shape[0], -1)  # [slots, Hkv * D]

    def call(i):
        pos, q, k, v, loc = _views(c, i)
        fn(pos, q, k, v, c.cs, kc, vc, loc)

    def outputs():  # written in place, into the same buffers as ours
        pos, q, k, v, loc = _views(c, 0)
        return q, k, c.kb[loc], c.vb[loc]

    return call, outputs, outputs, 1e-2


def _rope_only(c, fn):
    """A peer's in-place RoPE (no cache write): fn(pos, q, k, cos_sin)."""

    def call(i):
        pos, q, k, v, loc = _views(c, i)
        fn(pos, q, k, c.cs)

    def outputs():  # in place, as ours
        pos, q, k, v, loc = _views(c, 0)
        return q, k

    return call, outputs, outputs, 1e-2


def _sglang_rope(c):
    return _rope_only(c, peers.sglang_rope(c.neox, c.rot, torch.bfloat16))


def _fi_rope(c):
    return _rope_only(c, peers.flashinfer_rope(c.neox))


def _fi_fp8(c):
    fn = peers.flashinfer_fp8_append(c.neox, c.k_scale.item(), c.kb, c.vb, c.t)
    locs = [s[2].to(torch.int32) for s in c.sets]
    q_out = torch.empty(c.t, c.hq, c.d, dtype=c.kb.dtype, device=c.kb.device)

    def call(i):
        pos, q, k, v, loc = _views(c, i)
        fn(pos, q, k, v, c.cs, locs[i % c.nsets], q_out)

    # FlashInfer: q to fp8 in q_out, k untouched; ours: q and k rotated in place (bf16)
    def outputs():
        pos, q, k, v, loc = _views(c, 0)
        return q_out, c.kb[loc], c.vb[loc]

    def ours():
        pos, q, k, v, loc = _views(c, 0)
        return q, c.kb[loc], c.vb[loc]

    return call, outputs, ours, 0.13  # one e4m3 step is 2^-3 relative


_UNAVAILABLE: set[str] = set()  # peers that failed to build or load: reported once


def peer_columns(c, kv_dtype: str, rope_only: bool = False) -> dict:
    """{column: fn(i)} for the peers that cover this case, load here, and agree with ours.
    rope_only: also SGLang's RoPE alone (`sglang_rope`, the eager table)."""
    wanted = []
    if kv_dtype == "bf16":
        wanted += [("sglang", _sglang)] if c.rot == c.d else []
        wanted += [("sglang_rope", _sglang_rope)] if rope_only else []
        wanted.append(("fi_rope", _fi_rope))
    elif kv_dtype == "fp8_e4m3" and c.rot == c.d:
        wanted.append(("fi_fp8", _fi_fp8))
    cols = {}
    for name, make in wanted:
        if name in _UNAVAILABLE:
            continue
        try:
            call, outputs, ours, rel = make(c)
        except Exception as err:  # PeerUnavailable, or a build/load failure of the peer
            print(f"# {name} unavailable: {str(err).splitlines()[0][:200]}")
            _UNAVAILABLE.add(name)
            continue
        # Fresh inputs (timed replays rotate q/k in place with random cos/sin rows until they
        # overflow), the same for ours and the peer, and poisoned caches.
        qkv = c.sets[0][0]
        fresh = torch.randn_like(qkv)
        got = []
        for run, read in ((c.fused, ours), (call, outputs)):
            qkv.copy_(fresh)
            _poison(c.kb, c.vb)
            run(0)
            got.append([x.float() for x in read()])
        err = max(_close(a, b, rel) for a, b in zip(*got, strict=True))
        if not err <= 1.0:
            print(f"# {name} disagrees with ours (error {err:.3g} of its tolerance); not timed")
            continue
        print(f"# {name} agrees with ours (error {err:.3g} of its tolerance {rel})")
        cols[name] = call
    return cols
