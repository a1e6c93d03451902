"""A randomised sweep of the fused RoPE + KV write (and the q/k-norm op) against float64.

    python -m tests.sgl_ext.rope_kv_sweep [--cases N] [--seed S] [--rows] [--tokens T ...]

Each case draws fresh inputs (separate q / k / v tensors or strided views of one qkv row),
poisons the cache, runs the op once and checks, on the device:
- q and k against a float64 reference (dtype tolerances);
- every written K and V cache row bit for bit against quantize(the key as returned, V), and
  every other cache element still poisoned;
- the dequantised K row against the float64 rotated key (what fp8 rounding allows), so that a
  failure says which of the two a wrong row breaks.
A failing case prints every wrong row: its token, slot, head, the bytes stored and expected, the
input and the reference. `--rows` runs every row of every launch table (all GPUs' rows, forced
through SGL_EXT_TRITON_CONFIG) at both ends of its token range. The GPU tests in
test_launch_rows.py run the same checks; this module is the long sweep (`gpu_run.sh sweep`).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from dataclasses import dataclass

import torch

import sgl_ext
from sgl_ext import FusedSetKVBufferArg, settings
from tests.sgl_ext.sgl_ext_testutil import (
    FP8,
    TOL,
    bits,
    make_cos_sin_cache,
    make_kv_buffers,
    quant_ref,
    rope_ref,
    write_slots,
)

EPS = 1e-6
# What fp8 rounding allows between a dequantised cache value and the float64 key: half an ulp
# (2^-4 of e4m3's 3 mantissa bits, 2^-3 of e5m2's 2), doubled for margin; atol for the
# subnormal range.
FP8_TOL = {torch.float8_e4m3fn: (0.13, 0.02), torch.float8_e5m2: (0.26, 0.02)}


@dataclass(frozen=True)
class SweepCase:
    """One call's shapes and options (inputs are drawn from `seed`)."""

    num_tokens: int
    dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype | None = None  # None: the dtype of key
    layout: str = "nhd"  # sgl_ext_testutil.LAYOUTS
    page_size: int = 16
    neox: bool = True
    head_dim: int = 128
    rot_dim: int = 128
    hq: int = 8
    hkv: int = 2
    scale: str = "none"  # none | float | tensor
    loc_dtype: torch.dtype = torch.int64
    separate: bool = False  # q, k, v separate tensors (else strided views of one qkv row)
    skip: float = 0.2  # fraction of tokens whose slot is -1
    qk_norm: bool = False  # the q/k-norm op instead of the RoPE op
    config: str | None = None  # SGL_EXT_TRITON_CONFIG for this case
    seed: int = 0

    def short(self) -> str:
        kv = str(self.kv_dtype or self.dtype).replace("torch.", "")
        return (
            f"T={self.num_tokens} {str(self.dtype).replace('torch.', '')}->{kv} "
            f"{self.layout}/ps{self.page_size} {'neox' if self.neox else 'gptj'} "
            f"D={self.head_dim} rot={self.rot_dim} hq={self.hq} hkv={self.hkv} "
            f"scale={self.scale} loc={str(self.loc_dtype).replace('torch.', '')} "
            f"{'separate' if self.separate else 'qkv-views'} skip={self.skip}"
            f"{' qk_norm' if self.qk_norm else ''} config={self.config} seed={self.seed}"
        )


def _norm_ref(x: torch.Tensor, w: torch.Tensor, d: int) -> torch.Tensor:
    xs = x.double().reshape(x.shape[0], -1, d)  # [T, H, D]
    return xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def _slots(gen: torch.Generator, c: SweepCase, num_slots: int) -> torch.Tensor:
    """Distinct slots, a `skip` fraction of them -1."""
    loc = torch.randperm(num_slots, generator=gen)[: c.num_tokens]
    loc[torch.rand(c.num_tokens, generator=gen) < c.skip] = -1
    return loc.to(c.loc_dtype)


def run_case(c: SweepCase, device: str | torch.device = "cuda") -> str | None:
    """Run one case; None if everything holds, else a report of what is wrong."""
    gen = torch.Generator().manual_seed(c.seed)
    t, d, rot, hq, hkv = c.num_tokens, c.head_dim, c.rot_dim, c.hq, c.hkv
    kv_dtype = c.kv_dtype or c.dtype
    max_pos = 4096
    pos = torch.randint(0, max_pos, (t,), generator=gen).to(device)
    cs = make_cos_sin_cache(max_pos, rot).to(device)
    width = (hq + 2 * hkv) * d
    qkv = torch.randn(t, width, generator=gen, dtype=torch.float32).to(device)
    if c.qk_norm:  # heads of varied scale and offset: the norm has something to do
        qkv = qkv * (torch.rand(1, width, generator=gen).to(device) * 4 + 0.25) + 0.3
    qkv = qkv.to(c.dtype)
    orig = qkv.clone()
    if c.separate:
        q, k, v = (x.contiguous() for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    else:
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views of qkv
    page = c.page_size if c.layout in ("nhd", "hnd", "cross") else 1
    num_slots = -(-(t + t // 4 + 3) // page) * page
    loc = _slots(gen, c, num_slots).to(device)
    written = loc >= 0
    ks: object
    vs: object
    if c.scale == "float":
        ks, vs = 0.5, 0.25
    elif c.scale == "tensor":
        ks = torch.tensor([0.61], device=device)
        vs = torch.tensor(2.3, device=device)
    else:
        ks = vs = None
    qw = (torch.randn(d, generator=gen) * 0.3 + 1.0).to(c.dtype).to(device)
    kw = (torch.randn(d, generator=gen) * 0.3 + 1.0).to(c.dtype).to(device)
    bases, views = make_kv_buffers(c.layout, num_slots, hkv, d, d, kv_dtype, device, page)
    expected = tuple(b.clone() for b in bases)
    kb, vb = views(bases)
    arg = FusedSetKVBufferArg(v, kb, vb, ks, vs, loc)
    with settings.override(triton_config=c.config or None):
        if c.qk_norm:
            sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(
                pos, q, k, d, cs, qw, kw, EPS, c.neox, arg
            )
        else:
            sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, cs, c.neox, arg)
    o_q, o_k, o_v = orig.split([hq * d, hkv * d, hkv * d], dim=-1)
    if c.qk_norm:
        o_q, o_k = _norm_ref(o_q, qw, d), _norm_ref(o_k, kw, d)
    q_ref = rope_ref(pos, o_q, d, cs, c.neox)  # [T, Hq, D] f64
    k_ref = rope_ref(pos, o_k, d, cs, c.neox)  # [T, Hkv, D] f64
    problems = []
    tol = TOL[c.dtype]
    for name, got, ref in (("query", q, q_ref), ("key", k, k_ref)):
        got = got.reshape(ref.shape).double()
        bad = (got - ref).abs() > tol * 4 + tol * ref.abs()
        if bad.any():
            problems.append(f"{name}: {int(bad.sum())} elements off the float64 reference")
    if not torch.equal(bits(v.reshape(t, -1)), bits(o_v)):
        problems.append("value changed")
    ek, ev = views(expected)
    sel = written.nonzero().squeeze(1)
    k_rows = k.reshape(t, hkv, d)[sel]  # the key as returned
    write_slots(ek, loc[sel], quant_ref(k_rows, kv_dtype, ks))
    write_slots(ev, loc[sel], quant_ref(v.reshape(t, hkv, d)[sel], kv_dtype, vs))
    for name, got, exp in zip("KV", (kb, vb), views(expected), strict=True):
        if not torch.equal(bits(got), bits(exp)):
            problems.append(_row_report(name, got, exp, loc, k_ref, k, ks, kv_dtype, pos))
    if c.kv_dtype in FP8:  # the dequantised K against the float64 key (what a looser check sees)
        rtol, atol = FP8_TOL[c.kv_dtype]
        s = ks if isinstance(ks, float) else (ks.item() if ks is not None else 1.0)
        got = _rows(kb, loc[sel]).double() * s
        ref = k_ref[sel]
        # plus the key's own tolerance: a rotation that cancels two large inputs leaves their
        # 16-bit rounding as an absolute error (the q/k norm makes single dims up to sqrt(D))
        off = (got - ref).abs() - (atol + 4 * tol + (rtol + tol) * ref.abs())
        if (off > 0).any():
            problems.append(f"dequantised K off the float64 key by up to {off.max().item():.3g}")
    return "; ".join(problems) if problems else None


def _rows(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buf's [n, H, D] rows at logical slots (any layout of make_kv_buffers), as float32."""
    s = slots.long()
    if buf.ndim == 2:
        return buf[s].float().reshape(len(s), -1, 1)
    if buf.ndim == 3:
        return buf[s].float()
    return buf[s // buf.shape[1], s % buf.shape[1]].float()


def _row_report(name, got, exp, loc, k_ref, k_out, ks, kv_dtype, pos) -> str:
    """Which cache rows differ, and how: the first few elements of each, bits and values."""
    g, e = bits(got), bits(exp)
    pages = got.ndim == 4
    diff = (g != e).nonzero()
    lines = [f"{name} cache: {len(diff)} elements differ"]
    seen = set()
    for idx in diff.tolist():
        slot = idx[0] * got.shape[1] + idx[1] if pages else idx[0]
        head = idx[2] if pages else (idx[1] if got.ndim == 3 else None)
        if (slot, head) in seen:
            continue
        seen.add((slot, head))
        if len(seen) > 6:
            lines.append("...")
            break
        toks = (loc.long() == slot).nonzero().flatten().tolist()
        el = tuple(idx)
        line = (
            f"  slot {slot} head {head} elem {el}: got {int(g[el]) & 0xFF:#04x} "
            f"({got[el].float().item():.5g}) want {int(e[el]) & 0xFF:#04x} "
            f"({exp[el].float().item():.5g}); tokens with this slot {toks}"
        )
        if name == "K" and len(toks) == 1 and head is not None:
            dim = idx[-1]
            line += (
                f"; pos {int(pos[toks[0]])}; key returned "
                f"{k_out.reshape(k_ref.shape)[toks[0], head, dim].item():.6g}, float64 "
                f"{k_ref[toks[0], head, dim].item():.6g}, scale {ks}, cache {kv_dtype}"
            )
        lines.append(line)
    return "\n".join(lines)


def table_rows() -> list[tuple[str, str, int, int, tuple[int, ...], bool]]:
    """Every row of every launch table, any GPU's: (name, tuning string, first T, last T,
    head sizes, whether it is a q/k-norm row). launch_config's own (H100) layouts are listed
    by the T and D that select them."""
    from sgl_ext.triton import rope_kv_plan as rp

    out: dict[str, tuple[str, str, int, int, tuple[int, ...], bool]] = {}

    def add(name, cfg, first, last, dims, norm):
        s = rp.tuning_string(cfg)
        out.setdefault(f"{s}|{norm}", (name, s, first, last, dims, norm))

    bounds = (1, 8, 9, 64, 65, 384, 385, 416, 417, 704, 705, 896, 897, 1024, 1025, 32768)
    for d in (64, 128):
        for fp8 in (False, True):
            for t in bounds:
                add(
                    f"launch_config T={t} D={d} fp8={fp8}",
                    rp.launch_config(t, 64, d, fp8),
                    t,
                    t,
                    (d,),
                    False,
                )
    for tname, table in (("rope_kv", rp.rope_kv_table()), ("qk_norm", rp.qk_norm_table())):
        norm = tname == "qk_norm"
        sections = {"": table.rows, **{f"[{gpu}]": rows for gpu, rows in table.devices.items()}}
        for gpu, rows in sections.items():
            for r in rows:
                if r.config is not None:
                    last = min(r.last or 32768, 32768)
                    dims = (r.head_dim or 64,)
                    add(
                        f"{tname}{gpu} D={dims[0]} {r.first}..{last}",
                        r.config,
                        r.first,
                        last,
                        dims,
                        norm,
                    )
    return list(out.values())


def row_cases(kv_dtypes=(None, torch.float8_e4m3fn, torch.float8_e5m2), max_tokens=32768):
    """SweepCases for every table row at both ends of its token range (capped at max_tokens),
    on each cache dtype: the row's heads and a case with partial rotary, GPT-J and page 1."""
    cases = []
    for i, (_, cfg, first, last, dims, norm) in enumerate(table_rows()):
        ts = sorted({min(first, max_tokens), min(last, max_tokens)})
        for t in ts:
            for j, kv in enumerate(kv_dtypes):
                d = dims[0]
                cases.append(
                    SweepCase(
                        t,
                        kv_dtype=kv,
                        head_dim=d,
                        rot_dim=d,
                        hq=32,
                        hkv=8,
                        scale="tensor" if kv else "none",
                        qk_norm=norm,
                        config=cfg,
                        seed=1000 * i + 10 * t + j,
                    )
                )
                cases.append(
                    SweepCase(
                        t,
                        kv_dtype=kv,
                        head_dim=d,
                        rot_dim=d // 2,
                        neox=False,
                        hq=4,
                        hkv=4,
                        layout="nhd",
                        page_size=1,
                        scale="float" if kv else "none",
                        loc_dtype=torch.int32,
                        separate=True,
                        qk_norm=norm,
                        config=cfg,
                        seed=1000 * i + 10 * t + j + 5,
                    )
                )
    return cases


# Token counts at and around every launch-table bound.
SWEEP_TOKENS = (1, 2, 7, 8, 9, 24, 25, 31, 32, 33, 64, 65, 257, 384, 385, 416, 417, 704, 705)
SWEEP_TOKENS += (896, 897, 1024, 1025, 1100, 2048, 4097, 32768)


def random_case(rng: random.Random, t: int, seed: int) -> SweepCase:
    kv = rng.choice([None, torch.float8_e4m3fn, torch.float8_e5m2])
    d = rng.choice([64, 128])
    layout = rng.choice(["nhd", "hnd", "token"])
    hq, hkv = rng.choice([(4, 4), (8, 2), (32, 8), (64, 8), (7, 1)])
    return SweepCase(
        t,
        dtype=rng.choice([torch.bfloat16, torch.bfloat16, torch.float16]),
        kv_dtype=kv,
        layout=layout,
        page_size=rng.choice([1, 16]) if layout != "token" else 1,
        neox=rng.random() < 0.5,
        head_dim=d,
        rot_dim=rng.choice([d, d // 2]),
        hq=hq,
        hkv=hkv,
        scale=rng.choice(["float", "tensor"]) if kv else rng.choice(["none", "float"]),
        loc_dtype=rng.choice([torch.int32, torch.int64]),
        separate=rng.random() < 0.5,
        qk_norm=d == 128 and rng.random() < 0.25,
        seed=seed,
    )


def bisect(c: SweepCase, device: str, n: int = 10) -> None:
    """Run a failing case again n times as it was and under variants that each take one
    mechanism away; print how often each fails."""
    variants = {
        "as is": {},
        "no PDL": {"pdl": False},
        "no direct / C launch": {"direct_launch": False, "fast_launch": False},
        "native": {"backend": "native"},
    }
    for name, fields in variants.items():
        with settings.override(**fields):
            bad = sum(run_case(c, device) is not None for _ in range(n))
        print(f"  bisect {name}: {bad}/{n} failed", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=8, help="random cases per token count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens", type=int, nargs="*", default=list(SWEEP_TOKENS))
    p.add_argument("--rows", action="store_true", help="also every launch-table row, forced")
    p.add_argument("--repro", type=int, default=0, help="seeds of issue 51's case")
    p.add_argument("--shard", default="0/1", help="i/n: run every n-th case from the i-th")
    p.add_argument("--max-tokens", type=int, default=32768, help="cap for --rows")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = random.Random(a.seed)
    cases = []
    for t in a.tokens:
        n = a.cases if t <= 4097 else max(2, a.cases // 4)
        cases += [random_case(rng, t, a.seed * 100003 + 1000 * t + i) for i in range(n)]
    if a.rows:
        cases += row_cases(max_tokens=a.max_tokens)
    if a.repro:  # issue 51's case (H200): GPT-J, D 64 rot 32, e5m2 page 1, int32 slots
        base = SweepCase(
            1100,
            kv_dtype=torch.float8_e5m2,
            head_dim=64,
            rot_dim=32,
            neox=False,
            hq=4,
            hkv=4,
            page_size=1,
            scale="float",
            loc_dtype=torch.int32,
            separate=True,
        )
        cases += [dataclasses.replace(base, seed=s) for s in range(a.repro)]
    shard, shards = (int(x) for x in a.shard.split("/"))
    cases = cases[shard::shards]
    failed = 0
    for i, c in enumerate(cases):
        report = run_case(c, device)
        if report:
            failed += 1
            print(f"FAIL {c.short()}\n{report}", flush=True)
            if failed <= 3:
                bisect(c, device)
        if (i + 1) % 100 == 0:
            print(f"{i + 1}/{len(cases)} cases, {failed} failed", flush=True)
    if device == "cuda":
        torch.cuda.synchronize()
    print(
        f"rope_kv sweep on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}: "
        f"{len(cases)} cases, {failed} failed"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
